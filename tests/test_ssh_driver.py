"""The ssh driver through asyncssh against a real OpenSSH ``sshd`` (Debian's
openssh-server, started by the test on a free loopback port with a throw-away host key
and user key: :mod:`fleetwave.testing.sshd`). Several "hosts" are targets on the one
sshd, each with its own working directory.

A command's exit status and output tail in the step's details; an upload; a host key
that is not the one known, refused naming it; a command hanging past its timeout,
stopped on the host too; a port nobody listens on, and one that never answers; a
missing key file, a target of another driver; a conductor killed mid-command and what
the next one's recover hook does (with a ``check:``, and without); a YAML rollout of
ssh.run and ssh.upload states over a few hosts, ``fleetwave check`` passing.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from cli_harness import Cli
from fleetwave.testing.sshd import Sshd, find_sshd, free_port, write_keypair
from test_cli_strategy import steps

FLEETWAVE = str(Path(sys.executable).parent / "fleetwave")


@pytest.fixture(scope="module")
def sshd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sshd]:
    if find_sshd() is None:
        why = "no sshd (Debian's openssh-server; bash scripts/test.sh installs it)"
        if os.environ.get("CI", "").lower() in ("true", "1", "yes"):
            pytest.fail(f"CI runs the ssh driver's tests, but {why}")
        pytest.skip(why)
    server = Sshd.start(tmp_path_factory.mktemp("sshd"))
    try:
        yield server
    finally:
        server.stop()


#: a workflow of one state that runs `true`
TRUE = "name: w\nstates:\n  - {name: s, action: ssh.run, command: 'true'}\n"


def add_host(cli: Cli, name: str, sshd: Sshd, workdir: Path | None, **extra: object) -> None:
    settings = sshd.target_settings(**({"workdir": workdir} if workdir else {}), **extra)
    sets = [x for k, v in settings.items() for x in ("--set", f"{k}={v}")]
    res = cli("target", "add", name, "--driver", "ssh", *sets)
    assert res.code == 0, res.text


def workflow(cli: Cli, tmp: Path, text: str) -> None:
    f = tmp / "wf.yaml"
    f.write_text(text)
    res = cli("workflow", "add", str(f))
    assert res.code == 0, res.text


def rollout(cli: Cli, name: str, *extra: str) -> tuple[int, int]:
    res = cli("strategy", "create", "--workflow", name, "--all", "--format", "json", *extra)
    assert res.code == 0, res.text
    sid = int(res.json()["id"])
    return sid, cli("strategy", "apply", str(sid), "--wait").code


def test_a_commands_exit_status_and_output_tail_go_into_the_details(
    cli: Cli, sshd: Sshd, tmp_path: Path
) -> None:
    for name in ("ok", "bad"):
        (tmp_path / name).mkdir()
        add_host(cli, name, sshd, tmp_path / name)
    workflow(
        cli,
        tmp_path,
        """\
name: talk
states:
  - name: say
    action: ssh.run
    # "ok": 10,000 lines, only the tail kept; "bad": a line on stderr, exit 3 (stdout
    # and stderr are two streams: which comes first when both are written is not fixed)
    command: >-
      if [ "$FLEETWAVE_TARGET" = ok ]; then seq 1 10000;
      else echo "to stderr in $(pwd)" >&2; exit 3; fi
    timeout_s: 60
""",
    )
    sid, code = rollout(cli, "talk")
    assert code == 1
    by = steps(cli, sid)
    ok, bad = by["ok"], by["bad"]
    assert ok["state"] == "complete" and bad["state"] == "failed"
    history = cli("history", "--strategy", str(sid), "--format", "json").json()
    said = next(t["details"] for t in history if t["to"] == "complete")
    assert said.startswith("ssh.run: exit 0 in "), said
    # the tail: the last lines, on one line, the front cut (bounded)
    assert said.endswith("; 9998; 9999; 10000"), said
    assert "; ...; " not in said and "output: ..." in said
    assert len(said) < 2100
    assert bad["details"].startswith("say: ssh.run: exit 3 in "), bad["details"]
    assert bad["details"].endswith(
        f"output: to stderr in {tmp_path / 'bad'} (expected exit 0) (attempt 1 of 1)"
    ), bad["details"]
    assert cli("check").code == 0


def test_an_upload_lands_whole_under_the_hosts_workdir(
    cli: Cli, sshd: Sshd, tmp_path: Path
) -> None:
    (tmp_path / "h1" / "conf").mkdir(parents=True)
    add_host(cli, "h1", sshd, tmp_path / "h1")
    source = tmp_path / "app.conf"
    source.write_bytes(os.urandom(200_000))
    workflow(
        cli,
        tmp_path,
        f"""\
