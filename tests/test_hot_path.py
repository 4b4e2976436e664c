"""The hot path's shortcuts say what the general path says, also at its edges."""

from __future__ import annotations

import sqlite3
from typing import Any

import pytest
from sqlalchemy import select

from conftest import add_sim_targets, applied, rollout
from fleetwave import ActionContext, Advance, Outcome, StateAction
from fleetwave.domain.registry import register_workflow
from fleetwave.domain.rules import decide
from fleetwave.domain.workflow import StateDef, WorkflowDef
from fleetwave.store import queries
from fleetwave.store import runtime as rt
from fleetwave.store.db import Store
from fleetwave.store.schema import journal


class _ArrayLike:
    """An action's odd message: like a numpy array, ``==`` gives no plain truth value."""

    class _Ambiguous:
        def __bool__(self) -> bool:
            raise ValueError("the truth value of an array is ambiguous")

    def __eq__(self, other: object) -> Any:
        return self._Ambiguous()

    __hash__ = object.__hash__

    def __str__(self) -> str:
        return "['ok' 'done']"


class _SaysArray(StateAction):
    async def run(self, ctx: ActionContext) -> Outcome:
        return Advance(details=_ArrayLike())  # type: ignore[arg-type]


def test_decide_keeps_an_odd_message_of_a_plain_advance() -> None:
    d = decide(("a", "b"), "a", Advance(details=_ArrayLike()))  # type: ignore[arg-type]
    assert (d.to_state, d.details) == ("b", "['ok' 'done']")
    assert decide(("a", "b"), "b", Advance()) == ("complete", "")


def test_an_advance_with_an_odd_message_moves_the_step_on(store: Store) -> None:
    # The worker's and the dispatcher's shortcuts for an Advance without details must
    # not compare such a message with "" (it raised, and the step failed).
    add_sim_targets(store, 2)
    wf = WorkflowDef("odd-message", (StateDef("a", _SaysArray()), StateDef("b", _SaysArray())))
    register_workflow(wf)
    sid, final, _ = rollout(store, wf)
    assert final == "complete"
    steps = queries.list_steps(store, sid)
    assert {s["state"] for s in steps} == {"complete"}
    with store.read() as conn:
        said = conn.execute(
            select(journal.c.to_state, journal.c.details).where(journal.c.strategy_id == sid)
        ).all()
    odd = "['ok' 'done']"
    assert {tuple(r) for r in said} == {("a", ""), ("b", odd), ("complete", odd)}


def test_the_writer_lets_go_of_its_cursor_after_an_error(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The writer keeps its cursor from one commit to the next. An error that left a
    # statement half read on it must not keep the WAL's read snapshot open until the
    # next commit (rollback does not reset it): checkpoints would be held back.
    add_sim_targets(store, 3)
    sid = applied(store, "patch")
    ids = [s["step"] for s in queries.list_steps(store, sid)]
    real = rt.TransitionWriter._end_unmanaged

    def half_read_then_fail(self: rt.TransitionWriter, cur: Any, *a: Any, **kw: Any) -> Any:
        cur.execute("SELECT id FROM steps")
        cur.fetchone()
        raise sqlite3.OperationalError("disk I/O error (injected)")

    monkeypatch.setattr(rt.TransitionWriter, "_end_unmanaged", half_read_then_fail)
    writer = rt.TransitionWriter(store, "c1")
    batch = [rt.Transition(i, sid, "initial", 0, "pre-check", 1, "", 0) for i in ids]
    with pytest.raises(Exception, match="injected"):
        writer.commit(batch, [], 1.0)
    with store.write() as conn:  # another writer meanwhile
        conn.exec_driver_sql("UPDATE steps SET details = 'x'")
    other = sqlite3.connect(store.url, timeout=0.5)
    try:
        busy, _, _ = other.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
    finally:
        other.close()
    assert busy == 0
    # and the writer goes on (a new cursor on the same connection)
    monkeypatch.setattr(rt.TransitionWriter, "_end_unmanaged", real)
    batch = [rt.Transition(i, sid, "initial", 0, "pre-check", 1, "x", 0) for i in ids]
    result = writer.commit(batch, [], 1.0)
    writer.close()
    assert not result.rejected
    assert {s["state"] for s in queries.list_steps(store, sid)} == {"pre-check"}
