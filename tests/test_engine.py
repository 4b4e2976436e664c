"""The engine on a real database (SQLite and PostgreSQL): admission, caps, failures, retries,
timeouts, abort, clean stops and takeovers."""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections import Counter
from collections.abc import Sequence
from typing import Any

import pytest
from sqlalchemy import Connection, Row, func, select

from conftest import add_sim_targets, applied, on_virtual_time, rollout
from fleetwave import ActionContext, Advance, Outcome, StateAction, StepFailed, TransientError
from fleetwave.domain.models import Group, StrategyOptions
from fleetwave.domain.registry import get_workflow, register_workflow
from fleetwave.domain.rules import Decision
from fleetwave.domain.workflow import StateDef, WorkflowDef
from fleetwave.drivers.sim import SimDriver
from fleetwave.engine.clock import LoopClock
from fleetwave.engine.conductor import Conductor
from fleetwave.engine.config import EngineConfig
from fleetwave.engine.messages import ActionFinished
from fleetwave.store import admin, queries
from fleetwave.store import runtime as rt
from fleetwave.store.db import Store
from fleetwave.store.schema import conductors, events, journal, steps
from fleetwave.testing.invariants import check

#: every test that takes a store runs on SQLite and on PostgreSQL
pytestmark = pytest.mark.both_dialects


def _journal(store: Store, sid: int) -> list[Any]:
    with store.read() as conn:
        return list(
            conn.execute(select(journal).where(journal.c.strategy_id == sid).order_by(journal.c.id))
        )


def _states(store: Store, sid: int) -> dict[str, tuple[str, str]]:
    return {s["target"]: (s["state"], s["details"]) for s in queries.list_steps(store, sid)}


def test_rollout_enters_every_state_exactly_once(store: Store) -> None:
    add_sim_targets(store, 50)
    sim = SimDriver()
    sim.record = True
    c = Conductor(store, drivers={"sim": sim})
    sid, final, _ = rollout(store, conductor=c, max_parallel=7)
    assert final == "complete"
    wf = get_workflow("patch")
    assert wf is not None
    rows = _journal(store, sid)
    per_step: dict[int, list[str]] = {}
    for r in rows:
        per_step.setdefault(r.step_id, []).append(r.to_state)
    assert len(per_step) == 50
    for seq in per_step.values():
        assert seq == [*wf.state_names, "complete"]
    # What the targets saw: each operation once per target.
    seen = Counter((t, op) for t, op, _ in sim.performed)
    assert len(seen) == 50 * len(wf.states)
    assert set(seen.values()) == {1}
    assert check(store, sid).ok


class _Concurrency:
    def __init__(self) -> None:
        self.now = 0
        self.at_start: list[int] = []
        self.peak_by_group: Counter[str | None] = Counter()
        self.by_group: Counter[str | None] = Counter()


PROBE = _Concurrency()


class ProbeWork(StateAction):
    async def run(self, ctx: ActionContext) -> Outcome:
        PROBE.now += 1
        PROBE.by_group[ctx.target.group] += 1
        PROBE.peak_by_group[ctx.target.group] = max(
            PROBE.peak_by_group[ctx.target.group], PROBE.by_group[ctx.target.group]
        )
        PROBE.at_start.append(PROBE.now)
        try:
            await asyncio.sleep(random.Random(ctx.target.name).uniform(0.005, 0.05))
        finally:
            PROBE.now -= 1
            PROBE.by_group[ctx.target.group] -= 1
        return Advance()


def _probe_workflow() -> WorkflowDef:
    return register_workflow(
        WorkflowDef("probe-one", (StateDef("work", ProbeWork(), timeout_s=10),)), replace=True
    )


def test_sliding_window_keeps_max_parallel_busy(store: Store) -> None:
    global PROBE
    PROBE = _Concurrency()
    add_sim_targets(store, 80)
    wf = _probe_workflow()
    sid = admin.create_strategy(store, wf, StrategyOptions(max_parallel=10), all_targets=True)
    admin.apply_strategy(store, sid)
    # On virtual time: a stall of the machine (a slow fsync on a busy CI host) cannot
    # let several actions end before the dispatcher turns, as it could in real time.
    c = Conductor(store, clock=LoopClock())
    final = on_virtual_time(c.run(strategy_ids=[sid]))[sid]
    assert final == "complete"
    assert max(PROBE.at_start) == 10
    # While targets remain, a finished step is replaced at once, while the others still
    # run: lock-step batches would start each new batch into an empty window (1).
    steady = PROBE.at_start[10 : 80 - 10]
    assert min(steady) >= 9
    assert sum(steady) / len(steady) >= 9.5
    assert check(store, sid).ok


