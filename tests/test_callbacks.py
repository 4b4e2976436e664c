"""Callbacks (G6): stored and answered at once, applied once, late and duplicate ones ignored."""

from __future__ import annotations

import asyncio
import time
from collections import Counter

import pytest
from sqlalchemy import update

from conftest import add_sim_targets, applied, on_virtual_time, rollout
from fleetwave import ActionContext, Advance, Outcome, StateAction
from fleetwave.domain.errors import InputError, NotFound
from fleetwave.domain.models import StrategyOptions
from fleetwave.domain.registry import get_workflow, register_workflow
from fleetwave.domain.workflow import StateDef, StepFailed, WorkflowDef
from fleetwave.drivers.sim import SimDriver
from fleetwave.engine.clock import LoopClock
from fleetwave.engine.conductor import Conductor
from fleetwave.engine.config import EngineConfig
from fleetwave.engine.errors import SimulatedCrash
from fleetwave.engine.messages import LeaseLost, StrategyClaimed
from fleetwave.store import admin, queries
from fleetwave.store import runtime as rt
from fleetwave.store.callbacks import accept_callback, callback_outcomes
from fleetwave.store.db import Store
from fleetwave.store.schema import callbacks, strategies
from fleetwave.testing.invariants import check
from test_nothing_starts_after_a_stop import RecordsStarts
from test_pause_resume import _until


def test_clean_workflow_waits_for_agent_callbacks(store: Store) -> None:
    add_sim_targets(store, 30, settings={"latency_ms": 5})
    sid, final, _ = rollout(store, "clean", max_parallel=10)
    assert final == "complete"
    outcomes = callback_outcomes(store, sid)
    # two callback states per node, each answered exactly once
    assert Counter(o["outcome"] for o in outcomes) == {"applied": 60}
    assert check(store, sid).ok


def test_a_conductor_keeps_no_callback_ids_of_a_strategy_that_ended(store: Store) -> None:
    """Each callback's id was kept for the conductor's life (a set it never pruned): a
    serve rolling 'clean' over 100,000 nodes kept 200,000 ids per rollout."""
    add_sim_targets(store, 10, settings={"latency_ms": 2})
    sid, final, c = rollout(store, "clean", max_parallel=5)
    assert final == "complete"
    assert len(callback_outcomes(store, sid)) == 20  # it did hear them
    assert c._callbacks_seen == {}


class LostAndRetaken(StateAction):
    """While its step waits for a callback, the strategy is lost (another conductor took
    it over and died, its lease already expired) and claimed back at once, in the order
    the periodic pass does it; meanwhile the target calls back in process."""

    def __init__(self) -> None:
        self.conductor: Conductor | None = None
        self.sid = 0
        self.done = False

    async def run(self, ctx: ActionContext) -> Outcome:
        if not self.done:
            self.done = True
            c = self.conductor
            assert c is not None
            with c.store.write() as conn:
                conn.execute(
                    update(strategies)
                    .where(strategies.c.id == self.sid)
                    .values(owner="c-dead", fence=strategies.c.fence + 1, lease_expires_at=1.0)
                )
            now = c.clock.now()
            c.post(LeaseLost(self.sid))
            for rec in rt.claim_strategies(c.store, c.id, now, now + 60, {self.sid}):
                c._claiming.add(rec.id)
                c.post(StrategyClaimed(rec))
            c.receive_callback(ctx.step_id, ctx.state, "done", "agent done")
            await asyncio.sleep(5)  # cancelled when the run is dropped
        return Advance()

    async def recover(self, ctx: ActionContext) -> Outcome:
        return Advance()


def test_a_callback_heard_while_a_strategy_is_lost_and_claimed_back_counts_once(
    store: Store,
) -> None:
    """Found by a review: forgetting a lost strategy's posted callbacks made the one
    still queued be posted again at the claim: it moved the step on, and was recorded
    as 'ignored: duplicate'."""
    add_sim_targets(store, 1)
    action = LostAndRetaken()
    wf = register_workflow(
        WorkflowDef(
            "lost-retaken", (StateDef("w", action, mode="wait-for-callback", timeout_s=30),)
        ),
        replace=True,
    )
    sid = applied(store, wf.name)
    c = Conductor(store)
    action.conductor, action.sid = c, sid
    final = asyncio.run(asyncio.wait_for(c.run(strategy_ids=[sid]), 20))[sid]
    assert final == "complete"
    (cb,) = callback_outcomes(store, sid)
    assert (cb["outcome"], cb["reason"]) == ("applied", "moved the step on from w")


