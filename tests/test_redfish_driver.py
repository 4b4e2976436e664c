"""The redfish driver through sushy against sushy-tools' Redfish emulator (``sushy-emulator
--fake``, a real process on a loopback port, with basic auth): the clean workflow's BMC
states run as a YAML workflow of ``driver: redfish`` targets; a BMC that refuses the
credentials and one that refuses connections fail the step with the reason, the
password never in it; a conductor killed while a node powers off, and the next one's
recover hook reading the BMC instead of powering it off again; and the built-in
``clean`` workflow end to end, with a simulated agent that comes up once its node is
powered on to boot from the network and reports through ``fleetwave step callback``,
or over HTTP to a real ``fleetwave serve --listen`` with the agent token the driver
handed over (its handoff file, read as a node's boot configuration would carry it).

The fake BMC applies a power action 1 to 3 s after it is asked (sushy-tools' own pacing,
1 to 11 s, capped: the driver polls the same way whatever the delay), so a node's four
states take up to about ten seconds.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from api_harness import serving
from cli_harness import Cli
from fleetwave.testing.bmc import FakeBmc as Bmc
from fleetwave.testing.bmc import node_uuid
from test_cli_strategy import steps

NODES = ["node-1", "node-2"]
PASSWORD = "bmc-pass-0451"
CLEAN_BMC = """\
name: clean-bmc
states:
  - {name: power-off, timeout_s: 60}
  - {name: set-boot-network, timeout_s: 60}
  - {name: power-on, timeout_s: 60}
  - {name: final-power-off, timeout_s: 60}