def test_group_caps_and_serial_groups(store: Store) -> None:
    global PROBE
    PROBE = _Concurrency()
    admin.add_group(store, Group("east", max_parallel=3))
    from fleetwave.domain.models import ApplyType

    admin.add_group(store, Group("west", max_parallel=50, apply_type=ApplyType.SERIAL))
    add_sim_targets(store, 20, prefix="e", group="east")
    add_sim_targets(store, 10, prefix="w", group="west")
    add_sim_targets(store, 10, prefix="u")
    sid, final, _ = rollout(store, _probe_workflow(), max_parallel=8)
    assert final == "complete"
    assert PROBE.peak_by_group["east"] == 3
    assert PROBE.peak_by_group["west"] == 1
    assert max(PROBE.at_start) <= 8
    assert check(store, sid).ok


def test_serial_apply_type_runs_one_at_a_time(store: Store) -> None:
    global PROBE
    PROBE = _Concurrency()
    from fleetwave.domain.models import ApplyType

    add_sim_targets(store, 12)
    _, final, _ = rollout(store, _probe_workflow(), max_parallel=50, apply_type=ApplyType.SERIAL)
    assert final == "complete"
    assert max(PROBE.at_start) == 1


def test_stop_on_failure_finishes_current_state_and_starts_nothing(store: Store) -> None:
    add_sim_targets(store, 1, prefix="a", settings={"fail_at": "pre-check", "latency_ms": 1})
    add_sim_targets(store, 30, prefix="b", settings={"latency_ms": 5})
    sid, final, _ = rollout(store, max_parallel=4, stop_on_failure=True)
    assert final == "failed"
    st = _states(store, sid)
    assert st["a00000"][0] == "failed"
    aborted = [d for s, d in st.values() if s == "aborted"]
    assert any(d.startswith("stopped after ") for d in aborted)  # in flight: finished its state
    assert any(d.startswith("not started") for d in aborted)
    assert all(s in ("complete", "failed", "aborted") for s, _ in st.values())
    strategy = queries.get_strategy(store, sid)
    # the strategy says which target stopped it
    assert strategy["details"] == "stopped after a00000 failed (stop on failure)"
    assert check(store, sid).ok


def test_failure_threshold_stops_exactly_when_exceeded(store: Store) -> None:
    names = add_sim_targets(store, 12)
    for n in (names[2], names[5], names[8]):
        admin.set_managed(store, n, False)
    sid, final, _ = rollout(store, max_parallel=1, max_failures=1)
    assert final == "failed"
    st = _states(store, sid)
    assert st[names[2]][0] == "failed" and st[names[5]][0] == "failed"
    assert st[names[5]][1] == f"Target {names[5]} is unmanaged."
    assert st[names[8]][0] == "aborted"  # never reached: the threshold stopped the rollout
    assert [st[n][0] for n in names[:5] if n != names[2]] == ["complete"] * 4
    assert queries.get_strategy(store, sid)["details"] == (
        f"stopped: 2 failed steps exceed the failure threshold of 1 (the last: {names[5]})"
    )
    assert check(store, sid).ok


class Flaky(StateAction):
    calls: Counter[str] = Counter()

    async def run(self, ctx: ActionContext) -> Outcome:
        Flaky.calls[ctx.target.name] += 1
        if ctx.attempt < 3:
            raise TransientError("busy")
        return Advance()


class Boom(StateAction):
    async def run(self, ctx: ActionContext) -> Outcome:
        raise ValueError("boom on purpose")


class Hang(StateAction):
    async def run(self, ctx: ActionContext) -> Outcome:
        await asyncio.Event().wait()
        raise AssertionError("unreachable")


class Branch(StateAction):
    async def run(self, ctx: ActionContext) -> Outcome:
        return Advance(to="c", details="jumped")


class Fails(StateAction):
    async def run(self, ctx: ActionContext) -> Outcome:
        raise StepFailed("remote said no")


def _wf(name: str, *states: StateDef) -> WorkflowDef:
    return register_workflow(WorkflowDef(name, states), replace=True)