def test_duplicate_late_and_failed_callbacks(store: Store) -> None:
    add_sim_targets(
        store,
        40,
        settings={
            "latency_ms": 5,
            "callback_dup_rate": 0.5,
            "callback_fail_rate": 0.1,
            "callback_late_rate": 0.0,
        },
    )
    sid, final, _c = rollout(store, "clean", max_parallel=40)
    outcomes = callback_outcomes(store, sid)
    by = Counter(o["outcome"] for o in outcomes)
    assert by["ignored"] > 0 and by["applied"] > 0
    assert all(o["outcome"] in ("applied", "ignored") and o["reason"] for o in outcomes)
    reasons = {o["reason"] for o in outcomes if o["outcome"] == "ignored"}
    assert reasons <= {
        "duplicate: this state already had its callback",
        "its step is not under way: not started yet (a callback answers a state its step "
        "has entered, or will enter from one it is in), or just ended",
        "late: step already complete",
        "late: step already failed",
        "strategy ended first",
    } | {r for r in reasons if r.startswith(("late or out of order", "late: state "))}
    failed = [s for s in queries.list_steps(store, sid) if s["state"] == "failed"]
    assert failed and all("target reported failure" in s["details"] for s in failed)
    assert final == "failed"
    assert check(store, sid).ok


def test_lost_callback_times_out_with_clear_reason(store: Store) -> None:
    add_sim_targets(store, 5, settings={"latency_ms": 1, "callback_lost_rate": 1.0})
    sid, final, _ = rollout(store, "clean", timeouts_s={"wait-for-agent": 0.2}, max_parallel=5)
    assert final == "failed"
    assert {s["details"] for s in queries.list_steps(store, sid)} == {
        "wait-for-agent: timed out after 0.2s waiting for the target's callback (attempt 1 of 1)"
    }


def test_callback_is_answered_at_once_even_while_a_step_is_busy(store: Store) -> None:
    """No lock to wait on: accepting is one insert, whatever the step is doing."""
    add_sim_targets(store, 1, settings={"latency_ms": 300})
    sid = applied(store, "patch")
    c = Conductor(store)

    async def go() -> float:
        task = asyncio.create_task(c.run(strategy_ids=[sid]))
        await asyncio.sleep(0.1)  # the step is mid-action
        t0 = time.perf_counter()
        c.receive_callback(1, "pre-check", "done", "agent says hi")
        elapsed = time.perf_counter() - t0
        await task
        return elapsed

    elapsed = asyncio.run(go())
    assert elapsed < 0.25  # answered long before the 300 ms action finished
    (cb,) = callback_outcomes(store, sid)
    assert cb["outcome"] == "ignored"
    assert cb["reason"] == "state pre-check does not wait for callbacks"


def test_bad_callbacks_are_refused_with_a_clear_message(store: Store) -> None:
    add_sim_targets(store, 1)
    wf = get_workflow("clean")
    assert wf is not None
    admin.create_strategy(store, wf, StrategyOptions(), all_targets=True)
    with pytest.raises(InputError, match="kind"):
        accept_callback(store, 1, "wait-for-agent", "maybe", "", 0.0)
    with pytest.raises(NotFound, match="step 99"):
        accept_callback(store, 99, "wait-for-agent", "done", "", 0.0)


class CalledBackThenFails(StateAction):
    """The target calls back at once (the dispatcher hands the callback to the waiting
    step), then the action itself fails: the wait never reads the callback."""

    def __init__(self) -> None:
        self.conductor: Conductor | None = None

    async def run(self, ctx: ActionContext) -> Outcome:
        assert self.conductor is not None
        self.conductor.receive_callback(ctx.step_id, ctx.state, "done", "agent says done")
        await asyncio.sleep(0.05)  # the dispatcher resolves the step's wait meanwhile
        raise StepFailed("the action broke after the target called back")


