"""The words of a strategy's stop: why it stopped starting steps (its failure limit),
and why a step entered but not started ends aborted once it stops."""

from __future__ import annotations

from fleetwave.domain.models import StrategyOptions
from fleetwave.engine.run import StrategyRun


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
