"""Refused transitions settled from the row (see also test_settle.py, which shares its
helpers), callbacks that arrive before their wait, a periodic pass that dies, and a resume
after a clean stop. Found in review."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import pytest
from sqlalchemy.exc import OperationalError

from conftest import add_sim_targets, applied, on_virtual_time
from fleetwave import ActionContext, Advance, Outcome, StateAction
from fleetwave.domain.models import StrategyOptions
from fleetwave.domain.registry import get_workflow, register_workflow
from fleetwave.domain.workflow import (
    StateDef,
    StepFailed,
    TransientError,
    WorkflowDef,
)
from fleetwave.drivers.sim import SimDriver
from fleetwave.engine.clock import LoopClock
from fleetwave.engine.conductor import Conductor
from fleetwave.engine.config import EngineConfig
from fleetwave.store import admin, queries
from fleetwave.store import runtime as rt
from fleetwave.store.callbacks import callback_outcomes
from fleetwave.store.db import Store
from fleetwave.testing.invariants import check


def _recorded_run(
    store: Store, sid: int, after_first_operation: Callable[[Conductor], None] | None = None
) -> tuple[str, SimDriver]:
    """Drive ``sid`` with a sim driver that records what the targets saw; once the first
    operation has started (its page of waiting steps is loaded), call
    ``after_first_operation``. Returns the strategy's final state and the driver."""
    driver = SimDriver()
    driver.record = True
    c = Conductor(store, drivers={"sim": driver})

    async def go() -> dict[int, str]:
        task = asyncio.create_task(c.run(strategy_ids=[sid]))
        if after_first_operation is not None:
            while not driver.performed:
                await asyncio.sleep(0.005)
            after_first_operation(c)
        return await asyncio.wait_for(task, 30)

    return asyncio.run(go())[sid], driver


def test_callbacks_that_arrive_before_the_wait_are_kept(store: Store) -> None:
    add_sim_targets(store, 1, settings={"latency_ms": 50, "callback_lost_rate": 1.0})
    sid = applied(store, "clean")
    c = Conductor(store)

    async def go() -> dict[int, str]:
        task = asyncio.create_task(c.run(strategy_ids=[sid]))
        await asyncio.sleep(0.02)  # still powering off: the agent reports early
        c.receive_callback(1, "wait-for-agent", "done", "agent up")
        c.receive_callback(1, "clean-steps", "done", "disks wiped")
        return await task

    assert asyncio.run(go())[sid] == "complete"
    outcomes = {o["state"]: o["outcome"] for o in callback_outcomes(store, sid)}
    assert outcomes == {"wait-for-agent": "applied", "clean-steps": "applied"}
    assert check(store, sid).ok


def _edit_row_during_its_action(store: Store, sid: int, sql: str) -> tuple[str, SimDriver]:
    """Run ``sid`` (one step at a time); while the first step's first action runs, change
    that step's row behind the conductor's back (a hand edit, or a bug elsewhere), so the
    transition its outcome asks for is refused although the strategy is still held."""

    def edit(c: Conductor) -> None:
        (run,) = c.runs.values()
        (step_id,) = run.inflight
        with store.write() as conn:
            conn.exec_driver_sql(sql, (step_id,))

    return _recorded_run(store, sid, edit)


def test_a_refused_transition_is_settled_from_the_row_not_left_to_nobody(store: Store) -> None:
    """Suspected by the bug hunt: a transition refused while the strategy is still held
    freed the step's slot and nobody drove the step again; the strategy could end
    complete with that step mid-state. The conductor now reads the row: still in the
    state its action finished (only the fence changed), so the decision is applied
    again, at a new fence, and nothing runs twice."""
    names = add_sim_targets(store, 3, settings={"latency_ms": 20})
    sid = applied(store, "patch", max_parallel=1)
    final, driver = _edit_row_during_its_action(
        store, sid, "UPDATE steps SET fence = fence + 1 WHERE id = ?"
    )
    assert final == "complete"
    assert {s["state"] for s in queries.list_steps(store, sid)} == {"complete"}
    with store.read() as conn:
        settled = conn.exec_driver_sql(
            "SELECT details FROM events WHERE kind = 'step-settled'"
        ).all()
    assert [r[0] for r in settled] == [
        "transition refused; row unchanged but for its fence; applied again: updating-patches"
    ]
    ops = [p[1] for p in driver.performed if p[0] == names[0]]
    assert len(ops) == len(set(ops)) == 5  # each state's action once
    moves = [(h["from"], h["to"]) for h in queries.history(store, sid, target=names[0])]
    assert moves[:2] == [("initial", "pre-check"), ("pre-check", "updating-patches")]
    assert check(store, sid).ok


