"""PostgreSQL: the rows of one hot-path statement sent as arrays, in one statement.

The writer's group commit writes each of its statements (a compare-and-set UPDATE of
``steps``, a journal INSERT, ...) for many rows. Sent a row at a time (``executemany``,
which psycopg pipelines), each row is a statement the server parses, plans and runs,
and the client binds apart, all while the commit holds the database's write lock. As
arrays, a column each, the same rows are one statement: ``UPDATE ... FROM unnest(...)``
or ``INSERT ... SELECT ... FROM unnest(...)``. What each row does is unchanged: every
placeholder of the row's statement becomes the matching column of the unnested row, so
the compare-and-set conditions are the same, checked row by row (see
``docs/benchmarks.md`` for the measured cost of both).

One UPDATE statement changes a table row at most once, whichever of the unnested rows
match it: rows of one commit that name the same table row (by :attr:`ArrayStatement.key`)
are sent one at a time instead, in order, as before.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

#: how a column's values are made uniform for their array (one element type each)
_COERCE: dict[str, Callable[[Any], Any]] = {
    "int4": int,
    "float8": float,
    "text": str,
    "bool": bool,
}


class ArrayStatement:
    """``sql`` (an ``UPDATE ... SET ... WHERE ...`` or ``INSERT ... VALUES (...)`` with
    ``%s`` placeholders) rewritten to take its rows as arrays: ``types`` gives each
    placeholder's array element type (a key of :data:`_COERCE`), ``key`` the positions
    of the parameters that name the table row an UPDATE changes."""

    def __init__(self, sql: str, types: Sequence[str], key: Sequence[int] = ()) -> None:
        parts = sql.split("%s")
        if len(parts) - 1 != len(types):
            raise ValueError(f"{len(parts) - 1} placeholders, {len(types)} types: {sql}")
        for t in types:
            if t not in _COERCE:
                raise ValueError(f"unknown array type {t!r}")
        names = [f"u.c{i}" for i in range(len(types))]
        body = parts[0] + "".join(n + p for n, p in zip(names, parts[1:], strict=True))
        source = (
            "unnest("
            + ", ".join(f"%s::{t}[]" for t in types)
            + ") AS u("
            + ", ".join(f"c{i}" for i in range(len(types)))
            + ")"
        )
        head = body.lstrip().upper()
        if head.startswith("UPDATE "):
            set_part, sep, where = body.partition(" WHERE ")
            if not sep:
                raise ValueError(f"an UPDATE without WHERE: {sql}")
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
        self._coerce = [_COERCE[t] for t in types]

    def arrays(self, rows: Sequence[Sequence[Any]]) -> list[list[Any]] | None:
        """The rows' columns as the statement's arrays; None when two rows name the same
        table row (they must then be sent one at a time, in order)."""
        if self.key:
            key = self.key
            seen = {tuple(row[i] for i in key) for row in rows}
            if len(seen) != len(rows):
                return None
        return [
            [None if v is None else f(v) for v in column]
            for f, column in zip(self._coerce, zip(*rows, strict=True), strict=True)
        ]

    def execute(self, cur: Any, rows: Sequence[Sequence[Any]]) -> int:
        """Write ``rows`` on ``cur``: as arrays (one statement) when it can be, else one
        at a time; how many table rows were written (``rowcount``)."""
        columns = self.arrays(rows) if len(rows) > 1 else None
        if columns is None:
            cur.executemany(self.row_sql, rows)
        else:
            cur.execute(self.sql, columns)
        return int(cur.rowcount)
