"""``fleetwave``: the root command, with ``init`` and ``serve``; how every command's
options are read (an option given twice is refused) and how its errors end it.

The groups of commands live in their own modules (``targets``, ``groups``,
``workflows``, ``strategies``, ``steps``; ``journal`` for history, events and check;
``demo``, ``simcmd`` and ``site_emulator``), put together here in the order
``fleetwave --help`` lists them.

Bad input prints one line naming the problem on stderr and exits 2; nothing is written.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import socket
import sys
from typing import TYPE_CHECKING, Annotated, Any

import typer
from sqlalchemy.exc import DBAPIError

import fleetwave
from fleetwave.cli import output, remote
from fleetwave.cli.common import (
    DbOpt,
    LeaseTtlOpt,
    database_hint,
    db_named,
    discard_created,
    engine_config,
    existing_store,
    forget_created,
    store_for,
)
from fleetwave.cli.conductors import conductor_app
from fleetwave.cli.demo import demo_command
from fleetwave.cli.drive import ServeReport, stop_on_signals
from fleetwave.cli.drivers import driver_app
from fleetwave.cli.groups import group_app
from fleetwave.cli.journal import check, events, history
from fleetwave.cli.output import console, err_console
from fleetwave.cli.prune import prune
from fleetwave.cli.simcmd import sim_command
from fleetwave.cli.site_emulator import site_emulator_command
from fleetwave.cli.steps import step_app
from fleetwave.cli.strategies import strategy_app
from fleetwave.cli.targets import target_app
from fleetwave.cli.tokens import token_app
from fleetwave.cli.workflows import workflow_app
from fleetwave.domain.errors import InputError
from fleetwave.domain.models import plural
from fleetwave.domain.registry import load_plugins
from fleetwave.domain.workflow import WorkflowError
from fleetwave.engine import loop as event_loop
from fleetwave.engine.conductor import Conductor
from fleetwave.engine.errors import StoreReplaced, StoreUnavailable
from fleetwave.store import queries
from fleetwave.store.db import (
    HEAD_REVISION,
    SchemaOutdated,
    StoreError,
    default_db_path,
    mark_initialised,
    migrate,
    open_store,
)
from fleetwave.store.postgres import redact

if TYPE_CHECKING:
    from fleetwave.api.apart import ApiProcess
    from fleetwave.api.serve import Tls
    from fleetwave.api.service import Service


class _Interrupted(BaseException):
    """Ctrl-C (or SIGTERM, SIGHUP) that no command handled itself: Typer would turn a
    ``KeyboardInterrupt`` into exit 130 without a word."""


def _no_type_for_a_flag(shown: Any) -> Any:
    """Typer's help shows a flag's type (``--all <bool>``, ``--wait <bool>``), which
    reads as if it took a value (``--all true``); a flag shows none. Typer's own hook
    for the type column, wrapped (tests/test_cli_errors.py checks the help)."""

    def display_type_rich(self: Any, ctx: Any) -> Any:
        return None if self.is_flag else shown(self, ctx)

    return display_type_rich


typer.core.TyperOption.display_type_rich = _no_type_for_a_flag(  # type: ignore[method-assign]
    typer.core.TyperOption.display_type_rich
)


class _Commands(typer.core.TyperGroup):
    def invoke(self, ctx: Any) -> Any:
        try:
            return super().invoke(ctx)
        except KeyboardInterrupt:
            raise _Interrupted from None

    def resolve_command(self, ctx: Any, args: list[str]) -> Any:
        name, cmd, rest = super().resolve_command(ctx, args)
        if cmd is not None and not isinstance(cmd, typer.core.TyperGroup) and "--help" not in rest:
            _refuse_repeats(ctx, cmd, rest)  # (asked for help: the help, whatever else)
        return name, cmd, rest


def _refuse_repeats(ctx: Any, cmd: Any, args: list[str]) -> None:
    """An option that takes one value, given twice: Click keeps the last without a word
    (``--group ga --group gb`` made a strategy of gb only; ``--max-parallel 3
    --max-parallel 9`` ran at 9). Refused, as a name given twice in --targets is."""
    takes = {
        opt: param
        for param in cmd.params
        if getattr(param, "param_type_name", "") == "option"
        for opt in [*param.opts, *param.secondary_opts]
    }
    seen: set[str] = set()
    #: a flag's forms given (--wait, --no-wait): both would keep the last silently
    forms: dict[str, list[str]] = {}
    i = 0
    while i < len(args):
        token = args[i]
        i += 1
        if token == "--":
            break
        opt = token.split("=", 1)[0] if token.startswith("--") else token
        if opt not in takes:
            continue
        param = takes[opt]
        first = param.opts[0]
        if param.is_flag:
            given = forms.setdefault(first, [])
            if opt not in given:
                given.append(opt)
            if len(given) > 1:
                ctx.fail(f"{' and '.join(given)}: give one of them")
            continue
        if "=" not in token:
            i += 1  # its value, whatever it looks like
        if not (param.multiple or param.count):  # one value only
            if first in seen:
                ctx.fail(f"{first}: given more than once (it takes one value)")
            seen.add(first)


app = typer.Typer(
    cls=_Commands,
    help="fleetwave: roll one operation across a fleet, exactly once per state.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
# Each group's commands read their options as the root's do (_Commands): the class is
# given here, where it is defined (the groups' modules cannot import this one).
app.add_typer(target_app, name="target", cls=_Commands)
app.add_typer(group_app, name="group", cls=_Commands)
app.add_typer(workflow_app, name="workflow", cls=_Commands)
app.add_typer(strategy_app, name="strategy", cls=_Commands)
app.add_typer(step_app, name="step", cls=_Commands)
app.add_typer(conductor_app, name="conductor", cls=_Commands)
app.add_typer(driver_app, name="driver", cls=_Commands)
app.add_typer(token_app, name="token", cls=_Commands)
app.command("demo")(demo_command)
app.command("sim")(sim_command)
app.command("site-emulator")(site_emulator_command)


def _print_version(value: bool) -> None:
    if value:
        console.print(f"fleetwave {fleetwave.__version__}", highlight=False)
        raise typer.Exit(0)


@app.callback()
def _root(
    version: Annotated[
        bool,
        typer.Option("--version", callback=_print_version, is_eager=True, help="print the version"),
    ] = False,
    url: Annotated[
        str | None,
        typer.Option(
            "--url",
            envvar=remote.URL_ENV,
            metavar="URL",
            help="read (and pause, resume, abort) through a server's REST API instead of "
            "a database (token: $FLEETWAVE_TOKEN)",
            show_envvar=False,
        ),
    ] = None,
) -> None:
    """fleetwave: roll one operation across a fleet, exactly once per state."""
    remote.set_url(url)


@app.command()
def init(db: DbOpt = None) -> None:
    """Create the database, or upgrade an older fleetwave's to this one's schema."""
    try:
        store = store_for(db)
    except SchemaOutdated as old:
        # Upgrading under a running conductor of the older fleetwave would change its
        # tables under it: every conductor using the database stops first.
        store = open_store(db or default_db_path(), migrate_schema=False)
        running = queries.running_conductors(store)
        if running:
            names = ", ".join(queries.conductor_named(c) for c in running)
            raise InputError(
                f"{db_named(db)}: {store.url} is in use by "
                f"conductor{'s' if len(running) > 1 else ''} "
                f"{names}: stop {'them' if len(running) > 1 else 'it'}, then run "
                "'fleetwave init' again (nothing was changed)"
            ) from None
        if migrate(store) == HEAD_REVISION:
            # another 'fleetwave init' upgraded it meanwhile (this one waited for it)
            console.print(f"database ready (upgraded meanwhile by another init): {store.url}")
            return
        console.print(
            f"database upgraded from schema revision {old.revision} to {HEAD_REVISION}: {store.url}"
        )
        return
    mark_initialised(store)
    console.print(f"database ready: {store.url}")


# here, after init: `fleetwave --help` lists the commands in the order they are added
app.command()(history)
app.command()(events)
app.command()(check)
app.command()(prune)


@app.command()
def serve(
    listen: Annotated[
        str | None,
        typer.Option(
            metavar="HOST:PORT",
            help="also serve the REST API and the web dashboard here (127.0.0.1:8080; see "
            "docs/api.md)",
        ),
    ] = None,
    no_engine: Annotated[
        bool,
        typer.Option("--no-engine", help="serve only the API (a conductor runs elsewhere)"),
    ] = False,
    one_process: Annotated[
        bool,
        typer.Option(
            "--one-process",
            help="serve the API on the engine's own event loop (by default it is served "
            "from a process of its own beside the engine's; see docs/api.md)",
        ),
    ] = False,
    tls_cert: Annotated[
        str | None,
        typer.Option(metavar="FILE", help="serve the API over HTTPS: its certificate (PEM)"),
    ] = None,
    tls_key: Annotated[
        str | None, typer.Option(metavar="FILE", help="... and the certificate's key (PEM)")
    ] = None,
    read_cache_ms: Annotated[
        int,
        typer.Option(
            metavar="MS",
            min=0,
            max=60_000,
            help="with --listen: give the answer of a strategy's show, and of a page of "
            "its steps, again for this long, unless changed through the API meanwhile "
            "(0: never); up to 4 times as long while it is read again",
        ),
    ] = 250,
    lease_ttl: LeaseTtlOpt = None,
    log_format: Annotated[
        output.LogFormat,
        typer.Option(
            metavar="FORMAT",
            help="text, or json: each line on stderr one JSON object (time, level, "
            "logger, message, and strategy, step, target where known)",
        ),
    ] = output.LogFormat.text,
    db: DbOpt = None,
) -> None:
    """Run a conductor: drive every applying strategy until interrupted (Ctrl-C); with
    --listen, serve the REST API beside it."""
    if log_format is output.LogFormat.json:
        output.use_json_logs()
    if no_engine and listen is None:
        raise InputError("--no-engine: only with --listen (it serves the API alone)")
    if no_engine and lease_ttl is not None:
        raise InputError("--lease-ttl: not with --no-engine (no conductor runs here)")
    if listen is None and (tls_cert is not None or tls_key is not None):
        raise InputError("--tls-cert and --tls-key: only with --listen (they are the API's)")
    if one_process and (listen is None or no_engine):
        raise InputError("--one-process: only with --listen, and not with --no-engine")
    config = engine_config(lease_ttl)
    event_loop.loop_kind()  # refuse a bad FLEETWAVE_LOOP before announcing anything
    load_plugins()  # and a plug-in that cannot be imported, before taking anything on
    # Never a new database: a mistyped --db would be served, empty, for good (a service
    # manager restarting it), while the real fleet's strategies wait for nobody.
    store = existing_store(db)
    apart = listen is not None and not no_engine and not one_process
    api = None
    if listen is not None:
        api = _Api.bind(listen, db, tls_cert, tls_key, apart, log_format, read_cache_ms / 1000)
    if apart:
        # the engine finds the callbacks the API's process stores (SQLite: by a look
        # at the highest id; PostgreSQL's NOTIFY wakes it anyway)
        from fleetwave.api.apart import CALLBACK_WATCH_S

        config.callback_watch_s = CALLBACK_WATCH_S
        store.turns_across_processes = True  # (the API's process writes as often)
    if no_engine:
        assert api is not None
        _serve_api_alone(api)
        return
    others = [queries.conductor_named(c) for c in queries.serving_conductors(store)]
    verb = "serves" if len(others) == 1 else "serve"
    if others and store.hooks.for_update:
        # PostgreSQL: the setup for many conductors, which share every strategy's steps
        err_console.print(
            f"{plural(len(others), 'conductor')} already {verb} {store.url} "
            f"({', '.join(others)}): this one drives every applying strategy together "
            "with them",
            highlight=False,
        )
    elif others:
        # Allowed (each strategy is driven by one conductor at a time, by claim and
        # fence), but on SQLite one serve per database is the setup: a second one adds
        # no throughput (one writer) and is more often a leftover than a choice.
        err_console.print(
            f"warning: {plural(len(others), 'conductor')} already {verb} {store.url} "
            f"({', '.join(others)}): they share its strategies, each driven by one",
            highlight=False,
        )

    def stopped_now() -> str:
        return (
            f"stopped at once: the leases were not handed back and run out within "
            f"{config.lease_ttl_s:g} s; the next conductor takes over then"
        )

    async def _serve() -> None:
        stop = asyncio.Event()
        conductor = Conductor(store, config=config)
        stop_on_signals(stop, conductor.config.shutdown_grace_s, at_once=stopped_now)
        report = ServeReport(store, conductor)
        reporter: list[asyncio.Task[None]] = []
        serving = await api.start(stop, conductor) if api is not None else None

        def ready() -> None:
            # Said once registered: a database locked at start is waited for (logged) first.
            also = f", and the {api.said}" if api is not None else ""
            err_console.print(
                f"conductor {conductor.id} serving {store.url}{also}; Ctrl-C to stop",
                highlight=False,
            )
            reporter.append(asyncio.create_task(report.run()))

        try:
            await conductor.run(stop=stop, on_ready=ready)
        finally:
            for task in reporter:
                task.cancel()
            await asyncio.gather(*reporter, return_exceptions=True)
            if api is not None and serving is not None:
                # after the conductor: callbacks sent while it stopped are still stored
                await api.stop(serving)
        if reporter:
            report.tick(stopped=True)  # what ended meanwhile, and what was handed back
        err_console.print(f"conductor {conductor.id} stopped; leases handed back")

    try:
        event_loop.run(_serve())
    except KeyboardInterrupt:
        # The second Ctrl-C (or SIGTERM): stopped at once, nothing handed back.
        err_console.print(stopped_now(), highlight=False)
        raise typer.Exit(130) from None
    finally:
        if api is not None:
            api.sock.close()


class _Api:
    """``serve --listen``: the REST API, served from a process of its own beside the
    engine's (see fleetwave.api.apart), or on the command's loop (``--one-process``,
    ``--no-engine``). It has its own connections to the database (its requests never
    wait for the engine's), and runs its store calls on its own threads (see
    fleetwave.api.service)."""

    def __init__(
        self,
        sock: socket.socket,
        base: str,
        service: Service | None,
        tls: Tls | None,
        process: ApiProcess | None,
    ) -> None:
        self.sock = sock
        self.service = service
        self.tls = tls
        self.process = process
        self.said = f"API on {base}/v1 (OpenAPI: {base}/openapi.json; dashboard: {base}/)"
        self._stop = asyncio.Event()

    @classmethod
    def bind(
        cls,
        listen: str,
        db: str | None,
        cert: str | None,
        key: str | None,
        apart: bool = False,
        log_format: output.LogFormat = output.LogFormat.text,
        read_cache_s: float = 0.25,  # (api.service.READ_CACHE_S_DEFAULT: not imported)
    ) -> _Api:
        """Bound now: a port in use is bad input before anything starts."""
        from fleetwave.api.apart import ApiProcess, ChildSettings
        from fleetwave.api.serve import Tls, bind
        from fleetwave.api.service import Service

        tls = Tls.given(cert, key)
        sock, base = bind(listen, tls)
        if apart:
            level = logging.getLevelName(logging.getLogger().getEffectiveLevel()).lower()
            json_logs = log_format is output.LogFormat.json
            settings = ChildSettings(db, tls, json_logs, level, read_cache_s)
            return cls(sock, base, None, tls, ApiProcess(sock, settings))
        service = Service(existing_store(db), read_cache_s=read_cache_s)
        return cls(sock, base, service, tls, None)

    async def start(self, stop: asyncio.Event, conductor: Conductor | None) -> asyncio.Task[None]:
        """Serve until :meth:`stop`; if the API fails, ``stop`` is set (all stops). The
        API's own process answers requests once this returns."""
        from fleetwave.api.serve import serve_api

        if self.process is not None:
            await self.process.start(conductor)
            task = asyncio.create_task(self.process.wait_ended())
        else:
            assert self.service is not None
            self.service.conductor = conductor
            task = asyncio.create_task(serve_api(self.service, self.sock, self._stop, self.tls))
        task.add_done_callback(lambda _: stop.set())
        return task

    async def stop(self, task: asyncio.Task[None]) -> None:
        self._stop.set()
        if self.process is not None:
            await self.process.stop()
        await task
        err_console.print("API stopped", highlight=False)


