"""Values out of range or of the wrong kind are named in one line: numbers too large for
the database, max parallel and serial caps, timeouts, keys and options given twice."""

from __future__ import annotations

import asyncio
import json

import pytest
from sqlalchemy import update

from cli_harness import Cli, assert_rejected, one_line
from conftest import add_sim_targets
from fleetwave.domain.models import StrategyOptions
from fleetwave.engine.conductor import Conductor
from fleetwave.store import admin, queries
from fleetwave.store.db import Store
from fleetwave.store.schema import strategies
from test_cli_strategy import add, create
from test_plugins import _wf


def _groups(cli: Cli) -> dict[str, dict[str, object]]:
    res = cli("group", "list", "--format", "json")
    assert res.code == 0, res.text
    return {g["name"]: g for g in res.json()}


def test_a_serial_group_given_a_max_parallel_above_one_is_refused(cli: Cli) -> None:
    line = one_line(cli("group", "add", "west", "--apply-type", "serial", "--max-parallel", "7"))
    assert "--max-parallel: a serial group runs one target at a time, got 7" in line, line
    assert "west" not in _groups(cli)
    assert cli("group", "add", "west", "--apply-type", "serial", "--max-parallel", "1").code == 0
    assert cli("group", "add", "east", "--apply-type", "serial").code == 0
    listed = _groups(cli)
    assert [listed[g]["max_parallel"] for g in ("west", "east")] == [1, 1]
    # a max parallel below one is refused as for any group
    assert_rejected(
        cli("group", "add", "x", "--apply-type", "serial", "--max-parallel", "0"),
        "--max-parallel: must be at least 1, got 0",
    )


def test_a_serial_strategy_given_a_max_parallel_above_one_is_refused(cli: Cli) -> None:
    add(cli, "a", "b")
    res = cli(
        "strategy", "create", "--workflow", "patch", "--all", "--apply-type", "serial",
        "--max-parallel", "5",
    )  # fmt: skip
    assert "--max-parallel: a serial strategy runs one target at a time, got 5" in one_line(res)
    listed = cli("strategy", "list", "--format", "json")
    assert listed.json() == []  # nothing created
    sid = create(cli, "--all", "--apply-type", "serial")
    shown = cli("strategy", "show", str(sid), "--format", "json").json()
    assert shown["options"]["max_parallel"] == 1, shown


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (("strategy", "show", "-1"), "-1: ids and counts are whole numbers from 0"),
        (("step", "show", "-7"), "-7: ids and counts are whole numbers from 0"),
        (("history", "--strategy", "-5"), "--strategy: -5 is negative"),
        (("history", "--strategy", "x1"), "'x1' is not a whole number"),
        (("check", "--strategy", "1.5"), "'1.5' is not a whole number"),
        (
            ("strategy", "create", "--workflow", "patch", "--all", "--max-failures", "-3"),
            "--max-failures: -3 is negative",
        ),
        (
            ("strategy", "show", "9223372036854775808"),
            "9223372036854775808 is above the largest the database holds",
        ),
        (("strategy", "show", "9" * 5000), "a number of 5000 digits is above the largest"),
        (("strategy", "show", "+-1"), "'+-1' is not a whole number"),
        (("strategy", "show", "١٢"), "'١٢' is not a whole number"),  # Arabic-Indic digits
        (("strategy", "show", "²"), "'²' is not a whole number"),
    ],
)
def test_a_number_that_is_no_id_or_count_is_named(
    cli: Cli, args: tuple[str, ...], said: str
) -> None:
    assert said in one_line(cli(*args))


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (
            ("strategy", "list", "--format", "yaml"),
            "error: --format: 'yaml' is not one of 'table', 'json'.",
        ),
        (
            ("group", "add", "g", "--apply-type", "bogus"),
            "error: --apply-type: 'bogus' is not one of 'parallel', 'serial'.",
        ),
        (
            ("strategy", "create", "--workflow", "patch", "--all", "--timeout", "bogus=3"),
            "error: --timeout: bogus: workflow patch has no such state (its states: "
            "pre-check, updating-patches, creating-remote-patch-strategy, "
            "applying-remote-patch-strategy, finishing)",
        ),
        (
            ("sim", "--runs", "2", "--keep-db", "kept.db"),
            "error: --keep-db: keeps the database of a single run, got --runs 2",
        ),
        (("sim", "--keep-db", ""), "error: --keep-db: must not be empty"),
        (("sim", "--keep-db", "."), "error: --keep-db: '.' is a directory"),
    ],
)
def test_bad_values_are_named_plainly(cli: Cli, args: tuple[str, ...], said: str) -> None:
    add(cli, "a")
    res = cli(*args, db=None) if args[0] == "sim" else cli(*args)
    assert one_line(res).startswith(said), res.err


