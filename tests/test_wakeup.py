"""The precise wake-up the sim's latencies use (a timerfd the loop watches), and the
sim's sleeps on it: on the real loops they end when due by the monotonic clock, not on
the loop's millisecond ticks; on a virtual-time loop they keep to the loop's timers."""

from __future__ import annotations

import asyncio
import gc
import math
import os
import sys
import time
from collections.abc import Callable, Coroutine
from typing import Any

import pytest
import uvloop

from fleetwave.domain.models import Target
from fleetwave.domain.workflow import ActionContext
from fleetwave.drivers.sim import SimDriver, _Sleeps
from fleetwave.drivers.wakeup import PreciseTimer, on_monotonic_clock
from fleetwave.testing.vloop import VirtualTimeLoop

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a timerfd is Linux's")

LOOPS: dict[str, Callable[[], asyncio.AbstractEventLoop]] = {
    "asyncio": asyncio.new_event_loop,
    "uvloop": uvloop.new_event_loop,
}


def _run(make: Callable[[], asyncio.AbstractEventLoop], main: Coroutine[Any, Any, Any]) -> Any:
    loop = make()
    try:
        return loop.run_until_complete(main)
    finally:
        loop.close()


def _opened() -> PreciseTimer:
    timer = PreciseTimer.open()
    assert timer is not None, "Linux has timerfd"
    return timer


@pytest.mark.parametrize("kind", LOOPS)
def test_the_real_loops_are_on_the_monotonic_clock_a_virtual_one_is_not(kind: str) -> None:
    loop = LOOPS[kind]()
    try:
        assert on_monotonic_clock(loop)
        assert abs(loop.time() - time.monotonic()) < 0.01
    finally:
        loop.close()
    virtual = VirtualTimeLoop()
    try:
        assert not on_monotonic_clock(virtual)
    finally:
        virtual.close()


@pytest.mark.parametrize("kind", LOOPS)
def test_an_armed_timer_goes_off_not_before_its_time_and_once(kind: str) -> None:
    timer = _opened()
    fired: list[float] = []

    async def main() -> None:
        loop = asyncio.get_running_loop()

        def went_off() -> None:
            timer.disarm()  # taken in: it no longer reads as ready
            fired.append(time.monotonic())

        timer.attach(loop, went_off)
        due = time.monotonic() + 0.015
        timer.arm(due)
        await asyncio.sleep(0.1)
        assert len(fired) == 1, "one expiry, taken in once: called back once"
        assert fired[0] >= due

    try:
        _run(LOOPS[kind], main())
    finally:
        timer.close()


def test_a_time_already_past_goes_off_at_once_and_disarm_stops_it() -> None:
    timer = _opened()
    fired: list[str] = []

    async def main() -> None:
        loop = asyncio.get_running_loop()

        def went_off() -> None:
            timer.disarm()  # taken in: it no longer reads as ready
            fired.append("off")

        timer.attach(loop, went_off)
        timer.arm(time.monotonic() - 5.0)  # the past: not 0, which would disarm it
        await asyncio.sleep(0.02)
        assert fired == ["off"]
        timer.arm(time.monotonic() + 0.02)
        timer.disarm()
        await asyncio.sleep(0.06)
        assert fired == ["off"], "a disarmed timer stays quiet"

    try:
        _run(uvloop.new_event_loop, main())
    finally:
        timer.close()


def test_a_timer_moves_to_a_new_loop_and_its_descriptor_is_closed_with_it() -> None:
    timer = _opened()
    fd = timer._fd
    fired: list[int] = []

    async def on(n: int, arm: bool) -> None:
        def went_off() -> None:
            timer.disarm()  # taken in: it no longer reads as ready
            fired.append(n)

        timer.attach(asyncio.get_running_loop(), went_off)
        if arm:
            timer.arm(time.monotonic() + 0.005)
        await asyncio.sleep(0.05)

    _run(asyncio.new_event_loop, on(1, arm=False))  # a loop closed with the timer on it
    _run(uvloop.new_event_loop, on(2, arm=True))
    assert fired == [2]
    timer.close()
    with pytest.raises(OSError):
        os.fstat(fd)


@pytest.mark.parametrize("kind", LOOPS)
def test_sim_sleeps_on_a_real_loop_end_when_due_by_the_monotonic_clock(kind: str) -> None:
    """Each sleeper wakes no earlier than its own due time, in due order, however close
    together they started: not several at once on a millisecond tick."""
    sleeps = _Sleeps()
    woke: list[tuple[float, float]] = []

    async def one(delay: float) -> None:
        fut = sleeps.sleep(delay)
        due = next(when for when, _, f in sleeps._heap if f is fut)  # its own due time
        await fut
        woke.append((due, time.monotonic()))

    async def main() -> None:
        tasks = []
        for i in range(30):
            tasks.append(asyncio.create_task(one(0.01 + i * 0.0004)))
            await asyncio.sleep(0)
        # one is cancelled: it stays in the heap until due, and harms no one
        doomed = asyncio.create_task(one(0.012))
        await asyncio.sleep(0)
        doomed.cancel()
        await asyncio.gather(*tasks)
        assert sleeps._on_precise
        # the heap emptied: a new sleep arms the timer again
        await one(0.005)

    _run(LOOPS[kind], main())
    assert len(woke) == 31
    assert all(at >= due for due, at in woke)
    assert [at for _, at in woke] == sorted(at for _, at in woke)


