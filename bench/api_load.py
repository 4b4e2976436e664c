"""Benchmark of the REST API under load, served by ``fleetwave serve --listen``.

Two scenarios, each against a real server (``serve --listen``: the engine, and the
API in a process of its own; server CPU counts both) on loopback,
loaded by this process through a small HTTP/1.1 client of its own (keep-alive
connections, requests written by hand: httpx would cost this side more CPU than the
server spends, on a machine of two cores):

- ``intake``: agents' callbacks alone. ``CALLBACK_STEPS`` steps of a strategy that is
  not applied, each with an agent token issued for its state (as the engine issues
  them); ``--connections`` connections send heartbeats with unique idempotency keys
  as fast as they are answered, for ``--seconds``. Figures: callbacks answered 202
  per second, and stored (the callbacks table counted afterwards: every 202 is a row),
  latency p50/p99. Target: >= 3,000 accepted callbacks/s.
- ``mixed``: the server drives a rollout of ``ROLLOUT_TARGETS`` sim targets at max
  parallel ``ROLLOUT_PARALLEL`` (``patch``, zero latency: the rollout is CPU bound,
  so that the API's load shows in its throughput). It is run twice in fresh
  databases: alone, then with this process sending a steady (open-loop) mix of
  ``MIX_CALLBACKS_PER_S`` callbacks and ``MIX_READS_PER_S`` reads a second (strategy
  show, and pages of the step list) until the rollout completes; ``--repeat`` pairs
  (3), whose medians are compared (this VM's speed drifts between minutes). Targets:
  callback POST p99 < 20 ms (every loaded run's requests together), GET p99 < 50 ms,
  the rollout's throughput (transitions over the span of its journal) with the load
  >= 80 % of its throughput alone.

Run it from the repository root (``--quick``: smaller and shorter)::

    .venv/bin/python bench/api_load.py [--scenario intake|mixed|all]

It prints the figures and appends (replaces) its sections in ``bench/RESULTS.md``
with the command and machine. Exit status 1 when a target is missed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import multiprocessing as mp
import os
import re
import secrets
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sqlalchemy import func, select

from bench import (
    DEFAULT_RESULTS,
    Check,
    ScenarioReport,
    environment,
    print_report,
    write_results,
)
from fleetwave.domain.models import StrategyOptions, Target
from fleetwave.domain.registry import get_workflow
from fleetwave.engine import loop as event_loop
from fleetwave.store import admin, tokens
from fleetwave.store.db import open_store
from fleetwave.store.schema import callbacks, journal, strategies

CALLBACK_STATE = "waiting-for-agent"
CALLBACK_STEPS = 2_000
ROLLOUT_TARGETS = 10_000
ROLLOUT_PARALLEL = 1_000
MIX_CALLBACKS_PER_S = 500
MIX_READS_PER_S = 100
STEP_PAGE = 100
#: connections of each kind (callbacks, reads) the mix is sent on
MIX_CONNECTIONS = 16
MIN_INTAKE_PER_S = 3_000.0
MAX_POST_P99_S = 0.020
MAX_GET_P99_S = 0.050
MIN_THROUGHPUT_SHARE = 0.80


def _fleetwave() -> list[str]:
    return [str(Path(sys.executable).parent / "fleetwave")]


# -- the database ------------------------------------------------------------------


@dataclass
class World:
    db: str
    reader: str
    #: the rollout's strategy (None: no rollout), and the callbacks' strategy
    rollout_sid: int | None
    callback_sid: int
    #: (step id, agent token) of each callback step
    agents: list[tuple[int, str]]


def setup(db: str, callback_steps: int, rollout_targets: int, parallel: int) -> World:
    """The targets, the strategies and the tokens. Not measured."""
    store = open_store(db)
    wf = get_workflow("patch")
    assert wf is not None
    admin.add_targets(store, [Target(name=f"c{i:06d}") for i in range(callback_steps)])
    callback_sid = admin.create_strategy(
        store,
        wf,
        StrategyOptions(max_parallel=1),
        target_names=[f"c{i:06d}" for i in range(callback_steps)],
    )
    rollout_sid = None
    if rollout_targets:
        admin.add_targets(store, [Target(name=f"r{i:06d}") for i in range(rollout_targets)])
        rollout_sid = admin.create_strategy(
            store,
            wf,
            StrategyOptions(max_parallel=parallel),
            target_names=[f"r{i:06d}" for i in range(rollout_targets)],
        )
    reader = tokens.create_token(store, "bench", tokens.Role.READER, None)
    from fleetwave.store.schema import steps

    with store.read() as conn:
        step_ids = [
            int(r.id)
            for r in conn.execute(
                select(steps.c.id).where(steps.c.strategy_id == callback_sid).order_by(steps.c.id)
            )
        ]
    now = time.time()
    agents = [(s, tokens.new_secret(tokens.AGENT_PREFIX)) for s in step_ids]
    tokens.issue_agent_tokens(
        store,
        [
            (callback_sid, s, CALLBACK_STATE, tokens.token_hash(t), now, now + 86_400)
            for s, t in agents
        ],
    )
    store.dispose()
    return World(db, reader, rollout_sid, callback_sid, agents)


def apply(db: str, sid: int) -> None:
    store = open_store(db)
    admin.apply_strategy(store, sid)
    store.dispose()


def _applier(db: str, sid: int, ready: Any, go: Any, done: Any) -> None:
    """(A process of its own, as an operator's command would be.) Apply the strategy
    once ``go`` is set."""
    ready.set()
    go.wait()
    apply(db, sid)
    done.set()


class Applier:
    """The operator's apply, from a process of its own, started (and its imports made)
    before the run: applied in a thread of this process, it held the load's loop (the
    GIL) for tens of milliseconds, and the requests due meanwhile counted that as the
    server's latency."""

    def __init__(self, db: str, sid: int) -> None:
        ctx = mp.get_context("spawn")
        ready, self.go, self.done = ctx.Event(), ctx.Event(), ctx.Event()
        self.proc = ctx.Process(target=_applier, args=(db, sid, ready, self.go, self.done))
        self.proc.start()
        if not ready.wait(60):
            self.proc.kill()
            raise RuntimeError("the applying process did not start")

    async def apply(self) -> None:
        self.go.set()
        while not await asyncio.to_thread(self.done.wait, 1.0):
            if not self.proc.is_alive():
                raise RuntimeError("the apply failed (its process ended)")

    def close(self) -> None:
        self.proc.join(30)
        if self.proc.is_alive():
            self.proc.kill()


