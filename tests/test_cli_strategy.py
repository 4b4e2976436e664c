"""The command line for rollouts: strategies, steps, history, check and the demo.

Every test runs ``fleetwave.cli.main.main`` (the console script's entry point, which turns
bad input into ``error: ...`` and exit code 2) against a real SQLite file in ``tmp_path``,
drives strategies with ``strategy apply --wait`` on simulated targets with no latency, and
checks the outcome through the CLI's own ``--format json`` output.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sqlite3
import time
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy.exc import OperationalError

from cli_harness import PATCH_STATES, Cli, Result, assert_rejected, one_line
from fleetwave.engine.clock import WallClock
from fleetwave.store.leases import host_lease_now
from fleetwave.store.queries import shown_host
from fleetwave.store.runtime import HOSTNAME

#: how a conductor registered by this test process is named for an operator
ON = f"(on {shown_host(HOSTNAME)} pid {os.getpid()})"


def add(cli: Cli, *names: str, **settings: str) -> None:
    """Add sim targets, each with the given settings (``fail_at="pre-check"``)."""
    opts = [x for k, v in settings.items() for x in ("--set", f"{k}={v}")]
    for name in names:
        res = cli("target", "add", name, *opts)
        assert res.code == 0, res.text


def create(cli: Cli, *args: str) -> int:
    res = cli("strategy", "create", "--workflow", "patch", *args, "--format", "json")
    assert res.code == 0, res.text
    created = res.json()
    assert created["state"] == "initial"
    return int(created["id"])


def apply_wait(cli: Cli, sid: int) -> Result:
    return cli("strategy", "apply", str(sid), "--wait", "--format", "json")


def strategies(cli: Cli) -> list[dict[str, Any]]:
    res = cli("strategy", "list", "--format", "json")
    assert res.code == 0, res.text
    return list(res.json())


def steps(cli: Cli, sid: int, *extra: str) -> dict[str, dict[str, Any]]:
    res = cli("step", "list", "--strategy", str(sid), "--format", "json", *extra)
    assert res.code == 0, res.text
    return {s["target"]: s for s in res.json()}


def history(cli: Cli, sid: int, *extra: str) -> list[dict[str, Any]]:
    res = cli("history", "--strategy", str(sid), "--format", "json", *extra)
    assert res.code == 0, res.text
    return list(res.json())


# -- strategy create -----------------------------------------------------------------------


def test_create_makes_an_initial_strategy_with_one_step_per_target(cli: Cli) -> None:
    add(cli, "b", "a", "c")
    res = cli(
        "strategy",
        "create",
        "--workflow",
        "patch",
        "--targets",
        "c,a",
        "--max-parallel",
        "7",
        "--stop-on-failure",
        "--format",
        "json",
    )
    assert res.code == 0, res.text
    s = res.json()
    assert s["workflow"] == "patch"
    assert s["state"] == "initial"
    assert s["steps"] == 2
    assert s["max_parallel"] == 7
    assert s["stop_on_failure"] is True
    assert s["states"] == PATCH_STATES
    assert s["step_states"] == {"initial": 2}

    listed = strategies(cli)
    assert [x["id"] for x in listed] == [s["id"]]
    got = steps(cli, s["id"])
    assert sorted(got) == ["a", "c"]
    assert {x["state"] for x in got.values()} == {"initial"}
    assert all(x["started_at"] is None for x in got.values())


def test_create_table_output_names_the_strategy(cli: Cli) -> None:
    add(cli, "a")
    res = cli("strategy", "create", "--workflow", "patch", "--all")
    assert res.code == 0
    assert res.out.strip() == (
        "strategy 1 created (patch, 1 target, max parallel 20); 'fleetwave strategy apply 1' "
        "starts it"
    )  # how many it picked (a walkthrough: a --label typo picks fewer than meant)


def test_create_by_group_takes_only_that_group(cli: Cli) -> None:
    assert cli("group", "add", "east").code == 0
    assert cli("target", "add", "e1", "--group", "east").code == 0
    assert cli("target", "add", "e2", "--group", "east").code == 0
    add(cli, "x1")
    sid = create(cli, "--group", "east")
    assert sorted(steps(cli, sid)) == ["e1", "e2"]


def test_create_by_label_takes_the_targets_with_every_label(cli: Cli) -> None:
    assert cli("group", "add", "east").code == 0
    for name, group, labels in (
        ("e1", "east", ["region=eu", "tier=canary"]),
        ("e2", "east", ["region=eu"]),
        ("x1", None, ["region=eu", "tier=canary"]),
        ("x2", None, ["region=us", "tier=canary"]),
        ("x3", None, []),
    ):
        args = ["--group", group] if group else []
        for label in labels:
            args += ["--label", label]
        assert cli("target", "add", name, *args).code == 0, name
    listed = cli("target", "list", "--label", "tier=canary", "--format", "json").json()
    assert [t["name"] for t in listed] == ["e1", "x1", "x2"]
    sid = create(cli, "--label", "region=eu", "--label", "tier=canary")  # alone: of all
    assert sorted(steps(cli, sid)) == ["e1", "x1"]
    assert_rejected(
        cli("strategy", "create", "--workflow", "patch", "--group", "east", "--label", "region=eu"),
        "e1",
        "already in active strategy 1",
    )
    sid = create(cli, "--all", "--label", "region=us")
    assert sorted(steps(cli, sid)) == ["x2"]
    # a label with no target, or none in that group: said, nothing created
    before = strategies(cli)
    assert_rejected(
        cli("strategy", "create", "--workflow", "patch", "--label", "region=mars"),
        "--label",
        "no target has region=mars",
    )
    assert_rejected(
        cli("strategy", "create", "--workflow", "patch", "--group", "east", "--label", "tier=x"),
        "--label",
        "of group 'east'",
    )
    assert_rejected(
        cli("strategy", "create", "--workflow", "patch", "--targets", "x3", "--label", "a=b"),
        "--label",
        "not with --targets",
    )
    assert strategies(cli) == before


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--workflow", "nosuch", "--all"], ["unknown workflow 'nosuch'", "patch"]),
        (["--workflow", "patch", "--targets", "a,ghost"], ["--targets", "ghost"]),
        (["--workflow", "patch", "--targets", ","], ["--targets: an empty name in ','"]),
        (["--workflow", "patch", "--targets", "a,b,a"], ["--targets", "'a' given more than once"]),
        (
            ["--workflow", "patch", "--targets", "a,gh1,gh2"],
            ["--targets: no targets named 'gh1', 'gh2'"],
        ),
        (["--workflow", "patch", "--all", "--max-parallel", "0"], ["--max-parallel", "0"]),
        (["--workflow", "patch", "--all", "--max-parallel", "-1"], ["--max-parallel", "-1"]),
        (["--workflow", "patch", "--all", "--max-failures", "-1"], ["--max-failures", "-1"]),
        (["--workflow", "patch"], ["exactly one of", "--targets", "--group", "--all"]),
        (["--workflow", "patch", "--all", "--targets", "a"], ["exactly one of"]),
        (["--workflow", "patch", "--group", "nowhere"], ["--group", "nowhere"]),
        (["--workflow", "patch", "--all", "--timeout", "nosuch=5"], ["timeout", "nosuch"]),
        (["--workflow", "patch", "--all", "--timeout", "pre-check=0"], ["--timeout", "pre-check"]),
        (["--workflow", "patch", "--all", "--timeout", "pre-check=soon"], ["--timeout"]),
        (["--workflow", "patch", "--all", "--timeout", "pre-check"], ["--timeout", "key=value"]),
    ],
)
def test_create_bad_input_is_rejected_and_nothing_written(
    cli: Cli, args: list[str], words: list[str]
) -> None:
    add(cli, "a", "b")
    create(cli, "--targets", "b")  # one strategy already there
    before = strategies(cli)
    assert_rejected(cli("strategy", "create", *args), *words)
    assert strategies(cli) == before
    # and a's step was not created anywhere: a can still go into a new strategy
    create(cli, "--targets", "a")


def test_create_with_no_targets_at_all_is_rejected(cli: Cli) -> None:
    assert_rejected(
        cli("strategy", "create", "--workflow", "patch", "--all"), "--all", "no targets"
    )
    assert strategies(cli) == []


@pytest.mark.parametrize("first_state", ["initial", "applying"])
def test_target_in_another_active_strategy_is_rejected(cli: Cli, first_state: str) -> None:
    add(cli, "a", "b", "c")
    sid = create(cli, "--targets", "a,b")
    if first_state == "applying":  # applied but not driven: stays applying
        assert cli("strategy", "apply", str(sid)).code == 0
    shown = cli("strategy", "show", str(sid), "--format", "json").json()
    assert shown["state"] == first_state
    before = strategies(cli)

    res = cli("strategy", "create", "--workflow", "patch", "--targets", "c,b")
    assert_rejected(res, "target b", f"already in active strategy {sid}")
    assert strategies(cli) == before
    res = cli("strategy", "create", "--workflow", "patch", "--all")
    assert_rejected(res, f"already in active strategy {sid}")
    assert strategies(cli) == before


def test_target_is_free_again_once_its_strategy_ended(cli: Cli) -> None:
    add(cli, "a", latency_ms="0")
    first = create(cli, "--targets", "a")
    assert apply_wait(cli, first).code == 0
    second = create(cli, "--targets", "a")
    assert second != first
    assert apply_wait(cli, second).code == 0
    shown = cli("target", "show", "a", "--format", "json").json()
    steps_of = {s["strategy"]: s["step"] for s in shown["strategies"]}
    assert shown["strategies"] == [
        {
            "strategy": first,
            "strategy_state": "complete",
            "step": steps_of[first],
            "step_state": "complete",
            "details": "",
        },
        {
            "strategy": second,
            "strategy_state": "complete",
            "step": steps_of[second],
            "step_state": "complete",
            "details": "",
        },
    ]


# -- strategy apply --wait -----------------------------------------------------------------


def test_apply_wait_runs_every_step_to_complete_and_exits_0(cli: Cli) -> None:
    add(cli, *(f"site{i:02d}" for i in range(12)), latency_ms="0")
    sid = create(cli, "--all", "--max-parallel", "4")
    res = apply_wait(cli, sid)
    assert res.code == 0, res.text
    summary = res.json()
    assert summary["id"] == sid
    assert summary["state"] == "complete"
    assert summary["step_states"] == {"complete": 12}
    assert summary["owner"] is None  # the lease was handed back

    got = steps(cli, sid)
    assert len(got) == 12
    for s in got.values():
        assert s["state"] == "complete"
        assert s["details"] == ""
        assert s["owner"] is None
        assert s["started_at"] is not None
        assert s["finished_at"] >= s["started_at"]

    listed = strategies(cli)
    assert [(x["id"], x["state"]) for x in listed] == [(sid, "complete")]


def test_apply_wait_table_format(cli: Cli) -> None:
    add(cli, "a", "b")
    sid = create(cli, "--all")
    res = cli("strategy", "apply", str(sid), "--wait")
    assert res.code == 0, res.text
    assert "complete" in res.out
    shown = cli("strategy", "show", str(sid)).out
    assert "complete" in shown


def test_apply_without_wait_only_marks_it_applying(cli: Cli) -> None:
    add(cli, "a")
    sid = create(cli, "--all")
    res = cli("strategy", "apply", str(sid))
    assert res.code == 0
    assert "applying" in res.text
    shown = cli("strategy", "show", str(sid), "--format", "json").json()
    assert shown["state"] == "applying"
    assert shown["step_states"] == {"initial": 1}
    # apply --wait picks it up from there
    assert apply_wait(cli, sid).code == 0
    assert steps(cli, sid)["a"]["state"] == "complete"
    assert cli("strategy", "show", str(sid), "--format", "json").json()["driven_by"] is None


def _conductor_row(db: Path, cid: str, *, serves_all: bool, age_s: float = 0.0) -> None:
    """A conductor as `fleetwave serve` (serves_all) or `apply --wait` registers itself,
    alive in this very process, its last renewal ``age_s`` ago."""
    now = time.time() - age_s
    with sqlite3.connect(db) as conn:
        conn.execute(
            "INSERT INTO conductors (id, hostname, pid, started_at, heartbeat_at, serves_all, "
            "lease_clock) VALUES (?, ?, ?, ?, ?, ?, ?)",
            (cid, HOSTNAME, os.getpid(), now, now, serves_all, WallClock.lease_clock),
        )


@pytest.mark.parametrize(
    ("conductor", "warned", "driven_by"),
    [
        (None, True, "nobody: no conductor serves this database"),
        # apply --wait drives only its own strategy
        ({"serves_all": False}, True, "nobody: no conductor serves this database"),
        # a serve whose renewals stopped long ago is not serving
        ({"serves_all": True, "age_s": 120.0}, True, "nobody: no conductor serves"),
        ({"serves_all": True}, False, f"nobody yet: conductor c-serve {ON} serves this database"),
    ],
    # (not named by driven_by: it holds this process's pid, which differs between
    # pytest-xdist's workers, and they must collect the same tests)
    ids=["no-conductor", "apply-wait-only", "serve-stale", "serve-live"],
)
def test_apply_without_wait_says_when_no_conductor_will_drive_it(
    cli: Cli, db_path: Path, conductor: dict[str, Any] | None, warned: bool, driven_by: str
) -> None:
    """A strategy applied with nobody serving the database would sit `applying` forever:
    the operator is told at once, and `strategy show` says who drives it."""
    if conductor is not None:
        _conductor_row(db_path, "c-serve", **conductor)
    add(cli, "a")
    sid = create(cli, "--all")
    res = cli("strategy", "apply", str(sid))
    assert res.code == 0
    warning = f"warning: no conductor serves {db_path}: strategy {sid} waits until"
    assert (warning in res.err) is warned, res.err
    said = res.out.strip()  # stdout agrees with the warning (found by an acceptance pass)
    if warned:
        assert said == f"strategy {sid} applying; nothing drives it yet", said
    else:
        assert (
            said
            == f"strategy {sid} applying; conductor c-serve {ON} serves this database and claims it"
        ), said
    shown = cli("strategy", "show", str(sid), "--format", "json").json()
    assert shown["driven_by"].startswith(driven_by), shown["driven_by"]


def test_show_names_the_conductor_driving_it_and_a_lapsed_lease(cli: Cli, db_path: Path) -> None:
    add(cli, "a")
    sid = create(cli, "--all")
    _conductor_row(db_path, "c-1", serves_all=False)  # as `apply --wait` registers
    with sqlite3.connect(db_path) as conn:
        conn.execute(
            "UPDATE strategies SET state = 'applying', owner = 'c-1', lease_expires_at = ? "
            "WHERE id = ?",
            (host_lease_now() + 30, sid),
        )

    def driven_by() -> str:
        return str(cli("strategy", "show", str(sid), "--format", "json").json()["driven_by"])

    assert driven_by() == f"conductor c-1 {ON}"  # where to find it: host and process
    # Applied again while that conductor drives it: no warning.
    res = cli("strategy", "apply", str(sid))
    assert res.code == 0 and "warning" not in res.err, res.err

    def lease_ends_in(seconds: float) -> None:
        with sqlite3.connect(db_path) as conn:
            conn.execute(
                "UPDATE strategies SET lease_expires_at = ? WHERE id = ?",
                (host_lease_now() + seconds, sid),
            )

    lease_ends_in(-90)
    said = driven_by()
    assert said.startswith(f"nobody: the lease of conductor c-1 {ON} ran out 9"), said
    assert said.endswith(
        "; no conductor serves this database "
        f"(start 'fleetwave serve', or 'fleetwave strategy apply {sid} --wait')"
    ), said
    _conductor_row(db_path, "c-serve", serves_all=True)
    said = driven_by()
    assert said.startswith(f"nobody yet: the lease of conductor c-1 {ON} ran out 9"), said
    assert said.endswith(f"; conductor c-serve {ON} serves this database and claims it"), said
    # An owner whose process is gone (kill -9): a claim takes the strategy over at once.
    lease_ends_in(30)
    with sqlite3.connect(db_path) as conn:
        conn.execute("UPDATE conductors SET pid = ? WHERE id = 'c-1'", (dead := _no_such_pid(),))
    gone = f"nobody yet: conductor c-1 (on {shown_host(HOSTNAME)} pid {dead}) is gone; "
    assert driven_by().startswith(gone + f"conductor c-serve {ON} serves"), driven_by()


def test_a_stopped_apply_wait_that_does_not_drive_says_who_goes_on(
    cli: Cli, db_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ctrl-C of an `apply --wait` that did not hold the strategy said "another conductor
    drives it on" also when none did (its own claim had failed in an outage): now it says
    who goes on, or that nobody does and how to go on."""
    from fleetwave.cli import drive
    from fleetwave.store import queries
    from fleetwave.store.db import open_store

    add(cli, "a")
    sid = create(cli, "--all")
    _conductor_row(db_path, "c-1", serves_all=False)
    with sqlite3.connect(db_path) as conn:
        conn.execute(
            "UPDATE strategies SET state = 'applying', owner = 'c-1', lease_expires_at = ? "
            "WHERE id = ?",
            (host_lease_now() + 30, sid),
        )
    store = open_store(str(db_path))
    try:
        assert drive.stopping_unheld(store, sid) == (
            f"stopping: this command does not drive strategy {sid}; conductor c-1 drives it on"
        )
        assert drive.stopped_watching(store, sid) == (
            f"stopped: strategy {sid} is still applying; conductor c-1 drives it on"
        )
        with sqlite3.connect(db_path) as conn:  # its lease lapsed (an outage), no serve
            conn.execute("UPDATE strategies SET lease_expires_at = ? WHERE id = ?", (0.0, sid))
        said = drive.stopping_unheld(store, sid)
        assert said.startswith(
            f"stopping: this command does not drive strategy {sid}; nobody drives it: the "
            f"lease of conductor c-1 {ON} ran out"
        ), said
        assert said.endswith(
            "no conductor serves this database (start 'fleetwave serve', or "
            f"'fleetwave strategy apply {sid} --wait')"
        ), said
        assert "another conductor" not in said
        _conductor_row(db_path, "c-serve", serves_all=True)
        said = drive.stopped_watching(store, sid)
        assert said.startswith(f"stopped: strategy {sid} is still applying; the lease of"), said
        assert said.endswith(f"conductor c-serve {ON} serves this database and claims it"), said

        with sqlite3.connect(db_path) as conn:  # it ended meanwhile
            conn.execute("UPDATE strategies SET state = 'complete', owner = NULL")
        assert drive.stopped_watching(store, sid) == (
            f"stopped: strategy {sid} is complete; no conductor needs to drive it now"
        )

        def unavailable(*_: Any, **__: Any) -> Any:
            raise OperationalError("SELECT", None, sqlite3.OperationalError("database is locked"))

        monkeypatch.setattr(queries, "driving", unavailable)
        assert drive.stopping_unheld(store, sid) == (
            f"stopping: this command does not drive strategy {sid}; who drives it could not "
            "be read (the database did not answer)"
        )
        assert drive.stopped_watching(store, sid) == (
            f"stopped: this command did not drive strategy {sid}; its state and who drives "
            "it could not be read (the database did not answer)"
        )
    finally:
        store.dispose()


