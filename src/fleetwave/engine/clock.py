"""Where the engine gets the time.

Durations (timeouts, backoff, lease renewal) run on the asyncio loop's clock, so
a loop with virtual time (``fleetwave.testing.vloop``) runs an hour of fleet time
in a second. Wall-clock stamps for records come from :meth:`Clock.now`.
"""

from __future__ import annotations

import asyncio
import time
from typing import Protocol


class Clock(Protocol):
    def now(self) -> float:
        """Seconds since the epoch, for records and leases."""
        ...


class WallClock:
    def now(self) -> float:
        return time.time()


class LoopClock:
    """Epoch time that follows the running loop's clock (virtual or real)."""

    def __init__(self, epoch: float = 1_800_000_000.0) -> None:
        self.epoch = epoch

    def now(self) -> float:
        return self.epoch + asyncio.get_running_loop().time()
