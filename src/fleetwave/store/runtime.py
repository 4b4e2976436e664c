"""Engine-side queries: conductors, leases, claims, loading work, taking steps over.

The hot path, the group commit of transitions, is :mod:`fleetwave.store.writer`
(re-exported here: ``runtime.TransitionWriter``, ``runtime.Transition``, ...).
"""

from __future__ import annotations

import json
import os
import socket
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import Connection, insert, select, update
from sqlalchemy.exc import IntegrityError

from fleetwave.domain.models import (
    STEP_FAILED,
    STEP_INITIAL,
    STEP_TERMINAL,
    StrategyState,
    Target,
)
from fleetwave.domain.rollout import APPROVED_EVENT, approved_stage
from fleetwave.store import slots
from fleetwave.store.db import Store
from fleetwave.store.notify import notify
from fleetwave.store.schema import (
    attempts,
    conductors,
    events,
    steps,
    strategies,
)
from fleetwave.store.writer import HOLD_ENTRIES as HOLD_ENTRIES
from fleetwave.store.writer import SHARED as SHARED
from fleetwave.store.writer import SHARED_STATES as SHARED_STATES
from fleetwave.store.writer import AttemptDeadline as AttemptDeadline
from fleetwave.store.writer import CallbackMark as CallbackMark
from fleetwave.store.writer import CommitResult as CommitResult
from fleetwave.store.writer import Event as Event
from fleetwave.store.writer import StopRule as StopRule
from fleetwave.store.writer import Transition as Transition
from fleetwave.store.writer import TransitionWriter as TransitionWriter


def _host_identity() -> str:
    """This host and PID namespace: a PID is only comparable inside the same namespace."""
    try:
        ns = f":pidns{os.stat('/proc/self/ns/pid').st_ino}"
    except OSError:
        ns = ""
    return socket.gethostname() + ns


HOSTNAME = _host_identity()


#: Strategy states a conductor drives.
DRIVEN_STATES = (
    StrategyState.APPLYING.value,
    StrategyState.PAUSED.value,
    StrategyState.WAITING_APPROVAL.value,
    StrategyState.ABORT_REQUESTED.value,
    StrategyState.ABORTING.value,
)


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
    #: which visit of its state it is in (1 but on a bounded cycle), and the visits so
    #: far of the states that count them
    visit: int = 1
    visits: dict[str, int] = field(default_factory=dict)


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
    #: claimed from another conductor (its id): a lease taken over
    taken_from: str | None = None


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
    store: Store,
    cid: str,
    now: float,
    lease_until: float | None,
    *,
    serves_all: bool,
    lease_clock: str | None = None,
) -> None:
    with store.write() as conn:
        _register(conn, store, cid, now, serves_all, lease_clock, lease_until)


