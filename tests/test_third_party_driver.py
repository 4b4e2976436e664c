"""A third-party driver, installed from a throw-away package as an operator would
(its module and ``.dist-info`` as ``pip install`` lays them out, its entry point in
the ``fleetwave.drivers`` group), drives a
rollout: the driver's code and ``pyproject.toml`` are the ones docs/drivers.md shows.
A package whose driver cannot be imported is listed as broken; the others work on."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE_MARK = re.compile(r"<!-- package: (\S+) -->\n```\w*\n(.*?)\n```\n", re.DOTALL)


def _fleetwave(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    exe = Path(sys.executable).parent / "fleetwave"
    return subprocess.run(
        [str(exe), *args], env=env, capture_output=True, text=True, timeout=120, check=False
    )


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The manual's acme driver package, laid out as pip installs it (the module, and a
    ``.dist-info`` with its metadata and the entry points its ``pyproject.toml`` names)
    in a directory of its own; and a package whose driver cannot be imported."""
    site = tmp_path_factory.mktemp("site")
    files = dict(PACKAGE_MARK.findall((ROOT / "docs" / "drivers.md").read_text()))
    assert set(files) == {"acme_driver.py", "pyproject.toml"}
    (site / "acme_driver.py").write_text(files["acme_driver.py"] + "\n")
    project = tomllib.loads(files["pyproject.toml"])["project"]
    _dist_info(site, project["name"], project["version"], project["entry-points"])
    _dist_info(site, "broken-driver", "1.0", {"fleetwave.drivers": {"broken": "nowhere:X"}})
    return site


def _dist_info(site: Path, name: str, version: str, groups: dict[str, dict[str, str]]) -> None:
    info = site / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    (info / "entry_points.txt").write_text(
        "".join(
            f"[{group}]\n" + "".join(f"{k} = {v}\n" for k, v in points.items())
            for group, points in groups.items()
        )
    )


def test_an_installed_driver_is_listed_and_drives_a_rollout(
    installed: Path, tmp_path: Path
) -> None:
    env = {
        **os.environ,
        "PYTHONPATH": str(installed),
        "FLEETWAVE_DB": str(tmp_path / "fleet.db"),
        "ACME_PASSWORD": "open-sesame",
        "COLUMNS": "250",
    }
    listed = {
        d["name"]: d
        for d in json.loads(_fleetwave(env, "driver", "list", "--format", "json").stdout)
    }
    assert listed["acme"]["status"] == "ok" and listed["acme"]["secret"] == "password"
    assert listed["acme"]["source"].startswith("acme-driver (acme_driver:AcmeDriver)")
    assert listed["broken"]["status"].startswith("broken: cannot import: ModuleNotFoundError")
    assert listed["sim"]["status"] == "ok"
    shown = json.loads(_fleetwave(env, "driver", "show", "acme", "--format", "json").stdout)
    assert [(s["setting"], s["secret"]) for s in shown["settings"]] == [
        ("state_file", False),
        ("password", True),
    ]
    bad = _fleetwave(env, "target", "add", "w0", "--driver", "acme", "--set", "password=env:X")
    assert bad.returncode == 2 and bad.stderr == "error: target w0: state_file: required\n"
    widgets = {f"w{i}": tmp_path / f"w{i}.json" for i in range(1, 4)}
    for name, path in widgets.items():
        r = _fleetwave(
            env, "target", "add", name, "--driver", "acme",
            "--set", f"state_file={path}", "--set", "password=env:ACME_PASSWORD",
        )  # fmt: skip
        assert r.returncode == 0, r.stderr
    assert _fleetwave(env, "strategy", "create", "--workflow", "patch", "--all").returncode == 0
    run = _fleetwave(env, "strategy", "apply", "1", "--wait")
    assert run.returncode == 0, run.stdout + run.stderr
    states = ["pre-check", "updating-patches", "creating-remote-patch-strategy",
              "applying-remote-patch-strategy", "finishing"]  # fmt: skip
    for path in widgets.values():  # what the targets saw: each operation once
        assert json.loads(path.read_text()) == states
    check = _fleetwave(env, "check")
    assert check.returncode == 0 and "ok:" in check.stdout, check.stdout + check.stderr
    # again: every widget's pre-check reports it done, and the steps finish skipped
    assert _fleetwave(env, "strategy", "create", "--workflow", "patch", "--all").returncode == 0
    assert _fleetwave(env, "strategy", "apply", "2", "--wait").returncode == 0
    steps = json.loads(
        _fleetwave(env, "step", "list", "--strategy", "2", "--format", "json").stdout
    )
    assert all("already done" in s["details"] for s in steps), steps
    # a secret its driver cannot read fails the step with the reason
    env["ACME_PASSWORD"] = "wrong"
    assert (
        _fleetwave(env, "strategy", "create", "--workflow", "kube-upgrade", "--all").returncode == 0
    )
    assert _fleetwave(env, "strategy", "apply", "3", "--wait").returncode == 1
    steps = json.loads(
        _fleetwave(env, "step", "list", "--strategy", "3", "--format", "json").stdout
    )
    assert {s["state"] for s in steps} == {"failed"}
    assert all("acme: w" in s["details"] and "login refused" in s["details"] for s in steps)
