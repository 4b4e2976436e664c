"""The command line for the inventory: targets, groups and bulk import.

Every test runs ``fleetwave.cli.main.main`` (the console script's entry point, which turns
bad input into ``error: ...`` and exit code 2) against a real SQLite file in ``tmp_path``,
and checks the database through the CLI's own ``--format json`` output.
"""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from cli_harness import Cli, as_terminal, assert_rejected, one_line
from test_cli_strategy import add, create

FLEETWAVE = Path(sys.executable).with_name("fleetwave")


def targets(cli: Cli, *extra: str) -> dict[str, dict[str, Any]]:
    res = cli("target", "list", "--format", "json", *extra)
    assert res.code == 0, res.text
    return {t["name"]: t for t in res.json()}


def groups(cli: Cli) -> dict[str, dict[str, Any]]:
    res = cli("group", "list", "--format", "json")
    assert res.code == 0, res.text
    return {g["name"]: g for g in res.json()}


# -- target add ----------------------------------------------------------------------------


def test_target_add_types_settings_and_stores_labels_and_unmanaged(cli: Cli) -> None:
    res = cli(
        "target",
        "add",
        "site-1",
        "--set",
        "latency_ms=20",
        "--set",
        "failure_rate=0.25",
        "--set",
        "already_done=true",
        "--set",
        "fail_at=finishing",
        "--label",
        "env=prod",
        "--label",
        "region=eu-west",
        "--unmanaged",
    )
    assert res.code == 0, res.text
    assert "site-1 added" in res.text

    t = targets(cli)["site-1"]
    assert t["settings"] == {
        "latency_ms": 20,
        "failure_rate": 0.25,
        "already_done": True,
        "fail_at": "finishing",
    }
    assert type(t["settings"]["latency_ms"]) is int
    assert type(t["settings"]["already_done"]) is bool
    assert t["labels"] == {"env": "prod", "region": "eu-west"}
    assert t["managed"] is False
    assert t["driver"] == "sim"
    assert t["group"] is None

    shown = cli("target", "show", "site-1", "--format", "json")
    assert shown.code == 0, shown.text
    assert shown.json() == {**t, "strategies": []}


def test_target_add_defaults_to_managed_sim_without_settings(cli: Cli) -> None:
    assert cli("target", "add", "plain").code == 0
    assert targets(cli)["plain"] == {
        "name": "plain",
        "group": None,
        "driver": "sim",
        "managed": True,
        "settings": {},
        "labels": {},
    }


def test_target_add_keeps_label_values_verbatim(cli: Cli) -> None:
    res = cli(
        "target",
        "add",
        "site-1",
        "--label",
        "window=12:30",
        "--label",
        "version=1.10",
        "--label",
        "zip=007",
        "--label",
        "critical=true",
    )
    assert res.code == 0, res.text
    assert targets(cli)["site-1"]["labels"] == {
        "window": "12:30",
        "version": "1.10",
        "zip": "007",
        "critical": "true",
    }


def test_target_list_and_show_in_table_format_name_the_target(cli: Cli) -> None:
    assert cli("target", "add", "site-1", "--set", "latency_ms=5").code == 0
    listed = cli("target", "list")
    assert listed.code == 0
    assert "site-1" in listed.out
    assert "latency_ms" in listed.out
    shown = cli("target", "show", "site-1")
    assert shown.code == 0
    assert "site-1" in shown.out


def test_manage_and_unmanage_flip_the_flag(cli: Cli) -> None:
    assert cli("target", "add", "a").code == 0
    assert cli("target", "add", "b").code == 0
    assert targets(cli)["a"]["managed"] is True

    res = cli("target", "unmanage", "a")
    assert res.code == 0 and "a is unmanaged" in res.text
    after = targets(cli)
    assert after["a"]["managed"] is False
    assert after["b"]["managed"] is True  # only the named target changes

    res = cli("target", "manage", "a")
    assert res.code == 0 and "a is managed" in res.text
    assert targets(cli)["a"]["managed"] is True


@pytest.mark.parametrize("verb", ["manage", "unmanage", "delete", "show"])
def test_verbs_on_unknown_target_are_rejected(cli: Cli, verb: str) -> None:
    assert cli("target", "add", "a").code == 0
    assert_rejected(cli("target", verb, "ghost"), "ghost", "not found")
    assert list(targets(cli)) == ["a"]


def test_target_delete_removes_only_that_target(cli: Cli) -> None:
    for name in ("a", "b", "c"):
        assert cli("target", "add", name).code == 0
    res = cli("target", "delete", "b")
    assert res.code == 0 and "b deleted" in res.text
    assert sorted(targets(cli)) == ["a", "c"]
    assert_rejected(cli("target", "show", "b"), "b")
    # the name is free again
    assert cli("target", "add", "b").code == 0
    assert sorted(targets(cli)) == ["a", "b", "c"]


def test_duplicate_target_name_is_rejected_and_nothing_written(cli: Cli) -> None:
    assert cli("target", "add", "site-1", "--set", "latency_ms=5", "--label", "k=v").code == 0
    before = targets(cli)

    res = cli("target", "add", "site-1", "--set", "latency_ms=9", "--unmanaged")
    assert_rejected(res, "site-1", "already exists")
    assert targets(cli) == before