def _no_such_pid() -> int:
    pid = 4_000_000
    while True:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return pid
        except PermissionError:
            pass
        pid -= 1


def test_apply_wait_exits_1_when_a_step_failed(cli: Cli) -> None:
    add(cli, "good1", "good2")
    add(cli, "broken", fail_at="updating-patches")
    sid = create(cli, "--all")
    res = apply_wait(cli, sid)
    assert res.code == 1, res.text
    summary = res.json()
    assert summary["state"] == "failed"
    assert summary["step_states"] == {"complete": 2, "failed": 1}

    got = steps(cli, sid)
    assert got["broken"]["state"] == "failed"
    assert "updating-patches" in got["broken"]["details"]
    assert got["good1"]["state"] == got["good2"]["state"] == "complete"
    failed_only = steps(cli, sid, "--state", "failed")
    assert list(failed_only) == ["broken"]
    # the failed step never went past the state that failed
    assert [h["to"] for h in history(cli, sid, "--target", "broken")] == [
        "pre-check",
        "updating-patches",
        "failed",
    ]


def test_unmanaged_target_fails_with_the_exact_reason(cli: Cli) -> None:
    add(cli, "ok", "hands-off")
    assert cli("target", "unmanage", "hands-off").code == 0
    sid = create(cli, "--all")
    assert apply_wait(cli, sid).code == 1
    got = steps(cli, sid)
    assert got["hands-off"]["state"] == "failed"
    assert got["hands-off"]["details"] == "Target hands-off is unmanaged."
    assert got["ok"]["state"] == "complete"
    # nothing was done on it: one transition, straight from initial to failed
    assert [(h["from"], h["to"]) for h in history(cli, sid, "--target", "hands-off")] == [
        ("initial", "failed")
    ]


