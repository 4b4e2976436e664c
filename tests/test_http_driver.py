"""The http driver against the site emulator, a real process on a loopback port: the
built-in workflows complete over HTTP; a site that already has a strategy (ready to
apply, applying, failed, another's) is attached to or recreated, never applied twice;
a site unreachable during an apply for less and for more than its allowance; a site
that refuses connections, never answers or answers garbage fails within its timeout
with the reason;
a conductor killed mid-apply, and the next one's recover hook observing the site.

One emulator serves the module (each test uses its own sites) at time scale 0.01: a
site second is 10 ms of real time.
"""

from __future__ import annotations

import csv
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest

from cli_harness import Cli
from fleetwave.drivers.http import _Progress
from test_cli_strategy import apply_wait, steps
from test_site_emulator import Emulator

TIME_SCALE = 0.01
#: the site's phases (site seconds): build 50 ms, apply 200 ms with a 100 ms reboot
DEFAULTS = {"build_s": 5, "apply_s": 20, "reboot_s": 10, "reboot_at": 0.5, "abort_s": 2}
#: what every target is given besides its url: polls fit the emulator's pace
FAST = {"build_poll_s": 0.02, "apply_poll_s": 0.02}
RELEASE = "stx-10.0.1"
PATCH_RELEASE = [{"release_id": RELEASE, "kind": "patch", "state": "available"}]


@pytest.fixture(scope="module")
def emulator(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Emulator]:
    tmp = tmp_path_factory.mktemp("emulator")
    config = tmp / "sites.json"
    config.write_text(json.dumps({"defaults": DEFAULTS}))
    emu = Emulator(tmp, "--sites", "30", "--time-scale", str(TIME_SCALE), "--config", str(config))
    try:
        yield emu
    finally:
        emu.stop()


def _site_urls(emulator: Emulator) -> dict[str, str]:
    with emulator.csv.open() as f:
        return {row["name"]: row["url"] for row in csv.DictReader(f)}


def import_sites(cli: Cli, emulator: Emulator, tmp: Path, names: dict[str, dict[str, Any]]) -> None:
    """Import the named sites (from the emulator's own CSV) with their extra settings."""
    urls = _site_urls(emulator)
    keys = sorted({k for extra in names.values() for k in {**FAST, **extra}})
    path = tmp / "sites.csv"
    with path.open("w", newline="") as f:
        out = csv.writer(f)
        out.writerow(["name", "driver", "url", *keys])
        for name, extra in names.items():
            given = {**FAST, **extra}
            out.writerow([name, "http", urls[name], *(given.get(k, "") for k in keys)])
    res = cli("target", "import", str(path))
    assert res.code == 0, res.text


def admin(emulator: Emulator, site: str, change: dict[str, Any]) -> None:
    r = emulator.http.patch(f"/admin/sites/{site}", json=change)
    assert r.status_code == 200, r.text


def rollout(cli: Cli, workflow: str = "patch", *more: str) -> tuple[int, int]:
    res = cli("strategy", "create", "--workflow", workflow, "--all", *more, "--format", "json")
    assert res.code == 0, res.text
    sid = int(res.json()["id"])
    return sid, apply_wait(cli, sid).code


def _end_apply_once_polled(emulator: Emulator, site: str, attached: list[int]) -> None:
    """Once the rollout has polled ``site``'s apply under way (3 requests: its pre-check,
    the create refused with 409, a poll), let that apply end 1 s later (100 site
    seconds); the count of requests seen then goes into ``attached``. After 120 s
    without it, it ends the apply anyway (the rollout then ends, and the test fails)."""
    deadline = time.monotonic() + 120
    with httpx.Client(base_url=emulator.base, timeout=5.0) as http:
        seen = 0
        while time.monotonic() < deadline:
            seen = int(http.get(f"/admin/sites/{site}/counters").json()["requests"])
            if seen >= 3:
                attached.append(seen)
                break
            time.sleep(0.01)
        for change in (
            {"settings": {"apply_s": 100}},
            {"strategy": {"type": "sw-patch", "state": "applying", "release": RELEASE}},
        ):
            r = http.patch(f"/admin/sites/{site}", json=change)
            assert r.status_code == 200, r.text


