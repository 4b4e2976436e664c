"""Callbacks from targets: stored at once, answered at once, processed by the owner later (G6).

Accepting a callback is one INSERT. It takes no step lock and waits for no
conductor; the conductor that owns the step picks it up (at once when it runs in
this process, else on its next periodic pass) and records it ``applied`` or
``ignored`` with a reason.
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import insert, select
from sqlalchemy.exc import IntegrityError

from fleetwave.domain.errors import InputError, NotFound
from fleetwave.domain.models import STEP_TERMINAL
from fleetwave.domain.rules import details_text
from fleetwave.store.db import Store
from fleetwave.store.schema import callbacks, steps

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

    def answer(self) -> dict[str, object]:
        """What ``step callback --format json`` and the API answer for it."""
        return {
            "id": self.id,
            "step": self.step_id,
            "strategy": self.strategy_id,
            "state": self.state,
            "kind": self.kind,
            "outcome": self.outcome,
            "reason": self.reason,
        }


def accept_callback(
    store: Store,
    step_id: int,
    state: str,
    kind: str,
    details: str,
    now: float,
    idempotency_key: str | None = None,
) -> CallbackRecord:
    """Store a callback (one INSERT). With an ``idempotency_key`` already stored for
    this step, nothing is stored: the callback stored with it is returned (its sender
    sent it again, not knowing it had arrived); :func:`is_replay` tells."""
    if kind not in KINDS:
        raise InputError(f"kind: must be one of {', '.join(KINDS)}, got '{kind}'")
    if not state:
        raise InputError("state: must name the state the callback reports on")
    # A target's words: on one line, printable, bounded (a byte that was not UTF-8 in a
    # shell's argument made the insert fail with a traceback)
    details = details_text(details)
    try:
        return _insert(store, step_id, state, kind, details, now, idempotency_key)
    except IntegrityError:
        if idempotency_key is None:
            raise
        again = _keyed(store, step_id, idempotency_key)
        if again is None:
            raise
        return again


def _insert(
    store: Store,
    step_id: int,
    state: str,
    kind: str,
    details: str,
    now: float,
    idempotency_key: str | None,
) -> CallbackRecord:
    with store.write() as conn:
        row = conn.execute(
            select(steps.c.strategy_id, steps.c.state).where(steps.c.id == step_id)
        ).first()
        if row is None:
            raise NotFound(f"step {step_id} not found")
        outcome = reason = None
        final: dict[str, object] = {}
        if row.state in STEP_TERMINAL:
            # Nobody will wait for it again: answer it for good right here.
            outcome, reason = "ignored", f"late: step already {row.state}"
            final = {"outcome": outcome, "reason": reason, "processed_at": now}
        res = conn.execute(
            insert(callbacks).values(
                strategy_id=row.strategy_id,
                step_id=step_id,
                state=state,
                kind=kind,
                details=details,
                received_at=now,
                idempotency_key=idempotency_key,
                **final,
            )
        )
        cid = int(res.inserted_primary_key[0])  # type: ignore[index]
    return CallbackRecord(cid, int(row.strategy_id), step_id, state, kind, details, outcome, reason)


@dataclass(frozen=True, slots=True)
class Replay(CallbackRecord):
    """A callback stored before with the same idempotency key (nothing stored now)."""


def is_replay(record: CallbackRecord) -> bool:
    return isinstance(record, Replay)


def _keyed(store: Store, step_id: int, key: str) -> CallbackRecord | None:
    with store.read() as conn:
        r = conn.execute(
            select(callbacks).where(
                callbacks.c.step_id == step_id, callbacks.c.idempotency_key == key
            )
        ).first()
    if r is None:
        return None
    return Replay(
        int(r.id), int(r.strategy_id), step_id, r.state, r.kind, r.details, r.outcome, r.reason
    )


def open_callbacks(store: Store, strategy_ids: list[int], after_id: int) -> list[CallbackRecord]:
    """Unprocessed callbacks of these strategies, oldest first."""
    if not strategy_ids:
        return []
    p = store.hooks.placeholder
    sql = (
        "SELECT id, strategy_id, step_id, state, kind, details FROM callbacks "
        f"WHERE strategy_id IN ({store.hooks.placeholders(len(strategy_ids))}) "
        "AND outcome IS NULL "
        f"AND id > {p} ORDER BY id"
    )
    with store.read() as conn:
        rows = conn.exec_driver_sql(sql, (*strategy_ids, after_id)).all()
    return [CallbackRecord(*r) for r in rows]


def open_callback_of(store: Store, step_id: int, state: str) -> CallbackRecord | None:
    """The oldest unprocessed report (done or failed) on this step's ``state``."""
    p = store.hooks.placeholder
    sql = (
        "SELECT id, strategy_id, step_id, state, kind, details FROM callbacks "
        f"WHERE step_id = {p} AND state = {p} AND outcome IS NULL "
        "AND kind IN ('done', 'failed') ORDER BY id LIMIT 1"
    )
    with store.read() as conn:
        row = conn.exec_driver_sql(sql, (step_id, state)).first()
    return None if row is None else CallbackRecord(*row)


def callback_outcomes(store: Store, strategy_id: int) -> list[dict[str, object]]:
    with store.read() as conn:
        return [
            {
                "id": r.id,
                "step": r.step_id,
                "state": r.state,
                "kind": r.kind,
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