def test_unmanaged_at_add_time_also_fails(cli: Cli) -> None:
    assert cli("target", "add", "u", "--unmanaged").code == 0
    sid = create(cli, "--all")
    assert apply_wait(cli, sid).code == 1
    assert steps(cli, sid)["u"]["details"] == "Target u is unmanaged."


def test_already_done_target_completes_as_skipped(cli: Cli) -> None:
    add(cli, "fresh")
    add(cli, "patched", already_done="true")
    sid = create(cli, "--all")
    assert apply_wait(cli, sid).code == 0
    got = steps(cli, sid)
    assert got["patched"]["state"] == "complete"
    assert "skipped" in got["patched"]["details"]
    assert "already done" in got["patched"]["details"]
    assert got["fresh"]["details"] == ""
    assert [h["to"] for h in history(cli, sid, "--target", "patched")] == ["pre-check", "complete"]


def test_stop_on_failure_aborts_the_rest(cli: Cli) -> None:
    add(cli, "a-first", fail_at="pre-check")
    add(cli, "b", "c", "d")
    sid = create(cli, "--all", "--max-parallel", "1", "--stop-on-failure")
    res = apply_wait(cli, sid)
    assert res.code == 1
    summary = res.json()
    assert summary["state"] == "failed"
    assert "stop on failure" in summary["details"]
    got = steps(cli, sid)
    assert got["a-first"]["state"] == "failed"
    for name in ("b", "c", "d"):
        assert got[name]["state"] == "aborted", got[name]
        assert got[name]["details"].startswith("not started")
        assert got[name]["started_at"] is None
    # none of the others ever entered a workflow state
    assert {(h["from"], h["to"]) for h in history(cli, sid) if h["target"] != "a-first"} == {
        ("initial", "aborted")
    }
    assert cli("check", "--strategy", str(sid)).code == 0