def test_retry_with_backoff_then_success_or_failure(store: Store) -> None:
    Flaky.calls.clear()  # (counted anew on each dialect's run)
    add_sim_targets(store, 3)
    ok = _wf("retry-ok", StateDef("a", Flaky(), attempts_max=3, backoff_s=0.01))
    sid, final, _ = rollout(store, ok)
    assert final == "complete"
    assert all(Flaky.calls[f"t0000{i}"] == 3 for i in range(3))
    assert {s["attempt"] for s in queries.list_steps(store, sid)} == {3}


def test_retries_exhausted_fail_with_attempt_count(store: Store) -> None:
    add_sim_targets(store, 2)
    bad = _wf("retry-bad", StateDef("a", Flaky(), attempts_max=2, backoff_s=0.01))
    sid, final, _ = rollout(store, bad)
    assert final == "failed"
    for state, details in _states(store, sid).values():
        assert state == "failed"
        assert details == "a: busy (attempt 2 of 2)"


def test_unexpected_exception_fails_step_with_state_and_message(store: Store) -> None:
    add_sim_targets(store, 3)
    sid, final, _ = rollout(store, _wf("boom", StateDef("explode", Boom())))
    assert final == "failed"
    assert {d for _, d in _states(store, sid).values()} == {"explode: boom on purpose"}
    assert check(store, sid).ok


def test_timeout_fails_the_step_never_strands_it(store: Store) -> None:
    add_sim_targets(store, 20)
    wf = _wf("hang", StateDef("wait", Hang(), timeout_s=0.05, attempts_max=2, backoff_s=0.01))
    sid, final, _ = rollout(store, wf, max_parallel=20)
    assert final == "failed"
    assert {d for _, d in _states(store, sid).values()} == {
        "wait: timed out after 0.05s (attempt 2 of 2)"
    }
    with store.read() as conn:
        owners = conn.execute(select(steps.c.owner).where(steps.c.owner.is_not(None))).all()
    assert owners == []
    assert check(store, sid).ok


def test_branch_and_typed_failure(store: Store) -> None:
    add_sim_targets(store, 2)
    wf = _wf(
        "branchy",
        StateDef("a", Branch()),
        StateDef("b", Fails()),
        StateDef("c", Fails()),
    )
    sid, final, _ = rollout(store, wf)
    assert final == "failed"
    seq = [r.to_state for r in _journal(store, sid) if r.step_id == 1]
    assert seq == ["a", "c", "failed"]  # b never entered
    assert {d for _, d in _states(store, sid).values()} == {"c: remote said no"}
    assert check(store, sid).ok


def test_already_done_target_skips_with_reason(store: Store) -> None:
    add_sim_targets(store, 2, settings={"already_done": True})
    sim = SimDriver()
    sim.record = True
    sid, final, _ = rollout(store, conductor=Conductor(store, drivers={"sim": sim}))
    assert final == "complete"
    for state, details in _states(store, sid).values():
        assert state == "complete"
        assert details.startswith("skipped at pre-check")
    assert {op for _, op, _ in sim.performed} == {"pre-check"}


def test_unexpected_remote_state_is_a_clear_failure(store: Store) -> None:
    add_sim_targets(store, 1, settings={"remote_state": "ready-to-apply"})
    sid, final, _ = rollout(store)
    assert final == "failed"
    ((_state, details),) = _states(store, sid).values()
    assert details == "pre-check: target reports unexpected remote state 'ready-to-apply'"


def _run_and_abort_after(store: Store, conductor: Conductor, sid: int, after_s: float) -> str:
    """Drive ``sid``; the operator asks to abort it ``after_s`` in. Its final state."""

    async def go() -> dict[int, str]:
        task = asyncio.create_task(conductor.run(strategy_ids=[sid]))
        await asyncio.sleep(after_s)
        admin.request_abort(store, sid)
        return await task

    return asyncio.run(go())[sid]


def test_operator_abort_mid_run(store: Store) -> None:
    add_sim_targets(store, 200, settings={"latency_ms": 10})
    sid = applied(store, "patch", max_parallel=10)
    c = Conductor(store, config=EngineConfig(tick_s=0.02))
    assert _run_and_abort_after(store, c, sid, 0.3) == "aborted"
    counts = queries.step_counts(store, sid)
    assert set(counts) <= {"complete", "aborted"}
    assert counts["aborted"] > 100
    assert check(store, sid).ok
    kinds = {e["kind"] for e in queries.strategy_events(store, sid)}
    assert "abort-seen" in kinds


