"""Where the engine gets the time.

Three clocks, each for one use:

- durations (timeouts, backoff, lease renewal) run on the asyncio loop's clock, so a
  loop with virtual time (``fleetwave.testing.vloop``) runs an hour of fleet time in a
  second;
- :meth:`Clock.now` stamps records (the journal, events): wall time, which may step
  (NTP, a VM resumed) and differ between hosts; nothing is decided by it;
- :meth:`Clock.lease_now` is the clock leases are written and compared on, which
  every conductor sharing the database reads alike and which never steps. On SQLite
  every conductor runs on the database's host (WAL needs shared memory), so it is that
  host's boot-time clock (``CLOCK_BOOTTIME``: monotonic, counts a suspend), named by
  the boot id (:attr:`Clock.lease_clock`): a lease written under another boot is held
  by nobody. With a database server, the server's clock.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Protocol

from fleetwave.store.leases import HOST_CLOCK, SERVER_CLOCK, host_lease_now


class Clock(Protocol):
    #: the name of the clock :meth:`lease_now` reads: leases written on another are
    #: not compared with it (their writer is from another boot, or another host)
    lease_clock: str

    def now(self) -> float:
        """Seconds since the epoch, for records (may step; decides nothing)."""
        ...

    def lease_now(self) -> float:
        """Seconds on the lease clock, shared by every conductor of the database."""
        ...


class WallClock:
    """Production time: wall time for records, the host's boot-time clock for leases."""

    lease_clock = HOST_CLOCK[0]

    def now(self) -> float:
        return time.time()

    def lease_now(self) -> float:
        return host_lease_now()


class ServerClock(WallClock):
    """Wall time for records; a database server's clock for leases (PostgreSQL, whose
    conductors run on many hosts): read at each renewal (:meth:`sync`), advanced by
    this host's boot-time clock in between, so it never steps back and a reading costs
    no round trip."""

    lease_clock = SERVER_CLOCK

    def __init__(self, read_server: Callable[[], float]) -> None:
        self._read_server = read_server
        self._offset: float | None = None

    def lease_now(self) -> float:
        if self._offset is None:
            self.sync()
        assert self._offset is not None
        return host_lease_now() + self._offset

    def sync(self) -> None:
        """Read the server's clock again (a store call: run it through the retries)."""
        offset = self._read_server() - host_lease_now()
        # (forward only: the lease clock never goes back within this process)
        self._offset = offset if self._offset is None else max(self._offset, offset)


class LoopClock:
    """Epoch time that follows the running loop's clock (virtual or real).

    ``offset_s`` and ``drift`` make a skewed wall clock (a host whose NTP is off, or
    stepped: change ``offset_s``); its leases still read the loop's clock, the one
    every conductor on it shares, as a host's boot-time clock is shared.
    """

    lease_clock = "loop"

    def __init__(
        self, epoch: float = 1_800_000_000.0, *, offset_s: float = 0.0, drift: float = 0.0
    ) -> None:
        self.epoch = epoch
        self.offset_s = offset_s
        self.drift = drift

    def now(self) -> float:
        t = asyncio.get_running_loop().time()
        return self.epoch + self.offset_s + t * (1.0 + self.drift)

    def lease_now(self) -> float:
        return asyncio.get_running_loop().time()
