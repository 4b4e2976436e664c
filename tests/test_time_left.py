"""``strategy show``'s progress: percent done, time elapsed, and an estimate of the time
left from the completed steps' durations."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from conftest import on_virtual_time
from fleetwave.domain.models import StrategyOptions
from fleetwave.domain.rollout import time_left_s
from fleetwave.engine.clock import LoopClock
from fleetwave.engine.conductor import Conductor
from fleetwave.engine.config import EngineConfig
from fleetwave.store import admin, queries
from fleetwave.store.db import Store
from rollout_world import PATCH, fleet


@pytest.mark.parametrize(
    ("steps", "ended", "mean", "cap", "left"),
    [
        (10, 4, 5.0, 2, 15.0),  # 6 left, 2 at a time: 3 waves of 5 s
        (10, 9, 5.0, 20, 5.0),  # the last one
        (10, 10, None, 2, 0.0),  # done
        (10, 0, None, 2, None),  # nothing completed yet: no estimate
        (7, 0, 2.0, 3, 6.0),  # 7 in waves of 3: 3 waves
    ],
)
def test_time_left(steps: int, ended: int, mean: float | None, cap: int, left: float) -> None:
    assert time_left_s(steps, ended, mean, cap) == left


def test_show_gives_percent_done_and_the_time_left_while_it_runs(store: Store) -> None:
    fleet(store, {None: 10}, latency_ms=1000)  # a step: 5 states of 1 s
    sid = admin.create_strategy(store, PATCH, StrategyOptions(max_parallel=2), all_targets=True)
    admin.apply_strategy(store, sid)
    conductor = Conductor(store, clock=LoopClock(), config=EngineConfig(tick_s=1))
    seen: dict[str, Any] = {}

    async def go() -> str:
        task = asyncio.create_task(conductor.run(strategy_ids=[sid]))
        await asyncio.sleep(12)  # two waves of two have ended (at 5 s and 10 s)
        seen.update(queries.get_strategy(store, sid))
        return (await task)[sid]

    assert on_virtual_time(go()) == "complete"
    assert seen["percent_done"] == 40.0
    assert seen["time_left_estimate_s"] == 15  # 6 left, 2 at a time, 5 s each
    assert "elapsed_s" in seen
    done = queries.get_strategy(store, sid)
    assert done["percent_done"] == 100.0 and "time_left_estimate_s" not in done
