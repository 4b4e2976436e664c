"""A task waiting in a loop for an event or a timeout ends when cancelled, even if the
event is set at the same moment (``asyncio.wait_for`` on Python 3.11 loses that cancel:
a conductor's periodic pass, woken by every NOTIFY, then never ended and its stop hung)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest

from fleetwave.engine.loop import wait_set


async def _wait_for(event: asyncio.Event, timeout_s: float) -> bool:
    try:
        await asyncio.wait_for(event.wait(), timeout_s)
    except TimeoutError:
        return False
    return True


async def _cancel_as_it_is_set(
    wait: Callable[[asyncio.Event, float], Awaitable[bool]], times: int
) -> int:
    """Cancel a waiting loop right as its event is set, ``times`` times; how often it
    ended."""
    ended = 0
    for _ in range(times):
        event = asyncio.Event()

        async def looping(ev: asyncio.Event = event) -> None:
            while True:
                await wait(ev, 10.0)
                ev.clear()

        task = asyncio.create_task(looping())
        for _ in range(3):
            await asyncio.sleep(0)  # (it waits now)
        event.set()
        await asyncio.sleep(0)  # the event's waiter wakes; the outer wait has not yet
        task.cancel()
        done, _ = await asyncio.wait([task], timeout=0.2)
        if done:
            ended += 1
        else:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    return ended


def test_a_cancel_that_comes_as_the_event_is_set_ends_the_wait() -> None:
    assert asyncio.run(_cancel_as_it_is_set(wait_set, 50)) == 50


def test_the_timeout_and_the_event_are_told_apart() -> None:
    async def main() -> tuple[bool, bool]:
        ev = asyncio.Event()
        timed_out = await wait_set(ev, 0.01)
        ev.set()
        return timed_out, await wait_set(ev, 10.0)

    assert asyncio.run(main()) == (False, True)


@pytest.mark.skipif(
    not hasattr(asyncio, "timeout") or __import__("sys").version_info >= (3, 12),
    reason="the defect is Python 3.11's wait_for",
)
def test_wait_for_on_this_python_loses_such_a_cancel() -> None:
    """(Why wait_set exists: if this starts failing, Python no longer has the defect.)"""
    assert asyncio.run(_cancel_as_it_is_set(_wait_for, 5)) < 5
