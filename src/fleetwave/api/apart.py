"""The API served from a process of its own beside the engine (``fleetwave serve
--listen``, unless ``--api-in-engine``).

Why: the engine and the API are both Python, CPU-bound on their hot paths. On one
event loop, every group commit and dispatch turn of the engine holds every request
up (a callback waited behind them), and every request takes the engine's time (under
a steady mix of reads and callbacks, a rollout ran at a fraction of its speed). In
one process on two loops they would still share one interpreter lock. In a process
of its own, the API has a core of its own.

The command's process binds the socket (a port in use is said at once) and runs the
engine; it starts the API's process (spawned: a fresh interpreter, nothing of the
engine's threads or connections) with that socket. Nothing but the database passes
between them for the API's work: a callback the API stores is found by the engine
with a cheap look at the highest callback id (``EngineConfig.callback_watch_s``; on
PostgreSQL, NOTIFY wakes it). The one thing asked across is ``/metrics``: the engine's
counts, read on the engine's loop and sent back as text over a pipe.

The API's process ignores Ctrl-C (the terminal sends it to both): the command stops
the engine first, then the API (SIGTERM: requests under way finish), as before. It
also ends if the command's process dies (the kernel sends it SIGTERM).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import os
import signal
import socket
import sys
import threading
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, generate_latest

if TYPE_CHECKING:
    from fleetwave.api.serve import Tls
    from fleetwave.engine.conductor import Conductor

log = logging.getLogger("fleetwave.api")

#: how long the API's process has to finish the requests under way once told to stop,
#: before it is killed (uvicorn's own grace is 10 s)
STOP_WAIT_S = 15.0
#: how long a scrape waits for the engine's counts (its loop may be in a long commit)
ENGINE_METRICS_WAIT_S = 5.0
#: what the API's process says once it answers requests
READY = b"ready"
#: how long the command waits for that (a loaded machine imports slowly)
START_WAIT_S = 120.0
#: the API's process's thread switch interval (Python's default: 5 ms)
SWITCH_INTERVAL_S = 0.0005
#: how often the engine looks for callbacks the API's process stored (SQLite)
CALLBACK_WATCH_S = 0.02


@dataclass(frozen=True)
class ChildSettings:
    """What the API's process is started with."""

    db: str | None
    tls: Tls | None
    json_logs: bool
    log_level: str
    #: Service.read_cache_s (``serve --read-cache-ms``)
    read_cache_s: float


