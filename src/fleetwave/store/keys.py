"""Rows looked up by a composite key: "any of these (step, key) pairs".

SQLite does not use an index for a row value ``IN`` list: ``(a, b) IN (VALUES ...)``
scans the whole table, so a lookup's cost grew with every row ever stored (a batch of
callbacks read the idempotency keys of all the callbacks before it; issuing agent
tokens scanned every token issued). Here the pairs go as one JSON array, joined to the
table through ``json_each``: one probe of the composite index a pair, and one
statement whatever the number of pairs (an ``OR`` of equalities, also indexed, is a
new statement to build and compile for each count). PostgreSQL plans the row value
list as a join with the list's known size and uses the index, so it keeps it.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from sqlalchemy import ColumnElement, Connection, Table, and_, func, select, tuple_
from sqlalchemy.sql.elements import ColumnClause

#: pairs in one statement at most
CHUNK = 500


def any_of(
    conn: Connection,
    table: Table,
    columns: Sequence[ColumnClause[object]],
    values: Sequence[tuple[object, ...]],
) -> ColumnElement[bool]:
    """A condition that a row of ``table`` has its ``columns`` equal to one of the
    ``values`` (at most :data:`CHUNK`), in a form the database looks up in an index on
    them. ``table`` has an ``id`` primary key."""
    if len(values) > CHUNK:
        raise ValueError(f"{len(values)} keys in one lookup, at most {CHUNK}")
    if conn.dialect.name == "postgresql":
        return tuple_(*columns).in_(list(values))
    pairs = func.json_each(json.dumps(list(values))).table_valued("value").alias("wanted")
    on = and_(*(c == func.json_extract(pairs.c.value, f"$[{i}]") for i, c in enumerate(columns)))
    return table.c.id.in_(select(table.c.id).select_from(pairs.join(table, on)))
