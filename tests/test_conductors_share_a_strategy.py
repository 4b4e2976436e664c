"""Conductors sharing a strategy, step by step (``fleetwave serve`` on PostgreSQL).

Three conductors serve one database, each with a store of its own (as processes on
several hosts would): one leads each applying strategy, the others claim waiting steps
and drive them beside it. The rollout completes with work from all three in the
journal, ``check`` passes (G1, G7 counted in the slots), and no lease is held at the end;
a helper that dies has its steps taken over by the leader (recover hooks first); a
leader that dies is replaced by a helper, which keeps the steps it drives; a pause and
an abort reach the helpers; the failure threshold counts every conductor's failures.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from conftest import add_sim_targets, applied
from fleetwave.engine.conductor import Conductor, EngineConfig
from fleetwave.store import admin, queries
from fleetwave.store.db import Store, open_store
from fleetwave.testing.invariants import check

pytestmark = pytest.mark.both_dialects

FAST = EngineConfig(lease_ttl_s=3.0, tick_s=0.1, share=True)


def _journal_by_conductor(store: Store, sid: int) -> collections.Counter[str]:
    with store.read() as conn:
        rows = conn.exec_driver_sql(
            "SELECT conductor, count(*) FROM journal WHERE strategy_id = "
            f"{store.hooks.placeholder} GROUP BY conductor",
            (sid,),
        ).all()
    return collections.Counter({str(c): int(n) for c, n in rows})


def _state(store: Store, sid: int) -> str:
    return str(queries.get_strategy(store, sid)["state"])


def _owner(store: Store, sid: int) -> str | None:
    with store.read() as conn:
        got = conn.exec_driver_sql(
            f"SELECT owner FROM strategies WHERE id = {store.hooks.placeholder}", (sid,)
        ).scalar_one()
    return None if got is None else str(got)


async def _until(what: Callable[[], bool], timeout: float = 60.0) -> None:
    loop = asyncio.get_running_loop()
    give_up = loop.time() + timeout
    while not what():
        assert loop.time() < give_up, "timed out"
        await asyncio.sleep(0.05)


class Fleet:
    """Conductors serving every strategy, each with a store of its own."""

    def __init__(self, url: str, config: EngineConfig = FAST) -> None:
        self.url = url
        self.config = config
        self.stores: list[Store] = []
        self.tasks: dict[str, asyncio.Task[Any]] = {}
        self.stops: dict[str, asyncio.Event] = {}

    def start(self, name: str) -> Conductor:
        store = open_store(self.url)
        self.stores.append(store)
        c = Conductor(store, config=self.config, conductor_id=name)
        stop = asyncio.Event()
        self.stops[name] = stop
        self.tasks[name] = asyncio.create_task(c.run(stop=stop))
        return c

    async def stop(self, name: str) -> None:
        self.stops[name].set()
        await self.tasks.pop(name)

    async def kill(self, name: str) -> None:
        """As SIGKILL would: its task is cancelled mid-flight, nothing handed back."""
        task = self.tasks.pop(name)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    async def close(self) -> None:
        for name in list(self.tasks):
            await self.stop(name)
        for s in self.stores:
            s.dispose()


def _run(main: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(main())


def test_three_conductors_drive_one_strategy_together(store: Store, db_url: str) -> None:
    # (about 5 s of work: each conductor has joined within a periodic pass, 1 s)
    add_sim_targets(store, 600, {"latency_ms": 50})
    sid = applied(store, max_parallel=30)

    async def main() -> None:
        fleet = Fleet(db_url)
        try:
            for name in ("c-a", "c-b", "c-c"):
                fleet.start(name)
            await _until(lambda: _state(store, sid) == "complete")
        finally:
            await fleet.close()

    _run(main)
    by = _journal_by_conductor(store, sid)
    assert set(by) == {"c-a", "c-b", "c-c"}, by
    total = sum(by.values())
    assert total == 600 * 6  # (entry, five states' ends: every step once)
    for name, n in by.items():
        assert n >= total * 0.1, f"{name} did {n} of {total}: {by}"
    verdict = check(store, sid)
    assert verdict.ok, verdict.violations[:5]
    with store.read() as conn:
        held = conn.exec_driver_sql(
            "SELECT count(*) FROM steps WHERE owner IS NOT NULL"
        ).scalar_one()
        assert held == 0
        assert (
            conn.exec_driver_sql(
                "SELECT count(*) FROM strategies WHERE owner IS NOT NULL"
            ).scalar_one()
            == 0
        )


def test_in_flight_never_above_the_cap_across_conductors(store: Store, db_url: str) -> None:
    # (long enough for every conductor to join on a loaded host: about 3 s)
    add_sim_targets(store, 200, {"latency_ms": 40})
    sid = applied(store, max_parallel=12)
    seen: list[int] = []

    async def main() -> None:
        fleet = Fleet(db_url)
        try:
            for name in ("c-a", "c-b", "c-c"):
                fleet.start(name)

            def in_flight() -> bool:
                with store.read() as conn:
                    seen.append(
                        int(
                            conn.exec_driver_sql(
                                "SELECT count(*) FROM steps WHERE strategy_id = "
                                f"{store.hooks.placeholder} AND state NOT IN "
                                "('initial', 'complete', 'failed', 'aborted')",
                                (sid,),
                            ).scalar_one()
                        )
                    )
                return _state(store, sid) == "complete"

            await _until(in_flight)
        finally:
            await fleet.close()

    _run(main)
    assert max(seen) <= 12, max(seen)
    assert max(seen) >= 6  # (it did run in parallel)
    assert len(_journal_by_conductor(store, sid)) == 3


def test_a_helper_killed_its_steps_are_taken_over_by_the_leader(store: Store, db_url: str) -> None:
    add_sim_targets(store, 120, {"latency_ms": 150})
    sid = applied(store, max_parallel=20)

    async def main() -> None:
        fleet = Fleet(db_url)
        try:
            fleet.start("c-lead")
            await _until(lambda: _owner(store, sid) == "c-lead")
            fleet.start("c-help")

            def helping() -> bool:
                with store.read() as conn:
                    return bool(
                        conn.exec_driver_sql(
                            "SELECT count(*) FROM steps WHERE owner = 'c-help' AND state "
                            "NOT IN ('initial')"
                        ).scalar_one()
                    )

            await _until(helping)
            await fleet.kill("c-help")
            await _until(lambda: _state(store, sid) == "complete", timeout=90)
        finally:
            await fleet.close()

    _run(main)
    with store.read() as conn:
        taken = conn.exec_driver_sql(
            "SELECT count(*) FROM events WHERE kind = 'step-taken-over' "
            f"AND details LIKE {store.hooks.placeholder}",
            ("%from c-help%",),
        ).scalar_one()
    assert taken >= 1
    verdict = check(store, sid)
    assert verdict.ok, verdict.violations[:5]
    by = _journal_by_conductor(store, sid)
    assert by["c-help"] > 0 and by["c-lead"] > 0


def test_a_helper_stopped_cleanly_hands_back_and_the_leader_goes_on_at_once(
    store: Store, db_url: str
) -> None:
    """SIGTERM's drain, with actions longer than the grace period: the helper hands back
    its steps (waiting and running) and the leader takes the running ones over at once,
    not after the helper's lease (30 s here)."""
    add_sim_targets(store, 120, {"latency_ms": 600})
    sid = applied(store, max_parallel=20)
    slow_lease = EngineConfig(lease_ttl_s=30.0, tick_s=0.1, share=True, shutdown_grace_s=0.2)

    async def main() -> float:
        fleet = Fleet(db_url, slow_lease)
        try:
            fleet.start("c-lead")
            await _until(lambda: _owner(store, sid) == "c-lead")
            fleet.start("c-help")

            def helper_runs() -> bool:
                with store.read() as conn:
                    return bool(
                        conn.exec_driver_sql(
                            "SELECT count(*) FROM steps WHERE owner = 'c-help' AND state "
                            "NOT IN ('initial')"
                        ).scalar_one()
                    )

            await _until(helper_runs)
            await fleet.stop("c-help")
            stopped = asyncio.get_running_loop().time()

            def taken_back() -> bool:
                with store.read() as conn:
                    return not conn.exec_driver_sql(
                        "SELECT count(*) FROM steps WHERE (owner IS NULL OR owner = 'c-help') "
                        "AND state NOT IN ('initial', 'complete', 'failed', 'aborted')"
                    ).scalar_one()

            await _until(taken_back, timeout=20)
            took = asyncio.get_running_loop().time() - stopped
            await _until(lambda: _state(store, sid) == "complete", timeout=90)
            return took
        finally:
            await fleet.close()

    took = asyncio.run(main())
    assert took < 5.0, took  # (far from the 30 s lease: it was handed back, not lost)
    verdict = check(store, sid)
    assert verdict.ok, verdict.violations[:5]
    by = _journal_by_conductor(store, sid)
    assert by["c-help"] > 0 and by["c-lead"] > 0


