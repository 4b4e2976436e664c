"""Races between deadlines, lease loss, clean stops and takeovers (found in review).

Each test is a sequence a conductor must survive without stranding a step, acting
after it lost a strategy, or forgetting what a clean stop recorded.
"""

from __future__ import annotations

import asyncio

import pytest
from sqlalchemy import select, update

from conftest import add_sim_targets, applied
from fleetwave import ActionContext, Advance, Outcome, StateAction, TransientError
from fleetwave.domain.models import StrategyOptions
from fleetwave.domain.registry import register_workflow
from fleetwave.domain.rules import Decision
from fleetwave.domain.workflow import StateDef, WorkflowDef
from fleetwave.domain.yaml_workflow import parse_workflow_yaml
from fleetwave.drivers.sim import SimDriver
from fleetwave.engine.clock import LoopClock
from fleetwave.engine.conductor import Conductor
from fleetwave.engine.config import EngineConfig
from fleetwave.engine.messages import ActionFinished, LeaseLost, RetryAnswer, RetryScheduled
from fleetwave.store import admin, queries
from fleetwave.store.db import Store
from fleetwave.store.schema import journal, strategies
from fleetwave.testing.invariants import check
from fleetwave.testing.vloop import VirtualTimeLoop
from test_deadlines import LeaksCancellation


class SwallowsTimeout(StateAction):
    """Hangs; when cancelled (its deadline) it cleans up and reports done (swallows it)."""

    async def run(self, ctx: ActionContext) -> Outcome:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            return Advance(details="gave up waiting")
        return Advance()


def test_a_swallowed_deadline_does_not_poison_the_workers_later_states(
    store: Store,
) -> None:
    add_sim_targets(store, 1)
    wf = register_workflow(
        WorkflowDef(
            "swallow-then-leak",
            (
                StateDef("a", SwallowsTimeout(), timeout_s=0.05),
                StateDef("b", LeaksCancellation(), timeout_s=5),
            ),
        ),
        replace=True,
    )
    sid = applied(store, wf.name)
    # Expected (as in test_a_cancelled_error_escaping_an_action_fails_the_step):
    # the step fails with "b: action raised CancelledError". Actual: the worker's
    # cancel count is still 1 from a's deadline, so b's CancelledError is taken for
    # "the conductor is stopping this worker": it dies without reporting, the step
    # keeps its slot forever and run() never returns.
    result = asyncio.run(asyncio.wait_for(Conductor(store).run(strategy_ids=[sid]), 5))
    assert result[sid] == "failed"
    (step,) = queries.list_steps(store, sid)
    assert step["details"] == "b: action raised CancelledError"


class CountsAndHangs(StateAction):
    def __init__(self) -> None:
        self.runs = 0
        self.conductor: Conductor | None = None
        self.sid = 0

    async def run(self, ctx: ActionContext) -> Outcome:
        self.runs += 1
        c = self.conductor
        assert c is not None
        if self.runs == 1:
            # The conductor learns it lost the strategy in the very loop turn in which
            # this attempt's deadline comes due (the dispatcher's _drop_run and the
            # deadline timer both run before this worker resumes).
            ((when, _, _),) = c._deadlines
            asyncio.get_running_loop().call_at(when, c._drop_run, self.sid)
        await asyncio.sleep(3600)
        return Advance()


def test_a_deadline_and_a_lease_loss_in_one_turn_stop_the_worker(store: Store) -> None:
    add_sim_targets(store, 1)
    action = CountsAndHangs()
    wf = register_workflow(
        WorkflowDef(
            "hang-retry",
            (StateDef("a", action, timeout_s=0.1, attempts_max=3, backoff_s=0.01),),
        ),
        replace=True,
    )
    sid = applied(store, wf.name)
    c = Conductor(store)
    action.conductor, action.sid = c, sid

    async def go() -> dict[int, str]:
        task = asyncio.create_task(c.run(strategy_ids=[sid]))
        await asyncio.sleep(1.0)
        return await asyncio.wait_for(task, 5)

    result = asyncio.run(go())
    assert result[sid] == "lost"
    # After the lease was lost, this conductor must not touch the target again (G2).
    assert action.runs == 1


