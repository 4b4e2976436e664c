"""Engine-side queries: conductors, leases, claims, loading work, and the hot path.

The hot path is :func:`commit_transitions`: many transitions, each a
compare-and-set on (step, state, fence) plus its journal row, in one transaction
and one fsync (group commit). A row whose compare-and-set fails, or whose journal
insert would enter a state twice (G1), is rejected alone; the others still commit.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

from sqlalchemy import Connection, insert, select, update
from sqlalchemy.exc import DatabaseError, DBAPIError, IntegrityError, OperationalError
from sqlalchemy.pool import PoolProxiedConnection

from fleetwave.domain.models import (
    STEP_ABORTED,
    STEP_FAILED,
    STEP_INITIAL,
    STEP_TERMINAL,
    StrategyState,
    Target,
    unmanaged_reason,
)
from fleetwave.store.db import Store
from fleetwave.store.schema import (
    attempts,
    conductors,
    events,
    journal,
    steps,
    strategies,
)


def _host_identity() -> str:
    """This host and PID namespace: a PID is only comparable inside the same namespace."""
    try:
        ns = f":pidns{os.stat('/proc/self/ns/pid').st_ino}"
    except OSError:
        ns = ""
    return socket.gethostname() + ns


HOSTNAME = _host_identity()

#: Strategy states in which no step of the strategy starts: the commit that would start
#: one reads the strategy's state, so once an operator's pause or abort is committed,
#: nothing new starts (steps started before go on).
HOLD_ENTRIES = frozenset({StrategyState.PAUSED.value, StrategyState.ABORT_REQUESTED.value})

#: Strategy states a conductor drives.
DRIVEN_STATES = (
    StrategyState.APPLYING.value,
    StrategyState.PAUSED.value,
    StrategyState.ABORT_REQUESTED.value,
    StrategyState.ABORTING.value,
)


@dataclass(slots=True)
class Transition:
    """One compare-and-set state change of one step, with its journal row."""

    step_id: int
    strategy_id: int
    from_state: str
    from_fence: int
    to_state: str
    fence: int
    details: str
    attempt: int
    #: the conductor is stopping: it enters ``to_state`` but will not start its action
    not_started: bool = False
    #: when ``to_state`` runs out of time (engine clock); None for terminal states
    deadline_at: float | None = None
    #: written whoever owns the step's row now (settling a row someone else changed,
    #: ending the steps of a strategy nobody can drive): the fence still decides
    any_owner: bool = False


@dataclass(slots=True)
class Event:
    """A non-transition fact worth keeping: takeover, stale outcome, ignored message."""

    kind: str
    details: str
    strategy_id: int | None = None
    step_id: int | None = None


@dataclass(slots=True)
class CommitResult:
    #: transitions not written: refused by compare-and-set or a unique key, or fenced off
    rejected: list[Transition]
    #: strategies another conductor has claimed since this one did
    lost: set[int]
    #: entries written otherwise: failed, their target unmanaged since it was loaded;
    #: aborted, that failure having stopped the strategy (see :class:`StopRule`), as
    #: are that strategy's moves to a next state in the same commit
    replaced: list[Transition] = field(default_factory=list)
    #: entries not written (the steps still wait): a move of their strategy to an end
    #: was refused, so that step still holds its slot (and its stage); or the strategy
    #: is paused or its abort requested (:data:`HOLD_ENTRIES`)
    deferred: list[Transition] = field(default_factory=list)
    #: strategies whose entries were held back, and the state that held them: the
    #: operator's pause or abort reached the database before the dispatcher knew of it
    held_back: dict[int, str] = field(default_factory=dict)
    #: strategies whose entries were written as not started (their lease lapsing here,
    #: by the ``lapsing`` predicate when the commit went through): start none of them
    not_started: set[int] = field(default_factory=set)
    #: steps whose retry record (:class:`AttemptDeadline`) was not written: their row
    #: changed under this conductor (its fence or state), so the retry must not run
    retries_refused: set[int] = field(default_factory=set)
    #: steps whose retry was about to start (its start's record) while their strategy's
    #: abort is requested: not written, so the retry does not start (the operator's abort
    #: reached the database before the dispatcher knew of it; see :attr:`held_back`)
    retries_held: set[int] = field(default_factory=set)


def _never(_strategy_id: int) -> bool:
    return False


@dataclass(frozen=True, slots=True)
class StopRule:
    """A strategy's failure limit, as a commit that starts its steps must apply it."""

    #: failures it still tolerates (its limit minus the failed steps so far)
    tolerated: int
    #: why it stops once one more has failed (the not-started steps' details); the
    #: commit puts the name of the target whose failure crossed the limit for TARGET
    details: str

    TARGET: ClassVar[str] = "{target}"


@dataclass(slots=True)
class AttemptDeadline:
    """A retry of a step still in ``state`` at ``fence``: its deadline, its attempt
    number and why (not a transition)."""

    step_id: int
    strategy_id: int
    state: str
    fence: int
    deadline_at: float
    attempt: int
    #: None: the row's details are kept
    details: str | None
    #: 1 while the retry waits to start (a takeover then runs it as this attempt, once
    #: due), 0 once it starts
    not_started: int = 0


@dataclass(slots=True)
class CallbackMark:
    """How the dispatcher answered one stored callback."""

    callback_id: int
    outcome: str  # applied | ignored
    reason: str
    strategy_id: int = 0
    #: for ``applied`` by a transition: its step (the mark is written only with it)
    step_id: int | None = None


@dataclass(slots=True)
class StepRecord:
    step_id: int
    strategy_id: int
    stage: int
    group_id: int | None
    state: str
    fence: int
    attempt: int
    owner: str | None
    target: Target
    #: its state was entered by a conductor that stopped before starting the action
    not_started: bool = False
    #: when its state runs out of time (engine clock), if recorded
    deadline_at: float | None = None
    #: its place in the strategy's admission order (stages come in this order too)
    ordinal: int = 0


@dataclass
class StrategyRecord:
    id: int
    workflow: str
    state: str
    options: str
    group_caps: dict[int, int]
    owner: str | None
    fence: int
    lease_expires_at: float | None
    details: str
    #: the workflow's states when the strategy was created
    states: list[str] = field(default_factory=list)
    #: a YAML workflow's text as it was when the strategy was created
    workflow_yaml: str | None = None
    #: why its row cannot be driven (a field that is not readable), if so
    broken: str | None = None


# -- conductors and leases ---------------------------------------------------------


# The conductor's own statements are plain SQL with the dialect's placeholder: they run
# on its event loop, where SQLAlchemy's statement building and first-use compiling cost
# more than the statement itself (about a millisecond each at startup).


def server_time(store: Store) -> float:
    """The database server's clock, in seconds since the epoch (PostgreSQL)."""
    sql = store.hooks.now_sql()
    assert sql is not None, "a server clock is read only where the dialect has one"
    with store.read() as conn:
        return float(conn.exec_driver_sql(f"SELECT {sql}").scalar_one())