"""


def _uuid(index: int) -> str:
    return node_uuid(index)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def bmc(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Bmc]:
    emu = Bmc.start(tmp_path_factory.mktemp("bmc"), nodes=7, password=PASSWORD, max_delay_s=3)
    try:
        yield emu
    finally:
        emu.stop()


def _add_node(
    cli: Cli, name: str, address: str, index: int, *extra: str, poll_s: float = 0.5
) -> None:
    res = cli(
        "target", "add", name, "--driver", "redfish",
        "--set", f"redfish_address={address}",
        "--set", f"redfish_system_id=/redfish/v1/Systems/{_uuid(index)}",
        "--set", "redfish_username=admin",
        "--set", "redfish_password=env:BMC_PASSWORD",
        "--set", f"power_poll_s={poll_s}", *extra,
    )  # fmt: skip
    assert res.code == 0, res.text


@pytest.fixture
def clean_bmc(cli: Cli, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    wf = tmp_path / "clean-bmc.yaml"
    wf.write_text(CLEAN_BMC)
    assert cli("workflow", "add", str(wf)).code == 0
    monkeypatch.setenv("BMC_PASSWORD", PASSWORD)


def test_the_clean_workflows_bmc_states_run_through_sushy(
    cli: Cli, bmc: Bmc, clean_bmc: None
) -> None:
    for i, name in enumerate(NODES, 1):
        _add_node(cli, name, bmc.url, i)
    res = cli("strategy", "create", "--workflow", "clean-bmc", "--all", "--format", "json")
    sid = int(res.json()["id"])
    run = cli("strategy", "apply", str(sid), "--wait")
    assert run.code == 0, steps(cli, sid)
    for i in range(1, len(NODES) + 1):  # what the BMC says now
        system = bmc.system(i)
        assert system["PowerState"] == "Off"
        assert system["Boot"]["BootSourceOverrideTarget"] == "Pxe"  # type: ignore[index]
        # (sushy-tools keeps the device, and reports any override as continuous)
        assert system["Boot"]["BootSourceOverrideEnabled"] in ("Once", "Continuous")  # type: ignore[index]
    check = cli("check")
    assert check.code == 0 and "ok:" in check.text, check.text


def test_a_bmc_refusing_the_credentials_or_the_connection_fails_with_the_reason(
    cli: Cli, bmc: Bmc, clean_bmc: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("BMC_PASSWORD", "wrong-password-9")
    _add_node(cli, "node-1", bmc.url, 1)
    closed = f"http://127.0.0.1:{_free_port()}"
    _add_node(cli, "node-2", closed, 2, "--set", "redfish_timeout_s=2")
    res = cli("strategy", "create", "--workflow", "clean-bmc", "--all", "--format", "json")
    sid = int(res.json()["id"])
    started = time.monotonic()
    assert cli("strategy", "apply", str(sid), "--wait").code == 1
    assert time.monotonic() - started < 30
    by_node = steps(cli, sid)
    assert by_node["node-1"]["details"] == (
        f"power-off: redfish: {bmc.url} refused access (check redfish_username and "
        "redfish_password)"
    )
    assert by_node["node-2"]["details"] == (
        f"power-off: redfish: connection refused at {closed} (attempt 1 of 1)"
    )
    everything = cli("step", "list", "--strategy", str(sid), "--format", "json").text
    assert "wrong-password-9" not in everything and PASSWORD not in everything


def test_a_conductor_killed_mid_power_off_the_next_one_reads_the_bmc(
    cli: Cli, bmc: Bmc, clean_bmc: None, db_path: Path
) -> None:
    # (its conductor looks 2 s after asking: time enough to kill it before it sees)
    _add_node(cli, "node-3", bmc.url, 3, poll_s=2)
    res = cli("strategy", "create", "--workflow", "clean-bmc", "--all", "--format", "json")
    sid = str(res.json()["id"])
    env = {**os.environ, "FLEETWAVE_DB": str(db_path)}
    exe = str(Path(sys.executable).parent / "fleetwave")
    apply = [exe, "strategy", "apply", sid, "--wait", "--lease-ttl", "15"]
    reset = f"/redfish/v1/Systems/{_uuid(3)}/Actions/ComputerSystem.Reset"
    resets_before = bmc.log.read_text().count(reset)
    first = subprocess.Popen(apply, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:  # until the power-off was asked of the BMC (its log says so)
        deadline = time.monotonic() + 30
        while bmc.log.read_text().count(reset) == resets_before:
            assert time.monotonic() < deadline and first.poll() is None, first.communicate()
            time.sleep(0.05)
    finally:
        first.send_signal(signal.SIGKILL)
        first.communicate(timeout=10)
    assert steps(cli, int(sid))["node-3"]["state"] == "power-off"
    second = subprocess.run(apply, env=env, capture_output=True, text=True, timeout=120)
    assert second.returncode == 0, second.stdout + second.stderr
    # power off, then on, then off: three resets, the first never sent again (the
    # next conductor took over at once: this host's dead conductor was seen dead; the
    # BMC had not yet applied the power-off, and it watched it land)
    assert bmc.log.read_text().count(reset) - resets_before == 3
    history = cli("history", "--strategy", sid, "--format", "json").json()
    entered = next(t for t in history if t["to"] == "power-off")
    left = next(t for t in history if t["from"] == "power-off")
    assert left["conductor"] != entered["conductor"]
    assert bmc.system(3)["PowerState"] == "Off"


def test_the_clean_workflow_end_to_end_with_an_agent_that_boots_from_the_network(
    cli: Cli, bmc: Bmc, db_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("BMC_PASSWORD", PASSWORD)
    nodes = {"node-4": 4, "node-5": 5}
    for name, index in nodes.items():
        _add_node(cli, name, bmc.url, index)
    res = cli("strategy", "create", "--workflow", "clean", "--all", "--format", "json")
    sid = str(res.json()["id"])
    env = {**os.environ, "FLEETWAVE_DB": str(db_path)}
    exe = str(Path(sys.executable).parent / "fleetwave")
    run = subprocess.Popen(
        [exe, "strategy", "apply", sid, "--wait"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    reported: set[tuple[str, str]] = set()
    deadline = time.monotonic() + 120
    try:
        # The agents: a node powered on to boot from the network comes up and says so;
        # then it runs its clean steps and reports them done.
        while run.poll() is None:
            assert time.monotonic() < deadline, "the clean rollout did not end"
            for name, step in steps(cli, int(sid)).items():
                state = step["state"]
                if state not in ("wait-for-agent", "clean-steps") or (name, state) in reported:
                    continue
                system = bmc.system(nodes[name])
                booted = system["PowerState"] == "On" and (
                    system["Boot"]["BootSourceOverrideTarget"] == "Pxe"  # type: ignore[index]
                )
                if state == "wait-for-agent" and not booted:
                    continue
                said = (
                    "agent up, booted from the network"
                    if state == "wait-for-agent"
                    else ("clean steps done: erase_devices_metadata")
                )
                answer = cli("step", "callback", str(step["step"]), state, "--details", said)
                assert answer.code == 0, answer.text
                reported.add((name, state))
            time.sleep(0.2)
    finally:
        if run.poll() is None:
            run.kill()
        out = run.communicate()[0].decode()
    assert run.returncode == 0, out
    assert reported == {(n, s) for n in nodes for s in ("wait-for-agent", "clean-steps")}
    for name, index in nodes.items():
        assert bmc.system(index)["PowerState"] == "Off", name
        assert steps(cli, int(sid))[name]["state"] == "complete"
    check = cli("check")
    assert check.code == 0 and "ok:" in check.text, check.text


class HttpAgents(threading.Thread):
    """The nodes' agents, calling back over HTTP as a real one (ironic-python-agent)
    does: a node comes up once its BMC shows it powered on to boot from the network;
    its agent then reads what its boot configuration carries (here: the handoff file
    the driver wrote for it) and reports each waiting state, with that state's token."""

    def __init__(self, bmc: Bmc, handoff: Path, nodes: dict[str, int]) -> None:
        super().__init__(daemon=True)
        self.bmc, self.handoff, self.nodes = bmc, handoff, nodes
        self.stop = threading.Event()
        #: (node, state) -> the answer's status
        self.reported: dict[tuple[str, str], int] = {}
        self.forged: list[int] = []
        self.errors: list[str] = []

    def run(self) -> None:
        try:
            self._run()
        except Exception as exc:  # said by the test, not lost in a thread
            self.errors.append(repr(exc))

    def _run(self) -> None:
        with httpx.Client(timeout=10) as http:
            while not self.stop.wait(0.2):
                for name, index in self.nodes.items():
                    system = self.bmc.system(index)
                    booted = system["PowerState"] == "On" and (
                        system["Boot"]["BootSourceOverrideTarget"] == "Pxe"  # type: ignore[index]
                    )
                    given = self.handoff / f"{_uuid(index)}.json"
                    if not booted or not given.exists():
                        continue
                    said = json.loads(given.read_text())
                    state = said["state"]
                    if (name, state) in self.reported:
                        continue
                    url = f"{said['callback_url']}/v1/steps/{said['step']}/callbacks"
                    body = {
                        "state": state,
                        "idempotency_key": f"{name}-{state}",
                        "kind": "done",
                        "details": "agent up, booted from the network"
                        if state == "wait-for-agent"
                        else "clean steps done: erase_devices_metadata",
                    }
                    if not self.forged:  # a token it was not given is refused
                        wrong = {"Authorization": "Bearer not-the-token"}
                        self.forged.append(http.post(url, json=body, headers=wrong).status_code)
                    auth = {"Authorization": f"Bearer {said['token']}"}
                    self.reported[(name, state)] = http.post(
                        url, json=body, headers=auth
                    ).status_code