class Quick(StateAction):
    async def run(self, ctx: ActionContext) -> Outcome:
        await asyncio.sleep(1)
        return Advance()


class LongOp(StateAction):
    """A 600 s state whose recover hook watches the target until it is done."""

    async def run(self, ctx: ActionContext) -> Outcome:
        await asyncio.sleep(3600)
        return Advance()

    async def recover(self, ctx: ActionContext) -> Outcome:
        await asyncio.sleep(3600)
        return Advance()


def test_a_fresh_start_after_a_clean_stop_gets_a_fresh_deadline(store: Store) -> None:
    """a -> b is entered while A drains (not started); B starts b 1000 s later and dies
    60 s into it; C's recover hook should get ~540 s + grace, not grace alone."""
    add_sim_targets(store, 1)
    wf = register_workflow(
        WorkflowDef(
            "drain-then-long",
            (StateDef("a", Quick(), timeout_s=10), StateDef("b", LongOp(), timeout_s=600)),
        ),
        replace=True,
    )
    sid = applied(store, wf.name)
    config = EngineConfig(lease_ttl_s=10, tick_s=1, recover_grace_s=5)
    a, b, c = (Conductor(store, clock=LoopClock(), config=config) for _ in range(3))
    c_started = 0.0

    async def go() -> dict[int, str]:
        nonlocal c_started
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        loop.call_later(0.5, stop.set)  # clean stop while a runs: b is entered, not started
        await a.run(strategy_ids=[sid], stop=stop)
        (step,) = queries.list_steps(store, sid)
        assert step["state"] == "b"
        await asyncio.sleep(1000)  # nobody drives it for a while
        crashed = asyncio.create_task(b.run(strategy_ids=[sid]))
        await asyncio.sleep(60)  # b started afresh 60 s ago (600 s timeout)
        crashed.cancel()  # B dies without handing its leases back
        await asyncio.gather(crashed, return_exceptions=True)
        c_started = loop.time()
        return await c.run(strategy_ids=[sid], patient=True)

    loop = VirtualTimeLoop()
    try:
        assert loop.run_until_complete(go())[sid] == "failed"
        ended = loop.time()
    finally:
        loop.close()
    # b had ~540 s left when B died: C's recover hook should get about that (+5 s).
    assert ended - c_started > 500


def _steal(store: Store, sid: int) -> None:
    """Another conductor claims the strategy (fence + 1), as claim_strategies would."""
    with store.write() as conn:
        conn.execute(
            update(strategies)
            .where(strategies.c.id == sid)
            .values(owner="c-other", fence=strategies.c.fence + 1, lease_expires_at=4e9)
        )


class StolenWhileRunning(StateAction):
    def __init__(self) -> None:
        self.conductor: Conductor | None = None
        self.store: Store | None = None
        self.sid = 0

    async def run(self, ctx: ActionContext) -> Outcome:
        assert self.conductor is not None and self.store is not None
        await asyncio.sleep(0.05)
        _steal(self.store, self.sid)
        # the periodic pass notices the new owner just as this action reports
        asyncio.get_running_loop().call_soon(self.conductor.post, LeaseLost(self.sid))
        return Advance()


def test_an_outcome_and_a_lease_loss_in_one_batch_write_nothing(
    store: Store,
) -> None:
    add_sim_targets(store, 1)
    action = StolenWhileRunning()
    wf = register_workflow(
        WorkflowDef("stolen", (StateDef("a", action), StateDef("b", Quick()))), replace=True
    )
    sid = applied(store, wf.name)
    c = Conductor(store)
    action.conductor, action.store, action.sid = c, store, sid
    assert asyncio.run(asyncio.wait_for(c.run(strategy_ids=[sid]), 10))[sid] == "lost"
    with store.read() as conn:
        rows = conn.execute(select(journal.c.conductor, journal.c.to_state)).all()
    # c was fenced off (and knew it) before this commit: it must write nothing more.
    assert (c.id, "b") not in [tuple(r) for r in rows]


