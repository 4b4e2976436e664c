"""Read models of steps: lists and pages, ``step show``, history, attempts, events."""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from itertools import islice
from typing import Any

from sqlalchemy import false, null, select

from fleetwave.domain.errors import InputError, NotFound
from fleetwave.domain.models import (
    STEP_INITIAL,
    STEP_TERMINAL,
    StrategyState,
    shown,
)
from fleetwave.domain.rollout import APPROVED_EVENT
from fleetwave.store.db import Store
from fleetwave.store.queries.common import (
    Page,
    _journal_named,
    _kept,
    _page,
    _pages,
    _shown_json,
)
from fleetwave.store.queries.conductors import _Conductors
from fleetwave.store.queries.strategies import callback_states, strategy_exists
from fleetwave.store.schema import (
    attempts,
    callbacks,
    deleted_steps,
    events,
    journal,
    steps,
    strategies,
    targets,
)


def list_steps(
    store: Store, sid: int, state: str | None = None, limit: int | None = None
) -> list[dict[str, Any]]:
    return list(iter_steps(store, sid, state, limit))


def iter_steps(
    store: Store,
    sid: int,
    state: str | Sequence[str] | None = None,
    limit: int | None = None,
    *,
    target: str | Sequence[str] | None = None,
) -> Iterator[dict[str, Any]]:
    """A strategy's steps one at a time, as read; an unknown strategy is refused at
    once, before the first row is asked for, and so is a state it has no step can be in.
    ``state`` and ``target``: one, or several (steps in any of them)."""
    states = [state] if isinstance(state, str) else list(state or ())
    names = [target] if isinstance(target, str) else list(target or ())
    if not states:
        strategy_exists(store, sid)
    else:  # one read: the strategy's states say whether it exists too
        with store.read() as conn:
            row = conn.execute(select(strategies.c.states).where(strategies.c.id == sid)).first()
        if row is None:
            raise NotFound(f"strategy {sid} not found")
        own = _shown_json(row[0] or "[]")  # empty for a strategy of an early version
        if not isinstance(own, list):
            own = []  # unreadable (a hand edit): any state name is looked for
        known = [STEP_INITIAL, *own, *sorted(STEP_TERMINAL)]
        for one in states if own else ():
            if one not in known:
                raise InputError(
                    f"--state: '{one}' is not a state of strategy {sid} ({', '.join(known)})"
                )
    for name in names:
        _target_in(store, sid, name)
    return (row for _, row in _iter_steps(store, sid, states, limit, names))


def steps_page(
    store: Store,
    sid: int,
    limit: int,
    after: int = -1,
    state: Sequence[str] = (),
    target: Sequence[str] = (),
) -> Page:
    """Up to ``limit`` of a strategy's steps in its order, after the step at position
    ``after`` (as :func:`iter_steps` checks and shows them)."""
    iter_steps(store, sid, state, target=target)  # (its checks: unknown states, names)
    return _page(
        _iter_steps(store, sid, list(state), None, list(target), after=after, rows=limit + 1),
        limit,
    )


def _target_in(store: Store, sid: int, target: str) -> int:
    """The step of ``target`` in the strategy; refuse ``--target`` naming no target, or
    one the strategy has no step for."""
    with store.read() as conn:
        tid = conn.execute(select(targets.c.id).where(targets.c.name == target)).scalar()
        in_it = conn.execute(
            select(steps.c.id).where(steps.c.strategy_id == sid, steps.c.target_id == tid)
        ).first()
        if in_it is None and _kept(conn, sid):
            # a deleted strategy's step, by the name its target had (deleted since, maybe)
            in_it = conn.execute(
                select(deleted_steps.c.id).where(
                    deleted_steps.c.strategy_id == sid, deleted_steps.c.target == target
                )
            ).first()
        if in_it is None:
            if tid is None:
                raise NotFound(f"--target: no target named {shown(target)}")
            raise NotFound(f"--target: target {shown(target)} is not in strategy {sid}")
        return int(in_it[0])


