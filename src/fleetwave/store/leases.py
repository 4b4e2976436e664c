"""The clock leases are written and compared on, as this host reads it.

A lease (a strategy's, a step's) is stored as an expiry on its conductor's lease
clock, and the conductor's row names that clock (``conductors.lease_clock``). On
SQLite every conductor runs on the database's host, so the clock is the host's
boot-time clock (monotonic, never stepped by NTP, counts a suspend), named by the
host and its boot id: a lease written under another boot is held by nobody (its
writer is gone with that boot). See ``fleetwave.engine.clock`` for the engine's side.

:data:`READER` is how the commands that show leases (``strategy show``, ``step
show``) read that clock: the host's, unless a test on virtual time sets another.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from contextvars import ContextVar

_BOOTTIME = getattr(time, "CLOCK_BOOTTIME", time.CLOCK_MONOTONIC)


def host_boot_id() -> str:
    """This boot of this host: the host name and the kernel's boot id."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        # (no /proc: the monotonic clock starts anew with each boot, which the boot's
        # start, to the second, stands for)
        boot = f"start-{int(time.time() - time.clock_gettime(_BOOTTIME))}"
    return f"{socket.gethostname()}/boot:{boot}"


def host_lease_now() -> float:
    """The host's boot-time clock, in seconds."""
    return time.clock_gettime(_BOOTTIME)


#: this host's lease clock: its name and how to read it
HOST_CLOCK: tuple[str, Callable[[], float]] = (host_boot_id(), host_lease_now)

#: the lease clock the commands that show leases read (a test on virtual time sets
#: the one its conductors use)
READER: ContextVar[tuple[str, Callable[[], float]]] = ContextVar(
    "fleetwave_lease_reader", default=HOST_CLOCK
)
