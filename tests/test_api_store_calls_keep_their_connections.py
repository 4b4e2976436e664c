"""The API's store calls, from all its threads at once and its writer beside them, keep
their database connections from one request to the next: none is opened per request
(on SQLite each new one ran its pragmas and began with a cold page cache; on PostgreSQL
it is a new server process)."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import sqlalchemy as sa

from fleetwave.api.service import STORE_THREADS, Service
from fleetwave.store.db import Store


def _held_read(store: Store, all_in: threading.Barrier) -> int:
    """A read that holds its connection until every caller of the round holds one."""
    with store.read() as conn:
        all_in.wait(timeout=30)
        return int(conn.exec_driver_sql("SELECT 1").scalar_one())


def _held_write(store: Store, all_in: threading.Barrier) -> int:
    with store.write() as conn:
        all_in.wait(timeout=30)
        return int(conn.exec_driver_sql("SELECT 1").scalar_one())


def test_every_api_thread_keeps_its_connection_between_requests(store: Store) -> None:
    store.engine.dispose()  # (none kept from the set-up: each opened is counted)
    opened: list[float] = []

    @sa.event.listens_for(store.engine, "connect")
    def _count(*_: Any) -> None:
        opened.append(time.monotonic())

    service = Service(store)
    callers = STORE_THREADS + 1  # every read thread, and the writer's

    async def round_of_requests() -> None:
        all_in = threading.Barrier(callers)
        reads = [service.call(_held_read, store, all_in) for _ in range(STORE_THREADS)]
        answers = await asyncio.gather(service.write(_held_write, store, all_in), *reads)
        assert answers == [1] * callers

    try:
        asyncio.run(round_of_requests())
        first = len(opened)
        assert first >= callers  # (each held one at once)
        for _ in range(3):
            asyncio.run(round_of_requests())
        assert len(opened) == first, (
            f"{len(opened) - first} connections opened again by the same requests"
        )
    finally:
        service.close()
