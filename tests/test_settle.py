"""Refused transitions settled from the row, under an outside writer (found by a bug hunt
on the settling code; each failed before its fix)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from conftest import add_sim_targets, applied, on_virtual_time
from fleetwave import ActionContext, Advance, Outcome, StateAction
from fleetwave.domain.models import Group, StrategyOptions
from fleetwave.domain.registry import register_workflow
from fleetwave.domain.workflow import StateDef, StepFailed, TransientError, WorkflowDef
from fleetwave.drivers.sim import SimDriver
from fleetwave.engine.clock import LoopClock
from fleetwave.engine.conductor import Conductor
from fleetwave.engine.config import EngineConfig
from fleetwave.engine.messages import CallbackArrived
from fleetwave.store import admin, queries
from fleetwave.store import runtime as rt
from fleetwave.store.callbacks import accept_callback
from fleetwave.store.db import Store
from fleetwave.testing.invariants import check
from test_engine_edges import _edit_row_during_its_action, _recorded_run


class BumpFirstOnce(StateAction):
    """Someone bumps the fence of the first step's row while its action runs; then the
    action advances, or with ``then_fail`` fails. Its recover hook (after a takeover)
    finds the target fine."""

    def __init__(self, store: Store, *, delay: float = 0.05, then_fail: bool = False) -> None:
        self.store = store
        self.delay = delay
        self.then_fail = then_fail
        self.first: int | None = None

    async def run(self, ctx: ActionContext) -> Outcome:
        await asyncio.sleep(self.delay)
        if self.first is None:
            self.first = ctx.step_id
            with self.store.write() as conn:
                conn.exec_driver_sql(
                    "UPDATE steps SET fence = fence + 1 WHERE id = ?", (ctx.step_id,)
                )
            if self.then_fail:
                raise StepFailed("boom")
        return Advance()

    async def recover(self, ctx: ActionContext) -> Outcome:
        return Advance()


def test_a_refused_failure_is_applied_again_and_explains_the_stop(store: Store) -> None:
    """The action failed (a threshold of 0: the strategy stops) while someone bumped its
    row's fence: the failure was refused, yet the stop and the other steps' aborts were
    written, and the strategy ended 'complete' (the failure uncounted). The failure is
    now applied again at a new fence: the journal explains the stop."""
    action = BumpFirstOnce(store, delay=0.01, then_fail=True)
    wf = register_workflow(
        WorkflowDef("hunt-b", (StateDef("a", action, timeout_s=60),)), replace=True
    )
    add_sim_targets(store, 4)
    sid = admin.create_strategy(
        store, wf, StrategyOptions(max_parallel=1, max_failures=0), all_targets=True
    )
    admin.apply_strategy(store, sid)
    c = Conductor(store, drivers={"sim": SimDriver()}, config=EngineConfig())
    final = asyncio.run(asyncio.wait_for(c.run(strategy_ids=[sid]), 30))[sid]
    states = sorted(s["state"] for s in queries.list_steps(store, sid))
    verdict = check(store, sid)
    assert verdict.ok, verdict.violations
    assert final == "failed"
    assert states == ["aborted", "aborted", "aborted", "failed"]


class Quick(StateAction):
    async def run(self, ctx: ActionContext) -> Outcome:
        return Advance()

    async def recover(self, ctx: ActionContext) -> Outcome:
        return Advance()


def _waiting_for_a_callback(store: Store, name: str, timeout_s: float) -> int:
    """One target, a workflow whose first state waits for a callback: the strategy."""
    wf = register_workflow(
        WorkflowDef(
            name,
            (
                StateDef("w", Quick(), timeout_s=timeout_s, mode="wait-for-callback"),
                StateDef("b", Quick()),
            ),
        ),
        replace=True,
    )
    add_sim_targets(store, 1)
    sid = admin.create_strategy(store, wf, StrategyOptions(max_parallel=1), all_targets=True)
    admin.apply_strategy(store, sid)
    return sid


async def _edit_row_then_call_back(c: Conductor, store: Store) -> None:
    """Once the step waits for its callback, bump its row's fence (someone else writes
    it), then the target calls back: the move the callback causes is refused."""
    while True:
        await asyncio.sleep(0.01)
        fls = [fl for run in c.runs.values() for fl in run.inflight.values()]
        if fls and fls[0].waiter is not None:
            break
    (fl,) = fls
    with store.write() as conn:
        conn.exec_driver_sql("UPDATE steps SET fence = fence + 1 WHERE id = ?", (fl.rec.step_id,))
    c.receive_callback(fl.rec.step_id, "w", "done", "all good")


def test_a_callback_whose_move_was_refused_still_moves_the_step(store: Store) -> None:
    """The step waits for a callback; its row's fence is bumped by someone else and the
    callback arrives. The move it causes was refused while its mark 'applied: moved the
    step on' was written; the taken-over step waited for a callback again, never offered,
    and timed out. The move is now applied again: the mark is true."""
    sid = _waiting_for_a_callback(store, "hunt-c", 5)
    c = Conductor(store, drivers={"sim": SimDriver()}, config=EngineConfig(tick_s=0.2))

    async def go() -> dict[int, str]:
        task = asyncio.create_task(c.run(strategy_ids=[sid]))
        await _edit_row_then_call_back(c, store)
        return await asyncio.wait_for(task, 30)

    final = asyncio.run(go())[sid]
    steps = queries.list_steps(store, sid)
    with store.read() as conn:
        cbs = conn.exec_driver_sql("SELECT outcome, reason FROM callbacks").all()
    assert final == "complete", (final, [(s["state"], s["details"]) for s in steps], cbs)
    assert [tuple(c) for c in cbs] == [("applied", "moved the step on from w")]


@pytest.mark.parametrize("stages", [True, False])
def test_an_unsettled_end_keeps_its_stage_and_group_slot(
    store: Store, monkeypatch: pytest.MonkeyPatch, stages: bool
) -> None:
    """A step's move to its end is refused (row edited) and the first takeovers miss it
    (the row keeps changing). While it is unsettled its stage stays open and its group
    slot taken: they were released when the end was decided (the next stage started, the
    group exceeded its cap)."""
    action = BumpFirstOnce(store)
    wf = register_workflow(
        WorkflowDef("hunt-d", (StateDef("a", action, timeout_s=60),)), replace=True
    )
    admin.add_group(store, Group("g0", max_parallel=1))
    admin.add_group(store, Group("g1", max_parallel=5))
    add_sim_targets(store, 3, prefix="a", group="g0")
    add_sim_targets(store, 3, prefix="b", group="g1")
    sid = admin.create_strategy(
        store, wf, StrategyOptions(max_parallel=10, stages_by_group=stages), all_targets=True
    )
    admin.apply_strategy(store, sid)
    misses = {"n": 0}
    real = rt.take_over_steps

    def take_over(st: Store, recs: list[rt.StepRecord], *a: Any, **kw: Any) -> Any:
        if kw.get("held") is not None and misses["n"] < 2:
            misses["n"] += 1  # the row "changed again" before this takeover
            return real(st, [r for r in recs if r.step_id != action.first], *a, **kw)
        return real(st, recs, *a, **kw)

    monkeypatch.setattr(rt, "take_over_steps", take_over)
    c = Conductor(store, drivers={"sim": SimDriver()}, config=EngineConfig(tick_s=0.2))
    final = asyncio.run(asyncio.wait_for(c.run(strategy_ids=[sid]), 30))[sid]
    verdict = check(store, sid)
    assert verdict.ok, verdict.violations
    assert final == "complete"


def test_a_step_missed_by_a_takeover_keeps_its_group_slot(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """At adoption a started step moved between the read and the takeover (someone edited
    its row): a group-mate was admitted into its group's only slot in the same pass,
    before the step was settled and taken over: two of a cap-1 group in flight."""
    wf = register_workflow(
        WorkflowDef("hunt-e", (StateDef("a", Quick(), timeout_s=60),)), replace=True
    )
    admin.add_group(store, Group("g0", max_parallel=1))
    add_sim_targets(store, 3, prefix="a", group="g0")
    sid = admin.create_strategy(store, wf, StrategyOptions(max_parallel=10), all_targets=True)
    admin.apply_strategy(store, sid)
    # A conductor that died with the first step in 'a' (its row and journal as it left them).
    with store.write() as conn:
        (first,) = conn.exec_driver_sql("SELECT min(id) FROM steps").one()
        conn.exec_driver_sql(
            "UPDATE steps SET state='a', fence=1, owner='dead', started_at=1 WHERE id=?", (first,)
        )
        conn.exec_driver_sql(
            "INSERT INTO journal (strategy_id, step_id, at, conductor, from_state, to_state, "
            "fence, details) VALUES (?, ?, 1, 'dead', 'initial', 'a', 1, '')",
            (sid, first),
        )
    real = rt.take_over_steps

    def take_over(st: Store, recs: list[rt.StepRecord], *a: Any, **kw: Any) -> Any:
        if kw.get("held") is None and recs:
            with st.write() as conn:  # the row is edited just before the takeover
                conn.exec_driver_sql("UPDATE steps SET fence = fence + 1 WHERE id = ?", (first,))
        return real(st, recs, *a, **kw)

    monkeypatch.setattr(rt, "take_over_steps", take_over)
    c = Conductor(store, drivers={"sim": SimDriver()}, config=EngineConfig(tick_s=0.2))
    final = asyncio.run(asyncio.wait_for(c.run(strategy_ids=[sid]), 30))[sid]
    verdict = check(store, sid)
    assert verdict.ok, verdict.violations
    assert final == "complete"


# -- found by a second review of the settling code (each failed before its fix) -----------


@pytest.mark.parametrize(
    "sql",
    [
        # cannot go on: it fails, counted once
        "UPDATE steps SET state = 'bogus' WHERE id = ?",
        # in another state: taken over, its recover hook decides (and fails it again)
        "UPDATE steps SET state = 'updating-patches' WHERE id = ?",
    ],
)
def test_a_refused_failure_settled_otherwise_is_counted_once(store: Store, sql: str) -> None:
    add_sim_targets(store, 1, prefix="a", settings={"latency_ms": 20, "fail_at": "pre-check"})
    names = add_sim_targets(store, 2, settings={"latency_ms": 20})
    sid = applied(store, "patch", max_parallel=1, max_failures=1)
    final, _ = _edit_row_during_its_action(store, sid, sql)
    steps = {s["target"]: s["state"] for s in queries.list_steps(store, sid)}
    # at most one step failed, the threshold is 1: the others run
    assert steps[names[0]] == steps[names[1]] == "complete", steps
    assert final == ("failed" if "failed" in steps.values() else "complete"), (final, steps)


def test_a_refused_failure_of_a_step_ended_complete_elsewhere_is_taken_back(
    store: Store,
) -> None:
    add_sim_targets(store, 1, prefix="a", settings={"latency_ms": 20, "fail_at": "pre-check"})
    add_sim_targets(store, 2, settings={"latency_ms": 20})
    sid = applied(store, "patch", max_parallel=1)
    final, _ = _edit_row_during_its_action(
        store, sid, "UPDATE steps SET state = 'complete', details = 'done by hand' WHERE id = ?"
    )
    steps = {s["target"]: s["state"] for s in queries.list_steps(store, sid)}
    assert set(steps.values()) == {"complete"}
    assert final == "complete", (final, queries.get_strategy(store, sid)["details"])


def test_the_callback_of_a_move_refused_during_a_clean_stop_stays_open(store: Store) -> None:
    """Its 'applied' mark was written with the refused move; the next owner took the step
    over in the wait state, waited for a callback no longer open, and timed out. The mark
    is now written only with its transition: the next owner offers the callback again."""
    sid = _waiting_for_a_callback(store, "drain-cb", 2)
    first = Conductor(store, drivers={"sim": SimDriver()}, config=EngineConfig(tick_s=0.2))

    async def go() -> dict[int, str]:
        stop = asyncio.Event()
        task = asyncio.create_task(first.run(stop=stop))
        await _edit_row_then_call_back(first, store)
        stop.set()  # a clean stop (serve got SIGTERM)
        await asyncio.wait_for(task, 10)
        second = Conductor(store, drivers={"sim": SimDriver()}, config=EngineConfig(tick_s=0.2))
        return await asyncio.wait_for(second.run(strategy_ids=[sid]), 30)

    final = asyncio.run(go())[sid]
    steps = queries.list_steps(store, sid)
    with store.read() as conn:
        cbs = [tuple(r) for r in conn.exec_driver_sql("SELECT outcome, reason FROM callbacks")]
    assert final == "complete", (final, [(s["state"], s["details"]) for s in steps], cbs)


class SetBack(StateAction):
    def __init__(self, store: Store) -> None:
        self.store = store
        self.done = False

    async def run(self, ctx: ActionContext) -> Outcome:
        await asyncio.sleep(0.01)
        if not self.done:
            self.done = True
            with self.store.write() as conn:  # someone sets the row back to 'a'
                conn.exec_driver_sql("UPDATE steps SET state = 'a' WHERE id = ?", (ctx.step_id,))
        return Advance()

    async def recover(self, ctx: ActionContext) -> Outcome:
        return Advance()


def test_a_move_into_a_state_already_entered_is_not_applied_again_forever(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A row set back by hand to an earlier state (after the step went on): the step is
    taken over there, its recover hook moves it on into a state it already entered, the
    unique key (G1) refuses that, and the refused move was applied again once a tick,
    forever (the strategy never ended). Now it fails, once."""
    wf = register_workflow(
        WorkflowDef(
            "setback",
            (StateDef("a", Quick()), StateDef("b", SetBack(store)), StateDef("c", Quick())),
        ),
        replace=True,
    )
    add_sim_targets(store, 2)
    sid = admin.create_strategy(store, wf, StrategyOptions(max_parallel=1), all_targets=True)
    admin.apply_strategy(store, sid)
    c = Conductor(store, drivers={"sim": SimDriver()}, config=EngineConfig(tick_s=0.2))
    final = asyncio.run(asyncio.wait_for(c.run(strategy_ids=[sid]), 10))[sid]
    steps = [(s["state"], s["details"]) for s in queries.list_steps(store, sid)]
    assert final == "failed"
    assert steps == [("failed", "a: set back after it had entered b"), ("complete", "")]


