"""Benchmark of the ssh driver: a short YAML workflow over 20 hosts through one sshd.

One OpenSSH ``sshd`` (Debian's openssh-server, started here on a free loopback port
with a throw-away host key and user key: :mod:`fleetwave.testing.sshd`) serves 20
targets, each with its own working directory; a conductor in another process drives a
YAML workflow of three ``ssh.run`` states and an ``ssh.upload`` over them, all at
once (max parallel 20). Every operation opens its own SSH connection (key exchange,
public-key login, one channel), as the driver does.

What it reports:

- the strategy completes, the invariants hold, and ``fleetwave check`` passes; every
  host ran each command exactly once (its log) and got the file;
- wall time of ``Conductor.run``, against one operation's time measured alone (the
  driver connecting, running ``true`` and closing, on an idle machine): with every
  host at once, the ideal is a host's operations (four states, and the install's
  check) times that;
- the conductor's CPU per transition, and per SSH operation; the sshd's CPU (its
  connections' processes: the key exchange and login of each operation, and the
  commands), and the floor the CPU of both puts under the wall time on this machine
  (on two cores the server's side of 100 logins is most of it; on this machine each
  command also starts root's bash, whose ``~/.bashrc`` runs ``pyenv init``: about
  130 ms of each operation).

Run it from the repository root (``--quick``: 5 hosts)::

    .venv/bin/python bench/ssh_rollout.py

It prints the figures and appends (replaces) its section in ``bench/RESULTS.md`` with
the command and machine. Exit status 1 when a target is missed.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

from bench import (
    Check,
    RunResult,
    RunSpec,
    ScenarioReport,
    _spawn,
    scenario_main,
)
from fleetwave.domain.models import StrategyOptions, Target
from fleetwave.domain.yaml_workflow import parse_workflow_yaml
from fleetwave.drivers.ssh import SshDriver
from fleetwave.store import admin
from fleetwave.store.db import open_store
from fleetwave.testing.sshd import Sshd

HOSTS = 20
#: the rollout's states (each one SSH operation a host)
WORKFLOW = """\
name: ssh-bench
states:
  - name: pre-check
    action: ssh.run
    command: test ! -e version || ! grep -q 2.0 version
  - {{name: upload, action: ssh.upload, source: {source}, dest: release.txt}}
  - name: install
    action: ssh.run
    command: cp release.txt version && echo install >> log
    check: grep -q 2.0 version
  - name: verify
    action: ssh.run
    command: grep -c 2.0 version && echo verify >> log
