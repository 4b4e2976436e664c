"""``fleetwave sim`` as an operator or developer runs it."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest

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


def test_sim_with_rollout_plans_replays_and_says_how() -> None:
    # seed 83: a wait between stages on a skewed clock (once a livelock)
    args = ("--seed", "83", "--targets", "40", "--workflow", "firmware", "--plans")
    first = _sim(*args, "--format", "json")
    assert first.returncode == 0, first.stderr
    run = json.loads(first.stdout)[0]
    assert run["ok"] and run["options"]["stage_wait_s"] == 30.0
    assert run["options"]["stages"] == ["g1", "g0", "g2", "rest"]
    again = _sim(*args, "--format", "json")
    assert json.loads(again.stdout)[0]["digest"] == run["digest"]


def test_sim_rejects_bad_input() -> None:
    for args, needle in [
        (("--faults", "gremlins"), "--faults: unknown fault 'gremlins'"),
        (("--workflow", "nope"), "--workflow: unknown workflow 'nope' (known: clean,"),
        (("--faults", "crash,crash"), "--faults: 'crash' given more than once"),
        (("--targets", "0"), "--targets: must be 1 to 1000000, got 0"),
        (("--targets", "99999999999"), "--targets: must be 1 to 1000000"),
        (("--runs", "0"), "--runs: must be 1 to 1000000, got 0"),
        (("--faults", ""), "--faults: must not be empty"),
        (("--faults", "none,crash"), "--faults: 'all' and 'none' stand alone"),
    ]:
        res = _sim(*args)
        assert res.returncode == 2, (args, res.stderr)
        assert needle in res.stderr


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT])
def test_a_signal_stops_a_sweep_with_the_runs_done_and_one_line(sig: signal.Signals) -> None:
    """SIGTERM (a CI job's timeout) and SIGHUP exited 143 and 129 with nothing printed;
    raised at random points of the engine's tasks, an interrupt logged a CRITICAL line
    (or hundreds of asyncio errors). Now each stops the sweep as the README says: the
    runs done, one line on stderr saying how to go on, exit 130. SIGINT too when the
    process started with it ignored (a script's background job)."""
    proc = subprocess.Popen(
        [*FLEETWAVE, "sim", "--runs", "100", "--targets", "300"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        # as a non-interactive shell starts a background job: SIGINT ignored
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
    )
    assert proc.stdout is not None
    first = proc.stdout.readline()  # a run done: the handlers are in place
    assert first.startswith("seed 1: ok"), first
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    done = 1 + sum(1 for line in out.splitlines() if line.startswith("seed "))
    assert err.count("\n") == 1, err
    assert err.startswith(f"interrupted after {done} finished run"), err
    cut = done + 1
    assert f"seed {cut} was cut short. Go on with: fleetwave sim --seed {cut} " in err, err


def test_a_sweep_interrupted_in_its_last_run_is_cut_short_not_reported_ok() -> None:
    """An interrupt cancelled the run's main task while it awaited its conductor: the
    simulator took that for a crash, started another conductor, and reported the run
    (wrongly) as ok; a single-run or last-run sweep exited 0."""
    import threading

    from fleetwave.testing.simulate import Interrupt, SimConfig, run_simulation

    interrupt = Interrupt()
    timer = threading.Timer(1.5, interrupt.request)  # as a signal handler would, mid-run
    timer.start()
    started = time.monotonic()
    try:
        with pytest.raises(KeyboardInterrupt):
            run_simulation(SimConfig(seed=2, targets=5000), interrupt)
    finally:
        timer.cancel()
    assert time.monotonic() - started < 6  # the whole run takes several times that