def test_a_callback_handed_to_a_wait_that_then_failed_is_answered_with_why(
    store: Store,
) -> None:
    """It was left open until the strategy ended ("strategy ended first"), which hid
    what happened: the step's state ended (failed, or timed out) before its wait read
    the callback."""
    action = CalledBackThenFails()
    wf = register_workflow(
        WorkflowDef(
            "calls-back-then-fails",
            (StateDef("wait", action, mode="wait-for-callback", timeout_s=30),),
        ),
        replace=True,
    )
    add_sim_targets(store, 1)
    sid = applied(store, wf.name)
    c = Conductor(store)
    action.conductor = c
    assert asyncio.run(c.run(strategy_ids=[sid])) == {sid: "failed"}
    (cb,) = callback_outcomes(store, sid)
    assert cb["outcome"] == "ignored"
    assert cb["reason"] == (
        "its step's state ended first: wait: the action broke after the target called back"
    )


def _waiting(store: Store, sid: int, state: str) -> int:
    return sum(s["state"] == state for s in queries.list_steps(store, sid))


def test_an_abort_ends_a_wait_for_a_callback_at_once(store: Store) -> None:
    """It waited out the state's timeout (30 min for 'wait-for-agent', 2 h for
    'clean-steps'), the strategy 'aborting' all the while, and the step then ended
    failed (timed out), not aborted. Nothing of ours runs on the target during a wait:
    the abort ends it, and says the target may still be at it."""
    add_sim_targets(store, 4, settings={"latency_ms": 1, "callback_lost_rate": 1.0})
    sid = applied(store, "clean", max_parallel=2)
    c = Conductor(store, config=EngineConfig(tick_s=0.05))

    async def go() -> dict[int, str]:
        task = asyncio.create_task(c.run(strategy_ids=[sid]))
        await _until(lambda: _waiting(store, sid, "wait-for-agent") == 2)
        admin.request_abort(store, sid)
        return await asyncio.wait_for(task, 10.0)

    assert asyncio.run(go()) == {sid: "aborted"}
    details = Counter(s["details"] for s in queries.list_steps(store, sid))
    assert details == {
        "wait-for-agent: aborted by operator while waiting for the target's callback; "
        "what the target was started on may still be running there": 2,
        "not started: aborted by operator": 2,
    }
    assert check(store, sid).ok


def test_a_failure_limit_lets_a_wait_for_a_callback_end_its_state(store: Store) -> None:
    """Only an operator's abort ends a wait early: past a failure limit, in-flight
    steps finish their state as they do in any other mode (here: its timeout)."""
    add_sim_targets(store, 1, settings={"latency_ms": 1, "fail_at": "clean-steps"})
    add_sim_targets(store, 1, settings={"latency_ms": 1, "callback_lost_rate": 1.0}, prefix="late")
    sid, final, _ = rollout(
        store,
        "clean",
        max_parallel=2,
        stop_on_failure=True,
        timeouts_s={"wait-for-agent": 0.5},
    )
    assert final == "failed"
    by_target = {s["target"]: s["details"] for s in queries.list_steps(store, sid)}
    assert by_target["late00000"] == (
        "wait-for-agent: timed out after 0.5s waiting for the target's callback (attempt 1 of 1)"
    )


class StartsAnAgent(StateAction):
    """Starts the target's agent; after a takeover, finds it started (and waits on)."""

    async def run(self, ctx: ActionContext) -> Outcome:
        return Advance()

    async def recover(self, ctx: ActionContext) -> Outcome:
        return Advance()