def test_the_clean_workflow_end_to_end_with_agents_that_call_back_over_http(
    cli: Cli, bmc: Bmc, db_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("BMC_PASSWORD", PASSWORD)
    nodes = {"node-6": 6, "node-7": 7}
    handoff = tmp_path / "handoff"
    handoff.mkdir()
    agents = HttpAgents(bmc, handoff, nodes)
    with serving(db_path, env={"BMC_PASSWORD": PASSWORD}) as server:
        for name, index in nodes.items():
            _add_node(
                cli, name, bmc.url, index, "--set", f"agent_handoff_dir={handoff}",
                "--set", f"agent_callback_url={server.base}",
            )  # fmt: skip
        res = cli("strategy", "create", "--workflow", "clean", "--all", "--format", "json")
        sid = int(res.json()["id"])
        agents.start()
        try:
            assert cli("strategy", "apply", str(sid)).code == 0  # serve's conductor drives it
            deadline = time.monotonic() + 120
            while cli("strategy", "show", str(sid), "--format", "json").json()["state"] not in (
                "complete",
                "failed",
            ):
                assert time.monotonic() < deadline, steps(cli, sid)
                assert not agents.errors, agents.errors
                time.sleep(0.3)
        finally:
            agents.stop.set()
            agents.join(timeout=10)
    assert not agents.errors, agents.errors
    assert agents.reported == {
        (n, s): 202 for n in nodes for s in ("wait-for-agent", "clean-steps")
    }
    assert agents.forged == [401]
    for name, index in nodes.items():
        assert bmc.system(index)["PowerState"] == "Off", name
        assert steps(cli, sid)[name]["state"] == "complete"
    # the agents' reports, each stored through the API and applied
    history = cli("history", "--strategy", str(sid), "--format", "json").json()
    said = {(t["target"], t["from"]): t["details"] for t in history}
    assert said[("node-6", "clean-steps")] == "clean steps done: erase_devices_metadata"
    refused = cli("events", "--strategy", str(sid), "--kind", "callback-refused").text
    assert "from 127.0.0.1 refused" in refused
    # the tokens handed over are gone once the nodes are powered off
    assert list(handoff.iterdir()) == []
    check = cli("check")
    assert check.code == 0 and "ok:" in check.text, check.text


class FlakyFront:
    """A real HTTP server in front of the emulator that answers ``500`` to the first
    ``fail`` requests for a system (as a busy BMC does) and passes on the rest."""

    def __init__(self, upstream: str, fail: int) -> None:
        import http.server
        import threading

        front = self
        self.failed = 0
        self.fail = fail
        self.client = httpx.Client(base_url=upstream, timeout=10)

        class Handler(http.server.BaseHTTPRequestHandler):
            def _pass(self) -> None:
                size = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(size) if size else None
                if "/Systems/" in self.path and front.failed < front.fail:
                    front.failed += 1
                    self.send_response(500)
                    self.send_header("Content-Type", "application/json")
                    out = b'{"error": {"message": "database is locked"}}'
                    self.send_header("Content-Length", str(len(out)))
                    self.end_headers()
                    self.wfile.write(out)
                    return
                headers = {
                    k: v
                    for k, v in self.headers.items()
                    if k.lower() not in ("host", "content-length")
                }
                r = front.client.request(self.command, self.path, content=body, headers=headers)
                self.send_response(r.status_code)
                for k, v in r.headers.items():
                    if k.lower() not in ("content-length", "transfer-encoding", "connection"):
                        self.send_header(k, v)
                self.send_header("Content-Length", str(len(r.content)))
                self.end_headers()
                self.wfile.write(r.content)

            do_GET = do_POST = do_PATCH = do_DELETE = _pass

            def log_message(self, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.client.close()


@pytest.mark.parametrize("retries", [3, 0])
def test_a_bmc_answering_server_errors_is_asked_again_then_the_attempt_is_transient(
    cli: Cli, bmc: Bmc, clean_bmc: None, retries: int
) -> None:
    front = FlakyFront(bmc.url, fail=3)
    try:
        _add_node(
            cli, "node-1", front.url, 1, "--set", f"redfish_retries={retries}",
            "--set", "redfish_retry_delay_s=0.1", poll_s=0.2,
        )  # fmt: skip
        res = cli("strategy", "create", "--workflow", "clean-bmc", "--all", "--format", "json")
        sid = int(res.json()["id"])
        run = cli("strategy", "apply", str(sid), "--wait")
        details = steps(cli, sid)["node-1"]["details"]
        if retries:
            assert run.code == 0, details
            assert bmc.system(1)["PowerState"] == "Off"
        else:
            assert run.code == 1
            assert details == (
                f"power-off: redfish: {front.url} answered 500 database is locked, asked 1 time "
                "(redfish_retries) (attempt 1 of 1)"
            ), details
        assert front.failed == 3 if retries else front.failed == 1
    finally:
        front.stop()