def _register(
    conn: Connection,
    store: Store,
    cid: str,
    now: float,
    serves_all: bool,
    lease_clock: str | None,
    lease_until: float | None = None,
) -> None:
    p = store.hooks.placeholder
    conn.exec_driver_sql(
        "INSERT INTO conductors (id, hostname, pid, started_at, heartbeat_at, serves_all, "
        f"lease_clock, lease_until) VALUES ({p}, {p}, {p}, {p}, {p}, {p}, {p}, {p})",
        (
            cid,
            HOSTNAME,
            os.getpid(),
            now,
            now,
            store.hooks.flag(serves_all),
            lease_clock,
            lease_until,
        ),
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


def live_peers(
    conn: Connection, self_id: str, lease_clock: str | None, lease_now: float
) -> set[str]:
    """Other conductors whose own lease still runs (on this conductor's lease clock):
    the steps they hold are theirs, whatever strategy they are of."""
    rows = conn.exec_driver_sql(
        "SELECT id, hostname, pid, stopped_at, lease_clock, lease_until FROM conductors "
        "WHERE stopped_at IS NULL AND lease_until IS NOT NULL"
    )
    return {
        r.id
        for r in rows
        if r.id != self_id
        and r.lease_clock == lease_clock
        and r.lease_until >= lease_now
        and not conductor_gone(r.hostname, r.pid, None)
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
            update(conductors)
            .where(conductors.c.id == cid)
            .values(heartbeat_at=now, lease_until=lease_until)
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
        notify(conn, "released")  # the others claim what it held at once


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
        if res.rowcount == 1:
            notify(conn, "released", sid)
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
            _register(conn, store, cid, now, serves_all, lease_clock, lease_until)
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
                rec.taken_from = r.owner if r.owner not in (None, cid) else None
                claimed.append(rec)
                # (the others may help drive it: they look at once, not at their tick)
                notify(conn, "led", r.id)
                if slots.recount(conn, store.hooks, r.id):
                    # (derived counts: a hand edit of a step, or a bug, made them drift)
                    conn.exec_driver_sql(
                        "INSERT INTO events (at, conductor, strategy_id, kind, details) "
                        f"VALUES ({p}, {p}, {p}, 'slots-recounted', {p})",
                        (now, cid, r.id, "its slots did not match its steps: counted again"),
                    )
                conn.exec_driver_sql(
                    "INSERT INTO events (at, conductor, strategy_id, kind, details) "
                    f"VALUES ({p}, {p}, {p}, 'strategy-claimed', {p})",
                    (now, cid, r.id, f"from {r.owner or 'nobody'}"),
                )
    return claimed


def recount_slots(store: Store, sid: int, cid: str, now: float) -> bool:
    """Count the strategy's slots again from its steps (some row was changed by someone
    other than a conductor's commit: a hand edit); True, with an event, if they had
    drifted."""
    p = store.hooks.placeholder
    with store.write() as conn:
        if not slots.recount(conn, store.hooks, sid):
            return False
        conn.exec_driver_sql(
            "INSERT INTO events (at, conductor, strategy_id, kind, details) "
            f"VALUES ({p}, {p}, {p}, 'slots-recounted', {p})",
            (now, cid, sid, "its slots did not match its steps: counted again"),
        )
        return True


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
    "s.deadline_at, s.ordinal, s.visit, s.visits "
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
            visit=r[16],
            visits=_visits(r[17]),
        )
        for r in rows
    ]


def _visits(raw: str | None) -> dict[str, int]:
    """A step row's ``visits`` (JSON {state: n}, or NULL): as the engine counts them. A
    value that is not that (a hand edit) counts nothing: the journal's unique key on
    (step, state, visit) still refuses a visit entered twice."""
    if raw is None:
        return {}
    try:
        got = json.loads(raw)
    except ValueError:
        return {}
    if not isinstance(got, dict):
        return {}
    return {str(k): v for k, v in got.items() if type(v) is int and v > 0}


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


def failed_by_stage(store: Store, sid: int) -> dict[int, int]:
    """Strategy ``sid``'s failed steps by stage column (its phase), for a conductor that
    takes over a strategy whose stages have failure limits of their own."""
    p = store.hooks.placeholder
    with store.read() as conn:
        rows = conn.exec_driver_sql(
            f"SELECT stage, count(*) FROM steps WHERE strategy_id = {p} AND state = "
            f"'{STEP_FAILED}' GROUP BY stage",
            (sid,),
        ).all()
    return {int(stage): int(n) for stage, n in rows}


def gate_facts(store: Store, sid: int, phase: int) -> tuple[float | None, int]:
    """What a gate before ``phase`` of strategy ``sid`` depends on: when the last step
    of the earlier phases ended (None: none has), and the highest stage approved
    (``strategy approve``; 0: none)."""
    p = store.hooks.placeholder
    with store.read() as conn:
        ended = conn.exec_driver_sql(
            f"SELECT max(finished_at) FROM steps WHERE strategy_id = {p} AND stage < {p}",
            (sid, phase),
        ).scalar()
        said = conn.exec_driver_sql(
            f"SELECT details FROM events WHERE strategy_id = {p} AND kind = {p}",
            (sid, APPROVED_EVENT),
        ).all()
    approved = [n for (text,) in said if (n := approved_stage(str(text))) is not None]
    return (None if ended is None else float(ended)), max(approved, default=0)


