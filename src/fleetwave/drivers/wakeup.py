"""A wake-up at a precise time for the event loop: a Linux timerfd the loop watches.

The loop's own timers have a millisecond grain (uvloop's count whole milliseconds of
a floored clock; asyncio's rounds its poll's timeout up to one): what comes due
within one tick wakes together, about half a tick late. A real target's reply wakes
the loop the moment it arrives (its socket becomes readable). The simulated fleet's
latencies use this to end when they are due, as replies do, not in cohorts lined up
on the loop's ticks (which made every step of a cohort wait for all of them).

    timer = PreciseTimer.open()          # None where there is no timerfd
    if timer is not None and on_monotonic_clock(loop):
        timer.attach(loop, fired)        # ``fired`` runs on the loop when it goes off
        timer.arm(time.monotonic() + 0.02)

Linux only: a timerfd through :mod:`os` (Python 3.13+) or libc (ctypes). Elsewhere,
and on a loop whose clock is not the monotonic clock (a virtual-time loop in tests),
callers use the loop's own timers.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import sys
import time
import weakref
from collections.abc import Callable

_CLOCK_MONOTONIC = 1
_TFD_TIMER_ABSTIME = 1
_TFD_NONBLOCK = 0o4000
_TFD_CLOEXEC = 0o2000000


class _TimeSpec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class _ITimerSpec(ctypes.Structure):
    _fields_ = [("it_interval", _TimeSpec), ("it_value", _TimeSpec)]


def _libc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.timerfd_create.argtypes = [ctypes.c_int, ctypes.c_int]
        libc.timerfd_settime.argtypes = [
            ctypes.c_int,
            ctypes.c_int,
            ctypes.POINTER(_ITimerSpec),
            ctypes.c_void_p,
        ]
    except (OSError, AttributeError):
        return None
    return libc


_LIBC = None if hasattr(os, "timerfd_create") else _libc()


def on_monotonic_clock(loop: asyncio.AbstractEventLoop) -> bool:
    """Whether ``loop.time()`` is the monotonic clock (:func:`time.monotonic`): the
    standard loop's and uvloop's are; a loop on virtual time is not."""
    kind = type(loop)
    if isinstance(loop, asyncio.BaseEventLoop):
        return kind.time is asyncio.BaseEventLoop.time
    uvloop = sys.modules.get("uvloop")
    return uvloop is not None and kind.time is uvloop.Loop.time


class PreciseTimer:
    """One timerfd: :meth:`arm` it for a time on the monotonic clock, and the loop it is
    attached to calls back when that time comes. One loop at a time."""

    def __init__(self, fd: int) -> None:
        self._fd = fd
        #: the process that made it: a child forked from it shares the timer itself
        self.pid = os.getpid()
        self._loop: asyncio.AbstractEventLoop | None = None
        # the descriptor is the process's: closed with the timer, not left to the exit
        self._closer = weakref.finalize(self, os.close, fd)

    @classmethod
    def open(cls) -> PreciseTimer | None:
        """A new timer; None where the system has no timerfd (not Linux)."""
        flags = _TFD_NONBLOCK | _TFD_CLOEXEC
        try:
            if hasattr(os, "timerfd_create"):
                fd = os.timerfd_create(time.CLOCK_MONOTONIC, flags=flags)
            elif _LIBC is not None:
                fd = _LIBC.timerfd_create(_CLOCK_MONOTONIC, flags)
                if fd < 0:
                    return None
            else:
                return None
        except OSError:
            return None
        return cls(fd)

    def attach(self, loop: asyncio.AbstractEventLoop, fired: Callable[[], None]) -> None:
        """Watch the timer on ``loop`` (instead of the loop it was attached to before,
        if that one is still open); ``fired`` runs on the loop when the timer goes off."""
        old = self._loop
        if old is not None and old is not loop and not old.is_closed():
            old.remove_reader(self._fd)
        self._loop = loop
        self.disarm()
        loop.add_reader(self._fd, fired)

    def arm(self, when: float) -> None:
        """Go off at ``when`` (monotonic seconds); at once if that has passed."""
        # 0 would disarm the timer: a time in the past fires at once instead
        when = max(when, 1e-9)
        self._set(int(when), round((when - int(when)) * 1e9))

    def disarm(self) -> None:
        self._set(0, 0)
        self.clear()

    def clear(self) -> None:
        """Take in that the timer went off (the loop would call back again until then)."""
        with contextlib.suppress(BlockingIOError):
            os.read(self._fd, 8)

    def close(self) -> None:
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(self._fd)
        self._loop = None
        self._closer()

    def _set(self, sec: int, nsec: int) -> None:
        if nsec >= 1_000_000_000:
            sec, nsec = sec + 1, nsec - 1_000_000_000
        if hasattr(os, "timerfd_settime_ns"):
            os.timerfd_settime_ns(
                self._fd, flags=_TFD_TIMER_ABSTIME, initial=sec * 1_000_000_000 + nsec
            )
            return
        assert _LIBC is not None
        spec = _ITimerSpec(_TimeSpec(0, 0), _TimeSpec(sec, nsec))
        if _LIBC.timerfd_settime(self._fd, _TFD_TIMER_ABSTIME, ctypes.byref(spec), None) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"timerfd_settime: {os.strerror(err)}")
