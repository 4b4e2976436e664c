"""Rollout plans: in what order a strategy's targets run (canaries, stages, batches),
and the counts or percents an operator gives sizes and failure limits in.

Pure: text and target lists in, plans and decisions out. ``strategy create`` parses
the options with :func:`parse_amount`, :func:`parse_stages` and :func:`parse_batches`,
and the store plans the chosen targets with :func:`plan_rollout` when it creates the
strategy (and for ``--dry-run``). A plan is a list of stages, each cut into batches;
every batch of every stage is one *phase*, numbered from 1 in the order they run, and a
step's ``stage`` column holds its phase: the engine starts no step of a phase before
every step of the earlier phases has ended, and ``fleetwave check`` verifies that from
the journal. :func:`failure_stop` says when failures stop a strategy.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Protocol

from fleetwave.domain.errors import InputError
from fleetwave.domain.models import has_labels, plural, shown
from fleetwave.domain.windows import parse_window, shown_time, window_at

#: what a ``--stage`` may say for "the targets of no other stage"
REST_NAMES = ("rest", "*")
#: the name a canary stage goes by
CANARY = "canaries"

_PERCENT = re.compile(r"(0|[1-9][0-9]*)(\.[0-9]+)?%")
_COUNT = re.compile(r"0|[1-9][0-9]*")


@dataclass(frozen=True)
class Amount:
    """A count ("5") or a percent of some whole ("20%", "12.5%"), as an operator typed it."""

    text: str
    count: int | None = None
    percent: Fraction | None = None

    def limit_of(self, whole: int) -> int:
        """As a failure limit over ``whole`` steps: the failures tolerated (more stop it).
        ``5%`` of 30 tolerates 1 (1.5 rounded down): a second failure exceeds 5%."""
        if self.count is not None:
            return self.count
        assert self.percent is not None
        return math.floor(self.percent * whole / 100)

    def size_of(self, whole: int) -> int:
        """As a batch or canary size over ``whole`` targets: rounded down, at least 1."""
        if self.count is not None:
            return self.count
        return max(1, self.limit_of(whole))


def parse_amount(text: str, option: str, *, least: int = 0) -> Amount:
    """``N`` or ``P%`` (at most 100%); a count below ``least`` is refused (a percent
    must then be above 0)."""
    given = text.strip()
    if _COUNT.fullmatch(given):
        count = int(given)
        if count < least:
            raise InputError(f"{option}: must be at least {least}, got {given}")
        return Amount(given, count=count)
    if _PERCENT.fullmatch(given):
        percent = Fraction(given[:-1])
        if percent > 100:
            raise InputError(f"{option}: a percent is at most 100%, got {given}")
        if least > 0 and percent == 0:
            raise InputError(f"{option}: must be more than 0%, got {given}")
        return Amount(given, percent=percent)
    raise InputError(f"{option}: expected a whole number or a percent (5, 20%), got {shown(text)}")


def parse_stages(given: Sequence[str]) -> list[tuple[str, ...]]:
    """``--stage`` options as given (``canary``, ``east,west``, ``rest`` or ``*``): the
    group names of each stage, in order. An empty stage, an empty name, and a group (or
    ``rest``) in two stages are refused; whether the groups exist the store checks."""
    stages: list[tuple[str, ...]] = []
    seen: dict[str, int] = {}
    for number, text in enumerate(given, 1):
        names = [n.strip() for n in text.split(",")]
        if not any(names):
            raise InputError(f"--stage: stage {number} is empty (give group names, or rest)")
        if not all(names):
            raise InputError(f"--stage: an empty group name in {shown(text)}")
        stage: list[str] = []
        for name in names:
            key = "rest" if name in REST_NAMES else name
            if key in seen:
                where = "the same stage" if seen[key] == number else f"stages {seen[key]}"
                where += "" if seen[key] == number else f" and {number}"
                raise InputError(f"--stage: {shown(name)} is given in {where}")
            seen[key] = number
            stage.append(key)
        stages.append(tuple(stage))
    return stages


def parse_batches(text: str) -> list[Amount]:
    """``--batches 1,5,20%``: the batch sizes (the last one repeats); each at least 1."""
    parts = text.split(",")
    if not text.strip() or not all(p.strip() for p in parts):
        raise InputError(f"--batches: an empty size in {shown(text)}")
    return [parse_amount(p, "--batches", least=1) for p in parts]


def batch_sizes(sizes: Sequence[Amount], whole: int) -> list[int]:
    """``whole`` targets cut into batches of ``sizes`` (a percent is of ``whole``; the
    last size repeats; the last batch takes what is left)."""
    out: list[int] = []
    left = whole
    i = 0
    while left > 0:
        size = min(left, sizes[min(i, len(sizes) - 1)].size_of(whole))
        out.append(size)
        left -= size
        i += 1
    return out


@dataclass(frozen=True)
class PlanTarget:
    """A target as a plan sees it (in the strategy's order within its group)."""

    id: int
    name: str
    group: str | None
    labels: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class PlannedStage:
    """One stage of a plan: its name, its groups, how many steps, its batches' sizes
    (one batch of all of them without ``--batches``) and its own failure limit."""

    name: str
    groups: list[str]
    steps: int
    batches: list[int]
    #: failed steps of this stage tolerated (more stop the strategy); None: no limit
    max_failures: int | None = None
    canary: bool = False


@dataclass(frozen=True)
class Plan:
    stages: list[PlannedStage]
    #: (target id, phase) in the order the steps are admitted
    order: list[tuple[int, int]]
    #: targets chosen but in no stage: (name, why)
    left_out: list[tuple[str, str]]


@dataclass(frozen=True)
class RolloutSpec:
    """What an operator asked of a rollout's order, parsed (see ``strategy create``)."""

    stages: list[tuple[str, ...]] = field(default_factory=list)
    stages_by_group: bool = False
    batches: list[Amount] = field(default_factory=list)
    canary: Amount | None = None
    canary_label: Mapping[str, str] = field(default_factory=dict)
    stage_max_failures: Amount | None = None

    @property
    def planned(self) -> bool:
        """Whether the targets are cut into more than one phase (or may be)."""
        return bool(
            self.stages
            or self.stages_by_group
            or self.batches
            or self.canary
            or self.canary_label
            or self.stage_max_failures
        )


def group_stage_key(name: str, stage_order: int | None) -> tuple[bool, int, str]:
    """The order of groups as stages with ``--stages-by-group``: by their own order
    (``group add --order N``), then by name; groups without an order after those with."""
    return (stage_order is None, stage_order or 0, name)


def plan_rollout(
    chosen: Sequence[PlanTarget],
    spec: RolloutSpec,
    *,
    group_order: Mapping[str, int | None],
) -> Plan:
    """Cut ``chosen`` (in the strategy's order) into stages and batches as ``spec`` asks.

    ``group_order``: every group by name, with its stage order (None: none). A group of
    ``--stage`` that does not exist, a ``--canary`` larger than what it is taken from,
    and a plan that leaves no target are refused (InputError naming it)."""
    ungrouped = "(no group)"
    by_group: dict[str | None, list[PlanTarget]] = {}
    for t in chosen:
        by_group.setdefault(t.group, []).append(t)
    stages: list[tuple[str, list[str], list[PlanTarget]]] = []
    left_out: list[tuple[str, str]] = []
    if spec.stages:
        unknown = [g for s in spec.stages for g in s if g != "rest" and g not in group_order]
        if unknown:
            raise InputError(
                f"--stage: no group named {', '.join(repr(g) for g in unknown[:5])}"
                + (f" (and {len(unknown) - 5} more)" if len(unknown) > 5 else "")
            )
        named = {g for s in spec.stages for g in s if g != "rest"}
        for stage in spec.stages:
            members = [
                t
                for g, ts in by_group.items()
                for t in ts
                if (g in stage) or ("rest" in stage and g not in named)
            ]
            stages.append((",".join(stage), list(stage), members))
        if not any("rest" in s for s in spec.stages):
            left_out = [
                (
                    t.name,
                    f"in no stage ({f'group {t.group}' if t.group else 'no group'}; "
                    "--stage rest takes it)",
                )
                for g, ts in by_group.items()
                if g not in named
                for t in ts
            ]
    elif spec.stages_by_group:
        keys = sorted(
            (g for g in by_group if g is not None),
            key=lambda g: group_stage_key(g, group_order.get(g)),
        )
        stages = [(g, [g], by_group[g]) for g in keys]
        if None in by_group:
            stages.append((ungrouped, [], by_group[None]))
    else:
        stages = [("all", [], list(chosen))]
    canaries: list[PlanTarget] = []
    if spec.canary is not None or spec.canary_label:
        canaries = _choose_canaries(chosen, spec, stages, left_out)
        taken = {t.id for t in canaries}
        stages = [(n, g, [t for t in ts if t.id not in taken]) for n, g, ts in stages]
    stages = [s for s in stages if s[2]]
    if not stages and not canaries:
        names = ", ".join(name for name, _ in left_out[:5])
        raise InputError(f"--stage: no stage has any of the chosen targets ({names} ...)")
    planned: list[PlannedStage] = []
    order: list[tuple[int, int]] = []
    phase = 0
    if canaries:
        planned.append(PlannedStage(CANARY, [], len(canaries), [len(canaries)], 0, canary=True))
        phase += 1
        order += [(t.id, phase) for t in canaries]
    for name, groups, members in stages:
        sizes = batch_sizes(spec.batches, len(members)) if spec.batches else [len(members)]
        limit = (
            spec.stage_max_failures.limit_of(len(members))
            if spec.stage_max_failures is not None
            else None
        )
        planned.append(PlannedStage(name, groups, len(members), sizes, limit))
        at = 0
        for size in sizes:
            phase += 1
            order += [(t.id, phase) for t in members[at : at + size]]
            at += size
    return Plan(planned, order, left_out)


def _choose_canaries(
    chosen: Sequence[PlanTarget],
    spec: RolloutSpec,
    stages: list[tuple[str, list[str], list[PlanTarget]]],
    left_out: list[tuple[str, str]],
) -> list[PlanTarget]:
    """The canaries: the first N of the first stage, or of the targets with
    ``--canary-label`` (all of those without ``--canary``)."""
    staged = [t for _, _, ts in stages for t in ts]
    if spec.canary_label:
        pool = [t for t in staged if has_labels(dict(t.labels), dict(spec.canary_label))]
        labels = ", ".join(f"{k}={v}" for k, v in spec.canary_label.items())
        where = f"with {labels}"
        if not pool:
            raise InputError(f"--canary-label: no chosen target has {labels}")
    else:
        pool = stages[0][2] if stages else []
        where = f"in the first stage ({stages[0][0]})" if len(stages) > 1 else "to choose from"
    if spec.canary is None:
        return pool
    whole = len(staged)
    n = spec.canary.size_of(whole)
    if n < 1:
        raise InputError(f"--canary: must be at least 1, got {spec.canary.text}")
    if n >= whole:
        raise InputError(
            f"--canary: {spec.canary.text} is {plural(n, 'canary', 'canaries')}, of "
            f"{plural(whole, 'target')}: at most {whole - 1}, so that some run after them"
        )
    if n > len(pool):
        raise InputError(
            f"--canary: {plural(n, 'canary', 'canaries')} asked, but there "
            f"{'is' if len(pool) == 1 else 'are'} {len(pool)} {where}"
        )
    return pool[:n]


def phase_stages(stages: Sequence[PlannedStage]) -> list[int]:
    """For each phase (from 1; index 0 unused), the index of its stage in ``stages``."""
    out = [0]
    for i, stage in enumerate(stages):
        out += [i] * len(stage.batches)
    return out


def stage_failure_stop(stage: PlannedStage, failed_in_stage: int) -> str | None:
    """Whether ``failed_in_stage`` failed steps of ``stage`` stop the strategy, and why
    (None: they do not). A canary's failure always stops it; a stage's own limit once
    exceeded, not equalled. (The strategy's limit is checked beside this one.)"""
    if stage.canary and failed_in_stage > 0:
        return "a canary failed"
    if stage.max_failures is not None and failed_in_stage > stage.max_failures:
        many = "steps exceed" if failed_in_stage != 1 else "step exceeds"
        return (
            f"{failed_in_stage} failed {many} the failure threshold of stage "
            f"{stage.name} ({stage.max_failures})"
        )
    return None


def stage_tolerance(stage: PlannedStage, failed_in_stage: int) -> int | None:
    """How many more failures ``stage`` tolerates before it stops the strategy (None:
    no limit of its own)."""
    if stage.canary:
        return -failed_in_stage
    if stage.max_failures is None:
        return None
    return stage.max_failures - failed_in_stage


def stage_progress(
    stages: Sequence[PlannedStage], ended_by_phase: Mapping[int, tuple[int, int, int]]
) -> tuple[list[dict[str, object]], str | None]:
    """Each stage's progress (``strategy show``), and which one runs now, as text.

    ``ended_by_phase``: by phase, (steps, steps ended, steps started). A stage is
    ``done`` once all its steps have ended; the first that is not is ``running`` once
    one of its steps has started (with the batch that runs), ``next`` before (held by
    a wait, an approval, a window); those after it are ``waiting``."""
    out: list[dict[str, object]] = []
    now = ""
    phase = 0
    for number, stage in enumerate(stages, 1):
        steps = ended = begun = 0
        batch_now = 0
        for batch in range(1, len(stage.batches) + 1):
            phase += 1
            total, done, started = ended_by_phase.get(phase, (0, 0, 0))
            steps, ended, begun = steps + total, ended + done, begun + started
            if not batch_now and done < total:
                batch_now = batch
        if ended >= steps:
            state = "done"
        elif not now:
            state = "running" if begun else "next"
            now = f"stage {number} of {len(stages)} ({stage.name})"
            if len(stage.batches) > 1:
                now += f", batch {batch_now} of {len(stage.batches)}"
        else:
            state = "waiting"
        first = phase - len(stage.batches) + 1
        out.append(
            {
                "stage": number,
                "name": stage.name,
                "steps": steps,
                "ended": ended,
                "state": state,
                "batches": len(stage.batches),
                # the steps' stage column (step list): one phase per batch
                "phases": str(phase) if first == phase else f"{first}-{phase}",
            }
        )
    return out, now or None


#: the event ``strategy approve`` records: "stage N of M (NAME) approved by WHO"
APPROVED_EVENT = "stage-approved"
_APPROVED = re.compile(r"stage (\d+) of \d+ ")


def approval_text(stage_number: int, stages: Sequence[PlannedStage], by: str) -> str:
    """What ``strategy approve`` records (its event's details) for stage ``stage_number``."""
    name = stages[stage_number - 1].name
    return f"stage {stage_number} of {len(stages)} ({name}) approved by {by}"


def approved_stage(details: str) -> int | None:
    """The stage number an approval's details name (None: not an approval's)."""
    found = _APPROVED.match(details)
    return int(found.group(1)) if found else None


@dataclass(frozen=True)
class Gate:
    """What holds the start of a phase: nothing (:attr:`open`), a time (:attr:`until`),
    or an operator's approval of a stage (:attr:`approval`, its number)."""

    until: float | None = None
    approval: int | None = None
    #: why, for ``strategy show`` (the strategy's details while it holds)
    why: str = ""
    #: an open gate closes then (its window ends, the deadline comes): looked at again
    closes: float | None = None
    #: the deadline has passed: nothing more starts, ever (why)
    stop: str = ""

    @property
    def open(self) -> bool:
        return self.until is None and self.approval is None and not self.stop


OPEN = Gate()


def phase_gate(
    options: StrategyOptionsLike,
    phase: int,
    *,
    ended_at: float | None,
    approved_through: int,
    now: float,
    strategy_id: int | str = "ID",
) -> Gate:
    """Whether ``phase`` may start now (pure; the engine asks once per phase, again when
    the time it named comes, and when the window it was open in closes).

    Nothing starts before ``--start-after``, nor outside every ``--window``. At the
    first phase of a stage after the first, once the stages before have ended
    (at ``ended_at``): ``--stage-wait`` holds it until that long after, then
    ``--stage-approval`` until ``strategy approve`` has approved that stage (stages
    up to ``approved_through`` are)."""
    deadline = options.deadline
    if deadline is not None and now >= deadline:
        return Gate(stop=deadline_passed(deadline))
    if options.start_after is not None and now < options.start_after:
        return Gate(
            until=options.start_after,
            why=f"waiting until {shown_time(options.start_after)} (--start-after)",
        )
    gate = _stage_gate(options, phase, ended_at, approved_through, now, strategy_id)
    if not gate.open:
        return gate
    if not options.windows:
        return gate if deadline is None else Gate(closes=deadline)
    inside, change = window_at([parse_window(w) for w in options.windows], now)
    if inside:
        closes = [t for t in (change, deadline) if t is not None]
        return Gate(closes=min(closes) if closes else None)
    if options.deadline is not None and (change is None or change >= options.deadline):
        return Gate(until=options.deadline, why="waiting: no window opens before the deadline")
    if change is None:  # (weekly windows always open again: not reached)
        return Gate(until=now + 86_400, why="waiting: no window opens")
    return Gate(
        until=change,
        why=f"waiting for a window ({'; '.join(options.windows)}): the next opens at "
        f"{shown_time(change)}",
    )


def deadline_passed(deadline: float) -> str:
    """Why a strategy stopped at its deadline (its details, the waiting steps')."""
    return f"stopped: the deadline {shown_time(deadline)} passed (--deadline)"


def _stage_gate(
    options: StrategyOptionsLike,
    phase: int,
    ended_at: float | None,
    approved_through: int,
    now: float,
    strategy_id: int | str,
) -> Gate:
    """The gate between two stages: the wait after the one before, then the approval."""
    stages = options.plan
    starts = phase_stages(stages)
    if not 0 < phase < len(starts) or phase == 1:
        return OPEN
    index = starts[phase]
    if starts[phase - 1] == index:
        return OPEN  # the next batch of the same stage: no gate between batches
    number, name = index + 1, stages[index].name
    done = ended_at if ended_at is not None else now
    if options.stage_wait_s > 0 and now < done + options.stage_wait_s:
        return Gate(
            until=done + options.stage_wait_s,
            why=f"waiting {_duration(options.stage_wait_s)} after stage {number - 1} ended "
            f"(--stage-wait) before stage {number} of {len(stages)} ({name})",
        )
    if options.stage_approval and approved_through < number:
        return Gate(
            approval=number,
            why=f"waiting for approval of stage {number} of {len(stages)} ({name}): "
            f"'fleetwave strategy approve {strategy_id}'",
        )
    return OPEN


class StrategyOptionsLike(Protocol):
    """What :func:`phase_gate` reads of a strategy's options."""

    @property
    def plan(self) -> list[PlannedStage]: ...
    @property
    def stage_wait_s(self) -> float: ...
    @property
    def stage_approval(self) -> bool: ...
    @property
    def start_after(self) -> float | None: ...
    @property
    def windows(self) -> list[str]: ...
    @property
    def deadline(self) -> float | None: ...


def _duration(seconds: float) -> str:
    """10m, 1h30m, 45s: as ``--stage-wait`` takes it."""
    whole = round(seconds)
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    text = (f"{hours}h" if hours else "") + (f"{minutes}m" if minutes else "")
    return text + (f"{secs}s" if secs or not text else "")


_DURATION = re.compile(r"(?:(\d+)d)?(?:(\d+)h)?(?:(\d+)m)?(?:(\d+(?:\.\d+)?)s)?")
#: the longest wait an operator may ask for (as a state's timeout)
MAX_WAIT_S = 30 * 24 * 3600


def parse_duration(text: str, option: str, max_days: int = MAX_WAIT_S // 86400) -> float:
    """``10m``, ``1h30m``, ``45s``, ``2d`` or plain seconds (``600``): seconds, above 0
    and at most ``max_days`` days (30: the longest wait)."""
    given = text.strip()
    found = _DURATION.fullmatch(given)
    if _COUNT.fullmatch(given):
        seconds = float(given)
    elif given and found is not None and any(found.groups()):
        d, h, m, s = (float(g) if g else 0.0 for g in found.groups())
        seconds = d * 86400 + h * 3600 + m * 60 + s
    else:
        raise InputError(f"{option}: expected a duration (10m, 1h30m, 45s), got {shown(text)}")
    if seconds <= 0:
        raise InputError(f"{option}: must be more than 0, got {given}")
    if seconds > max_days * 86400:
        raise InputError(f"{option}: at most {max_days} days, got {given}")
    return seconds


def time_left_s(
    steps: int, ended: int, mean_step_s: float | None, max_parallel: int
) -> float | None:
    """An estimate of a rollout's time left (``strategy show``): the steps not ended, in
    waves of ``max_parallel``, each as long as the completed steps took on average.
    None without a completed step to go by. Waits between stages and windows are not
    in it."""
    left = steps - ended
    if left <= 0:
        return 0.0
    if mean_step_s is None:
        return None
    return math.ceil(left / max(1, min(max_parallel, left))) * mean_step_s
