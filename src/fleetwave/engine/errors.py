"""What a conductor raises to whoever runs it.

:class:`StoreReplaced` and :class:`StoreUnavailable` end :meth:`Conductor.run` (the
database file was replaced; a stop came during an outage); :class:`SimulatedCrash`
is a fault plan's, to kill a conductor at a chosen point in tests.
"""

from __future__ import annotations


class StoreReplaced(Exception):
    """The database file was removed or replaced while this conductor had it open: its
    writes would go to the old file, unseen by anyone. It stops. ``advice``: what the
    operator does next."""

    def __init__(self, message: str, advice: str) -> None:
        super().__init__(message)
        self.advice = advice


class StoreUnavailable(Exception):
    """The conductor was asked to stop while the database did not answer: it stopped
    without handing its leases back (they run out, and another conductor takes over)."""


class SimulatedCrash(BaseException):
    """Raised by a fault plan to kill the conductor at a chosen point (tests only)."""
