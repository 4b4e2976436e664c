"""``fleetwave sim`` as an operator or developer runs it."""

from __future__ import annotations

import json
import subprocess
import sys

FLEETWAVE = [sys.executable, "-m", "fleetwave.cli.main"]


def _sim(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*FLEETWAVE, "sim", *args], capture_output=True, text=True, timeout=300)


def test_sim_runs_prints_seeds_and_replays_exactly() -> None:
    first = _sim("--seed", "5", "--runs", "2", "--targets", "25", "--format", "json")
    assert first.returncode == 0, first.stderr
    runs = json.loads(first.stdout)
    assert [r["seed"] for r in runs] == [5, 6]
    assert all(r["ok"] and r["violations"] == [] for r in runs)
    again = _sim("--seed", "6", "--targets", "25", "--format", "json")
    assert json.loads(again.stdout)[0]["digest"] == runs[1]["digest"]


def test_sim_table_output_names_each_seed() -> None:
    res = _sim("--seed", "2", "--runs", "2", "--targets", "10", "--workflow", "clean")
    assert res.returncode == 0, res.stderr
    assert "seed 2: ok clean x10" in res.stdout
    assert "seed 3: ok clean x10" in res.stdout
    assert "2 runs ok" in res.stdout


def test_sim_rejects_bad_input() -> None:
    for args, needle in [
        (("--faults", "gremlins"), "--faults: unknown fault 'gremlins'"),
        (("--workflow", "nope"), "--workflow: unknown workflow 'nope'"),
        (("--targets", "0"), "--targets: must be 1 to 1000000, got 0"),
        (("--targets", "99999999999"), "--targets: must be 1 to 1000000"),
        (("--runs", "0"), "--runs: must be 1 to 1000000, got 0"),
        (("--faults", ""), "--faults: must not be empty"),
        (("--faults", "none,crash"), "--faults: 'all' and 'none' stand alone"),
    ]:
        res = _sim(*args)
        assert res.returncode == 2, (args, res.stderr)
        assert needle in res.stderr