name: ship
states:
  - {{name: copy, action: ssh.upload, source: {source}, dest: conf/app.conf}}
  - {{name: verify, action: ssh.run, command: 'cmp conf/app.conf {source}'}}
""",
    )
    sid, code = rollout(cli, "ship")
    assert code == 0, steps(cli, sid)
    assert (tmp_path / "h1" / "conf" / "app.conf").read_bytes() == source.read_bytes()
    assert not (tmp_path / "h1" / "conf" / "app.conf.fleetwave-partial").exists()
    history = cli("history", "--strategy", str(sid), "--format", "json").json()
    copied = next(t["details"] for t in history if t["from"] == "copy")
    assert copied == (
        f"ssh.upload: 200000 bytes from {source} to {tmp_path / 'h1' / 'conf' / 'app.conf'}"
    )


def test_a_host_key_not_the_known_one_is_refused_naming_it(
    cli: Cli, sshd: Sshd, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    other = write_keypair(tmp_path / "other_host_key")
    known = tmp_path / "known_hosts"
    known.write_text(f"[127.0.0.1]:{sshd.port} {other}\n")
    add_host(cli, "h1", sshd, None, ssh_known_hosts=known)
    add_host(cli, "h2", sshd, None, ssh_known_hosts=tmp_path / "empty_known_hosts")
    (tmp_path / "empty_known_hosts").write_text("")
    marker = tmp_path / "ran"
    workflow(
        cli,
        tmp_path,
        f"name: w\nstates:\n  - {{name: s, action: ssh.run, command: 'touch {marker}'}}\n",
    )
    sid, code = rollout(cli, "w")
    assert code == 1
    import asyncssh

    served = asyncssh.import_public_key(sshd.host_public).get_fingerprint("sha256")
    known_fp = asyncssh.import_public_key(other).get_fingerprint("sha256")
    by = steps(cli, sid)
    assert by["h1"]["details"] == (
        f"s: ssh: host key refused: 127.0.0.1:{sshd.port} offered its key ssh-ed25519 "
        f"{served}, which does not match the key known for it in {known} (ssh-ed25519 "
        f"{known_fp}) (ssh_known_hosts; a host reinstalled, or someone in between)"
    )
    assert by["h2"]["details"].startswith(
        f"s: ssh: host key refused: 127.0.0.1:{sshd.port} offered its key ssh-ed25519 "
        f"{served}, which is not in {tmp_path / 'empty_known_hosts'}"
    )
    assert not marker.exists()  # nothing ran
    refused = [r for r in caplog.records if r.msg.startswith("ssh host key refused")]
    assert sorted(r.args[0] for r in refused) == ["h1", "h2"]  # type: ignore[index]


def test_a_command_hanging_past_its_timeout_is_stopped_on_the_host_too(
    cli: Cli, sshd: Sshd, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level("INFO", logger="fleetwave.drivers.ssh")
    add_host(cli, "h1", sshd, tmp_path, ssh_command_timeout_s=2)
    workflow(
        cli,
        tmp_path,
        """\
name: ssh-hang
states:
  # ended, with something left running that holds its output: the exit status counts
  - {name: leave, action: ssh.run, command: 'echo left; sleep 30 &'}
  - {name: wait, action: ssh.run, command: 'echo $$ > pid; echo waiting; sleep 300 | cat'}
