"""``fleetwave demo``: a simulated fleet rollout on the embedded default, then a check.

It builds a fresh database with N simulated subclouds (a few already patched, one
unmanaged, one reporting an unexpected remote state), rolls the workflow across
them with a live progress bar, prints a summary and verifies the guarantees.
"""

from __future__ import annotations

import random
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.markup import escape

from fleetwave.catalog import resolve_workflow
from fleetwave.cli.common import MAX_SIM_TARGETS
from fleetwave.cli.drive import drive_strategy
from fleetwave.cli.output import Format, console, err_console, print_json
from fleetwave.domain.errors import InputError
from fleetwave.domain.models import StrategyOptions, Target, plural
from fleetwave.drivers.sim import MAX_LATENCY_MS
from fleetwave.engine import loop as event_loop
from fleetwave.store import admin, queries
from fleetwave.store.admin import MAX_PARALLEL
from fleetwave.store.db import open_store
from fleetwave.testing.invariants import check


def demo_targets(n: int, seed: int, latency_ms: float, failure_rate: float) -> list[Target]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        settings: dict[str, Any] = {
            "latency_ms": latency_ms,
            "latency": "lognormal" if latency_ms > 0 else "fixed",
            "latency_sigma": 0.4,
            "failure_rate": failure_rate,
        }
        if rng.random() < 0.03:
            settings["already_done"] = True  # pre-check skips: already patched
        out.append(Target(name=f"subcloud{i + 1:05d}", settings=settings))
    if n >= 10:
        # One target someone unmanaged mid-change, and one whose remote side is in a state
        # no workflow knows: both must end failed with a clear reason, never stuck.
        out[n // 2] = Target(name=out[n // 2].name, settings=out[n // 2].settings, managed=False)
        odd = dict(out[n // 3].settings, remote_state="ready-to-apply-partial")
        out[n // 3] = Target(name=out[n // 3].name, settings=odd)
    return out


def demo_command(
    targets: Annotated[int, typer.Option(help="simulated subclouds")] = 1000,
    max_parallel: Annotated[int, typer.Option(help="steps in flight at once")] = 100,
    workflow: Annotated[str, typer.Option(help="workflow to roll out")] = "patch",
    failure_rate: Annotated[float, typer.Option(help="chance an operation fails")] = 0.002,
    latency_ms: Annotated[float, typer.Option(help="median operation latency")] = 20.0,
    seed: Annotated[int, typer.Option(help="simulator seed")] = 1,
    db: Annotated[
        str | None, typer.Option(help="new database file (default: a temporary one)")
    ] = None,
    fmt: Annotated[Format, typer.Option("--format", help="table or json")] = Format.table,
) -> None:
    """Roll a workflow over a simulated fleet, print a summary, verify the invariants."""
    if not 1 <= targets <= MAX_SIM_TARGETS:
        raise InputError(f"--targets: must be 1 to {MAX_SIM_TARGETS}, got {targets}")
    if not 1 <= max_parallel <= MAX_PARALLEL:
        raise InputError(f"--max-parallel: must be 1 to {MAX_PARALLEL}, got {max_parallel}")
    if not 0 <= failure_rate <= 1:
        raise InputError(f"--failure-rate: must be between 0 and 1, got {failure_rate}")
    if not 0 <= latency_ms <= MAX_LATENCY_MS:
        raise InputError(f"--latency-ms: must be 0 to {MAX_LATENCY_MS}, got {latency_ms:g}")
    wf = resolve_workflow(None, workflow)  # built-ins and plug-ins: checked before any write
    event_loop.loop_kind()  # a bad FLEETWAVE_LOOP too
    if db is not None and not db.strip():
        raise InputError("--db: must not be empty")
    if db is None:
        db = str(Path(tempfile.mkdtemp(prefix="fleetwave-demo-")) / "demo.db")
    elif Path(db).exists():
        raise InputError(f"--db: {db} already exists; the demo needs a new database file")
    store = open_store(db)
    admin.add_targets(store, demo_targets(targets, seed, latency_ms, failure_rate))
    sid = admin.create_strategy(
        store, wf, StrategyOptions(max_parallel=max_parallel), all_targets=True
    )
    admin.apply_strategy(store, sid)
    if fmt is Format.table:
        console.print(
            f"rolling [bold]{escape(wf.name)}[/bold] over "
            f"{plural(targets, 'simulated subcloud')}, "
            f"max parallel {max_parallel} (db {escape(db)})",
            markup=True,
        )
    from fleetwave.engine.conductor import EngineConfig

    started = time.perf_counter()
    result = drive_strategy(
        store, sid, show_progress=fmt is Format.table, config=EngineConfig(seed=seed)
    )
    wall_s = time.perf_counter() - started
    counts = queries.step_counts(store, sid)
    verdict = check(store, sid)
    transitions = verdict.transitions
    failures = queries.list_steps(store, sid, state="failed")
    reasons = Counter(_reason(f["details"]) for f in failures)
    interrupted = result.state == "interrupted"
    summary = {
        "db": db,
        "strategy": sid,
        "workflow": wf.name,
        # stopped by Ctrl-C: the strategy's own state (still applying), not a made-up one
        "strategy_state": (
            queries.get_strategy(store, sid)["state"] if interrupted else result.state
        ),
        "interrupted": interrupted,
        "targets": targets,
        "complete": counts.get("complete", 0),
        "failed": counts.get("failed", 0),
        "aborted": counts.get("aborted", 0),
        "skipped": sum(1 for s in queries.list_steps(store, sid, state="complete") if s["details"]),
        "transitions": transitions,
        "wall_s": round(wall_s, 3),
        "transitions_per_s": round(transitions / wall_s, 1) if wall_s > 0 else None,
        "failures": [{"target": f["target"], "details": f["details"]} for f in failures],
        "check": {"ok": verdict.ok, "violations": verdict.violations},
    }
    if fmt is Format.json:
        print_json(summary)
    else:
        _print_summary(summary, reasons)
    store.dispose()  # the last connection closes: the WAL is folded into the file
    if interrupted:
        # Cut short, whatever the figures say: never a success for a script.
        err_console.print(
            f"stopped: strategy {sid} is still {summary['strategy_state']}; leases handed "
            f"back. Go on with 'fleetwave strategy apply {sid} --wait --db {db}'",
            highlight=False,
        )
        raise typer.Exit(130)
    if not verdict.ok:
        raise typer.Exit(1)


def _reason(details: str) -> str:
    """Group failure details by their shape: drop target-specific words."""
    return details.split(" (")[0]


def _print_summary(s: dict[str, Any], reasons: Counter[str]) -> None:
    from rich.table import Table

    state = s["strategy_state"] + (" (interrupted)" if s["interrupted"] else "")
    table = Table(title=f"strategy {s['strategy']} ({s['workflow']}): {state}")
    table.add_column("final state")
    table.add_column("steps", justify="right")
    table.add_row("complete", str(s["complete"]))
    table.add_row("  of which skipped (already done)", str(s["skipped"]))
    for key in ("failed", "aborted"):
        table.add_row(key, str(s[key]))
    console.print(table, soft_wrap=False)  # a drawn table: its title centred
    if s["failures"]:
        ft = Table(title="failures")
        ft.add_column("target")
        ft.add_column("details")
        for f in s["failures"][:15]:
            ft.add_row(f["target"], f["details"])
        if len(s["failures"]) > 15:
            ft.add_row(
                "...",
                f"{len(s['failures']) - 15} more: fleetwave step list --strategy "
                f"{s['strategy']} --state failed --db {s['db']}",
            )
        console.print(ft, soft_wrap=False)
    console.print(
        f"wall time {s['wall_s']:.2f} s, {s['transitions']} transitions, "
        f"{s['transitions_per_s']} transitions/s"
    )
    if s["check"]["ok"]:
        console.print("[green]fleetwave check: ok (G1, G3, G7, G8 hold)[/green]", markup=True)
    else:
        console.print("[red]fleetwave check: FAILED[/red]", markup=True)
        for v in s["check"]["violations"]:
            console.print(f"  {v}")
    console.print(f"inspect it: fleetwave step list --strategy {s['strategy']} --db {s['db']}")