def _iter_steps(
    store: Store,
    sid: int,
    states: list[str],
    limit: int | None,
    names: list[str],
    *,
    after: int = -1,
    rows: int | None = None,
) -> Iterator[tuple[int, dict[str, Any]]]:
    """The steps with their positions (``ordinal``), after ``after``."""
    q = (
        select(
            steps.c.id,
            targets.c.name,
            steps.c.stage,
            steps.c.state,
            steps.c.details,
            steps.c.started_at,
            steps.c.finished_at,
            steps.c.attempt,
            steps.c.owner,
            steps.c.ordinal,
            steps.c.not_started,
            steps.c.deadline_at,
        )
        .join(targets, targets.c.id == steps.c.target_id)
        .where(steps.c.strategy_id == sid)
    )
    if states:
        q = q.where(steps.c.state.in_(states))
    if names:
        q = q.where(targets.c.name.in_(names))
    found = _pages(store, q, steps.c.ordinal, after, rows)
    with store.read() as conn:
        deleted = conn.execute(
            select(strategies.c.state).where(strategies.c.id == sid)
        ).scalar() in (StrategyState.DELETED, StrategyState.PRUNING)
    if deleted:  # its steps as they ended (their targets as they were named then)
        kept = select(
            deleted_steps.c.id,
            deleted_steps.c.target.label("name"),
            deleted_steps.c.stage,
            deleted_steps.c.state,
            deleted_steps.c.details,
            deleted_steps.c.started_at,
            deleted_steps.c.finished_at,
            deleted_steps.c.attempt,
            null().label("owner"),
            deleted_steps.c.ordinal,
            false().label("not_started"),
            null().label("deadline_at"),
        ).where(deleted_steps.c.strategy_id == sid)
        if states:
            kept = kept.where(deleted_steps.c.state.in_(states))
        if names:
            kept = kept.where(deleted_steps.c.target.in_(names))
        found = _pages(store, kept, deleted_steps.c.ordinal, after, rows)
    now = time.time()
    lease = _step_lease(store, sid, now)
    for r in found if limit is None else islice(found, limit):
        details = _shown_details(r, lease)
        yield (
            r.ordinal,
            {
                "step": r.id,
                "strategy": sid,
                "target": r.name,
                "stage": r.stage,
                "state": r.state,
                "details": details,
                "started_at": r.started_at,
                "finished_at": r.finished_at,
                "attempt": r.attempt,
                "owner": r.owner,
            },
        )


@dataclass(frozen=True)
class _StepLease:
    """The lease a strategy's steps in flight are held under (their strategy's)."""

    #: the conductor holding it now (alive, its lease not run out), if any
    holder: str | None
    #: the strategy's owner, and the lease's time left (None: none, or not readable)
    owner: str | None
    left: float | None
    #: when it ran out (wall time, for an operator), if it has
    ran_out_at: float | None
    #: the strategy's workflow states that wait for the target's callback
    waits: frozenset[str] = frozenset()


def _step_lease(store: Store, sid: int, now: float) -> _StepLease:
    with store.read() as conn:
        r = conn.execute(
            select(strategies.c.owner, strategies.c.lease_expires_at).where(strategies.c.id == sid)
        ).first()
        known = _Conductors.read(conn, now)
        waits = callback_states(conn, sid)
    owner = r.owner if r is not None else None
    until = r.lease_expires_at if r is not None else None
    left = known.lease_left(owner, until)
    return _StepLease(
        owner if known.holds(owner, until) else None,
        owner,
        left,
        now + left if left is not None and left <= 0 else None,
        waits,
    )


#: what a takeover does with a state whose conductor was lost: its workflow says (a
#: state with ``recover: none`` fails the step; the text said a recover hook looked)
_RECOVERS = (
    "its state's recover setting decides what became of the action (look at the target, "
    "or fail the step: 'fleetwave workflow show' says which)"
)


