"""Action deadlines: one heap and one timer for every running action (see Conductor)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest
from sqlalchemy import select

from conftest import Sleeps, add_sim_targets, applied
from fleetwave import ActionContext, Advance, Outcome, StateAction, TransientError
from fleetwave.domain.registry import register_workflow
from fleetwave.domain.workflow import DriverOperation, StateDef, WorkflowDef
from fleetwave.drivers.sim import SimDriver
from fleetwave.engine.clock import LoopClock
from fleetwave.engine.conductor import Conductor
from fleetwave.engine.config import EngineConfig
from fleetwave.store import admin, queries
from fleetwave.store import runtime as rt
from fleetwave.store.db import Store
from fleetwave.store.schema import events
from fleetwave.testing.invariants import check
from fleetwave.testing.simulate import _abort_checks
from fleetwave.testing.vloop import VirtualTimeLoop


def test_an_earlier_states_deadline_never_cuts_the_next_state_short(store: Store) -> None:
    """State a ends long before its 0.1 s deadline; b runs past that moment, within its own."""
    add_sim_targets(store, 5)
    wf = register_workflow(
        WorkflowDef(
            "short-then-long",
            (
                StateDef("a", Sleeps(0.001), timeout_s=0.1),
                StateDef("b", Sleeps(0.3), timeout_s=5),
                StateDef("c", Sleeps(0.5), timeout_s=0.05),
            ),
        ),
        replace=True,
    )
    sid = applied(store, wf.name, max_parallel=5)
    # b ran its whole 0.3 s although a's deadline (0.1 s after a started) passed meanwhile
    _fails_every_step_with(store, sid, "c: timed out after 0.05s (attempt 1 of 1)")


def _fails_every_step_with(store: Store, sid: int, details: str) -> None:
    """Drive ``sid`` to its end, bounded: a worker stranded by a wrong cancel would hang."""
    result = asyncio.run(asyncio.wait_for(Conductor(store).run(strategy_ids=[sid]), 20))
    assert result[sid] == "failed"
    assert {s["details"] for s in queries.list_steps(store, sid)} == {details}
    assert check(store, sid).ok


def test_deadlines_of_finished_actions_do_not_pile_up(store: Store) -> None:
    """3,000 actions finish in milliseconds under 10-minute timeouts: the heap stays small."""
    add_sim_targets(store, 600)
    sid = applied(store, "patch", max_parallel=50)
    conductor = Conductor(store)
    peak = 0

    async def go() -> dict[int, str]:
        nonlocal peak
        run = asyncio.create_task(conductor.run(strategy_ids=[sid]))
        while not run.done():
            peak = max(peak, conductor.pending_deadlines())
            await asyncio.sleep(0)
        return await run

    assert asyncio.run(go())[sid] == "complete"
    assert queries.step_counts(store, sid) == {"complete": 600}
    # Without compaction every one of the 3,000 entries would wait out its 10 minutes.
    assert 50 <= peak <= 1100


class LeaksCancellation(StateAction):
    async def run(self, ctx: ActionContext) -> Outcome:
        inner = asyncio.get_running_loop().create_future()
        inner.cancel()
        await inner  # a library's cancelled inner future: CancelledError escapes the action
        return Advance()


def test_a_cancelled_error_escaping_an_action_fails_the_step(store: Store) -> None:
    add_sim_targets(store, 3)
    wf = register_workflow(
        WorkflowDef("leaky", (StateDef("a", LeaksCancellation(), timeout_s=5),)), replace=True
    )
    sid = applied(store, wf.name, max_parallel=3)
    _fails_every_step_with(store, sid, "a: action raised CancelledError")


def _crash_then_take_over(
    sid: int,
    first: Conductor,
    second: Conductor,
    *,
    crash_after_s: float,
    before_takeover: Callable[[], object] | None = None,
) -> tuple[str, float]:
    """On virtual time: ``first`` drives ``sid`` and dies after ``crash_after_s`` without
    handing its leases back; ``second`` takes over once they expire. Returns the final
    state and when ``first`` started (engine clock)."""
    started = 0.0

    async def go() -> dict[int, str]:
        nonlocal started
        started = LoopClock().now()
        crashed = asyncio.create_task(first.run(strategy_ids=[sid]))
        await asyncio.sleep(crash_after_s)
        crashed.cancel()  # dies without handing its leases back
        await asyncio.gather(crashed, return_exceptions=True)
        if before_takeover is not None:
            before_takeover()
        return await second.run(strategy_ids=[sid], patient=True)

    loop = VirtualTimeLoop()
    try:
        return loop.run_until_complete(go())[sid], started
    finally:
        loop.close()


def test_a_takeover_does_not_restart_the_states_timeout(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A state with 100 s to run loses its conductor at 60 s: it must not get 100 s more."""
    add_sim_targets(store, 1, settings={"hang_at": "pre-check"})
    sid = applied(store, "patch", timeouts_s={"pre-check": 100.0})
    sim = SimDriver()  # the target side: its hung operation outlives the first conductor
    config = EngineConfig(lease_ttl_s=10, tick_s=1, recover_grace_s=5)
    first = Conductor(store, clock=LoopClock(), config=config, drivers={"sim": sim})
    second = Conductor(store, clock=LoopClock(), config=config, drivers={"sim": sim})
    retries: list[tuple[float, str]] = []
    real = rt.TransitionWriter.commit

    def commit(self: rt.TransitionWriter, *a: Any, **kw: Any) -> Any:
        deadlines = kw.get("deadlines") or (a[5] if len(a) > 5 else None) or []
        retries.extend((LoopClock().now(), d.details) for d in deadlines)
        return real(self, *a, **kw)

    monkeypatch.setattr(rt.TransitionWriter, "commit", commit)
    final, started = _crash_then_take_over(sid, first, second, crash_after_s=60)
    assert final == "failed"
    # The first attempt, across the takeover: 100 s of the state's own time, then the
    # 5 s grace, not 60 + 10 + 100 s.
    at, why = retries[0]
    at -= started
    assert why.startswith(
        "pre-check: timed out: the state's 100s deadline, recorded when it was entered, "
        "ran out across a conductor takeover (the recover hook had "
    )
    assert 100 <= at <= 106
    # Its retries (the recover hook again: it looks before anything) have the whole
    # 100 s each, after 10 and 20 s of backoff, as without a takeover.
    (step,) = queries.list_steps(store, sid)
    assert step["details"] == "pre-check: timed out after 100s (attempt 3 of 3)"
    assert 100 + 10 + 100 + 20 + 100 <= step["finished_at"] - started <= 337
    assert check(store, sid).ok