def hold_for_approval(
    store: Store, sid: int, cid: str, fence: int, details: str, now: float
) -> bool:
    """applying -> waiting-approval, saying for which stage (``details``); only its owner
    may, at the fence it holds it at. False if it was not applying (paused, aborting,
    waiting already)."""
    p = store.hooks.placeholder
    with store.write() as conn:
        res = conn.exec_driver_sql(
            f"UPDATE strategies SET state = {p}, details = {p}, updated_at = {p} WHERE id = {p} "
            f"AND owner = {p} AND fence = {p} AND state = '{StrategyState.APPLYING.value}'",
            (StrategyState.WAITING_APPROVAL.value, details, now, sid, cid, fence),
        )
        return bool(res.rowcount == 1)


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


def load_started_steps(
    store: Store, sid: int, peers: PeerView | None = None
) -> tuple[list[StepRecord], int]:
    """The steps in one of the workflow's states (neither waiting nor ended), and the
    failed count. With ``peers`` (conductors share the strategy), not those another
    live conductor holds: they are that conductor's to drive."""
    if peers is not None:
        found, failed = load_started_steps(store, sid)
        with store.read() as conn:
            live = live_peers(conn, peers.me, peers.lease_clock, peers.lease_now)
        return [s for s in found if s.owner not in live], failed
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


@dataclass(frozen=True)
class PeerView:
    """Who is asking, and the lease clock's reading to judge the others' leases by."""

    me: str
    lease_clock: str | None
    lease_now: float


def serving_peers(store: Store, peers: PeerView) -> int:
    """How many other live conductors serve every strategy (they share them)."""
    with store.read() as conn:
        live = live_peers(conn, peers.me, peers.lease_clock, peers.lease_now)
        if not live:
            return 0
        marks = store.hooks.placeholders(len(live))
        return int(
            conn.exec_driver_sql(
                f"SELECT count(*) FROM conductors WHERE id IN ({marks}) AND serves_all "
                "AND draining_at IS NULL",
                tuple(sorted(live)),
            ).scalar_one()
        )


def strategies_to_help(store: Store, peers: PeerView, skip: set[int]) -> list[StrategyRecord]:
    """Applying strategies another live conductor leads that have waiting steps nobody
    has claimed and a free slot: this conductor may claim and drive some of their
    steps beside their leader (conductors sharing a strategy)."""
    p = store.hooks.placeholder
    sql = (
        "SELECT s.id, s.workflow, s.state, s.options, s.group_caps, s.owner, s.fence, "
        "s.lease_expires_at, s.details, s.states, s.workflow_yaml FROM strategies s "
        "JOIN strategy_slots sl ON sl.strategy_id = s.id AND sl.group_id = 0 "
        f"WHERE s.state = '{StrategyState.APPLYING.value}' AND s.owner IS NOT NULL "
        f"AND s.owner <> {p} AND s.lease_expires_at >= {p} AND sl.in_flight < sl.cap "
        "AND EXISTS (SELECT 1 FROM steps w WHERE w.strategy_id = s.id "
        f"AND w.state = '{STEP_INITIAL}' AND w.owner IS NULL) ORDER BY s.id"
    )
    with store.read() as conn:
        rows = conn.exec_driver_sql(sql, (peers.me, peers.lease_now)).all()
    return [_strategy_record(r) for r in rows if r.id not in skip]


def _gone_holders(conn: Connection, store: Store, sid: int, peers: PeerView) -> list[str]:
    """The conductors whose own lease ran out (or that stopped) holding steps of the
    strategy not ended; ``[""]`` when none does, but a started step is held by nobody
    (handed back by a conductor that stopped, or let go of by one that stopped driving
    the strategy); else none."""
    p = store.hooks.placeholder
    live = live_peers(conn, peers.me, peers.lease_clock, peers.lease_now)
    held = [
        str(r[0])
        for r in conn.exec_driver_sql(
            "SELECT DISTINCT owner FROM steps WHERE strategy_id = "
            f"{p} AND owner IS NOT NULL AND owner <> {p} AND state NOT IN ({_DONE})",
            (sid, peers.me),
        )
    ]
    gone = [c for c in held if c not in live]
    if gone:
        return gone
    unheld = conn.exec_driver_sql(
        f"SELECT 1 FROM steps WHERE strategy_id = {p} AND owner IS NULL "
        f"AND state NOT IN ('{STEP_INITIAL}', {_DONE}) LIMIT 1",
        (sid,),
    ).first()
    return [] if unheld is None else [""]


