"""Explicit stages (``--stage``), the order of ``--stages-by-group`` (the groups' own
``--order``, then name), the targets a plan leaves out, ``--dry-run``, and
``strategy show``'s stage progress; bad input refused with nothing written."""

from __future__ import annotations

from pathlib import Path

import pytest
from sqlalchemy import func, select

from cli_harness import Cli
from fleetwave.domain.errors import InputError
from fleetwave.domain.rollout import RolloutSpec, parse_stages
from fleetwave.store import queries
from fleetwave.store.db import Store, open_store
from fleetwave.store.schema import steps, strategies
from fleetwave.testing.invariants import check
from rollout_world import drive, entries, fleet, phase_targets, phases_in_order


def test_stages_run_in_the_order_given_each_after_the_one_before_ended(store: Store) -> None:
    fleet(store, {"east": 3, "west": 2, "canary": 2, None: 2}, caps={"east": 2})
    spec = RolloutSpec(stages=parse_stages(["canary", "east,west", "rest"]))
    sid, final = drive(store, spec)
    assert final == "complete"
    rows = entries(store, sid)
    phases_in_order(rows)  # stage 2 started after every step of stage 1 had ended, ...
    assert phase_targets(rows) == {
        1: {"canary-1", "canary-2"},
        2: {"east-1", "east-2", "east-3", "west-1", "west-2"},
        3: {"loose-1", "loose-2"},
    }
    assert check(store, sid).ok


def test_a_star_stage_takes_the_targets_of_no_other_stage(store: Store) -> None:
    fleet(store, {"a": 1, "b": 1, "c": 1})
    sid, final = drive(store, RolloutSpec(stages=parse_stages(["*", "a"])))
    assert final == "complete"
    assert phase_targets(entries(store, sid)) == {1: {"b-1", "c-1"}, 2: {"a-1"}}


def test_targets_in_no_stage_are_left_out_and_the_plan_says_why(store: Store) -> None:
    fleet(store, {"a": 2, "b": 2, None: 1})
    spec = RolloutSpec(stages=parse_stages(["b"]))
    sid, final = drive(store, spec)
    assert final == "complete"
    with store.read() as conn:
        made = conn.execute(select(strategies.c.step_count).where(strategies.c.id == sid))
        assert made.scalar_one() == 2
        assert conn.execute(select(func.count()).select_from(steps)).scalar_one() == 2


def test_stages_by_group_run_by_the_groups_order_then_name(store: Store) -> None:
    # (named z, the canary group came last by name: its order puts it first)
    fleet(store, {"alpha": 1, "zcanary": 1, "beta": 1, None: 1}, orders={"zcanary": 1, "beta": 2})
    sid, final = drive(store, RolloutSpec(stages_by_group=True))
    assert final == "complete"
    assert phase_targets(entries(store, sid)) == {
        1: {"zcanary-1"},
        2: {"beta-1"},
        3: {"alpha-1"},  # no order of its own: after those with one
        4: {"loose-1"},  # ungrouped: last
    }
    phases_in_order(entries(store, sid))


def test_strategy_show_says_which_stage_runs_and_which_are_done(store: Store) -> None:
    fleet(store, {"a": 1, "b": 1})
    sid, _ = drive(store, RolloutSpec(stages=parse_stages(["b", "a"])))
    shown = queries.get_strategy(store, sid)
    assert [(s["name"], s["state"], s["ended"]) for s in shown["stages"]] == [
        ("b", "done", 1),
        ("a", "done", 1),
    ]
    assert shown["stage_now"] is None


@pytest.mark.parametrize(
    ("given", "said"),
    [
        (["a", "a"], "--stage: 'a' is given in stages 1 and 2"),
        (["a,a"], "--stage: 'a' is given in the same stage"),
        (["rest", "*"], "--stage: '*' is given in stages 1 and 2"),
        ([""], "--stage: stage 1 is empty"),
        (["a,,b"], "--stage: an empty group name in 'a,,b'"),
    ],
)
def test_bad_stages_are_refused(given: list[str], said: str) -> None:
    with pytest.raises(InputError, match="^" + said.replace("*", r"\*")):
        parse_stages(given)


# -- on the command line -----------------------------------------------------------------


def _fleet_on(cli: Cli, tmp_path: Path) -> None:
    csv = tmp_path / "fleet.csv"
    csv.write_text("name,group\nc1,canary\ne1,east\ne2,east\nw1,west\nx1,\n")
    for args in (("group", "add", "canary"), ("group", "add", "east"), ("group", "add", "west")):
        assert cli(*args).code == 0
    assert cli("target", "import", str(csv)).code == 0


