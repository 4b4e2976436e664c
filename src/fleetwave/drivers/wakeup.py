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
import ctypes
import logging
import os
import sys
import time
import weakref
from collections.abc import Callable

log = logging.getLogger("fleetwave.drivers")

_TFD_TIMER_ABSTIME = 1
#: the timerfd's flags are the file flags' values (they differ between architectures)
_TFD_FLAGS = os.O_NONBLOCK | os.O_CLOEXEC
#: the latest time a timer is armed for (seconds of the monotonic clock: 68 years of
#: uptime, and what a 32-bit ``long`` holds)
_MAX_WHEN_S = 2**31 - 1


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


#: the timerfd calls in os (Python 3.13+); else libc's, through ctypes (looked up once:
#: the timer is set at every wake-up)
_OS_CREATE: Callable[..., int] | None = getattr(os, "timerfd_create", None)
_OS_SETTIME_NS: Callable[..., object] | None = getattr(os, "timerfd_settime_ns", None)
_LIBC = None if _OS_CREATE is not None else _libc()


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
        # the argument of libc's timerfd_settime, made once (it is set at every wake-up)
        self._spec = _ITimerSpec()
        self._spec_ref = ctypes.byref(self._spec)

    @classmethod
    def open(cls) -> PreciseTimer | None:
        """A new timer; None where the system has no timerfd (not Linux), or will not
        give one (out of file descriptors): the caller uses the loop's timers then."""
        try:
            if _OS_CREATE is not None:
                fd = _OS_CREATE(time.CLOCK_MONOTONIC, flags=_TFD_FLAGS)
            elif _LIBC is not None:
                fd = _LIBC.timerfd_create(time.CLOCK_MONOTONIC, _TFD_FLAGS)
                if fd < 0:
                    err = ctypes.get_errno()
                    raise OSError(err, os.strerror(err))
            else:
                return None
        except OSError as exc:
            log.debug("no timerfd (%s): the loop's own timers are used", exc)
            return None
        return cls(fd)

    def attach(self, loop: asyncio.AbstractEventLoop, fired: Callable[[], None]) -> None:
        """Watch the timer on ``loop`` (instead of the loop it was attached to before,
        if that one is still open); ``fired`` runs on the loop when the timer goes off."""
        self._check_open()
        old = self._loop
        if old is not None and old is not loop and not old.is_closed():
            old.remove_reader(self._fd)
        self._loop = loop
        self.disarm()
        loop.add_reader(self._fd, fired)

    def arm(self, when: float) -> None:
        """Go off at ``when`` (monotonic seconds); at once if that has passed."""
        if when != when:
            raise ValueError("timer: the time to go off at is not a number")
        # 0 would disarm the timer: a time in the past fires at once instead
        self._set(max(round(min(when, _MAX_WHEN_S) * 1e9), 1))

    def disarm(self) -> None:
        """Stop it; if it went off meanwhile, that is forgotten too, as by any new
        setting (it no longer reads as ready: the loop does not call back for it)."""
        self._set(0)

    def close(self) -> None:
        """Stop watching it and close its descriptor (again: nothing more)."""
        if self._fd < 0:
            return
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(self._fd)
        self._loop = None
        self._fd = -1
        self._closer()

    def _check_open(self) -> None:
        # (its number may belong to another file by now)
        if self._fd < 0:
            raise ValueError("timer: used after it was closed")

    def _set(self, ns: int) -> None:
        """Set it to go off at ``ns`` (monotonic nanoseconds; 0: not at all). A new
        setting also forgets that it went off (it no longer reads as ready)."""
        self._check_open()
        if _OS_SETTIME_NS is not None:
            _OS_SETTIME_NS(self._fd, flags=_TFD_TIMER_ABSTIME, initial=ns)
            return
        assert _LIBC is not None
        value = self._spec.it_value
        value.tv_sec, value.tv_nsec = divmod(ns, 1_000_000_000)
        if _LIBC.timerfd_settime(self._fd, _TFD_TIMER_ABSTIME, self._spec_ref, None) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"timerfd_settime: {os.strerror(err)}")
