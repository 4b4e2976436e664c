"""The site emulator (``fleetwave site-emulator``), a real process on a loopback port
driven over HTTP: a remote strategy's lifecycle, failures at build and at apply, the
hosts' reboot making the site unreachable, a site preset in ready-to-apply (seed 001's
case), a second create refused, the counters, bad input, and the targets CSV.

One emulator serves the module (each test uses its own sites) at time scale 0.005: a
site second is 5 ms of real time.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from fleetwave.cli.parsing import targets_from_file
from fleetwave.emulator.app import Fleet
from fleetwave.emulator.settings import EmulatorConfig, SitePatch

#: real seconds per site second
TIME_SCALE = 0.005
#: the longest a test waits for the emulator (to start, or a site to reach a state)
WAIT_S = 10.0
SITES = 12
CONFIG: dict[str, Any] = {
    # build 20 ms; apply 100 ms plus a 200 ms reboot from 50 ms in (apply ends at 300 ms)
    "defaults": {"build_s": 4, "apply_s": 20, "reboot_s": 40, "reboot_at": 0.5, "abort_s": 2},
    "releases": [{"release_id": "stx-10.0.1", "kind": "software"}],
    "sites": {
        "site-0007": {"strategy": {"type": "sw-patch", "state": "ready-to-apply"}},
        "site-0008": {"settings": {"fail_at": "build"}},
        "site-0009": {"settings": {"fail_at": "apply", "fail_percent": 10}},
    },
}


def _fleetwave() -> list[str]:
    exe = Path(sys.executable).parent / "fleetwave"
    return [str(exe)] if exe.exists() else [shutil.which("fleetwave") or "fleetwave"]


class Emulator:
    """A running ``fleetwave site-emulator`` and a client for it."""

    def __init__(self, tmp: Path, *args: str) -> None:
        self.err = tmp / "emulator.err"
        self.csv = tmp / "targets.csv"
        with self.err.open("w") as err:
            self.proc = subprocess.Popen(
                [
                    *_fleetwave(),
                    "site-emulator",
                    "--port",
                    "0",
                    "--targets-csv",
                    str(self.csv),
                    *args,
                ],
                stdout=subprocess.DEVNULL,
                stderr=err,
            )
        self.base = self._wait_ready()
        self.http = httpx.Client(base_url=self.base, timeout=5.0)

    def _wait_ready(self) -> str:
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline:
            said = re.search(r"on (http://\S+)/sites/", self.err.read_text())
            if said:
                return said.group(1)
            if self.proc.poll() is not None:
                raise AssertionError(f"emulator exited: {self.err.read_text()}")
            time.sleep(0.02)
        raise AssertionError(f"emulator not ready in {WAIT_S} s: {self.err.read_text()}")

    def stop(self) -> int:
        """SIGTERM (SIGKILL if it does not end in 5 s); its exit status."""
        self.http.close()
        self.proc.terminate()
        try:
            return self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=5)
            raise

    def strategy_path(self, site: str, kind: str = "sw-deploy") -> str:
        return f"/sites/{site}/orchestration/{kind}/strategy"

    def wait_state(self, site: str, state: str, kind: str = "sw-deploy") -> dict[str, Any]:
        """Poll the strategy until it is in ``state`` (riding out 503s); what it read."""
        deadline = time.monotonic() + WAIT_S
        seen = None
        while time.monotonic() < deadline:
            r = self.http.get(self.strategy_path(site, kind))
            if r.status_code == 200:
                seen = r.json()
                if seen["state"] == state:
                    return dict(seen)
            else:
                assert r.status_code == 503, r.text
            time.sleep(0.005)
        raise AssertionError(f"{site} never reached {state}; last seen {seen}")

    def counters(self, site: str) -> dict[str, int]:
        r = self.http.get(f"/admin/sites/{site}/counters")
        assert r.status_code == 200, r.text
        return dict(r.json())


@pytest.fixture(scope="module")
def emulator(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Emulator]:
    tmp = tmp_path_factory.mktemp("emulator")
    config = tmp / "sites.json"
    config.write_text(json.dumps(CONFIG))
    emu = Emulator(
        tmp,
        "--sites",
        str(SITES),
        "--time-scale",
        str(TIME_SCALE),
        "--seed",
        "7",
        "--config",
        str(config),
    )
    try:
        yield emu
    finally:
        status = emu.stop()
    # SIGTERM is a clean stop: answers finished, exit 0
    assert status == 0, emu.err.read_text()
    assert emu.err.read_text().rstrip().endswith("site-emulator stopped")


def test_a_strategy_goes_through_its_whole_life(emulator: Emulator) -> None:
    http, path = emulator.http, emulator.strategy_path("site-0001")
    assert http.get("/healthz").json() == {
        "status": "ok",
        "sites": SITES,
        "seed": 7,
        "time_scale": TIME_SCALE,
    }
    assert http.get(path).status_code == 404

    created = http.post(path, json={"release": "stx-10.0.1"})
    assert created.status_code == 201, created.text
    assert created.json()["state"] == "building"
    assert created.json()["current_phase"] == "build"
    uuid = created.json()["uuid"]

    # a second create while one exists: refused, saying which one is there
    again = http.post(path, json={"release": "stx-10.0.1"})
    assert again.status_code == 409
    assert again.json()["field"] == "strategy"
    assert again.json()["strategy"]["uuid"] == uuid
    assert "already exists" in again.json()["error"]

    ready = emulator.wait_state("site-0001", "ready-to-apply")
    assert ready["uuid"] == uuid
    applied = http.post(path + "/actions", json={"action": "apply"})
    assert applied.status_code == 202, applied.text
    assert applied.json()["state"] == "applying"
    assert http.get("/sites/site-0001/software/releases/stx-10.0.1").json()["state"] == (
        "deploying"
    )

    # the hosts reboot mid-apply: the site's API answers 503 for a while, then comes back
    deadline = time.monotonic() + WAIT_S
    while (r := http.get(path)).status_code != 503:
        assert r.status_code == 200 and r.json()["state"] == "applying", r.text
        assert time.monotonic() < deadline, "the site never became unreachable"
        time.sleep(0.002)
    assert r.json()["error"] == "site-0001: hosts rebooting"
    assert int(r.headers["Retry-After"]) >= 1
    admin = http.get("/admin/sites/site-0001").json()  # the admin's view answers meanwhile
    assert admin["reachable"] is False
    assert admin["hosts"][0]["availability"] == "rebooting"

    done = emulator.wait_state("site-0001", "applied")
    assert done["progress_percent"] == 100
    assert http.get("/sites/site-0001/software/releases").json()["releases"] == [
        {
            "release_id": "stx-10.0.1",
            "kind": "software",
            "state": "deployed",
            "reboot_required": True,
        }
    ]
    # applying it a second time is refused: the strategy is applied
    assert http.post(path + "/actions", json={"action": "apply"}).status_code == 409

    deleted = http.delete(path)
    assert deleted.status_code == 200 and deleted.json()["deleted"]["uuid"] == uuid
    assert http.get(path).status_code == 404
    counters = emulator.counters("site-0001")
    assert counters["creates"] == 2
    assert counters["applies"] == 2
    assert counters["applies_started"] == 1  # never applied twice
    assert counters["reboots"] == 1
    assert counters["deletes"] == 1
    assert counters["unreachable"] >= 1


def test_a_build_fails_and_an_apply_fails_before_the_reboot(emulator: Emulator) -> None:
    http = emulator.http
    assert http.post(emulator.strategy_path("site-0008"), json={}).status_code == 201
    failed = emulator.wait_state("site-0008", "build-failed")
    assert "build failed" in failed["reason"]
    # a build-failed strategy cannot be applied; it can be deleted and made again
    path = emulator.strategy_path("site-0008")
    assert http.post(path + "/actions", json={"action": "apply"}).status_code == 409
    assert http.delete(path).status_code == 200

    path = emulator.strategy_path("site-0009", "sw-patch")
    assert http.post(path, json={"release": "stx-10.0.1"}).status_code == 201
    emulator.wait_state("site-0009", "ready-to-apply", "sw-patch")
    assert http.post(path + "/actions", json={"action": "apply"}).status_code == 202
    failed = emulator.wait_state("site-0009", "apply-failed", "sw-patch")
    assert "apply failed" in failed["reason"]
    release = http.get("/sites/site-0009/software/releases/stx-10.0.1").json()
    assert release["state"] == "available"
    # it failed at 10 % of the apply, before the hosts' reboot: no reboot, never down
    assert emulator.counters("site-0009")["reboots"] == 0
    assert emulator.counters("site-0009")["unreachable"] == 0


def test_a_site_preset_in_ready_to_apply_is_attached_to_not_created_again(
    emulator: Emulator,
) -> None:
    """Seed 001: a remote strategy already in ready-to-apply when the state starts. The
    site says so on GET; a create is refused; the one apply moves it on."""
    http, path = emulator.http, emulator.strategy_path("site-0007", "sw-patch")
    found = http.get(path)
    assert found.status_code == 200 and found.json()["state"] == "ready-to-apply"
    refused = http.post(path, json={})
    assert refused.status_code == 409
    assert refused.json()["strategy"]["state"] == "ready-to-apply"
    assert http.post(path + "/actions", json={"action": "apply"}).status_code == 202
    emulator.wait_state("site-0007", "applied", "sw-patch")
    counters = emulator.counters("site-0007")
    assert (counters["creates"], counters["applies"], counters["applies_started"]) == (1, 1, 1)

    # the same, set at runtime through the admin endpoint; a strategy already applying
    admin = http.patch(
        "/admin/sites/site-0010",
        json={"strategy": {"type": "kube-upgrade", "state": "applying"}},
    )
    assert admin.status_code == 200, admin.text
    assert admin.json()["strategy"]["state"] == "applying"
    emulator.wait_state("site-0010", "applied", "kube-upgrade")
    assert http.patch("/admin/sites/site-0010", json={"strategy": None}).json()["strategy"] is None


def test_an_abort_during_the_apply_ends_in_aborted(emulator: Emulator) -> None:
    http, path = emulator.http, emulator.strategy_path("site-0003", "fw-update")
    # a long apply (2 s), which the abort cuts short
    assert http.patch("/admin/sites/site-0003", json={"settings": {"apply_s": 400}}).is_success
    assert (
        http.post(
            "/sites/site-0003/software/releases",
            json={"release_id": "fw-3.0", "kind": "firmware", "reboot_required": False},
        ).status_code
        == 201
    )
    assert http.post(path, json={"release": "fw-3.0"}).status_code == 201
    emulator.wait_state("site-0003", "ready-to-apply", "fw-update")
    assert http.post(path + "/actions", json={"action": "apply"}).status_code == 202
    # deleting a strategy while it applies is refused
    assert http.delete(path).status_code == 409
    aborting = http.post(path + "/actions", json={"action": "abort"})
    assert aborting.status_code == 202 and aborting.json()["state"] == "aborting"
    assert emulator.wait_state("site-0003", "aborted", "fw-update")["reason"] == (
        "aborted by request"
    )
    release = http.get("/sites/site-0003/software/releases/fw-3.0").json()
    assert release["state"] == "available"
    # a release without reboot_required: the hosts never rebooted
    assert emulator.counters("site-0003")["reboots"] == 0
    assert http.post(path + "/actions", json={"action": "abort"}).status_code == 409
    assert http.delete(path).status_code == 200


def test_an_unreachable_window_set_by_the_admin(emulator: Emulator) -> None:
    http = emulator.http
    r = http.patch("/admin/sites/site-0011", json={"unreachable_for_s": 60})  # 300 ms
    assert r.status_code == 200 and r.json()["reachable"] is False
    down = http.get("/sites/site-0011")
    assert down.status_code == 503
    assert down.json()["error"] == "site-0011: unreachable"
    assert 0 < down.json()["retry_after_s"] <= 0.3
    # nothing it was asked while unreachable reached its orchestrator
    assert http.post(emulator.strategy_path("site-0011"), json={}).status_code == 503
    deadline = time.monotonic() + WAIT_S
    while http.get("/sites/site-0011").status_code == 503:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    counters = emulator.counters("site-0011")
    assert counters["creates"] == 0 and counters["unreachable"] >= 2


def test_latency_releases_and_license(emulator: Emulator) -> None:
    http = emulator.http
    assert (
        http.patch("/admin/sites/site-0012", json={"settings": {"latency_ms": 50}}).status_code
        == 200
    )
    started = time.monotonic()
    assert http.get("/sites/site-0012").status_code == 200
    assert time.monotonic() - started >= 0.05
    up = http.post(
        "/sites/site-0012/software/releases",
        json={"release_id": "fw-2.1", "kind": "firmware", "reboot_required": False},
    )
    assert up.status_code == 201 and up.json()["uploaded"] is True
    again = http.post("/sites/site-0012/software/releases", json={"release_id": "fw-2.1"})
    assert again.status_code == 200 and again.json()["uploaded"] is False
    assert http.get("/sites/site-0012/license").json()["installed"] is False
    assert http.post("/sites/site-0012/license", json={"license": "key"}).status_code == 200
    assert http.get("/sites/site-0012/license").json()["installed"] is True
    counters = emulator.counters("site-0012")
    assert (counters["uploads"], counters["license_installs"]) == (2, 1)
    every = http.get("/admin/counters").json()["sites"]
    assert len(every) == SITES and every["site-0012"] == counters


@pytest.mark.parametrize(
    ("method", "path", "body", "status", "field"),
    [
        ("GET", "/sites/site-9999", None, 404, "site"),
        ("GET", "/admin/sites/nope", None, 404, "site"),
        ("GET", "/sites/site-0002/orchestration/sw-nothing/strategy", None, 422, "type"),
        ("POST", "/sites/site-0002/orchestration/sw-patch/strategy", "{bad", 400, "body"),
        ("POST", "/sites/site-0002/orchestration/sw-patch/strategy", {"rel": 1}, 422, "rel"),
        (
            "POST",
            "/sites/site-0002/orchestration/sw-patch/strategy",
            {"release": "x"},
            422,
            "release",
        ),
        (
            "POST",
            "/sites/site-0002/orchestration/sw-patch/strategy/actions",
            {"action": "go"},
            422,
            "action",
        ),
        ("POST", "/sites/site-0002/software/releases", {"release_id": "a b"}, 422, "release_id"),
        ("GET", "/sites/site-0002/software/releases/none", None, 404, "release_id"),
        (
            "PATCH",
            "/admin/sites/site-0002",
            {"settings": {"latency_ms": "5"}},
            422,
            "settings.latency_ms",
        ),
        (
            "PATCH",
            "/admin/sites/site-0002",
            {"settings": {"fail_at": "x"}},
            422,
            "settings.fail_at",
        ),
        ("PATCH", "/admin/sites/site-0002", {"settings": {"speed": 1}}, 422, "settings.speed"),
        ("PATCH", "/admin/sites/site-0002", {"unreachable_for_s": -1}, 422, "unreachable_for_s"),
        (
            "PATCH",
            "/admin/sites/site-0002",
            {"strategy": {"type": "sw-patch", "state": "ready-to-apply", "release": "zz"}},
            422,
            "strategy.release",
        ),
    ],
)
def test_bad_input_is_a_4xx_naming_the_field(
    emulator: Emulator, method: str, path: str, body: Any, status: int, field: str
) -> None:
    content = body if isinstance(body, str) else None if body is None else json.dumps(body)
    r = emulator.http.request(
        method, path, content=content, headers={"content-type": "application/json"}
    )
    assert r.status_code == status, r.text
    assert r.json()["field"] == field
    assert r.json()["error"]
    # nothing was changed by a refused admin change
    assert emulator.http.get("/admin/sites/site-0002").json()["settings"]["latency_ms"] == 0


def test_the_targets_csv_lists_every_site_for_target_import(emulator: Emulator) -> None:
    """The CSV parses as ``fleetwave target import`` reads it. (Importing it needs the
    ``http`` driver, which does not exist yet: the store refuses an unknown driver.)"""
    rows = emulator.csv.read_text().splitlines()
    assert rows[0] == "name,driver,url"
    assert rows[1] == f"site-0001,http,{emulator.base}/sites/site-0001"
    assert len(rows) == SITES + 1
    targets = targets_from_file(emulator.csv)
    assert [t.name for t in targets][:2] == ["site-0001", "site-0002"]
    assert {t.driver for t in targets} == {"http"}
    url = targets[6].settings["url"]
    assert url.endswith("/sites/site-0007")
    # the url is the site's API base: it answers
    assert httpx.get(url, timeout=5.0).json()["name"] == "site-0007"


def test_a_bad_config_or_option_is_refused_at_start(tmp_path: Path) -> None:
    config = tmp_path / "bad.yaml"
    config.write_text("sites:\n  site-0002:\n    settings: {fail_at: later}\n")
    r = subprocess.run(
        [*_fleetwave(), "site-emulator", "--sites", "3", "--port", "0", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert r.returncode == 2
    assert "sites.site-0002.settings.fail_at" in r.stderr and str(config) in r.stderr


def test_outcomes_replay_for_a_seed() -> None:
    """The same seed and requests: the same strategies (uuids) and the same failures."""

    def run(seed: int) -> list[tuple[str, str]]:
        now = [0.0]
        fleet = Fleet(
            40,
            seed=seed,
            config=EmulatorConfig(defaults={}, sites={}, releases=[]),
            clock=lambda: now[0],
        )
        for site in fleet.sites.values():
            fleet.patch(site, SitePatch(settings={"fail_rate": 0.5}), 0.0)
            site.create_strategy("sw-patch", None, 0.0)
        now[0] = 10.0
        for site in fleet.sites.values():
            site.advance(fleet.now())
            if site.strategy is not None and site.strategy.state == "ready-to-apply":
                site.act("sw-patch", "apply", fleet.now())
        now[0] = 100.0
        out = []
        for site in fleet.sites.values():
            site.advance(fleet.now())
            assert site.strategy is not None
            out.append((site.strategy.uuid, site.strategy.state))
        return out

    first = run(3)
    assert first == run(3)
    assert first != run(4)
    assert {state for _, state in first} == {"applied", "build-failed", "apply-failed"}