def test_without_stop_on_failure_the_rest_still_runs(cli: Cli) -> None:
    add(cli, "a-first", fail_at="pre-check")
    add(cli, "b", "c")
    sid = create(cli, "--all", "--max-parallel", "1")
    assert apply_wait(cli, sid).code == 1
    got = steps(cli, sid)
    assert got["a-first"]["state"] == "failed"
    assert got["b"]["state"] == got["c"]["state"] == "complete"


def test_max_failures_stops_once_exceeded(cli: Cli) -> None:
    add(cli, "a1", "a2", "a3", fail_at="finishing")
    add(cli, "b1", "b2")
    sid = create(cli, "--all", "--max-parallel", "1", "--max-failures", "1")
    res = apply_wait(cli, sid)
    assert res.code == 1
    assert res.json()["state"] == "failed"
    got = steps(cli, sid)
    assert [got[n]["state"] for n in ("a1", "a2", "a3", "b1", "b2")] == [
        "failed",
        "failed",
        "aborted",
        "aborted",
        "aborted",
    ]
    assert cli("check", "--strategy", str(sid)).code == 0


def test_timeout_override_fails_a_hanging_step(cli: Cli, tmp_path: Path) -> None:
    wf = tmp_path / "one.yaml"
    wf.write_text("name: one\nstates:\n  - name: only\n", encoding="utf-8")
    assert cli("workflow", "add", str(wf)).code == 0
    add(cli, "stuck", hang_rate="1")
    add(cli, "fine")
    res = cli(
        "strategy",
        "create",
        "--workflow",
        "one",
        "--all",
        "--timeout",
        "only=0.05",
        "--format",
        "json",
    )
    assert res.code == 0, res.text
    assert res.json()["options"]["timeouts_s"] == {"only": 0.05}
    sid = res.json()["id"]
    assert apply_wait(cli, sid).code == 1
    got = steps(cli, sid)
    assert got["stuck"]["state"] == "failed"
    assert "timed out after 0.05s" in got["stuck"]["details"]
    assert got["fine"]["state"] == "complete"


def test_apply_of_unknown_or_finished_strategy_is_rejected(cli: Cli) -> None:
    assert_rejected(cli("strategy", "apply", "99", "--wait"), "strategy 99", "not found")
    add(cli, "a")
    sid = create(cli, "--all")
    assert apply_wait(cli, sid).code == 0
    assert_rejected(cli("strategy", "apply", str(sid)), f"strategy {sid}", "complete")
    assert cli("strategy", "show", str(sid), "--format", "json").json()["state"] == "complete"


# -- abort / delete ------------------------------------------------------------------------


def test_abort_of_an_initial_strategy_aborts_every_step(cli: Cli) -> None:
    add(cli, "a", "b", "c")
    sid = create(cli, "--all")
    res = cli("strategy", "abort", str(sid))
    assert res.code == 0, res.text
    shown = cli("strategy", "show", str(sid), "--format", "json").json()
    assert shown["state"] == "aborted"
    assert shown["step_states"] == {"aborted": 3}
    got = steps(cli, sid)
    assert {s["state"] for s in got.values()} == {"aborted"}
    assert [(h["target"], h["from"], h["to"]) for h in history(cli, sid)] == [
        ("a", "initial", "aborted"),
        ("b", "initial", "aborted"),
        ("c", "initial", "aborted"),
    ]
    assert cli("check").code == 0
    # it is over: it cannot be applied again; an abort asked again says it is done (no
    # error: a script may ask twice) and changes nothing; its targets are free
    assert_rejected(cli("strategy", "apply", str(sid)), "aborted")
    again = cli("strategy", "abort", str(sid))
    assert (again.code, again.out) == (0, f"strategy {sid}: already aborted\n"), again.text
    assert len(history(cli, sid)) == 3
    create(cli, "--all")


def test_pause_and_resume(cli: Cli) -> None:
    add(cli, "a", "b")
    sid = create(cli, "--all")
    # only an applying strategy can be paused; only a paused one resumed
    assert_rejected(cli("strategy", "pause", str(sid)), f"strategy {sid}", "initial", "apply")
    assert_rejected(cli("strategy", "resume", str(sid)), f"strategy {sid}", "initial")
    assert_rejected(cli("strategy", "pause", "99"), "strategy 99 not found")
    assert cli("strategy", "apply", str(sid)).code == 0
    res = cli("strategy", "pause", str(sid))
    assert res.code == 0, res.text
    assert "paused" in res.out and f"fleetwave strategy resume {sid}" in res.out
    assert "already paused" in cli("strategy", "pause", str(sid)).out
    shown = cli("strategy", "show", str(sid), "--format", "json").json()
    assert shown["state"] == "paused"
    # a paused strategy keeps its targets, and cannot be deleted
    assert_rejected(cli("strategy", "create", "--workflow", "patch", "--all"), "a")
    assert_rejected(cli("strategy", "delete", str(sid)), f"strategy {sid}")
    res = cli("strategy", "resume", str(sid))
    assert res.code == 0 and "resumed" in res.out, res.text
    assert "not paused" in cli("strategy", "resume", str(sid)).out
    assert cli("strategy", "pause", str(sid)).code == 0
    # apply resumes a paused strategy too (apply --wait drives it as it is, paused:
    # tests/test_strategy_commands.py), and --wait drives it to the end
    assert "(resumed: it was paused)" in cli("strategy", "apply", str(sid)).out
    res = apply_wait(cli, sid)
    assert res.code == 0, res.text
    assert res.json()["state"] == "complete"
    assert_rejected(cli("strategy", "pause", str(sid)), "complete")


def test_abort_of_an_applying_strategy_then_drive_ends_aborted(cli: Cli) -> None:
    add(cli, "a", "b")
    sid = create(cli, "--all")
    assert cli("strategy", "apply", str(sid)).code == 0
    assert cli("strategy", "abort", str(sid)).code == 0
    shown = cli("strategy", "show", str(sid), "--format", "json").json()
    assert shown["state"] == "abort-requested"
    # cannot delete it while the abort is pending
    assert_rejected(cli("strategy", "delete", str(sid)), f"strategy {sid}")
    res = apply_wait(cli, sid)
    assert res.code == 1
    assert res.json()["state"] == "aborted"
    assert {s["state"] for s in steps(cli, sid).values()} == {"aborted"}
    assert cli("check").code == 0


def test_abort_of_unknown_strategy_is_rejected(cli: Cli) -> None:
    assert_rejected(cli("strategy", "abort", "42"), "strategy 42", "not found")


