"""A strategy's slots in the database (G7 across conductors): ``strategy_slots``.

Each strategy has a row for itself (group 0) and one for each group it has steps of,
with the cap, the steps in flight and (on the strategy's row) the failed steps. The
writer (:mod:`fleetwave.store.writer`) counts every entry into a workflow state and
every end of a started step in the same commit that writes them, and writes an entry
only if it leaves every cap it counts against held: whichever conductor made it, and
however stale its own view of the slots was. Commits that change the counts are
serialized on the rows (PostgreSQL: the write lock, and ``FOR UPDATE``; SQLite: its
one writer), so two conductors cannot both take the last slot.

The counts are derived data: :func:`recount` makes them again from the steps (a
conductor does so when it takes a strategy over, and ``check`` compares them).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from sqlalchemy import Connection

from fleetwave.domain.models import STEP_FAILED, STEP_INITIAL, STEP_TERMINAL
from fleetwave.store.db import DialectHooks

#: the group id of a strategy's own row (groups' ids start at 1)
WHOLE = 0

#: states a step is not in flight in
_NOT_IN_FLIGHT = (STEP_INITIAL, *sorted(STEP_TERMINAL))


@dataclass(frozen=True, slots=True)
class Slots:
    """One row: a strategy's (``group_id`` 0) or one of its groups'."""

    strategy_id: int
    group_id: int
    cap: int
    in_flight: int
    failed: int


def insert_slots(
    conn: Connection,
    hooks: DialectHooks,
    sid: int,
    cap: int,
    group_caps: dict[int, int],
    in_flight: dict[int, int] | None = None,
    failed: int = 0,
) -> None:
    """A new strategy's rows: its own (``cap``) and each of its groups' (``group_caps``,
    the groups it has steps of)."""
    p = hooks.placeholder
    flights = in_flight or {}
    rows = [(sid, WHOLE, cap, sum(flights.values()), failed)]
    rows += [(sid, gid, gcap, flights.get(gid, 0), 0) for gid, gcap in sorted(group_caps.items())]
    conn.exec_driver_sql(
        "INSERT INTO strategy_slots (strategy_id, group_id, cap, in_flight, failed) "
        f"VALUES ({p}, {p}, {p}, {p}, {p})",
        rows,
    )


def counted(conn: Connection, hooks: DialectHooks, sid: int) -> tuple[dict[int, int], int]:
    """What the rows should say, from the steps themselves: in flight by group (WHOLE
    for the strategy), and failed."""
    p = hooks.placeholder
    flights: dict[int, int] = {WHOLE: 0}
    failed = 0
    rows = conn.exec_driver_sql(
        "SELECT group_id, state, COUNT(*) FROM steps WHERE strategy_id = "
        f"{p} GROUP BY group_id, state",
        (sid,),
    )
    for gid, state, n in rows:
        if state == STEP_FAILED:
            failed += int(n)
        if state in _NOT_IN_FLIGHT:
            continue
        flights[WHOLE] += int(n)
        if gid is not None:
            flights[int(gid)] = flights.get(int(gid), 0) + int(n)
    return flights, failed


def read_slots(conn: Connection, hooks: DialectHooks, sid: int) -> list[Slots]:
    p = hooks.placeholder
    return [
        Slots(int(r[0]), int(r[1]), int(r[2]), int(r[3]), int(r[4]))
        for r in conn.exec_driver_sql(
            "SELECT strategy_id, group_id, cap, in_flight, failed FROM strategy_slots "
            f"WHERE strategy_id = {p} ORDER BY group_id",
            (sid,),
        )
    ]


def drift(conn: Connection, hooks: DialectHooks, sid: int) -> list[str]:
    """How the rows differ from the steps (empty: they agree), for ``check``."""
    flights, failed = counted(conn, hooks, sid)
    rows = {s.group_id: s for s in read_slots(conn, hooks, sid)}
    out: list[str] = []
    if WHOLE not in rows:
        return ["no slots row"]
    for gid in sorted(set(flights) | set(rows) - {WHOLE}):
        row = rows.get(gid)
        want = flights.get(gid, 0)
        what = "strategy" if gid == WHOLE else f"group {gid}"
        if row is None:
            if want:
                out.append(f"{what}: {want} in flight, no slots row")
            continue
        if row.in_flight != want:
            out.append(f"{what}: slots row says {row.in_flight} in flight, steps {want}")
    if rows[WHOLE].failed != failed:
        out.append(f"strategy: slots row says {rows[WHOLE].failed} failed, steps {failed}")
    return out


def recount(conn: Connection, hooks: DialectHooks, sid: int) -> bool:
    """Make the rows again from the steps (within the caller's write transaction);
    True when they had drifted (a hand edit of a step, a bug)."""
    flights, failed = counted(conn, hooks, sid)
    rows = {s.group_id: s for s in read_slots(conn, hooks, sid)}
    if not rows:
        return False  # (a strategy without slots: none are kept for it)
    p = hooks.placeholder
    changed = False
    for gid, row in rows.items():
        want = flights.get(gid, 0)
        want_failed = failed if gid == WHOLE else 0
        if (row.in_flight, row.failed) != (want, want_failed):
            changed = True
            conn.exec_driver_sql(
                f"UPDATE strategy_slots SET in_flight = {p}, failed = {p} "
                f"WHERE strategy_id = {p} AND group_id = {p}",
                (want, want_failed, sid, gid),
            )
    return changed


def delete_slots(conn: Connection, hooks: DialectHooks, sids: Iterable[int]) -> None:
    p = hooks.placeholder
    for sid in sids:
        conn.exec_driver_sql(f"DELETE FROM strategy_slots WHERE strategy_id = {p}", (sid,))
