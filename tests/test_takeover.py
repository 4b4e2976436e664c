"""Taking a strategy over, or claiming it back, strands nothing.

Claiming a strategy back after this conductor's own renewals lapsed (a callback
already handed to a wait is offered again; ``apply --wait`` does not give up),
``apply --wait`` taking over from an owner that died, a failure limit crossed inside
the commit (a step moving on in it does not start its next state), an action's own
BaseException or TimeoutError, a branch chosen by a wait-for-callback state, the
callbacks of a strategy aborted before it started, ``check`` on a strategy no
conductor could drive, and a stop for failures named after a takeover.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Any

import pytest
from sqlalchemy import update
from sqlalchemy.exc import OperationalError

from conftest import add_sim_targets, applied, on_virtual_time
from fleetwave import ActionContext, Advance, Outcome, StateAction
from fleetwave.cli.drive import _drive
from fleetwave.domain.models import StrategyOptions
from fleetwave.domain.registry import get_workflow, register_workflow
from fleetwave.domain.workflow import DriverOperation, Skip, StateDef, WorkflowDef
from fleetwave.engine.clock import LoopClock
from fleetwave.engine.conductor import Conductor
from fleetwave.engine.config import EngineConfig
from fleetwave.store import admin, queries
from fleetwave.store import runtime as rt
from fleetwave.store.callbacks import accept_callback, callback_outcomes
from fleetwave.store.db import Store
from fleetwave.store.schema import strategies, targets
from fleetwave.testing.invariants import check


class StartsThenWaits(StateAction):
    """Starts a long operation on the target (the agent reports while it still runs);
    the recover hook sees it still running and goes on waiting for the callback."""

    async def run(self, ctx: ActionContext) -> Outcome:
        await asyncio.sleep(60)
        return Advance()

    async def recover(self, ctx: ActionContext) -> Outcome:
        return Advance()


def _lapse_a_renewal(monkeypatch: pytest.MonkeyPatch) -> None:
    """The second lease renewal meets 'database is locked' for ~11 s of retries: with a
    12 s lease the watchdog self-fences, and the database then answers again."""
    real = rt.heartbeat
    calls = {"n": 0}

    def flaky_heartbeat(*a: Any, **kw: Any) -> int:
        calls["n"] += 1
        if 2 <= calls["n"] <= 8:
            raise OperationalError("UPDATE", None, Exception("database is locked"))
        return real(*a, **kw)

    monkeypatch.setattr(rt, "heartbeat", flaky_heartbeat)


def test_callback_handed_to_a_wait_is_lost_when_the_strategy_is_self_fenced_and_reclaimed(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A callback handed to a step's wait, then the conductor self-fences (renewal
    overdue) and claims the strategy back: the callback is still open in the database,
    but its id is in _callbacks_seen, so neither the claim nor the periodic poll offers
    it again. The recover hook waits for a callback that was already stored: the step
    times out and fails although the target reported done."""
    add_sim_targets(store, 1)
    wf = register_workflow(
        WorkflowDef(
            "rv-selffence-cb",
            (StateDef("w", StartsThenWaits(), mode="wait-for-callback", timeout_s=600),),
        ),
        replace=True,
    )
    sid = applied(store, wf.name)
    _lapse_a_renewal(monkeypatch)
    c = Conductor(store, clock=LoopClock(), config=EngineConfig(lease_ttl_s=12, tick_s=1))

    async def serve() -> None:
        stop = asyncio.Event()
        asyncio.get_running_loop().call_later(3000, stop.set)
        task = asyncio.create_task(c.run(stop=stop))
        await asyncio.sleep(2)
        (step,) = queries.list_steps(store, sid)
        c.receive_callback(step["step"], "w", "done", "agent: done")
        await task

    on_virtual_time(serve())
    final = queries.get_strategy(store, sid)["state"]
    outcomes = [(o["outcome"], o["reason"]) for o in callback_outcomes(store, sid)]
    steps = [(s["state"], s["details"]) for s in queries.list_steps(store, sid)]
    assert final == "complete", (final, steps, outcomes)
    assert outcomes == [("applied", "moved the step on from w")]


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