def test_delete_strategy_moves_its_steps_out_and_keeps_its_history(cli: Cli, db_path: Path) -> None:
    add(cli, "a", "b")
    keep = create(cli, "--targets", "a")
    gone = create(cli, "--targets", "b")
    assert apply_wait(cli, gone).code == 0
    # a target with steps cannot be deleted while its strategy has them
    assert_rejected(cli("target", "delete", "b"), "target b", "history")

    res = cli("strategy", "delete", str(gone))
    assert res.code == 0, res.text
    assert "history is kept" in res.out
    assert [s["id"] for s in strategies(cli)] == [keep]  # a list leaves deleted ones out
    shown = cli("strategy", "show", str(gone), "--format", "json").json()
    assert shown["state"] == "deleted" and shown["deleted_from"] == "complete"
    assert shown["step_states"] == {"complete": 1}
    assert [
        s["target"] for s in cli("step", "list", "--strategy", str(gone), "--format", "json").json()
    ] == ["b"]
    assert len(cli("history", "--strategy", str(gone), "--format", "json").json()) == 6
    with sqlite3.connect(db_path) as conn:
        assert (
            conn.execute("SELECT count(*) FROM steps WHERE strategy_id=?", (gone,)).fetchone()[0]
            == 0
        )
    assert cli("target", "delete", "b").code == 0  # its history names it still
    assert {
        r["target"] for r in cli("history", "--strategy", str(gone), "--format", "json").json()
    } == {"b"}
    # an initial strategy can be deleted too, which frees its targets
    assert cli("strategy", "delete", str(keep)).code == 0
    assert strategies(cli) == []
    create(cli, "--targets", "a")
    assert cli("check").code == 0


def _rows_of(db_path: Path, sid: int) -> dict[str, int]:
    with sqlite3.connect(db_path) as conn:
        return {
            table: conn.execute(
                f"SELECT count(*) FROM {table} WHERE strategy_id = ?", (sid,)
            ).fetchone()[0]
            for table in ("journal", "events", "callbacks", "steps", "deleted_steps")
        }


def test_delete_goes_in_chunks_and_keeps_the_callbacks(
    cli: Cli, db_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A big strategy's steps move a chunk per transaction (the write lock is held for
    milliseconds at a time, not seconds); its journal, events and callbacks stay."""
    add(cli, *(f"t{i}" for i in range(12)))
    gone = create(cli, "--all")
    assert apply_wait(cli, gone).code == 0
    with sqlite3.connect(db_path) as conn:  # a late callback, answered "strategy ended"
        conn.execute(
            "INSERT INTO callbacks (strategy_id, step_id, state, kind, details, received_at, "
            "outcome, reason, processed_at) VALUES (?, 1, 'finishing', 'done', '', 0, "
            "'ignored', 'late', 0)",
            (gone,),
        )
    before = _rows_of(db_path, gone)
    assert before["journal"] == 12 * 6 and before["steps"] == 12 and before["callbacks"] == 1
    from fleetwave.store import admin

    monkeypatch.setattr(admin, "DELETE_CHUNK", 5)
    writes = {"n": 0}
    real_write = admin.Store.write

    def counting_write(self: Any) -> Any:
        writes["n"] += 1
        return real_write(self)

    monkeypatch.setattr(admin.Store, "write", counting_write)
    res = cli("strategy", "delete", str(gone))
    assert res.code == 0, res.text
    assert _rows_of(db_path, gone) == before | {"steps": 0, "deleted_steps": 12}
    # mark, 3 chunks of steps (5, 5, 2), the slots and the deleted mark
    assert writes["n"] == 1 + 3 + 1


def test_an_interrupted_delete_is_finished_by_deleting_again(
    cli: Cli, db_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ctrl-C (or a crash) half-way: the strategy stays 'deleting', check does not judge
    its half-moved steps, apply and abort refuse it, and delete finishes it."""
    add(cli, *(f"t{i}" for i in range(8)))
    sid = create(cli, "--all")
    assert apply_wait(cli, sid).code == 0
    from fleetwave.store import admin

    monkeypatch.setattr(admin, "DELETE_CHUNK", 5)
    real_archive = admin._archive_steps
    chunks = {"n": 0}

    def interrupted(conn: Any, sid: int, chunk: int) -> int:
        chunks["n"] += 1
        if chunks["n"] == 2:
            raise KeyboardInterrupt  # after the first chunk was committed
        return real_archive(conn, sid, chunk)

    monkeypatch.setattr(admin, "_archive_steps", interrupted)
    res = cli("strategy", "delete", str(sid))
    assert res.code == 130, res.text  # interrupted
    monkeypatch.undo()
    assert [s["state"] for s in strategies(cli)] == ["deleting"]
    assert _rows_of(db_path, sid)["steps"] == 3 and _rows_of(db_path, sid)["journal"] == 48
    # its history answers whole meanwhile, by the working and the kept steps
    names = {r["target"] for r in cli("history", "--strategy", str(sid), "--format", "json").json()}
    assert names == {f"t{i}" for i in range(8)}

    res = cli("check")
    assert res.code == 0, res.text  # the half-moved steps are not judged
    assert f"not checked: strategy {sid} is being deleted" in res.text
    assert cli("check", "--format", "json").json()["not_checked_being_deleted"] == [sid]
    assert_rejected(cli("check", "--strategy", str(sid)), f"strategy {sid}", "being deleted")
    assert_rejected(cli("strategy", "apply", str(sid)), f"strategy {sid}", "being deleted")
    assert_rejected(cli("strategy", "abort", str(sid)), f"strategy {sid}", "deleting")

    assert cli("strategy", "delete", str(sid)).code == 0
    assert strategies(cli) == []
    assert _rows_of(db_path, sid) | {"events": 0} == {
        "journal": 48, "events": 0, "callbacks": 0, "steps": 0, "deleted_steps": 8
    }  # fmt: skip
    assert cli("check", "--strategy", str(sid)).code == 0


def test_delete_of_applying_strategy_is_rejected(cli: Cli) -> None:
    add(cli, "a")
    sid = create(cli, "--all")
    assert cli("strategy", "apply", str(sid)).code == 0
    assert_rejected(cli("strategy", "delete", str(sid)), f"strategy {sid}", "applying")
    assert [s["state"] for s in strategies(cli)] == ["applying"]
    assert_rejected(cli("target", "delete", "a"), "target a", f"active strategy {sid}")


# -- steps, history ------------------------------------------------------------------------


def test_step_show_has_the_steps_journal_in_order(cli: Cli) -> None:
    add(cli, "a")
    add(cli, "z-bad", fail_at="creating-remote-patch-strategy")
    sid = create(cli, "--all")
    assert apply_wait(cli, sid).code == 1
    got = steps(cli, sid)

    res = cli("step", "show", str(got["a"]["step"]), "--format", "json")
    assert res.code == 0, res.text
    step = res.json()
    assert step["target"] == "a"
    assert step["strategy"] == sid
    assert step["state"] == "complete"
    assert step["owner"] is None
    assert step["deadline_at"] is None  # terminal: nothing left to time out
    assert step["not_started"] is False
    assert [h["to"] for h in step["history"]] == [*PATCH_STATES, "complete"]
    assert {h["target"] for h in step["history"]} == {"a"}

    bad = cli("step", "show", str(got["z-bad"]["step"]), "--format", "json").json()
    assert bad["state"] == "failed"
    assert [h["to"] for h in bad["history"]] == [*PATCH_STATES[:3], "failed"]
    assert bad["history"][-1]["details"] == bad["details"]
    assert "creating-remote-patch-strategy" in bad["details"]

    table = cli("step", "show", str(got["a"]["step"]))
    assert table.code == 0
    assert "finishing" in table.out
    assert_rejected(cli("step", "show", "9999"), "step 9999", "not found")


