"""The words of a strategy's stop: why it stopped starting steps (its failure limit),
and why a step entered but not started ends aborted once it stops."""

from __future__ import annotations

from collections.abc import Mapping

from fleetwave.domain.models import StrategyOptions
from fleetwave.domain.rollout import stage_failure_stop, stage_tolerance
from fleetwave.engine.run import StrategyRun
from fleetwave.store.writer import StopRule


def stop_reason(options: StrategyOptions, failed: int, who: str | None = None) -> str:
    """Why a strategy stopped starting steps, once ``failed`` steps exceed its limit
    (``who``: the target whose failure did it, if known)."""
    if options.stop_on_failure:
        return f"stopped after {who or 'a step'} failed (stop on failure)"
    last = f" (the last: {who})" if who else ""
    many = "steps exceed" if failed != 1 else "step exceeds"
    return f"stopped: {failed} failed {many} the failure threshold of {options.failure_limit}{last}"


def not_started_reason(run: StrategyRun, state: str, attempt: int) -> str:
    """Why a step entered but not started (its state, or a recorded retry of it: its
    ``attempt``) ends aborted once its strategy stops."""
    if attempt > 1:
        attempts_max = run.workflow.state(state).attempts_max
        return f"{state}: attempt {attempt} of {attempts_max} not started: {run.stop_details}"
    return f"stopped before {state} started: {run.stop_details}"


def count_failure(run: StrategyRun, phase: int | None, who: str | None = None) -> str | None:
    """Book one more failed step of ``run`` (of target ``who``, in ``phase`` when known);
    returns why the strategy stops now (its limit, or its stage's, exceeded; a canary
    failed), or None."""
    run.failed += 1
    plan = run.options.plan
    if plan and phase is not None and 0 < phase < len(run.phase_stage):
        stage = run.phase_stage[phase]
        run.failed_in_stage[stage] += 1
        why = stage_failure_stop(plan[stage], run.failed_in_stage[stage])
        if why is not None:
            return f"stopped: {why}" + (f" (the last: {who})" if who else "")
    limit = run.options.failure_limit
    if limit is not None and run.failed > limit:
        return stop_reason(run.options, run.failed, who)
    return None


def commit_stop_rule(run: StrategyRun, phase: int) -> StopRule | None:
    """The failure limit a commit starting ``run``'s steps of ``phase`` applies (a
    target unmanaged meanwhile fails there): the tighter of the strategy's and its
    stage's; None when neither has one."""
    rule = None
    limit = run.options.failure_limit
    if limit is not None:
        rule = StopRule(limit - run.failed, stop_reason(run.options, limit + 1, StopRule.TARGET))
    plan = run.options.plan
    if plan and 0 < phase < len(run.phase_stage):
        index = run.phase_stage[phase]
        stage, failed = plan[index], run.failed_in_stage[index]
        tolerated = stage_tolerance(stage, failed)
        if tolerated is not None and (rule is None or tolerated < rule.tolerated):
            why = stage_failure_stop(stage, failed + max(tolerated, 0) + 1)
            rule = StopRule(tolerated, f"stopped: {why} (the last: {StopRule.TARGET})")
    return rule


def stage_stop_on_takeover(run: StrategyRun, failed_by_phase: Mapping[int, int]) -> str | None:
    """A strategy taken over: count its stages' failed steps (``failed_by_phase``: by a
    step's stage column) and say whether one of its stages stopped it (None: none)."""
    plan = run.options.plan
    run.failed_in_stage.clear()
    for phase, n in failed_by_phase.items():
        if 0 < phase < len(run.phase_stage):
            run.failed_in_stage[run.phase_stage[phase]] += n
    for index, n in sorted(run.failed_in_stage.items()):
        why = stage_failure_stop(plan[index], n)
        if why is not None:
            return f"stopped: {why}"
    return None