def _serve_api_alone(api: _Api) -> None:
    """``serve --listen --no-engine``: the API until Ctrl-C or SIGTERM."""

    async def _alone() -> None:
        stop = asyncio.Event()
        stop_on_signals(stop, 0, said=lambda: "stopping: requests under way finish")
        serving = await api.start(stop, None)
        err_console.print(f"serving the {api.said}; Ctrl-C to stop", highlight=False)
        try:
            await stop.wait()
        finally:
            await api.stop(serving)

    try:
        event_loop.run(_alone())
    except KeyboardInterrupt:
        raise typer.Exit(130) from None
    finally:
        api.sock.close()


LOG_LEVELS = ("debug", "info", "warning", "error")


def configure_logging(level: str) -> None:
    """Log lines at ``level`` and above to stderr, as every command does."""
    handler = output.ConsoleLogHandler()
    handler.setFormatter(output.utc_log_formatter())
    logging.basicConfig(level=level.upper(), handlers=[handler])
    if level != "debug":
        # its "Context impl SQLiteImpl" lines at every start said nothing of the rollout
        logging.getLogger("alembic").setLevel(logging.WARNING)


#: the exit status when whoever read the output went away (``| head``): what a shell
#: reports for a process that SIGPIPE ended (128 + 13)
READER_GONE = 141