async def _left_first_state(store: Store, sid: int, step_ids: list[int]) -> None:
    """Until each of the steps has left its first state (pre-check, at fence 1): a
    report for it is stale from then on (a fixed sleep raced a slow start, and the
    duplicate was taken as the state's outcome)."""
    while True:
        with store.read() as conn:
            left = conn.execute(
                select(func.count()).where(
                    journal.c.strategy_id == sid,
                    journal.c.from_state == "pre-check",
                    journal.c.step_id.in_(step_ids),
                )
            ).scalar_one()
        if left == len(step_ids):
            return
        await asyncio.sleep(0.002)


async def _under_way(store: Store, sid: int) -> None:
    """Until a step of the strategy has entered a state (not a fixed sleep: a slow
    start, a loaded machine, would have the stop land before anything started)."""
    while True:
        with store.read() as conn:
            if conn.execute(select(journal.c.id).where(journal.c.strategy_id == sid)).first():
                return
        await asyncio.sleep(0.002)


def test_stale_outcome_is_recorded_and_ignored(store: Store) -> None:
    """G3: a report for a (state, fence) the step has left changes nothing."""
    add_sim_targets(store, 5, settings={"latency_ms": 30})
    sid = applied(store, "patch", max_parallel=5)
    c = Conductor(store)

    async def go() -> dict[int, str]:
        task = asyncio.create_task(c.run(strategy_ids=[sid]))
        await _left_first_state(store, sid, [1])
        # A late duplicate of step 1's first report, at its first fence.
        c.post(ActionFinished(sid, 1, "pre-check", 1, Decision("failed", "late dup"), 1))
        return await task

    assert asyncio.run(go())[sid] == "complete"
    assert c.stats.stale_outcomes == 1
    assert [e["kind"] for e in queries.step_events(store, 1)] == ["stale-outcome-ignored"]
    assert check(store, sid).ok


def test_clean_shutdown_hands_leases_back_and_next_conductor_resumes(store: Store) -> None:
    add_sim_targets(store, 40, settings={"latency_ms": 20})
    sid = applied(store, "patch", max_parallel=10)
    first = Conductor(store)

    async def stop_soon() -> None:
        stop = asyncio.Event()
        task = asyncio.create_task(first.run(stop=stop))
        await _under_way(store, sid)
        stop.set()
        await task

    asyncio.run(stop_soon())
    with store.read() as conn:
        held = conn.execute(select(steps.c.id).where(steps.c.owner.is_not(None))).all()
        mid = conn.execute(
            select(steps.c.id).where(
                steps.c.state.not_in(["initial", "complete", "failed", "aborted"])
            )
        ).all()
    assert held == []  # handed back at once
    assert mid, "the stop should land mid-rollout"
    second = Conductor(store)
    result = asyncio.run(second.run(strategy_ids=[sid]))
    assert result[sid] == "complete"
    taken = [e for e in queries.strategy_events(store, sid) if e["kind"] == "step-taken-over"]
    assert len(taken) == len(mid)
    assert check(store, sid).ok


def test_dead_conductor_on_another_host_is_taken_over_after_lease_expiry(store: Store) -> None:
    from sqlalchemy import insert, update

    from fleetwave.store.schema import strategies

    add_sim_targets(store, 3)
    sid = applied(store, "patch", max_parallel=3)
    # the clock this database's conductors lease on (the host's, or the server's)
    lease_clock = Conductor(store).clock
    with store.write() as conn:
        conn.execute(
            insert(conductors).values(
                id="ghost",
                hostname="elsewhere",
                pid=1,
                started_at=0,
                heartbeat_at=0,
                lease_clock=lease_clock.lease_clock,  # (every conductor's on this database)
            )
        )
        live = lease_clock.lease_now() + 3600
        conn.execute(update(strategies).values(owner="ghost", fence=1, lease_expires_at=live))
        conn.execute(
            update(steps)
            .where(steps.c.id == 1)
            .values(state="updating-patches", owner="ghost", fence=3)
        )
        # as the ghost would have journalled it (G9: every move has its row)
        for frm, to in (("initial", "pre-check"), ("pre-check", "updating-patches")):
            conn.execute(
                insert(journal).values(
                    strategy_id=sid,
                    step_id=1,
                    at=0.0,
                    conductor="ghost",
                    from_state=frm,
                    to_state=to,
                    fence=3,
                    details="",
                )
            )
    # The lease is live: nobody may take it.
    assert asyncio.run(Conductor(store).run(strategy_ids=[sid]))[sid] == "owned"
    with store.write() as conn:
        conn.execute(update(strategies).values(lease_expires_at=lease_clock.lease_now() - 1))
    assert asyncio.run(Conductor(store).run(strategy_ids=[sid]))[sid] == "complete"
    with store.read() as conn:
        evts = conn.execute(select(events.c.kind, events.c.details)).all()
    assert ("step-taken-over", "in updating-patches from ghost (fence 3 -> 4)") in [
        (e.kind, e.details) for e in evts
    ]


