"""Running a conductor's event loop: uvloop where it is installed, else asyncio's own.

uvloop runs the same asyncio code with its loop machinery (timers, ready queue,
sockets) in C. A conductor spends much of its time there (one timer and a few
wake-ups per action), so on Linux and macOS it is the default.
``FLEETWAVE_LOOP=asyncio`` chooses the standard loop; ``uvloop`` requires uvloop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")

LOOP_ENV = "FLEETWAVE_LOOP"
LOOP_CHOICES = ("auto", "uvloop", "asyncio")


class LoopChoiceError(ValueError):
    pass


def loop_kind() -> str:
    """The loop :func:`run` uses: ``uvloop`` or ``asyncio``."""
    choice = os.environ.get(LOOP_ENV, "auto").strip().lower() or "auto"
    if choice not in LOOP_CHOICES:
        raise LoopChoiceError(
            f"{LOOP_ENV}: unknown event loop '{choice}' (choose one of {', '.join(LOOP_CHOICES)})"
        )
    if choice == "asyncio":
        return "asyncio"
    try:
        import uvloop  # noqa: F401
    except ImportError:
        if choice == "uvloop":
            raise LoopChoiceError(f"{LOOP_ENV}=uvloop: uvloop is not installed") from None
        return "asyncio"
    return "uvloop"


#: how long tasks left over when ``main`` ends get to finish once cancelled
LEFTOVER_GRACE_S = 2.0


def run(main: Coroutine[Any, Any, T]) -> T:
    """Run ``main`` to completion on a new loop of the kind :func:`loop_kind` picks.

    As ``asyncio.run``, except at the end: a task left over that does not end when
    cancelled (an action that catches ``CancelledError``) is given
    :data:`LEFTOVER_GRACE_S`, then left behind, the loop closed under it;
    ``asyncio.run`` waited for it for good, so a ``serve`` that had stopped never
    exited.
    """
    try:
        kind = loop_kind()
    except LoopChoiceError:
        main.close()
        raise
    factory = None
    if kind == "uvloop":
        import uvloop

        factory = uvloop.new_event_loop
    runner = asyncio.Runner(loop_factory=factory)
    try:
        return runner.run(main)
    finally:
        try:
            stuck = _end_leftovers(runner.get_loop())
        except BaseException:
            stuck = False
            raise
        finally:
            if stuck:
                # The runner's own close would wait for them for good: the loop is closed
                # under them instead (Python may warn that a task was destroyed pending).
                loop = runner.get_loop()
                with contextlib.suppress(Exception):
                    loop.run_until_complete(loop.shutdown_asyncgens())
                loop.close()
            else:
                runner.close()


#: tasks left running under a closed loop: kept, so that they are not finalized (their
#: coroutine closed) while the process goes on
_ABANDONED: list[asyncio.Task[Any]] = []


def _end_leftovers(loop: asyncio.AbstractEventLoop) -> bool:
    """Cancel the tasks left over and give them :data:`LEFTOVER_GRACE_S`; whether some
    will not end (they catch the cancel). Their coroutines are not closed here: one
    that catches everything would spin for good where no loop runs."""
    left = [t for t in asyncio.all_tasks(loop) if not t.done()]
    if not left:
        return False
    for task in left:
        task.cancel()
    loop.run_until_complete(asyncio.wait(left, timeout=LEFTOVER_GRACE_S))
    stuck = [t for t in left if not t.done()]
    if not stuck:
        return False
    _ABANDONED.extend(stuck)
    logging.getLogger("fleetwave.engine").error(
        "%d task(s) did not end when cancelled (an action catches CancelledError): left "
        "behind after %gs, the loop closed under them",
        len(stuck),
        LEFTOVER_GRACE_S,
    )
    return True


async def wait_set(event: asyncio.Event, timeout_s: float) -> bool:
    """Wait until ``event`` is set, for ``timeout_s`` at most; whether it is set.

    Not ``asyncio.wait_for``: on Python 3.11 it loses a cancel that comes as the event is
    set (it returns instead of raising), so a task cancelled in a loop of such waits
    (a conductor's periodic pass, woken by every NOTIFY) never ends, and whoever awaits
    it hangs. ``asyncio.timeout`` keeps the cancel.
    """
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(timeout_s):
            await event.wait()
    return event.is_set()
