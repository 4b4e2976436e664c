"""A real ``fleetwave serve --listen 127.0.0.1:0`` in a child process, for the API tests:
started on a free port (read from the line it prints once it serves), stopped with
SIGTERM as a service manager stops it."""

from __future__ import annotations

import json
import os
import re
import signal
import ssl
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from test_cli_scripting import FLEETWAVE
from test_cli_scripting import _run as run_fleetwave


@dataclass
class Server:
    base: str
    proc: subprocess.Popen[str]
    #: what it printed on stderr so far
    lines: list[str] = field(default_factory=list)

    def client(
        self, token: str | None = None, verify: bool | ssl.SSLContext = True
    ) -> httpx.Client:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        return httpx.Client(base_url=self.base, headers=headers, timeout=30, verify=verify)

    def stop(self) -> int:
        """SIGTERM, as a service manager stops it; its exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=60)


@contextmanager
def serving(
    db: Path, *options: str, env: dict[str, str] | None = None, listen: str = "127.0.0.1:0"
) -> Iterator[Server]:
    """``fleetwave serve --listen LISTEN OPTIONS --db DB`` until the block ends (a free
    port unless ``listen`` names one)."""
    proc = subprocess.Popen(
        [*FLEETWAVE, "serve", "--listen", listen, *options, "--db", str(db)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **(env or {})},
    )
    assert proc.stderr is not None
    lines: list[str] = []
    found: list[str] = []
    ready = threading.Event()

    def read() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            lines.append(line)
            m = re.search(r"API on (https?://\S+)/v1", line)
            if m and not found:
                found.append(m.group(1))
                ready.set()
        ready.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    deadline = time.monotonic() + 60
    while not ready.wait(0.1) and time.monotonic() < deadline:
        pass
    if not found:
        proc.kill()
        proc.wait()
        raise AssertionError("serve did not start: " + "".join(lines))
    server = Server(found[0], proc, lines)
    try:
        yield server
    finally:
        server.stop()
        reader.join(timeout=10)


@contextmanager
def in_process(db: Path, *, auth: bool = False) -> Iterator[httpx.Client]:
    """The API app on ``db`` through Starlette's test client (no socket): for the
    many small cases; the real server is :func:`serving`."""
    from fastapi.testclient import TestClient

    from fleetwave.api.app import served_app
    from fleetwave.api.service import Service
    from fleetwave.store.db import open_store

    store = open_store(str(db))
    try:
        with TestClient(served_app(Service(store, auth=auth)), raise_server_exceptions=False) as c:
            yield c
    finally:
        store.dispose()


def new_token(db: Path, role: str = "admin", name: str = "tests") -> str:
    """``fleetwave token create``: a bearer token of ``role``."""
    made = run_fleetwave(db, "token", "create", "--role", role, "--name", name, "--format", "json")
    assert made.returncode == 0, made.stderr
    return str(json.loads(made.stdout)["token"])
