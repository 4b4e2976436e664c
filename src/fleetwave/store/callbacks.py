"""Callbacks from targets: stored at once, answered at once, processed by the owner later (G6).

Accepting a callback is one INSERT. It takes no step lock and waits for no
conductor; the conductor that owns the step picks it up (at once when it runs in
this process, else on its next periodic pass) and records it ``applied`` or
``ignored`` with a reason.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection, insert, select

from fleetwave.domain.errors import Conflict, InputError, NotFound
from fleetwave.domain.models import STEP_TERMINAL
from fleetwave.domain.rules import details_text
from fleetwave.store import keys
from fleetwave.store.db import Store, hooks_of
from fleetwave.store.notify import notify
from fleetwave.store.schema import callbacks

KINDS = ("done", "failed", "heartbeat")


@dataclass(frozen=True, slots=True)
class CallbackRecord:
    id: int
    strategy_id: int
    step_id: int
    state: str
    kind: str
    details: str
    #: set when it was answered as it was stored (its step had ended): ignored, and why
    outcome: str | None = None
    reason: str | None = None
    #: when it was stored (the storer's clock; None where not read)
    received_at: float | None = None
    #: the visit of ``state`` it reports on (1 but for a state on a bounded cycle)
    visit: int = 1

    def answer(self) -> dict[str, object]:
        """What ``step callback --format json`` and the API answer for it."""
        return {
            "id": self.id,
            "step": self.step_id,
            "strategy": self.strategy_id,
            "state": self.state,
            "kind": self.kind,
            "visit": self.visit,
            "outcome": self.outcome,
            "reason": self.reason,
        }


@dataclass(frozen=True, slots=True)
class Report:
    """A callback to store, checked (:func:`report`)."""

    step_id: int
    state: str
    kind: str
    details: str
    now: float
    #: the sender's key: the same key for the same step is stored once
    idempotency_key: str | None = None
    #: the visit of ``state`` it reports on (its agent token's, or as its sender said);
    #: None: the step's visit of that state when it is stored (see :func:`insert_callbacks`)
    visit: int | None = None


def report(
    step_id: int,
    state: str,
    kind: str,
    details: str,
    now: float,
    idempotency_key: str | None = None,
    visit: int | None = None,
) -> Report:
    """A callback checked, as it will be stored; bad input is refused."""
    if visit is not None and not 1 <= visit <= 1_000_000:
        raise InputError(f"visit: must be a whole number from 1, got {visit}")
    if kind not in KINDS:
        raise InputError(f"kind: must be one of {', '.join(KINDS)}, got '{kind}'")
    if not state:
        raise InputError("state: must name the state the callback reports on")
    # A target's words: on one line, printable, bounded (a byte that was not UTF-8 in a
    # shell's argument made the insert fail with a traceback)
    return Report(step_id, state, kind, details_text(details), now, idempotency_key, visit)


def accept_callback(
    store: Store,
    step_id: int,
    state: str,
    kind: str,
    details: str,
    now: float,
    idempotency_key: str | None = None,
    visit: int | None = None,
) -> CallbackRecord:
    """Store a callback (one INSERT). With an ``idempotency_key`` already stored for
    this step, nothing is stored: the callback stored with it is returned (its sender
    sent it again, not knowing it had arrived); :func:`is_replay` tells. ``visit``: the
    visit of ``state`` it reports on (see :func:`insert_callbacks`)."""
    (answer,) = accept_callbacks(
        store, [report(step_id, state, kind, details, now, idempotency_key, visit)]
    )
    if isinstance(answer, InputError):
        raise answer
    return answer


def accept_callbacks(store: Store, reports: Sequence[Report]) -> list[CallbackRecord | InputError]:
    """Store callbacks in one transaction (the API's intake: one fsync for all those
    that came at once), each answered as :func:`accept_callback` answers one: its
    record, a :class:`Replay` of the one stored with its key (by whoever stored it,
    meanwhile too: its insert does nothing), or the error that refused it (an unknown
    step)."""
    with store.write() as conn:
        return insert_callbacks(conn, reports)


def stored_with_keys(
    conn: Connection, reports: Sequence[Report]
) -> dict[tuple[int, str], CallbackRecord]:
    """The callbacks stored with these reports' idempotency keys, by (step, key)."""
    keyed = [(r.step_id, r.idempotency_key) for r in reports if r.idempotency_key]
    stored: dict[tuple[int, str], CallbackRecord] = {}
    for start in range(0, len(keyed), keys.CHUNK):
        for row in conn.execute(
            select(callbacks).where(
                keys.any_of(
                    conn,
                    callbacks,
                    (callbacks.c.step_id, callbacks.c.idempotency_key),
                    keyed[start : start + keys.CHUNK],
                )
            )
        ):
            stored[(int(row.step_id), str(row.idempotency_key))] = Replay(
                int(row.id),
                int(row.strategy_id),
                int(row.step_id),
                row.state,
                row.kind,
                row.details,
                row.outcome,
                row.reason,
                row.received_at,
                int(row.visit),
            )
    return stored


