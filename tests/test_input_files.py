"""Import and workflow files, and typed values: encodings and BOMs, YAML and CSV errors
in one line naming file and line, CSV rows with extra fields, ``--set`` and CSV cells
read strictly (yes stays text, 1e3 is a number), and YAML workflows whose timeouts,
state names, backoffs, keys and versions are checked. From an input audit.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from cli_harness import Cli, import_refused, one_line, targets
from fleetwave.cli.parsing import read_text_file, scalar
from fleetwave.domain.errors import InputError
from fleetwave.domain.workflow import WorkflowError
from fleetwave.domain.yaml_workflow import parse_workflow_yaml


def workflow_names(cli: Cli) -> set[str]:
    res = cli("workflow", "list", "--format", "json")
    assert res.code == 0, res.text
    return {w["name"] for w in res.json()}


# -- encodings ------------------------------------------------------------------------------


@pytest.mark.parametrize("suffix", [".csv", ".yaml"])
def test_import_of_a_file_that_is_not_utf8_is_one_line(
    cli: Cli, tmp_path: Path, suffix: str
) -> None:
    f = tmp_path / f"latin{suffix}"
    body = "name\nok\ncaf\xe9\n" if suffix == ".csv" else "- name: ok\n- name: caf\xe9\n"
    f.write_bytes(body.encode("latin-1"))
    line = one_line(cli("target", "import", str(f)))
    where = "line 3, column 4" if suffix == ".csv" else "line 2, column 12"
    excel = " (Excel: 'CSV UTF-8')" if suffix == ".csv" else ""  # a CSV's usual source
    assert line == f"error: {f}: not UTF-8 text (byte 0xe9 at {where}); save it as UTF-8{excel}"
    assert targets(cli) == {}


@pytest.mark.parametrize(
    ("suffix", "body"),
    [
        (".csv", "name,group,latency_ms\nb1,,5\n"),
        (".yaml", "- name: b1\n  settings: {latency_ms: 5}\n"),
    ],
)
def test_import_takes_a_utf8_file_with_a_byte_order_mark(
    cli: Cli, tmp_path: Path, suffix: str, body: str
) -> None:
    """Excel's "CSV UTF-8" starts with a BOM: the first column was '\\ufeffname'."""
    f = tmp_path / f"excel{suffix}"
    f.write_bytes(b"\xef\xbb\xbf" + body.encode())
    res = cli("target", "import", str(f))
    assert res.code == 0, res.text
    assert targets(cli)["b1"]["settings"] == {"latency_ms": 5}


def test_read_text_file_names_the_byte_line_and_column(tmp_path: Path) -> None:
    f = tmp_path / "w.yaml"
    f.write_bytes(b"name: w\ndescription: caf\xe9\n")
    with pytest.raises(InputError, match=r"not UTF-8 text \(byte 0xe9 at line 2, column 17\)"):
        read_text_file(f)
    f.write_bytes(b"\xef\xbb\xbfname: w\n")
    assert read_text_file(f) == "name: w\n"


@pytest.mark.parametrize("command", ["validate", "add"])
def test_workflow_file_that_is_not_utf8_is_one_line(cli: Cli, tmp_path: Path, command: str) -> None:
    f = tmp_path / "latin.yaml"
    f.write_bytes("name: w\ndescription: caf\xe9\nstates:\n  - name: a\n".encode("latin-1"))
    db = {} if command == "add" else {"db": None}
    line = one_line(cli("workflow", command, str(f), **db))
    assert line.startswith(f"error: {f}: not UTF-8 text (byte 0xe9 at line 2"), line
    assert "w" not in workflow_names(cli)


def test_a_utf16_workflow_file_is_named_as_such_without_excel(cli: Cli, tmp_path: Path) -> None:
    """A UTF-16 YAML file (Windows editors) was told to use Excel's 'CSV UTF-8'."""
    f = tmp_path / "w16.yaml"
    f.write_bytes("name: w\nstates:\n  - name: a\n".encode("utf-16"))
    line = one_line(cli("workflow", "validate", str(f), db=None))
    assert line.endswith("it is UTF-16 (a byte-order mark says so); save it as UTF-8"), line


