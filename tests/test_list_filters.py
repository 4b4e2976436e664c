"""Filters of the list commands: repeated or comma-separated values show rows in either;
values that name nothing are refused."""

from __future__ import annotations

import pytest

from cli_harness import Cli, assert_rejected
from test_cli_strategy import history, steps


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


def test_a_filter_given_twice_shows_steps_in_either(cli: Cli, ended: int) -> None:
    """`--state failed --state aborted` showed only the aborted ones (the last given
    won, silently: an empty table read as "nothing failed"); so did `--target`."""
    both = steps(cli, ended, "--state", "failed", "--state", "complete")
    assert sorted(both) == ["bad1", "bad2", "ok1", "ok2", "ok3"]
    assert sorted(steps(cli, ended, "--state", "failed,complete", "--target", "bad1,ok2")) == [
        "bad1",
        "ok2",
    ]
    assert sorted(steps(cli, ended, "--target", "ok1", "--target", "bad2")) == ["bad2", "ok1"]
    assert sorted(steps(cli, ended, "--state", "failed")) == ["bad1", "bad2"]
    rows = history(cli, ended, "--target", "ok1", "--target", "bad1")
    assert {r["target"] for r in rows} == {"ok1", "bad1"}
    assert len(rows) == 12  # initial -> 5 states -> an end, for each


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (("--state", "failed,"), ["--state: an empty value in 'failed,'"]),
        (("--state", "failed", "--state", "nope"), ["--state: 'nope' is not a state"]),
        (("--target", "ok1,ghost"), ["--target: no target named 'ghost'"]),
    ],
)
def test_a_bad_value_among_several_is_refused(
    cli: Cli, ended: int, args: tuple[str, ...], words: list[str]
) -> None:
    assert_rejected(cli("step", "list", "--strategy", str(ended), *args), *words)