# -- branches of settling that no test reached (found by a coverage run) -------------------


def _settled_events(store: Store) -> list[str]:
    with store.read() as conn:
        rows = conn.exec_driver_sql(
            "SELECT details FROM events WHERE kind = 'step-settled' ORDER BY id"
        ).all()
    return [str(r[0]) for r in rows]


def test_a_waiting_step_whose_entry_was_refused_waits_again_and_runs(store: Store) -> None:
    """A step not started yet (loaded, waiting its turn) has its row's fence bumped by
    someone else: its entry is refused. The row says it never started, so it waits
    again and starts at its next turn; every step completes, each state once."""
    names = add_sim_targets(store, 3, settings={"latency_ms": 20})
    sid = applied(store, "patch", max_parallel=1)

    def bump_the_last(c: Conductor) -> None:
        with store.write() as conn:
            conn.exec_driver_sql(
                "UPDATE steps SET fence = fence + 1 WHERE strategy_id = ? AND target_id = "
                "(SELECT id FROM targets WHERE name = ?)",
                (sid, names[2]),
            )

    final, driver = _recorded_run(store, sid, bump_the_last)
    assert final == "complete"
    assert {s["state"] for s in queries.list_steps(store, sid)} == {"complete"}
    assert _settled_events(store) == ["transition refused; row waiting again"]
    ops = [p[1] for p in driver.performed if p[0] == names[2]]
    assert len(ops) == len(set(ops)) == 5  # started once it was its turn again
    assert check(store, sid).ok


