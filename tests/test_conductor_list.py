"""`fleetwave conductor list`: each conductor's host, process, state (active, draining,
stopped, gone) and what it holds, read from the database alone."""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

from sqlalchemy import insert

from cli_harness import Cli
from conftest import add_sim_targets, applied
from fleetwave.engine.conductor import Conductor
from fleetwave.engine.config import EngineConfig
from fleetwave.store import queries
from fleetwave.store import runtime as rt
from fleetwave.store.db import Store
from fleetwave.store.schema import conductors


def _row(store: Store, cid: str) -> dict[str, Any]:
    (row,) = [c for c in queries.list_conductors(store) if c["id"] == cid]
    return row


def test_a_conductor_is_active_then_draining_then_stopped(store: Store) -> None:
    add_sim_targets(store, 3, {"latency_ms": 1_500})
    sid = applied(store, max_parallel=3)
    c = Conductor(store, config=EngineConfig(shutdown_grace_s=5.0), conductor_id="c-live")
    seen: dict[str, dict[str, Any]] = {}

    async def main() -> None:
        stop = asyncio.Event()
        task = asyncio.create_task(c.run(strategy_ids=[sid], stop=stop))
        for _ in range(200):
            await asyncio.sleep(0.02)
            if _row(store, "c-live")["steps"] == 3:
                break
        seen["running"] = _row(store, "c-live")
        stop.set()
        await asyncio.sleep(0.2)  # running actions finish their state meanwhile
        seen["stopping"] = _row(store, "c-live")
        await task

    asyncio.run(main())
    running = seen["running"]
    assert (running["state"], running["strategies"], running["steps"]) == ("active", 1, 3)
    assert (running["host"], running["pid"]) == (rt.HOSTNAME.split(":pidns")[0], os.getpid())
    assert seen["stopping"]["state"] == "draining"
    ended = _row(store, "c-live")
    assert (ended["state"], ended["strategies"], ended["steps"]) == ("stopped", 0, 0)
    assert ended["stopped_at"] is not None


def test_a_conductor_whose_process_or_renewals_are_gone_is_gone(store: Store) -> None:
    now = time.time()
    with store.write() as conn:
        for cid, host, pid, heartbeat in (
            ("dead-here", rt.HOSTNAME, 2**22 + 12345, now),  # no such process on this host
            ("silent", "another-host", 1, now - 120),  # stopped renewing two minutes ago
            ("fresh", "another-host", 1, now),
        ):
            conn.execute(
                insert(conductors).values(
                    id=cid,
                    hostname=host,
                    pid=pid,
                    started_at=now - 600,
                    heartbeat_at=heartbeat,
                    lease_clock=Conductor(store).clock.lease_clock,
                )
            )
    states = {c["id"]: c["state"] for c in queries.list_conductors(store)}
    assert states == {"dead-here": "gone", "silent": "gone", "fresh": "active"}


def test_conductor_list_from_the_command_line(cli: Cli) -> None:
    assert cli("init").code == 0
    res = cli("conductor", "list")
    assert res.code == 0
    header, dashes = res.out.splitlines()  # no conductor yet: the header alone
    assert header.split() == [
        "id",
        "host",
        "pid",
        "state",
        "strategies",
        "steps",
        "started_at",
        "heartbeat_at",
    ]
    assert set(dashes) <= {"-", " "}
    assert cli("conductor", "list", "--format", "json").json() == []
