"""Benchmark of the redfish driver: the clean workflow's BMC states over 50 nodes of one
sushy-tools Redfish emulator.

One ``sushy-emulator --fake`` (sushy-tools, started here on a free loopback port with
basic auth: :mod:`fleetwave.testing.bmc`) serves 50 fake systems, all powered on; a
conductor in another process drives a YAML workflow of the clean workflow's BMC states
(``power-off``, ``set-boot-network``, ``power-on``, ``final-power-off``) over them, all
at once (max parallel 50), through sushy, looking at the power state every 0.5 s
(``power_poll_s``).

The emulator paces its fake hardware: a power action lands 1 to 11 s after it is asked
(``int(now) + randint(1, 11)``: 0 to 11 s), and shows only when the system is read
after that. A watcher reads the emulator's state file every 50 ms for each power action
asked and when it lands: a node's ideal is the sum of its three power actions' delays
(its other state, the boot override, takes one request), and the rollout's ideal is
the slowest node's, every node running at once.

What it reports:

- the strategy completes, the invariants hold, ``fleetwave check`` passes, and every
  node ends powered off, set to boot from the network;
- wall time of ``Conductor.run`` against that ideal, and per node (its clean's time
  against its own ideal);
- each state's duration over the nodes (median, 90th percentile, max), and the power
  states' time over their action's delay (the polling's share);
- the conductor's concurrency: steps under way at once (from the journal), power
  actions pending on the BMC at once (the watcher), BMC requests (the emulator's log)
  and the threads sushy's blocking calls run on;
- the conductor's CPU per transition and per BMC request.

Run it from the repository root (``--quick``: 10 nodes)::

    .venv/bin/python bench/redfish_clean.py

It prints the figures and appends (replaces) its section in ``bench/RESULTS.md`` with
the command and machine. Exit status 1 when a node is missed.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from dataclasses import asdict
from pathlib import Path

from sqlalchemy import select

from bench import (
    Check,
    RunResult,
    RunSpec,
    ScenarioReport,
    _spawn,
    scenario_main,
)
from fleetwave.domain.models import StrategyOptions, Target
from fleetwave.domain.yaml_workflow import parse_workflow_yaml
from fleetwave.store import admin
from fleetwave.store.db import open_store
from fleetwave.store.schema import journal
from fleetwave.testing.bmc import FakeBmc, node_uuid

NODES = 50
PASSWORD = "bench-bmc-0451"
POLL_S = 0.5
WORKFLOW = """\
name: clean-bmc
states:
  - {name: power-off, timeout_s: 120}
  - {name: set-boot-network, timeout_s: 60}
  - {name: power-on, timeout_s: 120}
  - {name: final-power-off, timeout_s: 120}
"""
STATES = ("power-off", "set-boot-network", "power-on", "final-power-off")
POWER_STATES = ("power-off", "power-on", "final-power-off")
#: how often the watcher reads the emulator's state
WATCH_S = 0.05


class Watcher(threading.Thread):
    """Every power action the BMC was asked for, as (system, state, seen, lands):
    read from the emulator's state file every :data:`WATCH_S`."""

    def __init__(self, bmc: FakeBmc) -> None:
        super().__init__(daemon=True)
        self.bmc = bmc
        self.stop = threading.Event()
        self.actions: dict[tuple[str, str, float], float] = {}
        self.peak_pending = 0

    def run(self) -> None:
        while not self.stop.wait(WATCH_S):
            try:
                pending = self.bmc.pending_power()
            except Exception:  # (the emulator writing: the next look sees it)
                continue
            now = time.time()
            self.peak_pending = max(self.peak_pending, len(pending))
            for system, (state, lands) in pending.items():
                self.actions.setdefault((system, state, lands), now)

    def delays(self) -> dict[str, list[float]]:
        """Per system, each power action's delay (from seen asked to landing)."""
        out: dict[str, list[float]] = defaultdict(list)
        for (system, _state, lands), seen in sorted(self.actions.items(), key=lambda a: a[1]):
            out[system].append(max(0.0, lands - seen))
        return out