def test_a_leader_killed_a_helper_leads_and_keeps_its_steps(store: Store, db_url: str) -> None:
    add_sim_targets(store, 120, {"latency_ms": 150})
    sid = applied(store, max_parallel=20)

    async def main() -> None:
        fleet = Fleet(db_url)
        try:
            fleet.start("c-lead")
            await _until(lambda: _owner(store, sid) == "c-lead")
            fleet.start("c-help")
            await _until(lambda: _journal_by_conductor(store, sid)["c-help"] > 10)
            await fleet.kill("c-lead")
            await _until(lambda: _state(store, sid) == "complete", timeout=90)
        finally:
            await fleet.close()

    _run(main)
    verdict = check(store, sid)
    assert verdict.ok, verdict.violations[:5]
    with store.read() as conn:
        claimed = conn.exec_driver_sql(
            "SELECT count(*) FROM events WHERE kind = 'strategy-claimed' "
            "AND conductor = 'c-help' AND details = 'from c-lead'"
        ).scalar_one()
    assert claimed == 1


def test_pause_and_abort_reach_the_helpers(store: Store, db_url: str) -> None:
    add_sim_targets(store, 200, {"latency_ms": 100})
    sid = applied(store, max_parallel=20)

    async def main() -> None:
        fleet = Fleet(db_url)
        try:
            fleet.start("c-lead")
            await _until(lambda: _owner(store, sid) == "c-lead")
            fleet.start("c-help")
            await _until(lambda: _journal_by_conductor(store, sid)["c-help"] > 5)
            admin.pause_strategy(store, sid)
            await asyncio.sleep(1.0)  # (in-flight steps finish their state)

            def quiet() -> bool:
                before = sum(_journal_by_conductor(store, sid).values())
                return before == sum(_journal_by_conductor(store, sid).values())

            await _until(quiet)
            entries_paused = _entries(store, sid)
            await asyncio.sleep(0.8)
            assert _entries(store, sid) == entries_paused  # nobody started a step
            admin.resume_strategy(store, sid)
            await _until(lambda: _entries(store, sid) > entries_paused)
            admin.request_abort(store, sid)
            await _until(lambda: _state(store, sid) == "aborted", timeout=60)
        finally:
            await fleet.close()

    _run(main)
    verdict = check(store, sid)
    assert verdict.ok, verdict.violations[:5]


