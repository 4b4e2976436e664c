"""What every route of the API shares: the store, the engine beside it (if any), the
threads that run blocking store calls, and the cursors of paged lists.

Store calls block (one or a few transactions; SQLite waits for a writer's lock inside
the call): they run on the API's own small pool of threads, never on the event loop,
which also runs the engine when ``fleetwave serve`` serves both.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextvars
import functools
import json
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ParamSpec, TypeVar

from fastapi import Request

from fleetwave.api.errors import ApiError
from fleetwave.store import tokens
from fleetwave.store.db import Store
from fleetwave.store.tokens import Caller

if TYPE_CHECKING:
    from fleetwave.api.intake import CallbackIntake
    from fleetwave.api.live import LiveHub
    from fleetwave.api.metrics import ApiMetrics
    from fleetwave.engine.conductor import Conductor

P = ParamSpec("P")
R = TypeVar("R")

#: threads for the API's store calls: enough for reads to overlap a write waiting for
#: SQLite's lock, few enough that a burst of requests cannot starve the engine's writes
STORE_THREADS = 8
#: the most rows one page of a list holds (``limit``), and how many it holds by default
PAGE_LIMIT_MAX = 1000
PAGE_LIMIT_DEFAULT = 100
#: how long an answer of a hot read (strategy show, a page of its steps) is given again
#: to the same request (``serve --read-cache-ms``): a dashboard or a script polling a
#: strategy of 10,000 steps costs one read of them per this long, not one per request
READ_CACHE_S_DEFAULT = 0.25
#: answers kept at most (the oldest go first)
READ_CACHE_MAX = 256
#: an answer older than :attr:`Service.read_cache_s` is still given while a newer read
#: of it is under way (one started by the first request to find it old), until it is
#: this many times that old: a request never waits for a read another already made
#: (under load a read of a large strategy takes tens of milliseconds)
READ_CACHE_STALE = 4
#: how long a bearer token found valid is taken as valid without reading it again
#: (seconds; never past its expiry, nor after a change made through this API, a
#: revocation included): a token revoked by a command is refused within this time
TOKEN_CACHE_S = 1.0
#: tokens kept at most (the oldest go first)
TOKEN_CACHE_MAX = 1024
#: the largest request body read (bytes): a bigger one is refused (413) unread
MAX_BODY_BYTES = 1_048_576


@dataclass
class Service:
    """The API's state: one per app (``app.state.service``)."""

    store: Store
    #: the engine in this process (``fleetwave serve`` without ``--no-engine``): told of
    #: each callback stored, so that it applies it at once rather than at its next pass
    conductor: Conductor | None = None
    #: the engine's metrics (Prometheus's text), asked of the engine's process when the
    #: API is served from a process of its own (see fleetwave.api.apart)
    engine_metrics: Callable[[], bytes] | None = None
    #: require a bearer token (False only for tests and ``--no-auth`` on loopback)
    auth: bool = True
    #: the app's metrics (set by make_app)
    metrics: ApiMetrics | None = None
    #: agents' callbacks, stored a batch at a time (set by make_app)
    intake: CallbackIntake = field(init=False, repr=False)
    #: the dashboard's live streams (set by make_app)
    live: LiveHub | None = field(default=None, repr=False)
    #: the threads store calls run on: made when first needed, ended by :meth:`close`
    #: (the app's shutdown; a test client may start the app again)
    _threads: ThreadPoolExecutor | None = field(default=None, repr=False)

    #: how long an answer of :meth:`recent` is given again (0: never)
    read_cache_s: float = READ_CACHE_S_DEFAULT
    #: bumped by every request that may change something (not an agent's callback):
    #: an answer read before is not given again after it
    generation: int = field(default=0, repr=False)
    _recent: dict[tuple[Any, ...], _Reused] = field(default_factory=dict, repr=False)
    #: the newer reads under way of answers given while old (:data:`READ_CACHE_STALE`)
    _refreshing: dict[tuple[Any, ...], asyncio.Task[None]] = field(default_factory=dict, repr=False)
    #: the callers of tokens found valid (:data:`TOKEN_CACHE_S`), by the token's hash
    _callers: dict[str, _Known] = field(default_factory=dict, repr=False)

    #: the one thread the API's writes run on, in turn: SQLite has one writer, and
    #: several threads waiting for its lock poll for it (most of their time asleep)
    _writer: ThreadPoolExecutor | None = field(default=None, repr=False)

    async def call(self, fn: Callable[P, R], *args: P.args, **kwargs: P.kwargs) -> R:
        """Run a blocking store call (a read) on the API's threads, with this request's
        context (who asks: recorded with what it changes)."""
        if self._threads is None:
            self._threads = ThreadPoolExecutor(STORE_THREADS, thread_name_prefix="fw-api")
        return await self._run(self._threads, fn, *args, **kwargs)

    async def recent(
        self, key: tuple[Any, ...], fn: Callable[P, R], *args: P.args, **kwargs: P.kwargs
    ) -> R:
        """:meth:`call`, or the answer of the same read (``key``) started less than
        :attr:`read_cache_s` ago, and since the last change made through this API
        (one under way is awaited). Changes made elsewhere (the engine, a command) show
        by then."""
        if self.read_cache_s <= 0:
            return await self.call(fn, *args, **kwargs)
        now = time.monotonic()
        hit = self._recent.get(key)
        if (
            hit is not None
            and hit.generation == self.generation
            and not (hit.answer.done() and hit.answer.exception() is not None)
        ):
            age = now - hit.at
            if age < self.read_cache_s:
                answer: R = await asyncio.shield(hit.answer)
                return answer
            if hit.answer.done() and age < READ_CACHE_STALE * self.read_cache_s:
                # Old, not too old: given now, and read again behind it (once).
                if key not in self._refreshing:
                    self._refreshing[key] = asyncio.create_task(
                        self._read_again(key, fn, *args, **kwargs)
                    )
                stale: R = hit.answer.result()
                return stale
        return await asyncio.shield(self._read(now, key, fn, *args, **kwargs))

    def _read(
        self,
        now: float,
        key: tuple[Any, ...],
        fn: Callable[P, R],
        *args: P.args,
        **kwargs: P.kwargs,
    ) -> asyncio.Future[R]:
        """Start a read of :meth:`recent`'s, kept as its answer from ``now`` on."""
        reading = asyncio.ensure_future(self.call(fn, *args, **kwargs))
        self._recent.pop(key, None)
        self._recent[key] = _Reused(now, self.generation, reading)
        while len(self._recent) > READ_CACHE_MAX:
            del self._recent[next(iter(self._recent))]
        return reading

    async def _read_again(
        self, key: tuple[Any, ...], fn: Callable[P, R], *args: P.args, **kwargs: P.kwargs
    ) -> None:
        """A newer read of an answer given while old; the old one is given meanwhile."""
        try:
            began, generation = time.monotonic(), self.generation
            reading = asyncio.ensure_future(self.call(fn, *args, **kwargs))
            await asyncio.wait([reading])
            if reading.exception() is None and generation == self.generation:
                # (a change through this API meanwhile: the next request reads anew)
                self._recent.pop(key, None)
                self._recent[key] = _Reused(began, generation, reading)
        finally:
            self._refreshing.pop(key, None)

    async def caller_of(self, token: str) -> Caller | None:
        """Who ``token`` stands for, if it is valid (see :data:`TOKEN_CACHE_S`)."""
        key = tokens.token_hash(token)
        now, wall = time.monotonic(), time.time()
        known = self._callers.get(key)
        if (
            known is not None
            and known.generation == self.generation
            and now - known.at < TOKEN_CACHE_S
            and (known.expires_at is None or known.expires_at > wall)
        ):
            return known.caller
        generation = self.generation
        held = await self.call(tokens.token_holder, self.store, token, wall)
        if held is None:
            self._callers.pop(key, None)  # (not kept: a token made just now is valid at once)
            return None
        caller, expires_at = held
        if generation == self.generation:
            self._callers.pop(key, None)
            self._callers[key] = _Known(now, generation, caller, expires_at)
            while len(self._callers) > TOKEN_CACHE_MAX:
                del self._callers[next(iter(self._callers))]
        return caller

    def changed(self) -> None:
        """Something may have changed (a request that is not a read): answers read
        before are not given again."""
        self.generation += 1

    async def write(self, fn: Callable[P, R], *args: P.args, **kwargs: P.kwargs) -> R:
        """Run a blocking store call that writes, on the API's writer thread."""
        return await self.write_nowait(fn, *args, **kwargs)

    def write_nowait(
        self, fn: Callable[P, R], *args: P.args, **kwargs: P.kwargs
    ) -> asyncio.Future[R]:
        """Start a store call that writes, on the API's writer thread: it runs to its
        end whoever waits for it (the app's shutdown waits for the thread)."""
        if self._writer is None:
            self._writer = ThreadPoolExecutor(1, thread_name_prefix="fw-api-write")
        return self._start(self._writer, fn, *args, **kwargs)

    async def _run(
        self, threads: ThreadPoolExecutor, fn: Callable[P, R], *args: P.args, **kwargs: P.kwargs
    ) -> R:
        return await self._start(threads, fn, *args, **kwargs)

    @staticmethod
    def _start(
        threads: ThreadPoolExecutor, fn: Callable[P, R], *args: P.args, **kwargs: P.kwargs
    ) -> asyncio.Future[R]:
        ctx = contextvars.copy_context()
        loop = asyncio.get_running_loop()
        return loop.run_in_executor(threads, functools.partial(ctx.run, fn, *args, **kwargs))

    async def live_close(self) -> None:
        """End the live streams (the server stops: it waits for the streams to end)."""
        if self.live is not None:
            await self.live.close()

    def close(self) -> None:
        for task in list(self._refreshing.values()):
            task.cancel()
        self._refreshing.clear()
        for threads in (self._threads, self._writer):
            if threads is not None:
                threads.shutdown(wait=True)
        self._threads = self._writer = None


