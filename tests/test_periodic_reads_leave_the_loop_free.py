"""On PostgreSQL the periodic pass reads (the strategies' states, the peers, the steps of
conductors gone) on a thread: while the database takes its time to answer, the
conductor's loop goes on starting actions. On SQLite (a local file) and on virtual
time (where nothing may wait on a thread) they stay on the loop."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import pytest

from conftest import add_sim_targets, applied
from fleetwave.engine.conductor import Conductor, EngineConfig
from fleetwave.store import runtime as rt
from fleetwave.store.db import Store
from fleetwave.testing.invariants import check

pytestmark = pytest.mark.both_dialects

SLOW_S = 0.4


def test_a_slow_periodic_read_does_not_stop_the_loop(
    store: Store, dialect: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    add_sim_targets(store, 30, settings={"latency_ms": 50})
    sid = applied(store, max_parallel=10)
    real = rt.strategy_states
    where: list[bool] = []

    def slow_states(*args: Any) -> Any:
        where.append(threading.current_thread() is threading.main_thread())
        time.sleep(SLOW_S)  # a database slow to answer (a loaded server, a far one)
        return real(*args)

    monkeypatch.setattr(rt, "strategy_states", slow_states)
    gaps: list[float] = []

    async def main() -> str:
        c = Conductor(store, config=EngineConfig(tick_s=0.05, share=True))
        task = asyncio.create_task(c.run(strategy_ids=[sid]))
        last = time.perf_counter()
        while not task.done():
            await asyncio.sleep(0.01)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now
        return (await task)[sid]

    assert asyncio.run(asyncio.wait_for(main(), 60)) == "complete"
    assert check(store, sid).ok
    assert where, "the periodic pass never read the strategies' states"
    if dialect == "postgresql":
        assert not any(where), "a periodic read ran on the loop's thread"
        # the loop went on while each slow read waited (a tick of the ticker above is
        # late by the store calls made inline meanwhile, never by a whole slow read)
        assert max(gaps) < SLOW_S * 0.75, max(gaps)
    else:
        assert all(where)
        assert max(gaps) >= SLOW_S  # (inline: the loop stood still; what the above rules out)
