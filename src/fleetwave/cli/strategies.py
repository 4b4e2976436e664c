"""``fleetwave strategy``: rollouts of one workflow over targets: create, apply (or
drive one here with ``--wait``), pause, resume, abort, show, list and delete."""

from __future__ import annotations

import getpass
import sys
import time
from pathlib import Path
from typing import Annotated, Any

import typer
from sqlalchemy.exc import OperationalError

from fleetwave import commands
from fleetwave.catalog import resolve_workflow, strategy_workflow_def
from fleetwave.cli import remote
from fleetwave.cli.common import (
    DbOpt,
    FormatOpt,
    IgnoreMissingOpt,
    LeaseTtlOpt,
    StrategyId,
    count_or_percent,
    database_hint,
    done,
    engine_config,
    existing_store,
    missing,
    whole_number,
)
from fleetwave.cli.drive import UNREAD, drive_strategy, now_state, stopped_at_once, stopped_watching
from fleetwave.cli.output import Format, console, emit_one, emit_rows, err_console, print_json
from fleetwave.cli.parsing import decode_text, parse_pairs, read_text_file, several
from fleetwave.domain.errors import InputError, NotFound
from fleetwave.domain.models import (
    STRATEGY_TERMINAL,
    ApplyType,
    StrategyState,
    plural,
    shown,
)
from fleetwave.domain.windows import (
    earliest_start,
    parse_window,
    shown_time,
)
from fleetwave.domain.yaml_workflow import MAX_SECONDS
from fleetwave.engine import loop as event_loop
from fleetwave.store import admin, queries
from fleetwave.store.db import Store

# put under the root command by main.py, which gives it its command class (_Commands)
strategy_app = typer.Typer(help="Rollouts of one workflow over targets.", no_args_is_help=True)


def _timeouts(items: list[str] | None) -> dict[str, float]:
    out: dict[str, float] = {}
    typed = parse_pairs(items, "--timeout", typed=False)  # as given, for the errors
    for key, value in parse_pairs(items, "--timeout").items():
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not 0 < value < float("inf")
        ):
            raise InputError(
                f"--timeout: {key}: expected a positive number of seconds, got {shown(typed[key])}"
            )
        if value > MAX_SECONDS:
            raise InputError(
                f"--timeout: {key}: at most {MAX_SECONDS} seconds (30 days), got {typed[key]}"
            )
        out[key] = float(value)
    return out