@dataclass(frozen=True, slots=True)
class _Reused:
    """An answer of :meth:`Service.recent`: when its read began, and on what."""

    at: float
    generation: int
    answer: asyncio.Future[Any]


@dataclass(frozen=True, slots=True)
class _Known:
    """A token found valid (:meth:`Service.caller_of`): when, on what, and its caller."""

    at: float
    generation: int
    caller: Caller
    expires_at: float | None


def service_of(request: Request) -> Service:
    service: Service = request.app.state.service
    return service


async def the_service(request: Request) -> Service:
    """:func:`service_of` as a route's dependency. (A dependency that is a plain ``def``
    is run on a worker thread: a thread hop per request, for a dictionary read.)"""
    return service_of(request)


def encode_cursor(key: Any) -> str | None:
    """An opaque cursor for the key of a page's last row (None: no next page)."""
    if key is None:
        return None
    raw = json.dumps([key], separators=(",", ":")).encode("utf-8")
    return base64.urlsafe_b64encode(raw).decode("ascii").rstrip("=")


def decode_cursor(cursor: str | None, kind: type, default: Any) -> Any:
    """The key a cursor holds (``default`` without one); one this server did not give
    is bad input naming ``cursor``."""
    if cursor is None or cursor == "":
        return default
    try:
        padded = cursor + "=" * (-len(cursor) % 4)
        (key,) = json.loads(base64.urlsafe_b64decode(padded.encode("ascii")))
    except (ValueError, binascii.Error, UnicodeError, TypeError):
        key = None
    if type(key) is not kind:
        raise ApiError(422, "invalid", "cursor: not a cursor this list gave", "cursor")
    return key


def page_answer(rows: list[dict[str, Any]], next_key: Any) -> dict[str, Any]:
    """A page of a list: its rows (each as ``--format json`` has it) and the cursor of
    the next page (null after the last)."""
    return {"items": rows, "next_cursor": encode_cursor(next_key)}
