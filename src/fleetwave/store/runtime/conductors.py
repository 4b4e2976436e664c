"""Conductors and their leases: registration, heartbeats, who is gone, letting go."""

from __future__ import annotations

import os
from typing import Any

from sqlalchemy import Connection, update

from fleetwave.store.db import Store
from fleetwave.store.notify import notify
from fleetwave.store.runtime.records import HOSTNAME
from fleetwave.store.schema import (
    conductors,
    strategies,
)


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