def test_a_workflow_file_that_is_a_device_is_not_called_missing(cli: Cli) -> None:
    """`workflow validate /dev/null` said it does not exist."""
    res = cli("workflow", "validate", "/dev/null", db=None)
    assert one_line(res) == (
        "error: FILE: /dev/null is not a regular file (a device, pipe or socket)"
    )


def test_a_workflow_file_given_to_strategy_create_says_to_add_it_first(
    cli: Cli, tmp_path: Path
) -> None:
    cli("target", "add", "a1")
    res = cli("strategy", "create", "--workflow", "site.yaml", "--all")
    line = one_line(res)
    assert line.startswith("error: --workflow: unknown workflow 'site.yaml' (known: "), line
    assert line.endswith(
        "; to use a workflow file, store it first with 'fleetwave workflow add "
        "site.yaml', then give its name"
    ), line
    res = cli("strategy", "create", "--workflow", "nosuch", "--all")
    assert "workflow add" not in res.text  # a plain unknown name gets no file hint


# -- YAML syntax, CSV shape -----------------------------------------------------------------


def test_yaml_syntax_error_in_target_import_is_one_line_with_line_and_column(
    cli: Cli, tmp_path: Path
) -> None:
    f = tmp_path / "fleet.yaml"
    line = import_refused(cli, f, "- name: a\n- name: [unclosed\n")
    assert line.startswith(f"error: {f}: not valid YAML at line 3, column 1: "), line


def test_yaml_import_refuses_a_key_given_twice(cli: Cli, tmp_path: Path) -> None:
    f = tmp_path / "fleet.yaml"
    line = import_refused(cli, f, "- name: a\n- name: b\n  name: c\n")
    assert line == (
        f"error: {f}: not valid YAML at line 3, column 3: duplicate key 'name' (also on line 2)"
    )


def test_csv_row_with_more_fields_than_the_header_is_refused(cli: Cli, tmp_path: Path) -> None:
    f = tmp_path / "fleet.csv"
    line = import_refused(cli, f, "name,group\nn1,\nn2,,latency_ms=5\n")
    assert line == f"error: {f} line 3: 3 fields, but the first line names 2 columns"


def test_csv_trailing_empty_fields_lose_nothing_and_are_taken(cli: Cli, tmp_path: Path) -> None:
    f = tmp_path / "fleet.csv"
    f.write_text("name,latency_ms\nn1,5,\nn2,6,,\n", encoding="utf-8")
    res = cli("target", "import", str(f))
    assert res.code == 0, res.text
    assert targets(cli)["n2"]["settings"] == {"latency_ms": 6}


def test_csv_header_naming_a_column_twice_is_refused(cli: Cli, tmp_path: Path) -> None:
    f = tmp_path / "fleet.csv"
    line = import_refused(cli, f, "name,latency_ms,latency_ms\nn1,5,6\n")
    assert line == f"error: {f} line 1: column 'latency_ms' appears twice"


def test_csv_the_csv_module_refuses_is_one_line(cli: Cli, tmp_path: Path) -> None:
    f = tmp_path / "fleet.csv"
    line = import_refused(cli, f, "name,fail_at\nn1,\nn2," + "x" * 200_000 + "\n")
    assert line.startswith(f"error: {f} line 3: not valid CSV: field larger than"), line
    line = import_refused(cli, f, "name\nn1\nn\x002\n")
    assert line.startswith(f"error: {f} line 3: name: 'n\\x002' is not allowed"), line


# -- errors found at the database name the file and line ----------------------------------


def test_unknown_group_names_the_csv_line(cli: Cli, tmp_path: Path) -> None:
    f = tmp_path / "fleet.csv"
    line = import_refused(cli, f, "name,group\nn1,\nn2,nosuch\n")
    assert line == f"error: {f} line 3: target n2: group: no group named 'nosuch'"