@pytest.mark.parametrize(
    ("kind", "step_ends", "callback"),
    [
        ("done", ("complete", "agent finished"), "applied"),  # its last state
        ("failed", ("failed", "w: target reported failure: agent finished"), "applied"),
    ],
)
def test_a_callback_stored_before_a_takeover_of_an_aborting_strategy_counts(
    store: Store, kind: str, step_ends: tuple[str, str], callback: str
) -> None:
    """The target answered while its conductor was gone; then the operator aborted. The
    next owner's worker reached the wait (its recover hook returned at once) before the
    stored callback was handed to it, so the abort ended the wait and the target's
    answer was ignored: a finished target recorded as "may still be running", a failed
    one as aborted, its failure never counted (review of session 11)."""
    add_sim_targets(store, 1)
    wf = register_workflow(
        WorkflowDef(
            "agent-takeover",
            (StateDef("w", StartsAnAgent(), mode="wait-for-callback", timeout_s=600),),
        ),
        replace=True,
    )
    sid = applied(store, wf.name)
    first = Conductor(store, config=EngineConfig(tick_s=0.05))

    async def go() -> dict[int, str]:
        task = asyncio.create_task(first.run(strategy_ids=[sid]))
        await _until(lambda: _waiting(store, sid, "w") == 1)
        task.cancel()  # killed while the step waits: its lease is left behind
        await asyncio.gather(task, return_exceptions=True)
        with store.write() as conn:  # ... and has run out
            conn.execute(
                update(strategies).where(strategies.c.id == sid).values(lease_expires_at=1.0)
            )
        (step,) = queries.list_steps(store, sid)
        accept_callback(store, step["step"], "w", kind, "agent finished", time.time())
        admin.request_abort(store, sid)
        return await asyncio.wait_for(
            Conductor(store, config=EngineConfig(tick_s=0.05)).run(strategy_ids=[sid]), 20
        )

    assert asyncio.run(go()) == {sid: "aborted"}
    (step,) = queries.list_steps(store, sid)
    assert (step["state"], step["details"]) == step_ends
    assert [cb["outcome"] for cb in callback_outcomes(store, sid)] == [callback]
    assert check(store, sid).ok


def test_a_takeover_of_an_aborting_strategy_starts_no_action_that_never_began(
    store: Store,
) -> None:
    """A conductor dies right after committing its first wave (their actions never
    reached the targets); the operator aborts; the next owner's recover hooks find the
    operations never started. They started them, after the abort was seen; now the
    steps end aborted and the targets see nothing."""
    add_sim_targets(store, 3, settings={"latency_ms": 1})
    sid = applied(store, "patch", max_parallel=3)
    sim = SimDriver()
    sim.count_starts = True

    def crash(point: str) -> None:
        if point == "after-commit":
            raise SimulatedCrash(point)

    async def go() -> dict[int, str]:
        first = Conductor(store, drivers={"sim": sim}, crash_hook=crash)
        with pytest.raises(SimulatedCrash):
            await first.run(strategy_ids=[sid])
        assert _waiting(store, sid, "pre-check") == 3  # entered, never dispatched
        with store.write() as conn:  # its lease ran out
            conn.execute(
                update(strategies).where(strategies.c.id == sid).values(lease_expires_at=1.0)
            )
        admin.request_abort(store, sid)
        second = Conductor(store, drivers={"sim": sim}, config=EngineConfig(tick_s=0.05))
        return await asyncio.wait_for(second.run(strategy_ids=[sid]), 20)

    assert asyncio.run(go()) == {sid: "aborted"}
    assert sim.starts == {}  # no target saw pre-check start
    assert {s["details"] for s in queries.list_steps(store, sid)} == {
        "pre-check: the target reports pre-check not started; not started now: aborted by operator"
    }
    assert check(store, sid).ok


def test_step_show_lists_what_the_target_reported(store: Store) -> None:
    """An operator told "the target may still be running it" had no way to see the
    target's later report: step show had the journal and events, not the callbacks."""
    add_sim_targets(store, 1, settings={"latency_ms": 1})
    sid, final, _ = rollout(store, "clean")
    assert final == "complete"
    (step,) = queries.list_steps(store, sid)
    got = queries.get_step(store, step["step"])["callbacks"]
    assert [(c["state"], c["kind"], c["outcome"], c["reason"]) for c in got] == [
        ("wait-for-agent", "done", "applied", "moved the step on from wait-for-agent"),
        ("clean-steps", "done", "applied", "moved the step on from clean-steps"),
    ]
    assert all(c["received_at"] > 0 for c in got)


class _FailsFirst(StateAction):
    """The first target fails after 1 s; the others take 10 s."""

    async def run(self, ctx: ActionContext) -> Outcome:
        if ctx.target.name.endswith("0"):
            await asyncio.sleep(1)
            raise StepFailed("kick failed")
        await asyncio.sleep(10)
        return Advance()


class _Kicked(StateAction):
    async def run(self, ctx: ActionContext) -> Outcome:
        return Advance()


