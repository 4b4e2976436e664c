"""Durable transitions per second on PostgreSQL with 1 to N conductors, and their cost.

Each conductor runs in its own OS process (as on separate hosts): a
``Conductor(store, config=EngineConfig(share=True, measure_latency=True))`` serving
with ``run(stop=...)``. Once every conductor is registered and idle, the strategy
(10,000 zero-latency sim targets through ``patch``: 5 states, six transitions a step,
max parallel 1,000) is applied; the conductors are woken by its notification, one
leads it and the others help. The wall time runs from the apply to the moment the
strategies row says ``complete`` (polled every 5 ms); then the conductors are stopped
cleanly and ``check`` is run on the journal.

Reported: transitions/s (journal rows / wall time), each conductor's share (journal
rows by conductor), dispatch latency p50/p99 (commit done -> next action started) per
conductor and overall, and the database's cost of one transition from the server's own
counters: WAL bytes (``pg_current_wal_lsn()``) and WAL syncs (``pg_stat_wal``),
transactions and rows inserted/updated (``pg_stat_database``), statements and their
server time (``pg_stat_statements``, when the server has it loaded), round trips
(counted in each conductor process: every psycopg ``execute``, ``executemany`` (one
pipeline), ``commit`` and ``rollback``), and CPU seconds (each conductor process, and
the server's processes when the server is local). Targets (issue #26): >= 20,000
transitions/s with one conductor, a p99 under 10 ms; with 2 and 3 no lower a total.

    .venv/bin/python bench/pg_throughput.py                      # 1 conductor
    .venv/bin/python bench/pg_throughput.py --conductors 3       # 3 processes
    .venv/bin/python bench/pg_throughput.py --url postgresql://...   # an existing server
    .venv/bin/python bench/pg_throughput.py --targets 2000 --no-results  # a sanity run

Without ``--url`` it starts a throw-away cluster with ``scripts/pg.sh`` (fsync on,
``synchronous_commit=on``, a unix socket in a temporary directory, with
``pg_stat_statements`` loaded and WAL I/O timed) and stops it afterwards. Each run uses a
new database. The figures are printed and written to ``bench/RESULTS.md``, a section
per conductor count (``pg_throughput, N conductor(s)``).
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import psycopg
from sqlalchemy.engine import make_url

from bench import write_sections
from fleetwave.domain.models import StrategyOptions, Target
from fleetwave.domain.registry import get_workflow
from fleetwave.engine.conductor import Conductor, EngineConfig
from fleetwave.engine.config import BATCH_MAX_SERVER
from fleetwave.store import admin
from fleetwave.store import runtime as rt
from fleetwave.store.db import open_store
from fleetwave.testing.invariants import check

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "RESULTS.md"
SECTION = "## pg_throughput"
MIN_TRANSITIONS_PER_S = 20_000.0
MAX_P99_S = 0.010
#: the throw-away server's extra settings: statements counted, WAL syncs timed
SERVER_OPTS = "-c shared_preload_libraries=pg_stat_statements -c track_wal_io_timing=on"
POLL_S = 0.005
#: the parent's poll of the strategy's state (named, to leave it out of the statements)
POLL_SQL = "SELECT state AS bench_poll FROM strategies WHERE id = %s"


# -- in each conductor's process ---------------------------------------------------------

#: psycopg calls that each make one round trip to the server (counted in this process)
_ROUND_TRIPS = [0]
#: wall and CPU seconds spent inside the writer's commit (the loop waits on it)
_COMMIT_S = [0.0, 0.0]


def _time_commits() -> None:
    """Wrap the transition writer's commit to time it (wall and this process's CPU)."""
    original = rt.TransitionWriter.commit

    def timed(self: Any, *args: Any, **kwargs: Any) -> Any:
        wall, cpu = time.perf_counter(), time.process_time()
        try:
            return original(self, *args, **kwargs)
        finally:
            _COMMIT_S[0] += time.perf_counter() - wall
            _COMMIT_S[1] += time.process_time() - cpu

    rt.TransitionWriter.commit = timed  # type: ignore[method-assign]


def _count_round_trips() -> None:
    """Wrap psycopg's execute, executemany (one pipeline: one round trip), commit and
    rollback to count them."""

    def counted(cls: Any, name: str) -> None:
        original = getattr(cls, name)

        def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
            _ROUND_TRIPS[0] += 1
            return original(self, *args, **kwargs)

        setattr(cls, name, wrapper)

    for name in ("execute", "executemany"):
        counted(psycopg.Cursor, name)
    for name in ("commit", "rollback"):
        counted(psycopg.Connection, name)


def _conductor_process(
    url: str, cid: str, batch_max: int, ready: Any, stop_ev: Any, out: Any
) -> None:
    """One conductor: serve until the parent says stop; report what it counted."""
    _count_round_trips()
    _time_commits()
    store = open_store(url)
    conductor = Conductor(
        store,
        config=EngineConfig(share=True, measure_latency=True, batch_max=batch_max),
        conductor_id=cid,
    )
    marks: dict[str, float] = {}

    def on_ready() -> None:
        marks["cpu0"] = time.process_time()
        marks["rt0"] = _ROUND_TRIPS[0]
        marks["cw0"], marks["cc0"] = _COMMIT_S
        marks["w0"] = time.perf_counter()
        ready.put(cid)

    async def serve() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()

        def wait_for_stop() -> None:
            stop_ev.wait()
            marks["cpu1"] = time.process_time()
            marks["rt1"] = _ROUND_TRIPS[0]
            marks["cw1"], marks["cc1"] = _COMMIT_S
            marks["w1"] = time.perf_counter()
            loop.call_soon_threadsafe(stop.set)

        threading.Thread(target=wait_for_stop, daemon=True).start()
        await conductor.run(stop=stop, on_ready=on_ready)

    asyncio.run(serve())
    store.dispose()
    stats = conductor.stats
    out.put(
        {
            "id": cid,
            "transitions": stats.transitions,
            "commits": stats.batches,
            "latency": sorted(stats.dispatch_latency_s),
            "cpu_s": marks.get("cpu1", 0.0) - marks.get("cpu0", 0.0),
            "round_trips": int(marks.get("rt1", 0) - marks.get("rt0", 0)),
            "commit_wall_s": marks.get("cw1", 0.0) - marks.get("cw0", 0.0),
            "commit_cpu_s": marks.get("cc1", 0.0) - marks.get("cc0", 0.0),
        }
    )


# -- the parent ------------------------------------------------------------------------


@dataclass
class Counters:
    lsn: str
    xacts: int
    inserted: int
    updated: int


def _counters(url: str) -> Counters:
    dbname = make_url(url).database
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("SELECT pg_stat_clear_snapshot()")
        lsn = conn.execute("SELECT pg_current_wal_lsn()::text").fetchone()
        row = conn.execute(
            "SELECT xact_commit, tup_inserted, tup_updated FROM pg_stat_database "
            "WHERE datname = %s",
            (dbname,),
        ).fetchone()
    assert lsn is not None and row is not None
    return Counters(str(lsn[0]), int(row[0]), int(row[1]), int(row[2]))


def _wal_bytes(url: str, before: str, after: str) -> int:
    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute("SELECT pg_wal_lsn_diff(%s, %s)", (after, before)).fetchone()
    assert row is not None
    return int(row[0])


def _pct(values: list[float], pct: float) -> float:
    if not values:
        return float("nan")
    return values[min(len(values) - 1, round(pct / 100 * (len(values) - 1)))]


def _server_processes(url: str) -> list[psutil.Process]:
    """The server's processes (its postmaster and children), when it runs on this host
    and its data directory can be read here; none otherwise."""
    try:
        with psycopg.connect(url, autocommit=True) as conn:
            row = conn.execute("SHOW data_directory").fetchone()
        assert row is not None
        pid = int((Path(str(row[0])) / "postmaster.pid").read_text().split()[0])
        postmaster = psutil.Process(pid)
        return [postmaster, *postmaster.children(recursive=True)]
    except (psycopg.Error, OSError, ValueError, IndexError, psutil.Error):
        return []


def _server_cpu(url: str) -> dict[int, float]:
    """CPU seconds of each of the server's processes, by pid (only this server's)."""
    seen: dict[int, float] = {}
    for proc in _server_processes(url):
        try:
            t = proc.cpu_times()
        except psutil.Error:
            continue
        seen[proc.pid] = t.user + t.system
    return seen


@dataclass
class Statement:
    query: str
    calls: int
    rows: int
    exec_ms: float


@dataclass
class Share:
    id: str
    journal_rows: int
    commits: int
    p50_ms: float
    p99_ms: float
    cpu_s: float
    round_trips: int
    commit_wall_s: float
    commit_cpu_s: float


@dataclass
class PgRun:
    conductors: int
    final: str
    targets: int
    max_parallel: int
    transitions: int
    wall_s: float
    per_s: float
    p50_ms: float
    p99_ms: float
    commits: int
    wal_bytes: int
    xacts: int
    inserted: int
    updated: int
    check: str
    synchronous_commit: str
    server: str
    load_before: float
    round_trips: int
    client_cpu_s: float
    server_cpu_s: float | None
    wal: dict[str, float] | None
    steps_updates: int
    steps_hot: int
    batch_max: int
    steps_fillfactor: int | None
    statements: list[Statement] = field(default_factory=list)
    shares: list[Share] = field(default_factory=list)


def _stat_statements(url: str) -> bool:
    """Whether pg_stat_statements counts here (created in the database, and reset)."""
    try:
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
            conn.execute("SELECT pg_stat_statements_reset()")
    except psycopg.Error:
        return False
    return True


def _statements(url: str) -> list[Statement]:
    with psycopg.connect(url, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT query, calls, rows, total_exec_time FROM pg_stat_statements "
            "WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database()) "
            "AND query NOT LIKE '%pg_stat_statements%' AND query NOT LIKE '%bench_poll%' "
            "ORDER BY calls DESC"
        ).fetchall()
    return [Statement(str(q), int(c), int(r), float(t)) for q, c, r, t in rows]


def _wal_stats(url: str, reset: bool) -> dict[str, float] | None:
    try:
        with psycopg.connect(url, autocommit=True) as conn:
            if reset:
                conn.execute("SELECT pg_stat_reset_shared('wal')")
                return None
            conn.execute("SELECT pg_stat_clear_snapshot()")
            row = conn.execute(
                "SELECT wal_records, wal_fpi, wal_bytes, wal_write, wal_sync, "
                "wal_write_time, wal_sync_time FROM pg_stat_wal"
            ).fetchone()
    except psycopg.Error:
        return None
    if row is None:
        return None
    keys = ("records", "fpi", "bytes", "writes", "syncs", "write_ms", "sync_ms")
    return {k: float(v) for k, v in zip(keys, row, strict=True)}


def _hot_updates(url: str) -> tuple[int, int]:
    """The steps table's updates, and how many of them were HOT (no index entry)."""
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("SELECT pg_stat_clear_snapshot()")
        row = conn.execute(
            "SELECT n_tup_upd, n_tup_hot_upd FROM pg_stat_user_tables WHERE relname = 'steps'"
        ).fetchone()
    return (int(row[0]), int(row[1])) if row else (0, 0)