def test_existing_target_names_the_line_of_the_first_clash(cli: Cli, tmp_path: Path) -> None:
    for name in ("sc-001", "sc-003"):
        assert cli("target", "add", name, "--set", "latency_ms=5").code == 0
    before = targets(cli)
    f = tmp_path / "fleet.csv"
    f.write_text("name\nnew1\nsc-003\nsc-001\n", encoding="utf-8")
    line = one_line(cli("target", "import", str(f)))
    differs = 'another definition (settings: {"latency_ms": 5} stored, {} given)'
    assert line == (
        f"error: {f} line 3: target sc-003: already exists with {differs} and 1 more; "
        "'fleetwave target set sc-003' changes it"
    )
    y = tmp_path / "fleet.yaml"
    y.write_text("- name: new1\n- name: sc-001\n", encoding="utf-8")
    line = one_line(cli("target", "import", str(y)))
    how = "; 'fleetwave target set sc-001' changes it"
    assert line == f"error: {y} targets[1]: target sc-001: already exists with {differs}{how}"
    assert targets(cli) == before
    # target add keeps its own message (no file)
    assert one_line(cli("target", "add", "sc-001")) == (
        f"error: target sc-001: already exists with {differs}{how}"
    )


def test_an_inventory_imported_again_adds_what_is_new_and_leaves_the_rest(
    cli: Cli, tmp_path: Path
) -> None:
    """A script that imports its inventory again (grown by a few rows) was refused
    ("already exists", exit 2, the same code as a typo): the same definition again is
    left as it is, and only another definition is refused. So for `target add` and
    `group add` run twice. Whether a target is managed is the operator's, not compared."""
    assert cli("group", "add", "east", "--max-parallel", "5").code == 0
    again = cli("group", "add", "east", "--max-parallel", "5")
    assert (again.code, again.out) == (0, "group east already exists, unchanged\n")
    assert one_line(cli("group", "add", "east", "--max-parallel", "4")) == (
        "error: group 'east' already exists with other settings (max-parallel 5 stored, "
        "4 given); 'fleetwave group set east' changes them"
    )
    f = tmp_path / "fleet.csv"
    f.write_text("name,group,latency_ms\nb,east,7\nc,east,7\n", encoding="utf-8")
    assert cli("target", "import", str(f)).out == f"2 targets imported from {f}\n"
    assert cli("target", "unmanage", "b").code == 0  # an operator's, during an incident
    f.write_text("name,group,latency_ms\nb,east,7\nc,east,7\nd,,1\n", encoding="utf-8")
    res = cli("target", "import", str(f))
    assert (res.code, res.out) == (0, f"1 target imported from {f}; 2 already there, unchanged\n")
    listed = targets(cli)
    assert sorted(listed) == ["b", "c", "d"]
    assert listed["b"]["managed"] is False  # left as the operator set it
    before = targets(cli)
    f.write_text("name,group,latency_ms\nb,east,7\nc,,7\ne,,1\n", encoding="utf-8")
    assert one_line(cli("target", "import", str(f))) == (
        f"error: {f} line 3: target c: already exists with another definition "
        "(group: east stored, none given); 'fleetwave target set c' changes it"
    )
    assert targets(cli) == before  # nothing written, not even e
    res = cli("target", "add", "d", "--set", "latency_ms=1")
    assert (res.code, res.out) == (0, "target d already exists, unchanged\n")


