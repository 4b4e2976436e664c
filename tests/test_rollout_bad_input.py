"""Bad rollout control on the command line: each refused with one ``error:`` line
naming it, exit 2, and nothing written (no strategy, with or without ``--dry-run``)."""

from __future__ import annotations

import pytest

from cli_harness import Cli

BAD = [
    (["--stage", "nope"], "error: --stage: no group named 'nope'"),
    (["--stage", "a", "--stage", "a,b"], "error: --stage: 'a' is given in stages 1 and 2"),
    (["--stage", ""], "error: --stage: stage 1 is empty"),
    (["--batches", "0"], "error: --batches: must be at least 1, got 0"),
    (["--batches", "120%"], "error: --batches: a percent is at most 100%, got 120%"),
    (["--max-failures", "101%"], "error: "),
    (["--stage-max-failures", "150%"], "error: "),
    (["--canary", "5"], "error: --canary: 5 is 5 canaries, of 4 targets: at most 3"),
    (["--canary", "0"], "error: --canary: must be at least 1, got 0"),
    (["--canary-label", "ring=9"], "error: --canary-label: no chosen target has ring=9"),
    (["--stage-wait", "5m"], "error: --stage-wait: the strategy has one stage"),
    (["--stage", "a", "--stage-wait", "0"], "error: --stage-wait: must be more than 0"),
    (["--window", "Sat 02:00-02:00"], "error: --window: 'Sat 02:00-02:00' never opens"),
    (
        ["--start-after", "2099-01-02T00:00Z", "--deadline", "2099-01-01T00:00Z"],
        "error: --deadline: 2099-01-01 00:00Z is not after --start-after 2099-01-02 00:00Z",
    ),
    (
        [
            "--window",
            "Sat 01:00-02:00",
            "--deadline",
            "2099-01-01T00:00Z",
            "--start-after",
            "2098-12-31T12:00Z",
        ],
        "error: --window: Sat 01:00-02:00 never opens between",
    ),
]


@pytest.mark.parametrize("dry_run", [False, True])
@pytest.mark.parametrize(("args", "said"), BAD)
def test_bad_rollout_control_is_refused_and_writes_nothing(
    cli: Cli, args: list[str], said: str, dry_run: bool
) -> None:
    for g in ("a", "b"):
        assert cli("group", "add", g).code == 0
        for i in (1, 2):
            assert cli("target", "add", f"{g}{i}", "--group", g).code == 0
    extra = ["--dry-run"] if dry_run else []
    res = cli("strategy", "create", "--workflow", "patch", "--all", *args, *extra)
    assert res.code == 2, res.text
    lines = res.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(said), lines
    assert res.out == ""
    assert cli("strategy", "list", "--format", "json").json() == []
