"""Adopting a claimed strategy: steps are taken over only by the conductor that still
holds the strategy, and by one run of it (reproductions d1 and d1b of an audit)."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy.exc import OperationalError

from conftest import add_sim_targets, applied, on_virtual_time
from fleetwave.domain.workflow import ActionContext
from fleetwave.drivers.sim import SimDriver
from fleetwave.engine.clock import LoopClock
from fleetwave.engine.conductor import Conductor
from fleetwave.engine.config import EngineConfig
from fleetwave.store import runtime as rt
from fleetwave.store.db import Store, open_store
from fleetwave.testing.invariants import check

Call = tuple[float, str, str, str, bool, int]


class Spy:
    """The shared sim driver as one conductor sees it: records each call on a target
    (loop time, conductor, target, operation, recovering, the calling task)."""

    def __init__(self, sim: SimDriver, who: str, calls: list[Call]) -> None:
        self._sim, self._who, self._calls = sim, who, calls

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._sim, name)
        if name not in ("perform", "observe", "start"):
            return attr

        async def call(target: Any, operation: str, ctx: ActionContext) -> Any:
            now = asyncio.get_running_loop().time()
            task = id(asyncio.current_task())
            self._calls.append((now, self._who, target.name, operation, ctx.recovering, task))
            return await attr(target, operation, ctx)

        return call


class StallsBeforeAdopting(Conductor):
    """Its claim commits, then the process stalls (a GC pause, SIGSTOP) before adopting."""

    async def _adopt(self, rec: Any, events: Any, batch: Any, now: float) -> Any:
        await asyncio.sleep(300)
        return await super()._adopt(rec, events, batch, now)


def _setup(tmp_path: Path, n: int) -> tuple[Store, int]:
    store = open_store(str(tmp_path / "adopt.db"), synchronous="OFF")
    add_sim_targets(store, n, {"latency_ms": 900_000})
    return store, applied(store, max_parallel=n)


async def _crashed_with_steps_in_flight(
    store: Store, sid: int, cfg: EngineConfig, clock: LoopClock
) -> None:
    """A first conductor starts every step, then dies (its leases run out later)."""
    c0 = Conductor(store, clock=clock, config=cfg, drivers={"sim": SimDriver()}, conductor_id="c0")
    task = asyncio.ensure_future(c0.run(strategy_ids=[sid]))
    await asyncio.sleep(30)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


def _events(store: Store, kind: str) -> list[tuple[str, int | None, str]]:
    with store.read() as conn:
        rows = conn.exec_driver_sql(
            "SELECT conductor, step_id, details FROM events WHERE kind = ? ORDER BY id", (kind,)
        ).all()
    return [(r[0], r[1], r[2]) for r in rows]


def test_a_conductor_fenced_off_before_adopting_takes_no_step_over(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """d1: A claims, stalls past its lease, B claims and takes the steps over; when A
    resumes, its adopt must take nothing (the strategy is B's at a higher fence)."""
    clock = LoopClock()
    store, sid = _setup(tmp_path, 3)
    cfg = EngineConfig(lease_ttl_s=60.0, tick_s=1.0, gc_freeze=False)
    calls: list[Call] = []
    sim = SimDriver()

    async def main() -> dict[int, str]:
        await _crashed_with_steps_in_flight(store, sid, cfg, clock)
        a = StallsBeforeAdopting(
            store,
            clock=clock,
            config=replace(cfg, renew_leases=False),
            drivers={"sim": Spy(sim, "A", calls)},  # type: ignore[dict-item]
            conductor_id="A",
        )
        ta = asyncio.ensure_future(a.run(strategy_ids=[sid], patient=True))
        await asyncio.sleep(90)
        b = Conductor(
            store,
            clock=clock,
            config=cfg,
            drivers={"sim": Spy(sim, "B", calls)},  # type: ignore[dict-item]
            conductor_id="B",
        )
        tb = asyncio.ensure_future(b.run(strategy_ids=[sid], patient=True))
        await asyncio.sleep(400)
        result = await ta  # A gives the strategy up once it finds it fenced off
        tb.cancel()
        await asyncio.gather(tb, return_exceptions=True)
        await sim.aclose()
        return result

    with caplog.at_level("WARNING", logger="fleetwave.engine"):
        result = on_virtual_time(main())
    assert result[sid] == "lost"
    assert [c for c in calls if c[1] == "A"] == []  # no recover hook ran under A
    assert {c[2] for c in calls if c[1] == "B" and c[4]} == {"t00000", "t00001", "t00002"}
    assert [e[0] for e in _events(store, "step-taken-over")] == ["B"] * 3
    assert "adopt-fenced-off: strategy 1" in caplog.text
    assert rt.strategy_state(store, sid) == ("applying", "B")
    assert check(store, sid).ok
    store.dispose()


def test_a_store_error_while_adopting_does_not_claim_the_strategy_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """d1b: the adopt's step takeover fails four times (backing off for about 1.5 s):
    the periodic pass meanwhile must not claim the strategy again, so one run and one
    worker per step."""
    clock = LoopClock()
    store, sid = _setup(tmp_path, 2)
    cfg = EngineConfig(lease_ttl_s=60.0, tick_s=1.0, gc_freeze=False)
    calls: list[Call] = []
    sim = SimDriver()
    take_over = rt.take_over_steps
    fails = {"n": 0}

    def flaky(*args: Any, **kwargs: Any) -> Any:
        if fails["n"] < 4:
            fails["n"] += 1
            raise OperationalError("UPDATE", None, Exception("disk I/O error (injected)"))
        return take_over(*args, **kwargs)

    async def main() -> tuple[int, int]:
        await _crashed_with_steps_in_flight(store, sid, cfg, clock)
        monkeypatch.setattr(rt, "take_over_steps", flaky)
        a = Conductor(
            store,
            clock=clock,
            config=cfg,
            drivers={"sim": Spy(sim, "A", calls)},  # type: ignore[dict-item]
            conductor_id="A",
        )
        ta = asyncio.ensure_future(a.run(strategy_ids=[sid], patient=True))
        await asyncio.sleep(120)
        live = sum(1 for t in a._workers if not t.done())
        in_flight = sum(len(r.inflight) for r in a.runs.values())
        ta.cancel()
        await asyncio.gather(ta, return_exceptions=True)
        await sim.aclose()
        return live, in_flight

    live, in_flight = on_virtual_time(main())
    assert fails["n"] == 4
    assert (live, in_flight) == (2, 2)
    claims = [e for e in _events(store, "strategy-claimed") if e[0] == "A"]
    assert claims == [("A", None, "from c0")]  # claimed once, not again from itself
    taken = _events(store, "step-taken-over")
    assert sorted(e[1] or 0 for e in taken) == [1, 2]  # each step taken over once
    recovering = sorted((c[2], c[5]) for c in calls if c[1] == "A" and c[4])
    # each target's recover hook ran in one worker (the sim's observe may call twice)
    assert len({target for target, _ in recovering}) == 2
    assert len({task for _, task in recovering}) == 2
    assert check(store, sid).ok
    store.dispose()
