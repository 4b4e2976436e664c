"""The sim driver's own machinery: shared latency timer and settings profiles."""

from __future__ import annotations

import asyncio

from hypothesis import given, settings
from hypothesis import strategies as st

from fleetwave.domain.models import Target
from fleetwave.drivers.sim import SimDriver, _Sleeps


@settings(max_examples=40, deadline=None)
@given(delays=st.lists(st.integers(0, 30), min_size=1, max_size=40), cancel=st.data())
def test_shared_timer_wakes_each_sleeper_at_its_time_in_order(
    delays: list[int], cancel: st.DataObject
) -> None:
    """Sleeps of any mix of delays wake no earlier than asked, in due order; cancelling
    one leaves the others be."""
    sleeps = _Sleeps()
    cancelled = cancel.draw(st.sets(st.integers(0, len(delays) - 1), max_size=3))
    woke: list[tuple[int, float, float]] = []

    async def one(i: int, ms: int) -> None:
        loop = asyncio.get_running_loop()
        start = loop.time()
        await sleeps.sleep(ms / 1000)
        woke.append((i, start + ms / 1000, loop.time()))

    async def main() -> None:
        tasks = [asyncio.create_task(one(i, ms)) for i, ms in enumerate(delays)]
        await asyncio.sleep(0)
        for i in cancelled:
            tasks[i].cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    asyncio.run(main())  # the standard loop: its timers never fire early
    assert sorted(i for i, _, _ in woke) == sorted(set(range(len(delays))) - cancelled)
    assert all(at >= due for _, due, at in woke)
    dues = [due for _, due, _ in woke]
    assert dues == sorted(dues)


def test_shared_timer_survives_a_new_event_loop() -> None:
    """A driver outlives a loop (tests run several): sleeping on the next one works."""
    sleeps = _Sleeps()

    async def pending_forever() -> None:
        sleeps.sleep(0.001)  # abandoned with its loop, before it is due

    asyncio.run(pending_forever())

    async def short() -> float:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        await asyncio.wait_for(sleeps.sleep(0.01), 2.0)  # a timer left on the old loop: never
        return loop.time() - t0

    assert 0.01 <= asyncio.run(short()) < 1.0


def test_profiles_are_shared_by_settings_not_kept_per_target() -> None:
    sim = SimDriver()
    shared = {"latency_ms": 5}
    a = sim._profile(Target(name="a", settings=shared))
    b = sim._profile(Target(name="b", settings=shared))
    c = sim._profile(Target(name="c", settings={"latency_ms": 5}))  # equal, not the same
    d = sim._profile(Target(name="d", settings={"latency_ms": 7}))
    assert a is b is c and d is not a
    assert d.latency_s == 0.007 and a.latency_s == 0.005
    assert len(sim._by_settings) == 2  # one per combination, nothing per target