def test_a_patch_rollout_attaches_to_strategies_the_sites_already_have(
    cli: Cli, emulator: Emulator, tmp_path: Path
) -> None:
    # 0002: seed 001's case, a strategy already ready-to-apply; 0003: one already applying
    # (slowly); 0004: an old one that failed; 0005: another type's, still building
    for site in ("site-0002", "site-0003", "site-0004", "site-0005"):
        admin(emulator, site, {"releases": PATCH_RELEASE})
    # 0003's apply lasts until the rollout has attached to it (see _end_apply_once_polled):
    # with a fixed 1 s apply it had sometimes ended before a loaded machine's rollout got
    # there, and its pre-check then skipped the site as done, leaving the strategy behind
    admin(emulator, "site-0003", {"settings": {"apply_s": 86_400}})
    admin(emulator, "site-0005", {"settings": {"build_s": 86_400}})
    presets = {"site-0002": "ready-to-apply", "site-0003": "applying", "site-0004": "apply-failed"}
    for site, state in presets.items():
        admin(
            emulator, site, {"strategy": {"type": "sw-patch", "state": state, "release": RELEASE}}
        )
    admin(emulator, "site-0005", {"strategy": {"type": "fw-update", "state": "building"}})
    sites = [f"site-000{i}" for i in range(1, 6)]
    import_sites(cli, emulator, tmp_path, {s: {} for s in sites})
    attached: list[int] = []
    ender = threading.Thread(target=_end_apply_once_polled, args=(emulator, "site-0003", attached))
    ender.start()
    try:
        sid, code = rollout(cli)
    finally:
        ender.join()
    # the rollout polled 0003's apply under way (pre-check, the create's 409, polls)
    assert attached and attached[0] >= 3, attached
    assert code == 1  # site-0005 fails
    by_site = steps(cli, sid)
    assert {s: by_site[s]["state"] for s in sites} == {
        **{s: "complete" for s in sites[:4]},
        "site-0005": "failed",
    }
    assert "site-0005 has a fw-update strategy building" in by_site["site-0005"]["details"]
    assert "not ours to replace while it runs" in by_site["site-0005"]["details"]
    counters = {s: emulator.counters(s) for s in sites}
    # applied once each; the one applying already never again; the other type untouched
    assert [counters[s]["applies_started"] for s in sites] == [1, 1, 0, 1, 0]
    assert [counters[s]["applies"] for s in sites] == [1, 1, 0, 1, 0]
    assert counters["site-0004"]["deletes"] == 2  # the failed one, then ours when finished
    for site in sites[:4]:
        view = emulator.http.get(f"/admin/sites/{site}").json()
        assert view["strategy"] is None  # finishing deleted it
        assert {r["release_id"]: r["state"] for r in view["releases"]} == {RELEASE: "deployed"}
    check = cli("check")
    assert check.code == 0 and "ok:" in check.text, check.text


@pytest.mark.parametrize(
    "workflow,kind",
    [("sw-deploy", "software"), ("firmware", "firmware"), ("kube-upgrade", "kubernetes")],
)
def test_the_other_built_in_workflows_complete_over_http(
    cli: Cli, emulator: Emulator, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    workflow: str, kind: str,
) -> None:  # fmt: skip
    site = {"sw-deploy": "site-0011", "firmware": "site-0012", "kube-upgrade": "site-0013"}[
        workflow
    ]
    monkeypatch.setenv("SITE_LICENSE", "a license text")
    import_sites(cli, emulator, tmp_path, {site: {"license": "env:SITE_LICENSE"}})
    sid, code = rollout(cli, workflow)
    assert code == 0, steps(cli, sid)
    view = emulator.http.get(f"/admin/sites/{site}").json()
    assert view["releases"] == [
        {"release_id": RELEASE, "kind": kind, "state": "deployed", "reboot_required": True}
    ]
    assert view["counters"]["applies_started"] == 1
    assert view["license_installed"] is (workflow == "sw-deploy")
    # again: the pre-check (the firmware import) finds it deployed and the step skips
    sid, code = rollout(cli, workflow)
    assert code == 0
    assert "already done" in steps(cli, sid)[site]["details"]
    assert emulator.counters(site)["applies_started"] == 1