def test_a_driving_conductor_that_fenced_itself_off_gives_up_although_nobody_took_over(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`strategy apply --wait` (run(strategy_ids=...)): a heartbeat that needs a few
    'database is locked' retries makes the lease watchdog drop the strategy
    (_watch_leases -> LeaseLost -> _drop_run marks it finished 'lost'); _should_exit then
    holds, so run() returns 'lost' and hands its leases back although no other conductor
    exists and the database answers again seconds later. The strategy is left 'applying'
    with nobody driving it, and apply --wait exits 1. (_watch_leases' docstring: once
    the database answers again, the strategy is claimed anew; only serve does that.)"""
    add_sim_targets(store, 1)
    wf = register_workflow(
        WorkflowDef("rv-selffence-wait", (StateDef("a", StartsThenWaits(), timeout_s=600),)),
        replace=True,
    )
    sid = applied(store, wf.name)
    _lapse_a_renewal(monkeypatch)
    c = Conductor(store, clock=LoopClock(), config=EngineConfig(lease_ttl_s=12, tick_s=1))
    result = on_virtual_time(asyncio.wait_for(c.run(strategy_ids=[sid], patient=True), 3600))
    st = queries.get_strategy(store, sid)["state"]
    assert (result[sid], st) == ("complete", "complete"), (result, st)


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


class OddBaseException(BaseException):
    """Like gevent's Timeout or a library's own cancellation: not an Exception."""


class RaisesBaseException(StateAction):
    async def run(self, ctx: ActionContext) -> Outcome:
        await asyncio.sleep(1)
        raise OddBaseException("library-internal interrupt")


def test_an_action_raising_a_base_exception_does_not_strand_its_step(store: Store) -> None:
    """_run_state catches CancelledError and Exception, not other BaseException
    subclasses: the worker task dies with it (_worker_ended only discards it), no
    ActionFinished is ever posted, the deadline timer sees a finished task and does
    nothing. The step keeps its slot in state 'a' for ever and run() never returns."""
    add_sim_targets(store, 1)
    wf = register_workflow(
        WorkflowDef("rv-baseexc", (StateDef("a", RaisesBaseException(), timeout_s=10),)),
        replace=True,
    )
    sid = applied(store, wf.name)
    c = Conductor(store, clock=LoopClock())

    async def go() -> dict[int, str]:
        return await asyncio.wait_for(c.run(strategy_ids=[sid]), 3600)

    try:
        result = on_virtual_time(go())
    except TimeoutError:
        result = {sid: "still running after an hour"}
    steps = [(s["state"], s["details"]) for s in queries.list_steps(store, sid)]
    assert result[sid] == "failed", (result, steps)


def test_check_does_not_flag_an_undrivable_strategy_with_a_failure_limit(store: Store) -> None:
    """A strategy no conductor can drive (its Python workflow changed its states since)
    is ended by _fail_undrivable: waiting steps 'aborted', details 'not started: cannot
    drive it: ...'. check() took any 'not started:' abort as a stop for the failure
    threshold; with max_failures (or stop on failure) set and no step failed, `fleetwave
    check` then reported a violation on a database the engine handled as designed."""

    add_sim_targets(store, 2)
    one = (StateDef("a", DriverOperation("a")),)
    register_workflow(WorkflowDef("rv-reshaped", one), replace=True)
    sid = admin.create_strategy(
        store,
        WorkflowDef("rv-reshaped", one),
        StrategyOptions(max_failures=0),
        all_targets=True,
    )
    other = (StateDef("b", DriverOperation("b")),)
    register_workflow(WorkflowDef("rv-reshaped", other), replace=True)
    admin.apply_strategy(store, sid)
    result = asyncio.run(Conductor(store).run(strategy_ids=[sid]))
    assert result == {sid: "failed"}
    verdict = check(store, sid)
    assert verdict.ok, verdict.violations


def test_apply_wait_watching_another_owner_takes_over_once_that_owner_dies(
    store: Store,
) -> None:
    """`strategy apply --wait` while another conductor drives the strategy: _drive runs
    a conductor without patient=True, gets 'owned', and from then on only polls the
    strategy's state until it is terminal. If that owner then dies (kill -9), its lease
    expires but the waiting process never takes over (G5: another conductor takes over
    without anyone typing a command); apply --wait hangs for ever with a conductor of
    its own right there."""

    add_sim_targets(store, 3, settings={"latency_ms": 300})
    sid = applied(store, "patch", max_parallel=3)
    cfg = EngineConfig(lease_ttl_s=1.0, tick_s=0.1)
    first = Conductor(store, config=cfg)

    async def go() -> str:
        owner = asyncio.create_task(first.run(strategy_ids=[sid]))
        await asyncio.sleep(0.2)
        waiting = asyncio.create_task(_drive(store, sid, False, cfg))
        await asyncio.sleep(0.2)
        owner.cancel()  # the owner dies without handing its leases back
        await asyncio.gather(owner, return_exceptions=True)
        try:
            return (await asyncio.wait_for(waiting, 15)).state
        except TimeoutError:
            st = queries.get_strategy(store, sid)["state"]
            return f"still waiting 15 s after the owner died; strategy {st}"

    state = asyncio.run(go())
    assert state == "complete", state


class ClientTimesOut(StateAction):
    """The action's own client gives up after 2 s (httpx, asyncssh and asyncio.timeout
    all raise the builtin TimeoutError)."""

    async def run(self, ctx: ActionContext) -> Outcome:
        await asyncio.sleep(2)
        raise TimeoutError("connect to bmc: timed out")


def test_an_actions_own_timeout_error_is_not_reported_as_the_state_deadline(
    store: Store,
) -> None:
    """_run_state catches the action's own TimeoutError in the same clause as the
    state's deadline and writes 'timed out after 600s' (the state's timeout): the
    record says the state ran for 10 minutes when the action failed after 2 s, and the
    client's message is dropped."""
    add_sim_targets(store, 1)
    wf = register_workflow(
        WorkflowDef("rv-client-timeout", (StateDef("a", ClientTimesOut(), timeout_s=600),)),
        replace=True,
    )
    sid = applied(store, wf.name)
    c = Conductor(store, clock=LoopClock())
    assert on_virtual_time(asyncio.wait_for(c.run(strategy_ids=[sid]), 60))[sid] == "failed"
    ((_, details),) = [(s["state"], s["details"]) for s in queries.list_steps(store, sid)]
    assert "600" not in details and "connect to bmc" in details, details