def test_an_inventory_imported_again_keeps_labels_its_file_does_not_give(
    cli: Cli, tmp_path: Path
) -> None:
    """Found by an acceptance pass: a CSV file cannot carry labels, so once an operator
    labelled a target (`target set --label`), importing the grown file again was refused
    ("labels: {"tier": "canary"} stored, {} given") and the new rows never came in. A
    source that gives no labels (a CSV file, a YAML item without `labels:`) keeps the
    stored ones, as it keeps whether a target is managed; YAML labels given are compared."""
    f = tmp_path / "fleet.csv"
    f.write_text("name,latency_ms\na,7\nb,7\n", encoding="utf-8")
    assert cli("target", "import", str(f)).code == 0
    assert cli("target", "set", "a", "--label", "tier=canary").code == 0
    f.write_text("name,latency_ms\na,7\nb,7\nc,7\n", encoding="utf-8")
    res = cli("target", "import", str(f))
    assert (res.code, res.out) == (0, f"1 target imported from {f}; 2 already there, unchanged\n")
    assert targets(cli)["a"]["labels"] == {"tier": "canary"}
    y = tmp_path / "fleet.yaml"
    y.write_text(
        "- {name: a, settings: {latency_ms: 7}}\n- {name: d, labels: {tier: canary}}\n",
        encoding="utf-8",
    )
    res = cli("target", "import", str(y))
    assert (res.code, res.out) == (0, f"1 target imported from {y}; 1 already there, unchanged\n")
    y.write_text("- {name: a, settings: {latency_ms: 7}, labels: {tier: main}}\n", encoding="utf-8")
    assert one_line(cli("target", "import", str(y))) == (
        f"error: {y} targets[0]: target a: already exists with another definition (labels: "
        '{"tier": "canary"} stored, {"tier": "main"} given); \'fleetwave target set a\' changes it'
    )
    assert targets(cli)["a"]["labels"] == {"tier": "canary"}


@pytest.mark.parametrize(
    ("name", "body", "problem"),
    [
        ("fleet.csv", "name,group\n", "no targets (the file has only its header line)"),
        ("fleet.yaml", "[]\n", "no targets (the list is empty)"),
        ("fleet.yaml", "targets: []\n", "no targets (the list is empty)"),
    ],
)
def test_a_file_with_no_targets_is_named(
    cli: Cli, tmp_path: Path, name: str, body: str, problem: str
) -> None:
    f = tmp_path / name
    f.write_text(body, encoding="utf-8")
    assert one_line(cli("target", "import", str(f))) == f"error: {f}: {problem}"


def test_a_directory_is_not_called_missing(cli: Cli, tmp_path: Path) -> None:
    d = tmp_path / "dir.csv"
    d.mkdir()
    assert "is a directory" in one_line(cli("target", "import", str(d)))


# -- typed values ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("20", 20),
        ("-3", -3),
        ("0", 0),
        ("0.5", 0.5),
        ("1e3", 1000.0),
        ("1.5e3", 1500.0),
        ("true", True),
        ("FALSE", False),
        ("True", True),
        ("yes", "yes"),
        ("no", "no"),
        ("on", "on"),
        ("off", "off"),
        ("1:30", "1:30"),
        ("0x10", "0x10"),
        ("010", "010"),
        ("1_000", "1_000"),
        ("null", "null"),
        (".inf", ".inf"),
        ("1e999", "1e999"),
        ("nan", "nan"),
        ("", ""),
    ],
)
def test_scalar_reads_numbers_and_true_false_strictly(text: str, value: Any) -> None:
    got = scalar(text)
    assert got == value and type(got) is type(value)


def test_set_values_are_not_yaml_1_1(cli: Cli) -> None:
    res = cli(
        "target",
        "add",
        "t1",
        "--set",
        "remote_state=yes",
        "--set",
        "fail_at=on",
        "--set",
        "latency_ms=1e3",
        "--set",
        "failure_rate=5e-1",
        "--set",
        "already_done=off",
    )
    assert res.code == 0, res.text
    assert targets(cli)["t1"]["settings"] == {
        "remote_state": "yes",
        "fail_at": "on",
        "latency_ms": 1000.0,
        "failure_rate": 0.5,
        "already_done": "off",
    }


@pytest.mark.parametrize("value", ["1:30", "0x10"])
def test_set_values_yaml_1_1_would_have_read_as_numbers_are_refused(cli: Cli, value: str) -> None:
    line = one_line(cli("target", "add", "t1", "--set", f"latency_ms={value}"))
    assert line == f"error: target t1: sim setting latency_ms: '{value}' is not a number"
    assert targets(cli) == {}