def test_sim_sleeps_on_virtual_time_keep_to_the_loops_timers() -> None:
    """An hour of virtual time passes at once: the precise timer (real time) is not
    used there."""
    sleeps = _Sleeps()

    async def main() -> tuple[float, float]:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        await sleeps.sleep(3600.0)
        return t0, loop.time()

    started = time.monotonic()
    t0, t1 = _run(VirtualTimeLoop, main())
    assert t1 - t0 >= 3600.0
    assert time.monotonic() - started < 5.0
    assert not sleeps._on_precise


def test_sim_sleeps_go_from_a_real_loop_to_a_virtual_one_and_back() -> None:
    sleeps = _Sleeps()

    async def nap(delay: float) -> None:
        await sleeps.sleep(delay)

    _run(uvloop.new_event_loop, nap(0.002))
    assert sleeps._on_precise
    _run(VirtualTimeLoop, nap(60.0))
    assert not sleeps._on_precise
    _run(asyncio.new_event_loop, nap(0.002))
    assert sleeps._on_precise


def test_a_closed_timer_refuses_to_be_used_and_nonsense_times_are_refused_or_bounded() -> None:
    timer = _opened()
    with pytest.raises(ValueError, match="not a number"):
        timer.arm(math.nan)

    async def far() -> None:
        fired: list[int] = []
        timer.attach(asyncio.get_running_loop(), lambda: fired.append(1))
        timer.arm(1e30)  # bounded (a day's latency is the most the sim asks), not wrapped
        await asyncio.sleep(0.02)
        assert fired == [], "armed for the far future, not wrapped into the past"

    _run(uvloop.new_event_loop, far())
    timer.close()
    timer.close()  # again: nothing
    for use in (lambda: timer.arm(time.monotonic() + 1), timer.disarm):
        with pytest.raises(ValueError, match="after it was closed"):
            use()
    sleeps = _Sleeps()

    async def nan() -> None:
        with pytest.raises(ValueError, match="not a number"):
            sleeps.sleep(math.nan)
        assert sleeps._heap == []
        await sleeps.sleep(0.001)  # the timer is fine after it

    _run(uvloop.new_event_loop, nan())


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_drivers_dropped_while_their_loop_lives_take_their_timers_with_them() -> None:
    """A conductor made per takeover makes a sim driver each time, on the same loop:
    each one's timer (a file descriptor) goes with the driver, not with the loop."""

    async def main() -> None:
        gc.collect()
        before = _fds()
        for i in range(50):
            driver = SimDriver()
            await driver._sleeps.sleep(0.0001)
            assert driver._sleeps._on_precise, i
            del driver
        gc.collect()
        await asyncio.sleep(0.01)  # a reader of a closed descriptor would now misfire
        assert _fds() <= before + 1

    _run(uvloop.new_event_loop, main())


@pytest.mark.parametrize("kind", LOOPS)
def test_a_plain_run_whose_caller_is_lost_ends_no_sooner_than_its_latency(kind: str) -> None:
    """A plain operation (fixed latency) runs in its caller's task; cancelled mid-way,
    the rest of it runs on by itself: for what is left by the clock its sleep keeps (on
    uvloop the loop's clock is floored to the millisecond: it ended up to a millisecond
    early)."""

    async def one(i: int) -> float | None:
        driver = SimDriver()
        target = Target(name=f"t{i}", settings={"latency_ms": 20})
        ctx = ActionContext(
            target=target, state="apply", attempt=1, strategy_id=1, step_id=1, driver=driver
        )
        ended: list[float] = []
        ran = driver._ran

        def spy(*args: Any) -> None:
            ended.append(time.monotonic())
            ran(*args)

        driver._ran = spy  # type: ignore[method-assign]
        await asyncio.sleep(0)
        start = time.monotonic()
        task = asyncio.ensure_future(driver.perform(target, "apply", ctx))
        await asyncio.sleep(0.008)
        if not task.cancel():
            return None  # (a loaded machine: it ended before its caller was lost)
        with pytest.raises(asyncio.CancelledError):
            await task
        while not ended:
            await asyncio.sleep(0.001)
        return ended[0] - start

    async def main() -> list[float]:
        took: list[float] = []
        for i in range(300):
            one_took = await one(i)
            if one_took is not None:
                took.append(one_took)
            if len(took) == 30:
                break
        return took

    took = _run(LOOPS[kind], main())
    assert len(took) >= 10, f"only {len(took)} of 300 runs were cancelled mid-way"
    assert min(took) >= 0.020, sorted(took)[:3]
