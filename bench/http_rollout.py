"""Benchmark of the http driver: a ``patch`` rollout over real HTTP.

One ``fleetwave site-emulator`` process serves 1,000 sites on one loopback port (each
answer delayed by ``--latency-ms``; each site's build, apply and reboot last as the
config below says, at ``--time-scale``); a conductor in another process drives a
``patch`` strategy over them at max parallel 500 with the http driver (its targets
imported from the emulator's ``--targets-csv``, with polls of ``POLL_S``).

What it reports:

- the strategy completes, the invariants hold, and ``fleetwave check`` passes; every
  site applied its strategy exactly once (the emulator's counters);
- wall time of ``Conductor.run`` against the ideal from the emulator's own timings:
  each site needs at least ``MIN_REQUESTS`` answers (each ``latency_ms`` late) and its
  build, apply and reboot, and ``targets / max_parallel`` sites run one after the
  other in each slot. Target: ratio <= 1.2;
- the conductor's CPU per transition, against the sim driver's on a like rollout (the
  same targets, workflow and max parallel; sim operations of ``SIM_LATENCY_MS``).

The emulator's phases are 30 s a site (build 5 s, apply 20 s with a 5 s reboot) and
the driver polls every 5 s, or sooner when the site's progress says a phase ends
before then: about 15 requests a site. (Polling every 0.5 s, 1,000 requests a second,
took about a core in each process: httpx costs the conductor about 1 ms of CPU per
request. What still separates the run from its ideal is the start: 500 sites asking
at once, each round of 500 requests queues for a few hundred ms of CPU on both
sides; at max parallel 100 the same run is within 3 % of its ideal.)

Run it from the repository root (``--quick``: 200 sites at max parallel 100)::

    .venv/bin/python bench/http_rollout.py

It prints the figures and appends (replaces) its section in ``bench/RESULTS.md`` with
the command and machine. Exit status 1 when a target is missed.
"""

from __future__ import annotations

import csv
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import httpx

from bench import (
    Check,
    RunResult,
    RunSpec,
    ScenarioReport,
    _spawn,
    measure,
    scenario_main,
)
from fleetwave.domain.models import StrategyOptions, Target
from fleetwave.domain.registry import get_workflow
from fleetwave.store import admin
from fleetwave.store.db import open_store

#: site seconds: the build, the apply and the hosts' reboot within it
PHASES = {"build_s": 500, "apply_s": 2000, "reboot_s": 500, "reboot_at": 0.5}
TIME_SCALE = 0.01
LATENCY_MS = 20
#: how often the driver looks at a build or an apply (real seconds)
POLL_S = 5.0
#: each sim operation of the comparison run (its CPU per transition hardly depends on it)
SIM_LATENCY_MS = 200
#: a site's answers at the least, in order: pre-check 1 (the release), updating-patches
#: 1 (the upload), creating 2 (the create, the build's end), applying 3 (the strategy,
#: the apply, its end), finishing 2 (the release, the delete)
MIN_REQUESTS = 9
MAX_RATIO = 1.2


def _fleetwave() -> list[str]:
    exe = Path(sys.executable).parent / "fleetwave"
    return [str(exe)]


def start_emulator(tmp: Path, sites: int) -> tuple[subprocess.Popen[bytes], Path, Path]:
    config = tmp / "emulator.json"
    config.write_text(json.dumps({"defaults": PHASES}))
    err = tmp / "emulator.err"
    sites_csv = tmp / "sites.csv"
    with err.open("w") as out:
        proc = subprocess.Popen(
            [
                *_fleetwave(),
                "site-emulator",
                "--sites",
                str(sites),
                "--port",
                "0",
                "--time-scale",
                str(TIME_SCALE),
                "--latency-ms",
                str(LATENCY_MS),
                "--config",
                str(config),
                "--targets-csv",
                str(sites_csv),
            ],
            stdout=subprocess.DEVNULL,
            stderr=out,
        )
    deadline = time.monotonic() + 30
    while not re.search(r"on http://\S+/sites/", err.read_text()):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"the emulator did not start: {err.read_text()}")
        time.sleep(0.05)
    return proc, sites_csv, err


def setup(db: str, sites_csv: Path, max_parallel: int) -> int:
    store = open_store(db)
    with sites_csv.open() as f:
        rows = list(csv.DictReader(f))
    settings = {"build_poll_s": POLL_S, "apply_poll_s": POLL_S}
    admin.add_targets(
        store,
        [
            Target(name=r["name"], driver="http", settings={"url": r["url"], **settings})
            for r in rows
        ],
    )
    wf = get_workflow("patch")
    assert wf is not None
    sid = admin.create_strategy(
        store, wf, StrategyOptions(max_parallel=max_parallel), all_targets=True
    )
    admin.apply_strategy(store, sid)
    store.dispose()
    return sid