def test_recover_hook_missing_fails_with_conductor_lost(store: Store) -> None:
    from sqlalchemy import insert, update

    add_sim_targets(store, 1)
    wf = _wf("no-recover", StateDef("only", Boom()))
    sid = admin.create_strategy(store, wf, StrategyOptions(), all_targets=True)
    admin.apply_strategy(store, sid)
    with store.write() as conn:
        conn.execute(update(steps).values(state="only", fence=1, owner="gone"))
        conn.execute(  # journalled, as every move is (G9)
            insert(journal).values(
                strategy_id=sid,
                step_id=1,
                at=0.0,
                conductor="gone",
                from_state="initial",
                to_state="only",
                fence=1,
                details="",
            )
        )
    result = asyncio.run(Conductor(store).run(strategy_ids=[sid]))
    assert result[sid] == "failed"
    ((_state, details),) = _states(store, sid).values()
    assert details == "only: conductor lost during only"


def test_clean_stop_lets_running_actions_finish_and_records_them(store: Store) -> None:
    """A clean stop starts nothing new but does not throw away work already under way."""
    add_sim_targets(store, 10, settings={"latency_ms": 300})
    sid = applied(store, "patch", max_parallel=10)
    sim = SimDriver()
    sim.record = True
    first = Conductor(store, drivers={"sim": sim}, config=EngineConfig(shutdown_grace_s=5))

    async def stop_mid_action() -> None:
        stop = asyncio.Event()
        task = asyncio.create_task(first.run(stop=stop))
        await asyncio.sleep(0.1)  # every step is 100 ms into its 300 ms pre-check
        stop.set()
        await task

    asyncio.run(stop_mid_action())
    # Each pre-check ran to its end and was committed: the steps moved on.
    assert queries.step_counts(store, sid) == {"updating-patches": 10}
    assert {op for _, op, _ in sim.performed} == {"pre-check"}
    assert asyncio.run(Conductor(store).run(strategy_ids=[sid]))[sid] == "complete"
    assert check(store, sid).ok


class Quick(StateAction):
    """No recover hook: a step lost while in this state cannot be resumed."""

    seconds = 0.3

    async def run(self, ctx: ActionContext) -> Outcome:
        await asyncio.sleep(Quick.seconds)
        return Advance()


def test_states_entered_during_a_clean_stop_start_afresh_without_a_recover_hook(
    store: Store,
) -> None:
    """Stopping enters the next states but starts none; the next owner starts them."""
    add_sim_targets(store, 6)
    wf = _wf("no-recover", StateDef("one", Quick()), StateDef("two", Quick()))
    sid = applied(store, wf.name, max_parallel=6)
    first = Conductor(store, config=EngineConfig(shutdown_grace_s=5))

    async def stop_mid_action() -> None:
        stop = asyncio.Event()
        task = asyncio.create_task(first.run(stop=stop))
        await asyncio.sleep(0.1)  # every step is inside "one"
        stop.set()
        await task

    asyncio.run(stop_mid_action())
    assert queries.step_counts(store, sid) == {"two": 6}
    with store.read() as conn:
        assert conn.execute(select(steps.c.not_started)).scalars().all() == [True] * 6
    shown = queries.get_step(store, 1)
    assert shown["not_started"] is True
    assert shown["deadline_at"] is not None  # "two" entered: its 600 s are counted

    second = Conductor(store)
    assert asyncio.run(second.run(strategy_ids=[sid]))[sid] == "complete"
    taken = [e for e in queries.strategy_events(store, sid) if e["kind"] == "step-taken-over"]
    assert len(taken) == 6
    assert all(e["details"].endswith("(its action never started)") for e in taken)
    with store.read() as conn:
        assert set(conn.execute(select(steps.c.not_started)).scalars()) == {False}
    assert check(store, sid).ok