@strategy_app.command("create")
def strategy_create(
    workflow: Annotated[str, typer.Option(metavar="NAME", help="workflow name")],
    targets: Annotated[
        str | None,
        typer.Option(
            metavar="NAMES",
            help="comma-separated target names; @FILE reads them from a file, - from stdin "
            "(one per line, or comma- or space-separated; # starts a comment)",
        ),
    ] = None,
    group: Annotated[
        str | None, typer.Option(metavar="NAME", help="every target of this group")
    ] = None,
    all_: Annotated[bool, typer.Option("--all", help="every target")] = False,
    failed_in: Annotated[
        int | None,
        typer.Option(
            parser=whole_number,
            metavar="ID",
            help="the targets whose step in strategy ID failed or was aborted (a retry)",
        ),
    ] = None,
    label: Annotated[
        list[str] | None,
        typer.Option(
            metavar="KEY=VALUE", help="only targets with this label (repeatable; alone: of all)"
        ),
    ] = None,
    max_parallel: Annotated[
        int | None, typer.Option(help="steps in flight at once (default 20)")
    ] = None,
    apply_type: Annotated[
        # (TYPE, not Typer's <parallel|serial>: this command's many options leave the
        # help column too narrow for --db's example URL at 80 columns otherwise)
        ApplyType,
        typer.Option(metavar="TYPE", help="parallel, or serial (one at a time)"),
    ] = ApplyType.PARALLEL,
    stop_on_failure: Annotated[
        bool, typer.Option("--stop-on-failure", help="stop at the first failure")
    ] = False,
    max_failures: Annotated[
        str | None,
        typer.Option(
            parser=count_or_percent,
            metavar="N|P%",
            help="stop once more than N steps (or P% of them) failed",
        ),
    ] = None,
    stages_by_group: Annotated[
        bool,
        typer.Option(
            "--stages-by-group",
            help="one stage per group (by the groups' --order, then name), one after another",
        ),
    ] = False,
    stage: Annotated[
        list[str] | None,
        typer.Option(
            metavar="GROUPS",
            help="a stage of these groups (a,b; rest or * for the others); repeat it, in "
            "the order they run",
        ),
    ] = None,
    stage_max_failures: Annotated[
        str | None,
        typer.Option(
            parser=count_or_percent,
            metavar="N|P%",
            help="stop once more than N steps (or P%) of one stage failed",
        ),
    ] = None,
    batches: Annotated[
        str | None,
        typer.Option(
            metavar="N,N,P%",
            help="batch sizes within each stage (the last repeats); a batch starts when "
            "the one before has ended",
        ),
    ] = None,
    canary: Annotated[
        str | None,
        typer.Option(
            parser=count_or_percent,
            metavar="N|P%",
            help="run N targets (or P%) first, of the first stage; nothing else starts "
            "until they complete; one failing fails the strategy",
        ),
    ] = None,
    canary_label: Annotated[
        list[str] | None,
        typer.Option(metavar="KEY=VALUE", help="choose the canaries by label (repeatable)"),
    ] = None,
    stage_wait: Annotated[
        str | None,
        typer.Option(metavar="DURATION", help="wait this long after each stage (10m, 1h30m, 45s)"),
    ] = None,
    stage_approval: Annotated[
        bool,
        typer.Option(
            "--stage-approval",
            help="after each stage, wait for 'strategy approve ID' (waiting-approval)",
        ),
    ] = False,
    start_after: Annotated[
        str | None,
        typer.Option(metavar="TIME", help="start no step before then (2026-12-06T01:00Z)"),
    ] = None,
    window: Annotated[
        list[str] | None,
        typer.Option(
            metavar="WINDOW",
            help="start steps only inside it, weekly ('Sat 01:00-05:00 UTC'); repeatable",
        ),
    ] = None,
    deadline: Annotated[
        str | None,
        typer.Option(
            metavar="TIME",
            help="start nothing after then; the strategy then ends failed (2026-12-07T06:00Z)",
        ),
    ] = None,
    dry_run: Annotated[
        bool,
        typer.Option("--dry-run", help="print the plan (stages, batches, canaries); write nothing"),
    ] = False,
    timeout: Annotated[
        list[str] | None,
        typer.Option(metavar="STATE=SECONDS", help="timeout override (repeatable)"),
    ] = None,
    # The defaults, said out loud (scripts written for earlier versions say them); not
    # in --help, where their second column cut every option's name at 80 columns.
    no_stop_on_failure: Annotated[bool, typer.Option("--no-stop-on-failure", hidden=True)] = False,
    no_stages_by_group: Annotated[bool, typer.Option("--no-stages-by-group", hidden=True)] = False,
    fmt: FormatOpt = Format.table,
    db: DbOpt = None,
) -> None:
    """Create a strategy (state initial); apply it to start."""
    for flag, on, off in (
        ("stop-on-failure", stop_on_failure, no_stop_on_failure),
        ("stages-by-group", stages_by_group, no_stages_by_group),
    ):
        if on and off:
            raise InputError(f"--{flag} and --no-{flag}: give one of them")
    names = _target_names(targets) if targets is not None else None
    labels = parse_pairs(label, "--label", typed=False)
    timeouts = _timeouts(timeout)
    rollout: dict[str, Any] = {
        "max_parallel": max_parallel,
        "apply_type": apply_type,
        "stop_on_failure": stop_on_failure,
        "max_failures": max_failures,
        "stages_by_group": stages_by_group,
        "stages": stage or [],
        "batches": batches,
        "canary": canary,
        "canary_label": parse_pairs(canary_label, "--canary-label", typed=False),
        "stage_max_failures": stage_max_failures,
        "stage_wait": stage_wait,
        "stage_approval": stage_approval,
        "start_after": start_after,
        "windows": window or [],
        "deadline": deadline,
    }
    server = remote.server(db)
    if server is not None:
        body = {
            "workflow": workflow,
            "targets": names,
            "group": group,
            "all": all_,
            "labels": labels,
            "failed_in": failed_in,
            "timeouts": timeouts,
            "dry_run": dry_run,
            **rollout,
            "apply_type": apply_type.value,
        }
        made = server.post("/v1/strategies", {k: v for k, v in body.items() if v is not None})
        if dry_run:
            _print_plan(made, fmt)
            return
    else:
        store = existing_store(db)
        if failed_in is not None:
            names = commands.failed_targets(
                store, failed_in, target_names=names, group=group, all_targets=all_, labels=labels
            )
        wf = resolve_workflow(store, workflow)
        commands.check_timeouts(wf, timeouts)
        opts, spec = commands.strategy_options(timeouts_s=timeouts, **rollout)
        if dry_run:
            plan = admin.plan_strategy(
                store,
                wf,
                opts,
                target_names=names,
                group=group,
                all_targets=all_,
                labels=labels,
                spec=spec,
            )
            _print_plan(plan, fmt)
            return
        made = commands.create_strategy(
            store,
            wf,
            opts,
            target_names=names,
            group=group,
            all_targets=all_,
            labels=labels,
            failed_in=failed_in,
            spec=spec,
        )
    sid = made["id"]
    if fmt is Format.json:
        print_json(made)
    else:
        console.print(
            f"strategy {sid} created ({made['workflow']}, "
            f"{plural(int(made['steps']), 'target')}, max parallel {made['max_parallel']}); "
            f"'fleetwave strategy apply {sid}' starts it",
            highlight=False,
        )
    stored = made["options"]
    left_out = int(stored.get("left_out", 0)) if isinstance(stored, dict) else 0
    if left_out:
        # said on stderr, also with --format json: a target the operator chose is not
        # in the rollout
        err_console.print(
            f"note: {plural(left_out, 'target')} in no stage left out ('--stage rest' "
            "takes them; --dry-run lists them)",
            highlight=False,
        )