def _entries(store: Store, sid: int) -> int:
    with store.read() as conn:
        return int(
            conn.exec_driver_sql(
                "SELECT count(*) FROM journal WHERE from_state = 'initial' "
                f"AND to_state NOT IN ('aborted', 'failed') AND strategy_id = "
                f"{store.hooks.placeholder}",
                (sid,),
            ).scalar_one()
        )


def test_the_failure_threshold_counts_every_conductors_failures(store: Store, db_url: str) -> None:
    add_sim_targets(store, 300, {"latency_ms": 30, "failure_rate": 0.05})
    sid = applied(store, max_parallel=30, max_failures=4)

    async def main() -> None:
        fleet = Fleet(db_url)
        try:
            for name in ("c-a", "c-b"):
                fleet.start(name)
            await _until(lambda: _state(store, sid) == "failed", timeout=90)
        finally:
            await fleet.close()

    _run(main)
    with store.read() as conn:
        failed = conn.exec_driver_sql(
            "SELECT count(*) FROM steps WHERE state = 'failed'"
        ).scalar_one()
        waiting = conn.exec_driver_sql(
            "SELECT count(*) FROM steps WHERE state = 'initial'"
        ).scalar_one()
    assert failed > 4 and waiting == 0
    verdict = check(store, sid)
    assert verdict.ok, verdict.violations[:5]


def test_callbacks_reach_the_conductor_that_drives_their_step(store: Store, db_url: str) -> None:
    """The ``clean`` workflow waits for its agents' callbacks. Every agent calls back
    to one conductor (as to the API beside one ``serve``): the steps the other drives
    get theirs from the database, and the one that received them leaves them alone (it
    marked them ignored, "not under way", since the steps were not its own)."""
    add_sim_targets(store, 80, {"latency_ms": 30})
    sid = applied(store, "clean", max_parallel=16)

    async def main() -> None:
        fleet = Fleet(db_url)
        try:
            a = fleet.start("c-a")
            b = fleet.start("c-b")
            await asyncio.sleep(0)  # (each has begun: its agents call it back)
            await _until(lambda: _owner(store, sid) is not None)
            for driver in b.drivers.values():
                if hasattr(driver, "callback_sink"):
                    driver.callback_sink = a._sink  # every agent reports to c-a
            await _until(lambda: _state(store, sid) == "complete", timeout=90)
        finally:
            await fleet.close()

    _run(main)
    verdict = check(store, sid)
    assert verdict.ok, verdict.violations[:5]
    assert set(_journal_by_conductor(store, sid)) == {"c-a", "c-b"}
    with store.read() as conn:
        outcomes = dict(
            conn.exec_driver_sql(
                "SELECT outcome, count(*) FROM callbacks WHERE strategy_id = "
                f"{store.hooks.placeholder} GROUP BY outcome",
                (sid,),
            ).all()
        )
    assert outcomes.get("ignored", 0) == 0, outcomes
    assert outcomes.get("applied", 0) >= 80 * 2  # (two waits a step)
