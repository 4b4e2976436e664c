"""Bad input at the edges of the CLI: one ``error:`` line, exit code 2, nothing written."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from cli_harness import Cli
from fleetwave.domain.models import Group


def _one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("error: ")
    return lines[0]


def test_a_bad_option_value_is_one_line_naming_the_option(cli: Cli) -> None:
    res = cli("strategy", "list", "--format", "xml")
    assert res.code == 2
    line = _one_line(res.err)
    assert "--format" in line and "xml" in line


def test_an_unknown_command_is_one_line(cli: Cli) -> None:
    res = cli("strategy", "frobnicate")
    assert res.code == 2
    assert "frobnicate" in _one_line(res.err)


def test_error_lines_are_not_wrapped_on_a_narrow_or_piped_stderr(
    cli: Cli, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "40")
    res = cli("workflow", "show", "nope")
    assert res.code == 2
    line = _one_line(res.err)
    # the argument is named as the command has it (there is no --workflow here)
    assert line.startswith("error: NAME: unknown workflow 'nope'")
    assert "sw-deploy)" in line and line.endswith("FLEETWAVE_PLUGINS")  # all on one line


def test_db_that_is_a_directory(cli: Cli, tmp_path: Path) -> None:
    res = cli("strategy", "list", db=tmp_path)
    assert res.code == 2
    assert "is a directory" in _one_line(res.err)


def test_db_that_is_not_a_database_is_left_alone(cli: Cli, tmp_path: Path) -> None:
    path = tmp_path / "notes.db"
    path.write_bytes(b"my notes, not a database\n" * 10)
    res = cli("target", "add", "a", db=path)
    assert res.code == 2
    assert "not a database" in _one_line(res.err)
    assert path.read_bytes() == b"my notes, not a database\n" * 10


def test_a_plugin_module_that_does_not_import(cli: Cli, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLEETWAVE_PLUGINS", "no_such_plugin_module")
    monkeypatch.setattr("fleetwave.domain.registry._loaded", False)
    monkeypatch.setattr("fleetwave.domain.registry._load_error", None)
    res = cli("workflow", "list")
    assert res.code == 2
    assert "FLEETWAVE_PLUGINS: cannot import 'no_such_plugin_module'" in _one_line(res.err)


@pytest.mark.parametrize(
    ("setting", "problem"),
    [
        ("already_done=maybe", "already_done: 'maybe' is not true or false (also yes/no"),
        ("fail_at=", "fail_at: '' is not a state name"),
        ("hang_at=two words", "hang_at: 'two words' is not a state name"),
        ("remote_state=", "remote_state: '' must be 1-255 printable characters"),
        ("remote_state=tab\there", "remote_state: 'tab\\there' must be 1-255 printable"),
        ("remote_state=" + "x" * 256, "must be 1-255 printable characters"),
    ],
)
def test_sim_settings_that_would_silently_do_nothing_are_refused(
    cli: Cli, setting: str, problem: str
) -> None:
    res = cli("target", "add", "site-1", "--set", setting)
    assert res.code == 2
    assert problem in _one_line(res.err)
    assert cli("target", "list", "--format", "json").json() == []


def test_a_remote_state_is_any_short_printable_text(cli: Cli) -> None:
    for i, word in enumerate(["ready-to-apply", "install failed", "42", "état: prêt"]):
        assert cli("target", "add", f"r{i}", "--set", f"remote_state={word}").code == 0


def test_already_done_words(cli: Cli) -> None:
    for i, word in enumerate(["true", "False", "yes", "no", "1", "0", "on", "off"]):
        assert cli("target", "add", f"t{i}", "--set", f"already_done={word}").code == 0


def test_an_unknown_log_level(cli: Cli, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLEETWAVE_LOG", "loud")
    res = cli("target", "list")
    assert res.code == 2
    assert "FLEETWAVE_LOG: unknown level 'loud'" in _one_line(res.err)


def test_bad_input_on_a_new_database_path_leaves_no_file(cli: Cli, tmp_path: Path) -> None:
    where = tmp_path / "new"
    where.mkdir()
    fresh = where / "new.db"
    for args in (
        ("group", "add", "g", "--max-parallel", "0"),
        ("strategy", "create", "--workflow", "nope", "--all"),
        ("target", "show", "nope"),
    ):
        res = cli(*args, db=fresh)
        assert res.code == 2, args
        assert not list(where.iterdir()), args  # not the database, nor its WAL
    assert cli("target", "add", "a", db=fresh).code == 0
    assert cli("target", "show", "nope", db=fresh).code == 2
    assert fresh.exists()  # an existing database stays, whatever the input
    assert cli("target", "show", "a", db=fresh).code == 0


def test_yaml_import_with_settings_at_the_top_level_says_where_they_go(
    cli: Cli, tmp_path: Path
) -> None:
    f = tmp_path / "fleet.yaml"
    f.write_text("- name: a\n  latency_ms: 20\n")
    res = cli("target", "import", str(f))
    assert res.code == 2
    assert "latency_ms: unknown field" in res.err and "under 'settings:'" in res.err


def test_no_command_prints_the_help_and_no_empty_error_line(cli: Cli) -> None:
    res = cli(db=None)
    assert res.code == 2
    assert "Usage" in res.out + res.err
    assert "error:" not in res.err


def test_a_new_database_that_another_process_wrote_to_is_kept(
    cli: Cli, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Removing what the failed command created must not remove someone else's work."""
    from fleetwave.cli import common
    from fleetwave.store import admin

    fresh = tmp_path / "shared.db"
    real_store_for = common.store_for

    def store_then_other_process_adds(db: str | None, *, create: bool = True) -> Any:
        store = real_store_for(db, create=create)
        admin.add_group(store, Group("east"))  # e.g. a `serve` beside this command
        return store

    monkeypatch.setattr("fleetwave.cli.groups.store_for", store_then_other_process_adds)
    res = cli("group", "add", "g", "--max-parallel", "0", db=fresh)
    assert res.code == 2
    assert fresh.exists()


