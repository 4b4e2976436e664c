"""``fleetwave site-emulator``: serve N emulated remote sites on one port (one asyncio
process, one app; see docs/site-emulator.md), and write them as targets for
``fleetwave target import``.

FastAPI and uvicorn are imported when the command runs, not when ``fleetwave`` starts.
"""

from __future__ import annotations

import contextlib
import csv
import ipaddress
import math
import signal
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any

import typer

from fleetwave.cli.output import err_console
from fleetwave.domain.errors import InputError
from fleetwave.emulator.settings import (
    MAX_LATENCY_MS,
    ConfigError,
    EmulatorConfig,
    SiteSettings,
    load_config,
    merged_settings,
)

#: how many connections wait to be accepted (a rollout at max parallel 500 opens many)
BACKLOG = 2048
#: the signals that stop the emulator (gracefully: answers under way are finished)
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
#: the range of --time-scale
TIME_SCALE_MIN, TIME_SCALE_MAX = 0.0001, 1000.0


def site_emulator_command(
    sites: Annotated[int, typer.Option(help="how many sites to serve")] = 10,
    port: Annotated[int, typer.Option(help="port to listen on (0: any free port)")] = 9000,
    host: Annotated[str, typer.Option(help="address to listen on")] = "127.0.0.1",
    config: Annotated[
        Path | None,
        typer.Option(metavar="FILE", help="YAML or JSON: settings of all sites and of each"),
    ] = None,
    latency_ms: Annotated[
        float | None, typer.Option(help="each site's answer delay (real ms; default 0)")
    ] = None,
    fail_rate: Annotated[
        float | None, typer.Option(help="chance a remote strategy fails (0..1; default 0)")
    ] = None,
    seed: Annotated[int, typer.Option(help="seed of every random draw")] = 0,
    time_scale: Annotated[
        float, typer.Option(help="real seconds per site second (0.01: 100 times faster)")
    ] = 1.0,
    targets_csv: Annotated[
        Path | None,
        typer.Option(metavar="FILE", help="write the sites as a CSV for 'fleetwave target import'"),
    ] = None,
) -> None:
    """Serve emulated remote sites, each with a subcloud's software update API.

    Runs until interrupted (Ctrl-C or SIGTERM).
    """
    from fleetwave.emulator.app import MAX_SITES, Fleet, make_app

    if not 1 <= sites <= MAX_SITES:
        raise InputError(f"--sites: must be 1 to {MAX_SITES}, got {sites}")
    if not 0 <= port <= 65535:
        raise InputError(f"--port: must be 0 to 65535, got {port}")
    if not TIME_SCALE_MIN <= time_scale <= TIME_SCALE_MAX or math.isnan(time_scale):
        raise InputError(
            f"--time-scale: must be {TIME_SCALE_MIN:g} to {TIME_SCALE_MAX:g}, got {time_scale:g}"
        )
    if latency_ms is not None and not 0 <= latency_ms <= MAX_LATENCY_MS:
        raise InputError(f"--latency-ms: must be 0 to {MAX_LATENCY_MS:g}, got {latency_ms:g}")
    if fail_rate is not None and not 0 <= fail_rate <= 1:
        raise InputError(f"--fail-rate: must be 0 to 1, got {fail_rate:g}")
    given: dict[str, Any] = {}
    if latency_ms is not None:
        given["latency_ms"] = latency_ms
    if fail_rate is not None:
        given["fail_rate"] = fail_rate
    loaded = EmulatorConfig()
    try:
        if config is not None:
            loaded = load_config(config)  # (its errors name the file)
    except ConfigError as exc:
        raise InputError(str(exc)) from None
    try:
        defaults = merged_settings(SiteSettings(), loaded.defaults, "defaults")
        defaults = merged_settings(defaults, given, "option")  # the options win
        fleet = Fleet(sites, seed=seed, time_scale=time_scale, defaults=defaults, config=loaded)
    except ConfigError as exc:
        raise InputError(f"{config}: {exc}" if config is not None else str(exc)) from None
    sock = listen_socket(host, port)
    bound = sock.getsockname()[1]
    base = f"http://{url_host(host)}:{bound}"
    try:
        if targets_csv is not None:
            write_targets_csv(targets_csv, base, list(fleet.sites))
        _serve(make_app(fleet), sock, sites, base)
    finally:
        sock.close()


def write_targets_csv(path: Path, base: str, names: list[str]) -> None:
    """The sites as targets: name, driver (http), url (the site's API base)."""
    try:
        with path.open("w", newline="", encoding="utf-8") as out:
            writer = csv.writer(out)
            writer.writerow(["name", "driver", "url"])
            for name in names:
                writer.writerow([name, "http", f"{base}/sites/{name}"])
    except OSError as exc:
        raise InputError(f"--targets-csv: cannot write {path}: {exc.strerror or exc}") from None


def url_host(host: str) -> str:
    """The host as a URL names it: a wildcard address as loopback, IPv6 in brackets."""
    if host in {"", "0.0.0.0"}:
        return "127.0.0.1"
    if host == "::":
        return "[::1]"
    try:
        return f"[{host}]" if ipaddress.ip_address(host).version == 6 else host
    except ValueError:
        return host  # a name


def listen_socket(
    host: str, port: int, named: tuple[str, str] = ("--host", "--port")
) -> socket.socket:
    """A listening socket, bound here so that --port 0's port is known before serving
    (and written in the CSV); connections wait in its backlog until the app runs.
    ``named``: the options that gave the host and the port, for the errors."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except (socket.gaierror, UnicodeError) as exc:
        raise InputError(f"{named[0]}: cannot resolve {host!r}: {exc}") from None
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(BACKLOG)
    except OSError as exc:
        sock.close()
        raise InputError(
            f"{named[1]}: cannot listen on {host}:{port}: {exc.strerror or exc}"
        ) from None
    sock.setblocking(False)
    return sock


def _serve(app: Any, sock: socket.socket, count: int, base: str) -> None:
    import uvicorn

    from fleetwave.engine import loop as event_loop

    class Server(uvicorn.Server):
        """Ctrl-C or SIGTERM stop it gracefully, and the command ends as a clean stop
        (uvicorn's own raised the signal again afterwards: 'interrupted', exit 130)."""

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            before = {sig: signal.signal(sig, self.handle_exit) for sig in STOP_SIGNALS}
            try:
                yield
            finally:
                for sig, handler in before.items():
                    signal.signal(sig, handler)

    server = Server(
        uvicorn.Config(
            app,
            log_config=None,  # fleetwave's logging, as every command's
            log_level="warning",
            access_log=False,
            backlog=BACKLOG,
            timeout_keep_alive=30,
        )
    )
    err_console.print(
        f"site-emulator: {count} site{'' if count == 1 else 's'} on {base}/sites/; Ctrl-C to stop",
        highlight=False,
    )
    event_loop.run(server.serve(sockets=[sock]))
    err_console.print("site-emulator stopped", highlight=False)