def _stages_rollout(store: Store) -> int:
    for g in ("a", "b", "c"):
        admin.add_group(store, Group(name=g, max_parallel=10))
    for i, g in enumerate(("a", "b", "c")):
        add_sim_targets(store, 6, prefix=g, group=g, settings={"latency_ms": 5 * (i + 1)})
    sid, final, _ = rollout(store, max_parallel=10, stages_by_group=True)
    assert final == "complete"
    return sid


def _journal_with_stages(conn: Connection, sid: int) -> Sequence[Row[Any]]:
    return conn.execute(
        select(journal.c.id, journal.c.from_state, journal.c.to_state, steps.c.stage)
        .join(steps, steps.c.id == journal.c.step_id)
        .where(journal.c.strategy_id == sid)
        .order_by(journal.c.id)
    ).all()


def test_stages_run_one_after_the_other(store: Store) -> None:
    sid = _stages_rollout(store)
    with store.read() as conn:
        rows = _journal_with_stages(conn, sid)
    first_start = {
        s: min(r.id for r in rows if r.stage == s and r.from_state == "initial") for s in (1, 2, 3)
    }
    last_end = {
        s: max(r.id for r in rows if r.stage == s and r.to_state == "complete") for s in (1, 2, 3)
    }
    assert last_end[1] < first_start[2] and last_end[2] < first_start[3]
    assert check(store, sid).ok


def test_check_reports_a_stage_started_too_early(store: Store) -> None:
    sid = _stages_rollout(store)
    with store.write() as conn:
        rows = _journal_with_stages(conn, sid)
        end1 = max(r.id for r in rows if r.stage == 1 and r.to_state == "complete")
        start2 = min(r.id for r in rows if r.stage == 2 and r.from_state == "initial")
        # Rewrite history: stage 2's first start committed before stage 1's last end.
        for old, new in ((end1, -1), (start2, end1), (-1, start2)):
            conn.execute(journal.update().where(journal.c.id == old).values(id=new))
    result = check(store, sid)
    assert any(
        v.startswith("stages: ") and "of stage 2 started while stage 1" in v
        for v in result.violations
    ), result.violations


def _paged(store: Store, **options: Any) -> tuple[int, Conductor]:
    """A strategy whose waiting steps load three at a time."""
    sid = applied(store, "patch", **options)
    return sid, Conductor(store, config=EngineConfig(waiting_page=3))


def test_paged_loading_fills_slots_past_a_group_at_its_cap(store: Store) -> None:
    """The first pages are all of a group capped at 1: later pages must fill the window."""
    admin.add_group(store, Group(name="a-capped", max_parallel=1))
    add_sim_targets(store, 12, prefix="a", group="a-capped", settings={"latency_ms": 20})
    add_sim_targets(store, 12, prefix="b", settings={"latency_ms": 20})
    sid, conductor = _paged(store, max_parallel=6)
    peak = 0

    async def go() -> dict[int, str]:
        nonlocal peak
        task = asyncio.create_task(conductor.run(strategy_ids=[sid]))
        for _ in range(40):  # the first 80 ms: before the first step of a ends (100 ms)
            peak = max(peak, sum(len(r.inflight) for r in conductor.runs.values()))
            await asyncio.sleep(0.002)
        return await task

    assert asyncio.run(go())[sid] == "complete"
    assert peak == 6  # one of group a and five ungrouped at once, though a's come first
    assert check(store, sid).ok


def test_paged_loading_ends_every_waiting_step_on_abort(store: Store) -> None:
    add_sim_targets(store, 40, settings={"latency_ms": 100})  # about 5 s in all
    sid, conductor = _paged(store, max_parallel=4)
    assert _run_and_abort_after(store, conductor, sid, 0.05) == "aborted"
    counts = queries.step_counts(store, sid)
    # the abort is seen within a second: most steps were still waiting, most not loaded
    assert "initial" not in counts and counts["aborted"] >= 25
    assert check(store, sid).ok


def test_paged_loading_keeps_stages_in_order(store: Store) -> None:
    for g in ("a", "b", "c"):
        admin.add_group(store, Group(name=g, max_parallel=10))
        add_sim_targets(store, 7, prefix=g, group=g, settings={"latency_ms": 2})
    sid, conductor = _paged(store, max_parallel=5, stages_by_group=True)
    with store.write() as conn:  # stage 1 last in admission order: pages would mislead
        conn.execute(steps.update().where(steps.c.stage == 1).values(ordinal=steps.c.ordinal + 100))
    assert asyncio.run(conductor.run(strategy_ids=[sid]))[sid] == "complete"
    assert queries.step_counts(store, sid) == {"complete": 21}
    assert check(store, sid).ok  # includes the stage order