def test_a_step_moved_by_hand_to_a_later_state_not_started_starts_there_afresh(
    store: Store,
) -> None:
    """Someone moves a running step's row to a later state marked not started: its move
    is refused, the row is taken over there and that state's action runs afresh (not its
    recover hook), with a deadline of its own."""
    names = add_sim_targets(store, 2, settings={"latency_ms": 20})
    sid = applied(store, "patch", max_parallel=1)
    final, driver = _edit_row_during_its_action(
        store,
        sid,
        "UPDATE steps SET state = 'applying-remote-patch-strategy', not_started = 1, "
        "deadline_at = NULL WHERE id = ?",
    )
    assert final == "complete"
    assert _settled_events(store) == [
        "transition refused; row in applying-remote-patch-strategy: taken over"
    ]
    ops = [p[1] for p in driver.performed if p[0] == names[0]]
    # pre-check ran (its move refused), then the state the row was set to, afresh
    assert ops == ["pre-check", "applying-remote-patch-strategy", "finishing"]


def test_a_step_deleted_by_hand_mid_action_does_not_hold_the_strategy(store: Store) -> None:
    """The row of a running step is deleted behind the conductor's back: its move is
    refused, settling finds no row, and the strategy goes on and ends (it held the
    step's slot until then, and does not wait for it forever)."""
    names = add_sim_targets(store, 3, settings={"latency_ms": 20})
    sid = applied(store, "patch", max_parallel=1)
    final, _ = _edit_row_during_its_action(store, sid, "DELETE FROM steps WHERE id = ?")
    assert final == "complete"
    steps = {s["target"]: s["state"] for s in queries.list_steps(store, sid)}
    assert steps == {names[1]: "complete", names[2]: "complete"}


