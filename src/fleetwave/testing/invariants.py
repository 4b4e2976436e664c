"""The guarantees, checked from the journal and final rows alone.

Used by ``fleetwave check``, the demo, the simulator and the tests:

* G1 no (step, state) entered twice, but for a state on a bounded cycle of branches
  (``max_visits``): each of its visits entered once, numbered 1, 2, ... up to its
  ``max_visits``;
* G3 every transition starts where the previous one ended, at a fence no lower,
  and follows the workflow's allowed moves (back only along a bounded cycle's branch);
* G7 replaying the journal in commit order, steps in flight never exceed the
  strategy's max parallel nor a group's cap;
* G8 nothing leaves a terminal state;
* G2 takeovers: replaying the claims and step takeovers in commit order (each is an
  event written in its own transaction), a step is taken over only by the conductor
  that holds its strategy then (the last to claim it);
* attempts: each attempt of a state sent to a target was recorded once, before it was
  sent (the database's unique keys: a state's first attempt is its journal entry, each
  later one a row of ``attempts``), only for a state the step entered, and a retry
  only after the attempt before it (none missing);
* G7 in the database: each strategy's slots (``strategy_slots``, which every commit
  counts and checks its entries against) say as many steps in flight, by strategy and
  group, and as many failed, as its steps do;
* stages: no step of a stage starts before every step of the earlier stages has
  ended (a step and the one it frees a slot for may share a commit: journal order);
  a step's stage column is its phase, one per batch of each stage of the strategy's
  plan (canaries first), so this checks batches and canaries too;
* and the bookkeeping around them: each step's row agrees with its journal, a
  terminal strategy has only terminal steps and holds no lease, and the failure
  threshold stopped admissions exactly when it was exceeded.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import Row, null, select

from fleetwave.domain.models import (
    STEP_FAILED,
    STEP_INITIAL,
    STEP_TERMINAL,
    STRATEGY_TERMINAL,
    UNDRIVABLE,
    StrategyState,
)
from fleetwave.domain.registry import get_workflow
from fleetwave.domain.rollout import phase_stages, stage_failure_stop
from fleetwave.domain.rules import is_allowed_move
from fleetwave.domain.workflow import back_edges
from fleetwave.domain.yaml_workflow import loops_of
from fleetwave.store import slots
from fleetwave.store.admin import options_from_json
from fleetwave.store.db import Store
from fleetwave.store.runtime import strategy_layout
from fleetwave.store.schema import (
    attempts,
    deleted_steps,
    events,
    journal,
    steps,
    strategies,
    targets,
)

MAX_REPORTED = 200


@dataclass
class CheckResult:
    strategies: int = 0
    steps: int = 0
    transitions: int = 0
    violations: list[str] = field(default_factory=list)
    truncated: int = 0
    #: strategies being deleted or pruned (their steps or history partly moved or
    #: gone): not checked (a deleted one is, from its kept steps)
    deleting: list[int] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.violations

    def add(self, msg: str) -> None:
        if len(self.violations) < MAX_REPORTED:
            self.violations.append(msg)
        else:
            self.truncated += 1

    def to_json(self) -> dict[str, object]:
        return {
            "ok": self.ok,
            "strategies": self.strategies,
            "steps": self.steps,
            "transitions": self.transitions,
            "violations": self.violations,
            "violations_not_shown": self.truncated,
            "not_checked_being_deleted": self.deleting,
        }


def check(store: Store, strategy_id: int | None = None) -> CheckResult:
    result = CheckResult()
    with store.read() as conn:
        q = select(strategies)
        if strategy_id is not None:
            q = q.where(strategies.c.id == strategy_id)
        strats = conn.execute(q.order_by(strategies.c.id)).all()
        for strat in strats:
            if strat.state in (StrategyState.DELETING, StrategyState.PRUNING):
                result.deleting.append(int(strat.id))
                continue
            result.strategies += 1
            deleted = strat.state == StrategyState.DELETED
            if deleted:  # its steps as they ended, owned by nobody
                step_rows = conn.execute(
                    select(
                        deleted_steps.c.id,
                        deleted_steps.c.state,
                        deleted_steps.c.group_id,
                        deleted_steps.c.stage,
                        null().label("owner"),
                        deleted_steps.c.target.label("name"),
                        null().label("visit"),
                    ).where(deleted_steps.c.strategy_id == strat.id)
                ).all()
            else:
                step_rows = conn.execute(
                    select(
                        steps.c.id,
                        steps.c.state,
                        steps.c.group_id,
                        steps.c.stage,
                        steps.c.owner,
                        targets.c.name,
                        steps.c.visit,
                    )
                    .join(targets, targets.c.id == steps.c.target_id)
                    .where(steps.c.strategy_id == strat.id)
                ).all()
            jrows = conn.execute(
                select(
                    journal.c.step_id,
                    journal.c.from_state,
                    journal.c.to_state,
                    journal.c.fence,
                    journal.c.details,
                    journal.c.visit,
                )
                .where(journal.c.strategy_id == strat.id)
                .order_by(journal.c.id)
            )  # read as checked: 600,000 rows of a 100,000-target rollout are not held
            arows = conn.execute(
                select(attempts.c.step_id, attempts.c.state, attempts.c.attempt, attempts.c.visit)
                .where(attempts.c.strategy_id == strat.id)
                .order_by(
                    attempts.c.step_id, attempts.c.state, attempts.c.visit, attempts.c.attempt
                )
            ).all()
            _check_strategy(result, strat, step_rows, jrows, arows)
            owners = conn.execute(
                select(events.c.kind, events.c.conductor, events.c.step_id, events.c.details)
                .where(
                    events.c.strategy_id == strat.id,
                    events.c.kind.in_(("strategy-claimed", "step-taken-over")),
                )
                .order_by(events.c.id)
            ).all()
            _check_takeovers(result, int(strat.id), owners)
            for problem in () if deleted else slots.drift(conn, store.hooks, int(strat.id)):
                result.add(f"G7: strategy {strat.id}: slots do not match its steps: {problem}")
    return result


def _check_strategy(
    result: CheckResult,
    strat: Row[Any],
    step_rows: Sequence[Row[Any]],
    jrows: Iterable[Row[Any]],
    arows: Sequence[Row[Any]] = (),
) -> None:
    sid = strat.id
    # a deleted strategy is judged as it was when deleted (its steps as they ended)
    ended_as = strat.state
    if ended_as == StrategyState.DELETED:
        ended_as = getattr(strat, "deleted_from", None) or ended_as
    try:
        # as the conductor reads them (one reading of what a strategy's row holds)
        listed, group_caps = strategy_layout(strat.states, strat.group_caps)
        states = tuple(listed)
        opts = options_from_json(strat.options)
    except (TypeError, ValueError, AttributeError, KeyError) as exc:
        # A hand edit or another tool: what the journal is checked against is unknown.
        result.add(
            f"strategy {sid}: its stored states, options or group caps are not readable "
            f"({exc}): its journal was not checked"
        )
        return
    back, max_visits = _loops(strat)
    cap = opts.effective_parallel
    limit = opts.failure_limit
    # a plan's stages with a limit of their own (or canaries): failures counted by stage
    phase_stage = phase_stages(opts.plan)
    stage_limited = any(s.canary or s.max_failures is not None for s in opts.plan)
    failed_in_stage: Counter[int] = Counter()
    name = {r.id: r.name for r in step_rows}
    group = {r.id: r.group_id for r in step_rows}
    stage = {r.id: r.stage for r in step_rows}
    open_in_stage: Counter[int] = Counter(stage.values())  # steps not yet terminal
    result.steps += len(step_rows)

    last: dict[int, str] = {}
    fence: dict[int, int] = {}
    # the states each step entered, as bits (one int per step, not a key per entry)
    bit: dict[str, int] = {}
    entered: dict[int, int] = {}
    # the last visit entered of each state that counts them, by (step, state)
    visited: dict[tuple[int, str], int] = {}
    # the first step stopped for the failure threshold (checked once the journal is read)
    stopped_for_threshold: int | None = None
    inflight: set[int] = set()
    group_load: Counter[int | None] = Counter()
    failures = 0
    stopped_at: int | None = None

    def who(step_id: int) -> str:
        return f"strategy {sid} step {step_id} ({name.get(step_id, '?')})"

    for i, (step_id, frm, to, fen, details, visit) in enumerate(jrows):
        result.transitions += 1
        mask = bit.get(to)
        if mask is None:
            mask = bit[to] = 1 << len(bit)
        seen = entered.get(step_id, 0)
        most = max_visits.get(to)
        if most is not None:
            _check_visit(result, who(step_id), to, visit, visited.get((step_id, to), 0), most)
            visited[(step_id, to)] = max(visit, visited.get((step_id, to), 0))
        elif seen & mask:
            result.add(f"G1: {who(step_id)} entered '{to}' more than once")
        elif visit != 1:
            result.add(f"G1: {who(step_id)} entered '{to}' as visit {visit}: it has no max_visits")
        entered[step_id] = seen | mask
        if (
            stopped_for_threshold is None
            and to == "aborted"
            and details.startswith(("not started:", "stopped after "))
            and not details.startswith(f"not started: {UNDRIVABLE}")
            and not details.endswith("(--deadline)")
        ):
            stopped_for_threshold = step_id
        prev = last.get(step_id, STEP_INITIAL)
        if prev in STEP_TERMINAL:
            result.add(f"G8: {who(step_id)} moved {frm} -> {to} after terminal '{prev}'")
        elif frm != prev:
            result.add(f"G3: {who(step_id)} moved from '{frm}' but was at '{prev}'")
        elif not is_allowed_move(states, frm, to, back):
            result.add(f"G3: {who(step_id)} made a move the workflow does not allow: {frm} -> {to}")
        if fen < fence.get(step_id, 0):
            result.add(f"G3: {who(step_id)} fence went back from {fence[step_id]} to {fen}")
        fence[step_id] = fen
        last[step_id] = to

        gid = group.get(step_id)
        if to in STEP_TERMINAL and prev not in STEP_TERMINAL:
            open_in_stage[stage.get(step_id, 0)] -= 1
        if to in STEP_TERMINAL:
            if step_id in inflight:
                inflight.discard(step_id)
                group_load[gid] -= 1
            if to == STEP_FAILED:
                failures += 1
                if limit is not None and failures > limit and stopped_at is None:
                    stopped_at = i
                phase = stage.get(step_id, 0)
                if stage_limited and 0 < phase < len(phase_stage):
                    index = phase_stage[phase]
                    failed_in_stage[index] += 1
                    over = stage_failure_stop(opts.plan[index], failed_in_stage[index])
                    if over is not None and stopped_at is None:
                        stopped_at = i
        elif frm == STEP_INITIAL:
            if stopped_at is not None:
                which = (
                    "a failure threshold" if stage_limited else f"the failure threshold ({limit})"
                )
                result.add(f"threshold: {who(step_id)} started after {which} was exceeded")
            own = stage.get(step_id, 0)
            earlier = sorted(s for s, n in open_in_stage.items() if s < own and n > 0)
            if earlier:
                result.add(
                    f"stages: {who(step_id)} of stage {own} started while stage "
                    f"{earlier[0]} had {open_in_stage[earlier[0]]} steps not ended"
                )
            inflight.add(step_id)
            group_load[gid] += 1
            if len(inflight) > cap:
                result.add(f"G7: strategy {sid} had {len(inflight)} steps in flight (max {cap})")
            gcap = group_caps.get(gid) if gid is not None else None
            if gcap is not None and group_load[gid] > gcap:
                result.add(
                    f"G7: strategy {sid} group {gid} had {group_load[gid]} in flight (cap {gcap})"
                )

    if (
        (limit is not None or stage_limited)
        and stopped_at is None
        and ended_as != "aborted"
        and stopped_for_threshold is not None
    ):
        # The threshold was never exceeded, so nothing may have been stopped for it.
        result.add(
            f"threshold: {who(stopped_for_threshold)} was stopped although only {failures} "
            f"steps failed (threshold {limit})"
        )

    _check_attempts(result, arows, bit, entered, who)

    terminal_strategy = ended_as in STRATEGY_TERMINAL
    for r in step_rows:
        journalled = last.get(r.id, STEP_INITIAL)
        if r.state != journalled:
            result.add(f"record: {who(r.id)} row says '{r.state}' but journal says '{journalled}'")
        if terminal_strategy and r.state not in STEP_TERMINAL:
            result.add(f"terminal: strategy {sid} is {ended_as} but {who(r.id)} is '{r.state}'")
        if r.state in max_visits and r.visit is not None:
            at = visited.get((r.id, r.state), 0)
            if r.visit != at:
                result.add(
                    f"record: {who(r.id)} row says visit {r.visit} of '{r.state}' but journal "
                    f"says {at}"
                )
        if r.state in STEP_TERMINAL and r.owner is not None:
            result.add(f"lease: {who(r.id)} is terminal but still owned by {r.owner}")
    if terminal_strategy and strat.owner is not None:
        result.add(f"lease: strategy {sid} is terminal but still owned by {strat.owner}")


def _loops(strat: Row[Any]) -> tuple[dict[str, frozenset[str]], dict[str, int]]:
    """A strategy's workflow's loops (see :func:`loops_of`): from the YAML it kept, else
    from the workflow registered under its name and version (a python one)."""
    text = getattr(strat, "workflow_yaml", None)
    if text:
        return loops_of(text)
    wf = get_workflow(strat.workflow)
    if wf is None or wf.version != strat.workflow_version or not wf.max_visits:
        return {}, {}
    return back_edges(wf.states), wf.max_visits


def _check_visit(
    result: CheckResult, who: str, state: str, visit: int, last: int, limit: int
) -> None:
    """G1 per visit: a state that counts its visits is entered at visit 1, then each
    next one once, never past its ``max_visits``."""
    if visit <= last:
        result.add(f"G1: {who} entered '{state}' visit {visit} more than once")
    elif visit != last + 1:
        result.add(f"G1: {who} entered '{state}' as visit {visit} after visit {last}")
    if visit > limit:
        result.add(f"G1: {who} entered '{state}' {visit} times (its max_visits is {limit})")


def _check_attempts(
    result: CheckResult,
    arows: Sequence[Row[Any]],
    bit: dict[str, int],
    entered: dict[int, int],
    who: Callable[[int], str],
) -> None:
    """Each state's attempts (ordered by step, state, attempt) follow on from its first,
    of a state the step entered: a retry recorded with no attempt before it, or an
    attempt of a state never entered, was sent on no record. (A state's first attempt
    is its entry in the journal, unique on step and state; it has a row of its own only
    when a conductor that was stopping entered it and the next owner started it.)"""
    expect: dict[tuple[int, str, int], int] = {}
    for step_id, state, attempt, visit in arows:
        mask = bit.get(state, 0)
        if not entered.get(step_id, 0) & mask:
            result.add(
                f"attempts: {who(step_id)} has attempt {attempt} of '{state}', never entered"
            )
        want = expect.get((step_id, state, visit), 1 if attempt == 1 else 2)
        if attempt != want:
            result.add(
                f"attempts: {who(step_id)} recorded attempt {attempt} of '{state}' "
                f"where attempt {want} was due"
            )
        expect[(step_id, state, visit)] = attempt + 1


def _check_takeovers(result: CheckResult, sid: int, owners: Sequence[Row[Any]]) -> None:
    holder: str | None = None
    for kind, conductor, step_id, details in owners:
        if kind == "strategy-claimed":
            holder = conductor
        elif conductor != holder:
            result.add(
                f"G2: strategy {sid} step {step_id} taken over by {conductor} ({details}) "
                f"while {holder} held the strategy"
            )
