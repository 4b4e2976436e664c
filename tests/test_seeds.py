"""One regression test per seed document (../shared/seeds), reproduced at scale.

Each asserts from the journal that no state was entered twice and that no step is
left non-terminal or locked.
"""

from __future__ import annotations

import asyncio
from collections import Counter

from sqlalchemy import func, select

from conftest import add_sim_targets, applied, rollout
from fleetwave.domain.models import STEP_TERMINAL
from fleetwave.domain.registry import get_workflow
from fleetwave.domain.rules import decide
from fleetwave.domain.workflow import Advance
from fleetwave.drivers.sim import SimDriver
from fleetwave.engine.conductor import Conductor
from fleetwave.store import queries
from fleetwave.store import runtime as rt
from fleetwave.store.db import Store
from fleetwave.store.schema import conductors, journal, steps, strategies
from fleetwave.testing.invariants import check


def _assert_clean_end(store: Store, sid: int) -> None:
    with store.read() as conn:
        dup = conn.execute(
            select(journal.c.step_id, journal.c.to_state)
            .group_by(journal.c.step_id, journal.c.to_state)
            .having(func.count() > 1)
        ).all()
        open_steps = conn.execute(
            select(func.count()).where(
                steps.c.strategy_id == sid, steps.c.state.not_in(list(STEP_TERMINAL))
            )
        ).scalar_one()
        held = conn.execute(select(func.count()).where(steps.c.owner.is_not(None))).scalar_one()
        strat_owner = conn.execute(
            select(strategies.c.owner).where(strategies.c.id == sid)
        ).scalar_one()
    assert dup == [], "a state was entered twice"
    assert open_steps == 0, "a step was left non-terminal"
    assert held == 0, "a step lease or lock was left held"
    assert strat_owner is None
    result = check(store, sid)
    assert result.ok, result.violations


def test_seed_000_stale_snapshot_never_reenters_a_finished_state(store: Store) -> None:
    """A scanner read a snapshot, a worker finished, the scanner re-entered the state.

    Here: take the snapshot mid-rollout, let every step finish, then act on the stale
    snapshot the way the buggy scanner did. Every such move is fenced off.
    """
    add_sim_targets(store, 2000, settings={"latency_ms": 3})
    sid = applied(store, "patch", max_parallel=500)
    first = Conductor(store)
    snapshot: list[rt.StepRecord] = []

    async def run_and_snapshot() -> dict[int, str]:
        task = asyncio.create_task(first.run(strategy_ids=[sid]))
        while not snapshot:
            await asyncio.sleep(0.01)
            recs, _ = rt.load_open_steps(store, sid)
            snapshot.extend(r for r in recs if r.state != "initial")
        # A second conductor arriving now must not drive a strategy with a live owner.
        second = await Conductor(store).run(strategy_ids=[sid])
        assert second[sid] == "owned"
        return await task

    assert asyncio.run(run_and_snapshot())[sid] == "complete"
    assert len(snapshot) >= 100
    before = queries.history(store, sid)

    # The stale scanner: take over and re-dispatch every step it saw in flight.
    assert rt.take_over_steps(store, snapshot, "stale-scanner", 0.0) == []
    writer = rt.TransitionWriter(store, "stale-scanner")
    patch = get_workflow("patch")
    assert patch is not None
    stale = [
        rt.Transition(
            step_id=r.step_id,
            strategy_id=sid,
            from_state=r.state,
            from_fence=r.fence,
            to_state=decide(patch.state_names, r.state, Advance()).to_state,
            fence=r.fence,
            details="stale re-dispatch",
            attempt=1,
        )
        for r in snapshot
    ]
    rejected = writer.commit(stale, [], 1.0).rejected
    assert len(rejected) == len(stale)
    assert queries.history(store, sid) == before
    kinds = Counter(e["kind"] for e in queries.strategy_events(store, sid))
    assert kinds["transition-rejected"] == len(stale)
    _assert_clean_end(store, sid)


def test_seed_001_two_thousand_finish_at_once_each_state_runs_once(store: Store) -> None:
    """Workers edited the scheduler's table; a finished state got a new worker.

    Here 2,000 zero-latency targets at max parallel 1,000 all finish at once, again
    and again; the targets themselves report each operation exactly once.
    """
    add_sim_targets(store, 2000)
    sim = SimDriver()
    sim.record = True
    sid, final, c = rollout(
        store, conductor=Conductor(store, drivers={"sim": sim}), max_parallel=1000
    )
    assert final == "complete"
    wf = get_workflow("patch")
    assert wf is not None
    seen = Counter((t, op) for t, op, _ in sim.performed)
    assert len(seen) == 2000 * len(wf.states)
    assert max(seen.values()) == 1
    assert c.stats.transitions == 2000 * (len(wf.states) + 1)
    assert c.stats.rejected == 0 and c.stats.stale_outcomes == 0
    _assert_clean_end(store, sid)


def test_seed_003_timed_out_state_leaves_nothing_locked(store: Store) -> None:
    """Callbacks blocked on a lock and left nodes locked until a human stepped in.

    Here 1,000 targets hang in one state; the timeout fails each with a clear reason,
    every lease is handed back, and nothing waits for an operator.
    """
    add_sim_targets(store, 1000, settings={"hang_at": "applying-remote-patch-strategy"})
    sid, final, _ = rollout(
        store, max_parallel=1000, timeouts_s={"applying-remote-patch-strategy": 0.3}
    )
    assert final == "failed"
    details = {s["details"] for s in queries.list_steps(store, sid)}
    assert details == {"applying-remote-patch-strategy: timed out after 0.3s (attempt 1 of 1)"}
    with store.read() as conn:
        live = conn.execute(select(conductors.c.id).where(conductors.c.stopped_at.is_(None))).all()
    assert live == []
    _assert_clean_end(store, sid)
