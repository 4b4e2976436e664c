"""G7 in the database: several conductors' commits share one strategy's slots.

Every commit counts its entries and ends in ``strategy_slots`` and writes an entry only
if the strategy's and its group's caps still hold, whatever the conductor that made it
believed; waiting steps are claimed by one conductor each (``claim_waiting_steps``),
and a claimed step is started only by its owner. Here the writers of several
conductors are driven by hand, interleaved, on both dialects.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from conftest import add_sim_targets
from fleetwave.domain.models import ApplyType, Group, StrategyOptions
from fleetwave.domain.registry import get_workflow
from fleetwave.store import admin, slots
from fleetwave.store import runtime as rt
from fleetwave.store.db import Store, open_store
from fleetwave.testing.invariants import check

pytestmark = pytest.mark.both_dialects

FIRST = "pre-check"


def _strategy(store: Store, n: int, max_parallel: int, group_cap: int | None = None) -> int:
    if group_cap is not None:
        admin.add_group(
            store, Group(name="g", max_parallel=group_cap, apply_type=ApplyType.PARALLEL)
        )
    add_sim_targets(store, n, group="g" if group_cap is not None else None)
    wf = get_workflow("patch")
    assert wf is not None
    sid = admin.create_strategy(
        store, wf, StrategyOptions(max_parallel=max_parallel), all_targets=True
    )
    admin.apply_strategy(store, sid)
    return sid


def _enter(rec: rt.StepRecord) -> rt.Transition:
    return rt.Transition(
        rec.step_id, rec.strategy_id, "initial", rec.fence, FIRST, rec.fence + 1, "", 0,
        group_id=rec.group_id,
    )  # fmt: skip


def _end(rec: rt.StepRecord, to_state: str = "complete") -> rt.Transition:
    return rt.Transition(
        rec.step_id, rec.strategy_id, FIRST, rec.fence + 1, to_state, rec.fence + 1, "", 1,
        group_id=rec.group_id,
    )  # fmt: skip


def _whole(store: Store, sid: int) -> slots.Slots:
    with store.read() as conn:
        return slots.read_slots(conn, store.hooks, sid)[0]


def test_an_entry_past_the_cap_is_not_written_whoever_made_it(store: Store) -> None:
    """A and B each believe two slots are free of max parallel 2: B's entries wait."""
    sid = _strategy(store, 6, max_parallel=2)
    a, b = rt.TransitionWriter(store, "A"), rt.TransitionWriter(store, "B")
    mine_a = rt.claim_waiting_steps(store, sid, "A", 2)
    mine_b = rt.claim_waiting_steps(store, sid, "B", 2)
    assert not {r.step_id for r in mine_a} & {r.step_id for r in mine_b}
    assert a.commit([_enter(r) for r in mine_a], [], 1.0).rejected == []
    res = b.commit([_enter(r) for r in mine_b], [], 1.0)
    assert res.rejected == [] and res.no_slot == {sid: 2}
    assert {t.step_id for t in res.deferred} == {r.step_id for r in mine_b}
    assert _whole(store, sid).in_flight == 2
    # A ends one: its slot is B's to take, and only one of B's two fits.
    assert a.commit([_end(mine_a[0])], [], 2.0).rejected == []
    res = b.commit([_enter(r) for r in mine_b], [], 3.0)
    assert res.no_slot == {sid: 1} and len(res.deferred) == 1
    assert _whole(store, sid).in_flight == 2
    assert check(store, sid).ok, check(store, sid).violations
    a.close()
    b.close()


def test_an_end_and_an_entry_that_cancel_out_in_a_refused_batch(store: Store) -> None:
    """A batch whose one refused row sends it down the row-by-row path, and whose end and
    entry of one strategy leave its slots as they were: nothing to count (on PostgreSQL
    the count's statement once ran without rows, hence without parameters, and failed)."""
    sid = _strategy(store, 3, max_parallel=2)
    a = rt.TransitionWriter(store, "A")
    s1, s2, s3 = rt.claim_waiting_steps(store, sid, "A", 3)
    assert a.commit([_enter(s1)], [], 1.0).rejected == []
    stale = _enter(s3)
    stale.from_fence += 5  # (as if another conductor had moved it since)
    res = a.commit([_end(s1), _enter(s2), stale], [], 2.0)
    assert [t.step_id for t in res.rejected] == [s3.step_id]
    assert _whole(store, sid).in_flight == 1
    assert check(store, sid).ok, check(store, sid).violations
    a.close()