def stored_callbacks(db: str, sid: int) -> int:
    store = open_store(db)
    with store.read() as conn:
        n = conn.execute(
            select(func.count()).select_from(callbacks).where(callbacks.c.strategy_id == sid)
        ).scalar_one()
    store.dispose()
    return int(n)


def rollout_figures(db: str, sid: int) -> tuple[str, int, float]:
    """The strategy's state, its transitions, and the span of its journal (s)."""
    store = open_store(db)
    with store.read() as conn:
        state = conn.execute(select(strategies.c.state).where(strategies.c.id == sid)).scalar_one()
        n, first, last = conn.execute(
            select(func.count(), func.min(journal.c.at), func.max(journal.c.at)).where(
                journal.c.strategy_id == sid
            )
        ).one()
    store.dispose()
    return str(state), int(n), float(last - first) if n else math.nan


# -- the server --------------------------------------------------------------------


@dataclass
class Server:
    proc: subprocess.Popen[str]
    host: str
    port: int
    lines: list[str] = field(default_factory=list)

    def cpu_s(self) -> float:
        """CPU seconds of the server's processes: ``serve`` and those it started (the
        API's own process)."""
        return sum(self.cpu_by_process())

    def cpu_by_process(self) -> tuple[float, float]:
        """CPU seconds of ``serve``'s own process (the engine), and of those it started
        (the API's)."""

        def of(pid: int) -> float:
            with contextlib.suppress(FileNotFoundError):
                fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
                return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
            return 0.0

        return of(self.proc.pid), sum(of(pid) for pid in _children(self.proc.pid))

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=60)


def _children(pid: int) -> list[int]:
    """The processes ``pid`` started, and theirs."""
    found: list[int] = []
    with contextlib.suppress(FileNotFoundError):
        for task in Path(f"/proc/{pid}/task").iterdir():
            for child in (task / "children").read_text().split():
                found += [int(child), *_children(int(child))]
    return found


#: extra ``serve`` options (``--serve-args``)
SERVE_ARGS: list[str] = []