def test_a_target_whose_driver_this_conductor_lacks_fails_with_the_reason(store: Store) -> None:
    """A serve started without the plug-in that provides a target's driver: its steps
    fail with a reason an operator can act on, and the strategy ends."""
    add_sim_targets(store, 2)
    sid = applied(store, "patch", max_parallel=2)
    c = Conductor(store, drivers={}, config=EngineConfig())
    final = asyncio.run(asyncio.wait_for(c.run(strategy_ids=[sid]), 30))[sid]
    assert final == "failed"
    details = {s["details"] for s in queries.list_steps(store, sid)}
    assert details == {"pre-check: no driver named 'sim' on this conductor"}


def test_a_step_moved_by_hand_while_its_strategy_stops_ends_aborted_not_started(
    store: Store,
) -> None:
    """As above, but the strategy is being aborted when the row is read: the state the
    row was set to never starts; the step ends aborted, and says why."""
    # the first in line (by name); its action outlasts a tick of the periodic pass
    names = add_sim_targets(store, 1, prefix="a", settings={"latency_ms": 1500})
    add_sim_targets(store, 1, prefix="b", settings={"latency_ms": 20})
    sid = applied(store, "patch", max_parallel=1)

    def edit_and_abort(c: Conductor) -> None:
        (run,) = c.runs.values()
        (step_id,) = run.inflight
        with store.write() as conn:
            conn.exec_driver_sql(
                "UPDATE steps SET state = 'applying-remote-patch-strategy', not_started = 1 "
                "WHERE id = ?",
                (step_id,),
            )
        admin.request_abort(store, sid)  # the periodic pass sees it while pre-check runs

    final, driver = _recorded_run(store, sid, edit_and_abort)
    assert final == "aborted"
    steps = {s["target"]: (s["state"], s["details"]) for s in queries.list_steps(store, sid)}
    state, details = steps[names[0]]
    assert state == "aborted"
    assert details.startswith("stopped before applying-remote-patch-strategy started: ")
    assert [p[1] for p in driver.performed if p[0] == names[0]] == ["pre-check"]
    assert _settled_events(store) == [
        "transition refused; row stopped before applying-remote-patch-strategy started: "
        + details.split(" started: ", 1)[1]
        + ": aborted"
    ]