def test_a_group_cap_holds_across_conductors(store: Store) -> None:
    sid = _strategy(store, 4, max_parallel=10, group_cap=1)
    a, b = rt.TransitionWriter(store, "A"), rt.TransitionWriter(store, "B")
    (ra,) = rt.claim_waiting_steps(store, sid, "A", 1)
    (rb,) = rt.claim_waiting_steps(store, sid, "B", 1)
    assert a.commit([_enter(ra)], [], 1.0).rejected == []
    assert b.commit([_enter(rb)], [], 1.0).no_slot == {sid: 1}
    # A's step fails: the group's slot frees and the failure is counted on the strategy
    assert a.commit([_end(ra, "failed")], [], 2.0).rejected == []
    assert b.commit([_enter(rb)], [], 3.0).no_slot == {}
    assert _whole(store, sid).failed == 1
    assert check(store, sid).ok, check(store, sid).violations
    a.close()
    b.close()


def test_a_step_claimed_by_one_conductor_is_not_started_by_another(store: Store) -> None:
    sid = _strategy(store, 2, max_parallel=5)
    b = rt.TransitionWriter(store, "B")
    mine_a = rt.claim_waiting_steps(store, sid, "A", 1)
    res = b.commit([_enter(mine_a[0])], [], 1.0)
    assert [t.step_id for t in res.rejected] == [mine_a[0].step_id]
    assert _whole(store, sid).in_flight == 0
    # handed back, it is anyone's again
    rt.release_waiting_steps(store, "A", [mine_a[0].step_id])
    assert b.commit([_enter(mine_a[0])], [], 2.0).rejected == []
    b.close()


def test_claims_take_disjoint_steps_in_admission_order(store: Store) -> None:
    sid = _strategy(store, 5, max_parallel=5)
    got = [rt.claim_waiting_steps(store, sid, c, 2) for c in ("A", "B", "C", "A")]
    ordinals = [[r.ordinal for r in recs] for recs in got]
    assert ordinals == [[0, 1], [2, 3], [4], []]


def test_a_recount_mends_slots_a_hand_edit_left_wrong(store: Store) -> None:
    sid = _strategy(store, 2, max_parallel=1)
    a = rt.TransitionWriter(store, "A")
    (rec,) = rt.claim_waiting_steps(store, sid, "A", 1)
    assert a.commit([_enter(rec)], [], 1.0).rejected == []
    p = store.hooks.placeholder
    with store.write() as conn:  # ended by hand: the slot stays taken in the count
        conn.exec_driver_sql(f"UPDATE steps SET state = 'complete' WHERE id = {p}", (rec.step_id,))
    assert not check(store, sid).ok
    assert rt.recount_slots(store, sid, "A", 2.0) is True
    assert _whole(store, sid).in_flight == 0
    assert rt.recount_slots(store, sid, "A", 3.0) is False
    a.close()


# -- any interleaving ----------------------------------------------------------------


@dataclass
class _Conductor:
    name: str
    writer: rt.TransitionWriter
    waiting: list[rt.StepRecord] = field(default_factory=list)
    running: list[rt.StepRecord] = field(default_factory=list)


#: one move of one conductor: (which, what, how many); claims of up to 3 steps, entries
#: and ends of up to 3 of its own
_OPS = st.lists(
    st.tuples(
        st.integers(0, 2),
        st.sampled_from(["claim", "enter", "complete", "fail"]),
        st.integers(1, 3),
    ),
    min_size=1,
    max_size=40,
)