def test_csv_cells_are_read_like_set_values(cli: Cli, tmp_path: Path) -> None:
    f = tmp_path / "fleet.csv"
    f.write_text(
        "name,remote_state,fail_at,latency_ms,already_done\nc1,no,on,1.5e3,yes\n",
        encoding="utf-8",
    )
    assert cli("target", "import", str(f)).code == 0
    assert targets(cli)["c1"]["settings"] == {
        "remote_state": "no",
        "fail_at": "on",
        "latency_ms": 1500.0,
        "already_done": "yes",
    }
    g = tmp_path / "bad.csv"
    g.write_text("name,latency_ms\nc2,1:30\n", encoding="utf-8")
    assert "latency_ms: '1:30' is not a number" in one_line(cli("target", "import", str(g)))


def test_yaml_import_keeps_yaml_types_but_yes_no_on_off_are_text(cli: Cli, tmp_path: Path) -> None:
    """A sim state may be called 'on'; remote_state: no used to be false (and then did
    nothing at all)."""
    f = tmp_path / "fleet.yaml"
    f.write_text(
        "- name: y1\n"
        "  settings: {fail_at: on, remote_state: no, already_done: yes, latency_ms: 1e3,"
        " failure_rate: 0.5}\n"
        "- name: y2\n"
        "  managed: no\n"
        "  settings: {already_done: true, latency_ms: 7}\n"
        "- name: y3\n"
        "  managed: off\n",
        encoding="utf-8",
    )
    res = cli("target", "import", str(f))
    assert res.code == 0, res.text
    got = targets(cli)
    assert got["y1"]["settings"] == {
        "fail_at": "on",
        "remote_state": "no",
        "already_done": "yes",
        "latency_ms": 1000.0,
        "failure_rate": 0.5,
    }
    assert got["y2"]["settings"] == {"already_done": True, "latency_ms": 7}
    assert got["y2"]["managed"] is False
    assert got["y3"]["managed"] is False  # 'off' is text now, and still means unmanaged


def test_strategy_timeout_takes_an_exponent(cli: Cli) -> None:
    assert cli("target", "add", "t1").code == 0
    res = cli(
        "strategy", "create", "--workflow", "patch", "--all", "--timeout", "finishing=1.5e3",
        "--format", "json",
    )  # fmt: skip
    assert res.code == 0, res.text
    assert res.json()["options"]["timeouts_s"] == {"finishing": 1500.0}


# -- YAML workflows -------------------------------------------------------------------------

STRICT_BAD = {
    "timeout true": (
        "name: w\nstates:\n  - name: a\n    timeout_s: true\n",
        "states[0] (a): timeout_s: expected a number, got true",
    ),
    "attempts true": (
        "name: w\nstates:\n  - name: a\n    retry: {attempts: true}\n",
        "states[0] (a): retry: attempts: expected a number, got true",
    ),
    "state name with a space": (
        "name: w\nstates:\n  - name: a b\n",
        "states[0] (a b): name: 'a b' is not allowed; use letters, digits and _ . -",
    ),
    "state name with a newline": (
        'name: w\nstates:\n  - name: "a\\nb"\n',
        "states[0] ('a\\nb'): name: 'a\\nb' is not allowed",
    ),
    "backoff above its cap": (
        "name: w\nstates:\n  - name: a\n    retry: {backoff_s: 100, backoff_max_s: 5}\n",
        "states[0] (a): retry: backoff_s (100) must not exceed backoff_max_s (5)",
    ),
    "backoff above the default cap": (
        "name: w\nstates:\n  - name: a\n    retry: {backoff_s: 600}\n",
        "states[0] (a): retry: backoff_s (600) must not exceed backoff_max_s (300, the default)",
    ),
    "key twice": (
        "name: x\nname: y\nstates:\n  - name: a\n",
        "not valid YAML at line 2, column 1: duplicate key 'name' (also on line 1)",
    ),
    "timeout above 30 days": (
        "name: w\nstates:\n  - name: a\n    timeout_s: 2592001\n",
        "states[0] (a): timeout_s: at most 2592000 seconds (30 days), got 2592001",
    ),
    "poll interval above 30 days": (
        "name: w\nstates:\n  - name: a\n    mode: poll\n    poll_interval_s: 1e9\n",
        "states[0] (a): poll_interval_s: at most 2592000 seconds (30 days)",
    ),
}


