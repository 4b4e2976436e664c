"""Taking a strategy over, or claiming it back, strands nothing: a callback handed to a
wait is offered again, ``apply --wait`` takes over an owner that died and does not give up
after its own lapse, a stale report's worker ends, an unreadable strategy row fails that
strategy alone, and a stop for failures is named after a takeover and while paused.
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
from fleetwave.domain.workflow import DriverOperation, StateDef, WorkflowDef
from fleetwave.engine.clock import LoopClock
from fleetwave.engine.conductor import Conductor
from fleetwave.engine.config import EngineConfig
from fleetwave.store import admin, queries
from fleetwave.store import runtime as rt
from fleetwave.store.callbacks import callback_outcomes
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
