"""Wake-ups between processes (PostgreSQL's LISTEN/NOTIFY): a serving conductor picks up
work another process committed at once, not at its next periodic pass.

The conductors here tick every 60 s: anything they do within a few seconds of another
process's commit was woken by its notification.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from conftest import add_sim_targets
from fleetwave.domain.models import StrategyOptions
from fleetwave.domain.registry import get_workflow
from fleetwave.engine.conductor import Conductor, EngineConfig
from fleetwave.store import admin, queries
from fleetwave.store import callbacks as cbs
from fleetwave.store.db import Store, open_store

#: the periodic pass's interval here: far longer than any wait below
TICK_S = 60.0


@contextmanager
def _serving(store: Store, share: bool = False, name: str | None = None) -> Iterator[Conductor]:
    """A conductor serving every strategy (as ``fleetwave serve``), in a thread."""
    config = EngineConfig(tick_s=TICK_S, share=share)
    conductor = Conductor(store, config=config, conductor_id=name)
    ready = threading.Event()
    stop: list[asyncio.Event] = []
    loops: list[asyncio.AbstractEventLoop] = []

    async def serve() -> None:
        stop.append(asyncio.Event())
        loops.append(asyncio.get_running_loop())
        await conductor.run(stop=stop[0], on_ready=ready.set)

    thread = threading.Thread(target=lambda: asyncio.run(serve()))
    thread.start()
    try:
        assert ready.wait(30), "the conductor did not start"
        yield conductor
    finally:
        if loops:
            loops[0].call_soon_threadsafe(stop[0].set)
        thread.join(60)
        assert not thread.is_alive()


def _wait_for(what: str, done: object, within: float) -> float:
    began = time.monotonic()
    while time.monotonic() - began < within:
        if done():  # type: ignore[operator]
            return time.monotonic() - began
        time.sleep(0.02)
    raise AssertionError(f"{what}: not within {within}s (the periodic pass is {TICK_S}s away)")


def _state(store: Store, sid: int) -> str:
    return str(queries.get_strategy(store, sid)["state"])


def test_a_strategy_applied_elsewhere_starts_at_once(pg_url: str) -> None:
    store = open_store(pg_url)
    add_sim_targets(store, 20, {"latency_ms": 5})
    wf = get_workflow("patch")
    assert wf is not None
    with _serving(store) as conductor:
        sid = admin.create_strategy(store, wf, StrategyOptions(max_parallel=20), all_targets=True)
        admin.apply_strategy(store, sid)  # (another process: the CLI)
        took = _wait_for("applied strategy completes", lambda: _state(store, sid) == "complete", 10)
        assert took < 10
        assert conductor.finished.get(sid) == "complete"
    store.dispose()


def test_a_callback_stored_elsewhere_is_applied_at_once(pg_url: str) -> None:
    """The ``clean`` workflow waits for its agent: a callback stored by another process
    (the CLI, an API server) moves the step on within seconds, not at the next tick."""
    store = open_store(pg_url)
    add_sim_targets(store, 1, {"latency_ms": 1, "callback_lost_rate": 1.0})
    wf = get_workflow("clean")
    assert wf is not None
    with _serving(store):
        sid = admin.create_strategy(store, wf, StrategyOptions(), all_targets=True)
        admin.apply_strategy(store, sid)

        def waiting() -> bool:
            steps = queries.list_steps(store, sid)
            return bool(steps) and steps[0]["state"] == "wait-for-agent"

        _wait_for("the step waits for its agent", waiting, 10)
        step_id = int(queries.list_steps(store, sid)[0]["step"])
        record = cbs.accept_callback(
            store, step_id, "wait-for-agent", "done", "booted", time.time()
        )
        _wait_for(
            "the callback is applied",
            lambda: queries.list_steps(store, sid)[0]["state"] != "wait-for-agent",
            10,
        )
        assert record.outcome is None  # stored, answered later by the conductor
    store.dispose()


def test_a_strategy_claimed_by_its_leader_is_helped_at_once(pg_url: str) -> None:
    """Two conductors serve; a strategy applied elsewhere is claimed by one of them. Its
    claim wakes the other, which helps drive it at once, not at its next periodic pass:
    both have steps in the journal long before the 60 s tick."""
    stores = [open_store(pg_url) for _ in range(3)]
    store = stores[0]
    add_sim_targets(store, 400, {"latency_ms": 20})
    wf = get_workflow("patch")
    assert wf is not None
    with (
        _serving(stores[1], share=True, name="c-one"),
        _serving(stores[2], share=True, name="c-two"),
    ):
        sid = admin.create_strategy(store, wf, StrategyOptions(max_parallel=40), all_targets=True)
        admin.apply_strategy(store, sid)

        def both_drive() -> bool:
            with store.read() as conn:
                rows = conn.exec_driver_sql(
                    "SELECT DISTINCT conductor FROM journal WHERE strategy_id = %s", (sid,)
                ).all()
            return {r[0] for r in rows} == {"c-one", "c-two"}

        # (the whole rollout takes about 4 s: 400 steps, 40 at a time, 5 states of 20 ms)
        _wait_for("both conductors drive the strategy", both_drive, 3)
        _wait_for("the strategy completes", lambda: _state(store, sid) == "complete", 10)
    for s in stores:
        s.dispose()
