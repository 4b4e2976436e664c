"""The lookups by a composite key (a callback's step and idempotency key, an agent
token's step, state and visit) search their index, on both dialects: their cost does
not grow with every callback or token ever stored. (SQLite scans the whole table for a
row value ``IN`` list: the callback intake read every stored callback for each batch.)
"""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy import event, insert

from conftest import add_sim_targets, applied
from fleetwave.store import callbacks as cbs
from fleetwave.store import queries, tokens
from fleetwave.store.db import Store
from fleetwave.store.schema import agent_tokens, callbacks

pytestmark = pytest.mark.both_dialects

#: rows already stored: enough that a planner prefers the index when it can use one
STORED = 5000


def _statements(store: Store, tables: tuple[str, ...], run: Any) -> list[tuple[str, Any]]:
    """The statements ``run()`` sends that read or delete from one of ``tables``."""
    seen: list[tuple[str, Any]] = []

    def record(conn: Any, cursor: Any, sql: str, params: Any, context: Any, many: bool) -> None:
        head = sql.lstrip().upper()
        if head.startswith(("SELECT", "DELETE")) and any(f" {t}" in sql for t in tables):
            seen.append((sql, params))

    event.listen(store.engine, "before_cursor_execute", record)
    try:
        run()
    finally:
        event.remove(store.engine, "before_cursor_execute", record)
    return seen


def _plan(store: Store, sql: str, params: Any) -> str:
    raw = store.engine.raw_connection()
    try:
        cur = raw.cursor()
        if store.engine.dialect.name == "postgresql":
            cur.execute("ANALYZE callbacks")
            cur.execute("ANALYZE agent_tokens")
            cur.execute("EXPLAIN " + sql, params)
            return "\n".join(str(r[0]) for r in cur.fetchall())
        cur.execute("ANALYZE")
        cur.execute("EXPLAIN QUERY PLAN " + sql, params)
        return "\n".join(str(r[-1]) for r in cur.fetchall())
    finally:
        raw.close()


def _scans(plan: str, table: str) -> bool:
    return f"SCAN {table}" in plan or f"Seq Scan on {table}" in plan


def _stored_rows(store: Store) -> tuple[int, list[int]]:
    add_sim_targets(store, 50)
    sid = applied(store, "clean")
    ids = [s["step"] for s in queries.list_steps(store, sid)]
    with store.write() as conn:
        conn.execute(
            insert(callbacks),
            [
                {
                    "strategy_id": sid,
                    "step_id": ids[i % len(ids)],
                    "state": "cleaning",
                    "kind": "heartbeat",
                    "details": "",
                    "received_at": 1.0,
                    "idempotency_key": f"old-{i}",
                    "visit": 1,
                }
                for i in range(STORED)
            ],
        )
        conn.execute(
            insert(agent_tokens),
            [
                {
                    "strategy_id": sid,
                    "step_id": ids[i % len(ids)],
                    "state": f"s{i // len(ids)}",
                    "hash": f"h{i:063d}",
                    "issued_at": 1.0,
                    "visit": 1,
                }
                for i in range(STORED)
            ],
        )
    return sid, ids


def test_stored_idempotency_keys_are_found_through_their_index(store: Store) -> None:
    _, ids = _stored_rows(store)
    reports = [
        cbs.report(ids[i % len(ids)], "cleaning", "heartbeat", "", 2.0, f"old-{i}")
        for i in range(0, 300, 3)
    ] + [cbs.report(ids[0], "cleaning", "heartbeat", "", 2.0, "new-1")]
    found: dict[tuple[int, str], cbs.CallbackRecord] = {}

    def look() -> None:
        with store.read() as conn:
            found.update(cbs.stored_with_keys(conn, reports))

    seen = _statements(store, ("callbacks",), look)
    # what it finds is right: every stored key, not the new one
    assert sorted(k for _, k in found) == sorted(f"old-{i}" for i in range(0, 300, 3))
    assert seen
    for sql, params in seen:
        plan = _plan(store, sql, params)
        assert not _scans(plan, "callbacks"), plan


def test_issuing_agent_tokens_replaces_by_index(store: Store) -> None:
    sid, ids = _stored_rows(store)
    rows = [(sid, ids[i], "s0", f"n{i:063d}", 2.0, None) for i in range(len(ids))]
    seen = _statements(store, ("agent_tokens",), lambda: tokens.issue_agent_tokens(store, rows))
    assert seen
    for sql, params in seen:
        plan = _plan(store, sql, params)
        assert not _scans(plan, "agent_tokens"), plan
    # each step's token for s0 was replaced: one row each, the new hash
    with store.read() as conn:
        got = conn.execute(
            agent_tokens.select().where(agent_tokens.c.state == "s0", agent_tokens.c.visit == 1)
        ).all()
    assert sorted(r.hash for r in got) == sorted(r[3] for r in rows)