def test_a_callback_kept_for_a_state_its_step_never_reaches_is_answered_when_it_ends(
    store: Store,
) -> None:
    """Found by a bug hunt: a callback that came early (for a later state) stayed open
    after its step had failed before that state, until the strategy ended, then said
    "strategy ended first". It is answered when its step ends, saying so."""
    names = add_sim_targets(store, 2)
    wf = register_workflow(
        WorkflowDef(
            "kick-then-agent",
            (
                StateDef("kick", _FailsFirst()),
                StateDef("agent", _Kicked(), mode="wait-for-callback", timeout_s=60),
            ),
        ),
        replace=True,
    )
    sid = applied(store, wf.name)
    step_of = {s["target"]: s["step"] for s in queries.list_steps(store, sid)}
    c = Conductor(store, clock=LoopClock())
    seen: dict[str, tuple[str, str]] = {}

    def early() -> None:
        accept_callback(store, step_of[names[0]], "agent", "done", "agent up", 0.0)

    def look() -> None:
        ((outcome, reason),) = [
            (cb["outcome"], cb["reason"]) for cb in queries.step_callbacks(store, step_of[names[0]])
        ]
        seen["while running"] = (outcome, reason)

    async def go() -> dict[int, str]:
        loop = asyncio.get_running_loop()
        loop.call_at(0.5, early)
        loop.call_at(3.0, look)  # the other target is still in kick
        loop.call_at(12.0, c.receive_callback, step_of[names[1]], "agent", "done", "up")
        return await asyncio.wait_for(c.run(strategy_ids=[sid]), 120)

    assert on_virtual_time(go())[sid] == "failed"  # one step failed
    assert seen["while running"] == ("ignored", "its step ended failed before reaching agent")
    assert {s["target"]: s["state"] for s in queries.list_steps(store, sid)} == {
        names[0]: "failed",
        names[1]: "complete",
    }


class BranchesToC(StateAction):
    async def run(self, ctx: ActionContext) -> Outcome:
        return Advance(to="c", details="nothing to do in b")


def test_a_branch_chosen_by_a_wait_for_callback_state_is_kept_after_the_callback(
    store: Store,
) -> None:
    """A wait-for-callback state whose action branches (Advance(to='c')): after the
    target's callback, _run_state replaces the action's outcome with
    _callback_outcome(answered), a plain Advance(): the branch is dropped and the step
    runs b, which the action said to skip."""
    add_sim_targets(store, 1)
    b = RecordsStarts()
    c_ = RecordsStarts()
    wf = register_workflow(
        WorkflowDef(
            "rv-branch-wait",
            (
                StateDef("w", BranchesToC(), mode="wait-for-callback", timeout_s=60),
                StateDef("b", b, timeout_s=60),
                StateDef("c", c_, timeout_s=60),
            ),
        ),
        replace=True,
    )
    sid = applied(store, wf.name)
    cond = Conductor(store, clock=LoopClock())

    async def go() -> dict[int, str]:
        task = asyncio.create_task(cond.run(strategy_ids=[sid]))
        await asyncio.sleep(1)
        (step,) = queries.list_steps(store, sid)
        cond.receive_callback(step["step"], "w", "done", "agent: done")
        return await asyncio.wait_for(task, 60)

    assert on_virtual_time(go())[sid] == "complete"
    moves = [h["to"] for h in queries.history(store, sid)]
    assert moves == ["w", "c", "complete"], moves


def test_a_callback_for_a_strategy_aborted_before_it_started_is_answered(store: Store) -> None:
    """G6: every callback is recorded applied or ignored with a reason. A callback
    stored for a step of a strategy not applied yet stays open; request_abort on the
    initial strategy aborts every step in its own transaction (admin.py request_abort,
    INITIAL branch) but, unlike end_strategy, leaves its open callbacks unanswered for
    ever (no conductor will ever drive the strategy)."""
    add_sim_targets(store, 1)

    wf = get_workflow("clean")
    assert wf is not None
    sid = admin.create_strategy(store, wf, StrategyOptions(), all_targets=True)
    (step,) = queries.list_steps(store, sid)
    accept_callback(store, step["step"], "wait-for-agent", "done", "agent up", 1.0)
    # the caller is told it was never applied (aborted at once), and asking again is
    # answered with the state it is in
    assert admin.request_abort(store, sid) == "initial"
    assert queries.get_strategy(store, sid)["state"] == "aborted"
    assert admin.request_abort(store, sid) == "aborted"
    outcomes = [(o["outcome"], o["reason"]) for o in callback_outcomes(store, sid)]
    assert all(o is not None and r for o, r in outcomes), outcomes


