"""PostgreSQL's group commit sends each statement's rows as arrays (one statement): what
it writes, and which rows its compare-and-set lets through, are those of sending the
same rows one at a time."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import add_sim_targets, applied
from fleetwave.domain.models import STEP_INITIAL
from fleetwave.store import queries
from fleetwave.store import runtime as rt
from fleetwave.store.arrays import ArrayStatement
from fleetwave.store.db import Store
from fleetwave.testing.invariants import check

CAS_SQL = (
    "UPDATE cas SET state=%s, fence=%s, note=COALESCE(%s, note), at=%s "
    "WHERE id=%s AND state=%s AND fence=%s AND (owner=%s OR %s)"
)
CAS_TYPES = ("text", "int4", "text", "float8", "int4", "text", "int4", "text", "bool")
INSERT_SQL = "INSERT INTO log (id, state, at, n) VALUES (%s, %s, %s, 1)"


def test_statements_are_rewritten_placeholder_for_column() -> None:
    s = ArrayStatement(CAS_SQL, CAS_TYPES, (4,), by="id")
    assert s.sql.startswith("UPDATE cas SET state=u.c0, fence=u.c1, note=COALESCE(u.c2, note)")
    assert "FROM (SELECT (r.v->>0)::text AS c0, (r.v->>1)::int4 AS c1," in s.sql
    # (the rows looked up by their ids, an array: an index scan, not a hash of the table)
    assert s.sql.endswith(
        "WHERE id = ANY(%s::int4[]) AND id=u.c4 AND state=u.c5 AND fence=u.c6 AND "
        "(owner=u.c7 OR u.c8)"
    )
    i = ArrayStatement(INSERT_SQL, ("int4", "text", "float8"))
    assert i.sql == (
        "INSERT INTO log (id, state, at, n) SELECT u.c0, u.c1, u.c2, 1 FROM (SELECT "
        "(r.v->>0)::int4 AS c0, (r.v->>1)::text AS c1, (r.v->>2)::float8 AS c2 FROM "
        "jsonb_array_elements(%s::jsonb) AS r(v)) AS u"
    )
    # the rows as one JSON array; two rows of one key, or a time JSON cannot say: none
    row = ("a", 1, None, 2.5, 7, 'x"\\', 0, "c", True)
    assert s.arrays([row]) == '[["a", 1, null, 2.5, 7, "x\\"\\\\", 0, "c", true]]'
    assert s.arrays([row] * 2) is None
    assert i.arrays([(1, "a", float("inf")), (2, "b", 1.0)]) is None


@pytest.mark.parametrize(
    ("sql", "types", "why"),
    [
        ("UPDATE t SET a=%s", ("int4",), "without WHERE"),
        ("UPDATE t SET a=%s WHERE b=%s", ("int4",), "2 placeholders, 1 types"),
        ("DELETE FROM t WHERE a=%s", ("int4",), "neither an UPDATE nor an INSERT"),
        ("UPDATE t SET a=%s WHERE b=1", ("int2",), "unknown array type"),
        ("UPDATE t SET a=%s WHERE b=%s", ("int4", "text"), "one int4 key parameter"),
    ],
)
def test_a_statement_it_cannot_rewrite_is_refused(sql: str, types: tuple[str], why: str) -> None:
    with pytest.raises(ValueError, match=why):
        ArrayStatement(sql, types, (1,) if len(types) > 1 else (), by="b")


@pytest.fixture
def pg(pg_url: str) -> Iterator[Any]:
    import psycopg

    with psycopg.connect(pg_url, autocommit=True) as conn:
        for table in ("cas", "cas_rows"):
            conn.execute(
                f"CREATE TABLE {table} (id int PRIMARY KEY, state text NOT NULL, fence int "
                "NOT NULL, note text, at float8, owner text)"
            )
        yield conn


_row = st.tuples(
    st.sampled_from(["a", "b", "c"]),  # to state
    st.integers(0, 3),  # to fence
    st.one_of(st.none(), st.text("xy\"\\'é\n{},", max_size=4)),  # note (NULL: kept)
    st.one_of(st.integers(0, 5), st.floats(0, 5, allow_nan=False)),  # at
    st.integers(1, 6),  # id
    st.sampled_from(["a", "b"]),  # from state
    st.integers(0, 2),  # from fence
    st.sampled_from(["c1", "c2"]),  # owner
    st.booleans(),  # any owner
)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(rows=st.lists(_row, min_size=1, max_size=12))
def test_arrays_write_what_rows_one_at_a_time_write(pg: Any, rows: list[tuple[Any, ...]]) -> None:
    statement = ArrayStatement(CAS_SQL, CAS_TYPES, (4,), by="id")
    with pg.cursor() as cur:
        for table in ("cas", "cas_rows"):
            cur.execute(f"TRUNCATE {table}")
            cur.executemany(
                f"INSERT INTO {table} VALUES (%s, %s, %s, 'n', 0, %s)",
                [(i, "ab"[i % 2], i % 3, f"c{1 + i % 2}") for i in range(1, 7)],
            )
        written = statement.execute(cur, rows)
        cur.executemany(CAS_SQL.replace("UPDATE cas", "UPDATE cas_rows"), rows)
        one_by_one = cur.rowcount
        cur.execute("SELECT * FROM cas ORDER BY id")
        got = cur.fetchall()
        cur.execute("SELECT * FROM cas_rows ORDER BY id")
        assert got == cur.fetchall()
    assert written == one_by_one


class _Counting:
    """A cursor that counts the statements sent through it (executemany: one a row)."""

    def __init__(self, cur: Any) -> None:
        self.cur, self.sent = cur, 0

    def execute(self, sql: str, params: Any = None) -> Any:
        self.sent += 1
        return self.cur.execute(sql, params)

    def executemany(self, sql: str, rows: Any) -> Any:
        rows = list(rows)
        self.sent += len(rows)
        return self.cur.executemany(sql, rows)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.cur, name)


@pytest.mark.parametrize("dialect", ["postgresql"])
def test_a_commit_of_many_steps_is_a_few_statements(store: Store, dialect: str) -> None:
    add_sim_targets(store, 60)
    sid = applied(store, max_parallel=100)
    writer = rt.TransitionWriter(store, "c1")
    ids = [s["step"] for s in queries.list_steps(store, sid)]
    first = [rt.Transition(i, sid, STEP_INITIAL, 0, "pre-check", 1, "", 0) for i in ids]
    assert writer.commit(first[:1], [], 1.0).rejected == []
    writer._cur = counting = _Counting(writer._cur)
    result = writer.commit(first[1:], [], 2.0)
    assert result.rejected == [] and result.replaced == [] and result.deferred == []
    # 59 entries: the begin, the fence and unmanaged checks, one UPDATE, one journal
    # INSERT, the slots (one at a time, 59 UPDATEs and 59 INSERTs)
    assert counting.sent < 12
    assert {s["state"] for s in queries.list_steps(store, sid)} == {"pre-check"}
    # one row's compare-and-set fails (a stale fence): it alone is refused
    moves = [rt.Transition(i, sid, "pre-check", 1, "updating-patches", 2, "", 1) for i in ids]
    moves[5] = rt.Transition(ids[5], sid, "pre-check", 0, "updating-patches", 1, "", 1)
    result = writer.commit(moves, [], 3.0)
    assert [t.step_id for t in result.rejected] == [ids[5]]
    states = {s["step"]: s["state"] for s in queries.list_steps(store, sid)}
    assert states[ids[5]] == "pre-check"
    assert sum(1 for v in states.values() if v == "updating-patches") == 59
    assert check(store, sid).ok


@pytest.mark.parametrize("dialect", ["postgresql"])
def test_a_commit_looks_its_steps_up_by_index(store: Store, dialect: str) -> None:
    """Not by hashing every step of the table (PostgreSQL guesses a JSON array's rows
    at 100, and a hash join over the whole table looked cheaper: each commit then
    scanned every step)."""
    add_sim_targets(store, 3000)
    sid = applied(store, max_parallel=100)
    ids = [s["step"] for s in queries.list_steps(store, sid)][:100]
    writer = rt.TransitionWriter(store, "c1")
    enter = writer._arrays[writer._enter_sql]
    rows = [
        ("pre-check", 1, "", 1, "c1", 1.0, False, None, 1, i, STEP_INITIAL, 0, 1, "c1", False, True)
        for i in ids
    ]
    assert enter.arrays(rows) is not None
    raw = store.engine.raw_connection()
    try:
        cur = raw.cursor()
        cur.execute("ANALYZE steps")
        cur.execute(
            "EXPLAIN " + enter.sql,
            (enter.arrays(rows), "{" + ",".join(map(str, ids)) + "}"),
        )
        plan = "\n".join(r[0] for r in cur.fetchall())
    finally:
        raw.close()
    assert "Seq Scan on steps" not in plan, plan
    assert "steps_pkey" in plan, plan
