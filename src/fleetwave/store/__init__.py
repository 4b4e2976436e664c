"""Durable state: schema, migrations, queries. Dialect differences live in ``dialects``."""