def register_conductor(
    store: Store, cid: str, now: float, *, serves_all: bool, lease_clock: str | None = None
) -> None:
    with store.write() as conn:
        _register(conn, store, cid, now, serves_all, lease_clock)


def _register(
    conn: Connection,
    store: Store,
    cid: str,
    now: float,
    serves_all: bool,
    lease_clock: str | None,
) -> None:
    p = store.hooks.placeholder
    conn.exec_driver_sql(
        "INSERT INTO conductors (id, hostname, pid, started_at, heartbeat_at, serves_all, "
        f"lease_clock) VALUES ({p}, {p}, {p}, {p}, {p}, {p}, {p})",
        (cid, HOSTNAME, os.getpid(), now, now, store.hooks.flag(serves_all), lease_clock),
    )


def _pid_alive(pid: int) -> bool:
    """Whether a process of this host is still there, and not a zombie: one killed
    whose parent has not reaped it yet (a container's first process that is not an
    init, a supervisor slow to wait) is dead, but signals still reach its pid."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return True  # no /proc (not Linux), or gone meanwhile: the lease decides
    # "pid (comm) S ...": the state follows the last ')' (comm may hold one)
    state = stat[stat.rfind(b")") + 2 : stat.rfind(b")") + 3]
    return state not in (b"Z", b"X")


def conductor_gone(hostname: str, pid: int, stopped_at: float | None) -> bool:
    """A conductor known to be gone: stopped cleanly, or a dead process on this host."""
    return stopped_at is not None or (hostname == HOSTNAME and not _pid_alive(pid))


def dead_conductors(conn: Connection, self_id: str, lease_clock: str | None = None) -> set[str]:
    """Conductors known to be gone (:func:`conductor_gone`), other than ``self_id``; and,
    given this conductor's ``lease_clock``, those whose leases are on another clock (of
    an earlier boot of this host, or from before leases named their clock): their
    leases cannot be compared with this clock, and their writers are gone with it."""
    rows = conn.exec_driver_sql("SELECT id, hostname, pid, stopped_at, lease_clock FROM conductors")
    return {
        r.id
        for r in rows
        if r.id != self_id
        and (
            conductor_gone(r.hostname, r.pid, r.stopped_at)
            or (lease_clock is not None and r.lease_clock != lease_clock)
        )
    }


def _update_steps_by_id(
    conn: Connection, store: Store, sql: str, params: tuple[Any, ...], step_ids: list[int]
) -> None:
    """``sql AND id IN (...)`` for the given steps, 500 ids a statement."""
    for start in range(0, len(step_ids), 500):
        chunk = step_ids[start : start + 500]
        conn.exec_driver_sql(
            f"{sql} AND id IN ({store.hooks.placeholders(len(chunk))})", (*params, *chunk)
        )


class ConductorUnknown(Exception):
    """The database has no row for this conductor, which registered in it: its content
    was replaced while the conductor ran (a backup restored into the same file)."""


def heartbeat(store: Store, cid: str, now: float, lease_until: float) -> int:
    """Renew every lease this conductor holds (its strategies': a step in flight is held
    under its strategy's lease); returns how many strategies it still owns."""
    with store.write() as conn:
        known = conn.execute(
            update(conductors).where(conductors.c.id == cid).values(heartbeat_at=now)
        )
        if known.rowcount == 0:
            # Nothing deletes a conductor's row: the database's content was replaced
            # under this conductor (a backup restored into it). Nothing is written.
            raise ConductorUnknown(cid)
        res = conn.execute(
            update(strategies).where(strategies.c.owner == cid).values(lease_expires_at=lease_until)
        )
        return int(res.rowcount)


def mark_draining(store: Store, cid: str, now: float) -> None:
    """A clean stop began: this conductor starts nothing new (``conductor list``)."""
    p = store.hooks.placeholder
    with store.write() as conn:
        conn.exec_driver_sql(
            f"UPDATE conductors SET draining_at = {p} WHERE id = {p} AND draining_at IS NULL",
            (now, cid),
        )


def release_conductor(store: Store, cid: str, now: float, step_ids: list[int]) -> None:
    """Clean shutdown: hand every lease back at once (G5).

    ``step_ids`` are the steps it has in flight (the dispatcher knows them): by id, as
    the heartbeat renews them, not by a scan of every step in the database. Once the
    conductor is marked stopped it counts as dead, so whatever it still held is free.
    """
    p = store.hooks.placeholder
    with store.write() as conn:
        conn.exec_driver_sql(f"UPDATE conductors SET stopped_at = {p} WHERE id = {p}", (now, cid))
        conn.exec_driver_sql(
            f"UPDATE strategies SET owner = NULL, lease_expires_at = NULL WHERE owner = {p}",
            (cid,),
        )
        _update_steps_by_id(
            conn,
            store,
            f"UPDATE steps SET owner = NULL WHERE owner = {p}",
            (cid,),
            step_ids,
        )


def release_strategy(store: Store, sid: int, cid: str, fence: int) -> bool:
    """Hand one claimed strategy back at once (this conductor cannot drive it: another
    may). False when it is no longer this conductor's at that fence."""
    p = store.hooks.placeholder
    with store.write() as conn:
        res = conn.exec_driver_sql(
            "UPDATE strategies SET owner = NULL, lease_expires_at = NULL "
            f"WHERE id = {p} AND owner = {p} AND fence = {p}",
            (sid, cid, fence),
        )
        return bool(res.rowcount == 1)


class UnreadableRow(ValueError):
    """A stored field is not what fleetwave writes there (a hand edit, another tool)."""


def stored_json(raw: Any, what: str) -> Any:
    """A JSON field of a row, parsed; :class:`UnreadableRow` naming it if it is not JSON."""
    try:
        return json.loads(raw)
    except (TypeError, ValueError) as exc:
        shown = repr(raw)
        shown = shown if len(shown) <= 60 else shown[:57] + "..."
        raise UnreadableRow(f"its stored {what} are not readable ({exc}): {shown}") from None


def strategy_layout(raw_states: Any, raw_caps: Any) -> tuple[list[str], dict[int, int]]:
    """A strategy row's states and group caps, as stored (JSON); :class:`UnreadableRow`
    saying which is not what fleetwave writes (a hand edit, another tool)."""
    got = stored_json(raw_states, "states")
    if not isinstance(got, list) or not all(isinstance(x, str) for x in got):
        raise UnreadableRow(f"its stored states are not a list of names: {raw_states!r}")
    raw = stored_json(raw_caps, "group caps")
    try:
        caps = {int(k): int(v) for k, v in raw.items()}
    except (AttributeError, TypeError, ValueError):
        caps = {}
    if not isinstance(raw, dict) or len(caps) != len(raw) or any(v < 1 for v in caps.values()):
        # a cap below 1 would start nothing of its group, for ever
        raise UnreadableRow(f"its stored group caps are not a map of group to cap: {raw_caps!r}")
    return got, caps


def _strategy_record(r: Any) -> StrategyRecord:
    """A claimed strategy's row as the engine needs it. Fields that cannot be read do
    not fail the claim (of every strategy with it): the record says what is wrong
    (:attr:`StrategyRecord.broken`), and that strategy alone fails."""
    broken: str | None = None
    caps: dict[int, int] = {}
    states: list[str] = []
    try:
        states, caps = strategy_layout(r.states, r.group_caps)
    except UnreadableRow as exc:
        broken = str(exc)
    return StrategyRecord(
        id=r.id,
        workflow=r.workflow,
        state=r.state,
        options=r.options,
        group_caps=caps,
        owner=r.owner,
        fence=r.fence,
        lease_expires_at=r.lease_expires_at,
        details=r.details,
        states=states,
        workflow_yaml=r.workflow_yaml,
        broken=broken,
    )


def claim_strategies(
    store: Store,
    cid: str,
    now: float,
    lease_until: float,
    only: set[int] | None = None,
    lease_now: float | None = None,
    *,
    register: bool = False,
    driving: set[int] | None = None,
    serves_all: bool = False,
    skip: set[int] | None = None,
    lease_clock: str | None = None,
) -> list[StrategyRecord]:
    """Claim every driven strategy that is free, expired, or held by a dead conductor.

    ``register``: a starting conductor registers itself in the same transaction (one
    commit, so one fsync, before its first action can start). A strategy this
    conductor owns but is not ``driving`` (it stopped acting on it when its lease
    renewal lapsed) is claimed again, with a new fence, as if from another. Those in
    ``skip`` (this conductor cannot drive them) are left to others.

    Leases are compared on the lease clock (``lease_now``, read on the clock named
    ``lease_clock``; see :mod:`fleetwave.store.leases`), never on the wall clock ``now``
    (which stamps records only): a conductor whose wall clock steps ahead does not take
    a live conductor's strategy. Without ``lease_now``, ``now`` (tests of this function).
    """
    lease_now = now if lease_now is None else lease_now
    p = store.hooks.placeholder
    claimed: list[StrategyRecord] = []
    sql = (
        "SELECT id, workflow, state, options, group_caps, owner, fence, lease_expires_at, "
        "details, states, workflow_yaml FROM strategies "
        f"WHERE state IN ({store.hooks.placeholders(len(DRIVEN_STATES))})"
    )
    params: list[Any] = list(DRIVEN_STATES)
    if only is not None:
        sql += f" AND id IN ({store.hooks.placeholders(len(only))})"
        params += sorted(only)
    with store.write() as conn:
        if register:
            _register(conn, store, cid, now, serves_all, lease_clock)
        elif conn.execute(select(conductors.c.id).where(conductors.c.id == cid)).first() is None:
            raise ConductorUnknown(cid)  # see heartbeat: nothing is claimed
        dead = dead_conductors(conn, cid, lease_clock)
        for r in conn.exec_driver_sql(sql + " ORDER BY id", tuple(params)).all():
            mine = r.owner == cid
            if (mine and r.id in (driving or ())) or r.id in (skip or ()):
                continue
            free = (
                r.owner is None
                or mine
                or r.owner in dead
                or (r.lease_expires_at is not None and r.lease_expires_at < lease_now)
            )
            if not free:
                continue
            res = conn.exec_driver_sql(
                f"UPDATE strategies SET owner = {p}, fence = {p}, lease_expires_at = {p} "
                f"WHERE id = {p} AND fence = {p}",
                (cid, r.fence + 1, lease_until, r.id, r.fence),
            )
            if res.rowcount == 1:
                rec = _strategy_record(r)
                rec.owner, rec.fence = cid, r.fence + 1
                claimed.append(rec)
                conn.exec_driver_sql(
                    "INSERT INTO events (at, conductor, strategy_id, kind, details) "
                    f"VALUES ({p}, {p}, {p}, 'strategy-claimed', {p})",
                    (now, cid, r.id, f"from {r.owner or 'nobody'}"),
                )
    return claimed


def strategy_state(store: Store, sid: int) -> tuple[str, str | None]:
    with store.read() as conn:
        row = conn.execute(
            select(strategies.c.state, strategies.c.owner).where(strategies.c.id == sid)
        ).one()
        return str(row.state), row.owner


def strategy_states(store: Store, sids: list[int]) -> dict[int, tuple[str, str | None]]:
    """(state, owner) of several strategies in one query (the periodic pass's only read)."""
    if not sids:
        return {}
    ids = store.hooks.placeholders(len(sids))
    sql = f"SELECT id, state, owner FROM strategies WHERE id IN ({ids})"
    with store.read() as conn:
        return {int(r[0]): (str(r[1]), r[2]) for r in conn.exec_driver_sql(sql, tuple(sids))}


def set_strategy_state(
    store: Store, sid: int, cid: str, fence: int, expect: str, new: str, details: str, now: float
) -> bool:
    """Compare-and-set the strategy's (non-final) state; only its owner may, at the fence
    it holds it at.

    Final states go through :func:`end_strategy`, which also drops the lease.
    """
    p = store.hooks.placeholder
    with store.write() as conn:
        res = conn.exec_driver_sql(
            f"UPDATE strategies SET state = {p}, details = {p}, updated_at = {p} "
            f"WHERE id = {p} AND state = {p} AND owner = {p} AND fence = {p}",
            (new, details, now, sid, expect, cid, fence),
        )
        return bool(res.rowcount == 1)


def set_strategy_details(
    store: Store, sid: int, cid: str, fence: int, details: str, now: float
) -> bool:
    """Say why a driven strategy stops starting steps (its state unchanged, applying or
    paused); only its owner may, at the fence it holds it at."""
    p = store.hooks.placeholder
    with store.write() as conn:
        res = conn.exec_driver_sql(
            f"UPDATE strategies SET details = {p}, updated_at = {p} WHERE id = {p} "
            f"AND owner = {p} AND fence = {p} AND state IN ('{StrategyState.APPLYING.value}', "
            f"'{StrategyState.PAUSED.value}')",
            (details, now, sid, cid, fence),
        )
        return bool(res.rowcount == 1)


def end_strategy(
    store: Store, sid: int, cid: str, fence: int, final: str, details: str, now: float
) -> bool:
    """Commit a driven strategy's final state, drop its lease, and answer its open callbacks.

    One transaction: a callback is either answered by the owner that processed it or
    ignored because the strategy ended, never left open by a strategy that is over.
    An operator abort that raced in (abort-requested) is overwritten: the steps are
    all terminal already. False when this conductor no longer holds the strategy at the
    ``fence`` it drove it at (as every other write of a driven strategy checks).
    """
    p = store.hooks.placeholder
    with store.write() as conn:
        was = conn.exec_driver_sql(f"SELECT state FROM strategies WHERE id = {p}", (sid,)).scalar()
        res = conn.exec_driver_sql(
            f"UPDATE strategies SET state = {p}, details = {p}, updated_at = {p}, "
            "owner = NULL, lease_expires_at = NULL "
            f"WHERE id = {p} AND owner = {p} AND fence = {p} "
            f"AND state IN ({store.hooks.placeholders(len(DRIVEN_STATES))})",
            (final, details, now, sid, cid, fence, *DRIVEN_STATES),
        )
        if res.rowcount != 1:
            return False
        if was == StrategyState.ABORT_REQUESTED and final != StrategyState.ABORTED:
            # The operator was told "abort requested"; the strategy then ended as its
            # steps had: on the record, so that the end is not read as a lost abort.
            conn.exec_driver_sql(
                "INSERT INTO events (at, conductor, strategy_id, kind, details) "
                f"VALUES ({p}, {p}, {p}, 'abort-too-late', {p})",
                (
                    now,
                    cid,
                    sid,
                    f"an abort was requested after every step had ended: the strategy "
                    f"ended {final}, as its steps had",
                ),
            )
        conn.exec_driver_sql(
            "UPDATE callbacks SET outcome = 'ignored', reason = 'strategy ended first', "
            f"processed_at = {p} WHERE strategy_id = {p} AND outcome IS NULL",
            (now, sid),
        )
        return True


_STEP_COLUMNS = (
    "SELECT s.id, s.stage, s.group_id, s.state, s.fence, s.attempt, s.owner, "
    "t.name, t.driver, t.settings, t.managed, t.labels, g.name, s.not_started, "
    "s.deadline_at, s.ordinal "
    "FROM steps s JOIN targets t ON t.id = s.target_id "
    "LEFT JOIN groups g ON g.id = s.group_id "
)


def _step_records(
    conn: Connection,
    store: Store,
    sid: int,
    where: str,
    params: tuple[Any, ...],
    limit: int | None = None,
) -> list[StepRecord]:
    """Steps of one strategy in admission order, as the engine needs them.

    Plain SQL and shared parses: this runs before actions start, for up to every
    step of the strategy (100,000 of them in a large rollout).
    """
    p = store.hooks.placeholder
    sql = f"{_STEP_COLUMNS}WHERE s.strategy_id = {p} AND {where} ORDER BY s.ordinal"
    if limit is not None:
        sql += f" LIMIT {int(limit)}"
    rows = conn.exec_driver_sql(sql, (sid, *params)).all()
    parsed: dict[str, Any] = {}  # many targets share settings and labels: parse each once

    def parse(raw: str) -> Any:
        got = parsed.get(raw)
        if got is None:
            got = parsed[raw] = json.loads(raw)
        return got

    return [
        StepRecord(
            step_id=r[0],
            strategy_id=sid,
            stage=r[1],
            group_id=r[2],
            state=r[3],
            fence=r[4],
            attempt=r[5],
            owner=r[6],
            target=Target(
                name=r[7],
                driver=r[8],
                group=r[12],
                settings=parse(r[9]),
                managed=bool(r[10]),
                labels=parse(r[11]),
            ),
            not_started=bool(r[13]),
            deadline_at=r[14],
            ordinal=r[15],
        )
        for r in rows
    ]


def failure_past_limit(store: Store, sid: int, limit: int) -> str | None:
    """The target whose failure took strategy ``sid`` past ``limit`` failed steps (its
    ``limit + 1``-th failure, in the journal's order), for a conductor that takes over
    a strategy already stopping: its details still name it."""
    p = store.hooks.placeholder
    with store.read() as conn:
        row = conn.exec_driver_sql(
            "SELECT t.name FROM journal j JOIN steps s ON s.id = j.step_id "
            f"JOIN targets t ON t.id = s.target_id WHERE j.strategy_id = {p} "
            f"AND j.to_state = '{STEP_FAILED}' ORDER BY j.id LIMIT 1 OFFSET {int(limit)}",
            (sid,),
        ).first()
    return None if row is None else str(row[0])


def _failed_count(conn: Connection, store: Store, sid: int) -> int:
    p = store.hooks.placeholder
    sql = f"SELECT count(*) FROM steps WHERE strategy_id = {p} AND state = 'failed'"
    return int(conn.exec_driver_sql(sql, (sid,)).scalar_one())


_DONE = ", ".join(f"'{s}'" for s in sorted(STEP_TERMINAL))


def _steps_and_failed(
    conn: Connection, store: Store, sid: int, where: str
) -> tuple[list[StepRecord], int]:
    return _step_records(conn, store, sid, where, ()), _failed_count(conn, store, sid)


def load_open_steps(store: Store, sid: int) -> tuple[list[StepRecord], int]:
    """Every non-terminal step of a strategy in admission order, and the failed count."""
    with store.read() as conn:  # one snapshot for both
        return _steps_and_failed(conn, store, sid, f"s.state NOT IN ({_DONE})")


def load_started_steps(store: Store, sid: int) -> tuple[list[StepRecord], int]:
    """The steps in one of the workflow's states (neither waiting nor ended), and the
    failed count."""
    with store.read() as conn:  # one snapshot for all three
        # No transition journalled yet (a strategy driven for the first time): no step
        # has left ``initial``, none failed, since every move is journalled in its own
        # transaction (G9). One index probe instead of two scans of every step (100,000
        # of them in a large rollout).
        p = store.hooks.placeholder
        moved = conn.exec_driver_sql(
            f"SELECT 1 FROM journal WHERE strategy_id = {p} LIMIT 1", (sid,)
        ).first()
        if moved is None:
            return [], 0
        return _steps_and_failed(conn, store, sid, f"s.state NOT IN ('{STEP_INITIAL}', {_DONE})")


def load_waiting_steps(store: Store, sid: int, after_ordinal: int, limit: int) -> list[StepRecord]:
    """The next ``limit`` steps still waiting to start, after ``after_ordinal``, in order."""
    p = store.hooks.placeholder
    where = f"s.state = '{STEP_INITIAL}' AND s.ordinal > {p}"
    with store.read() as conn:
        return _step_records(conn, store, sid, where, (after_ordinal,), limit)


def load_steps(
    store: Store, sid: int, step_ids: list[int]
) -> tuple[list[StepRecord], dict[int, set[str]]]:
    """These steps of a strategy as their rows are now (to settle a refused transition),
    and the workflow states each has entered (journalled; a state is entered once)."""
    if not step_ids:
        return [], {}
    ids = tuple(sorted(step_ids))
    marks = store.hooks.placeholders(len(ids))
    with store.read() as conn:
        rows = _step_records(conn, store, sid, f"s.id IN ({marks})", ids)
        entered: dict[int, set[str]] = {}
        for step_id, state in conn.exec_driver_sql(
            f"SELECT step_id, to_state FROM journal WHERE step_id IN ({marks}) "
            f"AND to_state NOT IN ({_DONE})",
            ids,
        ).all():
            entered.setdefault(int(step_id), set()).add(str(state))
    return rows, entered


def take_over_steps(
    store: Store,
    recs: list[StepRecord],
    cid: str,
    now: float,
    *,
    held: tuple[int, int] | None = None,
    afresh: set[int] | None = None,
) -> list[StepRecord] | None:
    """Fence off the previous owner of in-flight steps: fence+1, owner=us (CAS per step).

    ``not_started`` is cleared in the same write: from here on this owner may start
    the action, so a later owner must treat it as possibly started (recover hook). A
    retry recorded and not started (attempt above 1) keeps its mark until its start is
    recorded: this owner waits for it to be due first, and may be lost meanwhile.
    ``held`` (strategy id, fence): take nothing unless this conductor still holds that
    strategy at that fence (checked in the same transaction): None when it does not.
    ``afresh``: steps entered but never started that this owner will start now: their
    state's first attempt is recorded (:data:`attempts`) in the same transaction.
    """
    taken: list[StepRecord] = []
    if not recs:
        return taken  # nothing to fence off: no write transaction
    with store.write() as conn:
        if held is not None:
            p = store.hooks.placeholder
            row = conn.exec_driver_sql(
                f"SELECT owner, fence FROM strategies WHERE id = {p}", (held[0],)
            ).first()
            if row is None or (row[0], row[1]) != (cid, held[1]):
                return None
        for rec in recs:
            res = conn.execute(
                update(steps)
                .where(
                    steps.c.id == rec.step_id,
                    steps.c.fence == rec.fence,
                    steps.c.state == rec.state,
                )
                .values(
                    owner=cid,
                    fence=rec.fence + 1,
                    not_started=rec.not_started and rec.attempt > 1,
                    deadline_at=rec.deadline_at,
                )
            )
            if res.rowcount != 1:
                continue
            how = " (its action never started)" if rec.not_started else ""
            conn.execute(
                insert(events).values(
                    at=now,
                    conductor=cid,
                    strategy_id=rec.strategy_id,
                    step_id=rec.step_id,
                    kind="step-taken-over",
                    details=f"in {rec.state} from {rec.owner or 'nobody'} "
                    f"(fence {rec.fence} -> {rec.fence + 1}){how}",
                )
            )
            rec.fence += 1
            rec.owner = cid
            taken.append(rec)
            if afresh and rec.step_id in afresh:
                sp = conn.begin_nested()
                try:
                    conn.execute(
                        insert(attempts).values(
                            strategy_id=rec.strategy_id,
                            step_id=rec.step_id,
                            state=rec.state,
                            attempt=1,
                            at=now,
                            conductor=cid,
                            fence=rec.fence,
                            how="afresh",
                        )
                    )
                    sp.commit()
                except IntegrityError:
                    # Its first attempt was released before (the row says otherwise than
                    # the record): it may have started, so its recover hook looks first.
                    sp.rollback()
                    rec.not_started = False
    return taken


# -- the hot path -------------------------------------------------------------------


def _is_entry(t: Transition) -> bool:
    """A step starting: out of ``initial`` into one of its workflow's states."""
    return t.from_state == STEP_INITIAL and t.to_state not in STEP_TERMINAL


def _held_back(t: Transition, hold: dict[int, str]) -> bool:
    """Whether ``hold`` (strategies by a state that holds steps back) keeps ``t`` from
    being written as it is: any entry of a paused or aborting strategy, and a move to
    a next state of one whose abort is requested."""
    state = hold.get(t.strategy_id)
    if state is None or t.to_state in STEP_TERMINAL:
        return False
    return t.from_state == STEP_INITIAL or state == StrategyState.ABORT_REQUESTED.value


def _start_held(d: AttemptDeadline, hold: dict[int, str]) -> bool:
    """Whether ``hold`` keeps a retry from starting: its start (not its record made
    before the backoff) in a strategy whose abort is requested. A pause does not: the
    step is in flight, and goes on to its end."""
    return not d.not_started and hold.get(d.strategy_id) == StrategyState.ABORT_REQUESTED.value


class TransitionWriter:
    """Group commit of transitions. Not thread-safe: one conductor owns it."""

    def __init__(self, store: Store, conductor_id: str) -> None:
        self.store = store
        self.cid = conductor_id
        self._raw: PoolProxiedConnection | None = None
        #: the hot path's DBAPI connection and cursor (kept while ``_raw`` is), and module
        self._driver: Any = None
        self._cur: Any = None
        self._dbapi: Any = store.engine.dialect.dbapi
        #: the commit being written: its time, whether a strategy's lease is lapsing,
        #: and the strategies whose entries it wrote as not started for that
        self._at = 0.0
        self._lapsing: Callable[[int], bool] = _never
        self._lapsed_now: set[int] = set()
        #: the commit's answers of ``_lapsing``, by strategy
        self._lapsing_now: dict[int, bool] = {}
        #: how a boolean column is bound (index by the value)
        self._flags = (store.hooks.flag(False), store.hooks.flag(True))
        p = store.hooks.placeholder
        # One compare-and-set UPDATE per kind of move, so that what a kind always sets to
        # NULL is written in the SQL: binding a None costs the driver an adapter lookup
        # (SQLite: about 2.5 us a row, a quarter of the statement).
        head = f"UPDATE steps SET state={p}, fence={p}, details={p}, attempt={p}, "
        # The step's owner is checked with its state and fence: a step in a workflow
        # state is written only by the conductor that owns it (a row whose owner was
        # changed or cleared is refused, read back and settled); a waiting one has none.
        cas = f" WHERE id={p} AND state={p} AND fence={p} AND (owner={p} OR {p})"
        #: into a workflow state: owned by this conductor (under its strategy's lease)
        self._enter_sql = (
            f"{head}owner={p}, started_at=COALESCE(started_at, {p}), "
            f"finished_at=NULL, not_started={p}, deadline_at={p}{cas}"
        )
        #: a started step ends
        self._finish_sql = (
            f"{head}owner=NULL, started_at=COALESCE(started_at, {p}), "
            f"finished_at={p}, not_started={p}, deadline_at=NULL{cas}"
        )
        #: a step ends without having started (aborted, unmanaged): no started_at
        self._end_unstarted_sql = (
            f"{head}owner=NULL, finished_at={p}, not_started={p}, deadline_at=NULL{cas}"
        )
        #: an attempt released to its target (see :data:`attempts`)
        self._attempt_sql = (
            "INSERT INTO attempts (strategy_id, step_id, state, attempt, at, conductor, "
            f"fence, how) VALUES ({p}, {p}, {p}, {p}, {p}, {p}, {p}, {p})"
        )
        self._journal_sql = (
            "INSERT INTO journal (strategy_id, step_id, at, conductor, from_state, to_state, "
            f"fence, details) VALUES ({p}, {p}, {p}, {p}, {p}, {p}, {p}, {p})"
        )
        #: a retry: its deadline, attempt and why; a step that has moved on since is
        #: left alone
        self._deadline_sql = (
            f"UPDATE steps SET deadline_at={p}, attempt={p}, details=COALESCE({p}, details), "
            f"not_started={p} WHERE id={p} AND state={p} AND fence={p} AND owner={p}"
        )
        self._mark_sql = (
            f"UPDATE callbacks SET outcome={p}, reason={p}, processed_at={p} "
            f"WHERE id={p} AND outcome IS NULL"
        )
        #: the fence check's statement by how many strategies a commit touches
        self._held_sql: dict[int, str] = {}
        self._event_sql = (
            "INSERT INTO events (at, conductor, strategy_id, step_id, kind, details) "
            f"VALUES ({p}, {p}, {p}, {p}, {p}, {p})"
        )

    def _params(self, t: Transition) -> tuple[str, tuple[Any, ...], tuple[Any, ...]]:
        """The step's compare-and-set UPDATE (statement and parameters), its journal row.

        Written at the commit's time (``self._at``: a commit retried through an outage
        went through later than it was decided). The step's attempt is its current
        state's: 1 entering a state; once ended, the attempts its last state took. An
        entry of a strategy whose lease is lapsing here is marked not started: nothing
        of it starts here any more, and the next owner starts it afresh.
        """
        at = self._at
        flags = self._flags
        to_state, fence, details = t.to_state, t.fence, t.details
        step_id, from_state, from_fence = t.step_id, t.from_state, t.from_fence
        upd: tuple[Any, ...]
        # (each tuple built at once, in the statement's order: once a transition)
        if to_state not in STEP_TERMINAL:
            sql = self._enter_sql
            sid = t.strategy_id
            stale = self._lapsing_now.get(sid)
            if stale is None:
                # (asked once a commit for each strategy)
                stale = self._lapsing_now[sid] = self._lapsing(sid)
                if stale:
                    self._lapsed_now.add(sid)
            upd = (
                to_state,
                fence,
                details,
                1,  # the attempt: a state is entered at its first
                self.cid,
                at,
                flags[t.not_started or stale],
                t.deadline_at,
                step_id,
                from_state,
                from_fence,
                self.cid,
                flags[t.any_owner or from_state == STEP_INITIAL],
            )
        else:
            # an end: without started_at if the step never started, else with it
            unstarted = from_state == STEP_INITIAL
            sql = self._end_unstarted_sql if unstarted else self._finish_sql
            stamps = (at,) if unstarted else (at, at)
            upd = (
                to_state,
                fence,
                details,
                t.attempt,
                *stamps,
                flags[t.not_started],
                step_id,
                from_state,
                from_fence,
                self.cid,
                flags[t.any_owner or unstarted],
            )
        jr = (t.strategy_id, step_id, at, self.cid, from_state, to_state, fence, details)
        return sql, upd, jr

    def commit(
        self,
        batch: list[Transition],
        evts: list[Event],
        now: float,
        marks: list[CallbackMark] | None = None,
        fences: dict[int, int] | None = None,
        deadlines: list[AttemptDeadline] | None = None,
        stops: dict[int, StopRule] | None = None,
        lapsing: Callable[[int], bool] | None = None,
    ) -> CommitResult:
        """Commit a batch in one transaction (group commit).

        ``fences`` maps each strategy the batch touches to the fence this conductor
        claimed it with: if another conductor has claimed it since (this one was
        presumed dead), nothing of that strategy is written and it is reported lost.
        ``marks`` record how callbacks were answered, ``deadlines`` when retries run
        out of time, in the same transaction.

        A step about to start whose target an operator has unmanaged since it was
        loaded is written as failed instead (the check is in this transaction, so an
        unmanage either comes before the step starts or after). If that exceeds its
        strategy's failure limit (``stops``), the strategy's later entries in the batch
        are written as aborted, not started. Both are listed in
        :attr:`CommitResult.replaced`; ``batch`` itself is left as it is.

        ``lapsing``: whether a strategy's lease is lapsing at this conductor, asked once
        for each strategy as the commit is written (each attempt of a retried one asks
        again): all of its entries in the commit are then written as not started
        (:attr:`CommitResult.not_started`), or none.
        """
        self._at, self._lapsing = now, lapsing or _never
        self._lapsed_now = set()
        self._lapsing_now = {}
        mk = [(m.outcome, m.reason, now, m.callback_id) for m in marks or ()]
        flags = self._flags  # (its 0 or 1 as the boolean column is bound)
        dl = [
            (
                d.deadline_at,
                d.attempt,
                d.details,
                flags[d.not_started],
                d.step_id,
                d.state,
                d.fence,
                self.cid,
            )
            for d in deadlines or ()
        ]
        ups: list[tuple[str, tuple[Any, ...]]] = []
        jrs: list[tuple[Any, ...]] = []
        for t in batch:
            sql, u, j = self._params(t)
            ups.append((sql, u))
            jrs.append(j)
        ev = [(now, self.cid, e.strategy_id, e.step_id, e.kind, e.details) for e in evts]
        fences = fences or {}
        # Each attempt replaces entries in its own copies: the caller's batch stays as it
        # was, so the slower path, or a retried commit (a transient error), decides again.
        stops = stops or {}
        replaced: list[Transition] = []
        if self._commit_fast(
            list(batch),
            list(ups),
            list(jrs),
            ev,
            mk,
            fences,
            dl,
            stops,
            replaced,
            deadlines or [],
        ):
            return CommitResult([], set(), replaced, not_started=self._lapsed_now)
        return self._commit_one_by_one(
            list(batch),
            ups,
            jrs,
            ev,
            marks or [],
            now,
            fences,
            deadlines or [],
            stops,
        )

    def _held(self, cur: Any, fences: dict[int, int]) -> tuple[set[int], dict[int, str]]:
        """Strategies no longer held by this conductor at the fence it claimed them with;
        and, of those still held, the ones whose steps may not start now (by state)."""
        if not fences:
            return set(), {}
        ids = sorted(fences)
        sql = self._held_sql.get(len(ids))
        if sql is None:
            sql = self._held_sql[len(ids)] = (
                "SELECT id, owner, fence, state FROM strategies "
                f"WHERE id IN ({self.store.hooks.placeholders(len(ids))})"
            )
        cur.execute(sql, ids)
        held: set[int] = set()
        hold: dict[int, str] = {}
        for sid, owner, fence, state in cur.fetchall():
            if owner == self.cid and fence == fences[sid]:
                held.add(int(sid))
                if state in HOLD_ENTRIES:
                    hold[int(sid)] = str(state)
        return set(ids) - held, hold

    def _end_unmanaged(
        self,
        cur: Any,
        batch: list[Transition],
        ups: list[tuple[str, tuple[Any, ...]]],
        jrs: list[tuple[Any, ...]],
        stops: dict[int, StopRule],
    ) -> list[Transition]:
        """Steps about to start whose target is unmanaged now: fail them instead; and
        once that exceeds a strategy's failure limit, start none of its later ones.

        Entries are replaced, in ``batch`` and in the statements' parameters (the
        caller's copies): ``initial -> failed`` with the unmanaged reason, or ``initial
        -> aborted`` as not started, as the dispatcher would have decided had it known;
        so are that strategy's moves to a next state in the batch (they end aborted
        after the state they finished). One query, only for batches that start steps.
        """
        at = {
            t.step_id: i
            for i, t in enumerate(batch)
            if t.from_state == STEP_INITIAL and t.to_state not in STEP_TERMINAL
        }
        if not at:
            return []
        hooks = self.store.hooks
        ids = list(at)
        # Lists padded to a power of two (with a repeated id): each length is its own
        # statement, and one per batch size would crowd the driver's statement cache,
        # which holds the hot path's UPDATEs and INSERTs.
        size = 1 << (len(ids) - 1).bit_length()
        ids += [ids[-1]] * (size - len(ids))
        cur.execute(
            "SELECT s.id, t.name FROM steps s JOIN targets t ON t.id = s.target_id "
            f"WHERE s.id IN ({hooks.placeholders(size)}) AND t.managed = {hooks.placeholder}",
            [*ids, hooks.flag(False)],
        )
        unmanaged = dict(cur.fetchall())
        if not unmanaged:
            return []
        tolerated = {sid: rule.tolerated for sid, rule in stops.items()}
        stopped: dict[int, str] = {}
        out: list[Transition] = []
        for i in sorted(at.values()):
            t = batch[i]
            sid = t.strategy_id
            if sid in stopped:
                to_state, details = STEP_ABORTED, f"not started: {stopped[sid]}"
            elif t.step_id in unmanaged:
                to_state, details = STEP_FAILED, unmanaged_reason(unmanaged[t.step_id])
                if sid in tolerated:
                    tolerated[sid] -= 1
                    if tolerated[sid] < 0:
                        who = unmanaged[t.step_id]
                        stopped[sid] = stops[sid].details.replace(StopRule.TARGET, who)
            else:
                continue
            out.append(self._end_instead(batch, ups, jrs, i, to_state, details))
        if stopped:
            # The stop happened in this commit: a step of that strategy moving on in it
            # must not start its next state either (the dispatcher, deciding the move,
            # did not know). It ends aborted after the state it finished.
            for i, t in enumerate(batch):
                sid = t.strategy_id
                if sid not in stopped or t.from_state == STEP_INITIAL:
                    continue
                if t.to_state in STEP_TERMINAL:
                    continue
                details = f"stopped after {t.from_state}: {stopped[sid]}"
                out.append(self._end_instead(batch, ups, jrs, i, STEP_ABORTED, details))
        return out

    def _end_instead(
        self,
        batch: list[Transition],
        ups: list[tuple[str, tuple[Any, ...]]],
        jrs: list[tuple[Any, ...]],
        i: int,
        to_state: str,
        details: str,
    ) -> Transition:
        """Write ``batch[i]`` as an end (``to_state``, at its fence) instead of what the
        dispatcher decided, in the batch and the statements' parameters (the caller's
        copies); the transition written."""
        batch[i] = ended = replace(
            batch[i],
            to_state=to_state,
            fence=batch[i].from_fence,
            details=details,
            not_started=False,
            deadline_at=None,
        )
        sql, u, j = self._params(ended)
        ups[i], jrs[i] = (sql, u), j
        return ended

    def _commit_fast(
        self,
        batch: list[Transition],
        ups: list[tuple[str, tuple[Any, ...]]],
        jrs: list[tuple[Any, ...]],
        ev: list[tuple[Any, ...]],
        mk: list[tuple[Any, ...]],
        fences: dict[int, int],
        dl: list[tuple[Any, ...]],
        stops: dict[int, StopRule],
        replaced: list[Transition],
        deadlines: list[AttemptDeadline],
    ) -> bool:
        """The hot path: one transaction on a dedicated DBAPI connection, four executemany.

        False (rolled back) when a strategy was lost, or a compare-and-set or a unique
        key refused a row: the caller then sorts the batch out row by row.
        """
        dbapi = self._dbapi
        raw_conn = self._raw
        if raw_conn is None:
            raw_conn = self._raw = self._connect()
            self._driver = raw_conn.driver_connection
        raw = self._driver
        cur = self._cur
        if cur is None:
            # (kept from one commit to the next: made anew each time, it cost the hot
            # path; let go after an error, which may leave a statement open on it)
            cur = self._cur = raw.cursor()
        self.store.wait_for_locks(raw, raw_conn.info)
        try:
            cur.execute(self.store.hooks.begin_write_sql)
            if self.store.write_fault is not None:
                self.store.write_fault()
            lost, hold = self._held(cur, fences)
            if lost or (
                hold
                and (
                    any(_held_back(t, hold) for t in batch)
                    or any(_start_held(d, hold) for d in deadlines)
                )
            ):
                raw.rollback()  # the row-by-row path says what was not written, and why
                return False
            replaced += self._end_unmanaged(cur, batch, ups, jrs, stops)
            ats = [self._attempt_row(d) for d in deadlines if not d.not_started] if dl else []
            by_sql: dict[str, list[tuple[Any, ...]]] = {}
            for sql, u in ups:
                by_sql.setdefault(sql, []).append(u)
            for sql, rows in by_sql.items():
                cur.executemany(sql, rows)
                if cur.rowcount != len(rows):
                    raw.rollback()
                    return False
            if jrs:
                cur.executemany(self._journal_sql, jrs)
            if ats:
                cur.executemany(self._attempt_sql, ats)
            if ev:
                cur.executemany(self._event_sql, ev)
            if mk:
                cur.executemany(self._mark_sql, mk)
            if dl:
                cur.executemany(self._deadline_sql, dl)
                if cur.rowcount != len(dl):
                    raw.rollback()  # a retry's row changed: the slower path says which
                    return False
            raw.commit()
            return True
        except dbapi.IntegrityError:
            self._rollback(raw)
            return False
        except dbapi.OperationalError as exc:
            self._rollback(raw)
            raise OperationalError("commit", None, exc) from exc
        except dbapi.DatabaseError as exc:  # a malformed file, ...: as SQLAlchemy says it
            self._rollback(raw)
            raise DatabaseError("commit", None, exc) from exc
        except BaseException:
            self._rollback(raw)
            raise

    def _attempt_row(self, d: AttemptDeadline) -> tuple[Any, ...]:
        """A retry's start (its attempt row)."""
        return (d.strategy_id, d.step_id, d.state, d.attempt, self._at, self.cid, d.fence, "retry")

    def _rollback(self, raw: Any) -> None:
        """After an error in the hot path's transaction: roll it back, and let go of the
        cursor (a statement it left half read would keep a read snapshot of the WAL open
        until the next commit, holding back checkpoints; rollback does not reset it)."""
        self._drop_cursor()
        try:
            raw.rollback()
        except self._dbapi.Error:
            # The connection itself is gone (PostgreSQL ended it: a restart, a dropped
            # link): let go of it for good, and the next commit opens a new one.
            self._lose_connection()

    def _lose_connection(self) -> None:
        raw_conn, self._raw, self._driver = self._raw, None, None
        if raw_conn is not None:
            raw_conn.invalidate()

    def _drop_cursor(self) -> None:
        cur, self._cur = self._cur, None
        if cur is not None:
            with contextlib.suppress(Exception):
                cur.close()

    def _commit_one_by_one(
        self,
        batch: list[Transition],
        ups: list[tuple[str, tuple[Any, ...]]],
        jrs: list[tuple[Any, ...]],
        ev: list[tuple[Any, ...]],
        marks: list[CallbackMark],
        now: float,
        fences: dict[int, int],
        deadlines: list[AttemptDeadline],
        stops: dict[int, StopRule],
    ) -> CommitResult:
        rejected: list[Transition] = []
        deferred: list[Transition] = []
        held_back: dict[int, str] = {}
        with self.store.write() as conn:
            raw: Any = conn.connection.driver_connection
            lost, hold = self._held(raw.cursor(), fences)
            stopped_now: list[Transition] = []
            if hold:
                # Paused, or its abort requested: none of its steps starts. Its entries
                # are not written (they wait again); its other moves are, but once its
                # abort is requested, a move to a next state ends the step instead
                # (aborted after the state it finished), as the dispatcher would decide.
                keep = [
                    i for i, t in enumerate(batch) if not (_is_entry(t) and t.strategy_id in hold)
                ]
                for i in sorted(set(range(len(batch))) - set(keep)):
                    deferred.append(batch[i])
                    held_back[batch[i].strategy_id] = hold[batch[i].strategy_id]
                batch = [batch[i] for i in keep]
                ups = [ups[i] for i in keep]
                jrs = [jrs[i] for i in keep]
                for i, t in enumerate(batch):
                    if _held_back(t, hold):
                        details = f"stopped after {t.from_state}: aborted by operator"
                        stopped_now.append(
                            self._end_instead(batch, ups, jrs, i, STEP_ABORTED, details)
                        )
                        held_back[t.strategy_id] = hold[t.strategy_id]
            replaced = stopped_now + self._end_unmanaged(raw.cursor(), batch, ups, jrs, stops)
            rows = list(zip(batch, ups, jrs, strict=True))
            held: Counter[int] = Counter()

            def write(t: Transition, sql: str, u: tuple[Any, ...], j: tuple[Any, ...]) -> None:
                if t.strategy_id in lost:
                    rejected.append(t)
                    return
                sp = conn.begin_nested()
                try:
                    res = conn.exec_driver_sql(sql, u)
                    if res.rowcount != 1:
                        sp.rollback()
                        if not self._already_applied(conn, t):
                            rejected.append(t)
                            held[t.strategy_id] += t.to_state in STEP_TERMINAL
                        return
                    conn.exec_driver_sql(self._journal_sql, j)
                    sp.commit()
                except IntegrityError:
                    sp.rollback()
                    rejected.append(t)
                    held[t.strategy_id] += t.to_state in STEP_TERMINAL

            # Moves first, then the entries. The dispatcher admitted entries as soon as it
            # decided that steps ended (their slots free, perhaps their stage done); if such
            # an end is refused, the step is still in a state, so none of its strategy's
            # entries in this batch is written: they wait, and the dispatcher admits again
            # once it has read that step's row (more than max parallel in flight, or a
            # stage started before the last one ended, otherwise).
            for t, (sql, u), j in rows:
                if not _is_entry(t):
                    write(t, sql, u, j)
            for t, (sql, u), j in rows:
                if not _is_entry(t):
                    continue
                if held[t.strategy_id] and t.strategy_id not in lost:
                    deferred.append(t)
                else:
                    write(t, sql, u, j)
            for t in rejected:
                why = (
                    "strategy claimed by another conductor (fenced off)"
                    if t.strategy_id in lost
                    else "step no longer at that state and fence, or state already entered"
                )
                ev.append(
                    (
                        now,
                        self.cid,
                        t.strategy_id,
                        t.step_id,
                        "transition-rejected",
                        f"{t.from_state} -> {t.to_state} at fence {t.from_fence}: {why}",
                    )
                )
            if ev:
                conn.exec_driver_sql(self._event_sql, ev)
            # Callbacks of a lost strategy stay open: its new owner answers them. So does
            # one whose transition was refused: it is applied when that is settled.
            refused_steps = {t.step_id for t in rejected} | {t.step_id for t in deferred}
            mk = [
                (m.outcome, m.reason, now, m.callback_id)
                for m in marks
                if m.strategy_id not in lost and m.step_id not in refused_steps
            ]
            if mk:
                conn.exec_driver_sql(self._mark_sql, mk)
            retries_refused: set[int] = set()
            retries_held: set[int] = set()
            for d in deadlines:
                if d.strategy_id in lost:
                    continue
                if _start_held(d, hold):
                    retries_held.add(d.step_id)
                    held_back[d.strategy_id] = hold[d.strategy_id]
                    continue
                sp = conn.begin_nested()
                try:
                    written = conn.exec_driver_sql(
                        self._deadline_sql,
                        (
                            d.deadline_at,
                            d.attempt,
                            d.details,
                            self._flags[d.not_started],
                            d.step_id,
                            d.state,
                            d.fence,
                            self.cid,
                        ),
                    )
                    if written.rowcount == 1 and not d.not_started:
                        # (an attempt recorded twice is refused: it must not run twice)
                        conn.exec_driver_sql(self._attempt_sql, self._attempt_row(d))
                except IntegrityError:
                    sp.rollback()
                    retries_refused.add(d.step_id)
                    continue
                sp.commit()
                if written.rowcount != 1:
                    retries_refused.add(d.step_id)
        refused = {id(t) for t in rejected} | {id(t) for t in deferred}
        return CommitResult(
            rejected,
            lost,
            [t for t in replaced if id(t) not in refused],
            deferred,
            held_back,
            self._lapsed_now,
            retries_refused,
            retries_held,
        )

    def close(self) -> None:
        self._drop_cursor()
        self._driver = None
        if self._raw is not None:
            self._raw.close()
            self._raw = None

    def _connect(self) -> PoolProxiedConnection:
        """The hot path's own connection; a failure to connect (a server that is not
        there) as SQLAlchemy's error, as every other store call's is."""
        try:
            return self.store.engine.raw_connection()
        except self._dbapi.Error as exc:
            raise DBAPIError.instance("connect", None, exc, self._dbapi.Error) from exc

    def _already_applied(self, conn: Connection, t: Transition) -> bool:
        """True when this very transition is already committed (a retried, ambiguous commit)."""
        row = conn.execute(
            select(journal.c.fence, journal.c.conductor, journal.c.from_state).where(
                journal.c.step_id == t.step_id, journal.c.to_state == t.to_state
            )
        ).first()
        return (
            row is not None
            and row.fence == t.fence
            and row.conductor == self.cid
            and row.from_state == t.from_state
        )