def test_a_refused_transition_of_a_step_ended_elsewhere_counts_it_as_ended(
    store: Store,
) -> None:
    """The row says the step failed (someone ended it): the strategy counts that failure
    and ends failed, instead of complete, and nothing runs on that target again."""
    names = add_sim_targets(store, 3, settings={"latency_ms": 20})
    sid = applied(store, "patch", max_parallel=1)
    final, driver = _edit_row_during_its_action(
        store, sid, "UPDATE steps SET state = 'failed', details = 'ended by hand' WHERE id = ?"
    )
    assert final == "failed"
    steps = {s["target"]: s["state"] for s in queries.list_steps(store, sid)}
    assert steps == {names[0]: "failed", names[1]: "complete", names[2]: "complete"}
    assert len([p for p in driver.performed if p[0] == names[0]]) == 1  # its first action only


@pytest.mark.parametrize(
    ("sql", "details"),
    [
        ("UPDATE steps SET state = 'bogus' WHERE id = ?", "bogus: not a state of workflow patch"),
        ("UPDATE steps SET state = 'initial' WHERE id = ?", "set back to initial after it started"),
    ],
)
def test_a_refused_transition_of_a_row_that_cannot_go_on_fails_the_step(
    store: Store, sql: str, details: str
) -> None:
    """A row edited into a state the workflow lacks, or back to initial after the step
    started (its states cannot be entered twice), ends failed, once: not a loop of
    refused admissions."""
    names = add_sim_targets(store, 3, settings={"latency_ms": 20})
    sid = applied(store, "patch", max_parallel=1)
    final, driver = _edit_row_during_its_action(store, sid, sql)
    assert final == "failed"
    steps = {s["target"]: (s["state"], s["details"]) for s in queries.list_steps(store, sid)}
    assert steps[names[0]] == ("failed", details)
    assert steps[names[1]][0] == steps[names[2]][0] == "complete"
    assert len([p for p in driver.performed if p[0] == names[0]]) == 1
    with store.read() as conn:
        settled = conn.exec_driver_sql(
            "SELECT details FROM events WHERE kind = 'step-settled'"
        ).all()
    assert [r[0] for r in settled] == [f"transition refused; row {details}: failed"]


def test_a_step_aborted_after_a_refused_retry_does_not_say_its_state_was_done(
    store: Store,
) -> None:
    """Found by review: the note for a state that needed retries ("a: done at attempt
    2") was added to a step aborted because its retry was refused (the strategy
    stopping); and an ended step's attempt is the attempts its last state took."""

    class Late(StateAction):
        async def run(self, ctx: ActionContext) -> Outcome:
            if ctx.step_id == 1:
                await asyncio.sleep(1.8)
                raise StepFailed("boom")
            await asyncio.sleep(0.5)
            raise TransientError("net down")

    add_sim_targets(store, 2)
    wf = register_workflow(
        WorkflowDef("late-fail", (StateDef("a", Late(), attempts_max=3),)), replace=True
    )
    sid = applied(store, wf.name, max_parallel=2, stop_on_failure=True)
    c = Conductor(store, clock=LoopClock())
    assert on_virtual_time(c.run(strategy_ids=[sid]))[sid] == "failed"
    steps = {s["step"]: s for s in queries.list_steps(store, sid)}
    assert steps[2]["state"] == "aborted"
    assert "not retried: the strategy is stopping" in steps[2]["details"]
    assert "done at attempt" not in steps[2]["details"]
    assert steps[2]["attempt"] == 2


@pytest.mark.parametrize(
    "sql",
    [
        "UPDATE steps SET state = 'failed', details = 'ended by hand' WHERE id = ?",
        "UPDATE steps SET fence = fence + 1 WHERE id = ?",
    ],
)
def test_a_refused_failure_is_counted_once(store: Store, sql: str) -> None:
    """Found by review: a move to failed was counted when decided and again when its
    refusal was settled (from the row, or when the taken-over step failed again), so one
    failed step crossed a failure threshold of one and aborted the rest."""
    add_sim_targets(store, 1, prefix="a", settings={"latency_ms": 20, "fail_at": "pre-check"})
    names = add_sim_targets(store, 2, settings={"latency_ms": 20})
    sid = applied(store, "patch", max_parallel=1, max_failures=1)
    final, _ = _edit_row_during_its_action(store, sid, sql)
    steps = {s["target"]: s["state"] for s in queries.list_steps(store, sid)}
    assert steps == {"a00000": "failed", names[0]: "complete", names[1]: "complete"}
    assert final == "failed"


