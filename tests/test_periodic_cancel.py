"""The conductor's periodic pass ends when its run ends: a cancel that comes together
with a wake-up (PostgreSQL's LISTEN/NOTIFY) is not lost."""

from __future__ import annotations

import asyncio

import pytest

from fleetwave.engine.conductor import Conductor
from fleetwave.engine.config import EngineConfig
from fleetwave.store.db import Store


def test_the_periodic_pass_stops_when_cancelled_as_a_wake_up_comes(store: Store) -> None:
    """On PostgreSQL the periodic pass waits for a tick or a NOTIFY's wake-up. A cancel
    (the conductor's run ending) that came with a wake-up was swallowed (Python 3.11's
    wait_for returned the wake-up), and the run waited for the pass for good: the
    callback-on-a-cycle tests' strategies on PostgreSQL hung now and then once they had ended."""

    async def go() -> None:
        conductor = Conductor(store, config=EngineConfig(tick_s=60))
        conductor._listening = True
        conductor._nudge = asyncio.Event()
        task = asyncio.create_task(conductor._periodic())
        await asyncio.sleep(0.01)  # (waiting for a tick or a wake-up)
        conductor._nudge.set()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(task, 5)

    asyncio.run(go())