def test_unknown_group_is_rejected_and_nothing_written(cli: Cli) -> None:
    res = cli("target", "add", "site-1", "--group", "nowhere")
    assert_rejected(res, "site-1", "nowhere")
    assert targets(cli) == {}


@pytest.mark.parametrize(
    ("setting", "word"),
    [
        ("failure_rate=2", "failure_rate"),
        ("nosuch=1", "nosuch"),
        ("latency_ms=-1", "latency_ms"),
        ("latency_ms=fast", "latency_ms"),
        ("hang_rate=1.5", "hang_rate"),
        ("latency=gaussian", "latency"),
    ],
)
def test_bad_sim_setting_is_rejected_naming_it(cli: Cli, setting: str, word: str) -> None:
    res = cli("target", "add", "site-1", "--set", setting)
    assert_rejected(res, "site-1", f"sim setting {word}")
    assert targets(cli) == {}


@pytest.mark.parametrize("item", ["novalue", "=5", " =x"])
def test_malformed_set_is_rejected(cli: Cli, item: str) -> None:
    assert_rejected(cli("target", "add", "site-1", "--set", item), "--set", "key=value")
    assert targets(cli) == {}


def test_malformed_label_is_rejected(cli: Cli) -> None:
    assert_rejected(cli("target", "add", "site-1", "--label", "justtext"), "--label")
    assert targets(cli) == {}


def test_unknown_driver_is_rejected(cli: Cli) -> None:
    assert_rejected(cli("target", "add", "site-1", "--driver", "telnet"), "driver", "telnet")
    assert targets(cli) == {}


