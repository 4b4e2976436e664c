"""The ssh driver's password login against a real OpenSSH ``sshd`` (started by the test
on a loopback port, as :mod:`fleetwave.testing.sshd` does, with a throw-away local user
of its own that may log in with a password from 127.0.0.1 only): ``ssh_password`` given
as ``env:VAR`` logs in and runs a state; a wrong one fails the step with the reason,
and neither password is in anything fleetwave shows."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from cli_harness import Cli
from fleetwave.testing.sshd import PasswordUser, Sshd, find_sshd
from test_cli_strategy import steps
from test_ssh_driver import rollout, workflow

WHOAMI = """\
name: who
states:
  - {name: s, action: ssh.run, command: 'id -un > whoami && echo pw-login-ok'}
"""


@pytest.fixture(scope="module")
def password_sshd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Sshd, PasswordUser]]:
    why = ""
    if find_sshd() is None:
        why = "no sshd (Debian's openssh-server; bash scripts/test.sh installs it)"
    elif os.geteuid() != 0:
        why = "password logins need a user of the test's own, which only root can create"
    if why:
        if os.environ.get("CI", "").lower() in ("true", "1", "yes"):
            pytest.fail(f"CI runs the ssh driver's tests, but {why}")
        pytest.skip(why)
    tmp = tmp_path_factory.mktemp("sshd-pw")
    user = PasswordUser.create()
    try:
        server = Sshd.start(tmp / "sshd", password_user=user)
        try:
            yield server, user
        finally:
            server.stop()
    finally:
        user.remove()


def _add(cli: Cli, name: str, server: Sshd, user: PasswordUser) -> None:
    res = cli(
        "target", "add", name, "--driver", "ssh",
        "--set", "ssh_host=127.0.0.1", "--set", f"ssh_port={server.port}",
        "--set", f"ssh_username={user.name}", "--set", "ssh_password=env:HOST_PASSWORD",
        "--set", f"ssh_known_hosts={server.known_hosts}", "--set", f"ssh_workdir={user.home}",
    )  # fmt: skip
    assert res.code == 0, res.text


def test_a_password_from_the_environment_logs_in_and_runs_the_state(
    cli: Cli,
    tmp_path: Path,
    password_sshd: tuple[Sshd, PasswordUser],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    server, user = password_sshd
    monkeypatch.setenv("HOST_PASSWORD", user.password)
    workflow(cli, tmp_path, WHOAMI)
    _add(cli, "h1", server, user)
    sid, code = rollout(cli, "who")
    details = steps(cli, sid)["h1"]["details"]
    assert code == 0, details
    assert "exit 0" in details and "pw-login-ok" in details
    # the command ran as that user, logged in with its password
    assert (user.home / "whoami").read_text() == f"{user.name}\n"
    assert f"Accepted password for {user.name} from 127.0.0.1" in server.log.read_text()
    shown = cli("target", "show", "h1", "--format", "json").text
    assert "env:HOST_PASSWORD" in shown and user.password not in shown


def test_a_wrong_password_fails_the_step_with_the_reason_and_never_shows_it(
    cli: Cli,
    tmp_path: Path,
    password_sshd: tuple[Sshd, PasswordUser],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    server, user = password_sshd
    wrong = "not-" + user.password
    monkeypatch.setenv("HOST_PASSWORD", wrong)
    workflow(cli, tmp_path, WHOAMI)
    _add(cli, "h1", server, user)
    (user.home / "whoami").unlink(missing_ok=True)
    started = time.monotonic()
    sid, code = rollout(cli, "who")
    assert code == 1
    assert time.monotonic() - started < 60
    assert steps(cli, sid)["h1"]["details"] == (
        f"s: ssh: {user.name}@127.0.0.1:{server.port} refused the login (check ssh_username, "
        "ssh_key_file, ssh_password)"
    )
    assert not (user.home / "whoami").exists()
    assert f"Failed password for {user.name}" in server.log.read_text()
    said = "".join(
        cli(*args).text
        for args in (
            ("step", "list", "--strategy", str(sid), "--format", "json"),
            ("history", "--strategy", str(sid), "--format", "json"),
            ("events", "--strategy", str(sid), "--format", "json"),
            ("target", "list", "--format", "json"),
        )
    )
    assert wrong not in said and user.password not in said