def test_step_list_of_unknown_strategy_is_rejected(cli: Cli) -> None:
    assert_rejected(cli("step", "list", "--strategy", "5"), "strategy 5")


def test_history_lists_each_steps_transitions_in_order(cli: Cli) -> None:
    names = ["s1", "s2", "s3", "s4"]
    add(cli, *names)
    sid = create(cli, "--all", "--max-parallel", "2")
    assert apply_wait(cli, sid).code == 0
    rows = history(cli, sid)
    assert len(rows) == len(names) * (len(PATCH_STATES) + 1)
    for name in names:
        mine = [r for r in rows if r["target"] == name]
        assert [r["from"] for r in mine] == ["initial", *PATCH_STATES]
        assert [r["to"] for r in mine] == [*PATCH_STATES, "complete"]
        assert len({r["step"] for r in mine}) == 1
        assert all(r["conductor"] for r in mine)

    only = history(cli, sid, "--target", "s3")
    assert only == [r for r in rows if r["target"] == "s3"]
    assert history(cli, sid, "--target", "s3") != history(cli, sid, "--target", "s2")


def test_history_last_shows_the_latest_transitions_oldest_first(
    cli: Cli, monkeypatch: pytest.MonkeyPatch
) -> None:
    """At 3 a.m. the end of the journal is what matters: --last N, in order, also over
    page boundaries and with --target; nothing is read before the start."""
    from fleetwave.store import queries

    monkeypatch.setattr(queries.common, "PAGE_ROWS", 4)  # the last N span several pages
    add(cli, "s1", "s2", "s3")
    sid = create(cli, "--all", "--max-parallel", "1")
    assert apply_wait(cli, sid).code == 0
    rows = history(cli, sid)
    assert history(cli, sid, "--last", "7") == rows[-7:]
    assert history(cli, sid, "--last", "1") == rows[-1:]
    assert history(cli, sid, "--last", "1000") == rows
    mine = [r for r in rows if r["target"] == "s2"]
    assert history(cli, sid, "--target", "s2", "--last", "2") == mine[-2:]
    assert_rejected(cli("history", "--strategy", str(sid), "--last", "0"), "--last", "at least 1")


def test_history_of_a_target_outside_the_strategy_is_refused(cli: Cli) -> None:
    add(cli, "in", "out")
    sid = create(cli, "--targets", "in")
    assert apply_wait(cli, sid).code == 0
    assert_rejected(
        cli("history", "--strategy", str(sid), "--target", "out"),
        f"--target: target 'out' is not in strategy {sid}",
    )
    assert_rejected(cli("history", "--strategy", str(sid), "--target", "ghost"), "ghost")


def test_history_table_format(cli: Cli) -> None:
    add(cli, "a")
    sid = create(cli, "--all")
    assert apply_wait(cli, sid).code == 0
    res = cli("history", "--strategy", str(sid))
    assert res.code == 0
    for state in PATCH_STATES:
        assert state in res.out


# -- check ---------------------------------------------------------------------------------


def _run_mixed(cli: Cli) -> int:
    add(cli, "ok1", "ok2")
    add(cli, "bad", fail_at="updating-patches")
    add(cli, "done", already_done="true")
    sid = create(cli, "--all")
    assert apply_wait(cli, sid).code == 1
    return sid


def _step_id(cli: Cli, sid: int, target: str) -> int:
    return int(steps(cli, sid)[target]["step"])


def test_check_is_ok_after_a_run(cli: Cli) -> None:
    sid = _run_mixed(cli)
    res = cli("check")
    assert res.code == 0, res.text
    assert "ok" in res.out
    assert "checked 1 strategy, 4 steps" in res.text

    res = cli("check", "--format", "json")
    assert res.code == 0
    verdict = res.json()
    assert verdict["ok"] is True
    assert verdict["violations"] == []
    assert verdict["strategies"] == 1
    assert verdict["steps"] == 4
    assert verdict["transitions"] == len(history(cli, sid))

    res = cli("check", "--strategy", str(sid), "--format", "json")
    assert res.code == 0
    assert res.json()["ok"] is True


def test_check_of_unknown_strategy_is_rejected(cli: Cli) -> None:
    assert_rejected(cli("check", "--strategy", "77"), "strategy 77", "not found")


def test_check_finds_a_transition_from_the_wrong_state(cli: Cli, db_path: Path) -> None:
    sid = _run_mixed(cli)
    step = _step_id(cli, sid, "ok1")
    with sqlite3.connect(db_path) as conn:
        n = conn.execute(
            "UPDATE journal SET from_state='finishing' WHERE step_id=? AND to_state=?",
            (step, "updating-patches"),
        ).rowcount
        assert n == 1

    res = cli("check")
    assert res.code == 1
    assert "G3" in res.text
    assert "ok1" in res.text
    assert "FAILED" in res.text

    res = cli("check", "--format", "json")
    assert res.code == 1
    verdict = res.json()
    assert verdict["ok"] is False
    assert any(v.startswith("G3") and "ok1" in v for v in verdict["violations"])


def test_check_finds_a_move_out_of_a_terminal_state(cli: Cli, db_path: Path) -> None:
    sid = _run_mixed(cli)
    step = _step_id(cli, sid, "bad")  # initial -> pre-check -> updating-patches -> failed
    with sqlite3.connect(db_path) as conn:
        conn.execute(
            "INSERT INTO journal (strategy_id, step_id, at, conductor, from_state, to_state, "
            "fence, details) VALUES (?, ?, 9e9, 'rogue', 'failed', 'finishing', 1, '')",
            (sid, step),
        )

    res = cli("check", "--strategy", str(sid), "--format", "json")
    assert res.code == 1
    verdict = res.json()
    assert verdict["ok"] is False
    assert any(v.startswith("G8") and "bad" in v for v in verdict["violations"])
    assert "G8" in cli("check").text


def test_journal_refuses_a_state_entered_twice(cli: Cli, db_path: Path) -> None:
    sid = _run_mixed(cli)
    step = _step_id(cli, sid, "ok2")
    # G1 is in the database itself: the unique key on (step, to_state) refuses a second entry
    with sqlite3.connect(db_path) as conn, pytest.raises(sqlite3.IntegrityError):
        conn.execute(
            "INSERT INTO journal (strategy_id, step_id, at, conductor, from_state, "
            "to_state, fence, details) VALUES (?, ?, 9e9, 'rogue', 'pre-check', "
            "'updating-patches', 1, '')",
            (sid, step),
        )
    res = cli("check", "--format", "json")
    assert res.code == 0
    assert res.json()["ok"] is True