""",
    )
    started = time.monotonic()
    sid, code = rollout(cli, "ssh-hang")
    took = time.monotonic() - started
    assert code == 1 and took < 12, took
    assert steps(cli, sid)["h1"]["details"] == (
        "wait: ssh: h1: the command ran past its 2s (ssh_command_timeout_s) and was "
        "stopped; output: waiting (attempt 1 of 1)"
    )
    assert any(r.msg.startswith("ssh command stopped past its timeout") for r in caplog.records)
    history = cli("history", "--strategy", str(sid), "--format", "json").json()
    left = next(t["details"] for t in history if t["from"] == "leave")
    assert left.startswith("ssh.run: exit 0 in ") and left.endswith("; output: left"), left
    pid = int((tmp_path / "pid").read_text())
    deadline = time.monotonic() + 5  # its session is killed once the channel closes
    while Path(f"/proc/{pid}").exists():
        assert time.monotonic() < deadline, "the command still runs on the host"
        time.sleep(0.05)


def test_a_port_nobody_listens_on_fails_with_the_reason_at_once(
    cli: Cli, sshd: Sshd, tmp_path: Path
) -> None:
    port = free_port()
    add_host(cli, "h1", sshd, None, ssh_port=port, ssh_connect_timeout_s=3)
    workflow(cli, tmp_path, TRUE)
    started = time.monotonic()
    sid, code = rollout(cli, "w")
    assert code == 1 and time.monotonic() - started < 10
    assert steps(cli, sid)["h1"]["details"] == (
        f"s: ssh: connection refused at 127.0.0.1:{port} (attempt 1 of 1)"
    )


def test_a_port_that_never_answers_fails_within_the_connect_timeout(
    cli: Cli, sshd: Sshd, tmp_path: Path
) -> None:
    with socket.socket() as silent:  # accepts connections (the backlog), says nothing
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        port = silent.getsockname()[1]
        add_host(cli, "h1", sshd, None, ssh_port=port, ssh_connect_timeout_s=2)
        workflow(cli, tmp_path, TRUE)
        started = time.monotonic()
        sid, code = rollout(cli, "w")
        took = time.monotonic() - started
    assert code == 1 and 2 <= took < 8, took
    assert steps(cli, sid)["h1"]["details"] == (
        f"s: ssh: no answer within 2s at 127.0.0.1:{port} (ssh_connect_timeout_s) (attempt 1 of 1)"
    )


KILLED = """\
name: {name}
states:
  - name: work
    action: ssh.run
    command: 'echo $$ > pid; echo started >> runs; sleep 3; touch done.stamp'
{check}    timeout_s: 60
"""


@pytest.mark.parametrize("with_check", [True, False], ids=["with-check", "without-check"])
def test_a_conductor_killed_mid_command_the_next_one_never_runs_it_blindly(
    cli: Cli, sshd: Sshd, tmp_path: Path, db_path: Path, with_check: bool
) -> None:
    host = tmp_path / "h1"
    host.mkdir()
    add_host(cli, "h1", sshd, host)
    check = "    check: test -e done.stamp\n" if with_check else ""
    workflow(cli, tmp_path, KILLED.format(name="killed", check=check))
    res = cli("strategy", "create", "--workflow", "killed", "--all", "--format", "json")
    sid = str(res.json()["id"])
    env = {**os.environ, "FLEETWAVE_DB": str(db_path)}
    apply = [FLEETWAVE, "strategy", "apply", sid, "--wait", "--lease-ttl", "15"]
    first = subprocess.Popen(apply, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:  # until the command runs on the host
        deadline = time.monotonic() + 30
        while not (host / "pid").exists() or not (host / "pid").read_text().strip():
            assert time.monotonic() < deadline and first.poll() is None, first.communicate()
            time.sleep(0.02)
    finally:
        first.send_signal(signal.SIGKILL)
        first.communicate(timeout=10)
    # the conductor's connection went with it: the command is stopped on the host
    pid = int((host / "pid").read_text())
    deadline = time.monotonic() + 5
    while Path(f"/proc/{pid}").exists():
        assert time.monotonic() < deadline, "the command outlived its conductor"
        time.sleep(0.05)
    assert not (host / "done.stamp").exists()
    second = subprocess.run(apply, env=env, capture_output=True, text=True, timeout=120)
    step = steps(cli, int(sid))["h1"]
    if with_check:
        # the check says not done: the command runs again, to the end
        assert second.returncode == 0, second.stdout + second.stderr
        assert (host / "runs").read_text() == "started\nstarted\n"
        assert (host / "done.stamp").exists()
        assert step["state"] == "complete"
    else:
        # it may have run in part: never run again blindly
        assert second.returncode == 1
        assert (host / "runs").read_text() == "started\n"
        assert step["state"] == "failed"
        assert step["details"] == "work: conductor lost during work"
    assert cli("check").code == 0


def test_a_check_that_says_done_runs_nothing_and_may_skip_the_step(
    cli: Cli, sshd: Sshd, tmp_path: Path
) -> None:
    for name in ("done", "todo"):
        (tmp_path / name).mkdir()
        add_host(cli, name, sshd, tmp_path / name)
    (tmp_path / "done" / "stamp").write_text("")
    workflow(
        cli,
        tmp_path,
        """\