@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(ops=_OPS, caps=st.tuples(st.integers(1, 4), st.integers(1, 3)))
# (always tried: two conductors each starting as many as the strategy's cap, then the
# group's cap binding, then a slot freed and taken by the other)
@example(ops=[(0, "claim", 3), (1, "claim", 3), (0, "enter", 3), (1, "enter", 3)], caps=(2, 3))
@example(ops=[(0, "claim", 3), (1, "claim", 3), (0, "enter", 2), (1, "enter", 2)], caps=(4, 1))
@example(
    ops=[(0, "claim", 2), (1, "claim", 2), (0, "enter", 2), (0, "fail", 1), (1, "enter", 2)],
    caps=(2, 3),
)
def test_no_interleaving_exceeds_a_cap_or_shares_a_step(
    db_url: str, ops: list[tuple[int, str, int]], caps: tuple[int, int]
) -> None:
    """Three conductors claim, start and end steps in any order, each believing every
    slot is free: in flight never above the strategy's or the group's cap, at any
    commit; a step is started by the conductor that claimed it, once; the slots always
    match the steps, and ``check`` passes."""
    store = open_store(db_url)
    try:
        _drop_everything(store)
        max_parallel, group_cap = caps
        sid = _strategy(store, 8, max_parallel=max_parallel, group_cap=group_cap)
        cs = [_Conductor(c, rt.TransitionWriter(store, c)) for c in ("A", "B", "C")]
        started: dict[int, str] = {}
        for who, what, n in ops:
            c = cs[who]
            if what == "claim":
                c.waiting += rt.claim_waiting_steps(store, sid, c.name, n)
            elif what == "enter":
                batch, c.waiting = c.waiting[:n], c.waiting[n:]
                res = c.writer.commit([_enter(r) for r in batch], [], 1.0)
                assert res.rejected == []
                back = {t.step_id for t in res.deferred}
                for rec in batch:
                    if rec.step_id in back:
                        c.waiting.append(rec)
                    else:
                        assert rec.step_id not in started, "a step started twice"
                        started[rec.step_id] = c.name
                        c.running.append(rec)
            else:
                batch, c.running = c.running[:n], c.running[n:]
                to = "complete" if what == "complete" else "failed"
                assert c.writer.commit([_end(r, to) for r in batch], [], 2.0).rejected == []
            whole = _whole(store, sid)
            assert whole.in_flight <= min(max_parallel, group_cap)
            with store.read() as conn:
                assert slots.drift(conn, store.hooks, sid) == []
                owners = conn.exec_driver_sql(
                    "SELECT id, owner FROM steps WHERE state <> 'initial' AND state <> "
                    "'complete' AND state <> 'failed'"
                ).all()
            for step_id, owner in owners:
                assert started[int(step_id)] == owner
        verdict = check(store, sid)
        assert verdict.ok, verdict.violations
        for c in cs:
            c.writer.close()
    finally:
        store.dispose()


def _drop_everything(store: Store) -> None:
    """A fresh database for each example (hypothesis reuses the test's database)."""
    from fleetwave.store.schema import metadata

    with store.engine.begin() as conn:
        for table in reversed(metadata.sorted_tables):
            conn.execute(table.delete())


def test_a_helper_writes_its_steps_only_while_the_strategy_is_driven(store: Store) -> None:
    """A conductor that helps drive a strategy another leads commits with the SHARED
    fence: its own steps' owner and fence decide while the strategy is applying; once the
    strategy has ended (or is deleted), nothing of it is written."""
    sid = _strategy(store, 3, max_parallel=3)
    helper = rt.TransitionWriter(store, "H")
    s1, s2 = rt.claim_waiting_steps(store, sid, "H", 2)
    res = helper.commit([_enter(s1)], [], 1.0, fences={sid: rt.SHARED})
    assert res.rejected == [] and res.lost == set()
    with store.write() as conn:
        conn.exec_driver_sql(
            f"UPDATE strategies SET state = 'failed' WHERE id = {store.hooks.placeholder}",
            (sid,),
        )
    res = helper.commit([_end(s1), _enter(s2)], [], 2.0, fences={sid: rt.SHARED})
    assert res.lost == {sid}
    assert {t.step_id for t in res.rejected} == {s1.step_id, s2.step_id}
    assert _whole(store, sid).in_flight == 1  # (nothing of the refused commit counted)
    helper.close()