def test_an_unreachable_site_during_apply_has_its_own_allowance(
    cli: Cli, emulator: Emulator, tmp_path: Path
) -> None:
    # 0006 reboots for 0.5 s with 3 s allowed; 0007 for 3 s with 0.5 s allowed
    admin(emulator, "site-0006", {"settings": {"reboot_s": 50}})
    admin(emulator, "site-0007", {"settings": {"reboot_s": 300}})
    import_sites(
        cli,
        emulator,
        tmp_path,
        {
            "site-0006": {"unreachable_allowance_s": 3, "read_retries": 0},
            "site-0007": {"unreachable_allowance_s": 0.5, "read_retries": 0},
        },
    )
    sid, code = rollout(cli)
    assert code == 1
    by_site = steps(cli, sid)
    assert by_site["site-0006"]["state"] == "complete"
    failed = by_site["site-0007"]
    assert failed["state"] == "failed"
    assert "applying-remote-patch-strategy" in failed["details"]
    assert "site-0007 unreachable for" in failed["details"]
    assert "over its allowance of 0.5s (unreachable_allowance_s)" in failed["details"]
    assert "503: site-0007: hosts rebooting" in failed["details"]
    assert emulator.counters("site-0007")["applies_started"] == 1


PRE_CHECK_ONLY = """\
name: http-pre-check
states:
  - name: pre-check
    timeout_s: 5
"""


class _Garbled(BaseHTTPRequestHandler):
    """A site answering text where its API answers JSON."""

    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Length", "5")
        self.end_headers()
        self.wfile.write(b"hello")

    def log_message(self, format: str, *args: Any) -> None:  # quiet
        pass


def test_a_site_that_refuses_never_answers_or_garbles_fails_within_its_timeout(
    cli: Cli, tmp_path: Path
) -> None:
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    refused_port = closed.getsockname()[1]
    closed.close()  # nothing listens there now
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(10)  # connects, never answers
    silent_port = silent.getsockname()[1]
    garbled = ThreadingHTTPServer(("127.0.0.1", 0), _Garbled)
    garbled_port = garbled.server_address[1]
    threading.Thread(target=garbled.serve_forever, daemon=True).start()
    try:
        wf = tmp_path / "wf.yaml"
        wf.write_text(PRE_CHECK_ONLY)
        assert cli("workflow", "add", str(wf)).code == 0
        for name, port, extra in (
            ("refusing", refused_port, []),
            ("silent", silent_port, ["--set", "timeout_s=0.3", "--set", "read_retries=1"]),
            ("garbled", garbled_port, []),
        ):
            url = f"http://127.0.0.1:{port}/sites/{name}"
            res = cli("target", "add", name, "--driver", "http", "--set", f"url={url}", *extra)
            assert res.code == 0, res.text
        started = time.monotonic()
        sid, code = rollout(cli, "http-pre-check")
        assert code == 1
        assert time.monotonic() - started < 5  # each within its own timeout
        by_site = steps(cli, sid)
        assert by_site["refusing"]["details"] == (
            f"pre-check: http: connection refused at http://127.0.0.1:{refused_port}"
            f"/sites/refusing/software/releases/{RELEASE} (attempt 1 of 1)"
        )
        assert by_site["silent"]["details"] == (
            f"pre-check: http: no answer within 0.3s at http://127.0.0.1:{silent_port}"
            f"/sites/silent/software/releases/{RELEASE} (attempt 1 of 1)"
        )
        assert by_site["garbled"]["details"] == (
            f"pre-check: http: GET http://127.0.0.1:{garbled_port}/sites/garbled/software"
            f"/releases/{RELEASE}: not a JSON object: 'hello'"
        )
    finally:
        silent.close()
        garbled.shutdown()
        garbled.server_close()