def main() -> None:
    _never_fail_to_print()
    level = os.environ.get("FLEETWAVE_LOG", "warning").strip().lower() or "warning"
    if level not in LOG_LEVELS:
        _fail(f"FLEETWAVE_LOG: unknown level '{level}' (choose one of {', '.join(LOG_LEVELS)})", 2)
    configure_logging(level)
    forget_created()
    remote.set_url(None)  # (the root command sets it, from --url or FLEETWAVE_URL)
    try:
        # Not standalone: bad usage (an unknown option or value) is reported below as
        # one line, like every other bad input, instead of in a boxed panel.
        code = app(standalone_mode=False)
        sys.stdout.flush()  # here, not at exit, where a closed pipe could not be told
    except BrokenPipeError:
        _reader_gone()
    except SystemExit:
        if _stdout_closed_under_click():
            _reader_gone()
        raise
    except typer.TyperException as exc:  # usage: exit 2 (Click's code for bad usage)
        discard_created()
        _fail(_usage_problem(exc), exc.exit_code)
    except (typer.Abort, _Interrupted, KeyboardInterrupt):
        # What it was writing is rolled back (an admin command writes in one
        # transaction). A bare KeyboardInterrupt: before any command ran (Typer building
        # the command tree), which printed a traceback and died of the signal.
        _fail("interrupted", 130)
    except (InputError, WorkflowError, StoreError, event_loop.LoopChoiceError) as exc:
        discard_created()
        _fail(str(exc), 2)
    except StoreReplaced as exc:
        _fail(f"{exc}; {exc.advice}", 1)
    except StoreUnavailable as exc:
        # Asked to stop (Ctrl-C, SIGTERM) while the database did not answer.
        _fail(
            f"stopped without handing the leases back: the database did not answer ({exc}); "
            "they run out by themselves: go on with 'fleetwave serve' or "
            "'fleetwave strategy apply ID --wait'",
            130,
        )
    except DBAPIError as exc:
        # The database failed the command (locked by another program for longer than
        # a write waits, or an error a conductor does not ride out): one line, not a
        # traceback. The failed transaction was rolled back (an admin command's only
        # one: nothing of it was written).
        logging.getLogger("fleetwave").debug("database error", exc_info=True)
        said = " ".join(str(exc.orig).split())  # (PostgreSQL's run over several lines)
        _fail(f"database: {said}{database_hint(exc)}; its transaction was rolled back", 1)
    sys.exit(code if isinstance(code, int) else 0)


