"""Limits and plug-ins: numbers too large for the database, plug-ins that cannot be
imported, a strategy whose workflow this process lacks, a database path that is an empty
file or another program's database, filters that name nothing, the progress line,
Ctrl-C on ``apply --wait``, lease lengths and a locked database.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
from rich.progress import Progress
from sqlalchemy import update

from cli_harness import Cli, assert_rejected, one_line
from conftest import add_sim_targets, on_virtual_time
from fleetwave.cli.drive import _watch
from fleetwave.domain import registry
from fleetwave.domain.models import StrategyOptions
from fleetwave.domain.registry import register_workflow
from fleetwave.domain.workflow import DriverOperation, StateDef, WorkflowDef
from fleetwave.engine.claims import NOT_DRIVABLE_HERE
from fleetwave.engine.conductor import Conductor
from fleetwave.store import admin, queries
from fleetwave.store.db import Store
from fleetwave.store.schema import strategies
from fleetwave.testing.invariants import check

HUGE = "99999999999999999999"  # above 2**63 - 1


@pytest.mark.parametrize(
    "args",
    [
        ("strategy", "show", HUGE),
        ("strategy", "apply", HUGE),
        ("strategy", "abort", HUGE),
        ("strategy", "delete", HUGE),
        ("step", "show", HUGE),
        ("step", "list", "--strategy", HUGE),
        ("history", "--strategy", HUGE),
        ("history", "--strategy", "1", "--last", HUGE),
        ("check", "--strategy", HUGE),
        ("group", "add", "g0", "--max-parallel", HUGE),
        ("strategy", "create", "--workflow", "patch", "--all", "--max-parallel", HUGE),
        ("strategy", "create", "--workflow", "patch", "--all", "--max-failures", HUGE),
    ],
)
def test_a_number_too_large_is_bad_input(cli: Cli, args: tuple[str, ...]) -> None:
    assert cli("target", "add", "a").code == 0
    res = cli(*args)
    assert res.code == 2, res.text
    assert res.err.startswith("error: ") and len(res.err.strip().splitlines()) == 1, res.err
    assert "Traceback" not in res.text
    assert cli("strategy", "list", "--format", "json").json() == []
    assert cli("group", "list", "--format", "json").json() == []


def test_max_parallel_has_a_ceiling(cli: Cli) -> None:
    assert cli("target", "add", "a").code == 0
    res = cli("strategy", "create", "--workflow", "patch", "--all", "--max-parallel", "2000000")
    assert res.code == 2 and "--max-parallel" in res.err and "1000000" in res.err, res.text
    # one wording wherever a max parallel is given (Typer's own check said "Input should be")
    for args in (["group", "add", "g"], ["group", "set", "g"]):
        if args[1] == "set":
            assert cli("group", "add", "g").code == 0
        res = cli(*args, "--max-parallel", "2000000")
        assert_rejected(res, "--max-parallel: must be at most 1000000, got 2000000")
    res = cli("demo", "--targets", "5", "--latency-ms", "inf")
    assert_rejected(res, "--latency-ms: must be 0 to 86400000")


def test_a_strategy_whose_options_cannot_be_driven_fails_alone(store: Store) -> None:
    """A strategy an earlier version stored with max parallel 10**20: the conductor
    ends it as undrivable and drives the others (it crashed before)."""
    add_sim_targets(store, 2)
    bad = admin.create_strategy(store, _wf("patch"), StrategyOptions(), target_names=["t00000"])
    good = admin.create_strategy(store, _wf("patch"), StrategyOptions(), target_names=["t00001"])
    with store.write() as conn:
        opts = json.loads(
            conn.execute(strategies.select().where(strategies.c.id == bad)).one().options
        )
        opts["max_parallel"] = 10**20
        conn.execute(
            update(strategies).where(strategies.c.id == bad).values(options=json.dumps(opts))
        )
    admin.apply_strategy(store, bad)
    admin.apply_strategy(store, good)
    result = asyncio.run(Conductor(store).run(strategy_ids=[bad, good]))
    assert result == {bad: "failed", good: "complete"}
    assert "max_parallel: must be 1 to 1000000" in queries.get_strategy(store, bad)["details"]


def _wf(name: str) -> WorkflowDef:
    wf = registry.get_workflow(name)
    assert wf is not None
    return wf


def test_a_plugin_that_raises_is_one_line(
    cli: Cli, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    (tmp_path / "raising_plugin.py").write_text("raise RuntimeError('boom in plugin')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("FLEETWAVE_PLUGINS", "raising_plugin")
    monkeypatch.setattr(registry, "_loaded", False)
    monkeypatch.setattr(registry, "_load_error", None)
    for args in (("workflow", "list"), ("serve",), ("workflow", "show", "patch")):
        assert_rejected(
            cli(*args),
            "FLEETWAVE_PLUGINS: cannot import 'raising_plugin': RuntimeError: boom in plugin",
        )


def test_serve_with_a_plugin_that_is_missing_refuses_to_start(
    cli: Cli, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("FLEETWAVE_PLUGINS", "no_such_module_here")
    monkeypatch.setattr(registry, "_loaded", False)
    monkeypatch.setattr(registry, "_load_error", None)
    db = tmp_path / "new.db"
    assert_rejected(cli("serve", db=db), "FLEETWAVE_PLUGINS: cannot import 'no_such_module_here'")
    assert not db.exists()  # nothing written, not even a database


def test_apply_wait_without_the_strategys_plugin_refuses_and_changes_nothing(
    cli: Cli, monkeypatch: pytest.MonkeyPatch
) -> None:
    register_workflow(
        WorkflowDef("drain-x", (StateDef("drain", DriverOperation("drain")),)), replace=True
    )
    assert cli("target", "add", "a").code == 0
    sid = cli("strategy", "create", "--workflow", "drain-x", "--all", "--format", "json").json()[
        "id"
    ]
    monkeypatch.delitem(registry._workflows, "drain-x")  # another process: no plug-in
    res = cli("strategy", "apply", str(sid), "--wait")
    assert_rejected(res, f"strategy {sid}: workflow: unknown workflow 'drain-x'")
    assert cli("strategy", "show", str(sid), "--format", "json").json()["state"] == "initial"


def test_a_conductor_lacking_a_workflow_leaves_that_strategy_to_others(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Not failed (the strategy is not at fault): handed back, still applying, and
    not claimed again by this conductor; the other strategies are driven."""
    register_workflow(
        WorkflowDef("drain-y", (StateDef("drain", DriverOperation("drain")),)), replace=True
    )
    add_sim_targets(store, 2)
    missing = admin.create_strategy(
        store, _wf("drain-y"), StrategyOptions(), target_names=["t00000"]
    )
    there = admin.create_strategy(store, _wf("patch"), StrategyOptions(), target_names=["t00001"])
    admin.apply_strategy(store, missing)
    admin.apply_strategy(store, there)
    monkeypatch.delitem(registry._workflows, "drain-y")
    c = Conductor(store)
    result = asyncio.run(c.run(strategy_ids=[missing, there]))
    assert result == {missing: NOT_DRIVABLE_HERE, there: "complete"}
    shown = queries.get_strategy(store, missing)
    assert (shown["state"], shown["owner"], shown["step_states"]) == (
        "applying",
        None,
        {"initial": 1},
    )


