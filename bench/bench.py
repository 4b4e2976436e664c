"""Benchmark of the fleetwave engine: durable transition throughput, I/O overlap, scale.

What it measures (each scenario in a fresh SQLite database in a temporary directory,
``synchronous=FULL`` as :func:`fleetwave.store.db.open_store` sets by default):

``throughput``
    10,000 zero-latency sim targets (settings ``{}``), ``patch`` workflow, max parallel
    1,000. Durable transitions per second = committed transitions / wall time of
    ``Conductor.run`` (the count from ``conductor.stats.transitions``, cross-checked
    against the journal's row count), dispatch latency p50/p99 (commit done -> action
    started, ``EngineConfig(measure_latency=True)``) and peak RSS.
    Targets: >= 10,000 transitions/s and p99 < 10 ms.
``io_bound``
    1,000 sim targets with a fixed 20 ms latency per operation (``{"latency_ms": 20}``),
    ``patch`` (5 states), max parallel 200. Wall time against the ideal
    targets * states * 0.020 s / max parallel = 0.5 s. Target: ratio <= 1.15. It is
    run five times (three with ``--quick``), each in fresh processes and a fresh
    database; the median run's figures are shown and checked, and every run's ratio
    is listed: a single half-second run moves by 10 % with the VM's noise. Before
    each run its process times a fixed Python loop and an fdatasync of 40 KB beside
    the database, listed with the runs: how fast the VM was just then.
``sim_scale``
    ``fleetwave sim`` at scale: 10,000 targets through ``patch`` with all faults on
    virtual time, seeds 1, 2 and 3, each in its own process, without failure limits
    (no stop on failure, no threshold: every target runs its course). Target: under a
    minute of wall time each, and no guarantee violated.
``scale``
    100,000 zero-latency targets, ``patch``, max parallel 1,000. Peak RSS (target
    < 1.5 GB) and time per transition, compared with a 10,000-target run (target:
    ratio <= 1.3). Three pairs (one with ``--quick``), each the 10,000-target run then
    the 100,000-target one back to back, so a pair sees one phase of the VM (a single
    run's time per transition moves by up to 40 % between phases); the median pair's
    ratio is shown and checked, and the largest peak RSS.

After each run the invariants (:func:`fleetwave.testing.invariants.check`) are checked
and reported; their time is not part of any measured figure.

Each scenario runs in its own processes: one that creates the database (targets,
strategy, apply; never measured) and one that only drives the strategy, so the
reported peak RSS (``getrusage(RUSAGE_SELF).ru_maxrss``) is that of the engine run
alone (imports and opening the store included).

Run it from the repository root::

    .venv/bin/python bench/bench.py                      # all scenarios, full sizes
    .venv/bin/python bench/bench.py --scenario throughput
    .venv/bin/python bench/bench.py --quick              # smaller sizes, a sanity run

``--quick`` runs ``throughput`` with 2,000 targets and ``scale`` with 20,000 (against
2,000); ``io_bound`` is short already and keeps its size.

It prints the figures and a PASS/FAIL per target, and writes them to
``bench/RESULTS.md`` (``--results`` to write elsewhere): one section per scenario and
size, replaced when that scenario is run again, with the command, date and machine
that produced it. The exit status is 1 when a target is missed, or a scenario could
not be measured at all (its process failed), and 0 when every target is met.

The figures are only as quiet as the machine: each run records the load average and
how often its process was preempted, and a digest of ``src/`` before and after.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import json
import math
import os
import platform
import re
import resource
import shlex
import sqlite3
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import sqlalchemy
from sqlalchemy import func, select

from fleetwave.domain.models import StrategyOptions, Target
from fleetwave.domain.registry import get_workflow
from fleetwave.engine import loop as event_loop
from fleetwave.engine.conductor import Conductor
from fleetwave.engine.config import EngineConfig
from fleetwave.store import admin
from fleetwave.store.db import open_store
from fleetwave.store.schema import journal
from fleetwave.testing.invariants import check
from fleetwave.testing.simulate import FAULTS

BENCH_DIR = Path(__file__).resolve().parent
REPO_DIR = BENCH_DIR.parent
DEFAULT_RESULTS = BENCH_DIR / "RESULTS.md"
SCENARIOS = ("throughput", "io_bound", "scale", "sim_scale")
WORKFLOW = "patch"

# Targets of the brief.
MIN_TRANSITIONS_PER_S = 10_000.0
MAX_P99_LATENCY_S = 0.010
IO_RUNS = 5
MAX_IO_RATIO = 1.15
MAX_SCALE_RSS_BYTES = 1.5e9
MAX_SCALE_TIME_RATIO = 1.3
SCALE_PAIRS = 3
MAX_SIM_WALL_S = 60.0
SIM_SEEDS = (1, 2, 3)


# -- what a run is, and what it measured ---------------------------------------------


@dataclass(frozen=True)
class RunSpec:
    """One strategy run: how many targets, how wide, how slow each operation is."""

    targets: int
    max_parallel: int
    #: fixed sim latency per operation; 0 means zero-latency targets (settings {})
    latency_ms: float = 0.0


@dataclass(frozen=True)
class RunResult:
    """What the run process measured (all times in seconds, sizes in bytes)."""

    spec: RunSpec
    states: int
    final_state: str
    wall_s: float
    cpu_s: float
    transitions: int
    journal_rows: int
    expected_transitions: int
    batches: int
    rejected: int
    stale_outcomes: int
    latency_count: int
    latency_p50_s: float
    latency_p99_s: float
    latency_max_s: float
    #: dispatches slower than the p99 goal (10 ms)
    latency_over_goal: int
    rss_before_run: int
    peak_rss_run: int
    peak_rss_with_check: int
    check_ok: bool
    check_violations: list[str]
    check_s: float
    setup_s: float
    #: times the run process was preempted (other load on the machine)
    involuntary_switches: int
    #: 1-minute load average just before and just after the run
    load_before: float
    load_after: float
    #: how fast the VM was just before the run (its speed moves from minute to minute):
    #: a fixed piece of Python (ms), and the median fdatasync of 40 KB rewritten in a
    #: file beside the database (us)
    probe_python_ms: float = math.nan
    probe_fsync_us: float = math.nan

    @property
    def transitions_per_s(self) -> float:
        return self.transitions / self.wall_s

    @property
    def time_per_transition_s(self) -> float:
        return self.wall_s / self.transitions

    @property
    def counts_agree(self) -> bool:
        return self.transitions == self.journal_rows == self.expected_transitions


@dataclass(frozen=True)
class Check:
    """One target of the brief: what it asks, what was measured, met or not."""

    name: str
    goal: str
    measured: str
    passed: bool


@dataclass
class ScenarioReport:
    scenario: str
    quick: bool
    runs: list[tuple[str, RunResult]]
    figures: list[tuple[str, str]]
    checks: list[Check]


# -- child processes ----------------------------------------------------------------


def _peak_rss_bytes() -> int:
    # Linux reports ru_maxrss in KiB.
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _cpu_s_and_preemptions() -> tuple[float, int]:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime, ru.ru_nivcsw


def _percentile(sorted_values: list[float], pct: float) -> float:
    """Nearest-rank percentile of an already sorted list (nan when empty)."""
    if not sorted_values:
        return math.nan
    rank = max(1, math.ceil(pct / 100.0 * len(sorted_values)))
    return sorted_values[rank - 1]


def child_setup(db: str, spec: RunSpec) -> dict[str, Any]:
    """Create the targets and the strategy, and apply it. Not measured."""
    t0 = time.perf_counter()
    wf = get_workflow(WORKFLOW)
    assert wf is not None, f"workflow {WORKFLOW} is not registered"
    store = open_store(db)
    settings: dict[str, Any] = {"latency_ms": spec.latency_ms} if spec.latency_ms else {}
    admin.add_targets(
        store, [Target(name=f"t{i:06d}", settings=dict(settings)) for i in range(spec.targets)]
    )
    sid = admin.create_strategy(
        store, wf, StrategyOptions(max_parallel=spec.max_parallel), all_targets=True
    )
    admin.apply_strategy(store, sid)
    store.dispose()
    return {"sid": sid, "states": len(wf.state_names), "setup_s": time.perf_counter() - t0}


def child_run(db: str, sid: int, spec: RunSpec, states: int, setup_s: float) -> dict[str, Any]:
    """Drive the strategy with a fresh conductor and measure it; then check invariants."""
    store = open_store(db)
    conductor = Conductor(store, config=EngineConfig(measure_latency=True))
    rss_before = _peak_rss_bytes()

    async def timed_run() -> tuple[dict[int, str], float]:
        t0 = time.perf_counter()
        final = await conductor.run(strategy_ids=[sid])
        return final, time.perf_counter() - t0

    probe_python_ms, probe_fsync_us = _probe_vm(Path(db).parent)
    load_before = os.getloadavg()[0]
    cpu0, nivcsw0 = _cpu_s_and_preemptions()
    final, wall_s = event_loop.run(timed_run())
    cpu1, nivcsw1 = _cpu_s_and_preemptions()
    load_after = os.getloadavg()[0]
    peak_run = _peak_rss_bytes()

    with store.read() as conn:
        journal_rows = conn.execute(
            select(func.count()).select_from(journal).where(journal.c.strategy_id == sid)
        ).scalar_one()
    t0 = time.perf_counter()
    verdict = check(store, sid)
    check_s = time.perf_counter() - t0
    store.dispose()

    stats = conductor.stats
    lat = sorted(stats.dispatch_latency_s)
    result = RunResult(
        spec=spec,
        states=states,
        final_state=final.get(sid, "?"),
        wall_s=wall_s,
        cpu_s=cpu1 - cpu0,
        transitions=stats.transitions,
        journal_rows=int(journal_rows),
        # initial -> first state, one move per state, last state -> complete
        expected_transitions=spec.targets * (states + 1),
        batches=stats.batches,
        rejected=stats.rejected,
        stale_outcomes=stats.stale_outcomes,
        latency_count=len(lat),
        latency_p50_s=_percentile(lat, 50),
        latency_p99_s=_percentile(lat, 99),
        latency_max_s=lat[-1] if lat else math.nan,
        latency_over_goal=sum(1 for x in lat if x >= MAX_P99_LATENCY_S),
        rss_before_run=rss_before,
        peak_rss_run=peak_run,
        peak_rss_with_check=_peak_rss_bytes(),
        check_ok=verdict.ok,
        check_violations=verdict.violations[:10],
        check_s=check_s,
        setup_s=setup_s,
        involuntary_switches=nivcsw1 - nivcsw0,
        load_before=load_before,
        load_after=load_after,
        probe_python_ms=probe_python_ms,
        probe_fsync_us=probe_fsync_us,
    )
    return asdict(result)


def _probe_vm(directory: Path) -> tuple[float, float]:
    """How fast the machine is just now: a fixed piece of Python (ms), and the median
    of 21 fdatasyncs of 40 KB rewritten in a scratch file in ``directory`` (us)."""
    t0 = time.perf_counter()
    total = 0
    for i in range(200_000):
        total += i & 7
    python_ms = (time.perf_counter() - t0) * 1e3
    sync = getattr(os, "fdatasync", os.fsync)
    path = directory / "probe.bin"
    block = b"\0" * 40_960
    took: list[float] = []
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        for _ in range(21):
            os.pwrite(fd, block, 0)
            t0 = time.perf_counter()
            sync(fd)
            took.append(time.perf_counter() - t0)
    finally:
        os.close(fd)
        path.unlink(missing_ok=True)
    return python_ms, sorted(took)[10] * 1e6


def _spawn(role: str, payload: dict[str, Any]) -> dict[str, Any]:
    """Run this script as a child process in ``role``; returns the JSON it wrote."""
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as fh:
        out = Path(fh.name)
    try:
        cmd = [sys.executable, str(Path(__file__).resolve()), "--child", role]
        cmd += ["--payload", json.dumps(payload), "--out", str(out)]
        proc = subprocess.run(cmd, check=False)
        if proc.returncode != 0:
            raise RuntimeError(f"{role} process exited with status {proc.returncode}")
        data: dict[str, Any] = json.loads(out.read_text())
        return data
    finally:
        out.unlink(missing_ok=True)


def child_sim(seed: int, targets: int) -> dict[str, Any]:
    """One deterministic simulation: patch, all faults, on virtual time."""
    import logging

    from fleetwave.testing.simulate import SimConfig, run_simulation

    logging.getLogger("fleetwave").setLevel(logging.CRITICAL)
    # Without failure limits: every target runs its course (a seed that stops early
    # after a few failures says little about scale).
    cfg = SimConfig(seed=seed, targets=targets, workflow=WORKFLOW, failure_limits=False)
    res = run_simulation(cfg)
    data = asdict(res)
    data["peak_rss"] = _peak_rss_bytes()
    return data


def _child_main(role: str, payload: dict[str, Any], out: Path) -> None:
    if role == "sim":
        out.write_text(json.dumps(child_sim(payload["seed"], payload["targets"])))
        return
    spec = RunSpec(**payload["spec"])
    if role == "setup":
        data = child_setup(payload["db"], spec)
    elif role == "run":
        data = child_run(payload["db"], payload["sid"], spec, payload["states"], payload["setup_s"])
    else:
        raise SystemExit(f"unknown child role {role!r}")
    out.write_text(json.dumps(data))


def measure(spec: RunSpec) -> RunResult:
    """One run in a fresh database: set up in one process, drive in another."""
    with tempfile.TemporaryDirectory(prefix="fleetwave-bench-") as tmp:
        db = str(Path(tmp) / "bench.db")
        setup = _spawn("setup", {"db": db, "spec": asdict(spec)})
        data = _spawn(
            "run",
            {
                "db": db,
                "sid": setup["sid"],
                "states": setup["states"],
                "setup_s": setup["setup_s"],
                "spec": asdict(spec),
            },
        )
    data["spec"] = RunSpec(**data["spec"])
    return RunResult(**data)


# -- scenarios ---------------------------------------------------------------------


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.2f} ms"


def _mb(nbytes: float) -> str:
    return f"{nbytes / 1e6:,.0f} MB"


def _run_figures(label: str, r: RunResult) -> list[tuple[str, str]]:
    p = f"{label}: " if label else ""
    s = r.spec
    shape = f"{s.targets:,} targets x {r.states} states, max parallel {s.max_parallel:,}"
    shape += f", latency {s.latency_ms:g} ms" if s.latency_ms else ", zero latency"
    agree = "agree" if r.counts_agree else "DISAGREE"
    return [
        (f"{p}run", shape),
        (f"{p}final strategy state", r.final_state),
        (f"{p}wall time of Conductor.run", f"{r.wall_s:.3f} s"),
        (f"{p}CPU time during the run", f"{r.cpu_s:.3f} s"),
        (
            f"{p}transitions (stats / journal / expected)",
            f"{r.transitions:,} / {r.journal_rows:,} / {r.expected_transitions:,} ({agree})",
        ),
        (f"{p}durable transitions per second", f"{r.transitions_per_s:,.0f}"),
        (f"{p}time per transition", f"{r.time_per_transition_s * 1e6:.1f} us"),
        (
            f"{p}group commits (batches), mean size",
            f"{r.batches:,}, {r.transitions / max(r.batches, 1):.1f}",
        ),
        (
            f"{p}dispatch latency p50 / p99 / max ({r.latency_count:,} samples)",
            f"{_ms(r.latency_p50_s)} / {_ms(r.latency_p99_s)} / {_ms(r.latency_max_s)}",
        ),
        (
            f"{p}dispatches >= {_ms(MAX_P99_LATENCY_S)}",
            f"{r.latency_over_goal:,} ({r.latency_over_goal / max(r.latency_count, 1):.2%})",
        ),
        (f"{p}rejected transitions, stale outcomes", f"{r.rejected}, {r.stale_outcomes}"),
        (
            f"{p}RSS before the run / peak RSS of the run / peak incl. check",
            f"{_mb(r.rss_before_run)} / {_mb(r.peak_rss_run)} / {_mb(r.peak_rss_with_check)}",
        ),
        (
            f"{p}invariants check",
            ("ok" if r.check_ok else f"FAILED: {r.check_violations}") + f" ({r.check_s:.2f} s)",
        ),
        (
            f"{p}other load: 1-min load average before / after, preemptions",
            f"{r.load_before:.2f} / {r.load_after:.2f}, {r.involuntary_switches:,}",
        ),
        (f"{p}setup (not measured)", f"{r.setup_s:.1f} s"),
    ]


def _invariant_check(label: str, r: RunResult) -> Check:
    return Check(
        f"invariants ({label})" if label else "invariants",
        "check() ok, counts agree, complete",
        f"ok={r.check_ok}, counts agree={r.counts_agree}, state={r.final_state}",
        r.check_ok and r.counts_agree and r.final_state == "complete",
    )


def scenario_throughput(quick: bool) -> ScenarioReport:
    r = measure(RunSpec(targets=2_000 if quick else 10_000, max_parallel=1_000))
    checks = [
        Check(
            "throughput",
            f">= {MIN_TRANSITIONS_PER_S:,.0f} transitions/s",
            f"{r.transitions_per_s:,.0f} transitions/s",
            r.transitions_per_s >= MIN_TRANSITIONS_PER_S,
        ),
        Check(
            "dispatch latency p99",
            f"< {_ms(MAX_P99_LATENCY_S)}",
            _ms(r.latency_p99_s),
            r.latency_p99_s < MAX_P99_LATENCY_S,
        ),
        _invariant_check("", r),
    ]
    return ScenarioReport("throughput", quick, [("", r)], _run_figures("", r), checks)


def scenario_io_bound(quick: bool) -> ScenarioReport:
    """Run it IO_RUNS times (each in fresh processes): one run is at the mercy of the VM."""
    spec = RunSpec(targets=1_000, max_parallel=200, latency_ms=20.0)
    runs = [measure(spec) for _ in range(3 if quick else IO_RUNS)]
    ideal = spec.targets * runs[0].states * (spec.latency_ms / 1000.0) / spec.max_parallel
    runs.sort(key=lambda run: run.wall_s)
    r = runs[len(runs) // 2]  # the median run: its figures are the ones shown
    ratio = r.wall_s / ideal
    figures = _run_figures("median run", r)
    figures.insert(3, ("ideal wall time (targets x states x latency / parallel)", f"{ideal:.3f} s"))
    figures.insert(4, ("ratio wall / ideal, median run", f"{ratio:.3f}"))
    figures.insert(
        5,
        (
            f"ratio wall / ideal, all {len(runs)} runs",
            ", ".join(f"{run.wall_s / ideal:.3f}" for run in runs),
        ),
    )
    figures.insert(
        6,
        (
            "the VM just before each run, same order: a fixed Python loop / fdatasync 40 KB",
            ", ".join(
                f"{run.probe_python_ms:.0f} ms / {run.probe_fsync_us:.0f} us" for run in runs
            ),
        ),
    )
    checks = [
        Check("wall / ideal (median)", f"<= {MAX_IO_RATIO}", f"{ratio:.3f}", ratio <= MAX_IO_RATIO),
        *(_invariant_check(f"run {i + 1}", run) for i, run in enumerate(runs)),
    ]
    return ScenarioReport("io_bound", quick, [("", r)], figures, checks)


def scenario_scale(quick: bool) -> ScenarioReport:
    """SCALE_PAIRS pairs of runs, each the small run then the big one back to back, so
    both of a pair see the same phase of the VM; judged on the median pair's ratio."""
    base_spec = RunSpec(targets=2_000 if quick else 10_000, max_parallel=1_000)
    big_spec = RunSpec(targets=20_000 if quick else 100_000, max_parallel=1_000)
    pairs = []
    for _ in range(1 if quick else SCALE_PAIRS):
        baseline = measure(base_spec)
        big = measure(big_spec)
        pairs.append((big.time_per_transition_s / baseline.time_per_transition_s, big, baseline))
    pairs.sort(key=lambda pair: pair[0])
    ratio, big, baseline = pairs[len(pairs) // 2]
    peak = max(pair[1].peak_rss_run for pair in pairs)
    big_label = f"{big.spec.targets:,}"
    base_label = f"{baseline.spec.targets:,}"
    figures = _run_figures(f"median pair, {big_label}", big)
    figures += _run_figures(f"median pair, {base_label}", baseline)
    figures.append(
        (
            f"time per transition {big_label} / {base_label}, median pair",
            f"{big.time_per_transition_s * 1e6:.1f} us / "
            f"{baseline.time_per_transition_s * 1e6:.1f} us = {ratio:.3f}",
        )
    )
    figures.append(
        (
            f"ratio of each pair (us per transition, {big_label} / {base_label} targets)",
            ", ".join(
                f"{r:.3f} ({b.time_per_transition_s * 1e6:.1f} / "
                f"{s.time_per_transition_s * 1e6:.1f})"
                for r, b, s in pairs
            ),
        )
    )
    figures.append((f"peak RSS of the {big_label}-target runs, largest", _mb(peak)))
    checks = [
        Check(
            f"peak RSS ({big_label} targets, largest of {len(pairs)})",
            f"< {_mb(MAX_SCALE_RSS_BYTES)}",
            _mb(peak),
            peak < MAX_SCALE_RSS_BYTES,
        ),
        Check(
            "time per transition ratio (median pair)",
            f"<= {MAX_SCALE_TIME_RATIO}",
            f"{ratio:.3f}",
            ratio <= MAX_SCALE_TIME_RATIO,
        ),
        *(_invariant_check(f"{big_label}, pair {i + 1}", b) for i, (_, b, _) in enumerate(pairs)),
        *(_invariant_check(f"{base_label}, pair {i + 1}", b) for i, (_, _, b) in enumerate(pairs)),
    ]
    return ScenarioReport(
        "scale", quick, [(big_label, big), (base_label, baseline)], figures, checks
    )


# -- the environment and RESULTS.md --------------------------------------------------


def scenario_sim_scale(quick: bool) -> ScenarioReport:
    """``fleetwave sim``: 10,000 targets, patch, all faults, each seed in its own process."""
    targets = 2_000 if quick else 10_000
    figures: list[tuple[str, str]] = [
        (
            "run",
            f"{targets:,} targets, patch, all faults ({', '.join(FAULTS)}), "
            "no failure limits, virtual time",
        ),
    ]
    checks: list[Check] = []
    for seed in SIM_SEEDS:
        d = _spawn("sim", {"seed": seed, "targets": targets})
        figures += [
            (f"seed {seed}: wall time", f"{d['wall_s']:.1f} s"),
            (f"seed {seed}: virtual time", f"{d['virtual_s'] / 3600:.1f} h"),
            (
                f"seed {seed}: transitions, crashes, clean stops, db retries",
                f"{d['transitions']:,}, {d['crashes']}, {d['stops']}, {d['store_retries']}",
            ),
            (f"seed {seed}: final strategy state", d["strategy_state"]),
            (f"seed {seed}: peak RSS", _mb(d["peak_rss"])),
            (f"seed {seed}: journal digest", d["digest"][:16]),
        ]
        checks.append(
            Check(
                f"seed {seed} wall time",
                f"< {MAX_SIM_WALL_S:.0f} s",
                f"{d['wall_s']:.1f} s",
                d["wall_s"] < MAX_SIM_WALL_S,
            )
        )
        checks.append(
            Check(
                f"seed {seed} guarantees",
                "no violation",
                "ok" if d["ok"] else "; ".join(d["violations"][:3]),
                bool(d["ok"]),
            )
        )
    return ScenarioReport("sim_scale", quick, [], figures, checks)


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""


def _cmd(args: list[str]) -> str:
    try:
        return subprocess.run(args, capture_output=True, text=True, check=False).stdout.strip()
    except OSError:
        return ""


def src_digest() -> str:
    """A digest of the code under test (every file under src/), to notice edits mid-run."""
    h = hashlib.sha256()
    for path in sorted((REPO_DIR / "src").rglob("*.py")):
        h.update(str(path.relative_to(REPO_DIR)).encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def environment() -> list[tuple[str, str]]:
    cpu = re.search(r"^model name\s*:\s*(.+)$", _read("/proc/cpuinfo"), re.M)
    mem = re.search(r"^MemTotal:\s*(\d+) kB", _read("/proc/meminfo"), re.M)
    commit = _cmd(["git", "-C", str(REPO_DIR), "rev-parse", "--short", "HEAD"]) or "unknown"
    dirty = _cmd(["git", "-C", str(REPO_DIR), "status", "--porcelain", "--", "src"]).splitlines()
    if dirty:
        commit += f" + uncommitted changes to {len(dirty)} paths under src/"
    return [
        ("command", shlex.join(sys.orig_argv)),
        ("working directory", os.getcwd()),
        ("date", datetime.now(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")),
        ("uname -a", _cmd(["uname", "-a"]) or platform.platform()),
        ("CPU", cpu.group(1).strip() if cpu else platform.processor() or "unknown"),
        ("nproc", str(os.cpu_count())),
        ("memory", f"{int(mem.group(1)) / 1024 / 1024:.1f} GiB" if mem else "unknown"),
        ("Python", sys.version.replace("\n", " ")),
        ("SQLite", sqlite3.sqlite_version),
        ("SQLAlchemy", sqlalchemy.__version__),
        ("event loop", _loop_description()),
        ("fleetwave commit", commit),
        ("src/ digest at start", src_digest()),
    ]


def _loop_description() -> str:
    kind = event_loop.loop_kind()
    if kind == "uvloop":
        version = importlib.metadata.version("uvloop")
        return f"uvloop {version} (FLEETWAVE_LOOP=asyncio for the standard loop)"
    return "asyncio (standard library)"


HEADER = """# fleetwave benchmark results

Written by `bench/bench.py` (see its docstring for what each scenario measures).
Each section below is replaced when its scenario is run again and records the
command, date and machine that produced it. Every figure is from one run (io_bound:
the median of five) in a fresh SQLite database (WAL, `synchronous=FULL`), the engine
run in its own process.
"""

_SECTION_RE = re.compile(
    r"<!-- section: (?P<key>[^>]+?) -->\n(?P<body>.*?)<!-- /section -->\n", re.S
)


def _section_key(report: ScenarioReport) -> str:
    return f"{report.scenario} {'quick' if report.quick else 'full'}"


def _render_section(report: ScenarioReport, env: list[tuple[str, str]]) -> str:
    size = "quick sizes (--quick)" if report.quick else "full sizes"
    lines = [f"## {report.scenario}: {size}", ""]
    lines += ["| Target | Goal | Measured | Result |", "|---|---|---|---|"]
    lines += [
        f"| {c.name} | {c.goal} | {c.measured} | {'PASS' if c.passed else 'FAIL'} |"
        for c in report.checks
    ]
    lines += ["", "| Figure | Value |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in report.figures]
    lines += ["", "| Environment | |", "|---|---|"]
    lines += [f"| {k} | `{v}` |" for k, v in env]
    return "\n".join(lines) + "\n\n"


def write_results(path: Path, reports: list[ScenarioReport], env: list[tuple[str, str]]) -> None:
    write_sections(path, {_section_key(r): _render_section(r, env) for r in reports})


def write_sections(path: Path, new: dict[str, str]) -> None:
    """Replace (or add) the sections ``new`` (key: body, ending in a newline) of the
    results file; the others are kept as they are."""
    sections = {m["key"]: m["body"] for m in _SECTION_RE.finditer(_read(str(path)))}
    sections.update(new)
    order = [f"{s} {mode}" for mode in ("full", "quick") for s in SCENARIOS]
    keys = [k for k in order if k in sections] + [k for k in sections if k not in order]
    parts = [HEADER]
    parts += [f"<!-- section: {k} -->\n{sections[k]}<!-- /section -->\n" for k in keys]
    path.write_text("\n".join(parts))


# -- main --------------------------------------------------------------------------


def scenario_main(
    run: Callable[[bool], ScenarioReport], doc: str | None, quick: str, argv: list[str] | None
) -> int:
    """``main`` of a script that runs one scenario (``--quick``: ``quick`` says what it
    runs then): prints the figures, writes its section; 1 when a goal is missed."""
    parser = argparse.ArgumentParser(description=doc.split("\n")[0] if doc else None)
    parser.add_argument("--quick", action="store_true", help=quick)
    parser.add_argument("--results", type=Path, default=DEFAULT_RESULTS, help="markdown to update")
    args = parser.parse_args(argv)
    env = environment()
    report = run(args.quick)
    print_report(report)
    write_results(args.results, [report], env)
    print(f"\nwrote {args.results}")
    return 0 if all(c.passed for c in report.checks) else 1


def print_report(report: ScenarioReport) -> None:
    size = "quick" if report.quick else "full"
    print(f"\n== {report.scenario} ({size}) ==")
    width = max(len(k) for k, _ in report.figures)
    for k, v in report.figures:
        print(f"  {k:<{width}}  {v}")
    for c in report.checks:
        verdict = "PASS" if c.passed else "FAIL"
        print(f"  [{verdict}] {c.name}: {c.measured} (goal {c.goal})")
    sys.stdout.flush()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else None)
    parser.add_argument("--scenario", choices=[*SCENARIOS, "all"], default="all")
    parser.add_argument("--quick", action="store_true", help="smaller sizes: a sanity run")
    parser.add_argument("--results", type=Path, default=DEFAULT_RESULTS, help="markdown to update")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--payload", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.child:
        _child_main(args.child, json.loads(args.payload), args.out)
        return 0

    wanted = SCENARIOS if args.scenario == "all" else (args.scenario,)
    env = environment()
    print(f"fleetwave benchmark: {', '.join(wanted)} ({'quick' if args.quick else 'full'} sizes)")
    for k, v in env:
        print(f"  {k}: {v}")
    reports: list[ScenarioReport] = []
    errors: list[str] = []
    for name in wanted:
        try:
            if name == "throughput":
                report = scenario_throughput(args.quick)
            elif name == "io_bound":
                report = scenario_io_bound(args.quick)
            elif name == "sim_scale":
                report = scenario_sim_scale(args.quick)
            else:
                report = scenario_scale(args.quick)
        except RuntimeError as exc:
            errors.append(f"{name}: {exc}")
            print(f"\n== {name} ==\n  ERROR: not measured: {exc}", file=sys.stderr)
            continue
        reports.append(report)
        print_report(report)

    digest = src_digest()
    if digest != dict(env)["src/ digest at start"]:
        env.append(
            ("src/ digest at end", f"{digest}: CHANGED during the run, figures may mix code")
        )
        print(f"\nWARNING: files under src/ changed during the run (digest now {digest})")
    if reports:
        write_results(args.results, reports, env)
        print(f"\nwrote {args.results}")
    print("\nsummary:")
    for report in reports:
        for c in report.checks:
            print(f"  {'PASS' if c.passed else 'FAIL'}  {report.scenario}: {c.name}")
    for err in errors:
        print(f"  ERROR {err}")
    # 1 when a goal is missed, as when a scenario could not run: a script sees it
    missed = any(not c.passed for report in reports for c in report.checks)
    return 1 if errors or missed else 0


if __name__ == "__main__":
    sys.exit(main())