def _stops(limit: int | None) -> str:
    if limit is None:
        return "no failure threshold"
    if limit == 0:
        return "stops at the first failure"
    return f"stops past {plural(limit, 'failure')}"


def _print_plan(plan: dict[str, Any], fmt: Format) -> None:
    """``strategy create --dry-run``: the plan, as text or data."""
    if fmt is Format.json:
        print_json(plan)
        return
    limit = plan["max_failures"]
    console.print(
        f"plan: {plural(plan['steps'], 'step')} of {plan['workflow']}, max parallel "
        f"{plan['max_parallel']}, "
        + _stops(limit)
        + f"; starts {plan['earliest_start']}; nothing written",
        highlight=False,
    )
    for stage in plan["stages"]:
        groups = ", ".join(
            f"{g['name']} (max parallel {g['max_parallel']})"
            if g["max_parallel"] is not None
            else "no group"
            for g in stage["groups"]
        )
        limit = (
            "any failure stops it"
            if stage["canary"]
            else ""
            if stage["max_failures"] is None
            else _stops(stage["max_failures"])
        )
        sizes = [b["size"] for b in stage["batches"]]
        batches = f"; batches {', '.join(map(str, sizes))}" if len(sizes) > 1 else ""
        console.print(
            f"stage {stage['stage']} {stage['name']}: {plural(stage['steps'], 'step')}"
            + (f"; groups {groups}" if groups else "")
            + batches
            + (f"; {limit}" if limit else ""),
            highlight=False,
        )
        if stage["canary"]:
            console.print(
                f"  canaries: {', '.join(stage['batches'][0]['targets'])}", highlight=False
            )
    if plan["windows"]:
        console.print(f"windows: {'; '.join(plan['windows'])}", highlight=False)
    if plan["deadline"] is not None:
        console.print(
            f"deadline: {shown_time(plan['deadline'])} (nothing starts after it)",
            highlight=False,
        )
    between = []
    if plan["stage_wait_s"]:
        between.append(f"wait {plan['stage_wait_s']:g}s")
    if plan["stage_approval"]:
        between.append("wait for 'fleetwave strategy approve'")
    if between:
        console.print(f"after each stage: {', then '.join(between)}", highlight=False)
    left = plan["left_out"]
    if left:
        console.print(f"left out: {plural(len(left), 'target')}", highlight=False)
        for item in left[:20]:
            console.print(f"  {item['target']}: {item['why']}", highlight=False)
        if len(left) > 20:
            console.print(f"  ... and {len(left) - 20} more", highlight=False)