def test_a_wait_for_a_callback_says_it_is_not_retried(store: Store) -> None:
    add_sim_targets(store, 1, settings={"callback_lost_rate": 1.0})
    clean = get_workflow("clean")
    assert clean is not None
    states = tuple(
        StateDef(s.name, s.action, timeout_s=5, mode=s.mode, attempts_max=3)
        if s.name == "wait-for-agent"
        else s
        for s in clean.states
    )
    register_workflow(WorkflowDef("clean-3", states), replace=True)
    sid = applied(store, "clean-3")
    c = Conductor(store, clock=LoopClock())
    assert on_virtual_time(asyncio.wait_for(c.run(strategy_ids=[sid]), 3600))[sid] == "failed"
    (step,) = queries.list_steps(store, sid)
    assert step["details"] == (
        "wait-for-agent: timed out after 5s waiting for the target's callback "
        "(attempt 1 of 3; a wait for a callback is not retried)"
    )


def test_a_heartbeat_extends_its_waiting_states_deadline(store: Store) -> None:
    """An agent that sends heartbeats keeps its step's wait alive: each one moves the
    state's deadline to a full timeout after it (issue 27), so a clean step that takes
    longer than its timeout, reporting all along, is not failed as lost."""
    add_sim_targets(store, 1)
    wf = register_workflow(
        WorkflowDef(
            "agent-with-heartbeats",
            (StateDef("agent", _Kicked(), mode="wait-for-callback", timeout_s=10),),
        ),
        replace=True,
    )
    sid = applied(store, wf.name)
    (step,) = [s["step"] for s in queries.list_steps(store, sid)]
    c = Conductor(store, clock=LoopClock())

    async def go() -> dict[int, str]:
        loop = asyncio.get_running_loop()
        for at in (5.0, 10.0, 15.0):
            loop.call_at(at, c.receive_callback, step, "agent", "heartbeat", "still going")
        loop.call_at(22.0, c.receive_callback, step, "agent", "done", "finished")
        return await asyncio.wait_for(c.run(strategy_ids=[sid]), 120)

    assert on_virtual_time(go())[sid] == "complete"
    assert [s["state"] for s in queries.list_steps(store, sid)] == ["complete"]
    # each heartbeat moved the deadline (on the record: an event and its answer)
    moved = queries.strategy_events(store, sid, "deadline-extended")
    assert [e["details"].split(",")[0] for e in moved] == [
        f"agent: deadline moved to {_utc(EPOCH + at + 10)}" for at in (5, 10, 15)
    ]
    answers = [(o["kind"], o["outcome"], o["reason"]) for o in callback_outcomes(store, sid)]
    assert answers == [
        *(
            ("heartbeat", "applied", f"heartbeat: deadline moved to {_utc(EPOCH + at + 10)}")
            for at in (5, 10, 15)
        ),
        ("done", "applied", "moved the step on from agent"),
    ], answers


def test_a_wait_whose_heartbeats_stop_times_out_a_full_timeout_after_the_last(
    store: Store,
) -> None:
    """Heartbeats at 5s and 12s of a 10s wait: the step's row says so while it waits
    (a takeover goes on from it), and the wait runs out at 22s, not 10s nor 15s."""
    add_sim_targets(store, 1)
    wf = register_workflow(
        WorkflowDef(
            "agent-heartbeats-then-silence",
            (StateDef("agent", _Kicked(), mode="wait-for-callback", timeout_s=10),),
        ),
        replace=True,
    )
    sid = applied(store, wf.name)
    (step,) = [s["step"] for s in queries.list_steps(store, sid)]
    c = Conductor(store, clock=LoopClock())
    rows: dict[float, float | None] = {}

    def read_row(at: float) -> None:
        rows[at] = queries.get_step(store, step)["deadline_at"]

    async def go() -> dict[int, str]:
        loop = asyncio.get_running_loop()
        for at in (5.0, 12.0):
            loop.call_at(at, c.receive_callback, step, "agent", "heartbeat", "still going")
        for at in (1.0, 6.0, 13.0):
            loop.call_at(at, read_row, at)
        return await asyncio.wait_for(c.run(strategy_ids=[sid]), 120)

    assert on_virtual_time(go())[sid] == "failed"
    assert rows == {1.0: EPOCH + 10, 6.0: EPOCH + 15, 13.0: EPOCH + 22}, rows
    ended = queries.history(store, sid)[-1]
    assert ended["to"] == "failed"
    assert ended["at"] == pytest.approx(EPOCH + 22, abs=0.5)
    assert ended["details"] == (
        f"agent: timed out 10s after the target's last heartbeat ({_utc(EPOCH + 12)}) "
        "waiting for the target's callback (attempt 1 of 1)"
    )