def test_a_draining_conductor_claims_nothing_and_keeps_not_started_marks(
    store: Store,
) -> None:
    """A stops cleanly with S2's step entered in b (marked not started). B, itself
    draining, claims S2 on its periodic pass, takes the step over (clearing the mark),
    never starts it, and hands it back: C then calls b's (missing) recover hook."""
    add_sim_targets(store, 1, prefix="s")
    add_sim_targets(store, 1, prefix="l")
    short = register_workflow(
        WorkflowDef("two-quick", (StateDef("a", Quick()), StateDef("b", Quick()))), replace=True
    )
    long_ = register_workflow(
        WorkflowDef("one-long", (StateDef("x", LongOp(), timeout_s=600),)), replace=True
    )
    s2 = admin.create_strategy(store, short, StrategyOptions(), target_names=["s00000"])
    s1 = admin.create_strategy(store, long_, StrategyOptions(), target_names=["l00000"])
    admin.apply_strategy(store, s2)
    config = EngineConfig(lease_ttl_s=10, tick_s=1, shutdown_grace_s=10)
    a, b, c = (Conductor(store, clock=LoopClock(), config=config) for _ in range(3))

    async def go() -> dict[int, str]:
        loop = asyncio.get_running_loop()
        stop_a, stop_b = asyncio.Event(), asyncio.Event()
        task_a = asyncio.create_task(a.run(stop=stop_a))  # serves s2
        await asyncio.sleep(0.2)
        admin.apply_strategy(store, s1)
        task_b = asyncio.create_task(b.run(stop=stop_b))  # serves s1 (s2 is A's)
        await asyncio.sleep(0.1)
        loop.call_later(0.2, stop_a.set)  # A drains: a ends at t=1, b entered, not started
        loop.call_later(5, stop_b.set)  # B drains for 10 s (x runs 3600 s)
        await asyncio.gather(task_a, task_b)
        return await c.run(strategy_ids=[s2])

    loop = VirtualTimeLoop()
    try:
        result = loop.run_until_complete(go())
    finally:
        loop.close()
    (step,) = queries.list_steps(store, s2)
    assert result[s2] == "complete", step["details"]


def test_a_clean_stop_returns_once_running_actions_have_committed(store: Store) -> None:
    add_sim_targets(store, 1)
    wf = register_workflow(
        WorkflowDef("two-quick2", (StateDef("a", Quick()), StateDef("b", Quick()))), replace=True
    )
    applied(store, wf.name)
    c = Conductor(store, clock=LoopClock(), config=EngineConfig(shutdown_grace_s=10))

    async def go() -> float:
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        loop.call_later(0.5, stop.set)  # a ends at 1.0, its outcome commits, nothing runs
        await c.run(stop=stop)
        return loop.time()

    loop = VirtualTimeLoop()
    try:
        ended = loop.run_until_complete(go())
    finally:
        loop.close()
    # Nothing is left running at t=1.0; the drain should not sit out its 10 s grace.
    assert ended < 2.0, ended


def test_a_state_never_started_is_not_started_by_the_next_owner_of_an_aborted_strategy(
    store: Store,
) -> None:
    """Stopped cleanly with b entered but not started, then aborted: b must never run."""
    add_sim_targets(store, 2)
    runs: list[str] = []

    class Recorded(StateAction):
        async def run(self, ctx: ActionContext) -> Outcome:
            runs.append(ctx.state)
            await asyncio.sleep(1)
            return Advance()

    wf = register_workflow(
        WorkflowDef("abort-after-stop", (StateDef("a", Recorded()), StateDef("b", Recorded()))),
        replace=True,
    )
    sid = applied(store, wf.name)
    config = EngineConfig(shutdown_grace_s=10)

    async def go() -> dict[int, str]:
        stop = asyncio.Event()
        asyncio.get_running_loop().call_later(0.5, stop.set)
        await Conductor(store, clock=LoopClock(), config=config).run(stop=stop)
        admin.request_abort(store, sid)
        return await Conductor(store, clock=LoopClock(), config=config).run(strategy_ids=[sid])

    loop = VirtualTimeLoop()
    try:
        assert loop.run_until_complete(go())[sid] == "aborted"
    finally:
        loop.close()
    assert runs == ["a", "a"]
    details = {s["details"] for s in queries.list_steps(store, sid)}
    assert details == {"stopped before b started: aborted by operator"}
    assert check(store, sid).ok


