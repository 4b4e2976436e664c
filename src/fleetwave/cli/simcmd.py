"""``fleetwave sim``: the real engine on virtual time under injected faults, seed by seed."""

from __future__ import annotations

import logging
import shlex
import signal
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from typing import Annotated

import typer

from fleetwave.catalog import resolve_workflow
from fleetwave.cli.common import MAX_SIM_TARGETS
from fleetwave.cli.drive import stop_signals
from fleetwave.cli.output import Format, console, err_console, print_json
from fleetwave.domain.errors import InputError
from fleetwave.domain.models import plural
from fleetwave.domain.registry import get_workflow
from fleetwave.testing.simulate import FAULTS, Interrupt, SimConfig, parse_faults, run_simulation


def sim_command(
    seed: Annotated[int, typer.Option(help="first seed; a failing run prints its seed")] = 1,
    targets: Annotated[int, typer.Option(help="simulated targets")] = 200,
    workflow: Annotated[str, typer.Option(metavar="NAME", help="workflow to roll out")] = "patch",
    faults: Annotated[
        str,
        typer.Option(help=f"all, none, or a list of: {', '.join(FAULTS)}"),
    ] = "all",
    runs: Annotated[int, typer.Option(help="seeds to try in a row, from --seed")] = 1,
    keep_db_given: Annotated[
        str | None,
        typer.Option("--keep-db", metavar="PATH", help="keep the database of a single run here"),
    ] = None,
    fmt: Annotated[Format, typer.Option("--format", help="table or json")] = Format.table,
    verbose: Annotated[bool, typer.Option(help="log the engine's warnings")] = False,
    plans: Annotated[
        bool,
        typer.Option(
            "--plans", help="a random rollout plan too (stages, batches, canaries, waits)"
        ),
    ] = False,
) -> None:
    """Run the dispatcher, workers, store and sim driver on virtual time, check G1-G9.

    Exit 1 if any run violates a guarantee; replay it with --seed.
    """
    if not 1 <= targets <= MAX_SIM_TARGETS:
        raise InputError(f"--targets: must be 1 to {MAX_SIM_TARGETS}, got {targets}")
    if not 1 <= runs <= MAX_SIM_TARGETS:
        raise InputError(f"--runs: must be 1 to {MAX_SIM_TARGETS}, got {runs}")
    if get_workflow(workflow) is None:
        resolve_workflow(None, workflow, what="--workflow")  # refused, naming the known ones
    if keep_db_given is not None and not keep_db_given.strip():
        raise InputError("--keep-db: must not be empty")
    keep_db = Path(keep_db_given) if keep_db_given is not None else None
    if keep_db is not None and keep_db.is_dir():
        raise InputError(f"--keep-db: '{keep_db}' is a directory; give a path for a new file")
    if keep_db is not None and runs > 1:
        raise InputError(f"--keep-db: keeps the database of a single run, got --runs {runs}")
    if keep_db is not None and keep_db.exists():
        raise InputError(f"--keep-db: {keep_db} already exists; give a path for a new file")
    if keep_db is not None and not keep_db.expanduser().resolve().parent.is_dir():
        raise InputError(
            f"--keep-db: directory {keep_db.expanduser().resolve().parent} does not exist"
        )
    try:
        chosen = parse_faults(faults)
    except ValueError as exc:
        raise InputError(str(exc)) from None
    engine_log = logging.getLogger("fleetwave")
    level = engine_log.level
    if not verbose:
        engine_log.setLevel(logging.CRITICAL)
    interrupt = Interrupt()
    try:
        with _interrupted_by_signals(interrupt):
            _sweep(
                seed,
                runs,
                targets,
                workflow,
                faults,
                chosen,
                keep_db,
                fmt,
                verbose,
                interrupt,
                plans=plans,
            )
    finally:
        engine_log.setLevel(level)  # as it was (the command may run in a test's process)


@contextmanager
def _interrupted_by_signals(interrupt: Interrupt) -> Iterator[None]:
    """Ctrl-C, SIGTERM (a CI job's timeout) and SIGHUP (a closed terminal) stop the
    sweep: the run going on is cut short, the runs done so far are printed with how to
    go on, exit 130. As for ``demo`` and ``apply --wait``, also a SIGINT ignored when the
    process started (a background job of a script); a SIGHUP ignored then (``nohup``)
    stays ignored."""

    def handler(signum: int, frame: FrameType | None) -> None:
        interrupt.request()

    before = {sig: signal.signal(sig, handler) for sig in stop_signals()}
    try:
        yield
    finally:
        for sig, previous in before.items():
            signal.signal(sig, previous)


def _sweep(
    seed: int,
    runs: int,
    targets: int,
    workflow: str,
    faults: str,
    chosen: frozenset[str],
    keep_db: Path | None,
    fmt: Format,
    verbose: bool,
    interrupt: Interrupt | None = None,
    *,
    plans: bool = False,
) -> None:
    """The runs, one seed after the other; what ``sim_command`` prints and exits with."""
    again = " --plans" if plans else ""  # (in the command that replays or goes on)
    failed: list[int] = []
    results = []
    interrupted = False
    try:
        for s in range(seed, seed + runs):
            res = run_simulation(
                SimConfig(
                    seed=s,
                    targets=targets,
                    workflow=workflow,
                    faults=chosen,
                    keep_db=keep_db,
                    plans=plans,
                ),
                interrupt,
            )
            results.append(res)
            if fmt is Format.table:
                console.print(res.line(), highlight=False)
                for v in res.violations[:20]:
                    console.print(f"  violation: {v}", highlight=False)
            if not res.ok:
                failed.append(s)
    except KeyboardInterrupt:
        # The runs done so far are results too (a long sweep stopped by hand).
        interrupted = True
    if fmt is Format.json:
        print_json([r.__dict__ for r in results])
    if interrupted:
        cut, left = seed + len(results), runs - len(results)
        err_console.print(
            f"interrupted after {plural(len(results), 'finished run')} of {runs}"
            + (f"; FAILED seeds: {failed}" if failed else ", all ok")
            + f"; seed {cut} was cut short. Go on with: fleetwave sim --seed {cut}"
            + (f" --runs {left}" if left > 1 else "")
            + f" --targets {targets} --workflow {shlex.quote(workflow)}"
            + f" --faults {shlex.quote(faults)}{again}"
            + (" --format json" if fmt is Format.json else "")
            + (" --verbose" if verbose else ""),
            highlight=False,
        )
        raise typer.Exit(130)
    if fmt is Format.table and failed:
        console.print(
            f"FAILED seeds: {failed}; replay one with: fleetwave sim --seed {failed[0]} "
            f"--targets {targets} --workflow {workflow} --faults {faults}{again}",
        )
    elif fmt is Format.table:
        console.print(f"{plural(runs, 'run')} ok")
    if failed:
        raise typer.Exit(1)
