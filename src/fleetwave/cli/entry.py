"""The ``fleetwave`` console script: a light first step.

Importing the command line (Typer, Rich, SQLAlchemy, the engine) takes most of a
second, before any of its own signal handling exists: a Ctrl-C then printed a
traceback, and a SIGTERM ended the process without a word. Here the imports run under
handlers that end it as an interruption does later: one line, exit 130, and nothing
done (no command has started).
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


def run() -> None:
    stops = [signal.SIGINT, signal.SIGTERM, signal.SIGHUP]
    before = {}
    for sig in stops:
        previous = signal.getsignal(sig)
        if previous is signal.SIG_IGN:
            continue  # ignored by who started it (a background job's SIGINT): still so
        before[sig] = previous
        signal.signal(sig, _stop)
    try:
        from fleetwave.cli.main import main
    except (_Stopped, KeyboardInterrupt):
        sys.stderr.write("error: interrupted while starting; nothing was done\n")
        raise SystemExit(INTERRUPTED) from None
    finally:
        for sig, previous in before.items():
            signal.signal(sig, previous)
    main()