def test_an_abort_still_wins_over_the_failure_threshold_after_a_takeover(store: Store) -> None:
    """Failures past the threshold and an operator's abort, then the conductor dies: the
    next one ends the strategy aborted, as the first would have (the simulator's abort
    fault found the takeover ending it failed)."""
    add_sim_targets(store, 1, prefix="bad", settings={"fail_at": "pre-check"})
    add_sim_targets(store, 3, prefix="slow", settings={"latency_ms": 8_000})
    sid = applied(store, "patch", max_parallel=4, max_failures=0)
    sim = SimDriver()
    config = EngineConfig(lease_ttl_s=10, tick_s=1)
    first = Conductor(store, clock=LoopClock(), config=config, drivers={"sim": sim})
    # No periodic pass before it ends: only the takeover itself sees the abort.
    quiet = EngineConfig(lease_ttl_s=10, tick_s=1000)
    second = Conductor(store, clock=LoopClock(), config=quiet, drivers={"sim": sim})
    # At 5 s bad has failed and the slow ones are still in pre-check.
    final, _ = _crash_then_take_over(
        sid, first, second, crash_after_s=5, before_takeover=lambda: admin.request_abort(store, sid)
    )
    assert final == "aborted"
    counts = queries.step_counts(store, sid)
    assert counts == {"failed": 1, "aborted": 3}, counts
    assert check(store, sid).ok
    # The takeover records that it saw the abort: the simulator's abort check needs it
    # to hold the new owner to the abort (none of its steps may start or move on).
    with store.read() as conn:
        seen = conn.execute(select(events.c.details).where(events.c.kind == "abort-seen")).scalars()
        assert list(seen) == ["operator abort requested (on takeover)"]
    assert _abort_checks(store, sid, [], 0.0, lambda _conductor, at: at) == []


class FlakyThenHangs(StateAction):
    """Attempt 1 fails transiently after 10 s; attempt 2 never returns (nor does observing
    it after a takeover): only the state's timeout ends it."""

    async def run(self, ctx: ActionContext) -> Outcome:
        if ctx.attempt == 1:
            await asyncio.sleep(10)
            raise TransientError("busy")
        await asyncio.Event().wait()
        return Advance()

    async def recover(self, ctx: ActionContext) -> Outcome:
        await asyncio.Event().wait()  # the retry is still running on the target
        return Advance()


