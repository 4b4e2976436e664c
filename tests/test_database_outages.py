"""A conductor rides out a database outage: it retries, its lease watchdog stops its
actions before the lease lapses, and it claims its strategies anew afterwards."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest
from sqlalchemy import event
from sqlalchemy.exc import OperationalError

from conftest import Sleeps, add_sim_targets, applied, on_virtual_time
from fleetwave import ActionContext, Advance, Outcome, StateAction
from fleetwave.domain.registry import register_workflow
from fleetwave.domain.workflow import (
    StateDef,
    WorkflowDef,
)
from fleetwave.engine.clock import LoopClock
from fleetwave.engine.conductor import Conductor
from fleetwave.engine.config import EngineConfig
from fleetwave.engine.errors import StoreUnavailable
from fleetwave.store import queries
from fleetwave.store import runtime as rt
from fleetwave.store.db import Store
from fleetwave.testing.invariants import check
from fleetwave.testing.vloop import VirtualTimeLoop


def test_a_conductor_whose_store_keeps_failing_stops_instead_of_running_blind(
    store: Store,
) -> None:
    """Told not to ride out outages, a conductor stops after its retries."""
    add_sim_targets(store, 5, settings={"latency_ms": 60_000})
    sid = applied(store, "patch")
    conductor = Conductor(
        store,
        clock=LoopClock(),
        config=EngineConfig(lease_ttl_s=30, tick_s=1, ride_out_outages=False),
    )

    async def go() -> None:
        task = asyncio.create_task(conductor.run(strategy_ids=[sid]))
        await asyncio.sleep(5)

        def broken() -> None:
            raise OperationalError("BEGIN", None, Exception("disk I/O error (injected)"))

        store.write_fault = broken
        await task

    loop = VirtualTimeLoop()
    try:
        with pytest.raises(OperationalError):
            loop.run_until_complete(go())
    finally:
        store.write_fault = None
        loop.close()


def test_a_conductor_rides_out_a_database_outage_and_goes_on_after_it(
    store: Store, caplog: pytest.LogCaptureFixture
) -> None:
    """A database out for five minutes (locked by another program, a disk full): the
    conductor stopped after eight retries, with a traceback, and a `serve` was gone
    for good. It now keeps trying, says so every half minute, its lease watchdog stops
    the actions meanwhile, and once the database answers it claims the strategy anew
    and completes it (recover hooks looking at what was stopped)."""
    add_sim_targets(store, 5, settings={"latency_ms": 20_000})
    sid = applied(store, "patch")
    conductor = Conductor(store, clock=LoopClock(), config=EngineConfig(lease_ttl_s=30, tick_s=1))

    def out() -> None:
        raise OperationalError("BEGIN", None, Exception("database is locked (injected)"))

    async def go() -> dict[int, str]:
        loop = asyncio.get_running_loop()
        loop.call_later(5, setattr, store, "write_fault", out)
        loop.call_later(305, setattr, store, "write_fault", None)
        return await conductor.run(strategy_ids=[sid])

    with caplog.at_level(logging.WARNING, logger="fleetwave.engine"):
        assert on_virtual_time(go())[sid] == "complete"
    said = [r.getMessage() for r in caplog.records]
    retries = [m for m in said if m.startswith("store-retry")]
    # each stuck call (commit, renewal, claim) once at first, then every 30 s, then once
    # when it went through: not a line for each of its many tries
    assert conductor.stats.store_retries > 3 * len(retries)
    assert len(retries) <= 3 * (300 // 30 + 2), retries
    assert any("retrying until the database answers" in m for m in retries)
    # the store call in words, not the function's name ("claim_strategies failed")
    assert all("_" not in m.split(" failed")[0] for m in retries), retries
    # a warning at first, an error once it has lasted a minute (operators alert on those)
    levels = [r.levelno for r in caplog.records if "retrying until" in r.getMessage()]
    assert levels[0] == logging.WARNING and levels[-1] == logging.ERROR
    assert any("went through after" in m for m in retries)
    assert sum("lease-lapsing" in m for m in said) == 1
    # counted for /metrics (fleetwave_store_outages_total): each stuck call met it once,
    # and none is stuck now
    assert 1 <= conductor.stats.store_outages <= 3 * len(retries)
    assert conductor.stats.outage_since is None
    assert check(store, sid).ok


def test_a_conductor_started_on_a_read_only_file_goes_on_once_it_is_writable(
    store: Store,
) -> None:
    """SQLite opens a file it may not write read-only, and the connection stays so
    after the file is writable again: a conductor started while the file was chmod 444
    (a restore, a mistaken mode) retried 'attempt to write a readonly database' for
    ever after the mode was put back (helper-35's drill, 4 of 4). Here the connections
    opened during the first minute cannot write (SQLite's query_only, the same error)."""
    add_sim_targets(store, 5, settings={"latency_ms": 1_000})
    sid = applied(store, "patch")
    read_only = [True]

    def opened(dbapi_conn: Any, _record: Any) -> None:
        if read_only[0]:
            dbapi_conn.execute("PRAGMA query_only=ON")

    event.listen(store.engine, "connect", opened)
    store.dispose()  # the connections already open were opened writable
    conductor = Conductor(store, clock=LoopClock(), config=EngineConfig(lease_ttl_s=30, tick_s=1))

    async def go() -> dict[int, str]:
        asyncio.get_running_loop().call_later(60, read_only.__setitem__, 0, False)
        # an hour of virtual time: without new connections it never gets through
        return await asyncio.wait_for(conductor.run(strategy_ids=[sid]), 3600)

    try:
        assert on_virtual_time(go())[sid] == "complete"
    finally:
        event.remove(store.engine, "connect", opened)
    assert conductor.stats.store_retries > 0
    assert check(store, sid).ok


def test_a_serving_conductor_that_fenced_itself_off_takes_its_strategy_up_again(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by a bug hunt: a heartbeat slow to succeed (a few 'database is locked'
    retries; on a real SQLite file each also waits busy_timeout) made the periodic pass
    think renewal had lapsed: it stopped acting on every strategy. But nobody took them
    over, the database still named this conductor, its heartbeats kept the lease, and
    claims skipped strategies it owned: a serving conductor never drove it again."""
    add_sim_targets(store, 1)
    wf = register_workflow(
        WorkflowDef("hunt-long", (StateDef("a", Sleeps(60), timeout_s=600),)), replace=True
    )
    sid = applied(store, wf.name)
    real = rt.heartbeat
    calls = {"n": 0}

    def flaky_heartbeat(*a: Any, **kw: Any) -> int:
        calls["n"] += 1
        if 2 <= calls["n"] <= 8:  # the second renewal needs 7 retries (~11 s of backoff)
            raise OperationalError("UPDATE", None, Exception("database is locked"))
        return real(*a, **kw)

    monkeypatch.setattr(rt, "heartbeat", flaky_heartbeat)
    c = Conductor(store, clock=LoopClock(), config=EngineConfig(lease_ttl_s=12, tick_s=1))

    seen: dict[str, Any] = {}

    async def serve() -> None:
        stop = asyncio.Event()
        asyncio.get_running_loop().call_later(600, stop.set)
        task = asyncio.create_task(c.run(stop=stop))
        await asyncio.sleep(500)
        st = queries.get_strategy(store, sid)
        seen.update(state=st["state"], owner=rt.strategy_state(store, sid)[1])
        await task

    on_virtual_time(serve())
    # Claimed again (a new fence) and taken over: the state has no recover hook, so its
    # step fails as lost; the strategy ends, and nobody holds it.
    assert seen == {"state": "failed", "owner": None}, (seen, c.id, c.finished)
    ((step_state, details),) = [(s["state"], s["details"]) for s in queries.list_steps(store, sid)]
    assert (step_state, details) == ("failed", "a: conductor lost during a")


class RecordsCancel(StateAction):
    """Runs for a long time; records when (loop time) the conductor stopped it."""

    def __init__(self) -> None:
        self.cancelled_at: list[float] = []

    async def run(self, ctx: ActionContext) -> Outcome:
        try:
            await asyncio.sleep(300)
        except asyncio.CancelledError:
            self.cancelled_at.append(asyncio.get_running_loop().time())
            raise
        return Advance()


def test_actions_stop_before_the_lease_lapses_while_renewal_keeps_failing(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The lapse was checked only by the periodic pass after its renewal returned; a
    renewal retrying 'database is locked' (each try also blocking up to busy_timeout on
    a real file) kept that pass away for longer than the lease, so actions went on after
    another conductor could have taken the strategy over. A watchdog on the loop stops
    them once 80 % of the lease has passed since the last renewal that got through."""
    add_sim_targets(store, 1)
    action = RecordsCancel()
    wf = register_workflow(
        WorkflowDef("lease-watch", (StateDef("a", action, timeout_s=600),)), replace=True
    )
    sid = applied(store, wf.name)
    real = rt.heartbeat
    calls: list[float] = []

    def heartbeat_then_locked(*a: Any, **kw: Any) -> int:
        calls.append(asyncio.get_running_loop().time())
        if len(calls) >= 2:
            raise OperationalError("UPDATE", None, Exception("database is locked"))
        return real(*a, **kw)

    monkeypatch.setattr(rt, "heartbeat", heartbeat_then_locked)
    ttl = 12.0
    c = Conductor(
        store,
        clock=LoopClock(),
        config=EngineConfig(lease_ttl_s=ttl, tick_s=1, store_retries_max=40),
    )

    async def serve() -> None:
        stop = asyncio.Event()
        asyncio.get_running_loop().call_later(60, stop.set)
        await c.run(stop=stop)

    on_virtual_time(serve())
    renewed = calls[0]  # the last renewal that got through (its lease: renewed + ttl)
    assert len(calls) > 5  # renewal kept failing
    (stopped,) = action.cancelled_at
    assert renewed + 0.8 * ttl <= stopped <= renewed + 0.8 * ttl + 1.0 < renewed + ttl
    # Left to the next owner (whose recover hook looks at what was stopped), not ended.
    assert queries.get_strategy(store, sid)["state"] == "applying"
    assert [s["state"] for s in queries.list_steps(store, sid)] == ["a"]


class ShortOrLong(StateAction):
    """Step 1 (the short one) ends after 10 s; step 2 runs until stopped (recorded)."""

    def __init__(self) -> None:
        self.cancelled_at: list[float] = []

    async def run(self, ctx: ActionContext) -> Outcome:
        try:
            await asyncio.sleep(10 if ctx.step_id == 1 else 300)
        except asyncio.CancelledError:
            self.cancelled_at.append(asyncio.get_running_loop().time())
            raise
        return Advance()


def test_actions_stop_before_the_lease_lapses_while_the_dispatcher_is_stuck_in_a_commit(
    store: Store, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Found in session 9 (a real `serve` with its database locked for 45 s): the
    watchdog told the dispatcher to stop the lapsing strategy's actions, but the
    dispatcher was itself retrying a commit in the same outage, so the actions ran on
    past the lease, when another conductor may take the steps over (G2). The watchdog
    now stops them itself; and starts nothing more of it meanwhile."""
    add_sim_targets(store, 2)
    action = ShortOrLong()
    wf = register_workflow(
        WorkflowDef("lease-stuck", (StateDef("a", action, timeout_s=600), StateDef("b", action))),
        replace=True,
    )
    sid = applied(store, wf.name, max_parallel=2)
    locked = {"from": None}
    renewed: list[float] = []
    real_heartbeat, real_commit = rt.heartbeat, rt.TransitionWriter.commit

    def is_locked() -> None:
        if locked["from"] is not None:
            raise OperationalError("UPDATE", None, Exception("database is locked"))

    def heartbeat(*a: Any, **kw: Any) -> int:
        is_locked()
        renewed.append(asyncio.get_running_loop().time())
        return real_heartbeat(*a, **kw)

    def commit(self: rt.TransitionWriter, *a: Any, **kw: Any) -> Any:
        is_locked()
        return real_commit(self, *a, **kw)

    monkeypatch.setattr(rt, "heartbeat", heartbeat)
    monkeypatch.setattr(rt.TransitionWriter, "commit", commit)
    ttl = 12.0
    c = Conductor(
        store,
        clock=LoopClock(),
        config=EngineConfig(lease_ttl_s=ttl, tick_s=1, store_retries_max=1000),
    )

    stopped_at: list[float] = []

    async def serve() -> None:
        loop = asyncio.get_running_loop()
        loop.call_later(5, locked.__setitem__, "from", 5)  # the outage: from 5 s on
        stop = asyncio.Event()
        loop.call_later(60, stop.set)
        try:
            await asyncio.wait_for(c.run(stop=stop), 90)
        finally:
            stopped_at.append(loop.time())

    # Asked to stop during the outage, it gives up at once (its leases run out): it
    # hung until the database answered, however long.
    with pytest.raises(StoreUnavailable, match="database is locked"):
        on_virtual_time(serve())
    assert stopped_at[0] <= 66
    last = max(t for t in renewed if t < 5)  # the last renewal that got through
    # Step 1's action ended at 10 s; its commit has been retrying since: the dispatcher
    # is stuck, so only the watchdog can stop step 2's action in time.
    (stopped,) = action.cancelled_at
    assert last + 0.8 * ttl <= stopped <= last + 0.8 * ttl + 1.0 < last + ttl
    assert [s["state"] for s in queries.list_steps(store, sid)] == ["a", "a"]
    # said once, not on every tick the dispatcher stayed stuck
    assert sum("lease-lapsing" in r.getMessage() for r in caplog.records) == 1


class TenThenOne(StateAction):
    """State a takes 10 s, b 1 s; no recover hook (as a YAML workflow's action)."""

    def __init__(self) -> None:
        self.started: list[tuple[str, float]] = []

    async def run(self, ctx: ActionContext) -> Outcome:
        self.started.append((ctx.state, asyncio.get_running_loop().time()))
        await asyncio.sleep(10 if ctx.state == "a" else 1)
        return Advance()


def _outage(store: Store, start: float, end: float) -> None:
    def locked() -> None:
        raise OperationalError("BEGIN", None, Exception("database is locked (injected)"))

    loop = asyncio.get_running_loop()
    if start <= 0:
        store.write_fault = locked  # before the conductor's first write
    else:
        loop.call_later(start, setattr, store, "write_fault", locked)
    loop.call_later(end, setattr, store, "write_fault", None)


def test_a_state_entered_by_a_commit_that_went_through_after_the_lapse_starts_afresh(
    store: Store,
) -> None:
    """Found by review: a commit retried through an outage went through after the lease
    had lapsed, writing step 1's entry into b as started, though nothing of a lapsed
    strategy starts; claimed back, b was 'recovered', and with no recover hook the step
    failed ('conductor lost during b'). The entry is written as not started now, and b
    starts afresh."""
    add_sim_targets(store, 1)
    action = TenThenOne()
    wf = register_workflow(
        WorkflowDef("lapse-entry", (StateDef("a", action), StateDef("b", action))), replace=True
    )
    sid = applied(store, wf.name)
    c = Conductor(store, clock=LoopClock(), config=EngineConfig(lease_ttl_s=30, tick_s=1))

    async def go() -> dict[int, str]:
        _outage(store, 5, 60)  # a ends at 10 s: its commit waits until 60 s
        return await c.run(strategy_ids=[sid])

    assert on_virtual_time(go())[sid] == "complete"
    assert [state for state, _ in action.started] == ["a", "b"]
    assert action.started[1][1] >= 60
    moves = [h for h in queries.history(store, sid) if "attempt" not in h]  # (transitions)
    assert [(h["from"], h["to"]) for h in moves] == [
        ("initial", "a"),
        ("a", "b"),
        ("b", "complete"),
    ]
    assert check(store, sid).ok


def test_a_claim_that_went_through_after_an_outage_leases_from_then(store: Store) -> None:
    """Found by review: a store call retried through an outage wrote the time and the
    lease worked out before it: a claim that went through at 100 s wrote a lease that
    had run out at 30 s (another conductor could take the strategy at once) and
    claimed-at and entered-at times from before the outage (G9's "when")."""
    add_sim_targets(store, 1)
    action = TenThenOne()
    wf = register_workflow(
        WorkflowDef("lease-fresh", (StateDef("a", action), StateDef("b", action))), replace=True
    )
    sid = applied(store, wf.name)
    clock = LoopClock()
    c = Conductor(store, clock=clock, config=EngineConfig(lease_ttl_s=30, tick_s=1))
    seen: dict[str, float] = {}

    async def go() -> dict[int, str]:
        _outage(store, 0, 100)

        async def look() -> None:
            await asyncio.sleep(105)  # claimed, a running
            with store.read() as conn:
                seen["lease"] = conn.exec_driver_sql(
                    "SELECT lease_expires_at FROM strategies WHERE id = ?", (sid,)
                ).scalar_one()

        looking = asyncio.create_task(look())
        done = await c.run(strategy_ids=[sid])
        await looking
        return done

    assert on_virtual_time(go())[sid] == "complete"
    assert seen["lease"] >= 100 + 30 - 5  # (on the lease clock: the loop's)
    with store.read() as conn:
        claimed = conn.exec_driver_sql(
            "SELECT at FROM events WHERE kind = 'strategy-claimed' AND strategy_id = ?", (sid,)
        ).scalar_one()
    assert claimed - clock.epoch >= 100
    entered = [h["at"] for h in queries.history(store, sid)]
    assert all(at - clock.epoch >= 100 for at in entered), entered