def test_a_heartbeat_on_a_state_that_does_not_wait_is_only_noted(store: Store) -> None:
    """A running action's deadline is its own: a heartbeat moves only a wait's."""
    add_sim_targets(store, 1)
    wf = register_workflow(
        WorkflowDef("runs-long", (StateDef("work", _Sleeps(8.0), timeout_s=5),)),
        replace=True,
    )
    sid = applied(store, wf.name)
    (step,) = [s["step"] for s in queries.list_steps(store, sid)]
    c = Conductor(store, clock=LoopClock())

    async def go() -> dict[int, str]:
        loop = asyncio.get_running_loop()
        loop.call_at(2.0, c.receive_callback, step, "work", "heartbeat", "still going")
        return await asyncio.wait_for(c.run(strategy_ids=[sid]), 120)

    assert on_virtual_time(go())[sid] == "failed"
    answers = [(o["outcome"], o["reason"]) for o in callback_outcomes(store, sid)]
    assert answers == [("applied", "heartbeat noted")]
    assert queries.strategy_events(store, sid, "deadline-extended") == []


def test_a_heartbeat_that_comes_after_its_states_report_is_ignored_not_applied(
    store: Store,
) -> None:
    """Found by the HTTP agents' test (a flaky 8 applied for 7 waits): a report and a
    heartbeat of the same wait picked up together (one poll of callbacks stored by the
    API's process) were both marked applied, the heartbeat as "heartbeat noted", since
    the step was still in that state until its worker read the report. The state had
    its callback: the heartbeat is ignored, saying so. One that comes first is still
    applied (it moves the deadline)."""
    add_sim_targets(store, 2)
    wf = register_workflow(
        WorkflowDef(
            "agent-done-and-heartbeat",
            (StateDef("agent", _Kicked(), mode="wait-for-callback", timeout_s=10),),
        ),
        replace=True,
    )
    sid = applied(store, wf.name)
    first, second = sorted(s["step"] for s in queries.list_steps(store, sid))
    c = Conductor(store, clock=LoopClock())

    def both(step: int, kinds: tuple[str, str]) -> None:
        # (in one turn of the loop: the dispatcher takes both in one batch, in order)
        for kind in kinds:
            c.receive_callback(step, "agent", kind, kind)

    async def go() -> dict[int, str]:
        loop = asyncio.get_running_loop()
        loop.call_at(2.0, both, first, ("done", "heartbeat"))
        loop.call_at(2.0, both, second, ("heartbeat", "done"))
        return await asyncio.wait_for(c.run(strategy_ids=[sid]), 120)

    assert on_virtual_time(go())[sid] == "complete"
    answers = {
        (o["step"], o["kind"]): (o["outcome"], o["reason"]) for o in callback_outcomes(store, sid)
    }
    assert answers == {
        (first, "done"): ("applied", "moved the step on from agent"),
        (first, "heartbeat"): ("ignored", "late: state agent already had its callback"),
        (second, "heartbeat"): (
            "applied",
            f"heartbeat: deadline moved to {_utc(EPOCH + 12)}",
        ),
        (second, "done"): ("applied", "moved the step on from agent"),
    }, answers
    assert check(store, sid).ok