def insert_callbacks(
    conn: Connection,
    reports: Sequence[Report],
) -> list[CallbackRecord | InputError]:
    """:func:`accept_callbacks` within the caller's write transaction. A report whose
    idempotency key is stored already inserts nothing (``ON CONFLICT DO NOTHING``):
    its answer is a :class:`Replay` of the one stored, read then (not before: most
    keys are new, and a read of them all was a fifth of the intake's store time).

    Each is stored with the visit of its state it reports on: the one its report names
    (an agent token's visit), else the step's: the visit it is in when it is in that
    state, else the next visit of it (1 for a state entered once at most). The owner
    then applies it to that visit only: a late one of an earlier visit is ignored."""
    out: list[CallbackRecord | InputError] = []
    ids = sorted({r.step_id for r in reports})
    hooks = hooks_of(conn)
    found = {
        int(row.id): row
        for start in range(0, len(ids), 500)
        for row in conn.exec_driver_sql(
            "SELECT id, strategy_id, state, visit, visits FROM steps WHERE id IN ("
            + hooks.placeholders(len(ids[start : start + 500]))
            + ")",
            tuple(ids[start : start + 500]),
        )
    }
    woken: set[int] = set()
    # Decide each first, then insert them all in one statement (one INSERT a row,
    # each compiled and executed apart, was most of the intake's time on its thread).
    rows: list[dict[str, object]] = []
    # (its place in out, its record's fields but the id)
    made: list[tuple[int, tuple[int, int, str, str, str, str | None, str | None, float, int]]] = []
    again: list[tuple[int, int]] = []  # (its place in out, the one in made it repeats)
    pending: dict[tuple[int, str], int] = {}
    reports_by_place: dict[int, Report] = {}
    for r in reports:
        key = (r.step_id, r.idempotency_key) if r.idempotency_key else None
        if key is not None and key in pending:
            # the same key again in this batch: the one stored now
            again.append((len(out), pending[key]))
            out.append(NotFound("(answered below)"))
            continue
        step = found.get(r.step_id)
        if step is None:
            out.append(NotFound(f"step {r.step_id} not found"))
            continue
        outcome = reason = processed_at = None
        visit = r.visit if r.visit is not None else _visit_of(step, r.state)
        if step.state in STEP_TERMINAL:
            # Nobody will wait for it again: answer it for good right here.
            outcome, reason = "ignored", f"late: step already {step.state}"
            processed_at = r.now
        rows.append(
            {
                "strategy_id": step.strategy_id,
                "step_id": r.step_id,
                "state": r.state,
                "kind": r.kind,
                "details": r.details,
                "received_at": r.now,
                "idempotency_key": r.idempotency_key,
                "outcome": outcome,
                "reason": reason,
                "processed_at": processed_at,
                "visit": visit,
            }
        )
        if key is not None:
            pending[key] = len(made)
        made.append(
            (
                len(out),
                (
                    int(step.strategy_id),
                    r.step_id,
                    r.state,
                    r.kind,
                    r.details,
                    outcome,
                    reason,
                    r.now,
                    visit,
                ),
            )
        )
        reports_by_place[len(out)] = r
        out.append(NotFound("(answered below)"))
        if outcome is None:
            woken.add(int(step.strategy_id))
    if rows:
        inserted = _inserted_ids(conn, rows)
        # a key stored before (by another, or before this batch was read): its row
        # was not inserted; the one stored is the answer
        unstored = [
            reports_by_place[place]
            for (place, _), cid in zip(made, inserted, strict=True)
            if cid is None
        ]
        before = stored_with_keys(conn, unstored) if unstored else {}
        final: list[CallbackRecord | InputError] = []
        for (place, fields), cid in zip(made, inserted, strict=True):
            if cid is not None:
                final.append(CallbackRecord(cid, *fields))
                continue
            key = (fields[1], str(reports_by_place[place].idempotency_key))
            final.append(before.get(key) or Conflict(f"callback {key}: stored, then gone"))
        for (place, _), record in zip(made, final, strict=True):
            out[place] = record
        for place, index in again:
            first = final[index]
            out[place] = (
                first
                if isinstance(first, Exception | Replay)
                else Replay(*(getattr(first, f) for f in _FIELDS))
            )
    for sid in sorted(woken):
        notify(conn, "callback", sid)  # (its conductor: at once, once this commits)
    return out


