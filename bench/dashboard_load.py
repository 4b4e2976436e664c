"""Benchmark of the web dashboard beside a big rollout: ``fleetwave serve --listen``
drives ``TARGETS`` sim targets at max parallel ``PARALLEL`` (``LATENCY_MS`` an
operation: paced by its actions; ``--latency-ms 0``: the engine CPU bound), once with
no page open and once with the strategy page open in Debian's chromium (Playwright).

Measured (goals from issue #31):

- first render: from the page's navigation to the fleet grid drawn with every cell
  (the page's own ``performance.now()``, ``window.fleetwaveTimes``): under 1 s;
- update interval: the gaps between the page's live updates while the rollout runs:
  at least one a second (95 % of the gaps; the median and the longest reported);
- engine throughput with the page open, against without: transitions a second over
  the journal's span (the journal's own times): at least 90 %. Beside it, the server
  process's CPU seconds from the apply until the bench saw the end (polled once a
  second: an idle second or so included), and of it the live passes' own (their
  threads' CPU, ``fleetwave_live_pass_cpu_seconds_total``): steadier signs of what
  the page costs the server than the throughput on a shared machine.

Usage: ``.venv/bin/python bench/dashboard_load.py [--targets N] [--parallel N]
[--repeat N] [--results PATH]``; it prints the figures and replaces its section of
``bench/RESULTS.md``. The machine is shared: the figures are a loaded machine's.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from api_load import Server, apply, rollout_figures, start_server
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
from fleetwave.store import admin, tokens
from fleetwave.store.db import open_store

TARGETS = 10_000
PARALLEL = 1_000
#: each sim operation's time: the rollout lasts some seconds (10 waves of 5 states), long
#: enough to watch, paced by its actions (1,000 in flight: some 5,000 transitions a
#: second); ``--latency-ms 0`` for the engine CPU bound (a run of a couple of seconds)
LATENCY_MS = 200.0
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def make_world(
    directory: Path, targets: int, parallel: int, latency_ms: float = LATENCY_MS
) -> tuple[str, str]:
    """A database with ``targets`` sim targets and strategy 1 over them (initial), and
    a reader's token."""
    db = str(directory / "fleet.db")
    store = open_store(db)
    admin.add_targets(
        store,
        [Target(f"site-{i:05d}", settings={"latency_ms": latency_ms}) for i in range(targets)],
    )
    patch = get_workflow("patch")
    assert patch is not None
    admin.create_strategy(store, patch, StrategyOptions(max_parallel=parallel), all_targets=True)
    token = tokens.create_token(store, "bench", tokens.Role.READER, None)
    store.dispose()
    return db, token


def live_pass_cpu_s(base: str, token: str) -> float:
    """The server's ``fleetwave_live_pass_cpu_seconds_total``: its live passes' CPU."""
    text = httpx.get(
        base + "/metrics", headers={"Authorization": f"Bearer {token}"}, timeout=30
    ).text
    found = re.search(r"^fleetwave_live_pass_cpu_seconds_total (\S+)$", text, re.M)
    return float(found.group(1)) if found else math.nan


def wait_ended(db: str, timeout_s: float = 900) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        state, _, _ = rollout_figures(db, 1)
        if state in ("complete", "failed", "aborted"):
            return
        time.sleep(1)
    raise RuntimeError("the rollout did not end in time")


def run_without_page(targets: int, parallel: int, latency_ms: float) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="fw-dash-") as tmp:
        db, _ = make_world(Path(tmp), targets, parallel, latency_ms)
        server = start_server(db)
        try:
            cpu_before = server.cpu_s()
            apply(db, 1)
            wait_ended(db)
            cpu_s = server.cpu_s() - cpu_before
        finally:
            server.stop()
        state, n, span_s = rollout_figures(db, 1)
    return {"state": state, "transitions": n, "span_s": span_s, "server_cpu_s": cpu_s}


