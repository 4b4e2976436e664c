"""Target and group names: one rule for ``target add``, ``target import`` (CSV and YAML)
and ``group add`` (no spaces, commas, newlines, leading blanks, or 5,000 characters);
YAML name, group and driver must be text. From an input audit.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import insert

from cli_harness import Cli, assert_rejected, import_refused, one_line, targets
from fleetwave.domain.models import NAME_MAX, name_problem
from fleetwave.store.db import open_store
from fleetwave.store.schema import groups as groups_table
from fleetwave.store.schema import targets as targets_table

RULE = "letters and digits"


def groups(cli: Cli) -> dict[str, dict[str, Any]]:
    res = cli("group", "list", "--format", "json")
    assert res.code == 0, res.text
    return {g["name"]: g for g in res.json()}


BAD_NAMES = {
    "space": "bad name",
    "comma": "a,b",
    "newline": "a\nb",
    "leading space": " lead",
    "trailing space": "lead ",
    "tab": "a\tb",
    "leading dot": ".x",
    "leading underscore": "_x",
    "slash": "a/b",
    "quote": "it's",
    "zero-width joiner": "a\u200db",
}


@pytest.mark.parametrize("name", list(BAD_NAMES.values()), ids=list(BAD_NAMES))
def test_target_add_refuses_a_name_outside_the_rule(cli: Cli, name: str) -> None:
    line = one_line(cli("target", "add", name))
    assert line.startswith("error: target name: "), line
    assert "is not allowed" in line and RULE in line
    assert targets(cli) == {}


@pytest.mark.parametrize("name", list(BAD_NAMES.values()), ids=list(BAD_NAMES))
def test_group_add_refuses_a_name_outside_the_rule(cli: Cli, name: str) -> None:
    line = one_line(cli("group", "add", name))
    assert line.startswith("error: group name: "), line
    assert "is not allowed" in line and RULE in line
    assert groups(cli) == {}


def test_empty_names_name_the_field(cli: Cli) -> None:
    assert one_line(cli("target", "add", "")) == "error: target name: must not be empty"
    assert one_line(cli("group", "add", "")) == "error: group name: must not be empty"
    assert targets(cli) == {} and groups(cli) == {}


def test_a_name_longer_than_the_column_is_refused_without_echoing_it_all(cli: Cli) -> None:
    long = "n" * 5000
    for args, field in ((("target", "add", long), "target"), (("group", "add", long), "group")):
        line = one_line(cli(*args))
        assert line.startswith(f"error: {field} name: "), line
        assert "5000 characters long" in line and f"1-{NAME_MAX} characters" in line
        assert len(line) < 400
    # the longest allowed name is fine
    assert cli("target", "add", "n" * NAME_MAX).code == 0
    assert cli("group", "add", "g" * NAME_MAX).code == 0


@pytest.mark.parametrize(
    "name", ["site-1", "node_01.eu-west:az1@dc2", "A", "9lives", "节点一", "café-2"]
)
def test_names_inside_the_rule_are_accepted(cli: Cli, name: str) -> None:
    assert name_problem(name) is None
    assert cli("group", "add", name).code == 0
    assert cli("target", "add", name, "--group", name).code == 0
    assert targets(cli)[name]["group"] == name


def test_csv_import_refuses_a_bad_name_naming_the_line(cli: Cli, tmp_path: Path) -> None:
    f = tmp_path / "fleet.csv"
    line = import_refused(cli, f, 'name,group\nok1,\n"bad name",\nok2,\n')
    assert line.startswith(f"error: {f} line 3: name: 'bad name' is not allowed"), line


def test_csv_import_refuses_a_comma_or_newline_inside_a_quoted_name(
    cli: Cli, tmp_path: Path
) -> None:
    f = tmp_path / "fleet.csv"
    f.write_text('name\nok1\n"a,b"\n', encoding="utf-8")
    assert_rejected(cli("target", "import", str(f)), "line 3", "'a,b'", "not allowed")
    line = import_refused(cli, f, 'name\nok1\n"a\nb"\n')
    assert "line 4" in line and "'a\\nb' is not allowed" in line  # the record ends on line 4


@pytest.mark.parametrize(
    ("body", "words"),
    [
        ("- name: ok\n- name: [m2]\n", ["targets[1]: name: expected text, got a list"]),
        ("- name: {a: 1}\n", ["targets[0]: name: expected text, got a mapping"]),
        ("- name: true\n", ["targets[0]: name: expected text, got true"]),
        ("- name: 1.5\n", ["targets[0]: name: expected text", "quote it"]),
        ("- name: ok\n- name: bad name\n", ["targets[1]: name: 'bad name' is not allowed"]),
        ("- name: ok\n  group: [a]\n", ["targets[0] (ok): group: expected text, got a list"]),
        ("- name: ok\n  group: {a: 1}\n", ["targets[0] (ok): group: expected text, got a mapping"]),
        ("- name: ok\n  group: false\n", ["targets[0] (ok): group: expected text, got false"]),
        ("- name: ok\n  driver: [sim]\n", ["targets[0] (ok): driver: expected text, got a list"]),
        ("- name: ok\n  labels: {k: [1]}\n", ["targets[0] (ok): labels: k: expected text"]),
    ],
)
def test_yaml_import_name_group_and_driver_must_be_text(
    cli: Cli, tmp_path: Path, body: str, words: list[str]
) -> None:
    assert cli("group", "add", "a").code == 0
    f = tmp_path / "fleet.yaml"
    line = import_refused(cli, f, body)
    for word in words:
        assert word in line, (word, line)


def test_yaml_import_takes_a_whole_number_as_its_digits(cli: Cli, tmp_path: Path) -> None:
    assert cli("group", "add", "5").code == 0
    f = tmp_path / "fleet.yaml"
    f.write_text("- name: 42\n  group: 5\n- name: '007'\n- name: 007b\n", encoding="utf-8")
    res = cli("target", "import", str(f))
    assert res.code == 0, res.text
    got = targets(cli)
    assert sorted(got) == ["007", "007b", "42"]
    assert got["42"]["group"] == "5"


def test_yaml_group_as_a_number_that_is_not_there_names_the_row(cli: Cli, tmp_path: Path) -> None:
    f = tmp_path / "fleet.yaml"
    line = import_refused(cli, f, "- name: a\n- name: b\n  group: 5\n")
    assert line == f"error: {f} targets[1]: target b: group: no group named '5'"


def test_names_stored_before_the_rule_are_left_alone(cli: Cli, db_path: Path) -> None:
    """Rows written before the rule still work: shown, used as a group, managed, deleted."""
    store = open_store(str(db_path))
    try:
        with store.write() as conn:
            conn.execute(
                insert(groups_table).values(name="old g", max_parallel=2, apply_type="parallel")
            )
            conn.execute(
                insert(targets_table).values(
                    name="old name",
                    group_id=None,
                    driver="sim",
                    settings="{}",
                    managed=True,
                    labels="{}",
                    created_at=time.time(),
                )
            )
    finally:
        store.dispose()
    assert cli("target", "show", "old name").code == 0
    assert cli("target", "unmanage", "old name").code == 0
    assert cli("target", "add", "new1", "--group", "old g").code == 0
    assert targets(cli)["new1"]["group"] == "old g"
    assert cli("target", "delete", "old name").code == 0
    assert sorted(targets(cli)) == ["new1"]


def test_a_group_name_with_a_newline_is_shown_on_one_line(cli: Cli) -> None:
    line = one_line(cli("target", "add", "a", "--group", "x\ny"))
    assert line == "error: target a: group: no group named 'x\\ny'"
    assert targets(cli) == {}
