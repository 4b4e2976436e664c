"""Pausing and resuming a strategy on a real SQLite file, with a running conductor.

A pause holds every step that has not started; steps in flight go on to their end.
The commit that would start a step reads the strategy's state, so once
``pause_strategy`` returns no step of it starts, whether or not the dispatcher has
seen the pause yet (an abort is held the same way). The journal says so: its entries
out of ``initial`` into the first state are counted before and after.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import pytest
from sqlalchemy import func, select

from conftest import add_sim_targets, applied, on_virtual_time
from fleetwave.domain.errors import Conflict, NotFound
from fleetwave.domain.registry import register_workflow
from fleetwave.domain.workflow import StateDef, WorkflowDef
from fleetwave.engine.clock import LoopClock
from fleetwave.engine.conductor import Conductor
from fleetwave.engine.config import EngineConfig
from fleetwave.store import admin, queries
from fleetwave.store.db import Store
from fleetwave.store.schema import journal, steps, strategies
from fleetwave.testing.invariants import check
from test_engine_edges import Sleep

#: every test that takes a store runs on SQLite and on PostgreSQL
pytestmark = pytest.mark.both_dialects

TERMINAL = ("complete", "failed", "aborted")


def _started(store: Store, sid: int) -> int:
    """Steps that ever started: journal entries out of initial into a workflow state."""
    with store.read() as conn:
        return int(
            conn.execute(
                select(func.count())
                .select_from(journal)
                .where(
                    journal.c.strategy_id == sid,
                    journal.c.from_state == "initial",
                    journal.c.to_state.not_in(TERMINAL),
                )
            ).scalar_one()
        )


def _last_journal_id(store: Store) -> int:
    with store.read() as conn:
        return int(conn.execute(select(func.max(journal.c.id))).scalar() or 0)


def _in_flight(store: Store, sid: int) -> int:
    with store.read() as conn:
        return int(
            conn.execute(
                select(func.count())
                .select_from(steps)
                .where(steps.c.strategy_id == sid, steps.c.state.not_in(("initial", *TERMINAL)))
            ).scalar_one()
        )


async def _until(cond: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


def _kinds(store: Store, sid: int) -> list[str]:
    return [e["kind"] for e in queries.strategy_events(store, sid)]


def test_pause_holds_waiting_steps_in_flight_ones_finish_and_resume_completes(
    store: Store,
) -> None:
    add_sim_targets(store, 60, settings={"latency_ms": 10})
    sid = applied(store, "patch", max_parallel=5)
    c = Conductor(store, config=EngineConfig(tick_s=0.05))
    seen: dict[str, int] = {}

    async def go() -> dict[int, str]:
        task = asyncio.create_task(c.run(strategy_ids=[sid]))
        await _until(lambda: queries.step_counts(store, sid).get("complete", 0) >= 10)
        assert admin.pause_strategy(store, sid) == "applying"
        seen["started_at_pause"] = _started(store, sid)
        # Steps in flight go on to their end; none starts after the pause.
        await _until(lambda: _in_flight(store, sid) == 0)
        await asyncio.sleep(0.3)  # several periodic passes: still nothing starts
        seen["started_paused"] = _started(store, sid)
        seen["waiting"] = queries.step_counts(store, sid).get("initial", 0)
        seen["in_flight_paused"] = _in_flight(store, sid)
        assert queries.get_strategy(store, sid)["state"] == "paused"
        assert not task.done()  # a paused strategy is not over: its conductor holds it
        assert admin.resume_strategy(store, sid) == "paused"
        return await task

    assert asyncio.run(go())[sid] == "complete"
    assert seen["started_paused"] == seen["started_at_pause"]
    assert seen["waiting"] == 60 - seen["started_at_pause"] > 0
    assert seen["in_flight_paused"] == 0
    assert queries.step_counts(store, sid) == {"complete": 60}
    assert check(store, sid).ok
    kinds = _kinds(store, sid)
    assert kinds.index("pause-seen") < kinds.index("resume-seen")


def test_the_commit_holds_a_pause_the_dispatcher_has_not_seen(store: Store) -> None:
    """With no periodic pass in the test's time, only the entry commit can notice."""
    add_sim_targets(store, 40, settings={"latency_ms": 10})
    sid = applied(store, "patch", max_parallel=4)
    first = Conductor(store, config=EngineConfig(tick_s=60.0))
    seen: dict[str, int] = {}

    async def pause_then_stop() -> None:
        stop = asyncio.Event()
        task = asyncio.create_task(first.run(strategy_ids=[sid], stop=stop))
        await _until(lambda: queries.step_counts(store, sid).get("complete", 0) >= 4)
        admin.pause_strategy(store, sid)
        seen["started_at_pause"] = _started(store, sid)
        await _until(lambda: _in_flight(store, sid) == 0)
        await asyncio.sleep(0.1)
        seen["started_paused"] = _started(store, sid)
        stop.set()  # a clean stop while paused: leases handed back
        await task

    asyncio.run(pause_then_stop())
    assert seen["started_paused"] == seen["started_at_pause"]
    assert "pause-seen" in _kinds(store, sid)  # learnt from the refused entries
    with store.read() as conn:
        state, owner = conn.execute(
            select(strategies.c.state, strategies.c.owner).where(strategies.c.id == sid)
        ).one()
    assert (state, owner) == ("paused", None)

    # Another conductor takes the paused strategy over: it holds it, starts nothing,
    # and drives it to the end once resumed.
    second = Conductor(store, config=EngineConfig(tick_s=0.05))

    async def take_over_then_resume() -> dict[int, str]:
        task = asyncio.create_task(second.run(strategy_ids=[sid]))
        await _until(lambda: queries.get_strategy(store, sid)["owner"] == second.id)
        await asyncio.sleep(0.2)
        assert _started(store, sid) == seen["started_at_pause"]
        admin.resume_strategy(store, sid)
        return await task

    assert asyncio.run(take_over_then_resume())[sid] == "complete"
    assert queries.step_counts(store, sid) == {"complete": 40}
    assert check(store, sid).ok