def run(
    url: str,
    targets: int,
    max_parallel: int,
    conductors: int,
    batch_max: int = 0,
    steps_fillfactor: int | None = None,
) -> PgRun:
    wf = get_workflow("patch")
    assert wf is not None
    store = open_store(url)
    if steps_fillfactor is not None:
        # (room left in each page of steps for its updates to stay HOT, or none: 100)
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute(f"ALTER TABLE steps SET (fillfactor = {int(steps_fillfactor)})")
    admin.add_targets(store, [Target(name=f"t{i:06d}") for i in range(targets)])
    sid = admin.create_strategy(
        store, wf, StrategyOptions(max_parallel=max_parallel), all_targets=True
    )
    with psycopg.connect(url, autocommit=True) as conn:
        sync = conn.execute("SHOW synchronous_commit").fetchone()
        version = conn.execute("SHOW server_version").fetchone()
    ctx = mp.get_context("spawn")
    ready: Any = ctx.Queue()
    out: Any = ctx.Queue()
    stop_ev = ctx.Event()
    ids = [f"bench-{i + 1}" for i in range(conductors)]
    procs = [
        ctx.Process(
            target=_conductor_process, args=(url, cid, batch_max, ready, stop_ev, out), name=cid
        )
        for cid in ids
    ]
    for p in procs:
        p.start()
    reports: list[dict[str, Any]] = []
    try:
        for _ in ids:
            ready.get(timeout=120)
        time.sleep(0.6)  # (the statistics' last report of the setup)
        statements_on = _stat_statements(url)
        _wal_stats(url, reset=True)
        before = _counters(url)
        hot_before = _hot_updates(url)
        cpu_before = _server_cpu(url)
        load = os.getloadavg()[0]
        polls = 0
        with psycopg.connect(url, autocommit=True) as conn:
            t0 = time.perf_counter()
            admin.apply_strategy(store, sid)
            while True:
                row = conn.execute(POLL_SQL, (sid,)).fetchone()
                polls += 1
                state = str(row[0]) if row else "?"
                if state in ("complete", "failed", "aborted"):
                    break
                if time.perf_counter() - t0 > 600:
                    state = f"{state} (gave up after 600 s)"
                    break
                time.sleep(POLL_S)
            wall = time.perf_counter() - t0
        cpu_after = _server_cpu(url)
        wal = _wal_stats(url, reset=False)
        stop_ev.set()
        for _ in ids:
            reports.append(out.get(timeout=120))
    finally:
        stop_ev.set()
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    time.sleep(1.5)  # (the run's statistics reach pg_stat_database late)
    after = _counters(url)
    hot_after = _hot_updates(url)
    statements = _statements(url) if statements_on else []
    with psycopg.connect(url, autocommit=True) as conn:
        by_conductor: dict[str, int] = dict(
            conn.execute(
                "SELECT conductor, count(*) FROM journal WHERE strategy_id = %s GROUP BY conductor",
                (sid,),
            ).fetchall()
        )
    verdict = check(store, sid)
    store.dispose()
    n = sum(int(v) for v in by_conductor.values())
    lat = sorted(x for r in reports for x in r["latency"])
    shares = [
        Share(
            id=r["id"],
            journal_rows=int(by_conductor.get(r["id"], 0)),
            commits=r["commits"],
            p50_ms=_pct(r["latency"], 50) * 1000,
            p99_ms=_pct(r["latency"], 99) * 1000,
            cpu_s=r["cpu_s"],
            round_trips=r["round_trips"],
            commit_wall_s=r["commit_wall_s"],
            commit_cpu_s=r["commit_cpu_s"],
        )
        for r in sorted(reports, key=lambda r: str(r["id"]))
    ]
    server_cpu = None
    if cpu_before or cpu_after:
        server_cpu = sum(t - cpu_before.get(pid, 0.0) for pid, t in cpu_after.items())
    return PgRun(
        conductors=conductors,
        final=state,
        targets=targets,
        max_parallel=max_parallel,
        transitions=n,
        wall_s=wall,
        per_s=n / wall,
        p50_ms=_pct(lat, 50) * 1000,
        p99_ms=_pct(lat, 99) * 1000,
        commits=sum(r["commits"] for r in reports),
        wal_bytes=_wal_bytes(url, before.lsn, after.lsn),
        # (the parent's polls of the strategies row are transactions too: not counted)
        xacts=after.xacts - before.xacts - polls,
        inserted=after.inserted - before.inserted,
        updated=after.updated - before.updated,
        check="ok" if verdict.ok else f"FAILED: {verdict.violations[:3]}",
        synchronous_commit=str(sync[0]) if sync else "?",
        server=str(version[0]) if version else "?",
        load_before=load,
        round_trips=sum(r["round_trips"] for r in reports),
        client_cpu_s=sum(r["cpu_s"] for r in reports),
        server_cpu_s=server_cpu,
        wal=wal,
        steps_updates=hot_after[0] - hot_before[0],
        steps_hot=hot_after[1] - hot_before[1],
        batch_max=batch_max,
        steps_fillfactor=steps_fillfactor,
        statements=statements,
        shares=shares,
    )


