"""Steps as a conductor drives them: loading, claiming waiting ones, taking over others'."""

from __future__ import annotations

from typing import Any

from sqlalchemy import Connection, insert, update
from sqlalchemy.exc import IntegrityError

from fleetwave.domain.models import (
    STEP_INITIAL,
)
from fleetwave.store.db import Store
from fleetwave.store.runtime.conductors import _update_steps_by_id, live_peers
from fleetwave.store.runtime.records import PeerView, StepRecord, _step_records
from fleetwave.store.runtime.strategies import _DONE, _failed_count
from fleetwave.store.schema import (
    attempts,
    events,
    steps,
)
from fleetwave.store.writer import SHARED, SHARED_STATES


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