# -- demo ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("workflow", "remote"),
    [("sw-deploy", "deploy-activate-failed"), ("firmware", "fw-update-partial")],
)
def test_the_demos_odd_remote_state_is_the_workflows_own(
    cli: Cli, tmp_path: Path, workflow: str, remote: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Found by an acceptance pass: the target the demo leaves in a state its workflow
    does not know reported the patch workflow's 'ready-to-apply-partial' whatever the
    workflow rolled out."""
    res = cli(
        "demo",
        *("--targets", "12", "--latency-ms", "0", "--workflow", workflow),
        *("--format", "json", "--db", str(tmp_path / "demo.db")),
        db=None,
    )
    assert res.code == 0, res.text
    reasons = [f["details"] for f in res.json()["failures"]]
    assert any(f"unexpected remote state '{remote}'" in r for r in reasons), reasons
    assert not any("ready-to-apply-partial" in r for r in reasons), reasons
    # its summary lists the failures: the log does not as well (only below warning level)
    assert [r for r in caplog.records if r.name == "fleetwave.engine.outcomes"] == []
    assert logging.getLogger("fleetwave.engine.outcomes").level == logging.NOTSET


@pytest.mark.parametrize(("workflow", "skipper"), [("patch", "pre-check"), ("clean", None)])
def test_the_demo_makes_targets_already_done_only_where_its_workflow_skips_them(
    cli: Cli, tmp_path: Path, workflow: str, skipper: str | None
) -> None:
    """An operator walkthrough: `demo --workflow clean` said "5 targets already patched
    (they skip)", then "of which skipped (already done) 0": clean has no state that
    skips a target already done."""
    res = cli(
        "demo",
        *("--targets", "200", "--latency-ms", "0", "--workflow", workflow),
        *("--db", str(tmp_path / "demo.db")),
        db=None,
    )
    assert res.code == 0, res.text
    (purpose,) = [x for x in res.out.splitlines() if x.startswith("on purpose: ")]
    (skipped,) = [x for x in res.out.splitlines() if "of which skipped" in x]
    if skipper is None:
        assert "already" not in purpose, purpose
        assert skipped.split()[-1] == "0", skipped
    else:
        said = purpose.split("already done")[0].split(", ")[-1]  # "6 targets "
        n = int(said.split()[0])
        assert n > 0 and f"already done ({skipper} skips them)" in purpose, purpose
        assert skipped.split()[-1] == str(n), skipped


def test_demo_json_summary(cli: Cli, tmp_path: Path) -> None:
    demo_db = tmp_path / "demo.db"
    res = cli(
        "demo",
        "--targets",
        "200",
        "--max-parallel",
        "50",
        "--latency-ms",
        "0",
        "--format",
        "json",
        "--db",
        str(demo_db),
        db=None,
    )
    assert res.code == 0, res.text
    s = res.json()
    for key in (
        "targets",
        "complete",
        "failed",
        "aborted",
        "transitions",
        "wall_s",
        "transitions_per_s",
        "check",
    ):
        assert key in s, key
    assert s["targets"] == 200
    assert s["check"] == {"ok": True, "violations": []}
    assert s["complete"] + s["failed"] + s["aborted"] == 200
    assert s["complete"] > 150
    # the demo always plants one unmanaged target and one odd remote state
    reasons = [f["details"] for f in s["failures"]]
    assert any(r.endswith("is unmanaged.") for r in reasons)
    assert any("unexpected remote state" in r for r in reasons)
    assert s["failed"] == len(s["failures"])
    assert s["transitions"] > 200
    assert s["wall_s"] > 0

    # the demo database is an ordinary one: the other commands read it
    assert demo_db.is_file()
    listed = cli("target", "list", "--format", "json", db=demo_db).json()
    assert len(listed) == 200
    assert cli("check", db=demo_db).code == 0
    assert (
        len(cli("history", "--strategy", str(s["strategy"]), "--format", "json", db=demo_db).json())
        == s["transitions"]
    )


def test_demo_table_output(cli: Cli, tmp_path: Path) -> None:
    res = cli(
        "demo", "--targets", "20", "--latency-ms", "0", "--db", str(tmp_path / "d.db"), db=None
    )
    assert res.code == 0, res.text
    assert "fleetwave check: ok" in res.text


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--targets", "0"], ["--targets", "0"]),
        (["--targets", "-5"], ["--targets"]),
        (["--max-parallel", "0"], ["--max-parallel"]),
        (["--failure-rate", "1.5"], ["--failure-rate"]),
        (["--latency-ms", "-1"], ["--latency-ms"]),
    ],
)
def test_demo_bad_input_is_rejected_and_creates_no_database(
    cli: Cli, tmp_path: Path, args: list[str], words: list[str]
) -> None:
    demo_db = tmp_path / "demo.db"
    res = cli("demo", *args, "--format", "json", "--db", str(demo_db), db=None)
    assert_rejected(res, *words)
    assert res.out == ""
    assert not demo_db.exists()


def test_demo_refuses_an_existing_database(cli: Cli, db_path: Path) -> None:
    add(cli, "precious")
    res = cli("demo", "--targets", "5", "--db", str(db_path), db=None)
    assert_rejected(res, "--db", "already exists")
    assert list(cli("target", "list", "--format", "json").json()) == [
        {
            "name": "precious",
            "group": None,
            "driver": "sim",
            "managed": True,
            "settings": {},
            "labels": {},
        }
    ]


def test_demo_unknown_workflow_creates_no_database(cli: Cli, tmp_path: Path) -> None:
    demo_db = tmp_path / "demo.db"
    res = cli("demo", "--workflow", "nosuch", "--targets", "5", "--db", str(demo_db), db=None)
    assert_rejected(res, "nosuch")
    assert not demo_db.exists()


def test_apply_after_an_abort_says_it_does_not_undo_it(cli: Cli) -> None:
    add(cli, "a")
    sid = create(cli, "--all")
    assert cli("strategy", "apply", str(sid)).code == 0
    assert cli("strategy", "abort", str(sid)).code == 0
    res = cli("strategy", "apply", str(sid))
    assert res.code == 0
    assert " ".join(res.out.split()) == (
        f"strategy {sid} abort-requested (apply does not undo an abort: a conductor "
        "finishes it); nothing drives it yet"
    )
    assert cli("strategy", "show", str(sid), "--format", "json").json()["state"] == (
        "abort-requested"
    )


def test_a_callback_stored_while_its_strategy_is_deleted_is_kept_closed(
    cli: Cli, db_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An agent's callback stored while its strategy is being deleted: once its step
    has moved out none can be stored, and one stored before is kept with the history,
    closed as ignored ("strategy deleted"): no conductor handles it any more."""
    import time as _time

    from fleetwave.domain.errors import NotFound
    from fleetwave.store import admin
    from fleetwave.store.callbacks import accept_callback

    add(cli, "a", "b")
    sid = create(cli, "--all")  # never applied: its steps are not terminal
    step = _step_id(cli, sid, "a")
    real_write = admin.Store.write
    writes = {"n": 0}

    @contextlib.contextmanager
    def write(self: Any) -> Any:
        with real_write(self) as conn:
            yield conn
        if writes["n"] < 0:
            return  # the callback's own transaction
        writes["n"] += 1
        # after each transaction of the delete, an agent calls back for the step
        writes["n"] = -writes["n"]
        with contextlib.suppress(NotFound):  # once the step is gone: refused
            accept_callback(self, step, "pre-check", "done", "", _time.time())
        writes["n"] = -writes["n"]

    monkeypatch.setattr(admin.Store, "write", write)
    assert cli("strategy", "delete", str(sid)).code == 0
    monkeypatch.undo()
    with sqlite3.connect(db_path) as conn:
        assert conn.execute("SELECT outcome, reason FROM callbacks").fetchall() == [
            ("ignored", "strategy deleted")
        ]


def test_many_unknown_or_repeated_targets_are_named_a_few_at_a_time(cli: Cli) -> None:
    add(cli, "a")
    ghosts = ",".join(f"g{i}" for i in range(8))
    line = one_line(cli("strategy", "create", "--workflow", "patch", "--targets", f"a,{ghosts}"))
    assert "'g0', 'g1', 'g2', 'g3', 'g4' (and 3 more)" in line, line
    twice = "a," * 3 + "b,b"
    add(cli, "b")
    line = one_line(cli("strategy", "create", "--workflow", "patch", "--targets", twice))
    assert "--targets: 'a', 'b' given more than once" in line, line
    assert strategies(cli) == []
    # spaces around names are not part of them (an empty name is refused: a variable
    # that expanded to nothing, as the filters of step list and history refuse it)
    create(cli, "--targets", " a , b")


def test_targets_with_a_repeat_and_an_unknown_name_name_both(cli: Cli) -> None:
    add(cli, "a")
    line = one_line(cli("strategy", "create", "--workflow", "patch", "--targets", "a,nope,a"))
    assert "--targets: 'a' given more than once; no target named 'nope'" in line, line
    assert strategies(cli) == []


def test_a_conflict_names_every_held_target_by_strategy(cli: Cli) -> None:
    add(cli, "a", "b", "c", "d", "e", "f", "g", "h", "i")
    first = create(cli, "--targets", "a,b,c,d,e,f,g")
    second = create(cli, "--targets", "h")
    assert cli("strategy", "apply", str(second)).code == 0
    line = one_line(cli("strategy", "create", "--workflow", "patch", "--all"))
    assert (
        f"7 targets (a, b, c, d, e and 2 more): already in active strategy {first} "
        f"(initial); it was never applied: 'fleetwave strategy delete {first}' frees its "
        f"targets; target h: already in active strategy {second} (applying); it frees its "
        f"targets once it has ended: 'fleetwave strategy abort {second}' ends it"
    ) in line, line
    assert [s["id"] for s in strategies(cli)] == [first, second]  # nothing written


def test_step_list_takes_one_target_like_history(cli: Cli) -> None:
    add(cli, "a", "b", "c")
    sid = create(cli, "--targets", "a,b")
    res = cli("step", "list", "--strategy", str(sid), "--target", "b", "--format", "json")
    assert res.code == 0, res.text
    assert [s["target"] for s in res.json()] == ["b"]
    assert_rejected(
        cli("step", "list", "--strategy", str(sid), "--target", "c"),
        f"--target: target 'c' is not in strategy {sid}",
    )
    assert_rejected(
        cli("step", "list", "--strategy", str(sid), "--target", "nope"),
        "--target: no target named 'nope'",
    )


def test_apply_without_wait_answers_in_json_and_resume_and_abort_warn_when_undriven(
    cli: Cli, db_path: Path
) -> None:
    """apply --format json printed text; resume, and an abort asked again, said nothing
    of nobody being there to act on them (apply and a first abort warned)."""
    add(cli, "a")
    sid = create(cli, "--all")
    res = cli("strategy", "apply", str(sid), "--format", "json")
    assert res.code == 0
    answer = res.json()
    assert (answer["id"], answer["state"], answer["was"]) == (sid, "applying", "initial")
    # the same words as strategy show (it said "nothing drives it yet" there)
    shown = cli("strategy", "show", str(sid), "--format", "json").json()
    assert answer["driven_by"] == shown["driven_by"]
    assert answer["driven_by"].startswith("nobody: no conductor serves this database")
    assert "warning: no conductor serves" in res.err
    assert cli("strategy", "pause", str(sid)).code == 0
    res = cli("strategy", "resume", str(sid))
    assert res.code == 0
    assert res.err.strip() == (
        f"warning: no conductor serves {db_path}: strategy {sid} goes on once 'fleetwave "
        f"serve' runs (or drive it here: 'fleetwave strategy apply {sid} --wait')"
    ), res.err
    for _ in range(2):
        res = cli("strategy", "abort", str(sid))
        assert res.code == 0
        assert res.err.startswith(
            f"warning: no conductor serves {db_path}: the abort of strategy {sid} finishes"
        ), res.err


def test_json_field_names_follow_the_readmes_rule(cli: Cli) -> None:
    """The README's rule for JSON field names, over every command that shows a
    strategy, a step or a target: a strategy's own id is `id`, a step's `step`, a
    target's `name`; another object's state is prefixed with whose it is."""
    add(cli, "a", "b")
    sid = create(cli, "--all")
    assert apply_wait(cli, sid).code == 0
    lists = [
        cli("strategy", "list", "--format", "json").json()[0],
        cli("strategy", "show", str(sid), "--format", "json").json(),
    ]
    for row in lists:
        assert row["id"] == sid and row["state"] == "complete", row
    step_rows = cli("step", "list", "--strategy", str(sid), "--format", "json").json()
    step_id = step_rows[0]["step"]
    shown = cli("step", "show", str(step_id), "--format", "json").json()
    for row in [*step_rows, shown, *shown["history"]]:
        assert "id" not in row and isinstance(row["step"], int), row
        assert row["target"] in ("a", "b"), row
    for row in [*step_rows, shown]:  # a step's row names its strategy
        assert row["strategy"] == sid, row
    assert shown["strategy"] == sid and shown["state"] == "complete"
    for row in cli("history", "--strategy", str(sid), "--format", "json").json():
        assert set(row) >= {"step", "target", "from", "to"} and "id" not in row, row
        assert row["strategy"] == sid, row
    for row in cli("events", "--strategy", str(sid), "--format", "json").json():
        assert set(row) >= {"step", "target", "kind"} and "id" not in row, row
        assert row["strategy"] == sid, row
    target = cli("target", "show", "a", "--format", "json").json()
    assert target["name"] == "a" and "id" not in target
    (used,) = target["strategies"]
    assert used["strategy"] == sid and used["strategy_state"] == "complete", used
    assert used["step_state"] == "complete" and "state" not in used, used
    assert cli("target", "list", "--format", "json").json()[0]["name"] == "a"


def test_apply_of_a_paused_strategy_says_it_resumed_it(cli: Cli) -> None:
    """`strategy apply` of a paused strategy resumed it without a word (resume says the
    state it was in)."""
    add(cli, "a")
    sid = create(cli, "--all")
    assert cli("strategy", "apply", str(sid)).code == 0
    assert cli("strategy", "pause", str(sid)).code == 0
    res = cli("strategy", "apply", str(sid))
    assert res.code == 0
    assert res.out == f"strategy {sid} applying (resumed: it was paused); nothing drives it yet\n"
    assert cli("strategy", "pause", str(sid)).code == 0
    answer = cli("strategy", "apply", str(sid), "--format", "json").json()
    assert (answer["state"], answer["was"]) == ("applying", "paused")


def test_a_callback_for_a_strategy_nobody_drives_is_stored_with_a_warning(cli: Cli) -> None:
    add(cli, "a")
    sid = create(cli, "--all")
    res = cli("step", "callback", "1", "pre-check", "--kind", "heartbeat")
    assert res.code == 0, res.text
    assert res.out.startswith("callback 1 for step 1 (pre-check, heartbeat) stored")
    assert res.err.startswith(
        f"warning: no conductor drives strategy {sid}: the callback is answered once one does"
    ), res.err
    (stored,) = cli("step", "show", "1", "--format", "json").json()["callbacks"]
    assert (stored["kind"], stored["outcome"]) == ("heartbeat", "open")