def _usage_problem(exc: typer.TyperException) -> str:
    """Click's message, except for a negative number where an id goes (``strategy show
    -1``): Click reads it as an unknown option, which names no real problem."""
    # Typer's choice check words it "Value error, 'x' is not one of ...": the value
    # error is the message itself
    message = exc.format_message().replace(": Value error, ", ": ")
    name = getattr(exc, "option_name", None)  # Click's NoSuchOption (Typer keeps it private)
    if isinstance(name, str) and re.fullmatch(r"-\d+", name) and "No such option" in message:
        return (
            f"{name}: ids and counts are whole numbers from 0 "
            "(a negative number is read as an option)"
        )
    typed = re.fullmatch(
        r"(Invalid value for '[^']+': )Input should be a valid (number|integer), "
        r"unable to parse string as an? (?:number|integer)",
        message,
    )
    if typed is not None:
        # Typer's number check neither says what it was given (the command line does)
        # nor says it briefly: worded as the ids' own check ("'abc' is not a whole number").
        what = "a whole number" if typed.group(2) == "integer" else "a number"
        given = _option_value(getattr(getattr(exc, "param", None), "opts", None) or [])
        message = f"{typed.group(1)}{'the value' if given is None else repr(given)} is not {what}"
    # as every other bad value is said: the option, then the problem ("--max-parallel:
    # must be at least 1, got 0"), not Click's "Invalid value for '--max-parallel': ..."
    worded = re.fullmatch(r"Invalid value for '([^']+)': (.*)", message, re.DOTALL)
    return message if worded is None else f"{worded.group(1)}: {worded.group(2)}"