def _utc_shown(at: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%SZ", time.gmtime(at))


def _shown_details(r: Any, lease: _StepLease) -> str:
    """A step's details as shown (``r``: its row): for one in its workflow's states
    that nobody drives now, or entered but not started, what is happening to it and
    what comes next, then what its row says (a step whose conductor was killed showed
    only its last state's "done at attempt 2" or an old retry's time, as if running)."""
    state: str = r.state
    details: str = r.details
    owner: str | None = r.owner
    not_started, attempt = bool(r.not_started), int(r.attempt)
    if state == STEP_INITIAL or state in STEP_TERMINAL:
        return details
    resumes = "when a conductor drives the strategy again (serve, or strategy apply --wait)"
    live = owner is not None and owner == lease.holder
    if not_started and attempt > 1:
        # a retry recorded, waiting to start
        if live:
            return details or f"attempt {attempt} waits out its backoff on conductor {owner}"
        said = f"attempt {attempt} not started: it starts, once due, {resumes}"
    elif not_started:
        # entered by a conductor that was stopping: the next owner starts it afresh
        said = f"entered, its action not started: it starts {resumes}"
        if live:
            said = f"entered while conductor {owner} was stopping; its action starts {resumes}"
    elif live and state in lease.waits:
        # its action sent the work; the target's agent reports when it is done
        deadline = getattr(r, "deadline_at", None)
        until = "" if deadline is None else f" until {_utc_shown(float(deadline))}"
        said = f"waiting for callback{until} (on conductor {owner})"
        return f"{said}: {details}" if details else said
    elif live:
        # what it last said (a retry's reason, its last state's end) while it runs
        return details or f"running on conductor {owner}"
    elif owner is not None:
        why = "its process ended"
        if owner == lease.owner and lease.ran_out_at is not None:
            at = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(lease.ran_out_at))
            why = f"its lease ran out at {at}Z"
        elif owner == lease.owner and lease.left is None:
            why = "its lease was taken under an earlier boot of this host"
        said = (
            f"its conductor {owner} is gone ({why}); the step is taken over {resumes}, "
            f"and {_RECOVERS}"
        )
    else:
        said = (
            f"interrupted (its conductor stopped); the step is taken over {resumes}, and "
            f"{_RECOVERS}"
        )
    return f"{said} ({details})" if details else said


def get_step(store: Store, step_id: int) -> dict[str, Any]:
    now = time.time()
    with store.read() as conn:
        r = conn.execute(
            select(steps, targets.c.name.label("target"))
            .join(targets, targets.c.id == steps.c.target_id)
            .where(steps.c.id == step_id)
        ).first()
        if r is None:
            return _kept_step(store, step_id)
        out = {
            "step": r.id,
            "strategy": r.strategy_id,
            "target": r.target,
            "stage": r.stage,
            "state": r.state,
            "details": _shown_details(r, lease := _step_lease(store, r.strategy_id, now)),
            "started_at": r.started_at,
            "finished_at": r.finished_at,
            "attempt": r.attempt,
            "fence": r.fence,
            "owner": r.owner,
            # the lease it is held under (its strategy's), as wall time
            "lease_expires_at": (
                now + lease.left
                if r.owner is not None and r.owner == lease.owner and lease.left is not None
                else None
            ),
            # when the current state runs out of time; None once terminal
            "deadline_at": r.deadline_at,
            # entered by a conductor that stopped before starting its action
            "not_started": bool(r.not_started),
        }
    out["history"] = history(store, int(out["strategy"]), step_id=step_id)
    out["events"] = step_events(store, step_id)
    out["callbacks"] = step_callbacks(store, step_id)
    out["attempts"] = step_attempts(store, step_id)
    return out


def _kept_step(store: Store, step_id: int) -> dict[str, Any]:
    """A step of a deleted strategy, as it ended, with its history (``step show``)."""
    with store.read() as conn:
        r = conn.execute(select(deleted_steps).where(deleted_steps.c.id == step_id)).first()
    if r is None:
        raise NotFound(f"step {step_id} not found")
    out: dict[str, Any] = {
        "step": r.id,
        "strategy": r.strategy_id,
        "strategy_deleted": True,
        "target": r.target,
        "stage": r.stage,
        "state": r.state,
        "details": r.details,
        "started_at": r.started_at,
        "finished_at": r.finished_at,
        "attempt": r.attempt,
    }
    out["history"] = history(store, int(r.strategy_id), step_id=step_id)
    out["events"] = step_events(store, step_id)
    out["callbacks"] = step_callbacks(store, step_id)
    out["attempts"] = step_attempts(store, step_id)
    return out


def step_callbacks(store: Store, step_id: int) -> list[dict[str, Any]]:
    """What the step's target reported (callbacks), oldest first, with what became of
    each (applied, ignored and why; open until a conductor has handled it)."""
    with store.read() as conn:
        return [
            {
                "received_at": r.received_at,
                "state": r.state,
                "visit": r.visit,
                "kind": r.kind,
                "details": r.details,
                "outcome": r.outcome or "open",
                "reason": r.reason or "",
            }
            for r in conn.execute(
                select(callbacks).where(callbacks.c.step_id == step_id).order_by(callbacks.c.id)
            )
        ]