def test_the_default_flags_said_out_loud_are_still_accepted(cli: Cli) -> None:
    add(cli, "a", "b")
    res = cli(
        "strategy", "create", "--workflow", "patch", "--targets", "a",
        "--no-stop-on-failure", "--no-stages-by-group", "--format", "json",
    )  # fmt: skip
    assert res.code == 0, res.text
    shown = cli("strategy", "show", str(res.json()["id"]), "--format", "json").json()
    assert (shown["options"]["stop_on_failure"], shown["options"]["stages_by_group"]) == (
        False,
        False,
    )
    assert_rejected(
        cli(
            "strategy",
            "create",
            "--workflow",
            "patch",
            "--targets",
            "b",
            "--stages-by-group",
            "--no-stages-by-group",
        ),
        "--stages-by-group and --no-stages-by-group: give one of them",
    )


@pytest.mark.parametrize(
    "args",
    [
        ("target", "add", "a", "--set", "latency_ms=5", "--set", "latency_ms=6"),
        ("target", "add", "a", "--label", "k=1", "--label", "k=2"),
    ],
)
def test_a_key_given_twice_is_refused(cli: Cli, args: tuple[str, ...]) -> None:
    """``--set``, ``--label`` and ``--timeout`` kept the last value of a key given twice,
    silently (``--targets`` refuses a repeat)."""
    line = one_line(cli(*args))
    assert line.endswith("given more than once"), line
    assert cli("target", "list", "--format", "json").json() == []


def test_a_timeout_given_twice_is_refused(cli: Cli) -> None:
    add(cli, "a")
    res = cli(
        "strategy", "create", "--workflow", "patch", "--all",
        "--timeout", "pre-check=5", "--timeout", "pre-check=6",
    )  # fmt: skip
    assert one_line(res) == "error: --timeout: 'pre-check' given more than once"


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


def test_a_timeout_override_has_the_yaml_ceiling(cli: Cli) -> None:
    assert cli("target", "add", "a").code == 0
    res = cli("strategy", "create", "--workflow", "patch", "--all", "--timeout", "pre-check=1e12")
    assert_rejected(res, "--timeout: pre-check: at most 2592000 seconds (30 days), got 1e12")
    ok = cli("strategy", "create", "--workflow", "patch", "--all", "--timeout", "pre-check=1.5e3")
    assert ok.code == 0, ok.text


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


@pytest.mark.parametrize(
    ("args", "option"),
    [
        (["target", "add", "m", "--group", "ga", "--group", "gb"], "--group"),
        (
            [
                "strategy",
                "create",
                "--workflow",
                "patch",
                "--max-parallel",
                "3",
                "--max-parallel=9",
            ],
            "--max-parallel",
        ),
        (["target", "list", "--group", "a", "--group", "b"], "--group"),
        (["strategy", "create", "--workflow", "patch", "--workflow", "sw-deploy"], "--workflow"),
        (["step", "list", "--strategy", "1", "--strategy", "2"], "--strategy"),
        (["target", "list", "--format", "json", "--format", "table"], "--format"),
        (["strategy", "apply", "1", "--wait", "--no-wait"], "--wait and --no-wait"),
    ],
)
def test_an_option_of_one_value_given_twice_is_refused(
    cli: Cli, args: list[str], option: str
) -> None:
    """Click kept the last value without a word: a strategy of the second group only,
    or at the second max-parallel."""
    add(cli, "a1")
    assert cli("group", "add", "ga").code == 0
    said = "give one of them" if " and " in option else "given more than once (it takes one value)"
    assert one_line(cli(*args)) == f"error: {option}: {said}"
    targets = cli("target", "list", "--format", "json").json()
    assert [t["name"] for t in targets] == ["a1"]  # nothing written
    assert cli("strategy", "list", "--format", "json").json() == []


def test_options_that_take_several_values_or_none_may_be_repeated(cli: Cli) -> None:
    add(cli, "a1", "a2")
    sid = create(cli, "--all")
    res = cli("step", "list", "--strategy", str(sid), "--target", "a1", "--target", "a2")
    assert res.code == 0 and "a1" in res.out and "a2" in res.out, res.text
    # a flag given twice says the same thing twice; a value that looks like an option is
    # that option's value, not the option again
    res = cli("strategy", "create", "--workflow", "patch", "--targets", "a1", "--stop-on-failure")
    assert res.code == 2 and "already in active strategy" in res.text  # (a1 is held)
    res = cli("strategy", "delete", str(sid))
    assert res.code == 0, res.text
    res = cli(
        "strategy",
        "create",
        "--workflow",
        "patch",
        "--all",
        "--stop-on-failure",
        "--stop-on-failure",
    )
    assert res.code == 0, res.text
    res = cli("target", "add", "x", "--label", "--group", "--group", "ga")
    assert res.code == 2 and "given more than once" not in res.text, res.text