class SwallowsCancel(StateAction):
    """An action that swallows its cancellation and reports anyway (a library that
    catches too much): the report arrives after its strategy was dropped."""

    def __init__(self) -> None:
        self.task: asyncio.Task[Any] | None = None

    async def run(self, ctx: ActionContext) -> Outcome:
        self.task = asyncio.current_task()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.sleep(60)
        return Advance()


def test_the_worker_of_a_stale_report_ends(store: Store) -> None:
    """Its report is stale (the strategy is no longer driven here): the worker is told
    there is nothing more to do, instead of waiting until the conductor stops."""
    from sqlalchemy import update

    from fleetwave.engine.messages import LeaseLost
    from fleetwave.store.schema import strategies

    add_sim_targets(store, 1)
    action = SwallowsCancel()
    wf = register_workflow(WorkflowDef("swallows", (StateDef("a", action),)), replace=True)
    sid = applied(store, wf.name)
    c = Conductor(store, clock=LoopClock())
    seen: dict[str, bool] = {}

    async def serve() -> None:
        stop = asyncio.Event()
        task = asyncio.create_task(c.run(stop=stop))
        await asyncio.sleep(1)
        with store.write() as conn:  # another conductor took it over
            conn.execute(
                update(strategies)
                .where(strategies.c.id == sid)
                .values(owner="c-other", fence=strategies.c.fence + 1)
            )
        c.post(LeaseLost(sid))
        await asyncio.sleep(1)
        assert action.task is not None
        seen["worker_done"] = action.task.done()
        stop.set()
        await task

    on_virtual_time(serve())
    assert c.stats.stale_outcomes == 1
    assert seen["worker_done"]


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


@pytest.mark.parametrize(
    ("column", "value", "what"),
    [
        ("group_caps", "{oops", "its stored group caps are not readable"),
        ("group_caps", "[1, 2]", "its stored group caps are not a map of group to cap"),
        # readable, but a cap of 0 would start nothing of its group, for ever
        ("group_caps", '{"1": 0}', "its stored group caps are not a map of group to cap"),
        ("states", '"ab"', "its stored states are not a list of names"),
        ("states", "not json", "its stored states are not readable"),
        ("options", "{oops", ""),
    ],
)
def test_one_unreadable_strategy_row_fails_that_strategy_not_the_conductor(
    store: Store, column: str, value: str, what: str
) -> None:
    """Found by a bug hunt: a strategy row whose group caps (or states) a hand edit left
    unreadable stopped every conductor at its claim with a traceback (the claim of every
    strategy rolled back), so the healthy ones were never driven. That strategy alone
    now fails, saying why, as one whose options are unreadable did; show, list and
    check still answer."""
    names = add_sim_targets(store, 4)
    patch = get_workflow("patch")
    assert patch is not None
    good, bad = (
        admin.create_strategy(store, patch, StrategyOptions(), target_names=half)
        for half in (names[:2], names[2:])
    )
    for sid in (good, bad):
        admin.apply_strategy(store, sid)
    with store.write() as conn:
        conn.execute(update(strategies).where(strategies.c.id == bad).values({column: value}))
    finished = asyncio.run(asyncio.wait_for(Conductor(store).run(strategy_ids=[good, bad]), 60))
    assert finished == {good: "complete", bad: "failed"}, finished
    shown = queries.get_strategy(store, bad)
    assert shown["details"].startswith(f"cannot drive it: {what}"), shown["details"]
    option_fields = ("max_parallel", "apply_type", "stop_on_failure", "max_failures")
    if column == "options":
        # every option field says so, none shows as unset (max_failures showed null)
        assert {f: shown[f] for f in option_fields} == dict.fromkeys(
            option_fields, f"(unreadable: {value!r})"
        )
    assert {s["state"] for s in queries.list_steps(store, bad)} == {"aborted"}
    assert [s["id"] for s in queries.list_strategies(store)] == [good, bad]
    result = check(store)
    assert not result.ok
    assert result.violations == [
        f"strategy {bad}: its stored states, options or group caps are not readable "
        + result.violations[0].split("readable ", 1)[1]
    ]
    assert check(store, good).ok