def history(
    store: Store, sid: int, target: str | None = None, step_id: int | None = None
) -> list[dict[str, Any]]:
    return list(iter_history(store, sid, target, step_id))


def iter_history(
    store: Store,
    sid: int,
    target: str | Sequence[str] | None = None,
    step_id: int | None = None,
    last: int | None = None,
) -> Iterator[dict[str, Any]]:
    """A strategy's journal one transition at a time, as read (600,000 rows for a
    rollout of 100,000 targets), or only its ``last`` transitions, oldest first;
    unknown names are refused before the first row."""
    _check_last(last)
    strategy_exists(store, sid)
    q = _history_query(store, sid)
    names = [target] if isinstance(target, str) else list(target or ())
    step_ids = _steps_of(store, sid, names)
    if step_id is not None:
        step_ids = [s for s in step_ids if s == step_id] if names else [step_id]
    # Some steps' rows are found through the journal's (step, state) key; by strategy,
    # only the strategy's whole journal (600,000 rows at 100,000 targets) would do.
    if names or step_id is not None:
        # (+ 0: still only this strategy's rows, checked row by row, not by its index)
        q = q.where(journal.c.step_id.in_(step_ids), journal.c.strategy_id + 0 == sid)
    else:
        q = q.where(journal.c.strategy_id == sid)
    sends = _attempt_rows(store, sid, step_ids if names or step_id is not None else None)
    moves = _iter_history(store, sid, _only_last(store, q, journal.c.id, last))
    return _with_attempts((row for _, row in moves), sends, last)


def history_page(
    store: Store, sid: int, limit: int, after: int = 0, target: Sequence[str] = ()
) -> Page:
    """Up to ``limit`` transitions of a strategy's journal after the one ``after`` (its
    journal id), oldest first (as :func:`iter_history` has them, without the attempts
    a takeover made between them)."""
    iter_history(store, sid, list(target))  # (its checks: the strategy, the names)
    q = _history_query(store, sid).where(journal.c.strategy_id == sid)
    if target:
        q = q.where(journal.c.step_id.in_(_steps_of(store, sid, list(target))))
    return _page(_iter_history(store, sid, q, after, limit + 1), limit)


def _history_query(store: Store, sid: int) -> Any:
    """The journal's rows with their targets' names (a deleted strategy's: as its kept
    steps name them)."""
    with store.read() as conn:
        kept = _kept(conn, sid)
        source, name = _journal_named(conn, sid, journal)
    columns = (
        journal.c.id,
        journal.c.at,
        journal.c.conductor,
        name,
        journal.c.step_id,
        journal.c.from_state,
        journal.c.to_state,
        journal.c.fence,
        journal.c.details,
        journal.c.visit,
    )
    if kept:
        return select(*columns).select_from(source)
    # every transition's step is there: joined, not outer-joined
    return (
        select(*columns)
        .join(steps, steps.c.id == journal.c.step_id)
        .join(targets, targets.c.id == steps.c.target_id)
    )


#: what ``history`` says of an attempt a takeover made (``attempts``): a retry is not
#: shown there (its failed attempt is an ``attempt-failed`` event, the move on says
#: "done at attempt 3"); ``step show`` lists every attempt
ATTEMPT_WORDS = {
    "resent": "re-sent after takeover (the target did not have it)",
    "afresh": "started by the next owner (its conductor stopped before sending it)",
}


def _attempt_rows(store: Store, sid: int, step_ids: list[int] | None) -> list[dict[str, Any]]:
    """The strategy's attempts a takeover made (re-sends, starts by the next owner), as
    ``history`` rows, oldest first: few (one per step taken over), read whole."""
    with store.read() as conn:
        source, name = _journal_named(conn, sid, attempts)
        q = (
            select(
                attempts.c.at,
                attempts.c.conductor,
                name,
                attempts.c.step_id,
                attempts.c.state,
                attempts.c.attempt,
                attempts.c.fence,
                attempts.c.how,
                attempts.c.visit,
            )
            .select_from(source)
            .where(attempts.c.strategy_id == sid, attempts.c.how.in_(sorted(ATTEMPT_WORDS)))
            .order_by(attempts.c.id)
        )
        if step_ids is not None:
            q = q.where(attempts.c.step_id.in_(step_ids))
        rows = conn.execute(q).all()
    return [
        {
            "at": at,
            "strategy": sid,
            "conductor": conductor,
            "target": target,
            "step": step,
            "from": state,
            "to": state,
            "visit": visit,
            "fence": fence,
            "details": f"attempt {attempt}: {ATTEMPT_WORDS.get(how, how)}",
            "attempt": attempt,
        }
        for at, conductor, target, step, state, attempt, fence, how, visit in rows
    ]


