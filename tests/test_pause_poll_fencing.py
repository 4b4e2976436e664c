"""Pause, poll mode and the self-fence: the periodic pass survives a run dropped while it
reads states, a second poll state runs its own driver operation, an abort of a paused
strategy records no resume, a YAML workflow naming a plug-in's action is left to a
conductor that has it, and a fenced-off conductor still polling starts nothing again.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from sqlalchemy.exc import OperationalError

from conftest import add_sim_targets, applied, on_virtual_time
from fleetwave import ActionContext, Advance, Outcome, StateAction
from fleetwave.domain.registry import register_workflow
from fleetwave.domain.workflow import DriverOperation, StateDef, WorkflowDef
from fleetwave.engine.clock import LoopClock
from fleetwave.engine.conductor import Conductor
from fleetwave.engine.config import EngineConfig
from fleetwave.store import admin, queries
from fleetwave.store import runtime as rt
from fleetwave.store.db import Store
from fleetwave.testing.invariants import check


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


def test_a_second_poll_state_running_the_same_driver_operation_runs_it_again(
    store: Store,
) -> None:
    """Two poll states both run the driver operation ``reboot`` (a workflow that
    reboots twice). SimDriver.start (sim.py start) keeps, per step, the last operation
    finished and answers DONE when it is the same name: the second state's reboot is
    never started on the target and the step moves on at once. In run mode (perform)
    both reboots run."""
    from fleetwave.drivers.sim import SimDriver

    add_sim_targets(store, 1, settings={"latency_ms": 10_000})
    wf = register_workflow(
        WorkflowDef(
            "rv2-reboot-twice",
            (
                StateDef("reboot-1", DriverOperation("reboot"), mode="poll", poll_interval_s=5),
                StateDef("reboot-2", DriverOperation("reboot"), mode="poll", poll_interval_s=5),
            ),
        ),
        replace=True,
    )
    sid = applied(store, wf.name)
    sim = SimDriver(seed=1)
    sim.record = True
    c = Conductor(store, clock=LoopClock(), drivers={"sim": sim})

    async def go() -> float:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        await asyncio.wait_for(c.run(strategy_ids=[sid]), 10_000)
        return loop.time() - t0

    elapsed = on_virtual_time(go())
    assert queries.get_strategy(store, sid)["state"] == "complete"
    # each state's reboot ran on the target: two operations of 10 s each
    assert [op for _t, op, _a in sim.performed] == ["reboot", "reboot"]
    assert elapsed >= 20


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


def test_a_yaml_workflow_naming_a_plugin_action_is_left_by_a_conductor_without_it(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """README: a conductor lacking a strategy's plug-in "hands it back untouched, still
    applying ... a missing plug-in never fails a rollout. (YAML workflows need no
    plug-in: each strategy keeps a copy.)" A YAML workflow whose state names a plug-in
    action (``action: python:NAME``, registered by @register_action) does need it:
    parse_workflow_yaml raises WorkflowError in _adopt, which is caught by the generic
    ``except Exception`` and the strategy is failed by _fail_undrivable (conductor.py
    _adopt), instead of going through _cannot_drive_here. apply --wait's pre-check
    (cli/main.py strategy_apply) skips strategies with their own copy, too."""
    from fleetwave.domain import registry
    from fleetwave.domain.models import StrategyOptions
    from fleetwave.domain.yaml_workflow import parse_workflow_yaml
    from fleetwave.engine.claims import NOT_DRIVABLE_HERE

    @registry.register_action("rv2-verify")
    class Verify(StateAction):
        async def run(self, ctx: ActionContext) -> Outcome:
            return Advance()

    add_sim_targets(store, 2)
    text = "name: rv2-site\nstates:\n  - name: verify\n    action: python:rv2-verify\n"
    wf = parse_workflow_yaml(text, source="test")
    sid = admin.create_strategy(store, wf, StrategyOptions(), all_targets=True)
    admin.apply_strategy(store, sid)
    # this conductor's process lacks the plug-in that registers the action
    monkeypatch.delitem(registry._actions, "rv2-verify")
    c = Conductor(store, clock=LoopClock())
    result = on_virtual_time(asyncio.wait_for(c.run(strategy_ids=[sid]), 1_000))
    assert queries.get_strategy(store, sid)["state"] == "applying"
    assert result[sid] == NOT_DRIVABLE_HERE


def test_a_fenced_off_conductor_still_polling_does_not_start_it_again(
    store: Store,
) -> None:
    """A conductor stalls (stops renewing; its periodic pass has not run again yet)
    while a step polls ``apply``. Another conductor takes the strategy over, its
    recover hook sees ``apply`` done, the step moves on and runs ``finish``. At its next
    poll the fenced-off conductor's worker asks observe("apply"): the target's record
    now shows ``finish`` as the step's last operation, so observe says NOT_STARTED, and
    DriverOperation._poll (workflow.py, "the target lost it: start it again") starts
    ``apply`` on the target a second time, after the step has left that state. In run
    mode the stale worker only waits. The simulator flags the same thing (G1 at the
    target) for poll workflows, e.g. patch with every other state polling, seeds 30018,
    30044, 30087, 30103, 30123."""
    from fleetwave.drivers.sim import SimDriver

    add_sim_targets(store, 1, settings={"latency_ms": 1000})
    wf = register_workflow(
        WorkflowDef(
            "rv2-poll-two",
            (
                StateDef("apply", DriverOperation("apply"), mode="poll", poll_interval_s=10),
                StateDef("finish", DriverOperation("finish"), mode="poll", poll_interval_s=10),
            ),
        ),
        replace=True,
    )
    sid = applied(store, wf.name)
    sim = SimDriver(seed=1)
    sim.count_starts = True

    async def go() -> str:
        stalled = Conductor(
            store,
            clock=LoopClock(),
            drivers={"sim": sim},
            config=EngineConfig(lease_ttl_s=5, tick_s=30, renew_leases=False),
            conductor_id="stalled",
        )
        ztask = asyncio.create_task(stalled.run(strategy_ids=[sid], patient=True))
        await asyncio.sleep(0.5)
        rival = Conductor(
            store,
            clock=LoopClock(),
            drivers={"sim": sim},
            config=EngineConfig(lease_ttl_s=5, tick_s=1),
            conductor_id="rival",
        )
        result = await asyncio.wait_for(rival.run(strategy_ids=[sid], patient=True), 1_000)
        await asyncio.sleep(40)
        ztask.cancel()
        await asyncio.gather(ztask, return_exceptions=True)
        return result[sid]

    assert on_virtual_time(go()) == "complete"
    # the target ran each operation once
    assert sim.starts[("t00000", "apply", 1)] == 1, dict(sim.starts)