@pytest.mark.parametrize(("text", "problem"), list(STRICT_BAD.values()), ids=list(STRICT_BAD))
def test_a_new_workflow_is_checked_strictly(text: str, problem: str) -> None:
    with pytest.raises(WorkflowError) as exc:
        parse_workflow_yaml(text, source="wf.yaml", strict=True)
    assert str(exc.value).startswith(f"wf.yaml: {problem}")
    assert "\n" not in str(exc.value)


@pytest.mark.parametrize("text", [t for t, _ in STRICT_BAD.values()], ids=list(STRICT_BAD))
def test_a_stored_workflow_still_loads_as_before(text: str) -> None:
    """Workflows stored, and strategies created, before these checks must still load: a
    conductor fails a strategy whose workflow copy no longer parses."""
    assert parse_workflow_yaml(text, source="stored workflow w").states


def test_the_longest_timeout_and_a_merge_key_override_are_fine() -> None:
    wf = parse_workflow_yaml(
        "name: w\nstates:\n  - &a {name: a, timeout_s: 2592000}\n  - <<: *a\n    name: b\n",
        strict=True,
    )
    assert [s.timeout_s for s in wf.states] == [2592000.0, 2592000.0]


@pytest.mark.parametrize("command", ["validate", "add"])
def test_a_version_the_database_cannot_keep_is_refused(
    cli: Cli, tmp_path: Path, command: str
) -> None:
    f = tmp_path / "wf.yaml"
    f.write_text("name: w\nversion: 99999999999999999999\nstates:\n  - name: a\n")
    db = {} if command == "add" else {"db": None}
    line = one_line(cli("workflow", command, str(f), **db))
    assert line == f"error: {f}: version: at most 2147483647, got 99999999999999999999"
    assert "w" not in workflow_names(cli)
    f.write_text("name: w\nversion: 2147483647\nstates:\n  - name: a\n")
    assert cli("workflow", command, str(f), **db).code == 0


@pytest.mark.parametrize(("text", "problem"), list(STRICT_BAD.values()), ids=list(STRICT_BAD))
@pytest.mark.parametrize("command", ["validate", "add"])
def test_workflow_validate_and_add_refuse_what_strict_refuses(
    cli: Cli, tmp_path: Path, command: str, text: str, problem: str
) -> None:
    f = tmp_path / "wf.yaml"
    f.write_text(text, encoding="utf-8")
    db = {} if command == "add" else {"db": None}
    line = one_line(cli("workflow", command, str(f), **db))
    assert line.startswith(f"error: {f}: {problem}"), line
    assert not workflow_names(cli) & {"w", "x", "y"}


# -- what an import used to take, or explain wrongly (session 11) -------------------------


@pytest.mark.parametrize(
    ("text", "said"),
    [
        (
            'name,group\na1,"east\na2,west\n',
            # was: a bad name 'east\na2,west\n'
            "line 2: not valid CSV: a quote opened in this record is never closed",
        ),
        (
            "host,site\na1,east\n",
            "line 1: no 'name' column (the first line reads 'host', 'site'); the first line "
            "must name the columns: name, then any of group, driver, managed, and driver "
            "settings",
        ),
        ("name,,latency_ms\na1,,5\n", "line 1: column 2 has no name (an extra comma?)"),
        ("name,labels\na1,x\n", "line 1: labels: not a CSV column"),
        (
            "name,group,latency_ms\na1,east,5\na2\n",
            "line 3: 1 field, but the first line names 3 columns (leave a field empty",
        ),
    ],
    ids=["open-quote", "no-name-column", "empty-column", "labels-column", "short-row"],
)
def test_csv_shape_problems_say_what_is_wrong(
    cli: Cli, tmp_path: Path, text: str, said: str
) -> None:
    f = tmp_path / "fleet.csv"
    line = import_refused(cli, f, text)
    assert line.startswith(f"error: {f} "), line
    assert said in line, line