def _completed_with(
    store: Store, name: str, action: ReportsAStaleRetry | ReportsAnOldFencesOutcome
) -> int:
    """One target through a one-state workflow ``name`` whose action posts to the
    conductor (given it here): the strategy's id, once it completed."""
    add_sim_targets(store, 1)
    wf = register_workflow(WorkflowDef(name, (StateDef("a", action),)), replace=True)
    sid = applied(store, wf.name)
    c = Conductor(store)
    action.conductor = c
    assert asyncio.run(asyncio.wait_for(c.run(strategy_ids=[sid]), 10))[sid] == "complete"
    return sid


class ReportsAStaleRetry(StateAction):
    """Posts a retry record for its own step at a fence it no longer holds (as a worker
    fenced off by a takeover would), and keeps the answer."""

    def __init__(self) -> None:
        self.conductor: Conductor | None = None
        self.answer: RetryAnswer | None = None

    async def run(self, ctx: ActionContext) -> Outcome:
        assert self.conductor is not None
        handled: asyncio.Future[RetryAnswer] = asyncio.get_running_loop().create_future()
        self.conductor.post(
            RetryScheduled(ctx.strategy_id, ctx.step_id, ctx.state, 999, 0.0, 2, "stale", handled)
        )
        self.answer = await handled
        return Advance()


def test_a_stale_retry_record_is_refused_not_allowed(store: Store) -> None:
    """A retry reported at a fence the step no longer has (its worker fenced off, the
    step another worker's) was answered "go ahead": only cancelling that worker kept
    it from running the state beside the step's new worker (G2)."""
    action = ReportsAStaleRetry()
    sid = _completed_with(store, "stale-retry", action)
    assert action.answer is RetryAnswer.REFUSED
    (step,) = queries.list_steps(store, sid)
    assert step["attempt"] == 1 and step["details"] == ""  # nothing of it was recorded


BACKOFF_YAML = """\
name: backoff-100
states:
  - name: op
    timeout_s: 600
    retry: {attempts: 3, backoff_s: 100, backoff_max_s: 100}
"""


@pytest.mark.parametrize("restart_at", [10.0, 150.0])
def test_a_clean_stop_during_a_backoff_starts_no_retry_and_the_next_owner_runs_it(
    store: Store, restart_at: float
) -> None:
    """A clean stop waited out the grace period with nothing running and started the
    retry meanwhile ("starts nothing new" said the README); the next owner then ran the
    retry at once, cutting its backoff short, or (taking over after it was due) had its
    recover hook take attempt 1's failure for attempt 2's, so attempt 2 never ran. Now
    the stop returns at once, the row marks the retry not started, and the next owner
    starts it as attempt 2 when it is due (audit and review of session 11)."""
    add_sim_targets(store, 1, settings={"latency_ms": 1, "flaky_rate": 1.0})
    register_workflow(parse_workflow_yaml(BACKOFF_YAML, strict=True), replace=True)
    sid = applied(store, "backoff-100")
    sim = SimDriver(seed=1)
    sim.count_starts = True
    config = EngineConfig(tick_s=1, shutdown_grace_s=30)
    first, second = (
        Conductor(store, clock=LoopClock(), drivers={"sim": sim}, config=config) for _ in range(2)
    )
    times: dict[str, float] = {}

    async def go() -> dict[int, str]:
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        loop.call_later(10, stop.set)  # attempt 1 failed at once; attempt 2 is due at 100
        await first.run(strategy_ids=[sid], stop=stop)
        times["first_returned"] = loop.time()
        (step,) = queries.list_steps(store, sid)
        assert step["attempt"] == 2 and step["details"].startswith(
            "attempt 2 not started: it starts, once due, when a conductor drives"
        ), step
        await asyncio.sleep(restart_at - loop.time())
        return await second.run(strategy_ids=[sid])

    loop = VirtualTimeLoop()
    try:
        assert loop.run_until_complete(go())[sid] == "failed"
    finally:
        loop.close()
    assert times["first_returned"] < 11  # not after the 30 s grace
    started = {attempt: t for _, _, attempt, t in sim.retried_at}
    assert sorted(started) == [2, 3]
    assert started[2] >= max(100, restart_at)  # when due, not at the takeover
    assert started[3] >= started[2] + 100
    assert dict(sim.starts) == {("t00000", "op", n): 1 for n in (1, 2, 3)}