def test_abort_of_a_paused_strategy_ends_its_waiting_steps(store: Store) -> None:
    add_sim_targets(store, 30, settings={"latency_ms": 10})
    sid = applied(store, "patch", max_parallel=3)
    c = Conductor(store, config=EngineConfig(tick_s=0.05))

    async def go() -> dict[int, str]:
        task = asyncio.create_task(c.run(strategy_ids=[sid]))
        await _until(lambda: queries.step_counts(store, sid).get("complete", 0) >= 3)
        admin.pause_strategy(store, sid)
        await _until(lambda: _in_flight(store, sid) == 0)
        admin.request_abort(store, sid)
        return await task

    assert asyncio.run(go())[sid] == "aborted"
    counts = queries.step_counts(store, sid)
    assert set(counts) == {"complete", "aborted"}
    details = {s["details"] for s in queries.list_steps(store, sid) if s["state"] == "aborted"}
    assert details == {"not started: aborted by operator"}
    assert check(store, sid).ok


def test_the_commit_holds_an_abort_the_dispatcher_has_not_seen(store: Store) -> None:
    """Once ``abort`` returns nothing new starts, before any periodic pass reads it."""
    add_sim_targets(store, 40, settings={"latency_ms": 10})
    sid = applied(store, "patch", max_parallel=4)
    c = Conductor(store, config=EngineConfig(tick_s=60.0))
    seen: dict[str, int] = {}

    async def go() -> dict[int, str]:
        task = asyncio.create_task(c.run(strategy_ids=[sid]))
        await _until(lambda: queries.step_counts(store, sid).get("complete", 0) >= 4)
        admin.request_abort(store, sid)
        seen["started_at_abort"] = _started(store, sid)
        seen["last_row"] = _last_journal_id(store)
        return await asyncio.wait_for(task, 10.0)

    assert asyncio.run(go())[sid] == "aborted"
    assert _started(store, sid) == seen["started_at_abort"] < 40
    # nor does any step move on to its next state: each in flight ends aborted after
    # the state it was in
    with store.read() as conn:
        later = conn.execute(
            select(journal.c.to_state, journal.c.details).where(
                journal.c.strategy_id == sid, journal.c.id > seen["last_row"]
            )
        ).all()
    assert later and {to for to, _ in later} == {"aborted"}, later
    assert any(d.startswith("stopped after ") for _, d in later)
    assert "abort-seen" in _kinds(store, sid)
    assert check(store, sid).ok


def test_pause_and_resume_refuse_what_they_cannot_do(store: Store) -> None:
    add_sim_targets(store, 2)
    wf_sid = applied(store, "patch")
    assert admin.pause_strategy(store, wf_sid) == "applying"
    assert admin.pause_strategy(store, wf_sid) == "paused"  # again: no error
    assert admin.resume_strategy(store, wf_sid) == "paused"
    assert admin.resume_strategy(store, wf_sid) == "applying"  # again: no error
    admin.request_abort(store, wf_sid)
    with pytest.raises(Conflict, match="is abort-requested; only an applying strategy"):
        admin.pause_strategy(store, wf_sid)
    with pytest.raises(Conflict, match="only a paused strategy can be resumed"):
        admin.resume_strategy(store, wf_sid)
    with pytest.raises(NotFound, match="strategy 999 not found"):
        admin.pause_strategy(store, 999)
    with pytest.raises(NotFound, match="strategy 999 not found"):
        admin.resume_strategy(store, 999)


def test_aborting_a_paused_strategy_records_no_resume(store: Store) -> None:
    """Pause, then abort. The conductor moves the strategy to ``aborting``; its next
    periodic pass compares ``state == paused`` with run.paused (still True) and posts
    PauseChanged(False): _set_paused writes a "resume-seen" event ("resumed by
    operator") and logs "resumed" although the operator never resumed it
    (conductor.py _periodic, the PauseChanged branch; _set_paused)."""
    add_sim_targets(store, 6)
    wf = register_workflow(
        WorkflowDef("rv2-slow-abort", (StateDef("s", Sleep(30), timeout_s=600),)), replace=True
    )
    sid = applied(store, wf.name, max_parallel=2)
    c = Conductor(store, clock=LoopClock(), config=EngineConfig(tick_s=1))

    async def go() -> dict[int, str]:
        task = asyncio.create_task(c.run(strategy_ids=[sid]))
        await asyncio.sleep(5)
        admin.pause_strategy(store, sid)
        await asyncio.sleep(5)
        admin.request_abort(store, sid)
        return await asyncio.wait_for(task, 10_000)

    assert on_virtual_time(go())[sid] == "aborted"
    kinds = [e["kind"] for e in queries.strategy_events(store, sid)]
    assert "pause-seen" in kinds and "abort-seen" in kinds
    assert "resume-seen" not in kinds, kinds