def gone_holders(store: Store, sid: int, peers: PeerView) -> list[str]:
    """Whether :func:`take_from_gone_peers` would find anything, read only (the
    conductors gone that hold steps of the strategy, as there)."""
    with store.read() as conn:
        return _gone_holders(conn, store, sid, peers)


def take_from_gone_peers(store: Store, sid: int, peers: PeerView) -> list[StepRecord]:
    """The strategy's steps held by conductors whose own lease ran out (or that stopped):
    those never started are handed back (nobody's: claimed again), the started ones
    are returned, to be taken over (their recover hook looks first); with the started
    steps nobody holds."""
    p = store.hooks.placeholder
    with store.write() as conn:
        gone = _gone_holders(conn, store, sid, peers)
        if not gone:
            return []
        marks = store.hooks.placeholders(len(gone))
        res = conn.exec_driver_sql(
            f"UPDATE steps SET owner = NULL WHERE strategy_id = {p} "
            f"AND state = '{STEP_INITIAL}' AND owner IN ({marks})",
            (sid, *gone),
        )
        if res.rowcount:
            notify(conn, "released", sid)
        # (and started steps nobody holds: handed back by a conductor that stopped, or
        # let go of by one that stopped driving the strategy)
        return _step_records(
            conn,
            store,
            sid,
            f"s.state NOT IN ('{STEP_INITIAL}', {_DONE}) "
            f"AND (s.owner IN ({marks}) OR s.owner IS NULL)",
            tuple(gone),
        )


def strategies_held(store: Store, me: str) -> set[int]:
    """The strategies this conductor holds steps of that have not ended."""
    p = store.hooks.placeholder
    with store.read() as conn:
        return {
            int(r[0])
            for r in conn.exec_driver_sql(
                f"SELECT DISTINCT strategy_id FROM steps WHERE owner = {p} "
                f"AND state NOT IN ({_DONE})",
                (me,),
            )
        }


def let_go_of_undriven(store: Store, me: str, driving: set[int]) -> int:
    """Steps this conductor holds of strategies it does not drive (any more: it lost the
    strategy it led, or stopped helping one): nobody's again, so that the strategy's
    leader claims the waiting ones again and takes the started ones over (their recover
    hook looks first). How many."""
    p = store.hooks.placeholder
    sids = strategies_held(store, me) - driving
    if not sids:
        return 0
    with store.write() as conn:
        res = conn.exec_driver_sql(
            f"UPDATE steps SET owner = NULL WHERE owner = {p} AND state NOT IN ({_DONE}) "
            f"AND strategy_id IN ({store.hooks.placeholders(len(sids))})",
            (me, *sorted(sids)),
        )
        if res.rowcount:
            notify(conn, "released")
        return int(res.rowcount)


def open_elsewhere(store: Store, sid: int, me: str) -> tuple[int, int]:
    """Of the strategy's steps not ended: how many another conductor holds, and how many
    wait unclaimed (the strategy ends only once both are 0)."""
    p = store.hooks.placeholder
    with store.read() as conn:
        row = conn.exec_driver_sql(
            "SELECT count(*) FILTER (WHERE owner IS NOT NULL), "
            "count(*) FILTER (WHERE owner IS NULL) FROM steps "
            f"WHERE strategy_id = {p} AND state NOT IN ({_DONE}) "
            f"AND (owner IS NULL OR owner <> {p})",
            (sid, me),
        ).one()
    return int(row[0]), int(row[1])


def failed_counts(store: Store, sids: list[int]) -> dict[int, int]:
    """The failed steps of each strategy, as counted in its slots (by every conductor)."""
    if not sids:
        return {}
    sql = (
        "SELECT strategy_id, failed FROM strategy_slots WHERE group_id = 0 "
        f"AND strategy_id IN ({store.hooks.placeholders(len(sids))})"
    )
    with store.read() as conn:
        return {int(r[0]): int(r[1]) for r in conn.exec_driver_sql(sql, tuple(sids))}