class EngineMetricsClient:
    """In the API's process: the engine's counts, asked of the command's process."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn
        self._turn = threading.Lock()

    def text(self) -> bytes:
        """The engine's metrics in Prometheus's text format (empty if it does not answer)."""
        with self._turn:
            try:
                self._conn.send_bytes(b"metrics")
                if not self._conn.poll(ENGINE_METRICS_WAIT_S):
                    log.warning("api: the engine did not send its metrics in time")
                    return b""
                return self._conn.recv_bytes()
            except (OSError, EOFError):
                return b""


def _engine_metrics_text(conductor: Conductor) -> bytes:
    """The engine's counts as the in-process API shows them (on the engine's loop)."""
    from fleetwave.api.metrics import EngineCollector

    class _Holder:
        pass

    holder = _Holder()
    holder.conductor = conductor  # type: ignore[attr-defined]
    registry = CollectorRegistry(auto_describe=False)
    registry.register(EngineCollector(holder))  # type: ignore[arg-type]
    return generate_latest(registry)


class ApiProcess:
    """In the command's process: the API's process, and the engine's side of the pipe."""

    def __init__(self, sock: socket.socket, settings: ChildSettings) -> None:
        self.sock = sock
        self.settings = settings
        self._proc: BaseProcess | None = None
        self._conn: Connection | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    async def start(self, conductor: Conductor | None) -> None:
        """Start the API's process, and wait until it answers requests (or has failed:
        :attr:`ended`); ``conductor``'s counts are what it scrapes."""
        ctx = multiprocessing.get_context("spawn")
        ours, theirs = ctx.Pipe(duplex=True)
        proc = ctx.Process(
            target=child_main,
            args=(self.sock, self.settings, theirs),
            name="fleetwave-api",
            daemon=False,
        )
        proc.start()
        theirs.close()
        self._proc, self._conn = proc, ours
        with contextlib.suppress(OSError, EOFError):
            if await asyncio.to_thread(ours.poll, START_WAIT_S):
                ours.recv_bytes()  # (READY, or nothing: it ended)
        if conductor is not None:
            from fleetwave.engine.meters import Meters

            if conductor.meters is None:
                conductor.meters = Meters()  # (counted from now on, for the scrapes)
            self._loop = loop = asyncio.get_running_loop()
            loop.add_reader(ours.fileno(), self._answer, conductor)

    def _answer(self, conductor: Conductor) -> None:
        """A scrape's question (on the engine's loop): its counts, as text."""
        assert self._conn is not None and self._loop is not None
        try:
            self._conn.recv_bytes()
        except (OSError, EOFError):  # the API's process is gone: asks nothing more
            self._loop.remove_reader(self._conn.fileno())
            return
        with contextlib.suppress(OSError):
            self._conn.send_bytes(_engine_metrics_text(conductor))

    @property
    def ended(self) -> bool:
        return self._proc is not None and not self._proc.is_alive()

    async def wait_ended(self) -> None:
        """Until the API's process ends by itself (it failed)."""
        proc = self._proc
        assert proc is not None
        await asyncio.to_thread(proc.join)

    async def stop(self) -> None:
        """Stop the API (requests under way finish), and wait for its process."""
        proc, conn = self._proc, self._conn
        if self._loop is not None and conn is not None:
            with contextlib.suppress(ValueError, OSError):
                self._loop.remove_reader(conn.fileno())
        if proc is None:
            return
        if proc.is_alive() and proc.pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGTERM)
        await asyncio.to_thread(proc.join, STOP_WAIT_S)
        if proc.is_alive():
            log.error("api: its process did not stop in %gs: killed", STOP_WAIT_S)
            proc.kill()
            await asyncio.to_thread(proc.join)
        if conn is not None:
            conn.close()


def _die_with_parent() -> None:
    """Linux: SIGTERM this process when the one that started it dies."""
    with contextlib.suppress(OSError, AttributeError):
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, signal.SIGTERM)


def child_main(sock: socket.socket, settings: ChildSettings, conn: Connection) -> None:
    """The API's process: serve the API on ``sock`` until SIGTERM."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # (Ctrl-C is the command's to act on)
    _die_with_parent()
    from fleetwave.cli import output
    from fleetwave.cli.main import configure_logging

    configure_logging(settings.log_level)
    if settings.json_logs:
        output.use_json_logs()
    try:
        _serve(sock, settings, conn)
    except KeyboardInterrupt:
        pass
    finally:
        sock.close()
        sys.stderr.flush()


def _serve(sock: socket.socket, settings: ChildSettings, conn: Connection) -> None:
    from fleetwave.api.serve import serve_api
    from fleetwave.api.service import Service
    from fleetwave.cli.common import existing_store
    from fleetwave.domain.registry import load_plugins
    from fleetwave.engine import loop as event_loop

    load_plugins()  # (plug-in workflows: as the command's process has them)
    # The intake's writes run on a thread of their own while the loop parses requests:
    # a thread waits for the interpreter lock up to this long at each turn (5 ms by
    # default). Measured under the mix of bench/api_load.py: a callback batch's write
    # p99 from 6 to 9 ms down to 4 to 6 ms.
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    store = existing_store(settings.db)
    store.turns_across_processes = True  # (as the engine's process: see Store.writer_turn)
    service = Service(
        store, engine_metrics=EngineMetricsClient(conn).text, read_cache_s=settings.read_cache_s
    )

    async def run() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, stop.set)
        await serve_api(service, sock, stop, settings.tls, lambda: conn.send_bytes(READY))

    try:
        event_loop.run(run())
    finally:
        service.close()
        store.dispose()