def test_idle_dispatcher_tops_up_waiting_steps_in_small_pages(store: Store) -> None:
    """Before the first actions end, idle moments load a reserve of waiting steps, a small
    page at a time, up to a full page: none is loaded when slots free up under load."""
    add_sim_targets(store, 100, settings={"latency_ms": 60})
    sid = applied(store, "patch", max_parallel=10)
    conductor = Conductor(store, config=EngineConfig(waiting_page=40, prefetch_page=8))
    loads: list[int] = []
    load = rt.load_waiting_steps

    def counting(store: Store, sid: int, after: int, limit: int) -> list[rt.StepRecord]:
        recs = load(store, sid, after, limit)
        loads.append(limit)
        return recs

    seen: dict[str, int] = {}

    async def go() -> dict[int, str]:
        task = asyncio.create_task(conductor.run(strategy_ids=[sid]))
        await asyncio.sleep(0.04)  # the first actions take 60 ms
        run = conductor.runs[sid]
        seen.update(pending=run.pending_count(), inflight=len(run.inflight))
        return await task

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(rt, "load_waiting_steps", counting)
        assert asyncio.run(go())[sid] == "complete"
    assert seen["inflight"] == 10
    assert 40 <= seen["pending"] < 40 + 8  # topped up to a page, a small page at a time
    assert loads[0] == 40  # the first load: enough to fill the window (here, the page)
    assert set(loads[1:]) == {8}  # everything after it came in small pages while idle
    assert check(store, sid).ok


def test_first_wave_starts_in_one_commit_up_to_twice_batch_max(store: Store) -> None:
    """Nothing runs yet, so a bigger first commit delays nobody: the whole first wave
    (here 12 > batch_max 8) starts after one commit; later commits keep to batch_max."""
    add_sim_targets(store, 40, settings={"latency_ms": 50})
    sid = applied(store, "patch", max_parallel=12)
    conductor = Conductor(store, config=EngineConfig(batch_max=8))
    seen: dict[str, int] = {}

    async def go() -> dict[int, str]:
        task = asyncio.create_task(conductor.run(strategy_ids=[sid]))
        await asyncio.sleep(0.03)  # the first actions take 50 ms
        seen.update(batches=conductor.stats.batches, running=len(conductor._workers))
        return await task

    assert asyncio.run(go())[sid] == "complete"
    assert seen == {"batches": 1, "running": 12}
    sizes = store_batch_sizes(store, sid)
    assert sizes[0] == 12 and max(sizes[1:]) <= 8
    assert check(store, sid).ok


def test_group_commits_default_to_twice_the_rows_on_a_server_database(store: Store) -> None:
    """A PostgreSQL commit's fixed part (round trips, the write lock, the fence read)
    is dearer than SQLite's: by default its group commits take up to 256 transitions,
    SQLite's 128. A strategy of 600 with nothing running commits its first wave of up
    to twice that in one commit."""
    add_sim_targets(store, 600, settings={"latency_ms": 50})
    sid = applied(store, "patch", max_parallel=600)
    conductor = Conductor(store)
    expected = 128 if store.hooks.embedded else 256
    assert conductor.batch_max == expected
    assert asyncio.run(conductor.run(strategy_ids=[sid]))[sid] == "complete"
    sizes = store_batch_sizes(store, sid)
    assert sizes[0] == 2 * expected
    assert check(store, sid).ok


def store_batch_sizes(store: Store, sid: int) -> list[int]:
    """Journal rows per commit: rows of one group commit share their timestamp."""
    with store.read() as conn:
        rows = conn.execute(
            select(journal.c.at).where(journal.c.strategy_id == sid).order_by(journal.c.id)
        ).all()
    return list(Counter(r.at for r in rows).values())


def test_sim_driver_counts_starts_only_when_asked(store: Store) -> None:
    """The per-attempt start count grows with every operation: the simulator turns it
    on to check G1 at the targets; a conductor's driver keeps nothing."""
    add_sim_targets(store, 5)
    sid = applied(store, "patch")
    quiet, counting = SimDriver(), SimDriver()
    counting.count_starts = True
    for sim in (quiet, counting):
        s = applied(store, "patch") if sim is counting else sid
        assert asyncio.run(Conductor(store, drivers={"sim": sim}).run(strategy_ids=[s]))[s] == (
            "complete"
        )
    assert not quiet.starts
    assert sum(counting.starts.values()) == 5 * 5 and set(counting.starts.values()) == {1}


