"""What an operator's acceptance pass of groups, pause and abort, imports and YAML
workflows found (session 16): options given twice, warnings an unmanage owed, refusals
that pointed at the wrong remedy, and what a script reads from JSON."""

from __future__ import annotations

import pytest

from cli_harness import Cli, one_line
from test_cli_strategy import add, create


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
    ],
)
def test_an_option_of_one_value_given_twice_is_refused(
    cli: Cli, args: list[str], option: str
) -> None:
    """Click kept the last value without a word: a strategy of the second group only,
    or at the second max-parallel."""
    add(cli, "a1")
    assert cli("group", "add", "ga").code == 0
    assert one_line(cli(*args)) == f"error: {option}: given more than once (it takes one value)"
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