def claim_waiting_steps(
    store: Store, sid: int, cid: str, limit: int, stage: int | None = None
) -> list[StepRecord]:
    """Claim up to ``limit`` waiting steps of the strategy that nobody has claimed (of
    ``stage`` only, if given), in admission order: each is then this conductor's to
    start (the writer starts a claimed step only for its owner). Several conductors
    claiming at once take disjoint steps without waiting on each other: PostgreSQL skips
    rows another transaction has locked (``FOR UPDATE SKIP LOCKED``); SQLite has one
    writer at a time."""
    hooks = store.hooks
    p = hooks.placeholder
    where = f"strategy_id = {p} AND state = '{STEP_INITIAL}' AND owner IS NULL"
    params: tuple[Any, ...] = (sid,)
    if stage is not None:
        where += f" AND stage = {p}"
        params += (stage,)
    lock = " FOR UPDATE SKIP LOCKED" if hooks.for_update else ""
    with store.write() as conn:
        ids = [
            int(r[0])
            for r in conn.exec_driver_sql(
                f"SELECT id FROM steps WHERE {where} ORDER BY ordinal LIMIT {int(limit)}{lock}",
                params,
            )
        ]
        if not ids:
            return []
        _update_steps_by_id(
            conn,
            store,
            f"UPDATE steps SET owner = {p} WHERE state = '{STEP_INITIAL}' AND owner IS NULL",
            (cid,),
            ids,
        )
        return _step_records(
            conn,
            store,
            sid,
            f"s.id IN ({hooks.placeholders(len(ids))})",
            tuple(ids),
        )


def release_waiting_steps(store: Store, cid: str, step_ids: list[int]) -> None:
    """Hand claimed steps that never started back (a clean stop): nobody's again."""
    p = store.hooks.placeholder
    with store.write() as conn:
        _update_steps_by_id(
            conn,
            store,
            f"UPDATE steps SET owner = NULL WHERE state = '{STEP_INITIAL}' AND owner = {p}",
            (cid,),
            step_ids,
        )


def load_steps(
    store: Store, sid: int, step_ids: list[int]
) -> tuple[list[StepRecord], dict[int, set[tuple[str, int]]]]:
    """These steps of a strategy as their rows are now (to settle a refused transition),
    and the workflow states each has entered, with the visit (journalled; a state is
    entered once per visit)."""
    if not step_ids:
        return [], {}
    ids = tuple(sorted(step_ids))
    marks = store.hooks.placeholders(len(ids))
    with store.read() as conn:
        rows = _step_records(conn, store, sid, f"s.id IN ({marks})", ids)
        entered: dict[int, set[tuple[str, int]]] = {}
        for step_id, state, visit in conn.exec_driver_sql(
            f"SELECT step_id, to_state, visit FROM journal WHERE step_id IN ({marks}) "
            f"AND to_state NOT IN ({_DONE})",
            ids,
        ).all():
            entered.setdefault(int(step_id), set()).add((str(state), int(visit)))
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
                f"SELECT owner, fence, state FROM strategies WHERE id = {p}", (held[0],)
            ).first()
            if held[1] == SHARED:
                # (its own steps of a strategy another leads: while that is driven)
                if row is None or row[2] not in SHARED_STATES:
                    return None
            elif row is None or (row[0], row[1]) != (cid, held[1]):
                return None
        for rec in recs:
            res = conn.execute(
                update(steps)
                .where(
                    steps.c.id == rec.step_id,
                    steps.c.fence == rec.fence,
                    steps.c.state == rec.state,
                    steps.c.visit == rec.visit,
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
                            visit=rec.visit,
                        )
                    )
                    sp.commit()
                except IntegrityError:
                    # Its first attempt was released before (the row says otherwise than
                    # the record): it may have started, so its recover hook looks first.
                    sp.rollback()
                    rec.not_started = False
    return taken