def _target_names(given: str) -> list[str]:
    """``--targets``: the names as given (a,b,c), or read from ``@FILE`` or ``-`` (stdin):
    one per line, or separated by commas or spaces; ``#`` starts a comment. (A name
    starts with a letter or digit, so neither form can be a name.) An empty name in a
    list, or one that is not text, is refused."""
    if given != "-" and not given.startswith("@"):
        names = given.split(",")
        if any(not name.strip() for name in names):
            raise InputError(f"--targets: an empty name in {shown(given)}")
    else:
        if given == "-":
            text = decode_text(sys.stdin.buffer.read(), "--targets: stdin")
            source = "stdin"
        else:
            path, source = Path(given[1:]), given
            if not path.is_file():
                what = "a directory" if path.is_dir() else "no such file"
                raise InputError(f"--targets: {given}: {what}")
            text = read_text_file(path)
        names = [
            name
            for line in text.splitlines()
            for name in line.split("#", 1)[0].replace(",", " ").split()
        ]
        if not names:
            raise InputError(f"--targets: {source} names no target")
    for name in names:
        try:
            name.encode("utf-8")
        except UnicodeEncodeError:
            raise InputError(f"--targets: {shown(name)} is not valid text") from None
    return names


@strategy_app.command("apply")
def strategy_apply(
    strategy_id: StrategyId,
    wait: Annotated[bool, typer.Option(help="drive it here and wait for the end")] = False,
    lease_ttl: LeaseTtlOpt = None,
    fmt: FormatOpt = Format.table,
    db: DbOpt = None,
) -> None:
    """Start (or resume) a strategy. With --wait, drive it in the foreground."""
    if lease_ttl is not None and not wait:
        raise InputError(
            "--lease-ttl: only with --wait (the lease of the conductor that drives it here)"
        )
    config = engine_config(lease_ttl)
    store = existing_store(db)
    if wait:
        ended = queries.get_strategy(store, strategy_id)
        if ended["state"] in STRATEGY_TERMINAL:
            # Ended already (this command run again, by a script or a retried job): its
            # result, as if this run had waited for it; nothing is driven or changed,
            # so nothing it would need to drive it is asked for (its workflow's code).
            err_console.print(
                f"strategy {strategy_id} had already ended ({ended['state']}): nothing to drive",
                highlight=False,
            )
            _ended(ended, fmt)
            return
        event_loop.loop_kind()  # a bad FLEETWAVE_LOOP is refused before anything changes
        # Driving it here needs its workflow here (a Python one, or a YAML one naming a
        # Python action: its plug-in imported).
        strategy_workflow_def(store, strategy_id)
    if not wait:
        answer = commands.apply_strategy(store, strategy_id)
        before = str(answer["was"])
        who = queries.driving(store, strategy_id)
        now = str(answer["state"])
        if before == StrategyState.WAITING_APPROVAL:
            now += f" ('fleetwave strategy approve {strategy_id}' lets its next stage start)"
        elif now != "applying":
            now += " (apply does not undo an abort: a conductor finishes it)"
        elif before == "paused":
            now += " (resumed: it was paused)"
        if who.owner is not None:
            said = f"driven by conductor {who.owner}"
        elif who.claimer is not None:
            said = str(who.claim)
        else:
            said = "nothing drives it yet"
        if fmt is Format.json:
            # driven_by as `strategy show --format json` says it, word for word
            print_json(answer)
        else:
            console.print(f"strategy {strategy_id} {now}; {said}")
            later = _not_before(store, strategy_id)
            if later:
                console.print(f"strategy {strategy_id}: {later}", highlight=False)
        if who.nobody:
            err_console.print(
                f"warning: no conductor serves {store.url}: strategy {strategy_id} waits until "
                f"'fleetwave serve' runs (or drive it here: 'fleetwave strategy apply "
                f"{strategy_id} --wait')",
                highlight=False,
            )
        return
    before = _apply_patiently(store, strategy_id, ended["state"])
    if before == StrategyState.PAUSED.value:
        # Not resumed: this may be a job driving the rollout again after a crash, and the
        # pause an operator's, made meanwhile (an incident). Plain apply, or resume, ends it.
        err_console.print(
            f"strategy {strategy_id} is paused: driven here, nothing new starts until "
            f"'fleetwave strategy resume {strategy_id}' (apply --wait does not undo a pause)",
            highlight=False,
        )
    elif before in (StrategyState.ABORT_REQUESTED.value, StrategyState.ABORTING.value):
        err_console.print(
            f"strategy {strategy_id}: its abort was requested; apply does not undo an abort: "
            "driven here to its end",
            highlight=False,
        )
    try:
        result = drive_strategy(
            store, strategy_id, show_progress=fmt is Format.table, config=config
        )
    except KeyboardInterrupt:
        # Ctrl-C before the signal handlers were in place: stopped at once.
        err_console.print(stopped_at_once(store, strategy_id, config.lease_ttl_s), highlight=False)
        raise typer.Exit(130) from None
    if result.state == "interrupted":
        if not result.held:
            err_console.print(stopped_watching(store, strategy_id), highlight=False)
            raise typer.Exit(130)
        left = now_state(store, strategy_id)
        state = f"is still {left}" if left is not None else f"state could not be read ({UNREAD})"
        err_console.print(
            f"stopped: strategy {strategy_id} {state}"
            f"; leases handed back. Go on with 'fleetwave strategy apply {strategy_id} --wait' "
            "or 'fleetwave serve'",
            highlight=False,
        )
        raise typer.Exit(130)
    _ended(queries.get_strategy(store, strategy_id), fmt)


