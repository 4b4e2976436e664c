"""Serving the API with uvicorn on the loop that runs the engine (``fleetwave serve
--listen``), or alone (``--no-engine``).

The socket is bound before anything starts (a port in use is said at once, as bad
input). The command's own signal handling stops both: uvicorn's is turned off, and
the API stops once the engine has stopped (callbacks stored meanwhile are kept).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import uvicorn

from fleetwave.api.app import served_app
from fleetwave.api.service import Service
from fleetwave.cli.site_emulator import listen_socket, url_host
from fleetwave.domain.errors import InputError


def parse_listen(listen: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[::1]:8080`` for IPv6; ``:8080`` is every address): the host
    and port, or bad input naming ``--listen``."""
    host, sep, port_text = listen.strip().rpartition(":")
    if not sep or not port_text.isascii() or not port_text.isdigit():
        raise InputError(f"--listen: expected HOST:PORT (127.0.0.1:8080), got {listen!r}")
    port = int(port_text)
    if port > 65535:
        raise InputError(f"--listen: port must be 0 to 65535, got {port}")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host or "0.0.0.0", port


def bind(listen: str, tls: Tls | None = None) -> tuple[socket.socket, str]:
    """The API's listening socket, bound now, and the base URL it is reached at."""
    host, port = parse_listen(listen)
    sock = listen_socket(host, port, ("--listen", "--listen"))
    scheme = "https" if tls is not None else "http"
    return sock, f"{scheme}://{url_host(host)}:{sock.getsockname()[1]}"


@dataclass(frozen=True)
class Tls:
    """``--tls-cert`` and ``--tls-key``: PEM files, checked when given."""

    cert: str
    key: str

    @classmethod
    def given(cls, cert: str | None, key: str | None) -> Tls | None:
        if cert is None and key is None:
            return None
        if cert is None or key is None:
            raise InputError("--tls-cert and --tls-key: give both (or neither)")
        try:
            ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(cert, key)
        except FileNotFoundError as exc:
            raise InputError(f"--tls-cert/--tls-key: {exc.filename}: no such file") from None
        except (ssl.SSLError, OSError) as exc:
            raise InputError(
                f"--tls-cert/--tls-key: {cert} and {key} are not a certificate and its key "
                f"in PEM ({exc})"
            ) from None
        return cls(cert, key)


class _Server(uvicorn.Server):
    """uvicorn, leaving the signals to the command (it stops the engine first)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


async def serve_api(
    service: Service,
    sock: socket.socket,
    stop: asyncio.Event,
    tls: Tls | None = None,
    started: Callable[[], None] | None = None,
) -> None:
    """Serve the API on ``sock`` until ``stop`` is set (requests under way finish);
    ``started`` is called once it answers requests."""
    server = _Server(
        uvicorn.Config(
            served_app(service),
            ssl_certfile=tls.cert if tls is not None else None,
            ssl_keyfile=tls.key if tls is not None else None,
            log_config=None,  # fleetwave's logging, as every command's
            log_level="warning",
            access_log=False,
            timeout_keep_alive=30,
            timeout_graceful_shutdown=10,
        )
    )
    serving = asyncio.create_task(server.serve(sockets=[sock]), name="fleetwave-api")
    stopped = asyncio.create_task(stop.wait())
    if started is not None:
        while not server.started and not serving.done():
            await asyncio.sleep(0.01)
        if server.started:
            started()
    try:
        await asyncio.wait({serving, stopped}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        await service.live_close()  # (open pages' streams would hold the stop up)
        server.should_exit = True
        stopped.cancel()
        await asyncio.gather(stopped, return_exceptions=True)
        await serving