@pytest.mark.parametrize("abort_at", [None, 93.0])
def test_a_stalled_owner_waiting_out_a_taken_over_retry_starts_nothing(
    store: Store, abort_at: float | None
) -> None:
    """A conductor that takes a recorded retry over waits until it is due; stalled
    meanwhile (no renewals, no self-fencing) and taken over by another, it started the
    attempt anyway, beside the new owner, or after the new owner saw an abort: its start
    was not checked in a commit (review of session 11)."""
    add_sim_targets(store, 1, settings={"latency_ms": 1, "flaky_rate": 1.0})
    register_workflow(parse_workflow_yaml(BACKOFF_YAML, strict=True), replace=True)
    sid = applied(store, "backoff-100")
    sim = SimDriver(seed=1)
    sim.count_starts = True
    clock = LoopClock()
    first = Conductor(store, clock=clock, drivers={"sim": sim}, config=EngineConfig(tick_s=1))
    stalled = Conductor(
        store,
        clock=clock,
        drivers={"sim": sim},
        config=EngineConfig(tick_s=25, lease_ttl_s=80, renew_leases=False),
    )
    rival = Conductor(store, clock=clock, drivers={"sim": sim}, config=EngineConfig(tick_s=1))

    async def go() -> dict[int, str]:
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        loop.call_later(10, stop.set)
        await first.run(strategy_ids=[sid], stop=stop)
        zombie = asyncio.ensure_future(stalled.run(strategy_ids=[sid], patient=True))
        await asyncio.sleep(1)
        if abort_at is not None:
            loop.call_at(abort_at, admin.request_abort, store, sid)
        result = await rival.run(strategy_ids=[sid], patient=True)
        await asyncio.wait_for(zombie, 1000)
        return result

    loop = VirtualTimeLoop()
    try:
        final = loop.run_until_complete(go())[sid]
    finally:
        loop.close()
    assert all(n == 1 for n in sim.starts.values()), sim.starts
    if abort_at is None:
        assert final == "failed"
    else:
        assert final == "aborted"
        assert all(t < abort_at for *_, t in sim.retried_at), sim.retried_at
    assert check(store, sid).ok


