"""An asyncio event loop on virtual time: hours of fleet time pass in seconds.

The loop's clock only moves when nothing is ready to run: then it jumps straight
to the next timer. Everything that uses the loop's clock (``asyncio.sleep``,
``asyncio.timeout``, :class:`fleetwave.engine.clock.LoopClock`) runs on it
unchanged, so the real engine runs here, deterministically: same inputs, same
order of events, same journal.

Real file descriptors still work (they are polled without waiting), but nothing
may wait on a thread: the engine runs its store calls inline on the loop.

    loop = VirtualTimeLoop()
    try:
        loop.run_until_complete(main())
    finally:
        loop.close()
"""

from __future__ import annotations

import asyncio
import selectors


class Deadlock(RuntimeError):
    """Nothing is ready, no timer is set, and the main coroutine has not finished."""


class Livelock(RuntimeError):
    """The loop keeps itself busy without ever letting virtual time move on."""


#: loop iterations in a row without time moving on before it counts as a livelock
SPIN_LIMIT = 500_000


class _JumpingSelector(selectors.DefaultSelector):
    def __init__(self, loop: VirtualTimeLoop) -> None:
        super().__init__()
        self._vloop = loop
        self._spins = 0

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        ready = super().select(0)
        if ready:
            return ready
        if timeout is None:
            raise Deadlock("virtual time loop: nothing to run and no timer set")
        if timeout > 0:
            self._vloop.advance(timeout)
            self._spins = 0
        else:
            self._spins += 1
            if self._spins > SPIN_LIMIT:
                raise Livelock(
                    f"virtual time loop: {SPIN_LIMIT} iterations at t={self._vloop.time():.3f}s "
                    "without time moving on (something wakes itself forever)"
                )
        return []


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    #: what runs on it must not wait on a thread (the engine runs every store call
    #: inline on such a loop)
    virtual_time = True

    def __init__(self, start: float = 0.0) -> None:
        self._virtual_now = start
        super().__init__(selector=_JumpingSelector(self))
        # A timer is due when its time is within the clock's resolution of now. The real
        # clock's (1 ns) vanishes in float rounding once months of virtual time pass, and
        # a due timer would then never fire; 1 us keeps it meaningful for years.
        self._clock_resolution = 1e-6

    def time(self) -> float:
        return self._virtual_now

    def advance(self, seconds: float) -> None:
        self._virtual_now += seconds