@pytest.mark.parametrize(
    "args",
    [
        ("target", "list"),
        ("target", "show", "a"),
        ("target", "unmanage", "a"),
        ("group", "list"),
        ("strategy", "list"),
        ("strategy", "show", "1"),
        ("strategy", "apply", "1", "--wait"),
        ("strategy", "create", "--workflow", "patch", "--all"),
        ("step", "list", "--strategy", "1"),
        ("history", "--strategy", "1"),
        ("check",),
    ],
)
def test_a_command_on_a_database_that_is_not_there_says_so_and_creates_none(
    cli: Cli, tmp_path: Path, args: tuple[str, ...]
) -> None:
    # A mistyped --db must not show an empty fleet as if it were the truth.
    where = tmp_path / "elsewhere"
    where.mkdir()
    res = cli(*args, db=where / "typo.db")
    assert res.code == 2, res.err
    line = _one_line(res.err)
    assert line.startswith(f"error: --db: no database at {where / 'typo.db'}")
    assert "fleetwave init" in line
    assert not list(where.iterdir())


def test_fleetwave_db_naming_no_database_is_named(
    cli: Cli, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FLEETWAVE_DB", str(tmp_path / "nope.db"))
    res = cli("strategy", "list", db=None)
    assert res.code == 2
    assert _one_line(res.err).startswith("error: FLEETWAVE_DB: no database at ")
    assert not (tmp_path / "nope.db").exists()


@pytest.fixture
def empty_cwd(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh, empty working directory and no FLEETWAVE_DB: the default path
    (./fleetwave.db) holds no database."""
    here = tmp_path / "cwd"
    here.mkdir()
    monkeypatch.chdir(here)
    monkeypatch.delenv("FLEETWAVE_DB", raising=False)
    return here


def test_builtin_workflows_are_listed_without_a_database(cli: Cli, empty_cwd: Path) -> None:
    here = empty_cwd
    names = [w["name"] for w in cli("workflow", "list", "--format", "json", db=None).json()]
    assert {"patch", "sw-deploy", "firmware", "kube-upgrade"} <= set(names)
    shown = cli("workflow", "show", "patch", "--format", "json", db=None).json()
    assert shown["states"][0]["state"] == "pre-check"
    assert list(here.iterdir()) == []  # nothing was created to answer that
    # init creates it; then the same commands read it
    assert cli("init", db=None).code == 0
    assert (here / "fleetwave.db").exists()
    assert cli("target", "list", "--format", "json", db=None).json() == []


def test_a_missing_database_message_says_which_path_and_why(
    cli: Cli, tmp_path: Path, empty_cwd: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    here = empty_cwd
    line = _one_line(cli("target", "list", db=None).err)
    assert line.startswith("error: --db: no database at fleetwave.db (the default when neither")
    # set but empty counts as not set
    monkeypatch.setenv("FLEETWAVE_DB", "")
    assert _one_line(cli("target", "list", db=None).err) == line
    # a path that cannot be a database file says that, not "run init" (init would refuse)
    url = _one_line(cli("target", "list", "--db", "sqlite:///x.db", db=None).err)
    assert "is a URL" in url
    nodir = _one_line(cli("target", "list", db=tmp_path / "no" / "such.db").err)
    assert "does not exist" in nodir and "init" not in nodir
    # a mistyped database named for workflow list is an error too (it may hold YAML
    # workflows that a built-ins-only answer would silently leave out)
    res = cli("workflow", "list", db=tmp_path / "typo.db")
    assert res.code == 2
    assert "no database at" in _one_line(res.err)
    assert list(here.iterdir()) == [] and not (tmp_path / "typo.db").exists()


def test_more_bad_input_found_by_an_acceptance_pass(
    cli: Cli, empty_cwd: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    where = empty_cwd
    # an empty --db is not the default path
    res = cli("target", "add", "a", "--db", "", db=None)
    assert res.code == 2 and _one_line(res.err) == "error: --db: must not be empty"
    # the demo refuses a bad event loop before it writes anything
    monkeypatch.setenv("FLEETWAVE_LOOP", "bogus")
    res = cli("demo", "--targets", "5", db=where / "dd.db")
    assert res.code == 2 and "FLEETWAVE_LOOP" in _one_line(res.err)
    monkeypatch.delenv("FLEETWAVE_LOOP")
    # sim names its own option
    res = cli("sim", "--keep-db", str(where / "no" / "k.db"), db=None)
    assert res.code == 2
    assert _one_line(res.err).startswith("error: --keep-db: directory ")
    assert list(where.iterdir()) == []


def test_the_demo_leaves_one_database_file(cli: Cli, tmp_path: Path) -> None:
    here = tmp_path / "d"
    here.mkdir()
    db = here / "demo.db"
    assert cli("demo", "--targets", "20", "--format", "json", db=db).code == 0
    assert sorted(p.name for p in here.iterdir()) == ["demo.db"]  # no WAL left over
    assert cli("check", db=db).code == 0


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (("target", "add", "z", "--set", "failure_rate=5"), "failure_rate: 5 is outside 0..1"),
        (("target", "add", "z", "--set", "latency_ms=-5"), "-5 is outside 0..86400000"),
        (("history", "--strategy", "1", "--last", "-3"), "must be at least 1, got -3"),
        (("history", "--strategy", "1", "--last", "0"), "must be at least 1, got 0"),
    ],
)
def test_a_value_is_quoted_as_given_and_a_bound_worded_once(
    cli: Cli, args: tuple[str, ...], said: str
) -> None:
    """`--set failure_rate=5` was answered "5.0 is outside 0..1"; `--last -3` "is
    negative" where `--last 0` said "must be at least 1" (an acceptance pass)."""
    res = cli(*args)
    assert res.code == 2 and said in res.err, res.text


def test_an_unknown_workflow_hints_at_plugins_when_none_are_named(
    cli: Cli, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Python workflow's strategy, driven where its module is not imported, said only
    "unknown workflow" (an acceptance pass): it says where Python workflows come from."""
    monkeypatch.delenv("FLEETWAVE_PLUGINS", raising=False)
    res = cli("strategy", "create", "--workflow", "drain", "--all")
    assert res.code == 2, res.text
    assert res.err.rstrip().endswith(
        "; a Python workflow needs its module named in FLEETWAVE_PLUGINS"
    ), res.err
