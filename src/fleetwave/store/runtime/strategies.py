"""Strategies as a conductor drives them: claims, their state, their end, their phases' facts."""

from __future__ import annotations

from typing import Any

from sqlalchemy import Connection, select

from fleetwave.domain.models import (
    STEP_FAILED,
    STEP_TERMINAL,
    StrategyState,
)
from fleetwave.domain.rollout import APPROVED_EVENT, approved_stage
from fleetwave.store import slots
from fleetwave.store.db import Store
from fleetwave.store.notify import notify
from fleetwave.store.runtime.conductors import ConductorUnknown, _register, dead_conductors
from fleetwave.store.runtime.records import DRIVEN_STATES, StrategyRecord, _strategy_record
from fleetwave.store.schema import (
    conductors,
    strategies,
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