def start_server(db: str) -> Server:
    proc = subprocess.Popen(
        [*_fleetwave(), "serve", "--listen", "127.0.0.1:0", "--db", db, *SERVE_ARGS],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    lines: list[str] = []
    found: list[tuple[str, int]] = []
    ready = threading.Event()

    def read() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            lines.append(line)
            m = re.search(r"API on http://([\d.]+):(\d+)/v1", line)
            if m and not found:
                found.append((m.group(1), int(m.group(2))))
                ready.set()
        ready.set()

    threading.Thread(target=read, daemon=True).start()
    ready.wait(60)
    if not found:
        proc.kill()
        raise RuntimeError("serve did not start: " + "".join(lines))
    return Server(proc, found[0][0], found[0][1], lines)


# -- the client --------------------------------------------------------------------


class Connection:
    """One keep-alive HTTP/1.1 connection: a request at a time, its status and time."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer

    @classmethod
    async def open(cls, host: str, port: int) -> Connection:
        reader, writer = await asyncio.open_connection(host, port)
        return cls(reader, writer)

    async def request(self, raw: bytes) -> tuple[int, bytes]:
        self.writer.write(raw)
        status_line = await self.reader.readline()
        if not status_line:
            raise ConnectionError("the server closed the connection")
        status = int(status_line.split(b" ", 2)[1])
        length = 0
        while True:
            line = await self.reader.readline()
            if line in (b"\r\n", b"\n", b""):
                break
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value.strip())
        body = await self.reader.readexactly(length) if length else b""
        return status, body

    def close(self) -> None:
        self.writer.close()


def callback_request(step: int, token: str, key: str) -> bytes:
    body = json.dumps(
        {"state": CALLBACK_STATE, "idempotency_key": key, "kind": "heartbeat", "details": ""}
    ).encode()
    head = (
        f"POST /v1/steps/{step}/callbacks HTTP/1.1\r\nHost: bench\r\n"
        f"Authorization: Bearer {token}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


def get_request(path: str, token: str) -> bytes:
    return f"GET {path} HTTP/1.1\r\nHost: bench\r\nAuthorization: Bearer {token}\r\n\r\n".encode()


@dataclass
class Tally:
    latencies_s: list[float] = field(default_factory=list)
    statuses: dict[int, int] = field(default_factory=dict)

    def add(self, status: int, took_s: float) -> None:
        self.latencies_s.append(took_s)
        self.statuses[status] = self.statuses.get(status, 0) + 1

    def pct(self, p: float) -> float:
        lat = sorted(self.latencies_s)
        if not lat:
            return math.nan
        return lat[min(len(lat) - 1, max(0, math.ceil(p / 100 * len(lat)) - 1))]


async def flood(world: World, server: Server, connections: int, seconds: float) -> Tally:
    """Callbacks as fast as they are answered, on ``connections`` connections."""
    tally = Tally()
    end = time.perf_counter() + seconds
    run = secrets.token_hex(4)

    async def one(n: int) -> None:
        conn = await Connection.open(server.host, server.port)
        i = 0
        try:
            while time.perf_counter() < end:
                step, token = world.agents[(n + i * connections) % len(world.agents)]
                raw = callback_request(step, token, f"{run}-{n}-{i}")
                t0 = time.perf_counter()
                status, _ = await conn.request(raw)
                tally.add(status, time.perf_counter() - t0)
                i += 1
        finally:
            conn.close()

    await asyncio.gather(*(one(n) for n in range(connections)))
    return tally


async def steady_mix(
    world: World,
    server: Server,
    stop: asyncio.Event,
    callbacks_per_s: int,
    reads_per_s: int,
    counted_from: list[float],
) -> tuple[Tally, Tally]:
    """An open-loop mix until ``stop``: each request is due at its time and sent on the
    next free connection of its kind (``MIX_CONNECTIONS`` each, as agents and a
    dashboard behind a proxy would hold them); its latency counts from when it was
    due, so time queued for a connection counts too. Only requests due from
    ``counted_from[0]`` on (the apply: set by the caller) are counted: the ones before
    get the connections open and the load steady (the first ones on new connections,
    to a server that has answered nothing yet, took up to 250 ms)."""
    posts, gets = Tally(), Tally()
    run = secrets.token_hex(4)
    assert world.rollout_sid is not None
    sid = world.rollout_sid
    queues: dict[str, asyncio.Queue[tuple[float, bytes] | None]] = {
        "post": asyncio.Queue(),
        "get": asyncio.Queue(),
    }

    async def sender(kind: str, tally: Tally) -> None:
        conn = await Connection.open(server.host, server.port)
        queue = queues[kind]
        try:
            while (item := await queue.get()) is not None:
                due, raw = item
                status, _ = await conn.request(raw)
                if due >= counted_from[0]:
                    tally.add(status, time.perf_counter() - due)
        finally:
            conn.close()

    senders = [
        asyncio.create_task(sender(kind, tally))
        for kind, tally in (("post", posts), ("get", gets))
        for _ in range(MIX_CONNECTIONS)
    ]
    t0 = time.perf_counter()
    sent_posts = sent_gets = 0
    while not stop.is_set():
        elapsed = time.perf_counter() - t0
        while sent_posts < elapsed * callbacks_per_s:
            step, token = world.agents[sent_posts % len(world.agents)]
            due = t0 + sent_posts / callbacks_per_s
            queues["post"].put_nowait((due, callback_request(step, token, f"{run}-{sent_posts}")))
            sent_posts += 1
        while sent_gets < elapsed * reads_per_s:
            if sent_gets % 2 == 0:
                path = f"/v1/strategies/{sid}"
            else:
                path = f"/v1/strategies/{sid}/steps?limit={STEP_PAGE}"
            due = t0 + sent_gets / reads_per_s
            queues["get"].put_nowait((due, get_request(path, world.reader)))
            sent_gets += 1
        await asyncio.sleep(0.002)
    for queue in queues.values():
        for _ in range(MIX_CONNECTIONS):
            queue.put_nowait(None)
    await asyncio.gather(*senders)
    return posts, gets


async def wait_rollout(db: str, sid: int, stop: asyncio.Event, timeout_s: float) -> None:
    """Until the strategy ends: looked at with the standard library's sqlite3 (opening
    the store each time held the client's loop long enough to send its load in
    bursts), on a thread (a read waiting on the database must not hold the load)."""
    deadline = time.monotonic() + timeout_s
    conn = sqlite3.connect(db, timeout=30, check_same_thread=False)

    def state_now() -> str:
        (state,) = conn.execute("SELECT state FROM strategies WHERE id = ?", (sid,)).fetchone()
        conn.commit()  # (a fresh snapshot next time)
        return str(state)

    try:
        while time.monotonic() < deadline:
            if await asyncio.to_thread(state_now) in ("complete", "failed", "aborted"):
                break
            await asyncio.sleep(0.2)
    finally:
        conn.close()
    stop.set()


# -- the scenarios -----------------------------------------------------------------


def _ms(s: float) -> str:
    return f"{s * 1000:.1f} ms"


def scenario_intake(quick: bool, connections: int, seconds: float) -> ScenarioReport:
    with tempfile.TemporaryDirectory(prefix="fleetwave-api-bench-") as tmp:
        db = str(Path(tmp) / "bench.db")
        world = setup(db, CALLBACK_STEPS, 0, 1)
        server = start_server(db)
        try:
            cpu0 = server.cpu_s()
            t0 = time.perf_counter()
            tally = event_loop.run(flood(world, server, connections, seconds))
            wall = time.perf_counter() - t0
            cpu = server.cpu_s() - cpu0
        finally:
            server.stop()
        stored = stored_callbacks(db, world.callback_sid)
    accepted = tally.statuses.get(202, 0)
    per_s = accepted / wall
    checks = [
        Check(
            "accepted callbacks/s (202, each a stored row)",
            f">= {MIN_INTAKE_PER_S:,.0f}",
            f"{per_s:,.0f}",
            per_s >= MIN_INTAKE_PER_S,
        ),
        Check(
            "every 202 stored",
            "rows = 202s",
            f"{stored:,} rows, {accepted:,} answered 202",
            stored == accepted,
        ),
    ]
    figures = [
        (
            "load",
            f"{connections} keep-alive connections, heartbeats with unique keys, "
            f"{CALLBACK_STEPS:,} steps with agent tokens, for {seconds:g} s",
        ),
        ("answers by status", ", ".join(f"{k}: {v:,}" for k, v in sorted(tally.statuses.items()))),
        ("accepted per second", f"{per_s:,.0f}"),
        (
            "latency p50 / p99 / max",
            f"{_ms(tally.pct(50))} / {_ms(tally.pct(99))} / {_ms(tally.pct(100))}",
        ),
        ("server CPU per callback", f"{cpu / max(1, accepted) * 1e6:.0f} us"),
        ("server CPU / wall", f"{cpu:.2f} s / {wall:.2f} s"),
        ("other load: 1-min load average after", f"{os.getloadavg()[0]:.2f}"),
    ]
    return ScenarioReport("api_intake", quick, [], figures, checks)


@dataclass
class RolloutRun:
    state: str
    transitions: int
    span_s: float
    server_cpu_s: float
    posts: Tally | None = None
    gets: Tally | None = None
    #: the server's CPU seconds: the engine's process, the API's
    cpu_split: tuple[float, float] = (0.0, 0.0)

    @property
    def per_s(self) -> float:
        return self.transitions / self.span_s


def run_rollout(targets: int, parallel: int, loaded: bool) -> RolloutRun:
    with tempfile.TemporaryDirectory(prefix="fleetwave-api-bench-") as tmp:
        db = str(Path(tmp) / "bench.db")
        world = setup(db, CALLBACK_STEPS, targets, parallel)
        assert world.rollout_sid is not None
        sid = world.rollout_sid
        server = start_server(db)
        applier = Applier(db, sid)
        try:
            cpu0 = server.cpu_by_process()

            async def drive() -> tuple[Tally, Tally] | None:
                stop = asyncio.Event()
                counted_from = [math.inf]
                waiting = asyncio.create_task(wait_rollout(db, sid, stop, 600))
                mix = None
                if loaded:
                    mix = asyncio.create_task(
                        steady_mix(
                            world,
                            server,
                            stop,
                            MIX_CALLBACKS_PER_S,
                            MIX_READS_PER_S,
                            counted_from,
                        )
                    )
                    await asyncio.sleep(0.5)  # the load steady before the rollout starts
                counted_from[0] = time.perf_counter()
                await applier.apply()
                await waiting
                return await mix if mix is not None else None

            tallies = event_loop.run(drive())
            cpu1 = server.cpu_by_process()
            cpu = (cpu1[0] - cpu0[0], cpu1[1] - cpu0[1])
        finally:
            server.stop()
            applier.close()
        state, n, span = rollout_figures(db, sid)
    posts, gets = tallies if tallies is not None else (None, None)
    return RolloutRun(state, n, span, sum(cpu), posts, gets, cpu)


def _merged(tallies: list[Tally]) -> Tally:
    out = Tally()
    for t in tallies:
        out.latencies_s.extend(t.latencies_s)
        for k, v in t.statuses.items():
            out.statuses[k] = out.statuses.get(k, 0) + v
    return out


def scenario_mixed(quick: bool, repeat: int) -> ScenarioReport:
    """``repeat`` pairs, each a rollout alone then one with the load (in fresh
    databases): this VM's speed drifts by up to a factor of two between minutes, so one
    pair says little. The share is the median loaded throughput over the median alone;
    the latencies are those of every loaded run together."""
    targets, parallel = (2_000, 200) if quick else (ROLLOUT_TARGETS, ROLLOUT_PARALLEL)
    pairs: list[tuple[RolloutRun, RolloutRun]] = []
    for n in range(repeat):
        alone = run_rollout(targets, parallel, loaded=False)
        loaded = run_rollout(targets, parallel, loaded=True)
        print(
            f"  pair {n + 1}: alone {alone.per_s:,.0f}/s, with the load {loaded.per_s:,.0f}/s",
            flush=True,
        )
        pairs.append((alone, loaded))
    alone_per_s = statistics.median(a.per_s for a, _ in pairs)
    loaded_per_s = statistics.median(b.per_s for _, b in pairs)
    share = loaded_per_s / alone_per_s
    posts = _merged([b.posts for _, b in pairs if b.posts is not None])
    gets = _merged([b.gets for _, b in pairs if b.gets is not None])
    post99, get99 = posts.pct(99), gets.pct(99)
    states = [r.state for pair in pairs for r in pair]
    checks = [
        Check(
            "callback POST p99", f"< {_ms(MAX_POST_P99_S)}", _ms(post99), post99 < MAX_POST_P99_S
        ),
        Check("GET p99", f"< {_ms(MAX_GET_P99_S)}", _ms(get99), get99 < MAX_GET_P99_S),
        Check(
            "rollout throughput with the load / alone (medians)",
            f">= {MIN_THROUGHPUT_SHARE:.0%}",
            f"{share:.0%}",
            share >= MIN_THROUGHPUT_SHARE,
        ),
        Check(
            "every rollout completes",
            "complete",
            ", ".join(sorted(set(states))),
            set(states) == {"complete"},
        ),
    ]

    def statuses(t: Tally) -> str:
        return ", ".join(f"{k}: {v:,}" for k, v in sorted(t.statuses.items()))

    figures = [
        (
            "rollout",
            f"{targets:,} sim targets, patch, max parallel {parallel}, zero latency, "
            "driven by the server's engine",
        ),
        (
            "load",
            f"{MIX_CALLBACKS_PER_S}/s callbacks (heartbeats, unique keys) and "
            f"{MIX_READS_PER_S}/s reads (strategy show, step list pages of {STEP_PAGE}), "
            f"open loop on {MIX_CONNECTIONS} connections of each kind (latency from when a "
            "request was due), from the apply to the rollout's end",
        ),
        ("runs", f"{repeat} pair(s): alone, then with the load, in fresh databases"),
    ]
    for n, (alone, loaded) in enumerate(pairs, 1):
        line = (
            f"alone {alone.per_s:,.0f}/s ({alone.span_s:.2f} s, CPU engine "
            f"{alone.cpu_split[0]:.2f} s, API {alone.cpu_split[1]:.2f} s); with the load "
            f"{loaded.per_s:,.0f}/s ({loaded.span_s:.2f} s, CPU engine "
            f"{loaded.cpu_split[0]:.2f} s, API {loaded.cpu_split[1]:.2f} s)"
        )
        if loaded.posts is not None:
            line += f"; POST p50 / p99 {_ms(loaded.posts.pct(50))} / {_ms(loaded.posts.pct(99))}"
        figures.append((f"pair {n}: transitions/s ({alone.transitions:,} each)", line))
    figures += [
        ("medians: alone / with the load", f"{alone_per_s:,.0f}/s / {loaded_per_s:,.0f}/s"),
        (
            "callback POST, all loaded runs: answers; p50 / p99 / max",
            f"{statuses(posts)}; {_ms(posts.pct(50))} / {_ms(post99)} / {_ms(posts.pct(100))}",
        ),
        (
            "GET, all loaded runs: answers; p50 / p99 / max",
            f"{statuses(gets)}; {_ms(gets.pct(50))} / {_ms(get99)} / {_ms(gets.pct(100))}",
        ),
        ("other load: 1-min load average after", f"{os.getloadavg()[0]:.2f}"),
    ]
    return ScenarioReport("api_mixed", quick, [], figures, checks)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else None)
    parser.add_argument("--scenario", choices=["intake", "mixed", "all"], default="all")
    parser.add_argument("--quick", action="store_true", help="smaller and shorter runs")
    parser.add_argument("--connections", type=int, default=100, help="intake: connections")
    parser.add_argument("--seconds", type=float, default=None, help="intake: how long")
    parser.add_argument(
        "--repeat", type=int, default=3, help="mixed: pairs of runs (alone, with the load)"
    )
    parser.add_argument("--results", type=Path, default=DEFAULT_RESULTS, help="markdown to update")
    parser.add_argument(
        "--serve-args", default="", help="extra options for serve, e.g. '--one-process'"
    )
    args = parser.parse_args(argv)
    SERVE_ARGS[:] = args.serve_args.split()
    env = environment()
    reports = []
    if args.scenario in ("intake", "all"):
        seconds = args.seconds or (3.0 if args.quick else 10.0)
        reports.append(scenario_intake(args.quick, args.connections, seconds))
        print_report(reports[-1])
    if args.scenario in ("mixed", "all"):
        reports.append(scenario_mixed(args.quick, max(1, args.repeat)))
        print_report(reports[-1])
    write_results(args.results, reports, env)
    print(f"\nwrote {args.results}")
    return 0 if all(c.passed for r in reports for c in r.checks) else 1


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
