"""``fleetwave step``: the steps of a strategy (one target each) listed and shown, and
a target's report (callback) for a wait-for-callback state."""

from __future__ import annotations

import time
from typing import Annotated, Any

import typer

from fleetwave.catalog import strategy_workflow_def
from fleetwave.cli import remote
from fleetwave.cli.common import (
    DbOpt,
    FormatOpt,
    StepId,
    count_from_1,
    done,
    existing_store,
    whole_number,
)
from fleetwave.cli.output import Format, emit_one, emit_rows, err_console, first_then
from fleetwave.cli.parsing import several
from fleetwave.domain.errors import InputError, NotFound
from fleetwave.domain.registry import ActionNotFound, PluginError
from fleetwave.domain.workflow import WorkflowError
from fleetwave.store import queries
from fleetwave.store.callbacks import KINDS as CALLBACK_KINDS
from fleetwave.store.callbacks import accept_callback
from fleetwave.store.db import Store

# put under the root command by main.py, which gives it its command class (_Commands)
step_app = typer.Typer(help="Steps: one target inside one strategy.", no_args_is_help=True)


#: the step id last: what `step show` takes
STEP_COLUMNS = ["target", "stage", "state", "details", "started_at", "finished_at", "step"]


@step_app.command("list")
def step_list(
    strategy: Annotated[int, typer.Option(parser=whole_number, metavar="ID", help="strategy id")],
    state: Annotated[
        list[str] | None,
        typer.Option(
            metavar="STATE",
            help="only steps in this state; repeat it, or give a,b, for steps in any of them",
        ),
    ] = None,
    target: Annotated[
        list[str] | None,
        typer.Option(
            metavar="NAME", help="only this target's step; repeat it, or give a,b, for several"
        ),
    ] = None,
    fmt: FormatOpt = Format.table,
    db: DbOpt = None,
) -> None:
    """List the steps of a strategy."""
    states, names = several("--state", state), several("--target", target)
    server = remote.server(db)
    if server is not None:
        path = f"/v1/strategies/{strategy}/steps"
        emit_rows(server.every(path, state=states, target=names), STEP_COLUMNS, fmt)
        return
    store = existing_store(db)
    # refuses an unknown strategy (or target) now
    rows = queries.iter_steps(store, strategy, states, target=names)
    emit_rows(
        first_then(rows, lambda: queries.iter_steps(store, strategy, states, target=names)),
        STEP_COLUMNS,
        fmt,
    )


@step_app.command("show")
def step_show(step_id: StepId, fmt: FormatOpt = Format.table, db: DbOpt = None) -> None:
    """Show one step with its journal and events."""
    server = remote.server(db)
    if server is not None:
        emit_one(server.get(f"/v1/steps/{step_id}"), fmt)
        return
    emit_one(queries.get_step(existing_store(db), step_id), fmt)


@step_app.command("callback")
def step_callback(
    step_id: StepId,
    state: Annotated[str, typer.Argument(help="the state of the step the report is about")],
    kind: Annotated[
        str, typer.Option(help="done (the state's work finished), failed, or heartbeat")
    ] = "done",
    details: Annotated[str, typer.Option(help="what the target says (kept with it)")] = "",
    visit: Annotated[
        int | None,
        typer.Option(
            parser=count_from_1,
            metavar="N",
            help="the visit of STATE it reports on, for a state on a bounded cycle "
            "(max_visits); default: the visit the step is in, or its next visit of STATE",
        ),
    ] = None,
    fmt: FormatOpt = Format.table,
    db: DbOpt = None,
) -> None:
    """Report for a target: the callback a wait-for-callback state waits for.

    Stored at once (one INSERT); the conductor that drives the step's strategy answers
    it (applied, or ignored and why) within a tick. On a bounded cycle a report applies
    to its visit of the state only: one of a visit that is over is ignored as late.
    """
    if kind not in CALLBACK_KINDS:
        raise InputError(f"--kind: must be one of {', '.join(CALLBACK_KINDS)}, got '{kind}'")
    store = existing_store(db)
    step = queries.get_step(store, step_id)
    states = queries.get_strategy(store, step["strategy"])["states"]
    if isinstance(states, list) and states and state not in states:
        raise InputError(
            f"STATE: '{state}' is not a state of strategy {step['strategy']}'s workflow "
            f"({', '.join(states)})"
        )
    record = accept_callback(store, step_id, state, kind, details, time.time(), visit=visit)
    outcome, reason = record.outcome, record.reason  # a late one is answered at once
    answer = record.answer()
    late = outcome is not None
    ahead = None if late else _ahead_of(store, step, states, state)
    if late:
        said = f"callback {record.id} for step {step_id} stored and {outcome}: {reason}"
    elif ahead is not None:
        said = (
            f"callback {record.id} for step {step_id} ({state}, {kind}) stored and kept: the "
            f"step is {ahead}, before {state}; it counts once the step reaches {state}, and "
            "is ignored if the step ends first"
        )
    else:
        said = (
            f"callback {record.id} for step {step_id} ({state}, {kind}) stored; the conductor "
            f"driving strategy {record.strategy_id} answers it ('fleetwave step show {step_id}' "
            "says how)"
        )
    done(fmt, said, answer)
    if not late and queries.driving(store, record.strategy_id).nobody:
        err_console.print(
            f"warning: no conductor drives strategy {record.strategy_id}: the callback is "
            "answered once one does ('fleetwave serve', or 'fleetwave strategy apply "
            f"{record.strategy_id} --wait')",
            highlight=False,
        )


def _ahead_of(store: Store, step: dict[str, Any], states: Any, state: str) -> str | None:
    """Where a step under way is ("in STATE"), when a callback for ``state`` came
    before the step reached it and ``state`` waits for callbacks: the conductor keeps
    such a report for it (an agent's report can overtake the step's move). None
    otherwise (a step not under way yet keeps none), or when the strategy's workflow
    cannot be read here."""
    now = str(step["state"])
    # (a step not under way yet keeps nothing: its conductor ignores such a report)
    if not isinstance(states, list) or state not in states or now not in states:
        return None
    if states.index(now) >= states.index(state):
        return None
    try:
        wf = strategy_workflow_def(store, int(step["strategy"]))
        waits = wf.state(state).mode == "wait-for-callback"
    except (NotFound, ActionNotFound, PluginError, WorkflowError, KeyError):
        return None  # (only what the answer says depends on it)
    if not waits:
        return None
    return f"in {now}"