@pytest.mark.parametrize("wanted", ["nothing", "one strategy"])
def test_a_conductor_registers_once_and_signs_off(store: Store, wanted: str) -> None:
    """Registered with its first claim (or alone when there is nothing to claim), and
    marked stopped on a clean exit: the liveness that takeovers rely on."""
    sids: list[int] = []
    if wanted == "one strategy":
        add_sim_targets(store, 3)
        sids.append(applied(store, "patch"))
    conductor = Conductor(store)
    finished = asyncio.run(conductor.run(strategy_ids=sids))
    assert finished == {sid: "complete" for sid in sids}
    with store.read() as conn:
        rows = conn.execute(select(conductors).where(conductors.c.id == conductor.id)).all()
    assert len(rows) == 1 and rows[0].stopped_at is not None


def test_stale_outcomes_of_one_batch_are_one_warning(
    store: Store, caplog: pytest.LogCaptureFixture
) -> None:
    """A conductor that lost a strategy with hundreds of steps in flight used to log a
    line per step: one line per strategy and batch now, naming a few; each is still an
    event of its step."""
    add_sim_targets(store, 8, settings={"latency_ms": 30})
    sid = applied(store, "patch", max_parallel=8)
    c = Conductor(store)

    async def go() -> dict[int, str]:
        task = asyncio.create_task(c.run(strategy_ids=[sid]))
        await _left_first_state(store, sid, list(range(1, 8)))
        for step in range(1, 8):  # late duplicates of seven first reports, at once
            c.post(ActionFinished(sid, step, "pre-check", 1, Decision("failed", "dup"), 1))
        return await task

    with caplog.at_level(logging.WARNING, logger="fleetwave.engine"):
        assert asyncio.run(go())[sid] == "complete"
    assert c.stats.stale_outcomes == 7
    lines = [r.getMessage() for r in caplog.records if "ignored" in r.getMessage()]
    assert lines == [
        f"strategy {sid}: 7 outcomes ignored: their steps had moved on (a late report, or "
        "the strategy taken over): steps 1 (pre-check), 2 (pre-check), 3 (pre-check), "
        "4 (pre-check), 5 (pre-check) and 2 more"
    ]
    assert all(
        [e["kind"] for e in queries.step_events(store, step)] == ["stale-outcome-ignored"]
        for step in range(1, 8)
    )


class BoomLines(StateAction):
    async def run(self, ctx: ActionContext) -> Outcome:
        raise RuntimeError("boom\nsecond line\r\n\n  third  ")


def test_a_multi_line_exception_message_is_one_line_in_details_and_log(
    store: Store, caplog: pytest.LogCaptureFixture
) -> None:
    """An action's exception with line breaks in its message logged its second line on
    a line of its own, and put the breaks in the step's details (tables broke)."""
    add_sim_targets(store, 1)
    with caplog.at_level(logging.ERROR, logger="fleetwave"):
        sid, final, _ = rollout(store, _wf("boom-lines", StateDef("explode", BoomLines())))
    assert final == "failed"
    assert {d for _, d in _states(store, sid).values()} == {"explode: boom; second line; third"}
    raised = [r.getMessage() for r in caplog.records if "raised RuntimeError" in r.getMessage()]
    assert raised == ["action for t00000 in explode raised RuntimeError: boom; second line; third"]


def test_an_abort_ends_a_step_waiting_out_a_retry_backoff_at_once(store: Store) -> None:
    """A step waiting out its retry's backoff (nothing running on the target) kept the
    abort waiting until the retry was due (up to the 5-minute cap), then ended it
    "not retried". It ends now."""
    add_sim_targets(store, 2)
    wf = _wf("slow-retry", StateDef("a", Flaky(), attempts_max=3, backoff_s=30.0))
    sid = applied(store, wf.name, max_parallel=2)
    c = Conductor(store, config=EngineConfig(tick_s=0.05))
    started = time.monotonic()
    assert _run_and_abort_after(store, c, sid, 0.3) == "aborted"
    assert time.monotonic() - started < 10.0  # not the 30 s backoff
    for state, details in _states(store, sid).values():
        assert state == "aborted"
        assert details.startswith("a: busy (attempt 1 of 3); not retried: the strategy is"), details
    assert check(store, sid).ok