class _BusyOnce(StateAction):
    async def run(self, ctx: ActionContext) -> Outcome:
        await asyncio.sleep(2)
        if ctx.attempt == 1:
            raise TransientError("target busy")
        return Advance()

    async def recover(self, ctx: ActionContext) -> Outcome:
        return Advance()


class _StartsAgent(StateAction):
    async def run(self, ctx: ActionContext) -> Outcome:
        return Advance()  # the agent started: the state waits for its callback

    async def recover(self, ctx: ActionContext) -> Outcome:
        return Advance()


def test_an_early_callback_offered_again_after_a_settle_is_applied_once(store: Store) -> None:
    """Found by a bug hunt: a callback stored early (for a later state) was kept, and
    offered again when a hand edit of the step's row was settled; kept twice, it was
    handed to the wait and also marked "ignored: duplicate", and the transition's
    "applied" then changed nothing: the record said ignored for the callback that moved
    the step on. One callback offered twice is one callback."""
    add_sim_targets(store, 1)
    wf = register_workflow(
        WorkflowDef(
            "early-cb-settle",
            (
                StateDef("prep", _BusyOnce(), attempts_max=3, backoff_s=10.0),
                StateDef("wait", _StartsAgent(), mode="wait-for-callback"),
                StateDef("finish", _StartsAgent()),
            ),
        ),
        replace=True,
    )
    sid = applied(store, wf.name)
    (step,) = queries.list_steps(store, sid)
    c = Conductor(store, clock=LoopClock(), config=EngineConfig(tick_s=1.0))

    def early() -> None:  # the agent answers for `wait` while the step is in `prep`
        accept_callback(store, step["step"], "wait", "done", "EXT-CB-1", 0.0)

    def hand_edit() -> None:  # during prep's backoff (the simulator's meddle fault)
        with store.write() as conn:
            conn.exec_driver_sql(f"UPDATE steps SET fence = fence + 1 WHERE id = {step['step']}")

    async def go() -> dict[int, str]:
        loop = asyncio.get_running_loop()
        loop.call_at(0.7, early)
        loop.call_at(4.0, hand_edit)
        return await asyncio.wait_for(c.run(strategy_ids=[sid]), 120)

    assert on_virtual_time(go())[sid] == "complete"
    ((outcome, reason),) = [
        (cb["outcome"], cb["reason"]) for cb in queries.step_callbacks(store, step["step"])
    ]
    assert outcome == "applied", reason
    journal = [(h["from"], h["to"], h["details"]) for h in queries.history(store, sid)]
    assert ("wait", "finish", "EXT-CB-1") in journal, journal
    assert check(store, sid).ok