def _with_attempts(
    moves: Iterator[dict[str, Any]], sends: list[dict[str, Any]], last: int | None
) -> Iterator[dict[str, Any]]:
    """The journal's transitions with the attempts between them, by time (an attempt
    comes after its state's entry). With ``--last``: only attempts from the first
    transition shown on."""
    i = 0
    first = True
    for move in moves:
        if first and last is not None:
            while i < len(sends) and sends[i]["at"] < move["at"]:
                i += 1  # before the transitions shown
        first = False
        while i < len(sends) and sends[i]["at"] < move["at"]:
            yield sends[i]
            i += 1
        yield move
    if not first or last is None:
        yield from sends[i:]


def _check_last(last: int | None) -> None:
    if last is not None and last < 1:
        raise InputError(f"--last: must be at least 1, got {last}")


def _steps_of(store: Store, sid: int, names: list[str]) -> list[int]:
    """The strategy's steps of these targets; a name not in the strategy is refused."""
    return [_target_in(store, sid, name) for name in names]


def _only_last(store: Store, q: Any, key: Any, last: int | None) -> Any:
    """``q`` narrowed to its ``last`` rows in ``key`` order (all when None): where they
    begin is found by one index walk back."""
    if last is None:
        return q
    with store.read() as conn:
        start = conn.execute(
            q.with_only_columns(key).order_by(key.desc()).offset(last - 1).limit(1)
        ).scalar_one_or_none()
    return q if start is None else q.where(key >= start)


def _iter_history(
    store: Store, sid: int, q: Any, after: int = 0, rows: int | None = None
) -> Iterator[tuple[int, dict[str, Any]]]:
    """The journal's rows with their ids, after ``after``."""
    # by position: a history of 600,000 rows spent a sixth of its time naming columns
    for id_, at, conductor, target, step, frm, to, fence, details, visit in _pages(
        store, q, journal.c.id, after, rows
    ):
        yield (
            id_,
            {
                "at": at,
                "strategy": sid,
                "conductor": conductor,
                "target": target,
                "step": step,
                "from": frm,
                "to": to,
                # which visit of ``to`` (1 but for a state on a bounded cycle)
                "visit": visit,
                "fence": fence,
                "details": details,
            },
        )


def step_attempts(store: Store, step_id: int) -> list[dict[str, Any]]:
    """Each attempt of a state sent to the step's target: when it was released, by which
    conductor at which fence, and how: ``entry`` (a state's first, sent as it was
    entered: its journal row), ``afresh`` (entered by a conductor that was stopping,
    started by the next owner), ``retry``; and of which visit of the state (1 but on a
    bounded retry loop)."""
    with store.read() as conn:
        entries = conn.execute(
            select(
                journal.c.to_state,
                journal.c.at,
                journal.c.conductor,
                journal.c.fence,
                journal.c.visit,
            )
            .where(
                journal.c.step_id == step_id,
                journal.c.to_state.not_in(sorted(STEP_TERMINAL)),
            )
            .order_by(journal.c.id)
        ).all()
        rows = conn.execute(
            select(
                attempts.c.state,
                attempts.c.attempt,
                attempts.c.at,
                attempts.c.conductor,
                attempts.c.fence,
                attempts.c.how,
                attempts.c.visit,
            )
            .where(attempts.c.step_id == step_id)
            .order_by(attempts.c.id)
        ).all()
    recorded = [dict(r._mapping) for r in rows]
    afresh = {(r["state"], r["visit"]) for r in recorded if r["how"] == "afresh"}
    firsts = [
        {"state": e.to_state, "attempt": 1, "at": e.at, "conductor": e.conductor,
         "fence": e.fence, "how": "entry", "visit": e.visit}
        for e in entries
        if (e.to_state, e.visit) not in afresh
    ]  # fmt: skip
    return sorted(firsts + recorded, key=lambda r: (r["at"], r["attempt"]))


