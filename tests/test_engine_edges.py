"""The engine at its edges, each a way to strand a strategy or lose a callback: unmanaged
targets found in the commit, failure limits crossed inside a batch, database outages and
lease watchdogs, refused transitions settled from the row. Found in review."""

from __future__ import annotations

import asyncio
import logging
import sqlite3
from collections.abc import Callable
from typing import Any

import pytest
from sqlalchemy import delete, event
from sqlalchemy.exc import OperationalError

from cli_harness import PATCH_STATES
from conftest import Sleeps, add_sim_targets, applied, on_virtual_time, rollout
from fleetwave import ActionContext, Advance, Outcome, StateAction
from fleetwave.domain.models import StrategyOptions
from fleetwave.domain.registry import get_workflow, register_workflow
from fleetwave.domain.workflow import (
    DriverOperation,
    StateDef,
    StepFailed,
    TransientError,
    WorkflowDef,
)
from fleetwave.domain.yaml_workflow import parse_workflow_yaml
from fleetwave.drivers.sim import SimDriver
from fleetwave.engine.claims import NOT_DRIVABLE_HERE
from fleetwave.engine.clock import LoopClock
from fleetwave.engine.conductor import Conductor
from fleetwave.engine.config import EngineConfig
from fleetwave.engine.errors import StoreUnavailable
from fleetwave.store import admin, queries
from fleetwave.store import runtime as rt
from fleetwave.store.callbacks import callback_outcomes
from fleetwave.store.db import Store
from fleetwave.store.schema import workflows
from fleetwave.testing.invariants import check
from fleetwave.testing.vloop import VirtualTimeLoop


def test_threshold_crossed_while_the_batch_is_full_still_ends_every_step(store: Store) -> None:
    """130 targets at max parallel 128 (the batch size): a failure must still stop it all."""
    add_sim_targets(store, 1, prefix="a", settings={"fail_at": "finishing"})
    add_sim_targets(store, 129, prefix="b")
    sid, final, _ = rollout(store, max_parallel=128, stop_on_failure=True)
    assert final == "failed"
    counts = queries.step_counts(store, sid)
    assert "initial" not in counts
    assert counts["failed"] == 1
    assert check(store, sid).ok


def test_unmanaged_target_crossing_the_threshold_starts_nothing_more(store: Store) -> None:
    names = add_sim_targets(store, 10)
    admin.set_managed(store, names[0], False)
    sid, final, _ = rollout(store, max_parallel=10, stop_on_failure=True)
    assert final == "failed"
    steps = {s["target"]: (s["state"], s["details"]) for s in queries.list_steps(store, sid)}
    assert steps[names[0]][0] == "failed"
    # Admitted in the same round, after the unmanaged one: none of them may start.
    assert all(state == "aborted" for n, (state, _) in steps.items() if n != names[0])
    assert check(store, sid).ok


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


def test_target_unmanaged_after_its_step_was_loaded_fails_when_its_turn_comes(
    store: Store,
) -> None:
    """Found by an acceptance run: the managed flag was read when the page of waiting
    steps was loaded, so a target unmanaged during the rollout was still operated on."""
    names = add_sim_targets(store, 3, settings={"latency_ms": 20})
    sid = applied(store, "patch", max_parallel=1)

    def unmanage(c: Conductor) -> None:
        assert sum(len(run.inflight) + run.pending_count() for run in c.runs.values()) == 3
        admin.set_managed(store, names[2], False)  # as `fleetwave target unmanage` does

    final, driver = _recorded_run(store, sid, unmanage)
    assert final == "failed"
    steps = {s["target"]: (s["state"], s["details"]) for s in queries.list_steps(store, sid)}
    assert steps[names[2]] == ("failed", f"Target {names[2]} is unmanaged.")
    assert steps[names[0]][0] == steps[names[1]][0] == "complete"
    assert not [p for p in driver.performed if p[0] == names[2]]  # never touched
    moves = [(h["from"], h["to"]) for h in queries.history(store, sid, target=names[2])]
    assert moves == [("initial", "failed")]
    assert check(store, sid).ok


def test_unmanaged_entry_and_a_refused_move_in_one_batch(store: Store) -> None:
    """The row-by-row commit (taken when a compare-and-set refuses a row) also fails an
    entry whose target is unmanaged, and reports it."""
    names = add_sim_targets(store, 2)
    sid = applied(store, "patch")
    ids = {s["target"]: s["step"] for s in queries.list_steps(store, sid)}
    admin.set_managed(store, names[1], False)
    writer = rt.TransitionWriter(store, "c1")
    entry = rt.Transition(ids[names[1]], sid, "initial", 0, "pre-check", 1, "", 0)
    stale = rt.Transition(ids[names[0]], sid, "pre-check", 7, "updating-patches", 7, "", 1)
    batch = [stale, entry]
    result = writer.commit(batch, [], 1.0, 2.0)
    assert result.rejected == [stale]
    assert [(t.step_id, t.to_state) for t in result.replaced] == [(ids[names[1]], "failed")]
    assert batch == [stale, entry]  # the caller's batch is left alone
    steps = {s["target"]: (s["state"], s["details"]) for s in queries.list_steps(store, sid)}
    assert steps[names[1]] == ("failed", f"Target {names[1]} is unmanaged.")
    assert steps[names[0]][0] == "initial"
    writer.close()