def test_a_decomposed_name_is_told_to_be_written_composed(cli: Cli, tmp_path: Path) -> None:
    """macOS may save 'é' as 'e' and a combining accent: refused as if the name used
    a forbidden character, with no word of why."""
    decomposed = "cafe\u0301-1"
    line = import_refused(cli, tmp_path / "fleet.csv", f"name\n{decomposed}\n")
    assert "is written with combining accents (decomposed Unicode" in line, line
    assert line.endswith("write it composed: 'café-1'"), line
    res = cli("target", "add", decomposed)
    assert res.code == 2 and "write it composed" in res.text


def test_yaml_target_file_extra_top_level_fields_and_label_values(cli: Cli, tmp_path: Path) -> None:
    """An extra top-level field was ignored (a misplaced 'settings:' did nothing), a
    label true was stored as Python's 'True', and one with no value as 'None'."""
    f = tmp_path / "fleet.yaml"
    line = import_refused(cli, f, "targets:\n  - name: a1\nsettings: {latency_ms: 5}\n")
    assert line.endswith(
        "settings: unknown top-level field (the file is a list of targets, or one 'targets:' list)"
    ), line
    line = import_refused(cli, f, "- name: a1\n  labels: {rack: }\n")
    assert line.endswith("targets[0] (a1): labels: rack: no value (give one, or leave it out)")
    f.write_text("- name: a1\n  labels: {canary: true, tier: 2}\n", encoding="utf-8")
    assert cli("target", "import", str(f)).code == 0
    assert cli("target", "add", "a2", "--label", "canary=true").code == 0
    got = targets(cli)
    assert got["a1"]["labels"] == {"canary": "true", "tier": "2"}
    assert got["a2"]["labels"]["canary"] == got["a1"]["labels"]["canary"]


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ('    timeout_s: "300"\n', "timeout_s: expected a number, got the text '300' (unquote it)"),
        ("    retry: {attempts: '2'}\n", "attempts: expected a number, got the text '2'"),
        ('    retry: {backoff_s: "1.5"}\n', "backoff_s: expected a number, got the text '1.5'"),
    ],
)
def test_a_quoted_number_in_a_workflow_is_refused(
    cli: Cli, tmp_path: Path, text: str, problem: str
) -> None:
    """'1:30' was refused where a number goes, yet "300" (quoted) was read as 300."""
    wf = tmp_path / "wf.yaml"
    wf.write_text("name: q\nstates:\n  - name: a\n" + text, encoding="utf-8")
    line = one_line(cli("workflow", "validate", str(wf), db=None))
    assert f"states[0] (a): {'' if 'timeout' in problem else 'retry: '}{problem}" in line, line
    wf.write_text('name: q\nversion: "2"\nstates:\n  - name: a\n', encoding="utf-8")
    assert "version: expected a number, got the text '2'" in one_line(
        cli("workflow", "add", str(wf))
    )


def test_a_quoted_number_in_a_target_file_is_refused(cli: Cli, tmp_path: Path) -> None:
    """Stored as text, the same target given as --set latency_ms=5 read as another
    definition of it ("already exists with another definition")."""
    rows = tmp_path / "t.yaml"
    rows.write_text(
        "targets:\n  - {name: y1, settings: {latency_ms: 5}}\n"
        '  - {name: y2, settings: {failure_rate: "0.5"}}\n',
        encoding="utf-8",
    )
    line = one_line(cli("target", "import", str(rows)))
    assert line.endswith(
        "targets[1] (y2): sim setting failure_rate: the text '0.5' where a number goes (unquote it)"
    ), line
    assert cli("target", "list", "--format", "json").json() == []
    # typed where numbers are typed: --set, a CSV column, an unquoted YAML number
    assert cli("target", "add", "y1", "--set", "latency_ms=5").code == 0
    rows.write_text("targets:\n  - {name: y1, settings: {latency_ms: 5}}\n", encoding="utf-8")
    res = cli("target", "import", str(rows))
    assert res.code == 0 and "1 already there, unchanged" in res.text, res.text