def test_a_takeover_during_a_retry_gives_the_retry_its_own_time(store: Store) -> None:
    """Attempt 2 starts at 15 s with 100 s to run; the conductor dies at 60 s. The next
    one must give it until 115 s (plus grace), not what was left of attempt 1 (100 s)."""
    add_sim_targets(store, 1)
    wf = register_workflow(
        WorkflowDef(
            "flaky-then-hangs",
            (StateDef("a", FlakyThenHangs(), timeout_s=100, attempts_max=2, backoff_s=5),),
        ),
        replace=True,
    )
    sid = applied(store, wf.name)
    config = EngineConfig(lease_ttl_s=10, tick_s=1, recover_grace_s=5)
    first = Conductor(store, clock=LoopClock(), config=config)
    second = Conductor(store, clock=LoopClock(), config=config)
    final, started = _crash_then_take_over(sid, first, second, crash_after_s=60)
    assert final == "failed"
    (step,) = queries.list_steps(store, sid)
    assert "ran out across a conductor takeover" in step["details"], step["details"]
    # attempt 2's 100 s from 15 s, then the 5 s grace: not attempt 1's deadline (100 s)
    assert 115 <= step["finished_at"] - started <= 121
    assert check(store, sid).ok


class FlakyObserve(StateAction):
    """Runs for 300 s; after a takeover its recover hook's look at the target fails (a
    network blip): how that attempt ended is not known, and it may be retried."""

    def __init__(self) -> None:
        self.looks: list[int] = []
        self.runs: list[int] = []

    async def run(self, ctx: ActionContext) -> Outcome:
        self.runs.append(ctx.attempt)
        await asyncio.sleep(300 if ctx.attempt == 1 else 5)
        return Advance()

    async def recover(self, ctx: ActionContext) -> Outcome:
        self.looks.append(ctx.attempt)
        raise TransientError("target API unreachable")


def test_a_transient_failure_after_a_takeover_is_retried_like_any_other(
    store: Store,
) -> None:
    """A transient failure reported by the recover hook (a network blip while it looks
    at the target, or the target saying the attempt failed for now) failed the step:
    'not retried after a takeover', so a takeover of a thousand steps on a flaky
    network failed many. The next attempt now runs as any retry would, under the
    state's retry policy; the state is not entered again."""
    add_sim_targets(store, 1)
    action = FlakyObserve()
    wf = register_workflow(
        WorkflowDef(
            "flaky-observe",
            (StateDef("a", action, timeout_s=600, attempts_max=3, backoff_s=2),),
        ),
        replace=True,
    )
    sid = applied(store, wf.name)
    config = EngineConfig(lease_ttl_s=10, tick_s=1)
    first = Conductor(store, clock=LoopClock(), config=config)
    second = Conductor(store, clock=LoopClock(), config=config)
    final, _ = _crash_then_take_over(sid, first, second, crash_after_s=30)
    assert final == "complete"
    assert action.runs == [1, 2] and action.looks == [1]
    (step,) = queries.list_steps(store, sid)
    assert step["details"] == "a: done at attempt 2"
    assert [(h["from"], h["to"]) for h in queries.history(store, sid)] == [
        ("initial", "a"),
        ("a", "complete"),
    ]
    assert check(store, sid).ok


@pytest.mark.parametrize("mode", ["run", "poll"])
def test_an_operation_that_failed_for_now_on_the_target_is_tried_again_after_a_takeover(
    store: Store, mode: str
) -> None:
    """Found by review: with the retry calling the recover hook again, the target kept
    answering how the taken-over attempt had ended (failed for now), so every retry
    failed alike and the step failed claiming three attempts the target never saw.
    The target now sees attempt 2 start, and the step completes."""
    add_sim_targets(store, 1, settings={"latency_ms": 60_000, "flaky_rate": 0.5})
    wf = register_workflow(
        WorkflowDef(
            f"flaky-op-{mode}",
            (
                StateDef(
                    "op",
                    DriverOperation("op"),
                    timeout_s=600,
                    attempts_max=3,
                    backoff_s=2,
                    mode=mode,  # type: ignore[arg-type]
                    poll_interval_s=5,
                ),
            ),
        ),
        replace=True,
    )
    sid = applied(store, wf.name)
    sim = SimDriver(seed=2)  # attempt 1 fails for now (at 60 s), attempt 2 succeeds
    sim.count_starts = True
    config = EngineConfig(lease_ttl_s=10, tick_s=1)
    first = Conductor(store, clock=LoopClock(), config=config, drivers={"sim": sim})
    second = Conductor(store, clock=LoopClock(), config=config, drivers={"sim": sim})
    final, _ = _crash_then_take_over(sid, first, second, crash_after_s=30)
    assert final == "complete"
    assert dict(sim.starts) == {("t00000", "op", 1): 1, ("t00000", "op", 2): 1}
    assert check(store, sid).ok
