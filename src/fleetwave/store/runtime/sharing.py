"""Conductors sharing a strategy: peers, strategies to help, gone helpers' steps."""

from __future__ import annotations

from sqlalchemy import Connection

from fleetwave.domain.models import (
    STEP_INITIAL,
    StrategyState,
)
from fleetwave.store.db import Store
from fleetwave.store.notify import notify
from fleetwave.store.runtime.conductors import live_peers
from fleetwave.store.runtime.records import (
    PeerView,
    StepRecord,
    StrategyRecord,
    _step_records,
    _strategy_record,
)
from fleetwave.store.runtime.strategies import _DONE


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