def test_a_callback_answered_by_another_moves_its_step_not_at_all(store: Store) -> None:
    """Exactly once by design: a callback that moves its step is marked applied in the
    transaction of that move, with a compare-and-set (still open), and the move is
    written only if that mark is. One answered meanwhile by another (here by hand, as a
    conductor sharing the strategy or an operator's command would) refuses the move:
    the step is taken over where it is (its recover hook decides: here, to wait
    again), and the next report moves it."""
    add_sim_targets(store, 1)
    wf = register_workflow(
        WorkflowDef(
            "agent-answered-elsewhere",
            (StateDef("agent", _KickedAgain(), mode="wait-for-callback", timeout_s=10),),
        ),
        replace=True,
    )
    sid = applied(store, wf.name)
    (step,) = [s["step"] for s in queries.list_steps(store, sid)]
    c = Conductor(store, clock=LoopClock())

    def answered_elsewhere() -> None:
        cb = c.receive_callback(step, "agent", "done", "first")
        with store.write() as conn:  # (before the dispatcher's turn hands it to the wait)
            conn.execute(
                update(callbacks)
                .where(callbacks.c.id == cb.id)
                .values(outcome="ignored", reason="answered elsewhere")
            )

    async def go() -> dict[int, str]:
        loop = asyncio.get_running_loop()
        loop.call_at(2.0, answered_elsewhere)
        loop.call_at(5.0, c.receive_callback, step, "agent", "done", "second")
        return await asyncio.wait_for(c.run(strategy_ids=[sid]), 120)

    assert on_virtual_time(go())[sid] == "complete"
    answers = [(o["outcome"], o["reason"]) for o in callback_outcomes(store, sid)]
    assert answers == [
        ("ignored", "answered elsewhere"),
        ("applied", "moved the step on from agent"),
    ], answers
    moves = [(h["from"], h["to"], h["details"]) for h in queries.history(store, sid)]
    assert moves[-1] == ("agent", "complete", "second"), moves
    assert [m for m in moves if m[0] == "agent"] == [moves[-1]]
    refused = queries.strategy_events(store, sid, "transition-rejected")
    assert [e["details"].split(": ")[-1] for e in refused] == [
        "its callback was answered already"
    ], refused
    assert check(store, sid).ok


def test_the_writer_refuses_a_move_whose_callback_was_answered_already(store: Store) -> None:
    """The writer's part of the above, both paths: the batch's fast path falls back to
    row by row, which refuses that move only (the other step's is written)."""
    add_sim_targets(store, 2)
    wf = register_workflow(
        WorkflowDef(
            "agent-two-moves",
            (StateDef("agent", _Kicked(), mode="wait-for-callback", timeout_s=10),),
        ),
        replace=True,
    )
    sid = applied(store, wf.name)
    one, two = sorted(s["step"] for s in queries.list_steps(store, sid))
    writer = rt.TransitionWriter(store, "c1")
    enter = [rt.Transition(s, sid, "initial", 0, "agent", 1, "", 0) for s in (one, two)]
    assert writer.commit(enter, [], 1.0).rejected == []
    first = accept_callback(store, one, "agent", "done", "", 2.0)
    other = accept_callback(store, two, "agent", "done", "", 2.0)
    with store.write() as conn:
        conn.execute(
            update(callbacks)
            .where(callbacks.c.id == first.id)
            .values(outcome="applied", reason="by another")
        )
    moves = [rt.Transition(s, sid, "agent", 1, "complete", 1, "done", 1) for s in (one, two)]
    marks = [
        rt.CallbackMark(cb.id, "applied", "moved the step on from agent", sid, cb.step_id)
        for cb in (first, other)
    ]
    result = writer.commit(moves, [], 3.0, marks)
    assert result.rejected == [moves[0]] and result.answered == {one}
    states = {s["step"]: s["state"] for s in queries.list_steps(store, sid)}
    assert states == {one: "agent", two: "complete"}
    answers = {o["step"]: (o["outcome"], o["reason"]) for o in callback_outcomes(store, sid)}
    assert answers == {
        one: ("applied", "by another"),
        two: ("applied", "moved the step on from agent"),
    }


class _KickedAgain(_Kicked):
    async def recover(self, ctx: ActionContext) -> Outcome:
        return Advance()  # (taken over: its target is asked again, and it waits again)


class _Sleeps(StateAction):
    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    async def run(self, ctx: ActionContext) -> Outcome:
        await asyncio.sleep(self.seconds)
        return Advance()


EPOCH = LoopClock().epoch


def _utc(at: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(at)) + "Z"
