"""Leases are written and compared on a clock every conductor shares and that never
steps (the host's boot-time clock on SQLite), never on a conductor's wall clock
(reproduction d4 of an audit); a lease written under another boot is held by nobody."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from sqlalchemy import insert, update

from conftest import add_sim_targets, applied, on_virtual_time
from fleetwave.drivers.sim import SimDriver
from fleetwave.engine.clock import LoopClock, WallClock
from fleetwave.engine.conductor import Conductor
from fleetwave.engine.config import EngineConfig
from fleetwave.store import queries
from fleetwave.store import runtime as rt
from fleetwave.store.db import Store, open_store
from fleetwave.store.schema import conductors, strategies
from fleetwave.testing.invariants import check


def _held_by(store: Store, cid: str, hostname: str, lease_clock: str, until: float) -> None:
    """Every strategy held by conductor ``cid`` (of that host and lease clock) until then."""
    with store.write() as conn:
        conn.execute(
            insert(conductors).values(
                id=cid,
                hostname=hostname,
                pid=1,
                started_at=0,
                heartbeat_at=0,
                lease_clock=lease_clock,
            )
        )
        conn.execute(update(strategies).values(owner=cid, fence=1, lease_expires_at=until))


def _claims(store: Store) -> list[tuple[str, str]]:
    with store.read() as conn:
        rows = conn.exec_driver_sql(
            "SELECT conductor, details FROM events WHERE kind = 'strategy-claimed' ORDER BY id"
        ).all()
    return [(r[0], r[1]) for r in rows]


def test_a_wall_clock_ahead_takes_no_live_lease(tmp_path: Path) -> None:
    """d4: B's wall clock reads 100 s ahead of A's; A renews its lease all along, so B
    must never claim A's strategy (it waits, patient, and sees it end)."""
    store = open_store(str(tmp_path / "d4.db"), synchronous="OFF")
    add_sim_targets(store, 20, {"latency_ms": 20_000})
    sid = applied(store, max_parallel=5)
    sim = SimDriver()
    sim.count_starts = True
    cfg = EngineConfig(lease_ttl_s=30.0, tick_s=1.0, gc_freeze=False)

    async def main() -> tuple[dict[int, str], dict[int, str]]:
        clock = LoopClock()
        a = Conductor(store, clock=clock, config=cfg, drivers={"sim": sim}, conductor_id="A")
        ta = asyncio.ensure_future(a.run(strategy_ids=[sid]))
        await asyncio.sleep(45)
        ahead = LoopClock(offset_s=100.0, drift=0.001)  # stepped forward, and running fast
        b = Conductor(store, clock=ahead, config=cfg, drivers={"sim": sim}, conductor_id="B")
        tb = asyncio.ensure_future(b.run(strategy_ids=[sid], patient=True))
        got = await asyncio.gather(ta, tb)
        await sim.aclose()
        return got[0], got[1]

    result_a, result_b = on_virtual_time(main())
    assert result_a[sid] == "complete"
    assert result_b[sid] == "complete"
    assert _claims(store) == [("A", "from nobody")]
    assert [k for k, n in sim.starts.items() if n > 1] == []
    assert check(store, sid).ok
    store.dispose()


def test_a_lease_written_under_another_boot_is_held_by_nobody(tmp_path: Path) -> None:
    """A conductor of an earlier boot of this host (or of a version that did not name
    its lease clock) holds nothing, however far its lease seemed to reach: it is
    claimed at once, and `strategy show` says nobody drives it."""
    store = open_store(str(tmp_path / "boot.db"))
    add_sim_targets(store, 2, {"latency_ms": 1})
    sid = applied(store, max_parallel=2)
    # (pid 1: alive, a pid of the new boot) on the earlier boot's clock, a lease far
    # ahead of this boot's uptime
    _held_by(store, "before-reboot", rt.HOSTNAME, "this-host/boot:an-earlier-one", 1e9)
    assert queries.driving(store, sid).owner is None
    assert "under an earlier boot" in (queries.get_strategy(store, sid)["driven_by"] or "")
    result = asyncio.run(Conductor(store).run(strategy_ids=[sid]))
    assert result[sid] == "complete"
    assert _claims(store)[0][1] == "from before-reboot"
    store.dispose()


@pytest.mark.both_dialects
def test_conductors_lease_on_the_clock_the_database_gives_them(store: Store) -> None:
    """SQLite: every conductor is on the database's host, so leases are on its boot-time
    clock (named by its boot id). PostgreSQL: conductors on many hosts, so leases are
    on the server's clock; a conductor on another host counts as alive while its lease
    (on that clock) lasts."""
    add_sim_targets(store, 1, {"latency_ms": 1})
    sid = applied(store)
    conductor = Conductor(store)
    if store.hooks.now_sql() is None:
        assert conductor.clock.lease_clock == WallClock.lease_clock
    else:
        assert conductor.clock.lease_clock == "server"
        # (the server's clock, not this host's boot-time clock)
        assert abs(conductor.clock.lease_now() - rt.server_time(store)) < 5
    live = conductor.clock.lease_now() + 600
    _held_by(store, "elsewhere", "another-host", conductor.clock.lease_clock, live)
    assert queries.driving(store, sid).owner == "elsewhere"
    assert asyncio.run(conductor.run(strategy_ids=[sid]))[sid] == "owned"
    with store.write() as conn:
        conn.execute(update(strategies).values(lease_expires_at=live - 1200))
    assert asyncio.run(Conductor(store).run(strategy_ids=[sid]))[sid] == "complete"