@pytest.mark.parametrize(
    ("options", "final"),
    [
        ({"stop_on_failure": True}, "stopped after {who} failed (stop on failure)"),
        (
            {"max_failures": 0},
            "stopped: 1 failed step exceeds the failure threshold of 0 (the last: {who})",
        ),
    ],
)
def test_a_stop_for_failures_is_shown_while_it_lasts_and_named_after_a_takeover(
    store: Store, options: dict[str, Any], final: str
) -> None:
    """Found by an acceptance pass: while in-flight steps finished after a failure had
    stopped the strategy, `strategy show` said `applying` with no details (a rollout
    going well); and a conductor that took the strategy over (after a crash, or here a
    clean stop) ended it with "stopped after a step failed", the target's name lost."""
    names = add_sim_targets(store, 6, settings={"latency_ms": 3000})
    with store.write() as conn:  # the third fails at once, then the first
        for name, latency in ((names[2], 10), (names[0], 100)):
            settings = json.dumps({"fail_at": "pre-check", "latency_ms": latency})
            conn.execute(update(targets).where(targets.c.name == name).values(settings=settings))
    sid = applied(store, "patch", max_parallel=3, **options)
    seen: dict[str, Any] = {}

    async def go() -> dict[int, str]:
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        loop.call_at(0.2, lambda: seen.update(during=queries.get_strategy(store, sid)["details"]))
        loop.call_at(0.25, stop.set)  # a clean stop while the second is in its state
        first = Conductor(store, clock=LoopClock(), config=EngineConfig(shutdown_grace_s=0.1))
        seen["first"] = await first.run(strategy_ids=[sid], stop=stop)
        return await Conductor(store, clock=LoopClock()).run(strategy_ids=[sid])

    assert on_virtual_time(go())[sid] == "failed"
    assert seen["first"] == {}, seen  # it stopped without ending it: taken over
    reason = final.format(who=names[2])  # the failure that went past the limit
    assert seen["during"] == f"stopping: {reason}; in-flight steps finish their current state"
    assert queries.get_strategy(store, sid)["details"] == reason
    assert check(store, sid).ok


def test_a_stop_for_failures_is_shown_also_while_the_strategy_is_paused(store: Store) -> None:
    """A review found the "stopping: ..." details unwritten when the operator had paused
    the strategy (the write expected it applying): often the very moment an operator
    pauses is when steps fail."""
    names = add_sim_targets(store, 4, settings={"latency_ms": 3000})
    with store.write() as conn:
        settings = json.dumps({"fail_at": "pre-check", "latency_ms": 100})
        conn.execute(update(targets).where(targets.c.name == names[1]).values(settings=settings))
    sid = applied(store, "patch", max_parallel=2, stop_on_failure=True)
    seen: dict[str, Any] = {}

    def look() -> None:
        shown = queries.get_strategy(store, sid)
        seen.update(state=shown["state"], details=shown["details"])

    async def go() -> dict[int, str]:
        loop = asyncio.get_running_loop()
        loop.call_at(0.05, admin.pause_strategy, store, sid)
        loop.call_at(2.0, look)
        loop.call_at(2.5, admin.resume_strategy, store, sid)
        return await Conductor(store, clock=LoopClock()).run(strategy_ids=[sid])

    assert on_virtual_time(go())[sid] == "failed"
    assert seen == {
        "state": "paused",
        "details": f"stopping: stopped after {names[1]} failed (stop on failure); in-flight "
        "steps finish their current state",
    }, seen
