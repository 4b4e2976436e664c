"""Running a conductor's event loop: uvloop where it is installed, else asyncio's own.

uvloop runs the same asyncio code with its loop machinery (timers, ready queue,
sockets) in C. A conductor spends much of its time there (one timer and a few
wake-ups per action), so on Linux and macOS it is the default.
``FLEETWAVE_LOOP=asyncio`` chooses the standard loop; ``uvloop`` requires uvloop.
"""

from __future__ import annotations

import asyncio
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


def run(main: Coroutine[Any, Any, T]) -> T:
    """Run ``main`` to completion on a new loop of the kind :func:`loop_kind` picks."""
    try:
        kind = loop_kind()
    except LoopChoiceError:
        main.close()
        raise
    if kind == "uvloop":
        import uvloop

        return uvloop.run(main)
    return asyncio.run(main)