def _not_before(store: Store, sid: int) -> str:
    """What holds an applied strategy's first step, said by apply ("" if nothing)."""
    stored = queries.get_strategy(store, sid)["options"]
    if not isinstance(stored, dict):
        return ""
    after, windows = stored.get("start_after"), stored.get("windows") or []
    if after is None and not windows:
        return ""
    now = time.time()
    start = earliest_start(after, [parse_window(w) for w in windows], now)
    if start <= now:
        return ""
    why = "--start-after" if after is not None and start == after else "--window"
    return f"nothing starts before {shown_time(start)} ({why})"


def _apply_patiently(store: Store, strategy_id: int, was: str) -> str:
    """``apply --wait``'s first write (the strategy marked applying; a paused one is left
    paused), as patient as the conductor it starts: an outage (the database locked by
    another program past the time a write waits, read-only, full) is waited out and said
    once; Ctrl-C stops it with nothing changed. ``was``: its state as read before;
    returns the state it was in when applied."""
    failures = 0
    try:
        while True:
            try:
                return admin.apply_strategy(store, strategy_id, resume=False)
            except OperationalError as exc:
                if not store.hooks.is_outage(exc):
                    raise
                if store.hooks.needs_new_connections(exc):
                    store.dispose()  # a connection opened read-only stays so
                failures += 1
                if failures == 1:
                    err_console.print(
                        f"waiting: the database does not answer ({exc.orig}"
                        f"{database_hint(exc, waiting=True)}); strategy {strategy_id} is "
                        "applied and driven here once it does (Ctrl-C to stop: nothing is "
                        "changed until then)",
                        highlight=False,
                    )
                time.sleep(min(5.0, 0.05 * 2 ** min(failures, 7)))
    except KeyboardInterrupt:
        # The write may have gone through as the interrupt came (the lock released just
        # then): the database says which, if it answers.
        now = now_state(store, strategy_id)
        if now is not None and now != was:
            said = (
                f"stopped: strategy {strategy_id} is {now} (its apply went through as this "
                f"command stopped), and nothing drives it here: 'fleetwave strategy apply "
                f"{strategy_id} --wait' or 'fleetwave serve' does"
            )
        else:
            said = (
                f"stopped: strategy {strategy_id} was not applied (the database did not "
                "answer); nothing changed"
            )
        err_console.print(said, highlight=False)
        raise typer.Exit(130) from None


def _ended(summary: dict[str, Any], fmt: Format) -> None:
    """``apply --wait``'s answer: the strategy as it ended; exit 1 unless complete."""
    if fmt is Format.json:
        print_json(summary)
    else:
        emit_one(summary, fmt)
    if summary["state"] != StrategyState.COMPLETE:
        raise typer.Exit(1)


