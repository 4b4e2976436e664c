"""States that poll (``mode: poll``), on virtual time and a real SQLite file.

The action starts the work and answers :class:`NotYet` while it goes on; the engine
calls it again every ``poll_interval_s`` (or the ``after_s`` it asked for) until it
advances, fails, or the state's timeout runs out. A driver operation in a poll state
starts the operation (``start``) and then looks at it (``observe``): it is started
once, also across a takeover.
"""

from __future__ import annotations

import asyncio
import textwrap

import pytest

from conftest import add_sim_targets, applied, on_virtual_time
from fleetwave import ActionContext, Advance, NotYet, Outcome, StateAction
from fleetwave.domain.registry import register_workflow
from fleetwave.domain.workflow import DriverOperation, StateDef, WorkflowDef, WorkflowError
from fleetwave.domain.yaml_workflow import parse_workflow_yaml
from fleetwave.drivers.sim import SimDriver
from fleetwave.engine.clock import LoopClock
from fleetwave.engine.conductor import Conductor
from fleetwave.engine.config import EngineConfig
from fleetwave.store import admin, queries
from fleetwave.store.db import Store
from fleetwave.testing.invariants import check


class ReadyAfter(StateAction):
    """Answers "not yet" ``polls`` times (with how far it got), then advances."""

    def __init__(self, polls: int, after_s: float | None = None) -> None:
        self.polls = polls
        self.after_s = after_s
        self.calls: list[tuple[int, float]] = []

    async def run(self, ctx: ActionContext) -> Outcome:
        self.calls.append((ctx.poll, asyncio.get_running_loop().time()))
        if ctx.poll < self.polls:
            return NotYet(f"{25 * (ctx.poll + 1)}% done", after_s=self.after_s)
        return Advance()


def _one_state(name: str, action: StateAction, **state: object) -> str:
    wf = register_workflow(WorkflowDef(name, (StateDef("s", action, **state),)), replace=True)  # type: ignore[arg-type]
    return wf.name


def _drive(store: Store, sid: int, conductor: Conductor | None = None) -> str:
    c = conductor or Conductor(store, clock=LoopClock())
    result = on_virtual_time(asyncio.wait_for(c.run(strategy_ids=[sid]), 100_000))
    return str(result[sid])


def _details(store: Store, sid: int) -> list[str]:
    return [s["details"] for s in queries.list_steps(store, sid)]


def test_a_poll_state_is_asked_again_every_interval_until_it_advances(store: Store) -> None:
    add_sim_targets(store, 1)
    action = ReadyAfter(3)
    sid = applied(store, _one_state("poll-ok", action, mode="poll", poll_interval_s=20))
    assert _drive(store, sid) == "complete"
    assert [p for p, _ in action.calls] == [0, 1, 2, 3]
    gaps = [b - a for (_, a), (_, b) in zip(action.calls, action.calls[1:], strict=False)]
    assert gaps == pytest.approx([20, 20, 20], abs=0.01)
    # polling writes nothing: one journal row into the state, one out of it
    assert [(h["from"], h["to"]) for h in queries.history(store, sid)] == [
        ("initial", "s"),
        ("s", "complete"),
    ]
    assert check(store, sid).ok


def test_the_action_may_ask_for_its_own_delay(store: Store) -> None:
    add_sim_targets(store, 1)
    action = ReadyAfter(2, after_s=1.5)
    sid = applied(store, _one_state("poll-after", action, mode="poll", poll_interval_s=600))
    assert _drive(store, sid) == "complete"
    times = [t for _, t in action.calls]
    assert times[-1] - times[0] == pytest.approx(3.0, abs=0.01)


def test_a_poll_state_times_out_with_the_last_answer(store: Store) -> None:
    add_sim_targets(store, 1)
    sid = applied(
        store,
        _one_state("poll-slow", ReadyAfter(1000), mode="poll", poll_interval_s=10, timeout_s=35),
    )
    assert _drive(store, sid) == "failed"
    assert _details(store, sid) == [
        "s: timed out after 35s polling (last answer: 100% done) (attempt 1 of 1)"
    ]


def test_not_yet_from_a_state_that_does_not_poll_fails_the_step(store: Store) -> None:
    add_sim_targets(store, 1)
    sid = applied(store, _one_state("not-polling", ReadyAfter(1)))
    assert _drive(store, sid) == "failed"
    assert _details(store, sid) == [
        "s: the action answered 'not yet', but the state does not poll (mode: run)"
    ]


POLL_YAML = textwrap.dedent(
    """
    name: polled
    states:
      - name: apply
        mode: poll
        poll_interval_s: 5
        timeout_s: 3600
        retry: {attempts: 3, backoff_s: 1}
      - name: finish
    """
)


def _sim_conductor(store: Store) -> tuple[Conductor, SimDriver]:
    sim = SimDriver(seed=1)
    sim.count_starts = True
    return Conductor(store, clock=LoopClock(), drivers={"sim": sim}), sim


def _applied_yaml(store: Store, text: str, **options: object) -> int:
    wf = register_workflow(parse_workflow_yaml(text), replace=True)
    return applied(store, wf.name, **options)


async def _timed(c: Conductor, sid: int) -> float:
    """Drive ``sid``; how long it took (virtual seconds)."""
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    await asyncio.wait_for(c.run(strategy_ids=[sid]), 100_000)
    return loop.time() - t0


def _starts(sim: SimDriver, operation: str) -> dict[tuple[str, str, int], int]:
    return {k: v for k, v in sim.starts.items() if k[1] == operation}