def ideal_s(targets: int, max_parallel: int) -> tuple[float, float]:
    """The whole rollout's ideal, and one site's: its answers' latency and its phases."""
    phases = (PHASES["build_s"] + PHASES["apply_s"] + PHASES["reboot_s"]) * TIME_SCALE
    one = MIN_REQUESTS * LATENCY_MS / 1000 + phases
    return math.ceil(targets / max_parallel) * one, one


def run(quick: bool) -> ScenarioReport:
    targets, max_parallel = (200, 100) if quick else (1000, 500)
    with tempfile.TemporaryDirectory(prefix="fleetwave-http-bench-") as tmp_name:
        tmp = Path(tmp_name)
        proc, sites_csv, err = start_emulator(tmp, targets)
        try:
            db = str(tmp / "bench.db")
            sid = setup(db, sites_csv, max_parallel)
            spec = RunSpec(targets=targets, max_parallel=max_parallel)
            data = _spawn(
                "run", {"db": db, "sid": sid, "states": 5, "setup_s": 0.0, "spec": asdict(spec)}
            )
            data["spec"] = spec
            http = RunResult(**data)
            checked = subprocess.run(
                [*_fleetwave(), "check", "--db", db], capture_output=True, text=True, check=False
            )
            base = re.search(r"on (http://\S+)/sites/", err.read_text())
            assert base is not None
            counters = httpx.get(base.group(1) + "/admin/counters", timeout=30).json()["sites"]
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    ideal, one_site = ideal_s(targets, max_parallel)
    # the sim driver on a like rollout (the same targets, workflow and max parallel)
    sim = measure(RunSpec(targets, max_parallel, latency_ms=SIM_LATENCY_MS))
    applied = [c["applies_started"] for c in counters.values()]
    requests = sum(c["requests"] for c in counters.values())
    ratio = http.wall_s / ideal
    http_cpu_us = http.cpu_s / http.transitions * 1e6
    sim_cpu_us = sim.cpu_s / sim.transitions * 1e6
    checks = [
        Check(
            "completes, invariants, fleetwave check",
            "complete, check() ok, `fleetwave check` exit 0",
            f"state={http.final_state}, ok={http.check_ok}, exit {checked.returncode}",
            http.final_state == "complete" and http.check_ok and checked.returncode == 0,
        ),
        Check(
            "each site applied once",
            "applies_started = 1 on every site",
            f"min {min(applied)}, max {max(applied)}",
            min(applied) == max(applied) == 1,
        ),
        Check("wall / ideal", f"<= {MAX_RATIO}", f"{ratio:.3f}", ratio <= MAX_RATIO),
    ]
    figures = [
        (
            "run",
            f"{targets:,} sites on one emulator process, patch, max parallel {max_parallel}, "
            f"http driver (polls every {POLL_S:g} s)",
        ),
        (
            "emulator",
            f"latency {LATENCY_MS} ms per answer; build {PHASES['build_s'] * TIME_SCALE:g} s, "
            f"apply {PHASES['apply_s'] * TIME_SCALE:g} s + reboot "
            f"{PHASES['reboot_s'] * TIME_SCALE:g} s (unreachable, 503)",
        ),
        ("ideal: one site / the rollout", f"{one_site:.2f} s / {ideal:.2f} s"),
        ("wall time of Conductor.run", f"{http.wall_s:.2f} s"),
        ("wall / ideal", f"{ratio:.3f}"),
        ("transitions", f"{http.transitions:,} (journal {http.journal_rows:,})"),
        ("requests to the sites (all answers, 503s too)", f"{requests:,}"),
        ("conductor CPU during the run", f"{http.cpu_s:.2f} s"),
        ("conductor CPU per transition: http / sim", f"{http_cpu_us:.0f} us / {sim_cpu_us:.0f} us"),
        ("http CPU per transition vs sim", f"{http_cpu_us / sim_cpu_us:.1f} x"),
        (
            "sim comparison run",
            f"{targets:,} sim targets, max parallel {max_parallel}, "
            f"{SIM_LATENCY_MS} ms per operation: wall {sim.wall_s:.2f} s, "
            f"CPU {sim.cpu_s:.2f} s, {sim.transitions:,} transitions",
        ),
        ("peak RSS of the conductor", f"{http.peak_rss_run / 1e6:.0f} MB"),
        (
            "other load: 1-min load average before / after, preemptions",
            f"{http.load_before:.2f} / {http.load_after:.2f}, {http.involuntary_switches}",
        ),
    ]
    return ScenarioReport("http_rollout", quick, [("http", http), ("sim", sim)], figures, checks)


def main(argv: list[str] | None = None) -> int:
    return scenario_main(run, __doc__, "200 sites at max parallel 100", argv)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