def test_an_empty_file_or_another_programs_database_is_not_a_fleet(
    cli: Cli, tmp_path: Path
) -> None:
    empty = tmp_path / "empty.db"
    empty.touch()
    assert_rejected(cli("target", "list", db=empty), "is an empty file, not a database")
    assert empty.stat().st_size == 0
    other = tmp_path / "other.db"
    with sqlite3.connect(other) as conn:
        conn.execute("CREATE TABLE invoices (id INTEGER PRIMARY KEY)")
    assert_rejected(cli("target", "list", db=other), "SQLite database of something else")
    with sqlite3.connect(other) as conn:
        tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    assert tables == {"invoices"}  # nothing of ours added


def test_filters_naming_nothing_are_refused(cli: Cli) -> None:
    for name in ("a", "b"):
        assert cli("target", "add", name).code == 0
    sid = cli("strategy", "create", "--workflow", "patch", "--targets", "a", "--format", "json")
    sid_ = str(sid.json()["id"])
    assert_rejected(cli("target", "list", "--group", "nosuch"), "--group: no group named")
    assert_rejected(
        cli("step", "list", "--strategy", sid_, "--state", "nosuch"),
        "--state: 'nosuch' is not a state of strategy",
    )
    assert cli("step", "list", "--strategy", sid_, "--state", "pre-check").code == 0
    assert_rejected(
        cli("history", "--strategy", sid_, "--target", "b"),
        f"--target: target 'b' is not in strategy {sid_}",
    )


