"""Durable transitions per second on PostgreSQL, and what each costs the database.

One conductor drives 10,000 zero-latency sim targets through ``patch`` (5 states: six
transitions a step) at max parallel 1,000 against a local PostgreSQL server with
``synchronous_commit=on`` (its default: a commit returns once its WAL is flushed).
Reported: transitions/s (committed transitions / wall time of ``Conductor.run``),
dispatch latency p50/p99, and from the server's own counters the cost of one
transition: WAL bytes (``pg_current_wal_lsn()`` before and after), transactions, and
rows inserted and updated (``pg_stat_database``), with the commits the conductor made.
Targets (issue #26): >= 20,000 transitions/s and a p99 under 10 ms.

    .venv/bin/python bench/pg_throughput.py                  # a throw-away server
    .venv/bin/python bench/pg_throughput.py --url postgresql://...   # an existing one
    .venv/bin/python bench/pg_throughput.py --targets 2000   # a sanity run

Without ``--url`` it starts a throw-away cluster with ``scripts/pg.sh`` (fsync on, a unix
socket in a temporary directory) and stops it afterwards. Each run uses a new database.
The figures are printed and written to ``bench/RESULTS.md`` (section ``pg_throughput``).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import psycopg
from sqlalchemy.engine import make_url

from fleetwave.domain.models import StrategyOptions, Target
from fleetwave.domain.registry import get_workflow
from fleetwave.engine.conductor import Conductor, EngineConfig
from fleetwave.store import admin
from fleetwave.store.db import open_store
from fleetwave.testing.invariants import check

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "RESULTS.md"
SECTION = "## pg_throughput"
MIN_TRANSITIONS_PER_S = 20_000.0
MAX_P99_S = 0.010


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


@dataclass
class PgRun:
    final: str
    targets: int
    max_parallel: int
    transitions: int
    wall_s: float
    per_s: float
    p50_ms: float
    p99_ms: float
    commits: int
    per_commit: float
    wal_per_transition: float
    xacts: int
    inserted_per_transition: float
    updated_per_transition: float
    check: str
    synchronous_commit: str
    server: str
    load_before: float


def run(url: str, targets: int, max_parallel: int) -> PgRun:
    wf = get_workflow("patch")
    assert wf is not None
    store = open_store(url)
    admin.add_targets(store, [Target(name=f"t{i:06d}") for i in range(targets)])
    sid = admin.create_strategy(
        store, wf, StrategyOptions(max_parallel=max_parallel), all_targets=True
    )
    admin.apply_strategy(store, sid)
    conductor = Conductor(store, config=EngineConfig(measure_latency=True))
    with psycopg.connect(url, autocommit=True) as conn:
        sync = conn.execute("SHOW synchronous_commit").fetchone()
        version = conn.execute("SHOW server_version").fetchone()
    time.sleep(0.6)  # (the statistics collector's last report of the setup)
    before = _counters(url)
    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    final = asyncio.run(conductor.run(strategy_ids=[sid]))
    wall = time.perf_counter() - t0
    time.sleep(1.5)  # (its report of the run: the statistics reach pg_stat_database late)
    after = _counters(url)
    verdict = check(store, sid)
    store.dispose()
    stats = conductor.stats
    n = stats.transitions
    lat = sorted(stats.dispatch_latency_s)
    return PgRun(
        final=final.get(sid, "?"),
        targets=targets,
        max_parallel=max_parallel,
        transitions=n,
        wall_s=wall,
        per_s=n / wall,
        p50_ms=_pct(lat, 50) * 1000,
        p99_ms=_pct(lat, 99) * 1000,
        commits=stats.batches,
        per_commit=n / max(stats.batches, 1),
        wal_per_transition=_wal_bytes(url, before.lsn, after.lsn) / n,
        xacts=after.xacts - before.xacts,
        inserted_per_transition=(after.inserted - before.inserted) / n,
        updated_per_transition=(after.updated - before.updated) / n,
        check="ok" if verdict.ok else f"FAILED: {verdict.violations[:3]}",
        synchronous_commit=str(sync[0]) if sync else "?",
        server=str(version[0]) if version else "?",
        load_before=load,
    )


def _throw_away_server() -> tuple[str, str]:
    directory = tempfile.mkdtemp(prefix="fleetwave-pgbench-")
    url = subprocess.run(
        ["bash", str(ROOT / "scripts" / "pg.sh"), "start", directory],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    return directory, url


def _new_database(url: str) -> str:
    name = f"fwbench_{os.getpid()}_{int(time.time())}"
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    return make_url(url).set(database=name).render_as_string(hide_password=False)


def _render(r: PgRun, command: str) -> str:
    ok_rate = r.per_s >= MIN_TRANSITIONS_PER_S
    ok_p99 = r.p99_ms < MAX_P99_S * 1000
    lines = [
        SECTION,
        "",
        f"- command: `{command}`",
        f"- machine: {platform.node()}, {os.cpu_count()} cores, Python "
        f"{platform.python_version()}, PostgreSQL {r.server} (local, unix socket, "
        f"fsync on, synchronous_commit={r.synchronous_commit}); load average before "
        f"the run {r.load_before:.2f}",
        f"- date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
        "",
        "| figure | value | target |",
        "| --- | --- | --- |",
        f"| {r.targets:,} targets x 5 states, max parallel {r.max_parallel:,} | "
        f"{r.final}, check {r.check} | |",
        f"| durable transitions/s | {r.per_s:,.0f} | >= 20,000: {'PASS' if ok_rate else 'FAIL'} |",
        f"| dispatch latency p50 / p99 | {r.p50_ms:.2f} ms / "
        f"{r.p99_ms:.2f} ms | p99 < 10 ms: {'PASS' if ok_p99 else 'FAIL'} |",
        f"| commits (transitions per commit) | {r.commits:,} ({r.per_commit:.0f}) | |",
        f"| WAL bytes per transition | {r.wal_per_transition:,.0f} | |",
        f"| rows inserted / updated per transition | "
        f"{r.inserted_per_transition:.2f} / "
        f"{r.updated_per_transition:.2f} | |",
        f"| server transactions during the run | {r.xacts:,} | |",
        "",
    ]
    return "\n".join(lines)


def _write(section: str) -> None:
    text = RESULTS.read_text() if RESULTS.exists() else "# Benchmark results\n"
    start = text.find(SECTION + "\n")
    if start >= 0:
        end = text.find("\n## ", start + 1)
        text = text[:start] + section + ("" if end < 0 else text[end + 1 :])
    else:
        text = text.rstrip("\n") + "\n\n" + section
    RESULTS.write_text(text)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", help="an existing server's maintenance database URL")
    parser.add_argument("--targets", type=int, default=10_000)
    parser.add_argument("--max-parallel", type=int, default=1_000)
    parser.add_argument("--no-results", action="store_true", help="do not write RESULTS.md")
    args = parser.parse_args()
    directory = None
    url = args.url
    if url is None:
        directory, url = _throw_away_server()
    try:
        result = run(_new_database(url), args.targets, args.max_parallel)
    finally:
        if directory is not None:
            subprocess.run(["bash", str(ROOT / "scripts" / "pg.sh"), "stop", directory])
    command = "bench/pg_throughput.py " + " ".join(sys.argv[1:])
    section = _render(result, command.strip())
    print(section)
    if not args.no_results:
        _write(section)
    ok = (
        result.per_s >= MIN_TRANSITIONS_PER_S
        and result.p99_ms < MAX_P99_S * 1000
        and result.check == "ok"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
