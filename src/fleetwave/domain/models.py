"""Plain records of the domain (targets, groups, strategies, steps) and their state names."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any


class StrategyState(StrEnum):
    INITIAL = "initial"
    APPLYING = "applying"
    PAUSED = "paused"
    ABORT_REQUESTED = "abort-requested"
    ABORTING = "aborting"
    COMPLETE = "complete"
    FAILED = "failed"
    ABORTED = "aborted"
    DELETING = "deleting"


STRATEGY_TERMINAL = frozenset({StrategyState.COMPLETE, StrategyState.FAILED, StrategyState.ABORTED})
#: Strategy states in which its targets are held (a target can be in one such strategy at a time).
STRATEGY_ACTIVE = frozenset(
    {
        StrategyState.INITIAL,
        StrategyState.APPLYING,
        StrategyState.PAUSED,
        StrategyState.ABORT_REQUESTED,
        StrategyState.ABORTING,
    }
)

STEP_INITIAL = "initial"
STEP_COMPLETE = "complete"
STEP_FAILED = "failed"
STEP_ABORTED = "aborted"
STEP_TERMINAL = frozenset({STEP_COMPLETE, STEP_FAILED, STEP_ABORTED})
RESERVED_STATE_NAMES = STEP_TERMINAL | {STEP_INITIAL}


#: Why a conductor ended a strategy it cannot drive (its workflow gone or changed): its
#: waiting steps end aborted, "not started: cannot drive it: ...", no failure limit involved
UNDRIVABLE = "cannot drive it"


def unmanaged_reason(target_name: str) -> str:
    """Why a step of an unmanaged target failed when its turn came (its details)."""
    return f"Target {target_name} is unmanaged."


class ApplyType(StrEnum):
    PARALLEL = "parallel"
    SERIAL = "serial"


@dataclass(frozen=True)
class Target:
    name: str
    driver: str = "sim"
    group: str | None = None
    settings: dict[str, Any] = field(default_factory=dict)
    managed: bool = True
    labels: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Group:
    name: str
    max_parallel: int = 20
    apply_type: ApplyType = ApplyType.PARALLEL

    @property
    def effective_parallel(self) -> int:
        return 1 if self.apply_type is ApplyType.SERIAL else self.max_parallel


@dataclass(frozen=True)
class StrategyOptions:
    """What an operator chooses when creating a strategy."""

    max_parallel: int = 20
    apply_type: ApplyType = ApplyType.PARALLEL
    stop_on_failure: bool = False
    #: the rollout stops once more than this many steps have failed (None: never)
    max_failures: int | None = None
    stages_by_group: bool = False
    #: per-state timeout overrides, seconds
    timeouts_s: dict[str, float] = field(default_factory=dict)

    @property
    def effective_parallel(self) -> int:
        return 1 if self.apply_type is ApplyType.SERIAL else self.max_parallel

    @property
    def failure_limit(self) -> int | None:
        """Number of failed steps tolerated before the rollout stops."""
        if self.stop_on_failure:
            return 0
        return self.max_failures