def _throw_away_server() -> tuple[str, str]:
    directory = tempfile.mkdtemp(prefix="fleetwave-pgbench-")
    url = subprocess.run(
        ["bash", str(ROOT / "scripts" / "pg.sh"), "start", directory],
        check=True,
        capture_output=True,
        text=True,
        env={**os.environ, "PG_SERVER_OPTS": SERVER_OPTS},
    ).stdout.strip()
    return directory, url


def _new_database(url: str) -> str:
    name = f"fwbench_{os.getpid()}_{int(time.time())}"
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    return make_url(url).set(database=name).render_as_string(hide_password=False)


def _title(n: int) -> str:
    return f"{SECTION}, {n} conductor{'s' if n != 1 else ''}"


def _short(query: str) -> str:
    q = " ".join(query.split())
    return (q[:70] + "...") if len(q) > 73 else q


def _render(r: PgRun, command: str) -> str:
    n = max(r.transitions, 1)
    ok_rate = r.per_s >= MIN_TRANSITIONS_PER_S
    ok_p99 = r.p99_ms < MAX_P99_S * 1000
    lines = [
        _title(r.conductors),
        "",
        f"- command: `{command}`",
        f"- machine: {platform.node()}, {os.cpu_count()} cores (shared with other work), "
        f"Python {platform.python_version()}, PostgreSQL {r.server} (local, unix socket, "
        f"fsync on, synchronous_commit={r.synchronous_commit}); load average before "
        f"the run {r.load_before:.2f}",
        f"- date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
        f"- {r.conductors} conductor process{'es' if r.conductors != 1 else ''}, "
        f"EngineConfig(share=True, batch_max={r.batch_max or BATCH_MAX_SERVER})"
        + (
            f", steps table fillfactor {r.steps_fillfactor}"
            if r.steps_fillfactor is not None
            else ""
        )
        + "; wall time from the apply to the strategies row reading complete",
        "",
        "| figure | value | target |",
        "| --- | --- | --- |",
        f"| {r.targets:,} targets x 5 states, max parallel {r.max_parallel:,} | "
        f"{r.final}, check {r.check} | |",
        f"| transitions (journal rows) / wall time | {r.transitions:,} / {r.wall_s:.2f} s | |",
        f"| durable transitions/s | {r.per_s:,.0f} | >= 20,000: {'PASS' if ok_rate else 'FAIL'} |",
        f"| dispatch latency p50 / p99 (all conductors) | {r.p50_ms:.2f} ms / "
        f"{r.p99_ms:.2f} ms | p99 < 10 ms: {'PASS' if ok_p99 else 'FAIL'} |",
        f"| writer commits (transitions per commit) | {r.commits:,} "
        f"({r.transitions / max(r.commits, 1):.0f}) | |",
        f"| server transactions (per transition) | {r.xacts:,} ({r.xacts / n:.3f}) | |",
        f"| WAL bytes per transition | {r.wal_bytes / n:,.0f} | |",
        f"| rows inserted / updated per transition | {r.inserted / n:.2f} / "
        f"{r.updated / n:.2f} | |",
        f"| updates of steps that were HOT (no index entries) | {r.steps_hot:,} of "
        f"{r.steps_updates:,} | |",
        f"| round trips per transition (per writer commit) | {r.round_trips / n:.3f} "
        f"({r.round_trips / max(r.commits, 1):.1f}) | |",
        f"| conductor CPU s per 1,000 transitions | {r.client_cpu_s / n * 1000:.3f} | |",
    ]
    if r.server_cpu_s is not None:
        lines.append(f"| server CPU s per 1,000 transitions | {r.server_cpu_s / n * 1000:.3f} | |")
    if r.wal is not None:
        w = r.wal
        lines.append(
            f"| WAL records / syncs (sync time) | {w['records']:,.0f} / {w['syncs']:,.0f} "
            f"({w['sync_ms']:,.0f} ms, {w['sync_ms'] / max(w['syncs'], 1):.2f} ms each) | |"
        )
    if r.statements:
        calls = sum(s.calls for s in r.statements)
        locks = [s for s in r.statements if "pg_advisory_xact_lock" in s.query]
        lock_ms = sum(s.exec_ms for s in locks)
        exec_ms = sum(s.exec_ms for s in r.statements) - lock_ms
        lines += [
            f"| statements per transition (per writer commit) | {calls / n:.3f} "
            f"({calls / max(r.commits, 1):.1f}) | |",
            f"| server execution time but the write lock, per writer commit | "
            f"{exec_ms / max(r.commits, 1):.2f} ms ({exec_ms:,.0f} ms in all) | |",
            f"| time waiting for the write lock (advisory), all conductors | "
            f"{lock_ms:,.0f} ms over {sum(s.calls for s in locks):,} write transactions | |",
        ]
    lines += [
        "",
        "Per conductor (CPU: the process's, from ready to stop; in commit: the wall "
        "time its loop waited in the writer's commit, and the CPU it used there):",
        "",
        "| conductor | journal rows (share) | commits | dispatch p50 / p99 | CPU s | "
        "in commit: wall s / CPU s | round trips |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for s in r.shares:
        lines.append(
            f"| {s.id} | {s.journal_rows:,} ({s.journal_rows / n:.0%}) | {s.commits:,} | "
            f"{s.p50_ms:.2f} ms / {s.p99_ms:.2f} ms | {s.cpu_s:.2f} | "
            f"{s.commit_wall_s:.2f} / {s.commit_cpu_s:.2f} | {s.round_trips:,} |"
        )
    if r.statements:
        lines += [
            "",
            "Statements (pg_stat_statements, the ten most called):",
            "",
            "| statement | calls | rows | server ms |",
            "| --- | --- | --- | --- |",
        ]
        for st in r.statements[:10]:
            q = _short(st.query).replace("|", "\\|")
            lines.append(f"| `{q}` | {st.calls:,} | {st.rows:,} | {st.exec_ms:,.0f} |")
    lines.append("")
    return "\n".join(lines)


def _write(section: str, conductors: int) -> None:
    """Replace (or add) this conductor count's section of RESULTS.md (as the other
    benchmarks write theirs)."""
    write_sections(RESULTS, {f"pg_throughput {conductors}": section.rstrip() + "\n\n"})


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", help="an existing server's maintenance database URL")
    parser.add_argument("--targets", type=int, default=10_000)
    parser.add_argument("--max-parallel", type=int, default=1_000)
    parser.add_argument("--conductors", type=int, default=1, help="conductor processes")
    parser.add_argument(
        "--batch-max",
        type=int,
        default=0,
        help="EngineConfig.batch_max (0, its default: 256 on PostgreSQL)",
    )
    parser.add_argument(
        "--steps-fillfactor",
        type=int,
        help="ALTER TABLE steps SET (fillfactor = N) before the steps are made (the schema's: "
        "70 on PostgreSQL since migration 0017; 100 is PostgreSQL's default)",
    )
    parser.add_argument("--no-results", action="store_true", help="do not write RESULTS.md")
    args = parser.parse_args()
    directory = None
    url = args.url
    if url is None:
        directory, url = _throw_away_server()
    try:
        result = run(
            _new_database(url),
            args.targets,
            args.max_parallel,
            args.conductors,
            args.batch_max,
            args.steps_fillfactor,
        )
    finally:
        if directory is not None:
            subprocess.run(["bash", str(ROOT / "scripts" / "pg.sh"), "stop", directory])
    command = "bench/pg_throughput.py " + " ".join(sys.argv[1:])
    section = _render(result, command.strip())
    print(section)
    if not args.no_results:
        _write(section, args.conductors)
    ok = (
        result.per_s >= MIN_TRANSITIONS_PER_S
        and result.p99_ms < MAX_P99_S * 1000
        and result.check == "ok"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
