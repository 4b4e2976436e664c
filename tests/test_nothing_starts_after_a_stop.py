"""Once an abort or a failure limit is seen, nothing new starts, also for outcomes that
came in the same batch: no next state, no new attempt, and every step still ends."""

from __future__ import annotations

import asyncio

import pytest

from conftest import add_sim_targets, applied, on_virtual_time, rollout
from fleetwave import ActionContext, Advance, Outcome, StateAction
from fleetwave.domain.registry import register_workflow
from fleetwave.domain.workflow import (
    Skip,
    StateDef,
    StepFailed,
    TransientError,
    WorkflowDef,
)
from fleetwave.engine.clock import LoopClock
from fleetwave.engine.conductor import Conductor
from fleetwave.engine.config import EngineConfig
from fleetwave.store import admin, queries
from fleetwave.store.db import Store
from fleetwave.testing.invariants import check


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


class AdvanceOrSkipAtOne(StateAction):
    """Every target's action ends at t=1.0 (one dispatcher batch): t00000 advances to
    the next state, t00001 is already done (skip: its step ends, freeing a slot)."""

    async def run(self, ctx: ActionContext) -> Outcome:
        loop = asyncio.get_running_loop()
        await asyncio.sleep(1.0 - loop.time())
        if ctx.target.name.endswith("1"):
            return Skip("already done")
        return Advance()


class RecordsStarts(StateAction):
    def __init__(self) -> None:
        self.started: list[str] = []

    async def run(self, ctx: ActionContext) -> Outcome:
        self.started.append(ctx.target.name)
        return Advance()


def test_a_move_committed_with_an_unmanaged_entry_that_stops_the_strategy_starts_no_next_state(
    store: Store,
) -> None:
    """Stop on failure. In one batch: t0 moves a -> b, t1 ends (skip) and frees a slot,
    t2 is admitted into it. The commit finds t2's target unmanaged and writes it failed
    instead: the strategy stops in that very commit. _replaced_at_turn sets stopping,
    but _apply then releases t0 into b anyway, so b's action starts after the strategy
    stopped (the mirror of test_outcome_and_a_failure_in_one_batch_under_stop_on_failure,
    with the failure found in the commit instead of decided before it)."""
    names = add_sim_targets(store, 3)
    b = RecordsStarts()
    wf = register_workflow(
        WorkflowDef(
            "rv-unmanaged-stop-race",
            (StateDef("a", AdvanceOrSkipAtOne(), timeout_s=60), StateDef("b", b, timeout_s=60)),
        ),
        replace=True,
    )
    sid = applied(store, wf.name, max_parallel=2, stop_on_failure=True)
    c = Conductor(store, clock=LoopClock(), config=EngineConfig(tick_s=1.0))

    async def go() -> dict[int, str]:
        asyncio.get_running_loop().call_at(0.5, admin.set_managed, store, names[2], False)
        return await asyncio.wait_for(c.run(strategy_ids=[sid]), 30)

    result = on_virtual_time(go())
    moves = {
        s["target"]: [h["to"] for h in queries.history(store, sid, target=s["target"])]
        for s in queries.list_steps(store, sid)
    }
    assert result[sid] == "failed", moves
    assert moves[names[2]] == ["failed"], moves  # the scenario happened as described
    assert b.started == [], f"b started after the strategy stopped on failure: {moves}"