def step_events(store: Store, step_id: int) -> list[dict[str, Any]]:
    return _events(store, select(events).where(events.c.step_id == step_id))


def strategy_events(store: Store, sid: int, kind: str | None = None) -> list[dict[str, Any]]:
    q = select(events).where(events.c.strategy_id == sid)
    if kind is not None:
        q = q.where(events.c.kind == kind)
    return _events(store, q)


#: what the events of a strategy can be (``fleetwave events --kind``)
EVENT_KINDS = {
    "strategy-claimed": "a conductor took the strategy on (from whom)",
    "step-taken-over": "a step's lease passed to a new conductor (in which state, fences)",
    "attempt-failed": "an attempt of a state failed and is retried (why, which comes when)",
    "transition-rejected": "a transition was refused (fenced off, or the state entered)",
    "step-settled": "a transition was refused and the step's row read back",
    "stale-outcome-ignored": "a report for a step that had moved on, ignored",
    "pause-seen": "the conductor saw a pause",
    "resume-seen": "the conductor saw a resume",
    "abort-seen": "the conductor saw an abort",
    "abort-too-late": "an abort came after every step had ended (the strategy ended so)",
    "takeover-incomplete": "steps moved on while a takeover read them",
    "strategy-undrivable": "the strategy cannot be driven (why)",
    APPROVED_EVENT: "an operator approved the next stage (which, by whom)",
    "change-by": "a change made through the REST API, and by which token",
    "callback-refused": "an agent's callback refused for its token (from which address, why)",
    "deadline-extended": "a heartbeat moved a waiting state's deadline (to when)",
    "slots-recounted": "a strategy's slots (G7) counted again from its steps: they had drifted",
}


def iter_events(
    store: Store,
    sid: int,
    target: Sequence[str] = (),
    kind: Sequence[str] = (),
    last: int | None = None,
) -> Iterator[dict[str, Any]]:
    """A strategy's events (what is not a transition: claims, takeovers, failed attempts,
    operator actions seen), oldest first, a page at a time; of some targets or kinds, or
    the ``last`` ones. Unknown names and kinds are refused before the first row."""
    _check_last(last)
    for k in kind:
        if k not in EVENT_KINDS:
            raise InputError(f"--kind: '{k}' is not a kind of event ({', '.join(EVENT_KINDS)})")
    strategy_exists(store, sid)
    q = _events_query(store, sid, target, kind)
    return (row for _, row in _iter_events(store, sid, _only_last(store, q, events.c.id, last)))


def _events_query(store: Store, sid: int, target: Sequence[str], kind: Sequence[str]) -> Any:
    with store.read() as conn:
        source, name = _journal_named(conn, sid, events)
    q = select(events, name.label("target")).select_from(source).where(events.c.strategy_id == sid)
    if target:
        q = q.where(events.c.step_id.in_(_steps_of(store, sid, list(target))))
    if kind:
        q = q.where(events.c.kind.in_(list(kind)))
    return q


def events_page(
    store: Store,
    sid: int,
    limit: int,
    after: int = 0,
    target: Sequence[str] = (),
    kind: Sequence[str] = (),
) -> Page:
    """Up to ``limit`` of a strategy's events after the one ``after`` (its id), oldest
    first (as :func:`iter_events` has them)."""
    iter_events(store, sid, target, kind)  # (its checks)
    q = _events_query(store, sid, target, kind)
    return _page(_iter_events(store, sid, q, after, limit + 1), limit)


def _iter_events(
    store: Store, sid: int, q: Any, after: int = 0, rows: int | None = None
) -> Iterator[tuple[int, dict[str, Any]]]:
    for r in _pages(store, q, events.c.id, after, rows):
        yield (
            r.id,
            {
                "at": r.at,
                "strategy": sid,
                "conductor": r.conductor,
                "target": r.target,
                "step": r.step_id,
                "kind": r.kind,
                "details": r.details,
            },
        )


def _events(store: Store, q: Any) -> list[dict[str, Any]]:
    """Events (non-transition facts: takeovers, rejections, ignored outcomes), oldest first."""
    with store.read() as conn:
        return [
            {
                "at": r.at,
                "step": r.step_id,
                "kind": r.kind,
                "details": r.details,
                "conductor": r.conductor,
            }
            for r in conn.execute(q.order_by(events.c.id))
        ]