def _option_value(opts: list[str]) -> str | None:
    """What the command line gave one of ``opts`` (the last time it was given)."""
    args, given = sys.argv[1:], None
    for i, arg in enumerate(args):
        for opt in opts:
            if arg == opt and i + 1 < len(args):
                given = args[i + 1]
            elif arg.startswith(opt + "="):
                given = arg[len(opt) + 1 :]
    return given


def _never_fail_to_print() -> None:
    """A terminal or pipe whose encoding cannot show a name (``PYTHONIOENCODING=ascii``,
    an old locale) gets it backslash-escaped, not a traceback: names may be in any
    script. A closed stdout or stderr (``>&-``: Python then has none) swallows what is
    printed, as before, instead of failing the command after its work is done."""
    if sys.stdout is None:
        sys.stdout = open(os.devnull, "w", encoding="utf-8")  # noqa: SIM115 (for the process)
    if sys.stderr is None:
        sys.stderr = open(os.devnull, "w", encoding="utf-8")  # noqa: SIM115
    for stream in (sys.stdout, sys.stderr):
        encoding = (getattr(stream, "encoding", None) or "").lower().replace("-", "")
        reconfigure = getattr(stream, "reconfigure", None)
        if encoding != "utf8" and reconfigure is not None:
            reconfigure(errors="backslashreplace")


def _stdout_closed_under_click() -> bool:
    """Click answers a closed stdout (EPIPE) by wrapping the streams and exiting 1."""
    return type(sys.stdout).__name__ == "PacifyFlushWrapper"


def _reader_gone() -> None:
    """The reader of stdout went away (``fleetwave target list | head -1``): no more
    output, no message, exit 141, as for any command ended by SIGPIPE."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.__stdout__.fileno() if sys.__stdout__ is not None else 1)
    os.close(devnull)
    os._exit(READER_GONE)


def _fail(message: str, code: int) -> None:
    """One line on stderr, never wrapped (scripts and logs read it whole), and exit.

    No line for an empty message: ``fleetwave`` alone prints its help and exits 2.
    """
    if message:
        # never a password: a URL's, PGPASSWORD's (a driver's message may quote them)
        output.err_console.print(f"error: {redact(message)}", highlight=False)
    sys.exit(code)


if __name__ == "__main__":
    main()