def _strategies(db_path: Path) -> int:
    store = open_store(str(db_path))
    try:
        with store.read() as conn:
            return int(conn.execute(select(func.count()).select_from(strategies)).scalar_one())
    finally:
        store.dispose()


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["--stage", "nope"], "error: --stage: no group named 'nope'"),
        (["--stage", "east", "--stage", "east"], "error: --stage: 'east' is given in stages 1"),
        (["--stage", ","], "error: --stage: stage 1 is empty"),
        (["--stage", "east", "--stages-by-group"], "error: --stage and --stages-by-group"),
        (["--stage", "canary", "--canary", "2"], "error: --canary: 2 is 2 canaries, of 1 target"),
    ],
)
def test_bad_stages_on_the_command_line_write_nothing(
    cli: Cli, tmp_path: Path, db_path: Path, args: list[str], said: str
) -> None:
    _fleet_on(cli, tmp_path)
    res = cli("strategy", "create", "--workflow", "patch", "--all", *args)
    assert res.code == 2, res.text
    lines = res.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(said), lines
    assert _strategies(db_path) == 0


def test_dry_run_prints_the_plan_and_writes_nothing(
    cli: Cli, tmp_path: Path, db_path: Path
) -> None:
    _fleet_on(cli, tmp_path)
    args = ["strategy", "create", "--workflow", "patch", "--all", "--dry-run"]
    res = cli(*args, "--stage", "canary", "--stage", "east,west", "--max-failures", "50%")
    assert res.code == 0, res.text
    assert res.out.splitlines() == [
        "plan: 4 steps of patch, max parallel 20, stops past 2 failures; starts when "
        "applied; nothing written",
        "stage 1 canary: 1 step; groups canary (max parallel 20)",
        "stage 2 east,west: 3 steps; groups east (max parallel 20), west (max parallel 20)",
        "left out: 1 target",
        "  x1: in no stage (no group; --stage rest takes it)",
    ]
    data = cli(*args, "--stage", "canary", "--stage", "rest", "--format", "json").json()
    assert [s["name"] for s in data["stages"]] == ["canary", "rest"]
    assert data["stages"][1]["batches"] == [
        {"phase": 2, "size": 4, "targets": ["e1", "e2", "w1", "x1"]}
    ]
    assert data["steps"] == 5 and data["left_out"] == []
    assert data["earliest_start"] == "when applied"
    assert _strategies(db_path) == 0


def test_dry_run_refuses_what_create_refuses(cli: Cli, tmp_path: Path, db_path: Path) -> None:
    _fleet_on(cli, tmp_path)
    assert cli("strategy", "create", "--workflow", "patch", "--group", "east").code == 0
    res = cli("strategy", "create", "--workflow", "patch", "--all", "--dry-run")
    assert res.code == 2
    assert "already in active strategy 1" in res.err
    assert _strategies(db_path) == 1


def test_create_says_how_many_targets_no_stage_takes(cli: Cli, tmp_path: Path) -> None:
    _fleet_on(cli, tmp_path)
    res = cli("strategy", "create", "--workflow", "patch", "--all", "--stage", "east")
    assert res.code == 0
    assert "strategy 1 created (patch, 2 targets" in res.out
    assert res.err.strip() == (
        "note: 3 targets in no stage left out ('--stage rest' takes them; --dry-run lists them)"
    )
    shown = cli("strategy", "show", "1", "--format", "json").json()
    assert shown["stages"] == [
        {
            "stage": 1,
            "name": "east",
            "steps": 2,
            "ended": 0,
            "state": "waiting",  # not applied yet
            "batches": 1,
            "phases": "1",
        }
    ]


def test_a_groups_order_is_set_shown_and_cleared(cli: Cli) -> None:
    assert cli("group", "add", "late", "--order", "9").code == 0
    assert cli("group", "add", "late", "--order", "9").code == 0  # the same again: unchanged
    res = cli("group", "add", "late", "--order", "3")
    assert res.code == 2 and "order 9 stored, 3 given" in res.err
    res = cli("group", "set", "late", "--order", "2")
    assert res.out.startswith("group late: order 9 -> 2; strategies created from now on")
    assert cli("group", "show", "late", "--format", "json").json()["order"] == 2
    res = cli("group", "set", "late", "--no-order")
    assert res.out.startswith("group late: order 2 -> none")
    assert cli("group", "list", "--format", "json").json()[0]["order"] is None