def test_the_progress_line_counts_aborted_steps(store: Store) -> None:
    add_sim_targets(store, 3)
    sid = admin.create_strategy(store, _wf("patch"), StrategyOptions(), all_targets=True)
    admin.request_abort(store, sid)  # initial: every step aborted at once
    progress = Progress()
    done = asyncio.Event()
    done.set()
    asyncio.run(_watch(store, sid, 3, progress, done))
    (task,) = progress.tasks
    assert task.description == f"strategy {sid} (0 failed, 3 aborted)"
    assert task.completed == 3


FLEETWAVE = [sys.executable, "-m", "fleetwave.cli.main"]


def test_ctrl_c_on_apply_wait_stops_cleanly_and_hands_leases_back(tmp_path: Path) -> None:
    db = str(tmp_path / "f.db")

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*FLEETWAVE, *args, "--db", db], capture_output=True, text=True, timeout=60
        )

    assert run("init").returncode == 0
    for i in range(4):
        assert run("target", "add", f"s{i}", "--set", "latency_ms=2000").returncode == 0
    assert run("strategy", "create", "--workflow", "patch", "--all").returncode == 0
    proc = subprocess.Popen(
        [*FLEETWAVE, "strategy", "apply", "1", "--wait", "--db", db],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        shown = json.loads(run("strategy", "show", "1", "--format", "json").stdout)
        if shown["owner"] is not None:
            break
        time.sleep(0.1)
    proc.send_signal(signal.SIGINT)
    _out, err = proc.communicate(timeout=30)
    assert proc.returncode == 130, err
    assert "stopping: running actions finish" in err
    assert "stopped: strategy 1 is still applying; leases handed back" in err
    shown = json.loads(run("strategy", "show", "1", "--format", "json").stdout)
    assert (shown["state"], shown["owner"]) == ("applying", None)
    assert run("check").returncode == 0


def test_version(cli: Cli) -> None:
    import fleetwave

    res = cli("--version", db=None)
    assert (res.code, res.out.strip()) == (0, f"fleetwave {fleetwave.__version__}")


def test_a_target_held_by_a_strategy_never_applied_says_how_to_free_it(cli: Cli) -> None:
    assert cli("target", "add", "a").code == 0
    first = cli("strategy", "create", "--workflow", "patch", "--all", "--format", "json")
    sid = first.json()["id"]
    assert_rejected(
        cli("strategy", "create", "--workflow", "patch", "--all"),
        f"already in active strategy {sid} (initial); it was never applied: "
        f"'fleetwave strategy delete {sid}' frees its targets",
    )
    assert cli("strategy", "apply", str(sid)).code == 0
    assert_rejected(
        cli("strategy", "create", "--workflow", "patch", "--all"),
        f"already in active strategy {sid} (applying); it frees its targets once it has ended: "
        f"'fleetwave strategy abort {sid}' ends it",
    )


def test_a_timeout_override_has_the_yaml_ceiling(cli: Cli) -> None:
    assert cli("target", "add", "a").code == 0
    res = cli("strategy", "create", "--workflow", "patch", "--all", "--timeout", "pre-check=1e12")
    assert_rejected(res, "--timeout: pre-check: at most 2592000 seconds (30 days), got 1e12")
    ok = cli("strategy", "create", "--workflow", "patch", "--all", "--timeout", "pre-check=1.5e3")
    assert ok.code == 0, ok.text


def test_an_abort_of_a_strategy_no_conductor_can_drive_ends_it(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Left applying by conductors lacking its workflow, it would hold its targets for
    good: once the operator aborts it, the next conductor ends it (aborted)."""
    register_workflow(
        WorkflowDef("drain-z", (StateDef("drain", DriverOperation("drain")),)), replace=True
    )
    add_sim_targets(store, 1)
    sid = admin.create_strategy(store, _wf("drain-z"), StrategyOptions(), all_targets=True)
    admin.apply_strategy(store, sid)
    monkeypatch.delitem(registry._workflows, "drain-z")
    assert asyncio.run(Conductor(store).run(strategy_ids=[sid])) == {sid: NOT_DRIVABLE_HERE}
    admin.request_abort(store, sid)
    assert asyncio.run(Conductor(store).run(strategy_ids=[sid])) == {sid: "aborted"}
    (step,) = queries.list_steps(store, sid)
    assert step["state"] == "aborted"
    assert step["details"].startswith("not started: aborted by operator; cannot drive it here")
    assert check(store, sid).ok
    admin.create_strategy(store, _wf("patch"), StrategyOptions(), all_targets=True)  # freed


def test_apply_wait_refuses_a_yaml_strategy_naming_an_action_this_process_lacks(
    cli: Cli, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from fleetwave.domain.workflow import Advance, StateAction

    class Probe(StateAction):
        async def run(self, ctx: object) -> Advance:  # type: ignore[override]
            return Advance()

    monkeypatch.setitem(registry._actions, "probe-act", Probe)
    wf = tmp_path / "w.yaml"
    wf.write_text("name: uses-probe\nstates:\n  - {name: a, action: 'python:probe-act'}\n")
    assert cli("workflow", "add", str(wf)).code == 0
    assert cli("target", "add", "t1").code == 0
    made = cli("strategy", "create", "--workflow", "uses-probe", "--all", "--format", "json")
    sid = made.json()["id"]
    monkeypatch.delitem(registry._actions, "probe-act")  # another process: no plug-in
    monkeypatch.delenv("FLEETWAVE_PLUGINS", raising=False)
    assert_rejected(
        cli("strategy", "apply", str(sid), "--wait"),
        "action python:probe-act: no action registered under that name",
        # where to look, when no plug-in module is named (found by an acceptance pass)
        "once the module is named in FLEETWAVE_PLUGINS",
    )
    assert cli("strategy", "show", str(sid), "--format", "json").json()["state"] == "initial"


# -- the lease's length ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (("serve", "--lease-ttl", "14"), ["--lease-ttl: must be 15 to 3600 seconds, got 14"]),
        (("serve", "--lease-ttl", "3601"), ["--lease-ttl: must be 15 to 3600 seconds"]),
        (("serve", "--lease-ttl", "nan"), ["--lease-ttl", "got nan"]),
        (("strategy", "apply", "1", "--lease-ttl", "10"), ["--lease-ttl: only with --wait"]),
        (("strategy", "apply", "1", "--wait", "--lease-ttl", "1"), ["--lease-ttl", "got 1"]),
    ],
)
def test_a_lease_length_out_of_range_is_refused_before_anything_changes(
    cli: Cli, args: tuple[str, ...], words: list[str]
) -> None:
    assert cli("target", "add", "a").code == 0
    assert cli("strategy", "create", "--workflow", "patch", "--all").code == 0
    assert_rejected(cli(*args), *words)
    shown = cli("strategy", "show", "1", "--format", "json").json()
    assert (shown["state"], shown["owner"]) == ("initial", None)


def test_a_conductors_leases_last_as_long_as_it_is_told(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Written leases run ``lease_ttl_s`` from each renewal; a long lease is still
    renewed at least every 10 s, so the conductor keeps counting as serving."""
    from fleetwave.engine.clock import LoopClock
    from fleetwave.engine.config import EngineConfig
    from fleetwave.store import runtime as rt

    add_sim_targets(store, 2, {"latency_ms": 45_000})
    wf = registry.get_workflow("patch")
    assert wf is not None
    sid = admin.create_strategy(store, wf, StrategyOptions(), all_targets=True)
    admin.apply_strategy(store, sid)
    renewals: list[tuple[float, float]] = []
    real = rt.heartbeat

    def heartbeat(s: Store, cid: str, now: float, until: float) -> int:
        # (the lease runs on the lease clock: the loop's, here)
        renewals.append((now, until - asyncio.get_running_loop().time()))
        return real(s, cid, now, until)

    monkeypatch.setattr(rt, "heartbeat", heartbeat)

    async def main() -> dict[int, str]:
        config = EngineConfig(lease_ttl_s=600)
        return await Conductor(store, clock=LoopClock(), config=config).run(strategy_ids=[sid])

    assert on_virtual_time(main())[sid] == "complete"
    assert len(renewals) >= 20  # 5 states x 45 s, renewed every 10 s (not every 200 s)
    assert all(left == pytest.approx(600) for _now, left in renewals)
    gaps = [b[0] - a[0] for a, b in itertools.pairwise(renewals)]
    assert max(gaps) <= 11.5, gaps


def test_a_database_locked_by_another_program_is_one_line(
    cli: Cli, db_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A command whose write waited out the busy timeout printed a traceback: one line
    now, saying what holds it up, exit 1; nothing was written."""
    monkeypatch.setattr("fleetwave.store.db.DEFAULT_BUSY_TIMEOUT_MS", 200)
    holder = sqlite3.connect(db_path, isolation_level=None)
    try:
        holder.execute("BEGIN IMMEDIATE")  # another program's write transaction
        res = cli("target", "add", "a")
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    assert res.code == 1, res.text
    assert res.out == ""
    assert res.err.splitlines() == [
        "error: database: database is locked (another program holds its write lock: try "
        "again when it is done); its transaction was rolled back"
    ]
    assert cli("target", "list", "--format", "json").json() == []


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (("serve", "--lease-ttl", "soon"), "'soon' is not a number"),
        (("serve", "--lease-ttl=1e"), "'1e' is not a number"),
        (("demo", "--targets", "ten"), "'ten' is not a whole number"),
        (("demo", "--failure-rate", "x"), "'x' is not a number"),
    ],
)
def test_a_value_that_is_not_a_number_is_named(cli: Cli, args: tuple[str, ...], said: str) -> None:
    """Typer's number check said only 'unable to parse string as a number', at length."""
    option = args[1].split("=")[0]
    line = one_line(cli(*args))
    assert line == f"error: {option}: {said}", line


def test_a_yaml_action_registered_by_a_plugin_is_found(
    cli: Cli, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """`action: python:NAME` of an action a FLEETWAVE_PLUGINS module registers with
    @register_action was refused ("no action registered under that name"): the lookup
    did not load the plug-ins first (an acceptance pass)."""
    (tmp_path / "verify_plugin.py").write_text(
        "from fleetwave import Advance, StateAction\n"
        "from fleetwave.domain.registry import register_action\n"
        "@register_action('acc-verify')\n"
        "class Verify(StateAction):\n"
        "    async def run(self, ctx):\n"
        "        return Advance()\n",
        encoding="utf-8",
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("FLEETWAVE_PLUGINS", "verify_plugin")
    monkeypatch.setattr(registry, "_loaded", False)
    monkeypatch.setattr(registry, "_load_error", None)
    wf = tmp_path / "uses.yaml"
    wf.write_text(
        "name: uses-plugin\nstates:\n  - name: check\n    action: python:acc-verify\n",
        encoding="utf-8",
    )
    res = cli("workflow", "validate", str(wf))
    assert res.code == 0, res.text