"""
STATES = 4
#: what each host's log and file hold at the end
LOG = "install\nverify\n"
RELEASE = "release 2.0\n"
#: single operations timed alone, for the ideal
PROBES = 10


def _fleetwave() -> list[str]:
    return [str(Path(sys.executable).parent / "fleetwave")]


def one_operation_s(server: Sshd, tmp: Path) -> float:
    """The median time of one ssh.run of ``true`` through the driver, alone."""
    driver = SshDriver()
    target = Target(name="probe", driver="ssh", settings=server.target_settings(workdir=tmp))

    async def probe() -> list[float]:
        loop = asyncio.get_running_loop()
        times = []
        for _ in range(PROBES):
            t0 = loop.time()
            result = await driver.run_command(target, "true", None)
            assert result.exit_status == 0, result
            times.append(loop.time() - t0)
        return times

    return statistics.median(asyncio.run(probe()))


def setup(db: str, server: Sshd, hosts: list[Path], source: Path) -> int:
    store = open_store(db)
    admin.add_targets(
        store,
        [
            Target(name=h.name, driver="ssh", settings=server.target_settings(workdir=h))
            for h in hosts
        ],
    )
    text = WORKFLOW.format(source=source)
    wf = parse_workflow_yaml(text, source="ssh-bench.yaml", strict=True)
    admin.save_workflow(store, wf, text)
    sid = admin.create_strategy(
        store, wf, StrategyOptions(max_parallel=len(hosts)), all_targets=True
    )
    admin.apply_strategy(store, sid)
    store.dispose()
    return sid


def run(quick: bool) -> ScenarioReport:
    count = 5 if quick else HOSTS
    with tempfile.TemporaryDirectory(prefix="fleetwave-ssh-bench-") as tmp_name:
        tmp = Path(tmp_name)
        server = Sshd.start(tmp / "sshd")
        try:
            (tmp / "probe").mkdir()
            single_s = one_operation_s(server, tmp / "probe")
            hosts = [tmp / f"host-{i:02d}" for i in range(1, count + 1)]
            for h in hosts:
                h.mkdir()
            source = tmp / "release.txt"
            source.write_text(RELEASE)
            db = str(tmp / "bench.db")
            sid = setup(db, server, hosts, source)
            sshd_cpu0 = server.cpu_s()
            spec = RunSpec(targets=count, max_parallel=count)
            data = _spawn(
                "run",
                {"db": db, "sid": sid, "states": STATES, "setup_s": 0.0, "spec": asdict(spec)},
            )
            data["spec"] = spec
            ssh = RunResult(**data)
            sshd_cpu_s = server.cpu_s() - sshd_cpu0
            checked = subprocess.run(
                [*_fleetwave(), "check", "--db", db], capture_output=True, text=True, check=False
            )
            logs = [(h / "log").read_text() if (h / "log").exists() else "" for h in hosts]
            files = [h / "release.txt" for h in hosts]
            got = [f.read_text() if f.exists() else "" for f in files]
            sessions = server.log.read_text().count("Accepted publickey")
        finally:
            server.stop()
    cores = os.cpu_count() or 1
    # one host's operations one after the other (the install's check too)
    ideal = (STATES + 1) * single_s
    checks = [
        Check(
            "completes, invariants, fleetwave check",
            "complete, check() ok, `fleetwave check` exit 0",
            f"state={ssh.final_state}, ok={ssh.check_ok}, exit {checked.returncode}",
            ssh.final_state == "complete" and ssh.check_ok and checked.returncode == 0,
        ),
        Check(
            "each host ran each command once, got the file",
            "log = install, verify; release.txt on every host",
            f"{sum(log == LOG for log in logs)} of {count} logs right, "
            f"{sum(g == RELEASE for g in got)} files",
            all(log == LOG for log in logs) and all(g == RELEASE for g in got),
        ),
    ]
    # each state one operation a host, and the install's check one more
    operations = count * (STATES + 1)
    figures = [
        (
            "run",
            f"{count} hosts (targets on one sshd, own working directories), {STATES} states "
            "(ssh.run, ssh.upload, ssh.run with check, ssh.run), max parallel "
            f"{count}; a connection per operation",
        ),
        ("one ssh.run of `true` alone (median of 10)", f"{single_s * 1000:.0f} ms"),
        ("ideal (a host's 5 operations x one alone, hosts at once)", f"{ideal:.2f} s"),
        ("wall time of Conductor.run", f"{ssh.wall_s:.2f} s"),
        ("wall / ideal", f"{ssh.wall_s / ideal:.2f}"),
        ("SSH logins the sshd accepted (probes and the install check too)", f"{sessions}"),
        ("transitions", f"{ssh.transitions:,} (journal {ssh.journal_rows:,})"),
        ("conductor CPU during the run", f"{ssh.cpu_s:.2f} s"),
        (
            "conductor CPU per transition / per SSH operation",
            f"{ssh.cpu_s / ssh.transitions * 1000:.1f} ms / {ssh.cpu_s / operations * 1000:.1f} ms",
        ),
        (
            "sshd's CPU during the run (its connections' processes, the commands too) / "
            "per operation",
            f"{sshd_cpu_s:.2f} s / {sshd_cpu_s / operations * 1000:.0f} ms",
        ),
        (
            "CPU floor: (sshd + conductor CPU) / cores",
            f"{(sshd_cpu_s + ssh.cpu_s) / cores:.2f} s ({cores} cores): the wall is "
            f"{ssh.wall_s / ((sshd_cpu_s + ssh.cpu_s) / cores):.2f} x it",
        ),
        ("peak RSS of the conductor", f"{ssh.peak_rss_run / 1e6:.0f} MB"),
        (
            "other load: 1-min load average before / after, preemptions",
            f"{ssh.load_before:.2f} / {ssh.load_after:.2f}, {ssh.involuntary_switches}",
        ),
    ]
    return ScenarioReport("ssh_rollout", quick, [("ssh", ssh)], figures, checks)


def main(argv: list[str] | None = None) -> int:
    return scenario_main(run, __doc__, "5 hosts", argv)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