def test_a_callback_offered_twice_to_a_waiting_step_is_applied_once(store: Store) -> None:
    """The other half of the same finding: a callback offered again (a settle, a
    takeover) while its step already waits, and after the wait took it, was marked
    "ignored: duplicate"; the step moved on by it, and its "applied" changed nothing."""
    add_sim_targets(store, 1)
    wf = register_workflow(
        WorkflowDef(
            "cb-twice",
            (StateDef("wait", _StartsAgent(), mode="wait-for-callback"),),
        ),
        replace=True,
    )
    sid = applied(store, wf.name)
    (step,) = queries.list_steps(store, sid)
    c = Conductor(store, clock=LoopClock(), config=EngineConfig(tick_s=1.0))

    def twice() -> None:
        record = accept_callback(store, step["step"], "wait", "done", "agent done", 0.0)
        c._first_sight(record)  # as a re-offer does: the poll must not offer it a third time
        c.post(CallbackArrived(record))
        c.post(CallbackArrived(record))

    async def go() -> dict[int, str]:
        asyncio.get_running_loop().call_at(0.5, twice)
        return await asyncio.wait_for(c.run(strategy_ids=[sid]), 60)

    assert on_virtual_time(go())[sid] == "complete"
    ((outcome, reason),) = [
        (cb["outcome"], cb["reason"]) for cb in queries.step_callbacks(store, step["step"])
    ]
    assert outcome == "applied", reason