def test_fleetwave_db_environment_variable_selects_the_database(
    cli: Cli, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    env_db = tmp_path / "from-env.db"
    monkeypatch.setenv("FLEETWAVE_DB", str(env_db))
    assert cli("target", "add", "via-env", db=None).code == 0
    assert env_db.is_file()
    listed = cli("target", "list", "--format", "json", db=env_db)
    assert [t["name"] for t in listed.json()] == ["via-env"]
    # the --db file of the fixture is another database, untouched
    assert targets(cli) == {}


# -- groups --------------------------------------------------------------------------------


def test_group_add_and_list(cli: Cli) -> None:
    assert cli("group", "add", "east", "--max-parallel", "5").code == 0
    assert cli("group", "add", "west", "--apply-type", "serial").code == 0
    assert cli("target", "add", "e1", "--group", "east").code == 0
    assert cli("target", "add", "e2", "--group", "east").code == 0
    assert cli("target", "add", "loose").code == 0

    assert groups(cli) == {
        "east": {
            "name": "east",
            "max_parallel": 5,
            "apply_type": "parallel",
            "order": None,
            "targets": 2,
        },
        # serial: one at a time (the list shows what runs)
        "west": {
            "name": "west",
            "max_parallel": 1,
            "apply_type": "serial",
            "order": None,
            "targets": 0,
        },
    }
    assert sorted(targets(cli, "--group", "east")) == ["e1", "e2"]
    assert targets(cli, "--group", "west") == {}
    assert targets(cli)["e1"]["group"] == "east"
    assert targets(cli)["loose"]["group"] is None


def test_group_add_defaults(cli: Cli) -> None:
    assert cli("group", "add", "g").code == 0
    assert groups(cli)["g"] == {
        "name": "g",
        "max_parallel": 20,
        "apply_type": "parallel",
        "order": None,
        "targets": 0,
    }


@pytest.mark.parametrize("value", ["0", "-1"])
def test_group_max_parallel_below_one_is_rejected(cli: Cli, value: str) -> None:
    assert_rejected(cli("group", "add", "g", "--max-parallel", value), "--max-parallel", value)
    assert groups(cli) == {}


def test_duplicate_group_is_rejected(cli: Cli) -> None:
    assert cli("group", "add", "g", "--max-parallel", "4").code == 0
    assert_rejected(cli("group", "add", "g", "--max-parallel", "9"), "'g'", "already exists")
    assert groups(cli)["g"]["max_parallel"] == 4


def test_group_list_when_empty(cli: Cli, monkeypatch: pytest.MonkeyPatch) -> None:
    # piped: the header alone (a script counting rows counts none)
    res = cli("group", "list")
    assert res.code == 0
    assert res.out.splitlines()[0].split() == [
        "name",
        "max_parallel",
        "apply_type",
        "order",
        "targets",
    ]
    assert len(res.out.splitlines()) == 2
    as_terminal(monkeypatch)  # on a terminal it says so
    assert "(none)" in cli("group", "list").out


def group(cli: Cli, name: str) -> dict[str, Any]:
    res = cli("group", "show", name, "--format", "json")
    assert res.code == 0, res.text
    return dict(res.json())


def test_group_set_changes_what_is_stored_and_says_what_changed(cli: Cli) -> None:
    assert cli("group", "add", "east", "--max-parallel", "5").code == 0
    res = cli("group", "set", "east", "--max-parallel", "3")
    assert (res.code, res.out) == (
        0,
        "group east: max parallel 5 -> 3; strategies created from now on use it\n",
    )
    assert groups(cli)["east"]["max_parallel"] == 3
    again = cli("group", "set", "east", "--max-parallel", "3")
    assert (again.code, again.out) == (0, "group east: unchanged (max parallel 3, parallel)\n")
    # serial runs one at a time; made parallel again without a number, the default
    assert cli("group", "set", "east", "--apply-type", "serial").code == 0
    assert groups(cli)["east"] == {
        "name": "east",
        "max_parallel": 1,
        "apply_type": "serial",
        "order": None,
        "targets": 0,
    }
    res = cli("group", "set", "east", "--apply-type", "parallel", "--format", "json")
    assert res.json() == {
        "name": "east",
        "before": {"max_parallel": 1, "apply_type": "serial", "order": None},
        "after": {"max_parallel": 20, "apply_type": "parallel", "order": None},
        "changed": True,
        "active_strategies_unchanged": [],
    }


@pytest.mark.parametrize(
    ("args", "words"),
    [
        ([], ["nothing to change", "--max-parallel", "--apply-type"]),
        (["--max-parallel", "0"], ["--max-parallel", "at least 1", "0"]),
        (["--apply-type", "serial", "--max-parallel", "4"], ["--max-parallel", "serial", "4"]),
    ],
)
def test_group_set_refuses_bad_input_and_writes_nothing(
    cli: Cli, args: list[str], words: list[str]
) -> None:
    assert cli("group", "add", "east", "--max-parallel", "5").code == 0
    assert_rejected(cli("group", "set", "east", *args), *words)
    assert groups(cli)["east"]["max_parallel"] == 5


@pytest.mark.parametrize("verb", [["show"], ["delete"], ["set", "--max-parallel", "2"]])
def test_group_verbs_on_unknown_group_are_rejected(cli: Cli, verb: list[str]) -> None:
    assert_rejected(cli("group", verb[0], "ghost", *verb[1:]), "'ghost'", "not found")


def test_group_set_says_what_ran_before_for_an_old_serial_row(cli: Cli, db_path: Path) -> None:
    assert cli("group", "add", "legacy", "--apply-type", "serial").code == 0
    with sqlite3.connect(db_path) as conn:  # as an earlier version stored it
        conn.execute("UPDATE groups SET max_parallel = 5 WHERE name = 'legacy'")
    res = cli("group", "set", "legacy", "--max-parallel", "1")
    assert (res.code, res.out) == (0, "group legacy: unchanged (max parallel 1, serial)\n")


def test_group_set_applies_to_strategies_created_after_it(cli: Cli) -> None:
    """A strategy takes its groups' caps when created: the one created before the change
    keeps 5 (and is named), the one after it runs one target of the group at a time."""
    assert cli("group", "add", "east", "--max-parallel", "5").code == 0
    for name in ("a", "b", "c"):
        assert cli("target", "add", name, "--group", "east", "--set", "latency_ms=30").code == 0
    assert cli("strategy", "create", "--workflow", "patch", "--targets", "a").code == 0
    res = cli("group", "set", "east", "--max-parallel", "1")
    assert res.code == 0, res.text
    assert "active strategy 1 keeps the cap taken when created" in res.out
    assert cli("strategy", "create", "--workflow", "patch", "--targets", "b,c").code == 0
    shown = group(cli, "east")
    assert [(s["strategy"], s["steps"], s["max_parallel"]) for s in shown["strategies"]] == [
        (1, 1, 5),
        (2, 2, 1),
    ]
    assert cli("strategy", "apply", "2", "--wait").code == 0
    rows = cli("step", "list", "--strategy", "2", "--format", "json").json()
    (first, second) = sorted((r["started_at"], r["finished_at"]) for r in rows)
    assert first[1] <= second[0], rows  # one of the group in flight at a time


def test_group_show_counts_targets_and_unmanaged(cli: Cli) -> None:
    assert cli("group", "add", "east", "--apply-type", "serial").code == 0
    assert cli("target", "add", "a", "--group", "east").code == 0
    assert cli("target", "add", "b", "--group", "east", "--unmanaged").code == 0
    assert cli("target", "add", "loose").code == 0
    assert group(cli, "east") == {
        "name": "east",
        "max_parallel": 1,
        "apply_type": "serial",
        "order": None,
        "targets": 2,
        "unmanaged": 1,
        "strategies": [],
    }


def test_group_delete_refuses_while_it_has_targets_or_history(cli: Cli) -> None:
    assert cli("group", "add", "east").code == 0
    assert cli("target", "add", "a", "--group", "east").code == 0
    assert_rejected(cli("group", "delete", "east"), "east", "1 target", "'a'", "target set")
    assert cli("strategy", "create", "--workflow", "patch", "--targets", "a").code == 0
    assert cli("target", "set", "a", "--no-group").code == 2  # in an active strategy
    assert cli("strategy", "delete", "1").code == 0
    assert cli("strategy", "create", "--workflow", "patch", "--targets", "a").code == 0
    assert cli("strategy", "apply", "2", "--wait").code == 0
    assert cli("target", "set", "a", "--no-group").code == 0  # ended: it may move
    assert_rejected(cli("group", "delete", "east"), "east", "history in 1 strategy", "2")
    assert "east" in groups(cli)
    assert cli("strategy", "delete", "2").code == 0
    res = cli("group", "delete", "east", "--format", "json")
    assert (res.code, res.json()) == (0, {"name": "east", "deleted": True})
    assert groups(cli) == {}


# -- target set ----------------------------------------------------------------------------


def test_target_set_changes_settings_labels_and_group_key_by_key(cli: Cli) -> None:
    assert cli("group", "add", "east").code == 0
    assert cli("group", "add", "west").code == 0
    added = cli(
        "target", "add", "a", "--group", "east", "--set", "latency_ms=5", "--label", "rack=1"
    )
    assert added.code == 0
    assert cli("target", "unmanage", "a").code == 0
    res = cli(
        "target",
        "set",
        "a",
        "--set",
        "latency_ms=10",
        "--set",
        "failure_rate=0.1",
        "--label",
        "rack=2",
        "--label",
        "row=3",
    )
    assert (res.code, res.out) == (
        0,
        "target a: settings: latency_ms 5 -> 10, failure_rate (unset) -> 0.1; "
        "labels: rack 1 -> 2, row (unset) -> 3\n",
    )
    res = cli(
        "target", "set", "a", "--unset", "failure_rate", "--unlabel", "row", "--group", "west"
    )
    assert res.code == 0, res.text
    assert targets(cli)["a"] == {
        "name": "a",
        "group": "west",
        "driver": "sim",
        "managed": False,  # not the definition's: left as the operator set it
        "settings": {"latency_ms": 10},
        "labels": {"rack": "2"},
    }
    res = cli("target", "set", "a", "--no-group", "--format", "json")
    assert res.json() == {
        "name": "a",
        "changed": True,
        "changes": {"group": {"before": "west", "after": None}},
    }
    again = cli("target", "set", "a", "--no-group")
    assert (again.code, again.out) == (0, "target a: unchanged (it is so already)\n")


def test_target_set_compares_values_as_stored_and_says_so_key_by_key(cli: Cli) -> None:
    """1 and true, 5 and 5.0 are stored as other JSON values: target add of the new
    definition was refused after target set had said 'unchanged'."""
    assert cli("target", "add", "a", "--set", "already_done=1", "--set", "latency_ms=5").code == 0
    assert cli("target", "set", "a", "--label", "tier=x").code == 0
    res = cli(
        "target", "set", "a", "--set", "already_done=true", "--set", "latency_ms=5.0",
        "--label", "tier=y",
    )  # fmt: skip
    assert (res.code, res.out) == (
        0,
        "target a: settings: already_done 1 -> true, latency_ms 5 -> 5.0; labels: tier x -> y\n",
    )
    again = cli(
        "target", "add", "a", "--set", "already_done=true", "--set", "latency_ms=5.0",
        "--label", "tier=y",
    )  # fmt: skip
    assert (again.code, again.out) == (0, "target a already exists, unchanged\n")
    # another definition given to add names the way to change it
    assert_rejected(cli("target", "add", "a"), "another definition", "'fleetwave target set a'")


def test_target_set_blames_the_stored_driver_when_no_driver_is_given(
    cli: Cli, db_path: Path
) -> None:
    assert cli("target", "add", "a").code == 0
    with sqlite3.connect(db_path) as conn:  # stored by a fleetwave that had this driver
        conn.execute("UPDATE targets SET driver = 'ghost' WHERE name = 'a'")
    assert_rejected(
        cli("target", "set", "a", "--label", "k=v"),
        "target a: driver 'ghost' is unknown here",
        "give --driver",
    )
    res = cli("target", "set", "a", "--driver", "sim", "--label", "k=v")
    assert res.code == 0 and "driver ghost -> sim" in res.out, res.text


@pytest.mark.parametrize(
    ("args", "words"),
    [
        ([], ["nothing to change", "--group", "--set", "--unlabel"]),
        (["--unset", "nothere"], ["--unset", "no setting", "'nothere'", "'latency_ms'"]),
        (["--unlabel", "nothere"], ["--unlabel", "no label", "'nothere'"]),
        (["--set", "latency_ms=-1"], ["target a", "latency_ms", "-1"]),
        (["--set", "bogus=1"], ["target a", "bogus", "unknown"]),
        (["--driver", "nope"], ["--driver", "'nope'", "known: http, redfish, sim"]),
        (["--group", "nowhere"], ["--group", "'nowhere'"]),
        (["--group", "east", "--no-group"], ["--group", "--no-group"]),
        (["--unset", "latency_ms", "--set", "latency_ms=1"], ["--unset", "'latency_ms'"]),
        (["--unset", "k", "--unset", "k"], ["--unset", "'k'", "more than once"]),
        (["--set", "x"], ["--set", "key=value"]),
    ],
)
def test_target_set_refuses_bad_input_and_writes_nothing(
    cli: Cli, args: list[str], words: list[str]
) -> None:
    assert cli("group", "add", "east").code == 0
    assert cli("target", "add", "a", "--set", "latency_ms=5", "--label", "k=v").code == 0
    before = targets(cli)
    assert_rejected(cli("target", "set", "a", *args), *words)
    assert targets(cli) == before


def test_target_set_refuses_while_in_an_active_strategy(cli: Cli) -> None:
    assert cli("target", "add", "a").code == 0
    assert cli("strategy", "create", "--workflow", "patch", "--targets", "a").code == 0
    assert_rejected(
        cli("target", "set", "a", "--set", "latency_ms=1"),
        "target a",
        "active strategy 1 (initial)",
        "strategy delete 1",
    )
    assert cli("strategy", "apply", "1").code == 0
    res = cli("target", "set", "a", "--set", "latency_ms=1")
    assert_rejected(res, "active strategy 1 (applying)", "target unmanage a")
    assert targets(cli)["a"]["settings"] == {}
    assert_rejected(cli("target", "set", "ghost", "--set", "latency_ms=1"), "'ghost'", "not found")


# -- target import -------------------------------------------------------------------------


def test_import_csv_extra_columns_become_typed_driver_settings(cli: Cli, tmp_path: Path) -> None:
    assert cli("group", "add", "east").code == 0
    f = tmp_path / "fleet.csv"
    f.write_text(
        "name,group,driver,latency_ms,failure_rate,fail_at,managed\n"
        "s1,east,sim,20,0.5,finishing,true\n"
        "s2,,,,,,no\n"
        "s3,east,sim,0,,,\n",
        encoding="utf-8",
    )
    res = cli("target", "import", str(f))
    assert res.code == 0, res.text
    assert "3 targets imported" in res.text

    got = targets(cli)
    assert sorted(got) == ["s1", "s2", "s3"]
    assert got["s1"]["group"] == "east"
    assert got["s1"]["settings"] == {"latency_ms": 20, "failure_rate": 0.5, "fail_at": "finishing"}
    assert type(got["s1"]["settings"]["latency_ms"]) is int
    assert got["s1"]["managed"] is True
    # empty cells are not settings; empty driver means sim; managed=no means unmanaged
    assert got["s2"] == {
        "name": "s2",
        "group": None,
        "driver": "sim",
        "managed": False,
        "settings": {},
        "labels": {},
    }
    assert got["s3"]["settings"] == {"latency_ms": 0}
    assert got["s3"]["managed"] is True
    assert groups(cli)["east"]["targets"] == 2


def test_import_yaml_list_of_mappings(cli: Cli, tmp_path: Path) -> None:
    assert cli("group", "add", "west").code == 0
    f = tmp_path / "fleet.yaml"
    f.write_text(
        "- name: y1\n"
        "  group: west\n"
        "  settings: {latency_ms: 3, already_done: true}\n"
        "  labels: {tier: gold}\n"
        "- name: y2\n"
        "  managed: false\n"
        "- name: y3\n",
        encoding="utf-8",
    )
    res = cli("target", "import", str(f))
    assert res.code == 0, res.text
    got = targets(cli)
    assert sorted(got) == ["y1", "y2", "y3"]
    assert got["y1"]["group"] == "west"
    assert got["y1"]["settings"] == {"latency_ms": 3, "already_done": True}
    assert got["y1"]["labels"] == {"tier": "gold"}
    assert got["y2"]["managed"] is False
    assert got["y3"]["managed"] is True
    assert got["y3"]["settings"] == {}


def test_import_yaml_targets_key(cli: Cli, tmp_path: Path) -> None:
    f = tmp_path / "fleet.yml"
    f.write_text("targets:\n  - name: k1\n  - name: k2\n", encoding="utf-8")
    assert cli("target", "import", str(f)).code == 0
    assert sorted(targets(cli)) == ["k1", "k2"]


def test_import_3000_rows_csv_in_one_go(cli: Cli, tmp_path: Path) -> None:
    f = tmp_path / "big.csv"
    lines = ["name,group,driver,latency_ms"]
    lines += [f"node{i:05d},,sim,{i % 7}" for i in range(3000)]
    f.write_text("\n".join(lines) + "\n", encoding="utf-8")
    res = cli("target", "import", str(f))
    assert res.code == 0, res.text
    assert "3000 targets imported" in res.text
    got = cli("target", "list", "--format", "json").json()
    assert len(got) == 3000
    assert got[0]["name"] == "node00000"
    assert got[-1]["name"] == "node02999"
    assert got[-1]["settings"] == {"latency_ms": 2999 % 7}


def test_import_3000_rows_with_an_error_on_the_last_line_writes_nothing(
    cli: Cli, tmp_path: Path
) -> None:
    f = tmp_path / "big.csv"
    lines = ["name,failure_rate"]
    lines += [f"node{i:05d},0" for i in range(2999)]
    lines.append("node02999,3")  # line 3001 of the file
    f.write_text("\n".join(lines) + "\n", encoding="utf-8")
    assert_rejected(cli("target", "import", str(f)), "line 3001", "failure_rate")
    assert targets(cli) == {}


@pytest.mark.parametrize(
    ("bad_row", "words"),
    [
        ("x4,,sim,2", ["failure_rate"]),
        (",,sim,0", ["name", "must not be empty"]),
        ("x4,,sim,lots", ["failure_rate", "not a number"]),
    ],
)
def test_import_csv_error_on_line_n_names_the_line_and_writes_nothing(
    cli: Cli, tmp_path: Path, bad_row: str, words: list[str]
) -> None:
    f = tmp_path / "fleet.csv"
    f.write_text(
        "name,group,driver,failure_rate\nx1,,sim,0\nx2,,sim,0.1\nx3,,sim,0\n" + bad_row + "\n",
        encoding="utf-8",
    )
    assert_rejected(cli("target", "import", str(f)), "line 5", *words)
    assert targets(cli) == {}


def test_import_csv_bad_managed_value_names_the_line(cli: Cli, tmp_path: Path) -> None:
    f = tmp_path / "fleet.csv"
    f.write_text("name,managed\nm1,yes\nm2,perhaps\n", encoding="utf-8")
    assert_rejected(cli("target", "import", str(f)), "line 3", "managed", "perhaps")
    assert targets(cli) == {}


def test_import_csv_error_line_number_counts_blank_lines(cli: Cli, tmp_path: Path) -> None:
    f = tmp_path / "fleet.csv"
    f.write_text("name,failure_rate\na,0.1\n\nb,5\n", encoding="utf-8")  # b is on line 4
    assert_rejected(cli("target", "import", str(f)), "line 4", "failure_rate")


def test_import_duplicate_name_inside_the_file_writes_nothing(cli: Cli, tmp_path: Path) -> None:
    f = tmp_path / "fleet.csv"
    f.write_text("name\nd1\nd2\nd1\n", encoding="utf-8")
    assert_rejected(cli("target", "import", str(f)), "line 4", "d1", "twice", "also line 2")
    assert targets(cli) == {}
    y = tmp_path / "fleet.yaml"
    y.write_text("- name: a\n- name: b\n- name: a\n", encoding="utf-8")
    assert_rejected(cli("target", "import", str(y)), "targets[2]", "also targets[0]")
    assert targets(cli) == {}


def test_import_clashing_with_an_existing_target_writes_nothing(cli: Cli, tmp_path: Path) -> None:
    assert cli("target", "add", "old", "--set", "latency_ms=1").code == 0
    before = targets(cli)
    f = tmp_path / "fleet.csv"
    f.write_text("name,latency_ms\nnew1,2\nold,3\nnew2,4\n", encoding="utf-8")
    assert_rejected(cli("target", "import", str(f)), "old", "already exists")
    assert targets(cli) == before


def test_import_unknown_group_writes_nothing(cli: Cli, tmp_path: Path) -> None:
    f = tmp_path / "fleet.csv"
    f.write_text("name,group\ng1,\ng2,nowhere\n", encoding="utf-8")
    assert_rejected(cli("target", "import", str(f)), "g2", "nowhere")
    assert targets(cli) == {}


@pytest.mark.parametrize(
    ("body", "words"),
    [
        ("- name: a\n- name: b\n  colour: red\n", ["targets[1]", "colour", "unknown field"]),
        ("- name: a\n- name: b\n  settings: {failure_rate: 9}\n", ["targets[1]", "failure_rate"]),
        ("- name: a\n- group: g\n", ["targets[1]", "name"]),
        ("- name: a\n- name: b\n  settings: [1, 2]\n", ["targets[1]", "settings", "mapping"]),
        ("name: a\n", ["expected a list"]),
        ("- name: [unclosed\n", ["not valid YAML"]),
    ],
)
def test_import_bad_yaml_names_the_item_and_writes_nothing(
    cli: Cli, tmp_path: Path, body: str, words: list[str]
) -> None:
    f = tmp_path / "fleet.yaml"
    f.write_text(body, encoding="utf-8")
    assert_rejected(cli("target", "import", str(f)), *words)
    assert targets(cli) == {}


def test_import_csv_without_name_column_is_rejected(cli: Cli, tmp_path: Path) -> None:
    f = tmp_path / "fleet.csv"
    f.write_text("host,group\nh1,\n", encoding="utf-8")
    assert_rejected(cli("target", "import", str(f)), "'name'")
    assert targets(cli) == {}


def test_import_missing_file_and_unknown_extension_are_rejected(cli: Cli, tmp_path: Path) -> None:
    assert_rejected(cli("target", "import", str(tmp_path / "nope.csv")), "does not exist")
    txt = tmp_path / "fleet.txt"
    txt.write_text("name\na\n", encoding="utf-8")
    assert_rejected(cli("target", "import", str(txt)), ".csv", ".yaml")
    assert targets(cli) == {}


def test_import_empty_csv_is_rejected(cli: Cli, tmp_path: Path) -> None:
    f = tmp_path / "fleet.csv"
    f.write_text("name,group\n", encoding="utf-8")
    assert_rejected(cli("target", "import", str(f)), "no targets")
    assert targets(cli) == {}


# -- the console script itself -------------------------------------------------------------


@pytest.mark.skipif(not FLEETWAVE.exists(), reason="console script not installed in this venv")
def test_console_script_turns_bad_input_into_one_error_line_and_exit_2(
    cli: Cli, db_path: Path
) -> None:
    assert cli("target", "add", "s1").code == 0
    before = targets(cli)
    dup = subprocess.run(
        [str(FLEETWAVE), "target", "add", "s1", "--set", "latency_ms=3", "--db", str(db_path)],
        capture_output=True,
        text=True,
        env=dict(os.environ, COLUMNS="300"),
        timeout=60,
    )
    assert dup.returncode == 2
    assert dup.stdout == ""
    assert dup.stderr == (
        "error: target s1: already exists with another definition "
        '(settings: {} stored, {"latency_ms": 3} given); '
        "'fleetwave target set s1' changes it\n"
    )
    assert targets(cli) == before


def test_a_long_list_prints_as_plain_columns_at_once(
    cli: Cli, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rich measured and wrapped every cell (12,000 journal rows took 16 s): past a few
    hundred rows a table is plain aligned columns, every row, one line each."""
    from fleetwave.cli import output

    for name in ("alpha", "beta", "gamma-with-a-long-name"):
        assert cli("target", "add", name).code == 0
    as_terminal(monkeypatch)
    small = cli("target", "list")
    assert "┃" in small.out  # a few rows, on a terminal: a Rich table
    monkeypatch.setattr(output, "PLAIN_ABOVE", 2)
    res = cli("target", "list")
    assert res.code == 0
    lines = res.out.splitlines()
    assert lines[0].split() == ["name", "group", "driver", "managed", "settings", "labels"]
    assert set(lines[1]) <= {"-", " "}
    assert [line.split()[0] for line in lines[2:]] == ["alpha", "beta", "gamma-with-a-long-name"]
    # aligned: every row's second column starts where the header's does
    col = lines[0].index("group")
    assert all(line[col - 2 : col] == "  " for line in lines[2:])
    assert "┃" not in res.out
    # a name in wide characters takes two terminal cells each: still aligned
    assert cli("target", "add", "节点一").code == 0
    from rich.cells import cell_len

    lines = cli("target", "list").out.splitlines()
    starts = {cell_len(line.split("  sim")[0]) for line in lines[2:]}
    assert len(starts) == 1, lines


def test_lists_stream_as_json_one_row_per_line_and_refuse_bad_names_first(
    cli: Cli,
) -> None:
    """A fleet-sized list (a 100,000-target rollout's journal is 600,000 rows) is read
    and written a row at a time: one JSON row per line (a 600,000-row history held
    1.5 GB before). An unknown strategy or target is refused before anything is
    written, as before."""
    for name in ("alpha", "beta"):
        assert cli("target", "add", name).code == 0
    res = cli("target", "list", "--format", "json")
    lines = res.out.splitlines()
    assert lines[0] == "[" and lines[-1] == "]"
    assert [json.loads(line.rstrip(","))["name"] for line in lines[1:-1]] == ["alpha", "beta"]
    assert_rejected(
        cli("target", "list", "--group", "none-such", "--format", "json"),
        "--group: no group named 'none-such'",
    )
    for args in (
        ("history", "--strategy", "99"),
        ("step", "list", "--strategy", "99"),
    ):
        res = cli(*args, "--format", "json")
        assert res.code == 2 and res.out == "", res.text
        assert_rejected(res, "strategy 99")
    assert cli("strategy", "create", "--workflow", "patch", "--all").code == 0
    res = cli("history", "--strategy", "1", "--target", "nobody", "--format", "json")
    assert res.code == 2 and res.out == ""
    assert_rejected(res, "--target", "nobody")


@pytest.mark.parametrize(
    ("kind", "missing", "key"),
    [
        ("target", "nope", {"name": "nope"}),
        ("group", "nope", {"name": "nope"}),
        ("strategy", "99", {"id": 99}),
    ],
)
def test_delete_ignore_missing_makes_a_script_s_delete_idempotent(
    cli: Cli, kind: str, missing: str, key: dict[str, object]
) -> None:
    """A script deleting what may be gone already had to tell "not found" (exit 2) from
    every other refusal: --ignore-missing answers one that is not there with exit 0."""
    res = cli(kind, "delete", missing)
    assert res.code == 2 and "not found" in res.err, res.text
    res = cli(kind, "delete", missing, "--ignore-missing")
    assert res.code == 0, res.text
    assert res.out.strip() == f"{kind} {missing}: not there, nothing deleted"
    res = cli(kind, "delete", missing, "--ignore-missing", "--format", "json")
    assert res.code == 0 and res.json() == {**key, "deleted": False}, res.text


@pytest.mark.parametrize("kind", ["target", "group"])
@pytest.mark.parametrize(
    ("name", "problem"), [("", "must not be empty"), ("a b", "is not allowed")]
)
def test_delete_ignore_missing_refuses_a_name_nothing_could_have(
    cli: Cli, kind: str, name: str, problem: str
) -> None:
    """An unset variable in a cleanup script (`group delete "$G" --ignore-missing`)
    passed silently: a name no target or group could have is bad input (exit 2)."""
    for extra in ([], ["--ignore-missing"]):
        res = cli(kind, "delete", name, *extra)
        assert res.code == 2 and res.err.startswith("error: NAME: "), res.text
        assert problem in res.err, res.text


def test_delete_ignore_missing_still_refuses_what_is_there(cli: Cli) -> None:
    assert cli("group", "add", "g").code == 0
    assert cli("target", "add", "a", "--group", "g").code == 0
    res = cli("group", "delete", "g", "--ignore-missing")
    assert res.code == 2 and "group g: has 1 target" in res.err, res.text
    sid = cli("strategy", "create", "--workflow", "patch", "--all", "--format", "json").json()["id"]
    res = cli("target", "delete", "a", "--ignore-missing")
    assert res.code == 2 and f"target a: is in active strategy {sid}" in res.err, res.text
    res = cli("strategy", "delete", str(sid), "--ignore-missing", "--format", "json")
    assert res.code == 0 and res.json() == {"id": sid, "deleted": True}, res.text
    res = cli("target", "delete", "a", "--ignore-missing", "--format", "json")
    assert res.code == 0 and res.json() == {"name": "a", "deleted": True}, res.text


@pytest.mark.parametrize(
    "args",
    [
        ["target", "add", "e5", "--label", "tier="],
        ["target", "set", "a", "--label", "tier= "],
        ["target", "list", "--label", "tier="],
        ["strategy", "create", "--workflow", "patch", "--label", "tier="],
    ],
)
def test_an_empty_label_value_is_refused_as_in_a_file(cli: Cli, args: list[str]) -> None:
    """`--label tier=` stored an empty label, which a YAML file's `tier:` is refused as."""
    assert cli("target", "add", "a", "--label", "tier=x").code == 0
    res = cli(*args)
    assert res.code == 2, res.text
    assert res.err == "error: --label: tier: no value (give one, or leave it out)\n", res.text
    assert cli("target", "list", "--format", "json").json()[0]["labels"] == {"tier": "x"}


def test_target_delete_names_the_strategies_with_its_history(cli: Cli) -> None:
    """It said "has history in 2 strategies" without which, where `group delete` names
    them: the operator had to find them to delete them first."""
    assert cli("target", "add", "a").code == 0
    for _ in range(2):
        sid = cli("strategy", "create", "--workflow", "patch", "--all", "--format", "json")
        assert cli("strategy", "apply", str(sid.json()["id"]), "--wait").code == 0
    res = cli("target", "delete", "a")
    assert res.code == 2, res.text
    assert res.err == (
        "error: target a: has history in 2 strategies (1, 2); delete those strategies first\n"
    )


def _one_step_ended(cli: Cli, db_path: Path, stop: bool = False) -> int:
    """An applying strategy over a, b and c (max parallel 1) whose step of a has ended
    complete, of b is in flight, of c not started (the rows as a conductor leaves them)."""
    add(cli, "a", "b", "c")
    sid = create(cli, "--all", "--max-parallel", "1", *(["--stop-on-failure"] if stop else []))
    assert cli("strategy", "apply", str(sid)).code == 0
    with sqlite3.connect(db_path) as conn:
        for name, state in (("a", "complete"), ("b", "updating-patches")):
            conn.execute(
                "UPDATE steps SET state = ? WHERE strategy_id = ? AND target_id = "
                "(SELECT id FROM targets WHERE name = ?)",
                (state, sid, name),
            )
    return sid


def test_unmanaging_a_target_whose_step_is_still_to_come_warns(cli: Cli, db_path: Path) -> None:
    """It fails when its turn comes, and the strategy then ends failed (or stops): the
    command said only "target w2 is unmanaged"."""
    sid = _one_step_ended(cli, db_path, stop=True)
    res = cli("target", "unmanage", "c")
    assert res.code == 0
    assert res.out == "target c is unmanaged\n"
    assert res.err == (
        f"warning: target c: its step in strategy {sid} (applying) has not started: it fails "
        "when its turn comes (the strategy then ends failed); strategy "
        f"{sid} stops on failure: its steps not started then end aborted; 'fleetwave target "
        "manage c' before then lets it run\n"
    )
    res = cli("target", "unmanage", "c", "--format", "json")
    assert res.json() == {
        "name": "c",
        "managed": False,
        "steps_to_fail": [{"strategy": sid, "state": "applying", "stops": "on failure"}],
    }
    # in flight or ended: the step goes on, or is over; nothing to warn of
    for name in ("a", "b"):
        res = cli("target", "unmanage", name)
        assert (res.code, res.err) == (0, ""), res.text
    assert cli("target", "manage", "c").err == ""


def test_a_target_whose_step_has_ended_may_change_but_not_be_deleted(
    cli: Cli, db_path: Path
) -> None:
    """Its step is done: the refusal asked for the rollout to be aborted."""
    sid = _one_step_ended(cli, db_path)
    res = cli("target", "set", "a", "--set", "latency_ms=5", "--format", "json")
    assert res.code == 0, res.text
    after = cli("target", "show", "a", "--format", "json").json()
    assert after["settings"] == {"latency_ms": 5}
    assert one_line(cli("target", "delete", "a")) == (
        f"error: target a: its step in active strategy {sid} (applying) has ended "
        "(complete), and the strategy keeps its history: the target can be deleted with "
        f"the strategy's history once the strategy has ended (2 of 3 steps still to go; "
        f"'fleetwave strategy delete {sid}' then)"
    )
    # in flight: unmanaging it would not keep the rollout off it, so it is not offered
    line = one_line(cli("target", "set", "b", "--set", "latency_ms=5"))
    assert f"active strategy {sid} (applying)" in line and "unmanage" not in line
    line = one_line(cli("target", "set", "c", "--set", "latency_ms=5"))
    assert line.endswith(
        "'fleetwave target unmanage c' keeps the rollout off it meanwhile (its step fails "
        "when its turn comes)"
    )
    assert "abort" in one_line(cli("target", "delete", "b"))


def test_an_import_that_would_fence_off_a_managed_target_says_it_does_not(
    cli: Cli, tmp_path: Path
) -> None:
    """managed=false for a target already there was ignored, and the import said
    "unchanged": an inventory meant to fence a target off did not, without a word."""
    first = tmp_path / "a.csv"
    first.write_text("name,latency_ms\nm1,5\nm2,5\n", encoding="utf-8")
    assert cli("target", "import", str(first)).code == 0
    again = tmp_path / "b.csv"
    again.write_text("name,latency_ms,managed\nm1,5,false\nm2,5,true\nm3,5,false\n")
    res = cli("target", "import", str(again))
    assert res.code == 0
    assert res.out == f"1 target imported from {again}; 2 already there, unchanged\n"
    assert res.err == (
        "warning: 1 target given as unmanaged, already there managed, stay managed (m1): "
        "whether a target is managed is the operator's; 'fleetwave target unmanage NAME' "
        "keeps a rollout off one\n"
    )
    res = cli("target", "import", str(again), "--format", "json")
    assert res.json()["managed_kept"] == ["m1"]
    shown = {t["name"]: t["managed"] for t in cli("target", "list", "--format", "json").json()}
    assert shown == {"m1": True, "m2": True, "m3": False}