def _inserted_ids(conn: Connection, rows: list[dict[str, object]]) -> list[int | None]:
    """Insert ``rows`` (each with an idempotency key, or none, at most once a key per
    step): their ids, in order; None for one whose key was stored before (nothing
    inserted). Rows with a key go in one statement of many rows; the database returns
    their ids in an order of its own, so each is found by its step and key. (Asked to
    return them in order, SQLAlchemy sent SQLite a row at a time.) Rows without one go
    a row at a time."""
    keyed = [r for r in rows if r["idempotency_key"] is not None]
    by_key: dict[tuple[object, object], int] = {}
    one = "(" + hooks_of(conn).placeholders(len(_INSERTED)) + ")"
    for start in range(0, len(keyed), _ROWS_A_STATEMENT):
        chunk = keyed[start : start + _ROWS_A_STATEMENT]
        # (on the driver, in one statement: SQLAlchemy's own many-rows insert bound
        # each row's parameters apart, a tenth of the intake's time)
        sql = (
            f"INSERT INTO callbacks ({', '.join(_INSERTED)}) VALUES "
            + ", ".join([one] * len(chunk))
            + " ON CONFLICT (step_id, idempotency_key) DO NOTHING"
            " RETURNING id, step_id, idempotency_key"
        )
        params = tuple(r[c] for r in chunk for c in _INSERTED)
        for cid, step_id, key in conn.exec_driver_sql(sql, params):
            by_key[(step_id, key)] = int(cid)
    ids: list[int | None] = []
    for r in rows:
        if r["idempotency_key"] is not None:
            ids.append(by_key.get((r["step_id"], r["idempotency_key"])))
        else:
            (cid,) = conn.execute(insert(callbacks).values(r).returning(callbacks.c.id)).one()
            ids.append(int(cid))
    return ids


#: the columns a callback is inserted with, and rows in one INSERT at most (SQLite
#: takes 32,766 parameters a statement)
_INSERTED = (
    "strategy_id",
    "step_id",
    "state",
    "kind",
    "details",
    "received_at",
    "idempotency_key",
    "outcome",
    "reason",
    "processed_at",
    "visit",
)
_ROWS_A_STATEMENT = 500

_FIELDS = (
    "id",
    "strategy_id",
    "step_id",
    "state",
    "kind",
    "details",
    "outcome",
    "reason",
    "received_at",
    "visit",
)


def _visit_of(step: Any, state: str) -> int:
    """The visit of ``state`` a callback that names none reports on: the step's when it
    is in that state, else the next one (1 for a state not entered yet, or not counted)."""
    if step.state == state:
        return int(step.visit)
    visits: dict[str, int] = json.loads(step.visits) if step.visits else {}
    return int(visits.get(state, 0)) + 1


@dataclass(frozen=True, slots=True)
class Replay(CallbackRecord):
    """A callback stored before with the same idempotency key (nothing stored now)."""


def is_replay(record: CallbackRecord) -> bool:
    return isinstance(record, Replay)


def open_callbacks(
    store: Store, strategy_ids: list[int], after_id: int, owner: str | None = None
) -> list[CallbackRecord]:
    """Unprocessed callbacks of these strategies, oldest first; with ``owner`` (conductors
    share the strategies), only those for steps that conductor holds (another's are
    that one's to answer; a waiting step's, its next holder's)."""
    if not strategy_ids:
        return []
    p = store.hooks.placeholder
    sql = (
        "SELECT id, strategy_id, step_id, state, kind, details, outcome, reason, received_at, "
        "visit FROM callbacks "
        f"WHERE strategy_id IN ({store.hooks.placeholders(len(strategy_ids))}) "
        "AND outcome IS NULL "
        f"AND id > {p}"
    )
    params: tuple[object, ...] = (*strategy_ids, after_id)
    if owner is not None:
        sql += (
            " AND EXISTS (SELECT 1 FROM steps st WHERE st.id = callbacks.step_id "
            f"AND st.owner = {p})"
        )
        params += (owner,)
    sql += " ORDER BY id"
    with store.read() as conn:
        rows = conn.exec_driver_sql(sql, params).all()
    return [CallbackRecord(*r) for r in rows]


def last_callback_id(store: Store) -> int:
    """The highest callback id stored (0: none): a new one means callbacks to look at."""
    with store.read() as conn:
        return int(conn.exec_driver_sql("SELECT max(id) FROM callbacks").scalar() or 0)


def open_callback_of(
    store: Store, step_id: int, state: str, visit: int = 1
) -> CallbackRecord | None:
    """The oldest unprocessed report (done or failed) on this step's ``state``, in that
    ``visit`` of it."""
    p = store.hooks.placeholder
    sql = (
        "SELECT id, strategy_id, step_id, state, kind, details, outcome, reason, received_at, "
        "visit FROM callbacks "
        f"WHERE step_id = {p} AND state = {p} AND visit = {p} AND outcome IS NULL "
        "AND kind IN ('done', 'failed') ORDER BY id LIMIT 1"
    )
    with store.read() as conn:
        row = conn.exec_driver_sql(sql, (step_id, state, visit)).first()
    return None if row is None else CallbackRecord(*row)


def callback_outcomes(store: Store, strategy_id: int) -> list[dict[str, object]]:
    with store.read() as conn:
        return [
            {
                "id": r.id,
                "step": r.step_id,
                "state": r.state,
                "kind": r.kind,
                "visit": r.visit,
                "outcome": r.outcome,
                "reason": r.reason,
                "received_at": r.received_at,
            }
            for r in conn.execute(
                select(callbacks)
                .where(callbacks.c.strategy_id == strategy_id)
                .order_by(callbacks.c.id)
            )
        ]