def test_a_driver_operation_that_polls_is_started_once_and_observed(store: Store) -> None:
    add_sim_targets(store, 3, settings={"latency_ms": 42_000})
    sid = _applied_yaml(store, POLL_YAML)
    c, sim = _sim_conductor(store)
    elapsed = on_virtual_time(_timed(c, sid))
    assert queries.get_strategy(store, sid)["state"] == "complete"
    # each target's operation started once, seen done at the first look after 42 s
    # (45 s: a look every 5 s), then the 42 s of `finish`
    assert _starts(sim, "apply") == {(f"t{i:05d}", "apply", 1): 1 for i in range(3)}
    assert elapsed == pytest.approx(45 + 42, abs=0.5)
    assert check(store, sid).ok


def test_a_polled_operation_that_fails_on_the_target_fails_the_step(store: Store) -> None:
    add_sim_targets(store, 1, settings={"latency_ms": 12_000, "fail_at": "apply"})
    sid = _applied_yaml(store, POLL_YAML)
    c, _sim = _sim_conductor(store)
    on_virtual_time(_timed(c, sid))
    assert _details(store, sid) == [
        # in the words a run state's failure has (it read "apply: apply failed on
        # target: failed on target (fail_at=apply)")
        "apply: failed on target (fail_at=apply)"
    ]


def test_a_polled_operation_failing_transiently_is_started_again_per_attempt(
    store: Store,
) -> None:
    add_sim_targets(store, 1, settings={"latency_ms": 3_000, "flaky_rate": 1.0})
    sid = _applied_yaml(store, POLL_YAML)
    c, sim = _sim_conductor(store)
    on_virtual_time(_timed(c, sid))
    assert _starts(sim, "apply") == {("t00000", "apply", n): 1 for n in (1, 2, 3)}
    assert _details(store, sid) == ["apply: target busy (simulated) (attempt 3 of 3)"]


def test_a_takeover_in_a_poll_state_observes_and_does_not_start_it_again(
    store: Store,
) -> None:
    """The conductor dies mid-poll (its leases are not handed back); the next one takes
    over when they expire: its recover hook sees the operation still running on the
    target and polls on, and the target never sees it started twice."""
    add_sim_targets(store, 2, settings={"latency_ms": 300_000})
    sid = _applied_yaml(store, POLL_YAML)
    sim = SimDriver(seed=1)
    sim.count_starts = True
    cfg = EngineConfig(lease_ttl_s=30, tick_s=1)

    async def crash_then_take_over() -> str:
        first = Conductor(store, clock=LoopClock(), drivers={"sim": sim}, config=cfg)
        task = asyncio.create_task(first.run(strategy_ids=[sid]))
        await asyncio.sleep(60)
        task.cancel()  # killed: no clean stop, leases left to expire
        await asyncio.gather(task, return_exceptions=True)
        second = Conductor(store, clock=LoopClock(), drivers={"sim": sim}, config=cfg)
        result = await second.run(strategy_ids=[sid], patient=True)
        return result[sid]

    assert on_virtual_time(crash_then_take_over()) == "complete"
    assert _starts(sim, "apply") == {(f"t{i:05d}", "apply", 1): 1 for i in range(2)}
    taken = [e for e in queries.strategy_events(store, sid) if e["kind"] == "step-taken-over"]
    assert len(taken) == 2
    assert check(store, sid).ok


def test_poll_settings_are_checked(store: Store) -> None:
    with pytest.raises(WorkflowError, match=r"states\[0\] \(a\): poll_interval_s: only for"):
        parse_workflow_yaml("name: w\nstates:\n  - {name: a, poll_interval_s: 5}\n")
    with pytest.raises(WorkflowError, match="poll_interval_s"):
        parse_workflow_yaml("name: w\nstates:\n  - {name: a, mode: poll, poll_interval_s: 0}\n")
    with pytest.raises(WorkflowError, match="poll_interval_s: must be a positive, finite"):
        WorkflowDef("w", (StateDef("a", ReadyAfter(1), mode="poll", poll_interval_s=0),))


def test_an_abort_ends_a_poll_state_between_two_polls(store: Store) -> None:
    """It polled on until the state advanced or timed out (an hour here), the strategy
    'aborting' all the while. The call in progress ends; no further poll is made."""
    add_sim_targets(store, 1)
    action = ReadyAfter(1000)
    sid = applied(
        store,
        _one_state("poll-long", action, mode="poll", poll_interval_s=60, timeout_s=3600),
    )
    c = Conductor(store, clock=LoopClock(), config=EngineConfig(tick_s=1))

    async def abort_mid_poll() -> tuple[str, float]:
        loop = asyncio.get_running_loop()
        task = asyncio.create_task(c.run(strategy_ids=[sid]))
        await asyncio.sleep(150)  # polls at 0, 60 and 120 s
        admin.request_abort(store, sid)
        aborted_at = loop.time()
        result = await asyncio.wait_for(task, 10_000)
        return result[sid], loop.time() - aborted_at

    final, took = on_virtual_time(abort_mid_poll())
    assert final == "aborted"
    assert took < 5  # the next periodic pass sees the abort; the poll's wait ends then
    assert [p for p, _ in action.calls] == [0, 1, 2]
    assert _details(store, sid) == [
        "s: aborted by operator while polling the target (last answer: 75% done); what "
        "it was doing may still be running there"
    ]
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
