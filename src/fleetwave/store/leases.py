"""The clock leases are written and compared on, as this host reads it.

A lease (a strategy's, a step's) is stored as an expiry on its conductor's lease
clock, and the conductor's row names that clock (``conductors.lease_clock``). On
SQLite every conductor runs on the database's host, so the clock is the host's
boot-time clock (monotonic, never stepped by NTP, counts a suspend), named by the
host and its boot id: a lease written under another boot is held by nobody (its
writer is gone with that boot). See ``fleetwave.engine.clock`` for the engine's side.

With a database server (PostgreSQL) conductors run on many hosts: leases are on the
server's clock (``fleetwave.engine.clock.ServerClock``: read at each renewal,
advanced by this host's boot-time clock in between), named ``server``.

:func:`reader` is how the commands that show leases (``strategy show``, ``step
show``) read that clock: the host's, or the server's, unless :data:`READER` is set
(a conductor sets its own for its tasks; a test on virtual time sets the loop's).
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from contextvars import ContextVar
from typing import Any

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

#: the lease clock the commands that show leases read, when set (a conductor's tasks
#: read its own; a test on virtual time sets the one its conductors use)
READER: ContextVar[tuple[str, Callable[[], float]] | None] = ContextVar(
    "fleetwave_lease_reader", default=None
)

#: the name of a database server's clock, as a lease clock
SERVER_CLOCK = "server"


def reader(conn: Any) -> tuple[str, Callable[[], float]]:
    """The lease clock to read leases with, on connection ``conn`` (its dialect's)."""
    chosen = READER.get()
    if chosen is not None:
        return chosen
    if conn.dialect.name == "postgresql":
        now = float(conn.exec_driver_sql(f"SELECT {SERVER_NOW_SQL}").scalar_one())
        return SERVER_CLOCK, lambda: now
    return HOST_CLOCK


#: the server's clock, in seconds (PostgreSQL)
SERVER_NOW_SQL = "extract(epoch from clock_timestamp())"
