"""The dispatcher's in-memory bookkeeping of a strategy (engine/run.py), as a model."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from fleetwave.domain.builtin import builtin_workflows
from fleetwave.domain.models import StrategyOptions, Target
from fleetwave.engine.run import InFlight, StrategyRun
from fleetwave.store.runtime import StepRecord, StrategyRecord

PATCH = next(wf for wf in builtin_workflows() if wf.name == "patch")


def _run(staged: bool, cap: int, group_caps: dict[int, int]) -> StrategyRun:
    rec = StrategyRecord(
        id=1,
        workflow="patch",
        state="applying",
        options="{}",
        group_caps=group_caps,
        owner="c",
        fence=1,
        lease_expires_at=None,
        details="",
    )
    opts = StrategyOptions(max_parallel=cap, stages_by_group=staged)
    return StrategyRun(rec, PATCH, opts)


def _step(i: int, stage: int, group: int | None) -> StepRecord:
    return StepRecord(
        step_id=i,
        strategy_id=1,
        stage=stage,
        group_id=group,
        state="initial",
        fence=0,
        attempt=0,
        owner=None,
        target=Target(name=f"t{i}"),
        ordinal=i,
    )


def _slow_stage(run: StrategyRun) -> int | None:
    stages = {fl.rec.stage for fl in run.inflight.values()}
    stages.update(s for s, groups in run.pending.items() if any(groups.values()))
    return min(stages) if stages else None


ops = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.integers(1, 3), st.sampled_from([None, 1, 2])),
        st.tuples(st.just("take"), st.integers(0, 6), st.none()),
        st.tuples(st.just("end"), st.integers(0, 5), st.none()),
        st.tuples(st.just("requeue"), st.integers(0, 3), st.none()),
        st.tuples(st.just("drain"), st.just(0), st.none()),
    ),
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(staged=st.booleans(), cap=st.integers(1, 6), ops=ops)
def test_pending_count_and_stage_agree_with_the_queues(
    staged: bool, cap: int, ops: list[tuple[str, int, int | None]]
) -> None:
    """The kept count is the queues' length, and the one-stage shortcut finds the same
    stage as looking at every step, whatever the order of loads, admissions and ends."""
    run = _run(staged, cap, {1: 2})
    n = 0
    started = 0  # the highest stage a step was admitted from
    for op, arg, group in ops:
        if op == "add":
            # (as the engine loads them: none in a stage below one already started,
            # since a staged strategy's waiting steps are loaded before any starts)
            n += 1
            run.add_pending(_step(n, max(arg, started) if staged else 1, group))
        elif op == "take":
            for rec in run.take_admissions(arg):
                started = max(started, rec.stage)
                run.inflight[rec.step_id] = InFlight(rec, "pre-check", 1)
                run.group_load[rec.group_id] += 1
        elif op == "end" and run.inflight:
            step_id = sorted(run.inflight)[arg % len(run.inflight)]
            fl = run.inflight.pop(step_id)
            run.group_load[fl.rec.group_id] -= 1
        elif op == "requeue":
            taken = run.take_admissions(arg)
            run.requeue_front(taken)
        elif op == "drain":
            run.drain_pending()
        queued = sum(len(q) for groups in run.pending.values() for q in groups.values())
        assert run.pending_count() == queued
        assert run.current_stage() == _slow_stage(run)
        assert len(run.inflight) <= cap


def test_an_unsettled_step_holds_its_max_parallel_slot() -> None:
    """G7: a step whose transition was refused may still be running on its target (it
    is read back and perhaps taken over): until settled it holds its slot, so a run at
    max parallel 1 admits nothing meanwhile (found unpinned by a mutation audit; the
    stage and group slots had tests)."""
    from fleetwave.engine.run import Unsettled

    run = _run(False, 1, {})
    run.unsettled[1] = Unsettled(refused=None, stage=1, group_id=None, held=True)
    run.add_pending(_step(2, 1, None))
    assert not run.take_admissions_possible()
    assert run.take_admissions(10) == []
    del run.unsettled[1]  # settled: its slot is free
    assert [rec.step_id for rec in run.take_admissions(10)] == [2]