def setup(db: str, bmc: FakeBmc, count: int) -> int:
    store = open_store(db)
    admin.add_targets(
        store,
        [
            Target(
                name=f"node-{i:02d}",
                driver="redfish",
                settings={
                    "redfish_address": bmc.url,
                    "redfish_system_id": bmc.system_id(i),
                    "redfish_username": "admin",
                    "redfish_password": "env:BMC_PASSWORD",
                    "power_poll_s": POLL_S,
                },
            )
            for i in range(1, count + 1)
        ],
    )
    wf = parse_workflow_yaml(WORKFLOW, source="clean-bmc.yaml", strict=True)
    admin.save_workflow(store, wf, WORKFLOW)
    sid = admin.create_strategy(store, wf, StrategyOptions(max_parallel=count), all_targets=True)
    admin.apply_strategy(store, sid)
    store.dispose()
    return sid


def journal_of(db: str, sid: int) -> list[tuple[int, float, str, str]]:
    store = open_store(db)
    with store.read() as conn:
        rows = conn.execute(
            select(journal.c.step_id, journal.c.at, journal.c.from_state, journal.c.to_state)
            .where(journal.c.strategy_id == sid)
            .order_by(journal.c.id)
        ).all()
    store.dispose()
    return [(int(r[0]), float(r[1]), str(r[2]), str(r[3])) for r in rows]


def _spread(values: list[float]) -> str:
    if not values:
        return "-"
    ordered = sorted(values)
    p90 = ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]
    return f"{statistics.median(ordered):.2f} / {p90:.2f} / {ordered[-1]:.2f} s"


