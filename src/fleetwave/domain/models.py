"""Plain records of the domain (targets, groups, strategies, steps) and their state names."""

from __future__ import annotations

import re
import unicodedata
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fleetwave.domain.rollout import PlannedStage


class StrategyState(StrEnum):
    INITIAL = "initial"
    APPLYING = "applying"
    PAUSED = "paused"
    #: a stage ended and the next waits for ``strategy approve`` (``--stage-approval``)
    WAITING_APPROVAL = "waiting-approval"
    ABORT_REQUESTED = "abort-requested"
    ABORTING = "aborting"
    COMPLETE = "complete"
    FAILED = "failed"
    ABORTED = "aborted"
    DELETING = "deleting"
    #: deleted: its steps are gone from the working tables, its history is kept (its
    #: journal, attempts, events, callbacks and its steps as they ended) until
    #: ``fleetwave prune``; its id is never given again
    DELETED = "deleted"
    #: ``fleetwave prune`` is dropping its history (partly gone); prune again finishes
    PRUNING = "pruning"


STRATEGY_TERMINAL = frozenset({StrategyState.COMPLETE, StrategyState.FAILED, StrategyState.ABORTED})
#: Strategy states in which its targets are held (a target can be in one such strategy at a time).
STRATEGY_ACTIVE = frozenset(
    {
        StrategyState.INITIAL,
        StrategyState.APPLYING,
        StrategyState.PAUSED,
        StrategyState.WAITING_APPROVAL,
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


#: The rule for a target's or a group's name: one word an operator can type, list with
#: commas (``--targets a,b``) and find in a log line. Names stored before the rule was
#: enforced are left alone (they can still be shown, managed and deleted).
NAME_MAX = 255
NAME_RULE = (
    f"1-{NAME_MAX} characters: letters and digits (of any script) and _ . - : @, starting "
    "with a letter or digit (no spaces, commas or control characters)"
)
#: \w: a letter or digit of any script, or _ (str patterns match Unicode)
_NAME = re.compile(r"[^\W_][\w.:@-]*")
#: what a workflow state may be called (YAML workflows; the sim's fail_at, hang_at and
#: unexpected_at settings name states by the same rule); at most STATE_NAME_MAX characters
#: Numbers as an operator types them: decimal, no leading zeros ("010" stays text), with
#: an optional fraction and exponent ("1e3", "1.5e3"). Not YAML 1.1's octal, hex,
#: sexagesimal ("1:30") or yes/no/on/off.
DECIMAL_INT = re.compile(r"0|-?[1-9][0-9]*")
DECIMAL_FLOAT = re.compile(r"[-+]?(?:(?:0|[1-9][0-9]*)(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][-+]?[0-9]+)?")


def typed_as_number(text: str) -> bool:
    """Whether ``text`` reads as a number where numbers are typed (YAML, ``--set``): as
    text, it was quoted."""
    return bool(DECIMAL_INT.fullmatch(text) or DECIMAL_FLOAT.fullmatch(text))


STATE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
STATE_NAME_MAX = 64


def shown(text: str, limit: int = 40) -> str:
    """``text`` as an error message quotes it: on one line (control characters escaped)
    and cut after ``limit`` characters."""
    return repr(text[:limit]) + ("..." if len(text) > limit else "")


def name_problem(name: str) -> str | None:
    """What is wrong with ``name`` as a target or group name, or None if it is fine."""
    if not name:
        return "must not be empty"
    if len(name) > NAME_MAX:
        return f"{shown(name)} is {len(name)} characters long; use {NAME_RULE}"
    if not _NAME.fullmatch(name):
        composed = unicodedata.normalize("NFC", name)
        if composed != name and _NAME.fullmatch(composed) and len(composed) <= NAME_MAX:
            # "e" + a combining accent, as macOS may write a file's text: the accent is
            # not a letter of its own
            return (
                f"{shown(name)} is written with combining accents (decomposed Unicode, as "
                f"macOS may save it); write it composed: {shown(composed)}"
            )
        return f"{shown(name)} is not allowed; use {NAME_RULE}"
    return None


#: Why a conductor ended a strategy it cannot drive (its workflow gone or changed): its
#: waiting steps end aborted, "not started: cannot drive it: ...", no failure limit involved
UNDRIVABLE = "cannot drive it"


def has_labels(labels: dict[str, str], wanted: dict[str, str]) -> bool:
    """Whether a target's labels include every one of ``wanted`` (key and value)."""
    return all(labels.get(k) == v for k, v in wanted.items())


def plural(n: int, noun: str, nouns: str | None = None) -> str:
    """``1 step``, ``2 steps`` (``nouns`` where adding an s is wrong)."""
    return f"{n} {noun if n == 1 else (nouns or noun + 's')}"


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
    #: its place when groups are stages (``--stages-by-group``): by this, then by name;
    #: groups without one after those with one
    stage_order: int | None = None

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
    #: ``--max-failures`` as a percent ("5%"), as given; :attr:`max_failures` is then
    #: that percent of the strategy's steps, rounded down (set when it is created)
    max_failures_percent: str = ""
    #: the rollout's order as given (``--stage``, ``--batches``, ``--canary``,
    #: ``--canary-label``, ``--stage-max-failures``), shown by ``strategy show``
    stages: list[list[str]] = field(default_factory=list)
    batches: str = ""
    canary: str = ""
    canary_label: dict[str, str] = field(default_factory=dict)
    stage_max_failures: str = ""
    #: the plan made of them when the strategy was created (fleetwave.domain.rollout):
    #: its stages in order, each cut into batches; a step's stage column is its phase
    #: (one per batch of each stage). Empty: one stage, or stages by group made before
    #: plans were kept
    plan: list[PlannedStage] = field(default_factory=list)
    #: targets chosen but in no stage of the plan, left out of the strategy
    left_out: int = 0
    #: after each stage of the plan, wait this long before the next starts
    stage_wait_s: float = 0.0
    #: after each stage of the plan, wait for ``strategy approve`` before the next starts
    stage_approval: bool = False
    #: no step starts before this time (epoch seconds; ``--start-after``)
    start_after: float | None = None
    #: steps start only inside these weekly windows (``--window``, as given)
    windows: list[str] = field(default_factory=list)
    #: after this time nothing new starts, and the strategy ends failed (``--deadline``)
    deadline: float | None = None

    @property
    def effective_parallel(self) -> int:
        return 1 if self.apply_type is ApplyType.SERIAL else self.max_parallel

    @property
    def staged(self) -> bool:
        """Whether its steps run in more than one phase (stages, batches, canaries)."""
        return self.stages_by_group or sum(len(s.batches) for s in self.plan) > 1

    @property
    def shareable(self) -> bool:
        """Whether conductors that do not lead it may drive its steps beside its leader:
        a sliding window (no stages, batches, canaries, gates, windows or deadline),
        where any free slot may take any waiting step."""
        return not (self.staged or self.gated or self.windows or self.deadline is not None)

    @property
    def gated(self) -> bool:
        """Whether something besides the steps' ends holds a phase's start (a wait after
        a stage, an approval)."""
        return bool(
            self.stage_wait_s > 0
            or self.stage_approval
            or self.start_after is not None
            or self.windows
            or self.deadline is not None
        )

    @property
    def failure_limit(self) -> int | None:
        """Number of failed steps tolerated before the rollout stops."""
        if self.stop_on_failure:
            return 0
        return self.max_failures
