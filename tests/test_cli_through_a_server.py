"""``fleetwave --url URL ...`` (or FLEETWAVE_URL with FLEETWAVE_TOKEN) reads through a
real server what the same command reads from the database, and prints the same: one
test per family of commands, in JSON and as tables; a command that needs the
database is refused with --url."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from api_harness import Server, new_token, serving
from cli_harness import Cli, assert_rejected


@pytest.fixture
def server(cli: Cli, db_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Server]:
    """A fleet (a group, targets, a strategy ended failed), served with --no-engine;
    FLEETWAVE_TOKEN set to an operator's token."""
    assert cli("group", "add", "east", "--max-parallel", "2").code == 0
    for name in ("a1", "a2"):
        assert cli("target", "add", name, "--group", "east", "--label", "ring=1").code == 0
    assert cli("target", "add", "b1", "--set", "fail_at=finishing").code == 0
    assert cli("strategy", "create", "--workflow", "patch", "--all").code == 0
    assert cli("strategy", "apply", "1", "--wait").code == 1
    assert cli("strategy", "create", "--workflow", "patch", "--group", "east").code == 0
    monkeypatch.setenv("FLEETWAVE_TOKEN", new_token(db_path, "operator"))
    with serving(db_path, "--no-engine") as running:
        yield running


def _alike(cli: Cli, server: Server, *args: str) -> None:
    """The command prints the same through the server as from the database, as JSON and
    as a table, and ends the same."""
    for fmt in ("json", "table"):
        local = cli(*args, "--format", fmt)
        through = cli("--url", server.base, *args, "--format", fmt, db=None)
        assert (through.code, through.out) == (local.code, local.out), (args, fmt, through.err)


def test_targets_and_groups(cli: Cli, server: Server) -> None:
    _alike(cli, server, "target", "list")
    _alike(cli, server, "target", "list", "--group", "east", "--label", "ring=1")
    _alike(cli, server, "target", "show", "a1")
    _alike(cli, server, "group", "list")
    _alike(cli, server, "group", "show", "east")


def test_workflows(cli: Cli, server: Server, monkeypatch: pytest.MonkeyPatch) -> None:
    # Only the built-in workflows here, as in the server's process: other tests of this
    # run register Python workflows in this one (the CLI runs in it).
    from fleetwave.domain import registry
    from fleetwave.domain.builtin import builtin_workflows

    built_in = {wf.name for wf in builtin_workflows()}

    monkeypatch.setattr(
        registry,
        "_workflows",
        {n: w for n, w in registry._workflows.items() if n in built_in},
    )
    _alike(cli, server, "workflow", "list")
    _alike(cli, server, "workflow", "show", "clean")


def test_strategies_and_steps(cli: Cli, server: Server) -> None:
    _alike(cli, server, "strategy", "list")
    _alike(cli, server, "strategy", "list", "--state", "failed")
    _alike(cli, server, "strategy", "show", "1")
    _alike(cli, server, "step", "list", "--strategy", "1")
    _alike(cli, server, "step", "list", "--strategy", "1", "--state", "failed,complete")
    _alike(cli, server, "step", "show", "3")


def test_history_events_and_check(cli: Cli, server: Server) -> None:
    _alike(cli, server, "history", "--strategy", "1")
    _alike(cli, server, "history", "--strategy", "1", "--target", "b1", "--last", "2")
    _alike(cli, server, "events", "--strategy", "1")
    _alike(cli, server, "check")
    _alike(cli, server, "check", "--strategy", "1")


def test_pause_resume_and_abort(cli: Cli, server: Server) -> None:
    url = ("--url", server.base)
    assert cli("strategy", "apply", "2").code == 0
    paused = cli(*url, "strategy", "pause", "2", "--format", "json", db=None)
    assert paused.json() == {"id": 2, "state": "paused", "was": "applying"}
    assert cli("strategy", "show", "2", "--format", "json").json()["state"] == "paused"
    resumed = cli(*url, "strategy", "resume", "2", db=None)
    assert resumed.code == 0 and resumed.out == "strategy 2: resumed\n"
    aborted = cli(*url, "strategy", "abort", "2", "--format", "json", db=None)
    assert aborted.json() == {"id": 2, "state": "abort-requested", "asked_now": True}
    # who did it is on the record: the operator's token
    said = cli("events", "--strategy", "2", "--kind", "change-by", "--format", "json").json()
    assert [e["details"] for e in said][-1] == "strategy 2 abort requested by api:tests"


def test_what_cannot_go_through_a_server_is_refused(
    cli: Cli, server: Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = ("--url", server.base)
    assert_rejected(cli(*url, "target", "add", "c9", db=None), "--url", "fleetwave target add")
    assert_rejected(cli(*url, "strategy", "list"), "--db and --url")
    assert_rejected(cli(*url, "strategy", "show", "99", db=None), "strategy 99 not found")
    assert_rejected(cli("--url", "ftp://x", "strategy", "list", db=None), "--url: expected")
    monkeypatch.delenv("FLEETWAVE_TOKEN")
    refused = cli(*url, "strategy", "list", db=None)
    assert_rejected(refused, "wants a valid token", "FLEETWAVE_TOKEN")
    with socket.socket() as gone:  # a port nothing listens on
        gone.bind(("127.0.0.1", 0))
        port = gone.getsockname()[1]
    monkeypatch.setenv("FLEETWAVE_URL", f"http://127.0.0.1:{port}")
    assert_rejected(cli("strategy", "list", db=None), "--url: cannot reach")
