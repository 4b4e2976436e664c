"""The ``fleetwave`` console script: a light first step.

Importing the command line (Typer, Rich, SQLAlchemy, the engine) takes most of a
second, before any of its own signal handling exists: a Ctrl-C then printed a
traceback, and a SIGTERM ended the process without a word. Here the imports run under
handlers that end it with one line, exit 130, and nothing done (no command has
started). Then SIGTERM and SIGHUP stop a command as Ctrl-C does (its transaction
rolled back, "error: interrupted", exit 130, as the README's exit codes say); the
commands that drive strategies put their own handlers in place of these.
"""

from __future__ import annotations

import signal
import sys
from types import FrameType

#: what an interruption exits with (128 + SIGINT), as the README's table says
INTERRUPTED = 130


class _Stopped(BaseException):
    """A stop signal arrived while the command line was being imported."""


def _stop(signum: int, _frame: FrameType | None) -> None:
    raise _Stopped(signum)


def _interrupt(_signum: int, _frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def run() -> None:
    # SIGHUP is not on every platform; a signal ignored by who started the command (a
    # background job's SIGINT, nohup's SIGHUP) stays ignored
    names = ("SIGINT", "SIGTERM", "SIGHUP")
    stops = [getattr(signal, name) for name in names if hasattr(signal, name)]
    stops = [sig for sig in stops if signal.getsignal(sig) is not signal.SIG_IGN]
    before = {sig: signal.getsignal(sig) for sig in stops}
    for sig in stops:
        signal.signal(sig, _stop)
    try:
        from fleetwave.cli.main import main
    except (_Stopped, KeyboardInterrupt):
        sys.stderr.write("error: interrupted while starting; nothing was done\n")
        raise SystemExit(INTERRUPTED) from None
    finally:
        for sig in stops:
            # Ctrl-C as Python has it (KeyboardInterrupt); SIGTERM and SIGHUP alike
            signal.signal(sig, before[sig] if sig == signal.SIGINT else _interrupt)
    main()
