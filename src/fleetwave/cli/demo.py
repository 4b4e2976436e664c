"""``fleetwave demo``: a simulated fleet rollout on the embedded default, then a check.

It builds a fresh database with N simulated subclouds (a few already patched, one
unmanaged, one reporting an unexpected remote state), rolls the workflow across
them with a live progress bar, prints a summary and verifies the guarantees.
"""

from __future__ import annotations

import logging
import os
import random
import sys
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
from fleetwave.cli.output import Format, console, emit_rows, err_console, print_json
from fleetwave.domain.errors import InputError
from fleetwave.domain.models import StrategyOptions, Target, plural
from fleetwave.domain.workflow import WorkflowDef
from fleetwave.drivers.sim import MAX_LATENCY_MS
from fleetwave.engine import loop as event_loop
from fleetwave.store import admin, queries
from fleetwave.store.admin import MAX_PARALLEL
from fleetwave.store.db import is_empty, is_url, open_store
from fleetwave.testing.invariants import check

#: a state each built-in workflow's remote side may be left in that the workflow does not
#: know (a half-applied change); another workflow's target reports a made-up one
ODD_REMOTE_STATES = {
    "patch": "ready-to-apply-partial",
    "sw-deploy": "deploy-activate-failed",
    "firmware": "fw-update-partial",
    "kube-upgrade": "upgrade-networking-failed",
    "clean": "clean-hold",
}


def skipping_state(wf: WorkflowDef) -> str | None:
    """The first state of ``wf`` that skips a target reporting it already done, if any
    (a workflow without one runs such a target through)."""
    for st in wf.states:
        if getattr(st.action, "skip_when_done", False):
            return st.name
    return None


def demo_targets(
    n: int,
    seed: int,
    latency_ms: float,
    failure_rate: float,
    workflow: str = "patch",
    *,
    skips: bool = True,
) -> list[Target]:
    """The demo's fleet; ``skips``: the workflow skips targets already done (a few then
    report they are; without such a state, none is made so)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        settings: dict[str, Any] = {
            "latency_ms": latency_ms,
            "latency": "lognormal" if latency_ms > 0 else "fixed",
            "latency_sigma": 0.4,
            "failure_rate": failure_rate,
        }
        if rng.random() < 0.03 and skips:
            settings["already_done"] = True  # e.g. patch's pre-check skips: already patched
        out.append(Target(name=f"subcloud{i + 1:05d}", settings=settings))
    if n >= 10:
        # One target someone unmanaged mid-change, and one whose remote side is in a state
        # no workflow knows: both must end failed with a clear reason, never stuck.
        out[n // 2] = Target(name=out[n // 2].name, settings=out[n // 2].settings, managed=False)
        remote = ODD_REMOTE_STATES.get(workflow, "half-changed")
        odd = dict(out[n // 3].settings, remote_state=remote)
        out[n // 3] = Target(name=out[n // 3].name, settings=odd)
    return out


def demo_command(
    targets: Annotated[int, typer.Option(help="simulated subclouds")] = 1000,
    max_parallel: Annotated[int, typer.Option(help="steps in flight at once")] = 100,
    workflow: Annotated[str, typer.Option(metavar="NAME", help="workflow to roll out")] = "patch",
    failure_rate: Annotated[float, typer.Option(help="chance an operation fails")] = 0.002,
    latency_ms: Annotated[float, typer.Option(help="median operation latency")] = 20.0,
    seed: Annotated[int, typer.Option(help="simulator seed")] = 1,
    db: Annotated[
        str | None,
        typer.Option(metavar="PATH", help="new database file (default: a temporary one)"),
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
    elif not is_url(db) and Path(db).exists():
        raise InputError(f"--db: {db} already exists; the demo needs a new database file")
    store = open_store(db)
    if is_url(db):
        if not is_empty(store):
            store.dispose()
            raise InputError(
                f"--db: {store.url} already holds a fleet; the demo needs a new database"
            )
        db = store.url  # (as it is shown: without its password)
    skipper = skipping_state(wf)
    fleet = demo_targets(targets, seed, latency_ms, failure_rate, wf.name, skips=bool(skipper))
    admin.add_targets(store, fleet)
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
        purpose = _on_purpose(fleet, failure_rate, skipper)
        if purpose:
            console.print(f"{purpose}: the failures below are the simulator's", highlight=False)
    from fleetwave.engine.config import EngineConfig

    # The summary below lists the failures and how it ended: not in the log as well
    # (below a debug or info level asked for, which shows everything).
    quiet = logging.getLogger("fleetwave.engine.outcomes")
    level = quiet.level
    if logging.getLogger().getEffectiveLevel() >= logging.WARNING:
        quiet.setLevel(logging.ERROR)
    started = time.perf_counter()
    try:
        result = drive_strategy(
            store, sid, show_progress=fmt is Format.table, config=EngineConfig(seed=seed)
        )
    finally:
        quiet.setLevel(level)
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
    state = s["strategy_state"] + (" (interrupted)" if s["interrupted"] else "")
    rows = [
        {"final state": "complete", "steps": s["complete"]},
        {"final state": "  of which skipped (already done)", "steps": s["skipped"]},
        {"final state": "failed", "steps": s["failed"]},
        {"final state": "aborted", "steps": s["aborted"]},
    ]
    left = s["targets"] - s["complete"] - s["failed"] - s["aborted"]
    if left:
        rows.append({"final state": "not ended (interrupted)", "steps": left})
    # drawn on a terminal, plain columns when piped (as every table)
    title = f"strategy {s['strategy']} ({s['workflow']}): {state}"
    emit_rows(rows, ["final state", "steps"], Format.table, title=title)
    if s["failures"]:
        failures = [{"target": f["target"], "details": f["details"]} for f in s["failures"][:15]]
        if len(s["failures"]) > 15:
            failures.append(
                {
                    "target": "...",
                    "details": f"{len(s['failures']) - 15} more: {_prog()} step list "
                    f"--strategy {s['strategy']} --state failed --db {s['db']}",
                }
            )
        emit_rows(failures, ["target", "details"], Format.table, title="failures")
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
    console.print(f"inspect it: {_prog()} step list --strategy {s['strategy']} --db {s['db']}")


def _prog() -> str:
    """The command as it was run (``.venv/bin/fleetwave``, when not on the PATH), for
    the commands a summary suggests."""
    invoked = sys.argv[0] if sys.argv else ""
    return invoked if os.path.basename(invoked) == "fleetwave" else "fleetwave"


def _on_purpose(fleet: list[Target], failure_rate: float, skipper: str | None) -> str:
    """What the demo's fleet does wrong on purpose: its failures are the simulator's
    (``skipper``: the state that skips targets already done)."""
    said = [f"a failure rate of {failure_rate:.2%} per operation"] if failure_rate else []
    done = sum(
        1
        for t in fleet
        if t.settings.get("already_done") and t.managed and "remote_state" not in t.settings
    )  # (the unmanaged one and the odd one fail first)
    if done:
        said.append(f"{plural(done, 'target')} already done ({skipper} skips them)")
    said += [f"{t.name} unmanaged" for t in fleet if not t.managed]
    said += [
        f"{t.name} in an unexpected remote state" for t in fleet if "remote_state" in t.settings
    ]
    return "on purpose: " + ", ".join(said) if said else ""