@strategy_app.command("approve")
def strategy_approve(
    strategy_id: StrategyId,
    by: Annotated[
        str | None,
        typer.Option(
            metavar="NAME",
            help="who approves (default: you; through a server: the token's name)",
        ),
    ] = None,
    fmt: FormatOpt = Format.table,
    db: DbOpt = None,
) -> None:
    """Let a strategy waiting for approval (--stage-approval) start its next stage."""
    server = remote.server(db)
    if server is not None:
        if by is not None:
            raise InputError(
                "--by: through a server the approval is recorded with the token's name"
            )
        answer = server.post(f"/v1/strategies/{strategy_id}/approve")
    else:
        who = (by if by is not None else _user()).strip()
        if not who:
            raise InputError("--by: an empty name")
        answer = admin.approve_strategy(existing_store(db), strategy_id, who)
    done(fmt, f"strategy {strategy_id}: {answer['details']}", answer)


def _user() -> str:
    """Who runs this command, as the system knows them."""
    try:
        return getpass.getuser()
    except (OSError, KeyError):
        return "unknown"


@strategy_app.command("pause")
def strategy_pause(
    strategy_id: StrategyId, fmt: FormatOpt = Format.table, db: DbOpt = None
) -> None:
    """Pause: no new step starts; steps in flight go on to their end. Undo with resume."""
    server = remote.server(db)
    answer = (
        server.post(f"/v1/strategies/{strategy_id}/pause")
        if server is not None
        else commands.pause_strategy(existing_store(db), strategy_id)
    )
    done(
        fmt,
        f"strategy {strategy_id}: already paused"
        if answer["was"] == "paused"
        else (
            f"strategy {strategy_id}: paused; no new step starts, steps in flight go on to "
            f"their end ('fleetwave strategy resume {strategy_id}' to go on)"
        ),
        answer,
    )


@strategy_app.command("resume")
def strategy_resume(
    strategy_id: StrategyId, fmt: FormatOpt = Format.table, db: DbOpt = None
) -> None:
    """Resume a paused strategy: its waiting steps start again."""
    server = remote.server(db)
    if server is not None:
        answer = server.post(f"/v1/strategies/{strategy_id}/resume")
    else:
        store = existing_store(db)
        answer = commands.resume_strategy(store, strategy_id)
    done(
        fmt,
        f"strategy {strategy_id}: not paused (applying)"
        if answer["was"] == "applying"
        else f"strategy {strategy_id}: resumed",
        answer,
    )
    if server is None:  # (a server's conductors are its own to watch)
        _warn_if_undriven(store, strategy_id, "strategy {sid} goes on", "drive")


@strategy_app.command("abort")
def strategy_abort(
    strategy_id: StrategyId, fmt: FormatOpt = Format.table, db: DbOpt = None
) -> None:
    """Abort: nothing new starts; running actions finish their current state, and waits
    on a target (for its callback, between polls) end at once."""
    server = remote.server(db)
    if server is not None:
        answer = server.post(f"/v1/strategies/{strategy_id}/abort")
    else:
        store = existing_store(db)
        answer = commands.abort_strategy(store, strategy_id)
    now = answer["state"]
    # what it was: aborted before, never applied (aborted by this call), asked for now,
    # or an abort asked for before and under way
    before = (
        now if not answer["asked_now"] else (StrategyState.INITIAL if now == "aborted" else None)
    )
    if before == StrategyState.ABORTED:
        done(fmt, f"strategy {strategy_id}: already aborted", answer)
        return
    if before == StrategyState.INITIAL:
        # never applied: its steps were ended in the same transaction, nothing to wait for
        done(fmt, f"strategy {strategy_id}: aborted (it was never applied)", answer)
        return
    if before is None:
        done(fmt, f"strategy {strategy_id}: abort requested", answer)
    else:
        done(fmt, f"strategy {strategy_id}: abort already requested ({before})", answer)
    # Its abort waits for a conductor (none drives it): said each time it is asked.
    if server is None:
        _warn_if_undriven(store, strategy_id, "the abort of strategy {sid} finishes", "finish")