def _unmanage_right_after_loading(store: Store, monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    """The operator unmanages ``name`` just after the conductor loaded its step."""
    real_load = rt.load_waiting_steps

    def load_then_unmanage(*a: Any, **kw: Any) -> list[rt.StepRecord]:
        recs = real_load(*a, **kw)
        admin.set_managed(store, name, False)
        return recs

    monkeypatch.setattr(rt, "load_waiting_steps", load_then_unmanage)


def test_transient_error_after_failing_an_unmanaged_entry_strands_nothing(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found in review: the writer replaced the entry in the conductor's own batch, so
    the commit retried after a transient error found nothing to fail, and the step was
    written failed but kept its slot forever (the strategy never ended)."""
    names = add_sim_targets(store, 2)
    _unmanage_right_after_loading(store, monkeypatch, names[1])
    real_fail = rt.TransitionWriter._end_unmanaged
    calls = {"n": 0}

    def fail_then_disk_error(self: rt.TransitionWriter, *a: Any, **kw: Any) -> Any:
        out = real_fail(self, *a, **kw)
        calls["n"] += 1
        if out and calls["n"] == 1:
            raise sqlite3.OperationalError("disk I/O error (injected)")
        return out

    monkeypatch.setattr(rt.TransitionWriter, "_end_unmanaged", fail_then_disk_error)
    sid = applied(store, "patch", max_parallel=2)
    c = Conductor(store, config=EngineConfig(store_retries_max=3))

    async def go() -> dict[int, str]:
        return await asyncio.wait_for(c.run(strategy_ids=[sid]), 10)

    assert asyncio.run(go())[sid] == "failed"
    assert c.stats.store_retries >= 1
    steps = {s["target"]: s["state"] for s in queries.list_steps(store, sid)}
    assert steps == {names[0]: "complete", names[1]: "failed"}
    assert check(store, sid).ok


def test_stop_on_failure_by_an_unmanaged_target_found_in_the_commit_starts_nothing_more(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found in review: the steps admitted beside the unmanaged one entered their first
    state in the same commit and then ran, though the strategy stops on failure."""
    names = add_sim_targets(store, 10)
    _unmanage_right_after_loading(store, monkeypatch, names[0])
    sid = applied(store, "patch", max_parallel=10, stop_on_failure=True)
    final, driver = _recorded_run(store, sid)
    assert final == "failed"
    assert driver.performed == []  # no target was touched
    steps = {s["target"]: (s["state"], s["details"]) for s in queries.list_steps(store, sid)}
    assert steps[names[0]] == ("failed", f"Target {names[0]} is unmanaged.")
    # Admitted beside it, after it: none entered a state (as when the flag is known at
    # admission: test_unmanaged_target_crossing_the_threshold_starts_nothing_more).
    for n in names[1:]:
        assert [h["to"] for h in queries.history(store, sid, target=n)] == ["aborted"]
        assert steps[n][1] == f"not started: stopped after {names[0]} failed (stop on failure)"
    assert check(store, sid).ok


def test_threshold_crossed_by_unmanaged_targets_found_in_the_commit(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two failures tolerated: the first three unmanaged targets fail (the third one
    exceeds the threshold), and no step after the third starts."""
    names = add_sim_targets(store, 8)
    real_load = rt.load_waiting_steps

    def load_then_unmanage(*a: Any, **kw: Any) -> list[rt.StepRecord]:
        recs = real_load(*a, **kw)
        for n in (names[1], names[3], names[4], names[6]):
            admin.set_managed(store, n, False)
        return recs

    monkeypatch.setattr(rt, "load_waiting_steps", load_then_unmanage)
    sid = applied(store, "patch", max_parallel=8, max_failures=2)
    assert asyncio.run(Conductor(store).run(strategy_ids=[sid]))[sid] == "failed"
    steps = {s["target"]: s for s in queries.list_steps(store, sid)}
    moves = {n: [h["to"] for h in queries.history(store, sid, target=n)] for n in names}
    assert [moves[n] for n in names] == [
        ["pre-check", "aborted"],  # started before the failures: ends its state, stops
        ["failed"],
        ["pre-check", "aborted"],
        ["failed"],
        ["failed"],  # the third failure: past the threshold of 2
        ["aborted"],
        ["aborted"],  # unmanaged too, but never reached: stopped first
        ["aborted"],
    ]
    assert steps[names[5]]["details"] == (
        "not started: stopped: 3 failed steps exceed the failure threshold of 2 "
        f"(the last: {names[4]})"
    )
    assert check(store, sid).ok


def test_a_step_started_before_a_clean_stop_goes_on_although_unmanaged_meanwhile(
    store: Store,
) -> None:
    """A clean stop leaves a step that ran its first state entered in its next one, not
    started; its target is unmanaged before the next conductor takes over. It failed
    there ("Target ... is unmanaged."; a bug hunt: with stop on failure, the whole
    rollout stopped, other targets half-patched), where a step already started is not
    interrupted (README), and was not after a kill -9. It goes on to its end."""
    add_sim_targets(store, 2, settings={"latency_ms": 200})
    sid = applied(store, "patch", max_parallel=1, stop_on_failure=True)
    stop = asyncio.Event()
    first = Conductor(store)

    async def until_stopped() -> None:
        task = asyncio.create_task(first.run(strategy_ids=[sid], stop=stop))
        while not any(run.inflight for run in first.runs.values()):
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)
        stop.set()  # the first step finishes its state; its next state is entered, unstarted
        await task

    asyncio.run(until_stopped())
    entered = [s for s in queries.list_steps(store, sid) if s["state"] not in ("initial",)]
    assert entered, "the stop should leave a step in flight"
    assert entered[0]["state"] == "updating-patches", entered
    target = entered[0]["target"]
    admin.set_managed(store, target, False)
    final, driver = _recorded_run(store, sid)
    assert final == "complete"
    assert [p[1] for p in driver.performed if p[0] == target] == PATCH_STATES[1:]
    assert check(store, sid).ok


def test_takeover_does_not_start_a_step_whose_target_was_unmanaged_meanwhile(
    store: Store,
) -> None:
    """A step entered in its first state but never started there (as a commit writes
    it while its conductor's lease lapses), its target unmanaged before the next
    conductor takes over: it must not start then either (as at an admission)."""
    names = add_sim_targets(store, 2, settings={"latency_ms": 20})
    sid = applied(store, "patch", max_parallel=2)
    _entered_unstarted_by_a_lost_conductor(store, sid)
    (step, _) = queries.list_steps(store, sid)
    admin.set_managed(store, step["target"], False)
    final, driver = _recorded_run(store, sid)
    assert final == "failed"
    assert not [p for p in driver.performed if p[0] == step["target"]]
    steps = {s["target"]: (s["state"], s["details"]) for s in queries.list_steps(store, sid)}
    assert steps[step["target"]] == ("failed", f"Target {step['target']} is unmanaged.")
    assert steps[names[1]][0] == "complete"
    assert check(store, sid).ok


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


def test_a_strategy_keeps_the_yaml_workflow_it_was_created_with(store: Store) -> None:
    """Editing, then deleting, the stored workflow changes nothing for the strategy."""
    text = "name: pinned\nstates:\n  - name: only\n    timeout_s: 60\n"
    admin.save_workflow(store, parse_workflow_yaml(text), text)
    add_sim_targets(store, 2)
    sid = admin.create_strategy(
        store, parse_workflow_yaml(text), StrategyOptions(), all_targets=True
    )
    edited = text.replace("only", "something-else") + "version: 2\n"
    admin.save_workflow(store, parse_workflow_yaml(edited), edited)
    with store.write() as conn:
        conn.execute(delete(workflows).where(workflows.c.name == "pinned"))
    admin.apply_strategy(store, sid)
    assert asyncio.run(Conductor(store).run(strategy_ids=[sid]))[sid] == "complete"
    assert {s["state"] for s in queries.list_steps(store, sid)} == {"complete"}
    assert check(store, sid).ok


def test_a_strategy_whose_workflow_changed_fails_alone_one_not_here_is_left(
    store: Store,
) -> None:
    """A Python workflow re-registered with other states fails its strategy; one never
    registered in this process (a plug-in not imported here) is left, still applying,
    to a conductor that has it."""
    one = (StateDef("a", DriverOperation("a")),)
    register_workflow(WorkflowDef("shifty", one), replace=True)
    add_sim_targets(store, 2, prefix="x")
    add_sim_targets(store, 2, prefix="y")
    add_sim_targets(store, 1, prefix="z")
    changed = admin.create_strategy(
        store, WorkflowDef("shifty", one), StrategyOptions(), target_names=["x00000", "x00001"]
    )
    register_workflow(WorkflowDef("shifty", (StateDef("b", DriverOperation("b")),)), replace=True)
    gone = admin.create_strategy(
        store, WorkflowDef("never-registered", one), StrategyOptions(), target_names=["y00000"]
    )
    wf = get_workflow("patch")
    assert wf is not None
    healthy = admin.create_strategy(store, wf, StrategyOptions(), target_names=["z00000"])
    for sid in (changed, gone, healthy):
        admin.apply_strategy(store, sid)
    result = asyncio.run(Conductor(store).run(strategy_ids=[changed, gone, healthy]))
    assert result == {changed: "failed", gone: NOT_DRIVABLE_HERE, healthy: "complete"}
    assert (
        "workflow shifty changed since the strategy was created: its states were ['a'], now ['b']"
        in queries.get_strategy(store, changed)["details"]
    )
    assert queries.get_strategy(store, gone)["state"] == "applying"
    assert check(store).ok


def test_a_conductor_whose_store_keeps_failing_stops_instead_of_running_blind(
    store: Store,
) -> None:
    """Told not to ride out outages, a conductor stops after its retries."""
    add_sim_targets(store, 5, settings={"latency_ms": 60_000})
    sid = applied(store, "patch")
    conductor = Conductor(
        store,
        clock=LoopClock(),
        config=EngineConfig(lease_ttl_s=30, tick_s=1, ride_out_outages=False),
    )

    async def go() -> None:
        task = asyncio.create_task(conductor.run(strategy_ids=[sid]))
        await asyncio.sleep(5)

        def broken() -> None:
            raise OperationalError("BEGIN", None, Exception("disk I/O error (injected)"))

        store.write_fault = broken
        await task

    loop = VirtualTimeLoop()
    try:
        with pytest.raises(OperationalError):
            loop.run_until_complete(go())
    finally:
        store.write_fault = None
        loop.close()


def test_a_conductor_rides_out_a_database_outage_and_goes_on_after_it(
    store: Store, caplog: pytest.LogCaptureFixture
) -> None:
    """A database out for five minutes (locked by another program, a disk full): the
    conductor stopped after eight retries, with a traceback, and a `serve` was gone
    for good. It now keeps trying, says so every half minute, its lease watchdog stops
    the actions meanwhile, and once the database answers it claims the strategy anew
    and completes it (recover hooks looking at what was stopped)."""
    add_sim_targets(store, 5, settings={"latency_ms": 20_000})
    sid = applied(store, "patch")
    conductor = Conductor(store, clock=LoopClock(), config=EngineConfig(lease_ttl_s=30, tick_s=1))

    def out() -> None:
        raise OperationalError("BEGIN", None, Exception("database is locked (injected)"))

    async def go() -> dict[int, str]:
        loop = asyncio.get_running_loop()
        loop.call_later(5, setattr, store, "write_fault", out)
        loop.call_later(305, setattr, store, "write_fault", None)
        return await conductor.run(strategy_ids=[sid])

    with caplog.at_level(logging.WARNING, logger="fleetwave.engine"):
        assert on_virtual_time(go())[sid] == "complete"
    said = [r.getMessage() for r in caplog.records]
    retries = [m for m in said if m.startswith("store-retry")]
    # each stuck call (commit, renewal, claim) once at first, then every 30 s, then once
    # when it went through: not a line for each of its many tries
    assert conductor.stats.store_retries > 3 * len(retries)
    assert len(retries) <= 3 * (300 // 30 + 2), retries
    assert any("retrying until the database answers" in m for m in retries)
    # the store call in words, not the function's name ("claim_strategies failed")
    assert all("_" not in m.split(" failed")[0] for m in retries), retries
    # a warning at first, an error once it has lasted a minute (operators alert on those)
    levels = [r.levelno for r in caplog.records if "retrying until" in r.getMessage()]
    assert levels[0] == logging.WARNING and levels[-1] == logging.ERROR
    assert any("went through after" in m for m in retries)
    assert sum("lease-lapsing" in m for m in said) == 1
    assert check(store, sid).ok


def test_a_conductor_started_on_a_read_only_file_goes_on_once_it_is_writable(
    store: Store,
) -> None:
    """SQLite opens a file it may not write read-only, and the connection stays so
    after the file is writable again: a conductor started while the file was chmod 444
    (a restore, a mistaken mode) retried 'attempt to write a readonly database' for
    ever after the mode was put back (helper-35's drill, 4 of 4). Here the connections
    opened during the first minute cannot write (SQLite's query_only, the same error)."""
    add_sim_targets(store, 5, settings={"latency_ms": 1_000})
    sid = applied(store, "patch")
    read_only = [True]

    def opened(dbapi_conn: Any, _record: Any) -> None:
        if read_only[0]:
            dbapi_conn.execute("PRAGMA query_only=ON")

    event.listen(store.engine, "connect", opened)
    store.dispose()  # the connections already open were opened writable
    conductor = Conductor(store, clock=LoopClock(), config=EngineConfig(lease_ttl_s=30, tick_s=1))

    async def go() -> dict[int, str]:
        asyncio.get_running_loop().call_later(60, read_only.__setitem__, 0, False)
        # an hour of virtual time: without new connections it never gets through
        return await asyncio.wait_for(conductor.run(strategy_ids=[sid]), 3600)

    try:
        assert on_virtual_time(go())[sid] == "complete"
    finally:
        event.remove(store.engine, "connect", opened)
    assert conductor.stats.store_retries > 0
    assert check(store, sid).ok


# -- found by a bug hunt (liveness and exactly-once) ------------------------------


class EndsJustBefore(StateAction):
    """Returns a hair before loop time ``at`` (within the loop's 1 us resolution)."""

    def __init__(self, at: float) -> None:
        self.at = at

    async def run(self, ctx: ActionContext) -> Outcome:
        loop = asyncio.get_running_loop()
        await asyncio.sleep(self.at - 5e-7 - loop.time())
        return Advance()


class Records(StateAction):
    def __init__(self) -> None:
        self.started: list[str] = []

    async def run(self, ctx: ActionContext) -> Outcome:
        self.started.append(ctx.target.name)
        return Advance()


def test_outcome_and_abort_in_one_batch_starts_no_next_state(store: Store) -> None:
    """Found by a bug hunt. The operator aborts at t=1.5. At t=2.0 the periodic pass
    sees it; in that same loop turn step a's action ends. The dispatcher got
    [ActionFinished, StopRequested] in one batch: the step was moved into b, and b's
    action started after the abort was seen (the abort-seen event in the very commit
    that entered b)."""
    add_sim_targets(store, 1)
    b = Records()
    wf = register_workflow(
        WorkflowDef(
            "hunt-abort-race",
            (StateDef("a", EndsJustBefore(2.0), timeout_s=60), StateDef("b", b, timeout_s=60)),
        ),
        replace=True,
    )
    sid = applied(store, wf.name)
    c = Conductor(store, clock=LoopClock(), config=EngineConfig(tick_s=1.0))

    async def go() -> dict[int, str]:
        asyncio.get_running_loop().call_at(1.5, admin.request_abort, store, sid)
        return await asyncio.wait_for(c.run(strategy_ids=[sid]), 30)

    result = on_virtual_time(go())
    assert result[sid] == "aborted"
    moves = [h["to"] for h in queries.history(store, sid)]
    assert b.started == [], f"b's action started after the abort was seen; journal {moves}"
    assert moves == ["a", "aborted"]


def _entered_unstarted_by_a_lost_conductor(store: Store, sid: int) -> None:
    """Every step of ``sid`` entered in its first state and not started, as a commit
    writes them while its conductor's lease lapses; that conductor gone."""
    with store.write() as conn:
        for step in queries.list_steps(store, sid):
            conn.exec_driver_sql(
                "UPDATE steps SET state = 'pre-check', fence = 1, attempt = 1, "
                f"not_started = 1, owner = 'c-gone' WHERE id = {step['step']}"
            )
            conn.exec_driver_sql(
                "INSERT INTO journal (strategy_id, step_id, at, conductor, from_state, "
                f"to_state, fence, details) VALUES ({sid}, {step['step']}, 0, 'c-gone', "
                "'initial', 'pre-check', 1, '')"
            )


def test_takeover_starts_no_unstarted_step_once_an_unmanaged_one_stops_the_strategy(
    store: Store,
) -> None:
    """Two steps entered in their first state but not started; the second one's target
    is then unmanaged. The next conductor (stop on failure) walks the taken-over steps
    in order: the first is put in flight, the second fails (unmanaged) and stops the
    strategy; the first was started anyway, although the code ends unstarted steps of a
    stopping strategy without starting them."""
    names = add_sim_targets(store, 2, settings={"latency_ms": 200})
    sid = applied(store, "patch", max_parallel=2, stop_on_failure=True)
    _entered_unstarted_by_a_lost_conductor(store, sid)
    admin.set_managed(store, names[1], False)
    final, driver = _recorded_run(store, sid)
    assert final == "failed"
    steps = {s["target"]: (s["state"], s["details"]) for s in queries.list_steps(store, sid)}
    assert steps[names[1]] == ("failed", f"Target {names[1]} is unmanaged.")
    assert steps[names[0]][0] == "aborted", steps
    assert driver.performed == [], f"started after the strategy stopped: {driver.performed}"


class FailsOrAdvancesJustBefore(StateAction):
    """Target x advances 0.5 us before t=1.0; target y fails 0.2 us before (one loop turn)."""

    async def run(self, ctx: ActionContext) -> Outcome:
        loop = asyncio.get_running_loop()
        fails = ctx.target.name.endswith("1")
        await asyncio.sleep(1.0 - (2e-7 if fails else 5e-7) - loop.time())
        if fails:
            raise StepFailed("broken")
        return Advance()


def test_outcome_and_a_failure_in_one_batch_under_stop_on_failure(store: Store) -> None:
    """Stop on failure: x's outcome and y's failure reach the dispatcher in one batch.
    x is moved into b in the same commit that fails y, and b's action then starts
    though the strategy has stopped."""
    add_sim_targets(store, 2)
    b = Records()
    wf = register_workflow(
        WorkflowDef(
            "hunt-fail-race",
            (StateDef("a", FailsOrAdvancesJustBefore(), timeout_s=60), StateDef("b", b)),
        ),
        replace=True,
    )
    sid = applied(store, wf.name, max_parallel=2, stop_on_failure=True)
    c = Conductor(store, clock=LoopClock(), config=EngineConfig(tick_s=1.0))
    result = on_virtual_time(asyncio.wait_for(c.run(strategy_ids=[sid]), 30))
    assert result[sid] == "failed"
    moves = {
        s["target"]: [h["to"] for h in queries.history(store, sid, target=s["target"])]
        for s in queries.list_steps(store, sid)
    }
    assert b.started == [], f"b started after the strategy stopped on failure: {moves}"


def test_a_serving_conductor_that_fenced_itself_off_takes_its_strategy_up_again(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by a bug hunt: a heartbeat slow to succeed (a few 'database is locked'
    retries; on a real SQLite file each also waits busy_timeout) made the periodic pass
    think renewal had lapsed: it stopped acting on every strategy. But nobody took them
    over, the database still named this conductor, its heartbeats kept the lease, and
    claims skipped strategies it owned: a serving conductor never drove it again."""
    add_sim_targets(store, 1)
    wf = register_workflow(
        WorkflowDef("hunt-long", (StateDef("a", Sleeps(60), timeout_s=600),)), replace=True
    )
    sid = applied(store, wf.name)
    real = rt.heartbeat
    calls = {"n": 0}

    def flaky_heartbeat(*a: Any, **kw: Any) -> int:
        calls["n"] += 1
        if 2 <= calls["n"] <= 8:  # the second renewal needs 7 retries (~11 s of backoff)
            raise OperationalError("UPDATE", None, Exception("database is locked"))
        return real(*a, **kw)

    monkeypatch.setattr(rt, "heartbeat", flaky_heartbeat)
    c = Conductor(store, clock=LoopClock(), config=EngineConfig(lease_ttl_s=12, tick_s=1))

    seen: dict[str, Any] = {}

    async def serve() -> None:
        stop = asyncio.Event()
        asyncio.get_running_loop().call_later(600, stop.set)
        task = asyncio.create_task(c.run(stop=stop))
        await asyncio.sleep(500)
        st = queries.get_strategy(store, sid)
        seen.update(state=st["state"], owner=rt.strategy_state(store, sid)[1])
        await task

    on_virtual_time(serve())
    # Claimed again (a new fence) and taken over: the state has no recover hook, so its
    # step fails as lost; the strategy ends, and nobody holds it.
    assert seen == {"state": "failed", "owner": None}, (seen, c.id, c.finished)
    ((step_state, details),) = [(s["state"], s["details"]) for s in queries.list_steps(store, sid)]
    assert (step_state, details) == ("failed", "a: conductor lost during a")


def test_target_managed_again_before_its_turn_is_not_failed_as_unmanaged(store: Store) -> None:
    """Found by a bug hunt; the mirror of the unmanaged-after-loading test: the managed
    flag read when the page was loaded was trusted at admission. A target that
    was unmanaged at load time but managed again long before its turn is failed as
    'unmanaged' (and, under stop on failure, stops the whole strategy)."""
    names = add_sim_targets(store, 3, settings={"latency_ms": 20})
    admin.set_managed(store, names[2], False)
    sid = applied(store, "patch", max_parallel=1, stop_on_failure=True)

    def manage(_c: Conductor) -> None:
        admin.set_managed(store, names[2], True)  # `fleetwave target manage`, before its turn

    final, _driver = _recorded_run(store, sid, manage)
    steps = {s["target"]: (s["state"], s["details"]) for s in queries.list_steps(store, sid)}
    assert steps[names[2]][0] == "complete", steps
    assert final == "complete"


class FlakyCounting(StateAction):
    """Fails transiently every time, after ``delay`` seconds; counts attempts per target."""

    def __init__(self, delay: float, fail_for_good: str = "") -> None:
        self.delay = delay
        self.fail_for_good = fail_for_good
        self.attempts: dict[str, int] = {}

    async def run(self, ctx: ActionContext) -> Outcome:
        self.attempts[ctx.target.name] = self.attempts.get(ctx.target.name, 0) + 1
        if ctx.target.name == self.fail_for_good:
            await asyncio.sleep(2 * self.delay)
            raise StepFailed("broken for good")
        await asyncio.sleep(self.delay)
        raise TransientError("busy")


@pytest.mark.parametrize(
    ("abort_at", "tick_s"),
    [
        (4.0, 1.0),  # read at the next tick, while the step waits out its backoff
        # Found by a bug hunt: ticks at 5, 10, 15 s, so the abort at 10.5 s was not read
        # before the retry came due (11 s), and the commit recording the retry's start
        # looked only at the step's row: attempt 2 started after `strategy abort` had
        # returned. That commit reads the strategy's state now, as an entry's does.
        (10.5, 5.0),
    ],
)
def test_no_new_attempt_starts_after_an_abort(store: Store, abort_at: float, tick_s: float) -> None:
    """The operator aborts while a step waits to retry its state: the retry (a new
    operation on the target) must not start; the step ends aborted, not retried."""
    add_sim_targets(store, 1)
    action = FlakyCounting(delay=1.0)
    wf = register_workflow(
        WorkflowDef("retry-abort", (StateDef("a", action, attempts_max=3, backoff_s=10.0),)),
        replace=True,
    )
    sid = applied(store, wf.name)
    c = Conductor(store, clock=LoopClock(), config=EngineConfig(tick_s=tick_s))

    async def go() -> dict[int, str]:
        asyncio.get_running_loop().call_at(abort_at, admin.request_abort, store, sid)
        return await asyncio.wait_for(c.run(strategy_ids=[sid]), 120)

    assert on_virtual_time(go())[sid] == "aborted"
    assert action.attempts == {"t00000": 1}  # attempt 2 never started
    ((state, details),) = [(s["state"], s["details"]) for s in queries.list_steps(store, sid)]
    assert state == "aborted"
    assert details == "a: busy (attempt 1 of 3); not retried: the strategy is stopping"
    assert check(store, sid).ok


def test_no_new_attempt_starts_after_the_strategy_stopped_on_failure(store: Store) -> None:
    names = add_sim_targets(store, 2)
    action = FlakyCounting(delay=1.0, fail_for_good=names[1])
    wf = register_workflow(
        WorkflowDef("retry-stop", (StateDef("a", action, attempts_max=3, backoff_s=10.0),)),
        replace=True,
    )
    sid = applied(store, wf.name, max_parallel=2, stop_on_failure=True)
    c = Conductor(store, clock=LoopClock(), config=EngineConfig(tick_s=1.0))
    assert on_virtual_time(asyncio.wait_for(c.run(strategy_ids=[sid]), 120))[sid] == "failed"
    assert action.attempts == {names[0]: 1, names[1]: 1}  # no retry after t=2
    steps = {s["target"]: s["state"] for s in queries.list_steps(store, sid)}
    assert steps == {names[0]: "aborted", names[1]: "failed"}
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


class RecordsCancel(StateAction):
    """Runs for a long time; records when (loop time) the conductor stopped it."""

    def __init__(self) -> None:
        self.cancelled_at: list[float] = []

    async def run(self, ctx: ActionContext) -> Outcome:
        try:
            await asyncio.sleep(300)
        except asyncio.CancelledError:
            self.cancelled_at.append(asyncio.get_running_loop().time())
            raise
        return Advance()


def test_actions_stop_before_the_lease_lapses_while_renewal_keeps_failing(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The lapse was checked only by the periodic pass after its renewal returned; a
    renewal retrying 'database is locked' (each try also blocking up to busy_timeout on
    a real file) kept that pass away for longer than the lease, so actions went on after
    another conductor could have taken the strategy over. A watchdog on the loop stops
    them once 80 % of the lease has passed since the last renewal that got through."""
    add_sim_targets(store, 1)
    action = RecordsCancel()
    wf = register_workflow(
        WorkflowDef("lease-watch", (StateDef("a", action, timeout_s=600),)), replace=True
    )
    sid = applied(store, wf.name)
    real = rt.heartbeat
    calls: list[float] = []

    def heartbeat_then_locked(*a: Any, **kw: Any) -> int:
        calls.append(asyncio.get_running_loop().time())
        if len(calls) >= 2:
            raise OperationalError("UPDATE", None, Exception("database is locked"))
        return real(*a, **kw)

    monkeypatch.setattr(rt, "heartbeat", heartbeat_then_locked)
    ttl = 12.0
    c = Conductor(
        store,
        clock=LoopClock(),
        config=EngineConfig(lease_ttl_s=ttl, tick_s=1, store_retries_max=40),
    )

    async def serve() -> None:
        stop = asyncio.Event()
        asyncio.get_running_loop().call_later(60, stop.set)
        await c.run(stop=stop)

    on_virtual_time(serve())
    renewed = calls[0]  # the last renewal that got through (its lease: renewed + ttl)
    assert len(calls) > 5  # renewal kept failing
    (stopped,) = action.cancelled_at
    assert renewed + 0.8 * ttl <= stopped <= renewed + 0.8 * ttl + 1.0 < renewed + ttl
    # Left to the next owner (whose recover hook looks at what was stopped), not ended.
    assert queries.get_strategy(store, sid)["state"] == "applying"
    assert [s["state"] for s in queries.list_steps(store, sid)] == ["a"]


class ShortOrLong(StateAction):
    """Step 1 (the short one) ends after 10 s; step 2 runs until stopped (recorded)."""

    def __init__(self) -> None:
        self.cancelled_at: list[float] = []

    async def run(self, ctx: ActionContext) -> Outcome:
        try:
            await asyncio.sleep(10 if ctx.step_id == 1 else 300)
        except asyncio.CancelledError:
            self.cancelled_at.append(asyncio.get_running_loop().time())
            raise
        return Advance()


def test_actions_stop_before_the_lease_lapses_while_the_dispatcher_is_stuck_in_a_commit(
    store: Store, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Found in session 9 (a real `serve` with its database locked for 45 s): the
    watchdog told the dispatcher to stop the lapsing strategy's actions, but the
    dispatcher was itself retrying a commit in the same outage, so the actions ran on
    past the lease, when another conductor may take the steps over (G2). The watchdog
    now stops them itself; and starts nothing more of it meanwhile."""
    add_sim_targets(store, 2)
    action = ShortOrLong()
    wf = register_workflow(
        WorkflowDef("lease-stuck", (StateDef("a", action, timeout_s=600), StateDef("b", action))),
        replace=True,
    )
    sid = applied(store, wf.name, max_parallel=2)
    locked = {"from": None}
    renewed: list[float] = []
    real_heartbeat, real_commit = rt.heartbeat, rt.TransitionWriter.commit

    def is_locked() -> None:
        if locked["from"] is not None:
            raise OperationalError("UPDATE", None, Exception("database is locked"))

    def heartbeat(*a: Any, **kw: Any) -> int:
        is_locked()
        renewed.append(asyncio.get_running_loop().time())
        return real_heartbeat(*a, **kw)

    def commit(self: rt.TransitionWriter, *a: Any, **kw: Any) -> Any:
        is_locked()
        return real_commit(self, *a, **kw)

    monkeypatch.setattr(rt, "heartbeat", heartbeat)
    monkeypatch.setattr(rt.TransitionWriter, "commit", commit)
    ttl = 12.0
    c = Conductor(
        store,
        clock=LoopClock(),
        config=EngineConfig(lease_ttl_s=ttl, tick_s=1, store_retries_max=1000),
    )

    stopped_at: list[float] = []

    async def serve() -> None:
        loop = asyncio.get_running_loop()
        loop.call_later(5, locked.__setitem__, "from", 5)  # the outage: from 5 s on
        stop = asyncio.Event()
        loop.call_later(60, stop.set)
        try:
            await asyncio.wait_for(c.run(stop=stop), 90)
        finally:
            stopped_at.append(loop.time())

    # Asked to stop during the outage, it gives up at once (its leases run out): it
    # hung until the database answered, however long.
    with pytest.raises(StoreUnavailable, match="database is locked"):
        on_virtual_time(serve())
    assert stopped_at[0] <= 66
    last = max(t for t in renewed if t < 5)  # the last renewal that got through
    # Step 1's action ended at 10 s; its commit has been retrying since: the dispatcher
    # is stuck, so only the watchdog can stop step 2's action in time.
    (stopped,) = action.cancelled_at
    assert last + 0.8 * ttl <= stopped <= last + 0.8 * ttl + 1.0 < last + ttl
    assert [s["state"] for s in queries.list_steps(store, sid)] == ["a", "a"]
    # said once, not on every tick the dispatcher stayed stuck
    assert sum("lease-lapsing" in r.getMessage() for r in caplog.records) == 1


class TenThenOne(StateAction):
    """State a takes 10 s, b 1 s; no recover hook (as a YAML workflow's action)."""

    def __init__(self) -> None:
        self.started: list[tuple[str, float]] = []

    async def run(self, ctx: ActionContext) -> Outcome:
        self.started.append((ctx.state, asyncio.get_running_loop().time()))
        await asyncio.sleep(10 if ctx.state == "a" else 1)
        return Advance()


def _outage(store: Store, start: float, end: float) -> None:
    def locked() -> None:
        raise OperationalError("BEGIN", None, Exception("database is locked (injected)"))

    loop = asyncio.get_running_loop()
    if start <= 0:
        store.write_fault = locked  # before the conductor's first write
    else:
        loop.call_later(start, setattr, store, "write_fault", locked)
    loop.call_later(end, setattr, store, "write_fault", None)


def test_a_state_entered_by_a_commit_that_went_through_after_the_lapse_starts_afresh(
    store: Store,
) -> None:
    """Found by review: a commit retried through an outage went through after the lease
    had lapsed, writing step 1's entry into b as started, though nothing of a lapsed
    strategy starts; claimed back, b was 'recovered', and with no recover hook the step
    failed ('conductor lost during b'). The entry is written as not started now, and b
    starts afresh."""
    add_sim_targets(store, 1)
    action = TenThenOne()
    wf = register_workflow(
        WorkflowDef("lapse-entry", (StateDef("a", action), StateDef("b", action))), replace=True
    )
    sid = applied(store, wf.name)
    c = Conductor(store, clock=LoopClock(), config=EngineConfig(lease_ttl_s=30, tick_s=1))

    async def go() -> dict[int, str]:
        _outage(store, 5, 60)  # a ends at 10 s: its commit waits until 60 s
        return await c.run(strategy_ids=[sid])

    assert on_virtual_time(go())[sid] == "complete"
    assert [state for state, _ in action.started] == ["a", "b"]
    assert action.started[1][1] >= 60
    assert [(h["from"], h["to"]) for h in queries.history(store, sid)] == [
        ("initial", "a"),
        ("a", "b"),
        ("b", "complete"),
    ]
    assert check(store, sid).ok


def test_a_claim_that_went_through_after_an_outage_leases_from_then(store: Store) -> None:
    """Found by review: a store call retried through an outage wrote the time and the
    lease worked out before it: a claim that went through at 100 s wrote a lease that
    had run out at 30 s (another conductor could take the strategy at once) and
    claimed-at and entered-at times from before the outage (G9's "when")."""
    add_sim_targets(store, 1)
    action = TenThenOne()
    wf = register_workflow(
        WorkflowDef("lease-fresh", (StateDef("a", action), StateDef("b", action))), replace=True
    )
    sid = applied(store, wf.name)
    clock = LoopClock()
    c = Conductor(store, clock=clock, config=EngineConfig(lease_ttl_s=30, tick_s=1))
    seen: dict[str, float] = {}

    async def go() -> dict[int, str]:
        _outage(store, 0, 100)

        async def look() -> None:
            await asyncio.sleep(105)  # claimed, a running
            with store.read() as conn:
                seen["lease"] = conn.exec_driver_sql(
                    "SELECT lease_expires_at FROM strategies WHERE id = ?", (sid,)
                ).scalar_one()

        looking = asyncio.create_task(look())
        done = await c.run(strategy_ids=[sid])
        await looking
        return done

    assert on_virtual_time(go())[sid] == "complete"
    assert seen["lease"] >= 100 + 30 - 5  # (on the lease clock: the loop's)
    with store.read() as conn:
        claimed = conn.exec_driver_sql(
            "SELECT at FROM events WHERE kind = 'strategy-claimed' AND strategy_id = ?", (sid,)
        ).scalar_one()
    assert claimed - clock.epoch >= 100
    entered = [h["at"] for h in queries.history(store, sid)]
    assert all(at - clock.epoch >= 100 for at in entered), entered


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
    assert writer.commit([enter], [], 1.0, 2.0).rejected == []
    with store.write() as conn:  # someone else writes that step's row meanwhile
        conn.exec_driver_sql("UPDATE steps SET fence = 5 WHERE id = ?", (ids["t00000"],))
    end = rt.Transition(ids["t00000"], sid, "pre-check", 1, "complete", 1, "skipped", 1)
    nxt = rt.Transition(ids["t00001"], sid, "initial", 0, "pre-check", 1, "", 0)
    elsewhere = rt.Transition(other_step, other, "initial", 0, "pre-check", 1, "", 0)
    result = writer.commit([end, nxt, elsewhere], [], 2.0, 3.0)
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