def test_a_row_that_keeps_changing_is_read_once_a_tick(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by review: every dispatcher pass settled again and armed one more retry
    timer, so retries piled up with the other steps' traffic (hundreds of reads and
    writes a second, long after it stopped). A step whose row keeps changing keeps its
    slot and is read again once a tick."""
    add_sim_targets(store, 1, prefix="a", settings={"latency_ms": 30})
    add_sim_targets(store, 300, settings={"latency_ms": 10})
    sid = applied(store, "patch", max_parallel=20)
    stuck: set[int] = set()
    reads: list[float] = []
    real_load = rt.load_steps

    def load_steps(st: Store, strategy: int, ids: list[int]) -> Any:
        reads.append(asyncio.get_running_loop().time())
        got = real_load(st, strategy, ids)
        with st.write() as conn:  # the row changes again right after each read
            for step_id in stuck & set(ids):
                conn.exec_driver_sql("UPDATE steps SET fence = fence + 1 WHERE id = ?", (step_id,))
        return got

    monkeypatch.setattr(rt, "load_steps", load_steps)
    c = Conductor(store, drivers={"sim": SimDriver()}, config=EngineConfig(tick_s=0.5))
    seen: dict[str, int] = {}

    async def go() -> dict[int, str]:
        task = asyncio.create_task(c.run(strategy_ids=[sid]))
        while not c.runs:
            await asyncio.sleep(0.005)
        (run,) = c.runs.values()
        first = min(run.inflight)
        stuck.add(first)
        with store.write() as conn:
            conn.exec_driver_sql("UPDATE steps SET fence = fence + 1 WHERE id = ?", (first,))
        while run.inflight or run.pending_count() or run.more_waiting:
            seen["max_held"] = max(seen.get("max_held", 0), run.held_slots())
            await asyncio.sleep(0.01)
        seen["unsettled"] = len(run.unsettled)
        t0 = asyncio.get_running_loop().time()
        await asyncio.sleep(2.0)  # only the stuck step is left
        seen["idle_reads"] = len([t for t in reads if t >= t0])
        stuck.clear()
        return await asyncio.wait_for(task, 30)

    assert asyncio.run(go())[sid] == "complete"
    assert seen["unsettled"] == 1, seen
    assert 2 <= seen["idle_reads"] <= 2 / 0.5 + 1, seen
    assert seen["max_held"] <= 20  # the stuck step's slot is not handed to another
    assert {s["state"] for s in queries.list_steps(store, sid)} == {"complete"}
    with store.read() as conn:
        (journalled,) = conn.exec_driver_sql("SELECT count(*) FROM journal").one()
    assert c.stats.transitions == journalled  # settling's own commits counted, once


def test_entries_beside_a_refused_end_wait(store: Store) -> None:
    """Found by the simulator's outside-writer fault: the dispatcher gives a step's slot
    (and, when it was its stage's last, the next stage) to an entry as soon as it decides
    the step ended. If that end is refused, the step is still in a state: the entries of
    its strategy in that batch are not written (more than max parallel in flight, or a
    stage started early, otherwise). Another strategy's entry is written."""
    add_sim_targets(store, 4)
    wf = get_workflow("patch")
    assert wf is not None
    three = ["t00000", "t00001", "t00002"]
    sid = admin.create_strategy(store, wf, StrategyOptions(max_parallel=1), target_names=three)
    other = admin.create_strategy(store, wf, StrategyOptions(), target_names=["t00003"])
    ids = {s["target"]: s["step"] for s in queries.list_steps(store, sid)}
    (other_step,) = [s["step"] for s in queries.list_steps(store, other)]
    writer = rt.TransitionWriter(store, "c1")
    enter = rt.Transition(ids["t00000"], sid, "initial", 0, "pre-check", 1, "", 0)
    assert writer.commit([enter], [], 1.0).rejected == []
    with store.write() as conn:  # someone else writes that step's row meanwhile
        conn.exec_driver_sql("UPDATE steps SET fence = 5 WHERE id = ?", (ids["t00000"],))
    end = rt.Transition(ids["t00000"], sid, "pre-check", 1, "complete", 1, "skipped", 1)
    nxt = rt.Transition(ids["t00001"], sid, "initial", 0, "pre-check", 1, "", 0)
    elsewhere = rt.Transition(other_step, other, "initial", 0, "pre-check", 1, "", 0)
    result = writer.commit([end, nxt, elsewhere], [], 2.0)
    assert result.rejected == [end]
    assert result.deferred == [nxt]
    states = {s["target"]: s["state"] for s in queries.list_steps(store, sid)}
    assert states == {"t00000": "pre-check", "t00001": "initial", "t00002": "initial"}
    assert [s["state"] for s in queries.list_steps(store, other)] == ["pre-check"]


def test_a_periodic_pass_that_dies_stops_the_conductor_with_its_error(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Lease renewal lives in the periodic pass: a conductor whose pass died would act on
    while its leases lapse. It stops instead, with the pass's error, and hands nothing
    back (its leases expire; the next conductor takes over and recovers)."""
    add_sim_targets(store, 3, settings={"latency_ms": 200})
    sid = applied(store, "patch", max_parallel=3)

    def broken(*_a: Any, **_kw: Any) -> Any:
        raise RuntimeError("a bug in the periodic pass")

    monkeypatch.setattr(rt, "strategy_states", broken)
    short = EngineConfig(tick_s=0.05, lease_ttl_s=0.5)
    c = Conductor(store, drivers={"sim": SimDriver()}, config=short)
    with pytest.raises(RuntimeError, match="a bug in the periodic pass"):
        asyncio.run(asyncio.wait_for(c.run(strategy_ids=[sid]), 10))
    strategy = queries.get_strategy(store, sid)
    assert strategy["state"] == "applying"
    assert strategy["owner"] == c.id  # not released: a dead conductor's lease expires
    monkeypatch.undo()
    # This process lives on, so the dead conductor is presumed alive until its lease runs out.
    nxt = Conductor(store, drivers={"sim": SimDriver()}, config=short)
    final = asyncio.run(asyncio.wait_for(nxt.run(strategy_ids=[sid], patient=True), 30))[sid]
    assert final == "complete"
    assert check(store, sid).ok


def test_resuming_after_a_clean_stop_is_not_a_warning(
    store: Store, caplog: pytest.LogCaptureFixture
) -> None:
    """Every resume after a Ctrl-C logged a WARNING ("took over 20 steps in flight (0
    call their recover hook, 20 start afresh)"): routine, when nothing was running."""
    add_sim_targets(store, 4, settings={"latency_ms": 1000})
    sid = applied(store, "patch")

    async def go() -> dict[int, str]:
        stop = asyncio.Event()
        asyncio.get_running_loop().call_later(0.5, stop.set)
        config = EngineConfig(shutdown_grace_s=5)  # running actions finish
        await Conductor(store, clock=LoopClock(), config=config).run(strategy_ids=[sid], stop=stop)
        return await Conductor(store, clock=LoopClock()).run(strategy_ids=[sid])

    with caplog.at_level(logging.INFO, logger="fleetwave.engine"):
        assert on_virtual_time(go())[sid] == "complete"
    took = [r for r in caplog.records if "took over" in r.getMessage()]
    assert took and all(r.levelno == logging.INFO for r in took), [
        (r.levelname, r.getMessage()) for r in took
    ]
    assert "4 start afresh" in took[-1].getMessage()


class Sleep(StateAction):
    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    async def run(self, ctx: ActionContext) -> Outcome:
        await asyncio.sleep(self.seconds)
        return Advance()

    async def recover(self, ctx: ActionContext) -> Outcome:
        return Advance()


def test_a_run_dropped_while_the_periodic_pass_reads_states_does_not_kill_it(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The periodic pass reads (state, owner) of ``list(self.runs)``; a transient error
    makes _io sleep and retry. If the lease watchdog drops the run meanwhile (lapsed
    self-fence: the owner in the database is still this conductor), the new pause
    comparison ``self.runs[sid].paused`` raises KeyError: the periodic pass dies and
    the whole conductor stops with it (conductor.py _periodic)."""
    add_sim_targets(store, 1)
    wf = register_workflow(
        WorkflowDef("rv2-slow", (StateDef("s", Sleep(20), timeout_s=600),)), replace=True
    )
    sid = applied(store, wf.name)
    c = Conductor(store, clock=LoopClock(), config=EngineConfig(lease_ttl_s=6, tick_s=1))
    real = rt.strategy_states
    calls = {"n": 0}

    def flaky(*a: Any, **kw: Any) -> Any:
        calls["n"] += 1
        if 3 <= calls["n"] <= 8:
            # the database is unavailable for ~6 s (retried by _io with backoff): the
            # lease watchdog self-fences the strategy meanwhile (lapsed drop)
            raise OperationalError("SELECT", None, Exception("database is locked"))
        return real(*a, **kw)

    monkeypatch.setattr(rt, "strategy_states", flaky)
    result = on_virtual_time(asyncio.wait_for(c.run(strategy_ids=[sid]), 10_000))
    assert result[sid] == "complete"
    assert check(store, sid).ok