def test_an_abort_just_before_a_taken_over_retry_is_due_stops_it(store: Store) -> None:
    """The takeover's side of a bug hunt's finding: a conductor that took over a recorded
    retry waits until it is due, and an abort committed less than a tick before then
    was not read by the commit recording the retry's start: the retry started after
    `strategy abort` returned. That commit reads the strategy's state now."""
    add_sim_targets(store, 1, settings={"latency_ms": 1, "flaky_rate": 1.0})
    register_workflow(parse_workflow_yaml(BACKOFF_YAML, strict=True), replace=True)
    sid = applied(store, "backoff-100")
    sim = SimDriver(seed=1)
    sim.count_starts = True
    first = Conductor(store, clock=LoopClock(), drivers={"sim": sim}, config=EngineConfig(tick_s=1))
    # its ticks at about 60 and 110 s: the abort at 95 s is not read before 100 s
    second = Conductor(
        store, clock=LoopClock(), drivers={"sim": sim}, config=EngineConfig(tick_s=50)
    )

    async def go() -> dict[int, str]:
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        loop.call_later(10, stop.set)  # attempt 1 failed at once; attempt 2 is due at 100
        await first.run(strategy_ids=[sid], stop=stop)
        loop.call_at(95.0, admin.request_abort, store, sid)
        return await second.run(strategy_ids=[sid])

    loop = VirtualTimeLoop()
    try:
        assert loop.run_until_complete(go())[sid] == "aborted"
    finally:
        loop.close()
    assert dict(sim.starts) == {("t00000", "op", 1): 1}  # attempt 2 never started
    (step,) = queries.list_steps(store, sid)
    assert step["state"] == "aborted", step
    assert step["details"] == "op: attempt 2 of 3 not started: aborted by operator", step
    assert check(store, sid).ok


class ReportsAnOldFencesOutcome(StateAction):
    """Posts, for its own step and state, an outcome at a fence below the step's (as a
    worker fenced off by a takeover, still running the same state, would), then ends."""

    def __init__(self) -> None:
        self.conductor: Conductor | None = None

    async def run(self, ctx: ActionContext) -> Outcome:
        assert self.conductor is not None
        stale = Decision("failed", "a: reported by a worker fenced off")
        self.conductor.post(ActionFinished(ctx.strategy_id, ctx.step_id, ctx.state, 0, stale, 1))
        await asyncio.sleep(0.05)  # the dispatcher handles it before this worker reports
        return Advance()


def test_an_outcome_from_an_old_fence_in_the_same_state_is_ignored(store: Store) -> None:
    """G2: only the worker at the step's fence decides its state (found unpinned by a
    mutation audit: the state alone would have let the old worker's outcome through)."""
    sid = _completed_with(store, "old-fence", ReportsAnOldFencesOutcome())
    (step,) = queries.list_steps(store, sid)
    assert step["state"] == "complete"
    kinds = [e["kind"] for e in queries.strategy_events(store, sid)]
    assert kinds.count("stale-outcome-ignored") == 1, kinds
    assert check(store, sid).ok


def test_a_retry_taken_over_says_it_started_while_it_runs(store: Store) -> None:
    """Found by a review: a retry started by the conductor that took it over kept the
    row's "attempt 2 from <a time now past>" while it ran, as if still to come."""
    seen: list[str] = []

    class BusyOnce(StateAction):
        async def run(self, ctx: ActionContext) -> Outcome:
            if ctx.attempt == 1:
                raise TransientError("busy")
            seen.append(str(queries.list_steps(store, ctx.strategy_id)[0]["details"]))
            return Advance()

    wf = WorkflowDef(
        "busy-once", (StateDef("op", BusyOnce(), timeout_s=600, attempts_max=3, backoff_s=100),)
    )
    register_workflow(wf, replace=True)
    add_sim_targets(store, 1)
    sid = applied(store, "busy-once")
    config = EngineConfig(tick_s=1, shutdown_grace_s=30)
    first, second = (Conductor(store, clock=LoopClock(), config=config) for _ in range(2))

    async def go() -> dict[int, str]:
        stop = asyncio.Event()
        asyncio.get_running_loop().call_later(10, stop.set)  # during the backoff
        await first.run(strategy_ids=[sid], stop=stop)
        return await second.run(strategy_ids=[sid])

    loop = VirtualTimeLoop()
    try:
        assert loop.run_until_complete(go())[sid] == "complete"
    finally:
        loop.close()
    (said,) = seen
    assert said.startswith("op: attempt 2 of 3 started "), said
    assert said.endswith("Z (a retry taken over)"), said
    failed = [e for e in queries.strategy_events(store, sid) if e["kind"] == "attempt-failed"]
    assert [e["details"].split("; ")[0] for e in failed] == ["op: busy (attempt 1 of 3)"]