name: once
states:
  - name: install
    action: ssh.run
    command: echo ran >> log; touch stamp
    check: test -e stamp
    skip_when_done: true
  - {name: after, action: ssh.run, command: echo after >> log}
""",
    )
    sid, code = rollout(cli, "once")
    assert code == 0
    by = steps(cli, sid)
    assert by["done"]["details"] == (
        "skipped at install: ssh.run: the check says done (exit 0); the command not run"
    )
    assert not (tmp_path / "done" / "log").exists()
    assert (tmp_path / "todo" / "log").read_text() == "ran\nafter\n"


def test_a_rollout_of_ssh_states_over_a_few_hosts_completes_and_checks(
    cli: Cli, sshd: Sshd, tmp_path: Path
) -> None:
    hosts = [f"host-{i}" for i in range(1, 5)]
    for name in hosts:
        (tmp_path / name).mkdir()
        add_host(cli, name, sshd, tmp_path / name)
    release = tmp_path / "release.tar"
    release.write_text("release 2.0\n")
    workflow(
        cli,
        tmp_path,
        f"""\
name: host-upgrade
version: 1
states:
  - name: pre-check
    action: ssh.run
    command: test ! -e current || ! grep -q 2.0 current
    expect_exit: 0
  - {{name: upload, action: ssh.upload, source: {release}, dest: release.tar}}
  - name: install
    action: ssh.run
    command: cp release.tar current && echo "installed on $FLEETWAVE_TARGET"
    check: grep -q 2.0 current
  - name: verify
    action: ssh.run
    command: grep -c 2.0 current
    expect_exit: [0]
""",
    )
    shown = cli("workflow", "show", "host-upgrade", "--format", "json").json()
    install = shown["states"][2]
    assert install["recover"] == "check" and install["params"]["check"] == "grep -q 2.0 current"
    sid, code = rollout(cli, "host-upgrade", "--max-parallel", "2")
    assert code == 0, steps(cli, sid)
    for name in hosts:
        assert (tmp_path / name / "current").read_text() == "release 2.0\n"
    history = cli("history", "--strategy", str(sid), "--format", "json").json()
    installed = sorted(t["details"].rsplit("; ", 1)[1] for t in history if t["from"] == "install")
    assert installed == [f"output: installed on {name}" for name in hosts]
    check = cli("check")
    assert check.code == 0 and "ok:" in check.text, check.text


def test_a_missing_key_or_a_target_of_another_driver_fails_with_the_reason(
    cli: Cli, sshd: Sshd, tmp_path: Path
) -> None:
    add_host(cli, "nokey", sshd, None, ssh_key_file=tmp_path / "gone")
    assert cli("target", "add", "simmy").code == 0  # a sim target
    workflow(cli, tmp_path, TRUE)
    sid, code = rollout(cli, "w")
    assert code == 1
    by = steps(cli, sid)
    assert by["nokey"]["details"] == (
        f"s: ssh: ssh_key_file: cannot read {tmp_path / 'gone'}: No such file or directory"
    )
    assert by["simmy"]["details"] == (
        "s: ssh.run: target simmy uses the sim driver; ssh.run runs on ssh targets"
    )
    # a plain operation is none of the ssh driver's
    workflow(cli, tmp_path, "name: plain\nstates:\n  - {name: pre-check}\n")
    res = cli("strategy", "create", "--workflow", "plain", "--targets", "nokey", "--format", "json")
    sid = int(res.json()["id"])
    assert cli("strategy", "apply", str(sid), "--wait").code == 1
    assert steps(cli, sid)["nokey"]["details"] == (
        "pre-check: ssh: no operation 'pre-check': a state of an ssh target runs ssh.run "
        "(command: ...) or ssh.upload (source: ..., dest: ...)"
    )
