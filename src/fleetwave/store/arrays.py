"""PostgreSQL: the rows of one hot-path statement sent as arrays, in one statement.

The writer's group commit writes each of its statements (a compare-and-set UPDATE of
``steps``, a journal INSERT, ...) for many rows. Sent a row at a time (``executemany``,
which psycopg pipelines), each row is a statement the server parses, plans and runs,
and the client binds apart, all while the commit holds the database's write lock. Sent
as one JSON array of rows, the same rows are one statement: ``UPDATE ... FROM (SELECT
... FROM json_array_elements(...))`` or ``INSERT ... SELECT ... FROM
json_array_elements(...)``. (JSON, not a typed array a column: psycopg builds an array
parameter element by element in Python, which cost more than the statements it saved;
``json.dumps`` is one C call.) What each row does is unchanged: every placeholder of the
row's statement becomes the matching column of the row, so the compare-and-set
conditions are the same, checked row by row (see ``docs/benchmarks.md`` for the
measured cost of both).

One UPDATE statement changes a table row at most once, whichever of the unnested rows
match it: rows of one commit that name the same table row (by :attr:`ArrayStatement.key`)
are sent one at a time instead, in order, as before.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

#: the element types a column may have
TYPES = frozenset({"int4", "float8", "text", "bool"})


class ArrayStatement:
    """``sql`` (an ``UPDATE ... SET ... WHERE ...`` or ``INSERT ... VALUES (...)`` with
    ``%s`` placeholders) rewritten to take its rows as arrays: ``types`` gives each
    placeholder's element type (one of :data:`TYPES`), ``key`` the positions of the
    parameters that name the table row an UPDATE changes.

    ``by``: an UPDATE's integer column the key's one parameter matches (its primary
    key): the rows' values of it are sent again, as an array the statement looks the
    table's rows up by. Without it PostgreSQL estimates the JSON's rows at 100 and
    joins them by hashing the whole table (a scan of every step, each commit)."""

    def __init__(
        self, sql: str, types: Sequence[str], key: Sequence[int] = (), by: str | None = None
    ) -> None:
        parts = sql.split("%s")
        if len(parts) - 1 != len(types):
            raise ValueError(f"{len(parts) - 1} placeholders, {len(types)} types: {sql}")
        for t in types:
            if t not in TYPES:
                raise ValueError(f"unknown array type {t!r}")
        names = [f"u.c{i}" for i in range(len(types))]
        body = parts[0] + "".join(n + p for n, p in zip(names, parts[1:], strict=True))
        columns = ", ".join(f"(r.v->>{i})::{t} AS c{i}" for i, t in enumerate(types))
        source = f"(SELECT {columns} FROM jsonb_array_elements(%s::jsonb) AS r(v)) AS u"
        head = body.lstrip().upper()
        if head.startswith("UPDATE "):
            set_part, sep, where = body.partition(" WHERE ")
            if not sep:
                raise ValueError(f"an UPDATE without WHERE: {sql}")
            if by is not None:
                if len(key) != 1 or types[key[0]] != "int4" or not by.isidentifier():
                    raise ValueError(f"looked up by {by!r}: one int4 key parameter needed")
                where = f"{by} = ANY(%s::int4[]) AND {where}"
            self.sql = f"{set_part} FROM {source} WHERE {where}"
        elif head.startswith("INSERT "):
            into, sep, values = body.partition(" VALUES (")
            if not sep or not values.rstrip().endswith(")"):
                raise ValueError(f"an INSERT without one VALUES row: {sql}")
            self.sql = f"{into} SELECT {values.rstrip()[:-1]} FROM {source}"
        else:
            raise ValueError(f"neither an UPDATE nor an INSERT: {sql}")
        self.row_sql = sql
        self.types = tuple(types)
        self.key = tuple(key)
        self.by = by

    def arrays(self, rows: Sequence[Sequence[Any]]) -> str | None:
        """The rows as the statement's one parameter (a JSON array of them); None when
        two rows name the same table row (they must then be sent one at a time, in
        order)."""
        if self.key:
            key = self.key
            seen = {tuple(row[i] for i in key) for row in rows}
            if len(seen) != len(rows):
                return None
        try:
            return json.dumps(rows, allow_nan=False)
        except ValueError:  # (an infinite time: JSON has none; one at a time, then)
            return None

    def execute(self, cur: Any, rows: Sequence[Sequence[Any]]) -> int:
        """Write ``rows`` on ``cur``: as arrays (one statement) when it can be, else one
        at a time; how many table rows were written (``rowcount``)."""
        param = self.arrays(rows) if len(rows) > 1 else None
        if param is None:
            cur.executemany(self.row_sql, rows)
        elif self.by is None:
            cur.execute(self.sql, (param,))
        else:
            k = self.key[0]
            ids = "{" + ",".join([str(int(row[k])) for row in rows]) + "}"
            cur.execute(self.sql, (param, ids))
        return int(cur.rowcount)
