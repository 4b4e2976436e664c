"""The dashboard's live updates: server-sent events, one stream per open page, from a
bounded fan-out.

One **producer** per subject (the overview of every strategy and conductor, or one
strategy) reads the store at a fixed rate (a strategy every :data:`POLL_S`, the
overview every :data:`OVERVIEW_POLL_S`), on the API's threads, and keeps the latest
snapshot, numbered, with its changes already made into JSON. Every page watching that
subject reads the same snapshot: a hundred open pages cost one set of queries a pass,
not a hundred (the producer starts with the first page and stops with the last). Each
stream waits for the next snapshot; one that fell behind (a slow client) is sent the
whole snapshot (``full``, made into JSON once, when the first page needs it) instead
of the changes it missed (``tick``), so no queue grows per client.

Limits: at most :data:`STREAMS_MAX` streams and :data:`PRODUCERS_MAX` producers at
once (one more is refused with 503 ``too_many_streams``); a stream whose token is
revoked or expires is ended within :data:`TOKEN_RECHECK_S`.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import json
import logging
import math
import operator
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fleetwave.api.errors import ApiError
from fleetwave.api.pages import (
    Grid,
    JournalRow,
    Marks,
    Transition,
    read_grid_marked,
    read_journal,
    read_pass,
    read_transitions,
)
from fleetwave.domain.models import STEP_FAILED, STEP_TERMINAL
from fleetwave.engine.loop import wait_set
from fleetwave.store import queries
from fleetwave.store.postgres import redact

if TYPE_CHECKING:
    from fleetwave.api.service import Service

log = logging.getLogger("fleetwave.api.live")

#: how often a strategy's producer reads the store (seconds), at a fixed rate: twice a
#: second, so that its page is updated at least once a second with room for the jitter
#: of a loaded machine (a pass late, a page's drawing late)
POLL_S = 0.5
#: how often the overview's producer reads the store (every strategy under way is read
#: as ``strategy show`` reads it: a pass costs more, and its pages draw tables)
OVERVIEW_POLL_S = 0.7
#: streams open at once (all pages), and subjects watched at once
STREAMS_MAX = 200
PRODUCERS_MAX = 32
#: a stream with nothing new sends a comment this often (proxies close idle streams)
KEEPALIVE_S = 15.0
#: how often a stream checks that its token is still valid
TOKEN_RECHECK_S = 30.0
#: how often a strategy's producer reads every step's state, not only those its
#: journal and attempts name (seconds)
WHOLE_GRID_S = 10.0
#: the latest failures a strategy's snapshot lists
FAILURES_SHOWN = 20
#: upper edges (seconds) of the step-duration histograms' buckets (the last is open)
DURATION_EDGES_S = (0.01, 0.03, 0.1, 0.3, 1.0, 3.0, 10.0, 30.0, 100.0, 300.0, 1000.0, 3000.0)
#: points of the throughput chart (its bucket widens as the rollout goes on)
THROUGHPUT_POINTS = 60


def sse(event: str, data: bytes, seq: int | None = None) -> bytes:
    """One server-sent event (``data`` is one line of JSON)."""
    head = f"event: {event}\n" + (f"id: {seq}\n" if seq is not None else "")
    return head.encode() + b"data: " + data + b"\n\n"


def _json(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":"), default=str).encode()


#: a journal row's ``at``
_AT = operator.itemgetter(2)


def _already(made: bytes) -> Callable[[], bytes]:
    return lambda: made


class Snapshot:
    """What a producer read at one pass: ``full`` for a page that starts (or fell
    behind), made when the first such page asks for it; ``tick`` for one that saw the
    snapshot before."""

    def __init__(self, seq: int, full: Callable[[], bytes], tick: bytes) -> None:
        self.seq = seq
        self.tick = tick
        self._make_full: Callable[[], bytes] | None = full
        self._full = b""

    @property
    def full(self) -> bytes:
        if self._make_full is not None:
            self._full, self._make_full = self._make_full(), None
        return self._full


class Producer:
    """Reads one subject every :attr:`period_s` while somebody watches it."""

    period_s = OVERVIEW_POLL_S

    def __init__(self, svc: Service, key: str, hub: LiveHub) -> None:
        self.svc = svc
        self.key = key
        self.hub = hub
        self.watchers = 0
        self.latest: Snapshot | None = None
        self._changed = asyncio.Event()
        self.task: asyncio.Task[None] | None = None
        self.stopped = False

    def stop(self) -> None:
        """Wake every stream waiting for a snapshot: there will be none."""
        self.stopped = True
        self._changed.set()

    async def wait_after(self, seq: int, timeout_s: float) -> Snapshot | None:
        """The first snapshot after ``seq`` (None after ``timeout_s`` without one)."""
        while self.latest is None or self.latest.seq <= seq:
            if self.stopped:
                return None
            changed = self._changed
            if not await wait_set(changed, timeout_s):
                return None
        return self.latest

    def _publish(self, full: Callable[[], bytes], tick: bytes) -> None:
        seq = self.latest.seq + 1 if self.latest is not None else 1
        self.latest = Snapshot(seq, full, tick)
        self._changed.set()
        self._changed = asyncio.Event()

    async def run(self) -> None:
        first = True
        due = time.monotonic()
        while True:
            try:
                self.hub.reads += 1
                await self.read(first)
                first = False
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the store did not answer: said on the page
                log.warning("live %s: the store did not answer: %s", self.key, redact(str(exc)))
                problem = _json({"problem": f"the database did not answer: {redact(str(exc))}"})
                said = sse("problem", problem)
                self._publish(_already(said), said)
            # (a fixed rate; after a pass that overran, the next starts at once: no burst)
            due = max(due + self.period_s, time.monotonic())
            await asyncio.sleep(max(0.0, due - time.monotonic()))

    async def read(self, first: bool) -> None:
        raise NotImplementedError


class OverviewProducer(Producer):
    """Every strategy (as ``strategy list``, with ``strategy show``'s elapsed time and
    estimate for those under way) and every conductor (``conductor list``)."""

    async def read(self, first: bool) -> None:
        data = await self.svc.call(overview, self.svc.store)
        said = sse("full", _json(data))
        self._publish(_already(said), said)


#: strategy states in which its steps still move (its summary is read again each pass)
_UNDER_WAY = ("initial", "applying", "paused", "waiting-approval", "abort-requested", "aborting")


def overview(store: Any) -> dict[str, Any]:
    """The strategies page and the conductors page: one read of each list, and
    ``strategy show`` for the strategies not ended (their elapsed time and estimate)."""
    rows = queries.list_strategies(store)
    for row in rows:
        if row["state"] in _UNDER_WAY:
            shown = queries.get_strategy(store, int(row["id"]))
            for key in ("elapsed_s", "time_left_estimate_s", "percent_done", "stage_now"):
                row[key] = shown.get(key)
    return {
        "at": time.time(),
        "strategies": rows,
        "conductors": queries.list_conductors(store),
    }


@dataclass
class _Charts:
    """A strategy's journal, folded as it is read: throughput and time per state."""

    #: per second (its ``at``, whole): transitions written, and steps ended
    transitions: dict[int, int] = field(default_factory=dict)
    ended: dict[int, int] = field(default_factory=dict)
    #: each step's current state and when it entered it
    entered: dict[int, tuple[str, float]] = field(default_factory=dict)
    #: per state: how many left it after how long (DURATION_EDGES_S buckets), and total
    durations: dict[str, list[int]] = field(default_factory=dict)
    duration_sum_s: dict[str, float] = field(default_factory=dict)
    failures: deque[dict[str, Any]] = field(default_factory=lambda: deque(maxlen=FAILURES_SHOWN))
    #: the earliest ``at`` folded: when the strategy's first transition was
    first_at: float | None = None

    def fold(self, rows: list[JournalRow]) -> list[int]:
        """Fold journal rows (id, step, at, to), oldest first; the ids of the
        latest of them that entered ``failed`` (their details are read apart). (Some
        10,000 rows a second at full speed: what it uses in its loop is bound first.)"""
        if not rows:
            return []
        low = min(map(_AT, rows))
        if self.first_at is None or low < self.first_at:
            self.first_at = low
        transitions, ended, entered = self.transitions, self.ended, self.entered
        durations, sums = self.durations, self.duration_sum_s
        t_get, e_get, left, d_get, s_get = (
            transitions.get,
            ended.get,
            entered.pop,
            durations.get,
            sums.get,
        )
        edges, buckets, bucket_of = DURATION_EDGES_S, len(DURATION_EDGES_S) + 1, bisect.bisect_left
        terminal = STEP_TERMINAL
        failed: deque[int] = deque(maxlen=FAILURES_SHOWN)
        for row_id, step, at, to in rows:
            second = int(at)
            transitions[second] = t_get(second, 0) + 1
            before = left(step, None)
            if before is not None:
                state, since = before
                took = at - since if at > since else 0.0
                counts = d_get(state)
                if counts is None:
                    counts = durations[state] = [0] * buckets
                counts[bucket_of(edges, took)] += 1
                sums[state] = s_get(state, 0.0) + took
            if to in terminal:
                ended[second] = e_get(second, 0) + 1
                if to == STEP_FAILED:
                    failed.append(row_id)
            else:
                entered[step] = (to, at)
        return list(failed)

    def failed(self, rows: list[Transition], names: dict[int, str]) -> None:
        """The failures' rows (oldest first), read by their ids."""
        for t in rows:
            self.failures.appendleft(
                {
                    "step": t.step,
                    "target": names.get(t.step, "?"),
                    "at": t.at,
                    "from": t.came_from,
                    "details": t.details,
                    "conductor": t.conductor,
                }
            )

    def shown(self, now: float) -> dict[str, Any]:
        """The charts' data: throughput in buckets of ``bucket_s`` from ``t0`` (ended
        steps and transitions per second), the duration histograms, the failures."""
        if self.transitions:
            first, last = min(self.transitions), max(max(self.transitions), int(now))
        else:
            first = last = int(now)
        span = last - first + 1
        bucket = max(1, math.ceil(span / THROUGHPUT_POINTS))
        start = last - bucket * THROUGHPUT_POINTS + 1 if span > THROUGHPUT_POINTS else first
        ended = [0] * math.ceil((last - start + 1) / bucket)
        moved = [0] * len(ended)
        for series, source in ((ended, self.ended), (moved, self.transitions)):
            for second, n in source.items():
                if second >= start:
                    series[min(len(series) - 1, (second - start) // bucket)] += n
        return {
            "throughput": {
                "t0": start,
                "bucket_s": bucket,
                "ended_per_s": [round(n / bucket, 2) for n in ended],
                "transitions_per_s": [round(n / bucket, 2) for n in moved],
            },
            "durations": {
                "edges_s": list(DURATION_EDGES_S),
                "states": {
                    state: {
                        "counts": counts,
                        "mean_s": round(self.duration_sum_s[state] / max(1, sum(counts)), 3),
                    }
                    for state, counts in self.durations.items()
                },
            },
            "failures": list(self.failures),
        }


class StrategyProducer(Producer):
    """One strategy: ``strategy show`` (its counts as the command has them), its grid
    (every cell on ``full``, the cells that changed on ``tick``) and its charts.

    A pass costs the server what moved since the last, not the strategy's size: the
    journal's new rows (a few columns, through the driver) give the charts and the
    cells' states (a state is entered at attempt 1; an end keeps the attempt), a new
    attempt row (a retry) has its step read; every step is read again only every
    :data:`WHOLE_GRID_S` and when the strategy's state changes (a change no journal
    or attempt row names does not stay on the page for long). ``strategy show``'s
    figures are read whole each pass. The whole pass runs on one of the API's
    threads, not on the event loop the engine shares; the whole grid is made into
    JSON only when a page needs it (it starts, or fell behind)."""

    period_s = POLL_S

    def __init__(self, svc: Service, key: str, hub: LiveHub, sid: int) -> None:
        super().__init__(svc, key, hub)
        self.sid = sid
        self.grid: Grid | None = None
        self.index: dict[int, int] = {}
        self.names: dict[int, str] = {}
        self.charts = _Charts()
        #: the journal's and the attempts' last rows folded (read with the grid first)
        self.marks = Marks(0, 0)
        #: the strategy's state at the last pass, and when every step is read again
        self.state_seen: str | None = None
        self.whole_due = time.monotonic() + WHOLE_GRID_S

    async def read(self, first: bool) -> None:
        full, tick, cpu_s = await self.svc.call(self.timed_pass)
        self.hub.pass_cpu_s += cpu_s
        self._publish(full, tick)

    def timed_pass(self) -> tuple[Callable[[], bytes], bytes, float]:
        """:meth:`one_pass`, and the CPU seconds its thread spent on it."""
        started = time.thread_time()
        full, tick = self.one_pass()
        return full, tick, time.thread_time() - started

    def one_pass(self) -> tuple[Callable[[], bytes], bytes]:
        """Read and fold what moved; the snapshot's ``full`` (made when first asked
        for) and ``tick``. (On an API thread: one pass at a time, the producer's.)"""
        store, sid = self.svc.store, self.sid
        if self.grid is None:
            made, self.marks = read_grid_marked(store, sid)
            self.grid = made
            self.index = {step: i for i, step in enumerate(made.step)}
            self.names = dict(zip(made.step, made.target, strict=True))
            # (the journal so far, for the charts)
            self.charts.failed(
                read_transitions(store, self.charts.fold(read_journal(store, sid, self.marks))),
                self.names,
            )
        grid = self.grid
        summary = queries.get_strategy(store, sid, first_at=self.charts.first_at)
        whole = summary["state"] != self.state_seen or time.monotonic() >= self.whole_due
        if whole:
            self.whole_due = time.monotonic() + WHOLE_GRID_S
            self.state_seen = summary["state"]
        moved = read_pass(store, sid, self.marks, whole)
        self.marks = moved.marks
        states, attempts, index = grid.state, grid.attempt, self.index
        changed: dict[int, None] = {}  # (cells in the order they changed, once each)
        for _, step, _, to in moved.journal:
            i = index.get(step)
            if i is not None:
                states[i] = to
                if to not in STEP_TERMINAL:
                    attempts[i] = 1
                changed[i] = None
        for step, state, attempt in moved.steps:
            i = index.get(step)
            if i is not None and (states[i] != state or attempts[i] != attempt):
                states[i], attempts[i] = state, attempt
                changed[i] = None
        failed = self.charts.fold(moved.journal)
        if failed:
            self.charts.failed(read_transitions(store, failed), self.names)
        now = time.time()
        common = _json({"at": now, "strategy": summary, **self.charts.shown(now)})
        changes = [[i, states[i], attempts[i]] for i in changed]
        tick = b'{"changes":' + _json(changes) + b"," + common[1:]
        cells = {**grid.columns(), "state": states[:], "attempt": attempts[:]}

        def full() -> bytes:
            return sse("full", b'{"grid":' + _json(cells) + b"," + common[1:])

        return full, sse("tick", tick)


class LiveHub:
    """The producers, and who watches each; owned by the app (``Service.live``)."""

    def __init__(self, svc: Service) -> None:
        self.svc = svc
        self.producers: dict[str, Producer] = {}
        self.streams = 0
        #: passes the producers made (read by /metrics)
        self.reads = 0
        #: CPU seconds the strategies' passes took in this process (their threads' own
        #: time: a page's cost to the server, read by /metrics and the benchmark)
        self.pass_cpu_s = 0.0
        #: producers whose last page went, being cancelled (awaited by :meth:`close`)
        self._stopping: set[asyncio.Task[None]] = set()
        #: set when the server stops: every stream ends (uvicorn waits for them)
        self.closing = asyncio.Event()

    def admit(self, key: str) -> None:
        """Refuse a stream beyond the limits (503), before its answer starts."""
        if self.closing.is_set():
            raise ApiError(503, "stopping", "the server is stopping")
        if self.streams >= STREAMS_MAX:
            raise ApiError(
                503, "too_many_streams", f"{STREAMS_MAX} live streams are open: close a page"
            )
        if key not in self.producers and len(self.producers) >= PRODUCERS_MAX:
            raise ApiError(
                503, "too_many_streams", f"{PRODUCERS_MAX} subjects are watched live: close a page"
            )

    def _watch(self, key: str, make: Callable[[], Producer]) -> Producer:
        producer = self.producers.get(key)
        if producer is None:
            producer = self.producers[key] = make()
            producer.task = asyncio.create_task(producer.run(), name=f"fleetwave-live-{key}")
        producer.watchers += 1
        self.streams += 1
        return producer

    def _unwatch(self, producer: Producer) -> None:
        """(Not async: it runs as a cancelled stream ends, where an await is cancelled.)"""
        producer.watchers -= 1
        self.streams -= 1
        if producer.watchers == 0 and self.producers.get(producer.key) is producer:
            del self.producers[producer.key]
            task = producer.task
            if task is not None:
                task.cancel()
                self._stopping.add(task)
                task.add_done_callback(self._stopping.discard)

    @staticmethod
    def overview_key() -> str:
        return "overview"

    @staticmethod
    def strategy_key(sid: int) -> str:
        return f"strategy-{sid}"

    def overview(self, still_allowed: Allowed) -> AsyncIterator[bytes]:
        key = self.overview_key()
        self.admit(key)
        return self._stream(key, lambda: OverviewProducer(self.svc, key, self), still_allowed)

    def strategy(self, sid: int, still_allowed: Allowed) -> AsyncIterator[bytes]:
        key = self.strategy_key(sid)
        self.admit(key)
        return self._stream(key, lambda: StrategyProducer(self.svc, key, self, sid), still_allowed)

    async def _stream(
        self, key: str, make: Callable[[], Producer], still_allowed: Allowed
    ) -> AsyncIterator[bytes]:
        """The events of one page: the whole snapshot first, then each pass's changes
        (the whole again after a pass it missed), until it goes, its token stops being
        valid, or the server stops."""
        producer = self._watch(key, make)
        seen = -1  # (no snapshot yet: the first one sent whole)
        checked = time.monotonic()
        try:
            yield b"retry: 2000\n\n"
            while not self.closing.is_set():
                snap = await producer.wait_after(seen, KEEPALIVE_S)
                if self.closing.is_set():
                    break
                if time.monotonic() - checked > TOKEN_RECHECK_S:
                    checked = time.monotonic()
                    if not await still_allowed():
                        yield sse(
                            "unauthorized", _json({"message": "the token is no longer valid"})
                        )
                        break
                if snap is None:
                    yield b": keepalive\n\n"
                    continue
                yield snap.tick if snap.seq == seen + 1 else snap.full
                seen = snap.seq
        finally:
            self._unwatch(producer)

    async def close(self) -> None:
        """End every stream and producer (the server stops)."""
        self.closing.set()
        for producer in list(self.producers.values()):
            producer.stop()
            await _ended(producer.task)
        self.producers.clear()
        for task in list(self._stopping):
            await _ended(task)


Allowed = Callable[[], Awaitable[bool]]


async def _ended(task: asyncio.Task[None] | None) -> None:
    if task is None:
        return
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