def run_with_page(targets: int, parallel: int, latency_ms: float) -> dict[str, Any]:
    from playwright.sync_api import sync_playwright

    with tempfile.TemporaryDirectory(prefix="fw-dash-") as tmp, sync_playwright() as p:
        db, token = make_world(Path(tmp), targets, parallel, latency_ms)
        server: Server = start_server(db)
        context = p.chromium.launch_persistent_context(
            str(Path(tmp) / "profile"),
            executable_path=CHROMIUM,
            headless=True,
            args=CHROMIUM_ARGS,
            viewport={"width": 1280, "height": 720},
        )
        try:
            page = context.new_page()
            page.add_init_script(f"sessionStorage.setItem('fleetwave.token', {json.dumps(token)})")
            base = f"http://{server.host}:{server.port}"
            page.goto(base + "/#/strategy/1")
            page.wait_for_function("() => window.fleetwaveTimes.firstGrid !== null", timeout=60_000)
            first_ms = float(page.evaluate("window.fleetwaveTimes.firstGrid"))
            cells = page.evaluate(
                "[...document.querySelectorAll('#counts [data-state] .n')]"
                ".reduce((a, n) => a + +n.textContent, 0)"
            )
            assert cells == targets, cells
            page.evaluate("window.fleetwaveTimes.updates = []")
            started = page.evaluate("performance.now()")
            cpu_before = server.cpu_s()
            passes_before = live_pass_cpu_s(base, token)
            apply(db, 1)
            wait_ended(db)
            cpu_s = server.cpu_s() - cpu_before
            passes_cpu_s = live_pass_cpu_s(base, token) - passes_before
            updates = [t for t in page.evaluate("window.fleetwaveTimes.updates") if t >= started]
        finally:
            context.close()
            server.stop()
        state, n, span_s = rollout_figures(db, 1)
    # between the updates seen while it ran (its end is known only to the bench's own
    # polling, once a second: not a gap of the page's)
    gaps = sorted(b - a for a, b in itertools.pairwise(updates))
    return {
        "state": state,
        "transitions": n,
        "span_s": span_s,
        "server_cpu_s": cpu_s,
        "live_pass_cpu_s": passes_cpu_s,
        "first_render_ms": first_ms,
        "updates": len(updates),
        "gap_median_ms": statistics.median(gaps) if gaps else float("nan"),
        "gap_p95_ms": gaps[int(0.95 * (len(gaps) - 1))] if gaps else float("nan"),
        "gap_max_ms": gaps[-1] if gaps else float("nan"),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else None)
    parser.add_argument("--targets", type=int, default=TARGETS)
    parser.add_argument("--parallel", type=int, default=PARALLEL)
    parser.add_argument("--latency-ms", type=float, default=LATENCY_MS, help="a sim operation")
    parser.add_argument("--repeat", type=int, default=1, help="pairs of runs (best of each)")
    parser.add_argument("--results", type=Path, default=DEFAULT_RESULTS, help="markdown to update")
    args = parser.parse_args(argv)
    if not os.path.exists(CHROMIUM):
        print(f"no {CHROMIUM}: apt-get install -y chromium", file=sys.stderr)
        return 2
    env = environment()
    load_before = os.getloadavg()[0]
    without: list[dict[str, Any]] = []
    with_page: list[dict[str, Any]] = []
    for _ in range(args.repeat):
        without.append(run_without_page(args.targets, args.parallel, args.latency_ms))
        print("without the page:", without[-1], flush=True)
        with_page.append(run_with_page(args.targets, args.parallel, args.latency_ms))
        print("with the page:", with_page[-1], flush=True)
    load_after = os.getloadavg()[0]

    def rate(r: dict[str, Any]) -> float:
        return float(r["transitions"] / r["span_s"])

    base = max(rate(r) for r in without)
    seen = max(with_page, key=rate)
    ratio = rate(seen) / base
    first_ms = min(r["first_render_ms"] for r in with_page)
    gap = seen["gap_median_ms"]
    checks = [
        Check(
            "first render of the strategy page",
            "< 1,000 ms",
            f"{first_ms:,.0f} ms",
            first_ms < 1000,
        ),
        Check(
            "live updates while the rollout runs",
            "at least 1 a second (95 % of the gaps <= 1,000 ms)",
            f"gaps p95 {seen['gap_p95_ms']:,.0f} ms (median {gap:,.0f} ms)",
            seen["gap_p95_ms"] <= 1000,
        ),
        Check(
            "engine throughput with the page open",
            ">= 90 % of without",
            f"{100 * ratio:.0f} % ({rate(seen):,.0f} vs {base:,.0f} transitions/s)",
            ratio >= 0.9,
        ),
    ]
    figures = [
        (
            "rollout",
            f"{args.targets:,} sim targets, patch (6 transitions each), max parallel "
            f"{args.parallel:,}, {args.latency_ms:g} ms an operation, SQLite",
        ),
        ("runs", f"{args.repeat} pair(s), without the page then with it; best of each"),
        *(
            (
                f"without the page, run {i + 1}",
                f"{r['transitions']:,} transitions in "
                f"{r['span_s']:.1f} s: {rate(r):,.0f}/s ({r['state']}); server CPU "
                f"{r['server_cpu_s']:.2f} s",
            )
            for i, r in enumerate(without)
        ),
        *(
            (
                f"with the page, run {i + 1}",
                f"{r['transitions']:,} transitions in "
                f"{r['span_s']:.1f} s: {rate(r):,.0f}/s ({r['state']}); server CPU "
                f"{r['server_cpu_s']:.2f} s (the page's passes {r['live_pass_cpu_s']:.2f} s); "
                "first render "
                f"{r['first_render_ms']:,.0f} ms; {r['updates']} updates, gaps median "
                f"{r['gap_median_ms']:,.0f} / p95 {r['gap_p95_ms']:,.0f} / max "
                f"{r['gap_max_ms']:,.0f} ms",
            )
            for i, r in enumerate(with_page)
        ),
        ("other load: 1-min load average before / after", f"{load_before:.2f} / {load_after:.2f}"),
        ("machine", "shared with other workers: a loaded machine's figures"),
    ]
    report = ScenarioReport("dashboard", False, [], figures, checks)
    print_report(report)
    write_results(args.results, [report], env)
    print(f"\nwrote {args.results}")
    return 0 if all(c.passed for c in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