def wait_state(emulator: Emulator, site: str, state: str) -> None:
    """Until the site's strategy is in ``state`` (as the admin sees it: no 503, no 404)."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        strategy = emulator.http.get(f"/admin/sites/{site}").json()["strategy"]
        if strategy is not None and strategy["state"] == state:
            return
        time.sleep(0.01)
    raise AssertionError(f"{site} never {state}")


def _fleetwave(*args: str, env: dict[str, str], **kw: Any) -> subprocess.Popen[str]:
    exe = Path(sys.executable).parent / "fleetwave"
    return subprocess.Popen(
        [str(exe), *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        **kw,
    )


def test_a_conductor_killed_mid_apply_the_next_one_observes_the_sites(
    cli: Cli, emulator: Emulator, db_path: Path, tmp_path: Path
) -> None:
    # The next conductor takes over at once (a dead process on this host is seen dead):
    # site-0021's apply (5 s) and site-0022's (8 s, the hosts rebooting from 4 s) are
    # still running, site-0023's strategy still building (8 s)
    sites = ["site-0021", "site-0022", "site-0023"]
    admin(emulator, "site-0021", {"settings": {"apply_s": 500}})
    admin(emulator, "site-0022", {"settings": {"apply_s": 800, "reboot_s": 50}})
    admin(emulator, "site-0023", {"settings": {"build_s": 800}})
    import_sites(cli, emulator, tmp_path, {s: {} for s in sites})
    res = cli("strategy", "create", "--workflow", "patch", "--all", "--format", "json")
    sid = str(res.json()["id"])
    env = {**os.environ, "FLEETWAVE_DB": str(db_path)}
    first = _fleetwave("strategy", "apply", sid, "--wait", "--lease-ttl", "15", env=env)
    try:
        for site, state in zip(sites, ["applying", "applying", "building"], strict=True):
            wait_state(emulator, site, state)
        # (the steps' states then)
        killed_in = ["applying-remote-patch-strategy"] * 2 + ["creating-remote-patch-strategy"]
    except AssertionError:
        first.kill()
        raise AssertionError(first.communicate()[0]) from None
    finally:
        first.send_signal(signal.SIGKILL)
        said, _ = first.communicate(timeout=10)
    assert first.returncode == -signal.SIGKILL, said
    second = _fleetwave("strategy", "apply", sid, "--wait", "--lease-ttl", "15", env=env)
    out, _ = second.communicate(timeout=90)
    assert second.returncode == 0, out
    by_site = steps(cli, int(sid))
    assert {by_site[s]["state"] for s in sites} == {"complete"}
    for site in sites:  # observed and attached to, never created or applied again
        counters = emulator.counters(site)
        assert (counters["creates"], counters["applies_started"]) == (1, 1), site
    history = cli("history", "--strategy", sid, "--format", "json")
    assert history.code == 0, history.text
    moves = {(t["target"], t["from"]): t for t in history.json()}
    for site, state in zip(sites, killed_in, strict=True):
        entered = next(t for t in history.json() if (t["target"], t["to"]) == (site, state))
        left = moves[(site, state)]  # by the next conductor, on the site's word
        assert left["conductor"] != entered["conductor"] and left["fence"] > entered["fence"]
    check = cli("check")
    assert check.code == 0 and "ok:" in check.text, check.text


def test_a_poll_comes_sooner_when_the_sites_progress_says_the_phase_ends_sooner() -> None:
    look = _Progress(poll_s=2.0)
    applying = {"state": "applying"}
    assert look.next_look_s({**applying, "progress_percent": 10}, now=100.0) == 2.0
    # 10 -> 40 % in 2 s: 60 % left is 4 s, more than a poll
    assert look.next_look_s({**applying, "progress_percent": 40}, now=102.0) == 2.0
    # 10 -> 85 % in 5 s: 15 % left is 1 s
    assert look.next_look_s({**applying, "progress_percent": 85}, now=105.0) == pytest.approx(1.0)
    # 99 %: never sooner than a tenth of the poll
    assert look.next_look_s({**applying, "progress_percent": 99}, now=106.0) == 0.2
    # another phase (or no progress said) starts afresh at the poll interval
    assert look.next_look_s({"state": "aborting", "progress_percent": 50}, now=107.0) == 2.0
    assert look.next_look_s({"state": "aborting", "progress_percent": None}, now=108.0) == 2.0


def test_the_conductor_closes_its_connection_pools_when_it_ends(
    cli: Cli, emulator: Emulator, tmp_path: Path, db_path: Path
) -> None:
    import asyncio

    import psutil

    from fleetwave.engine.conductor import Conductor
    from fleetwave.store.db import open_store

    port = int(emulator.base.rsplit(":", 1)[1].split("/")[0])

    def open_to_emulator() -> int:
        return sum(
            1
            for c in psutil.Process().net_connections(kind="tcp")
            if c.raddr and c.raddr.port == port and c.status == psutil.CONN_ESTABLISHED
        )

    import_sites(cli, emulator, tmp_path, {f"site-002{i}": {} for i in range(4)})
    res = cli("strategy", "create", "--workflow", "patch", "--all", "--format", "json")
    sid = int(res.json()["id"])
    assert cli("strategy", "apply", str(sid)).code == 0
    store = open_store(str(db_path))

    async def drive() -> tuple[str, int]:
        # on a loop that goes on after the conductor (as a service's or a library's):
        # the driver's keep-alive connections would stay open on it
        conductor = Conductor(store)
        ended = await conductor.run(strategy_ids=[sid])
        await asyncio.sleep(0.2)  # (the emulator's side closes too)
        return ended[sid], open_to_emulator()

    before = open_to_emulator()  # (the test's own client's)
    try:
        state, after = asyncio.run(drive())
    finally:
        store.dispose()
    assert state == "complete", steps(cli, sid)
    assert after == before