def _warn_if_undriven(store: Store, sid: int, what: str, verb: str) -> None:
    """Warn on stderr when no conductor drives strategy ``sid`` nor will claim it: what
    was just asked waits until one does (``what`` says what waits; ``verb`` how the
    operator does it here)."""
    who = queries.driving(store, sid)
    if who.wanted and who.nobody:
        err_console.print(
            f"warning: no conductor serves {store.url}: {what.format(sid=sid)} once "
            f"'fleetwave serve' runs (or {verb} it here: 'fleetwave strategy apply {sid} "
            "--wait')",
            highlight=False,
        )


@strategy_app.command("show")
def strategy_show(strategy_id: StrategyId, fmt: FormatOpt = Format.table, db: DbOpt = None) -> None:
    """Show a strategy with its step counts per state."""
    server = remote.server(db)
    if server is not None:
        emit_one(server.get(f"/v1/strategies/{strategy_id}"), fmt)
        return
    emit_one(queries.get_strategy(existing_store(db), strategy_id), fmt)


@strategy_app.command("list")
def strategy_list(
    state: Annotated[
        list[str] | None,
        typer.Option(
            metavar="STATE",
            help="only strategies in this state; repeat it, or give a,b, for several",
        ),
    ] = None,
    fmt: FormatOpt = Format.table,
    db: DbOpt = None,
) -> None:
    """List strategies."""
    table = fmt is Format.table
    states = several("--state", state)
    known = [s.value for s in StrategyState]
    for one in states:
        if one not in known:
            raise InputError(f"--state: '{one}' is not a strategy state ({', '.join(known)})")
    server = remote.server(db)
    rows = (
        server.every("/v1/strategies", state=states, brief=table)
        if server is not None
        else queries.list_strategies(existing_store(db), brief=table, states=states)
    )
    if table:
        for row in rows:
            # at a glance: steps ended of all, how many of them did not complete, and who
            # drives it (`strategy show` says more: how to get it driven)
            counts = row["step_states"]
            bad = [f"{counts[s]} {s}" for s in ("failed", "aborted") if counts.get(s)]
            if row["waiting_to_retry"]:
                bad.append(f"{row['waiting_to_retry']} waiting to retry")
            row["done"] = f"{row['done']}/{row['steps']}" + (f" ({', '.join(bad)})" if bad else "")
    emit_rows(rows, ["id", "workflow", "state", "done", "driven_by", "details"], fmt)


@strategy_app.command("delete")
def strategy_delete(
    strategy_id: StrategyId,
    ignore_missing: IgnoreMissingOpt = False,
    fmt: FormatOpt = Format.table,
    db: DbOpt = None,
) -> None:
    """Delete a strategy that is not running: its steps leave the working tables, its
    history (journal, attempts, events, callbacks) is kept until `fleetwave prune`."""
    store = existing_store(db)
    try:
        admin.delete_strategy(store, strategy_id)
    except NotFound:
        if not ignore_missing:
            raise
        missing(fmt, f"strategy {strategy_id}", {"id": strategy_id})
        return
    except KeyboardInterrupt:
        # Each chunk is its own transaction: what was moved stays moved, the rest
        # stays until the command runs again (the strategy shows `deleting`). Ctrl-C
        # may also come before the first commit (waiting for the write lock) or after
        # the last: the database says which.
        try:
            now: str | None = queries.get_strategy(store, strategy_id)["state"]
        except NotFound:
            now = None
        if now is None or now == StrategyState.DELETED:
            _deleted(fmt, strategy_id)
            return
        if now == StrategyState.DELETING:
            said = (
                f"stopped: strategy {strategy_id} is partly deleted (it shows 'deleting'); "
                f"'fleetwave strategy delete {strategy_id}' finishes it"
            )
        else:
            said = f"stopped: nothing deleted; strategy {strategy_id} is still {now}"
        err_console.print(said, highlight=False)
        raise typer.Exit(130) from None
    _deleted(fmt, strategy_id)


def _deleted(fmt: Format, sid: int) -> None:
    done(
        fmt,
        f"strategy {sid} deleted; its history is kept ('fleetwave history --strategy {sid}') "
        "until 'fleetwave prune' drops it",
        {"id": sid, "deleted": True},
    )