def run(quick: bool) -> ScenarioReport:
    count = 10 if quick else NODES
    os.environ["BMC_PASSWORD"] = PASSWORD  # (the conductor's process reads it)
    with tempfile.TemporaryDirectory(prefix="fleetwave-redfish-bench-") as tmp_name:
        tmp = Path(tmp_name)
        (tmp / "bmc").mkdir()
        bmc = FakeBmc.start(tmp / "bmc", nodes=count, password=PASSWORD)
        watcher = Watcher(bmc)
        try:
            db = str(tmp / "bench.db")
            sid = setup(db, bmc, count)
            requests0 = bmc.log.read_text().count('"GET /redfish') + bmc.log.read_text().count(
                '"POST /redfish'
            )
            watcher.start()
            spec = RunSpec(targets=count, max_parallel=count)
            data = _spawn(
                "run",
                {
                    "db": db,
                    "sid": sid,
                    "states": len(STATES),
                    "setup_s": 0.0,
                    "spec": asdict(spec),
                },
            )
            watcher.stop.set()
            watcher.join()
            data["spec"] = spec
            result = RunResult(**data)
            log = bmc.log.read_text()
            requests = log.count('"GET /redfish') + log.count('"POST /redfish') - requests0
            patches = log.count('"PATCH /redfish')
            checked = subprocess.run(
                [str(Path(sys.executable).parent / "fleetwave"), "check", "--db", db],
                capture_output=True,
                text=True,
                check=False,
            )
            systems = [bmc.system(i) for i in range(1, count + 1)]
            rows = journal_of(db, sid)
        finally:
            watcher.stop.set()
            bmc.stop()

    # each state's time per node, and each node's clean from its first state to its end
    entered: dict[int, dict[str, float]] = defaultdict(dict)
    durations: dict[str, list[float]] = defaultdict(list)
    span: dict[int, list[float]] = defaultdict(list)
    moves: list[tuple[float, int]] = []
    for step, at, frm, to in rows:
        if frm in entered[step]:
            durations[frm].append(at - entered[step][frm])
        entered[step][to] = at
        span[step].append(at)
        if frm == "initial":
            moves.append((at, 1))
        if to in ("complete", "failed", "aborted"):
            moves.append((at, -1))
    in_flight = peak_in_flight = 0
    for _, d in sorted(moves):
        in_flight += d
        peak_in_flight = max(peak_in_flight, in_flight)

    delays = watcher.delays()
    node_ideal = {s: sum(d) for s, d in delays.items()}
    ideal = max(node_ideal.values()) if node_ideal else float("nan")
    by_uuid = {node_uuid(i): i for i in range(1, count + 1)}
    step_of_node = {}
    for step, _, frm, _to in rows:  # steps were created in target order: node-01 first
        if frm == "initial":
            step_of_node.setdefault(step, len(step_of_node) + 1)
    node_ratio = []
    for step, times in span.items():
        index = step_of_node.get(step)
        own = node_ideal.get(node_uuid(index)) if index is not None else None
        if own:
            node_ratio.append((max(times) - min(times)) / own)
    power_time = sum(sum(durations[s]) for s in POWER_STATES)
    power_delay = sum(sum(d) for d in delays.values())
    actions = sum(len(d) for d in delays.values())
    off_pxe = sum(
        s["PowerState"] == "Off" and s["Boot"]["BootSourceOverrideTarget"] == "Pxe" for s in systems
    )
    threads = min(32, (os.cpu_count() or 1) + 4)
    checks = [
        Check(
            "completes, invariants, fleetwave check",
            "complete, check() ok, `fleetwave check` exit 0",
            f"state={result.final_state}, ok={result.check_ok}, exit {checked.returncode}",
            result.final_state == "complete" and result.check_ok and checked.returncode == 0,
        ),
        Check(
            "every node powered off, to boot from the network",
            f"{count} of {count}",
            f"{off_pxe} of {count}",
            off_pxe == count,
        ),
        Check(
            "each node's power actions seen on the BMC",
            f"3 a node ({3 * count})",
            f"{actions} (nodes: {len(delays)})",
            actions == 3 * count and set(delays) <= set(by_uuid),
        ),
    ]
    figures = [
        (
            "run",
            f"{count} nodes (fake systems of one sushy-emulator), states "
            f"{', '.join(STATES)}; max parallel {count}; power_poll_s {POLL_S}",
        ),
        (
            "the emulator's pacing: each power action's delay (median / p90 / max)",
            _spread([d for ds in delays.values() for d in ds]),
        ),
        ("ideal: the slowest node's three power delays", f"{ideal:.2f} s"),
        ("wall time of Conductor.run", f"{result.wall_s:.2f} s"),
        ("wall / ideal", f"{result.wall_s / ideal:.2f}"),
        ("per node: its clean / its own ideal (median / max)", _node_ratio(node_ratio)),
        *((f"state {s} (median / p90 / max)", _spread(durations[s])) for s in STATES),
        (
            "power states' time over their actions' delays (polling, requests)",
            f"{power_time - power_delay:.1f} s over {actions} actions: "
            f"{(power_time - power_delay) / max(actions, 1):.2f} s each",
        ),
        ("steps under way at once (peak, journal)", f"{peak_in_flight}"),
        ("power actions pending on the BMC at once (peak)", f"{watcher.peak_pending}"),
        (
            "BMC requests (GET + POST; PATCH for boot)",
            f"{requests:,} + {patches} in {result.wall_s:.1f} s: {requests / result.wall_s:.0f}/s",
        ),
        (
            "threads sushy's blocking calls share (asyncio's default pool)",
            f"{threads} (min(32, cores + 4))",
        ),
        ("transitions", f"{result.transitions:,} (journal {result.journal_rows:,})"),
        ("conductor CPU during the run", f"{result.cpu_s:.2f} s"),
        (
            "conductor CPU per transition / per BMC request",
            f"{result.cpu_s / result.transitions * 1000:.1f} ms / "
            f"{result.cpu_s / max(requests + patches, 1) * 1000:.1f} ms",
        ),
        ("peak RSS of the conductor", f"{result.peak_rss_run / 1e6:.0f} MB"),
        (
            "other load: 1-min load average before / after, preemptions",
            f"{result.load_before:.2f} / {result.load_after:.2f}, {result.involuntary_switches}",
        ),
    ]
    return ScenarioReport("redfish_clean", quick, [("redfish", result)], figures, checks)


def _node_ratio(ratios: list[float]) -> str:
    if not ratios:
        return "-"
    return f"{statistics.median(ratios):.2f} / {max(ratios):.2f}"


def main(argv: list[str] | None = None) -> int:
    return scenario_main(run, __doc__, "10 nodes", argv)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
