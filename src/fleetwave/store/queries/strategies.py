"""Read models of strategies: lists, ``strategy show``, their workflows."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from sqlalchemy import Connection, Table, and_, case, false, func, select

from fleetwave.domain.errors import InputError, NotFound
from fleetwave.domain.models import (
    STEP_ABORTED,
    STEP_COMPLETE,
    STEP_FAILED,
    STEP_INITIAL,
    STEP_TERMINAL,
    STRATEGY_TERMINAL,
    StrategyState,
)
from fleetwave.domain.registry import get_workflow
from fleetwave.domain.rollout import APPROVED_EVENT, PlannedStage, stage_progress, time_left_s
from fleetwave.domain.workflow import WorkflowError
from fleetwave.domain.yaml_workflow import parse_workflow_yaml
from fleetwave.store.admin import options_from_json
from fleetwave.store.db import Store
from fleetwave.store.queries.common import KEPT_STATES, _shown_json, _step_tables, steps_ended
from fleetwave.store.queries.conductors import _Conductors, _driving
from fleetwave.store.schema import (
    deleted_steps,
    events,
    journal,
    steps,
    strategies,
    targets,
)


def step_counts(store: Store, sid: int) -> dict[str, int]:
    with store.read() as conn:
        return _step_counts(conn, sid)


def _step_counts(conn: Any, sid: int) -> dict[str, int]:
    counts: dict[str, int] = {}
    for table in _step_tables(conn, sid):
        for state, n in conn.execute(
            select(table.c.state, func.count())
            .where(table.c.strategy_id == sid)
            .group_by(table.c.state)
        ):
            counts[str(state)] = counts.get(str(state), 0) + int(n)
    return counts


def _strategy_dict(r: Any) -> dict[str, Any]:
    opts = _shown_json(r.options)
    if not isinstance(opts, dict):
        opts = dict.fromkeys(
            ("max_parallel", "apply_type", "stop_on_failure", "max_failures"), opts
        )
    return {
        "id": r.id,
        "workflow": r.workflow,
        # which version it runs: a stored workflow replaced since keeps its own copy here
        "workflow_version": r.workflow_version,
        "state": r.state,
        "steps": r.step_count,
        "max_parallel": opts.get("max_parallel"),
        "apply_type": opts.get("apply_type"),
        "stop_on_failure": opts.get("stop_on_failure"),
        "max_failures": opts.get("max_failures"),
        "details": r.details,
        "created_at": r.created_at,
        "updated_at": r.updated_at,
        "owner": r.owner,
        # when ``strategy delete`` began (its history kept until ``fleetwave prune``)
        "deleted_at": r.deleted_at,
        "deleted_from": r.deleted_from,
    }


def list_strategies(
    store: Store, *, brief: bool = False, states: Sequence[str] = ()
) -> list[dict[str, Any]]:
    """Every strategy (or those in ``states``), with its steps by state (``step_states``,
    as ``strategy show`` has them), how many have ended (``done``) and who drives
    it (``driven_by``, as ``strategy show`` says it; None once it needs no driving):
    a rollout whose conductor died lists as such, not as one going well. ``brief``:
    ``driven_by`` as a list's column says it (:attr:`Driving.brief`).

    One read (a snapshot), whatever the number of strategies: the conductors are read
    once for all of them."""
    now = time.time()
    with store.read() as conn:
        q = select(strategies).order_by(strategies.c.id)
        if states:
            q = q.where(strategies.c.state.in_(list(states)))
        else:  # deleted ones only when asked for (``--state deleted``)
            q = q.where(strategies.c.state.not_in([StrategyState.DELETED, StrategyState.PRUNING]))
        rows = conn.execute(q).all()
        counts: dict[int, dict[str, int]] = {}
        retrying: dict[int, int] = {}
        retry = and_(steps.c.not_started, steps.c.attempt > 1)
        for sid, state, waits, n in conn.execute(
            select(steps.c.strategy_id, steps.c.state, retry, func.count()).group_by(
                steps.c.strategy_id, steps.c.state, retry
            )
        ):
            mine = counts.setdefault(int(sid), {})
            mine[str(state)] = mine.get(str(state), 0) + int(n)
            if waits and state != STEP_INITIAL and state not in STEP_TERMINAL:
                retrying[int(sid)] = retrying.get(int(sid), 0) + int(n)
        kept = [int(r.id) for r in rows if r.state in KEPT_STATES]
        for sid, state, n in (
            conn.execute(
                select(deleted_steps.c.strategy_id, deleted_steps.c.state, func.count())
                .where(deleted_steps.c.strategy_id.in_(kept))
                .group_by(deleted_steps.c.strategy_id, deleted_steps.c.state)
            )
            if kept
            else ()
        ):
            mine = counts.setdefault(int(sid), {})
            mine[str(state)] = mine.get(str(state), 0) + int(n)
        known = _Conductors.read(conn, now)
    out = []
    for r in rows:
        item = _strategy_dict(r)
        item["step_states"] = counts.get(int(r.id), {})
        item["done"] = steps_ended(item["step_states"])
        # steps between two attempts of a state, waiting out its backoff (as `strategy
        # show` counts them): a rollout that retries does not look idle
        item["waiting_to_retry"] = retrying.get(int(r.id), 0)
        who = _driving(r, now, known)
        item["driven_by"] = who.brief if brief else who.text
        out.append(item)
    return out


def ended_badly_in(store: Store, sid: int) -> list[str]:
    """The targets of strategy ``sid``'s failed and aborted steps (``strategy create
    --failed-in``), in its step order, all read in one transaction: read a page at a
    time, a ``strategy delete`` of it running meanwhile left some out. Refused when the
    strategy is not there or is being deleted (its steps partly gone)."""
    with store.read() as conn:
        state = conn.execute(
            select(strategies.c.state).where(strategies.c.id == sid)
        ).scalar_one_or_none()
        if state is None:
            raise NotFound(f"--failed-in: strategy {sid} not found")
        if state in (StrategyState.DELETING.value, StrategyState.PRUNING.value):
            raise InputError(
                f"--failed-in: strategy {sid} is being deleted, its steps partly gone "
                f"('fleetwave strategy delete {sid}' finishes it)"
            )
        if state == StrategyState.DELETED.value:  # its steps as they ended, kept
            return list(
                conn.execute(
                    select(deleted_steps.c.target)
                    .where(
                        deleted_steps.c.strategy_id == sid,
                        deleted_steps.c.state.in_([STEP_FAILED, STEP_ABORTED]),
                    )
                    .order_by(deleted_steps.c.id)
                ).scalars()
            )
        return list(
            conn.execute(
                select(targets.c.name)
                .join(steps, steps.c.target_id == targets.c.id)
                .where(
                    steps.c.strategy_id == sid,
                    steps.c.state.in_([STEP_FAILED, STEP_ABORTED]),
                )
                .order_by(steps.c.id)
            ).scalars()
        )


def get_strategy(store: Store, sid: int, first_at: float | None = None) -> dict[str, Any]:
    """``strategy show``. ``first_at``: when the strategy's first transition was, if
    the caller knows it (the dashboard's live producer folds the journal): else it is
    its first journal entry's time."""
    now = time.time()
    with store.read() as conn:
        r = conn.execute(select(strategies).where(strategies.c.id == sid)).first()
        if r is None:
            raise NotFound(f"strategy {sid} not found")
        out = _strategy_dict(r)
        out["states"] = _shown_json(r.states)
        out["options"] = _shown_json(r.options)
        out["driven_by"] = _driving(r, now, _Conductors.read(conn, now)).text
        out["step_states"] = counts = _step_counts(conn, sid)
        # Steps in one of their states, by whether its action started: a started one
        # (in flight) and the latest of their deadlines: a stop or an abort lets them
        # finish that state, so it is over by then at the latest (an operator waiting on
        # an abort asked when it would end). One entered but not started (by a conductor
        # that was stopping), or a retry waiting out its backoff, runs nothing meanwhile,
        # and a stop ends it at once: counted apart, no deadline (after a clean stop,
        # they read as actions running somewhere).
        out["in_flight"] = out["not_started"] = out["waiting_to_retry"] = 0
        out["in_flight_until"] = None
        again = steps.c.attempt > 1  # one expression: one bound parameter (PostgreSQL
        # refuses a GROUP BY whose expression differs from the selected one by its name)
        for not_started, retry, n, until in conn.execute(
            select(steps.c.not_started, again, func.count(), func.max(steps.c.deadline_at))
            .where(
                steps.c.strategy_id == sid,
                steps.c.state.not_in([STEP_INITIAL, *sorted(STEP_TERMINAL)]),
            )
            .group_by(steps.c.not_started, again)
        ):
            if not not_started:
                out["in_flight"] += int(n)
                if until is not None:
                    out["in_flight_until"] = max(out["in_flight_until"] or until, until)
            else:
                out["waiting_to_retry" if retry else "not_started"] += int(n)
        # of those in flight, the ones in a state waiting for the target's callback (not
        # running anything here), and the latest of their deadlines
        waits = callback_states(conn, sid)
        out["waiting_for_callback"], out["waiting_for_callback_until"] = 0, None
        if waits:
            n, until = conn.execute(
                select(func.count(), func.max(steps.c.deadline_at)).where(
                    steps.c.strategy_id == sid,
                    steps.c.state.in_(sorted(waits)),
                    steps.c.not_started == false(),
                )
            ).one()
            out["waiting_for_callback"], out["waiting_for_callback_until"] = int(n), until
        # when the rollout last moved (the row's updated_at is its own state's change)
        out["last_transition_at"] = conn.execute(
            select(journal.c.at)
            .where(journal.c.strategy_id == sid)
            .order_by(journal.c.id.desc())
            .limit(1)
        ).scalar_one_or_none()
        plan = _plan_of(r.options)
        kept = r.state in KEPT_STATES
        done_steps = deleted_steps if kept else steps
        if plan:
            ended = _ended_by_stage(conn, sid, done_steps)
            approvals = [
                {"at": e.at, "details": e.details}
                for e in conn.execute(
                    select(events.c.at, events.c.details)
                    .where(events.c.strategy_id == sid, events.c.kind == APPROVED_EVENT)
                    .order_by(events.c.id)
                )
            ]
        took = conn.execute(
            select(func.avg(done_steps.c.finished_at - done_steps.c.started_at)).where(
                done_steps.c.strategy_id == sid,
                done_steps.c.state == STEP_COMPLETE,
                done_steps.c.started_at.is_not(None),
            )
        ).scalar()
        if first_at is None:
            # the first entry written (by the index: its minimum ``at`` was a scan of
            # every row, 9 ms at 60,000, on each ``strategy show``)
            first_at = conn.execute(
                select(journal.c.at)
                .where(journal.c.strategy_id == sid)
                .order_by(journal.c.id)
                .limit(1)
            ).scalar_one_or_none()
    out["done"] = steps_ended(counts)  # as strategy list has it
    total = int(r.step_count)
    out["percent_done"] = round(100 * out["done"] / total, 1) if total else 100.0
    if first_at is not None and r.state not in STRATEGY_TERMINAL | KEPT_STATES:
        out["elapsed_s"] = round(max(0.0, now - float(first_at)), 1)
        left = time_left_s(
            total,
            out["done"],
            None if took is None else float(took),
            int(out.get("max_parallel") or 1),
        )
        out["time_left_estimate_s"] = None if left is None else round(left)
    if plan:
        out["stages"], out["stage_now"] = stage_progress(plan, ended)
        if approvals:
            out["approvals"] = approvals
        if r.state == StrategyState.INITIAL:  # never applied: nothing runs yet
            out["stage_now"] = None
            for stage in out["stages"]:
                stage["state"] = "waiting"
    return out


def _plan_of(options: str) -> list[PlannedStage]:
    """A strategy's plan (stages, batches, canaries) from its options; none if they
    cannot be read (``strategy show`` shows what it can)."""
    try:
        return options_from_json(options).plan
    except (TypeError, ValueError, KeyError):
        return []


def _ended_by_stage(
    conn: Connection, sid: int, table: Table = steps
) -> dict[int, tuple[int, int, int]]:
    """By stage column (phase): its steps, how many of them have ended, and how many
    have started (left ``initial``: ended ones too); ``table``: where its steps are
    (``deleted_steps`` once it is deleted)."""
    ended = case((table.c.state.in_(sorted(STEP_TERMINAL)), 1), else_=0)
    begun = case((table.c.started_at.is_not(None), 1), else_=0)
    return {
        int(stage): (int(n), int(done or 0), int(started or 0))
        for stage, n, done, started in conn.execute(
            select(table.c.stage, func.count(), func.sum(ended), func.sum(begun))
            .where(table.c.strategy_id == sid)
            .group_by(table.c.stage)
        )
    }


def strategy_workflow(store: Store, sid: int) -> tuple[str, str | None]:
    """The strategy's workflow name, and its own copy (YAML) if it keeps one: without
    one, the process that drives it must have the workflow registered (a plug-in)."""
    with store.read() as conn:
        r = conn.execute(
            select(strategies.c.workflow, strategies.c.workflow_yaml).where(strategies.c.id == sid)
        ).first()
    if r is None:
        raise NotFound(f"strategy {sid} not found")
    return str(r.workflow), None if r.workflow_yaml is None else str(r.workflow_yaml)


def deleted_note(store: Store, sid: int) -> str | None:
    """For a deleted strategy (or one being deleted or pruned), what a reader of its
    history is told first: that it was deleted, when, and what keeps its history."""
    with store.read() as conn:
        r = conn.execute(
            select(strategies.c.state, strategies.c.deleted_at).where(strategies.c.id == sid)
        ).first()
    if r is None or r.state not in KEPT_STATES:
        return None
    at = (
        ""
        if r.deleted_at is None
        else " " + time.strftime("%Y-%m-%d %H:%M:%SZ", time.gmtime(float(r.deleted_at)))
    )
    if r.state == StrategyState.PRUNING:
        return f"strategy {sid}: deleted{at}, its history being pruned (partly gone)"
    if r.state == StrategyState.DELETING:
        return f"strategy {sid}: being deleted (since{at}); its history is kept"
    return f"strategy {sid}: deleted{at}; its history is kept until 'fleetwave prune'"


def strategy_exists(store: Store, sid: int) -> None:
    with store.read() as conn:
        if conn.execute(select(strategies.c.id).where(strategies.c.id == sid)).first() is None:
            raise NotFound(f"strategy {sid} not found")


def callback_states(conn: Any, sid: int) -> frozenset[str]:
    """The states of strategy ``sid``'s workflow that wait for the target's callback
    (``mode: wait-for-callback``): from its own YAML copy, or the registered workflow
    of its name; none when this process cannot have it (a plug-in not loaded here)."""
    r = conn.execute(
        select(strategies.c.workflow, strategies.c.workflow_yaml).where(strategies.c.id == sid)
    ).first()
    if r is None:
        return frozenset()
    try:
        wf = (
            get_workflow(r.workflow)
            if r.workflow_yaml is None
            else parse_workflow_yaml(r.workflow_yaml, source=f"strategy {sid}")
        )
    except WorkflowError:
        return frozenset()
    if wf is None:
        return frozenset()
    return frozenset(st.name for st in wf.states if st.mode == "wait-for-callback")
