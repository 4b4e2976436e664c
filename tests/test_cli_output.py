"""What the CLI prints: help, tables and messages at 80 columns, times, the version."""

from __future__ import annotations

import logging
import time
from datetime import UTC, datetime

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cli_harness import Cli
from fleetwave.cli.output import WHEN_WIDTH, when
from test_cli_strategy import add, apply_wait, create, history


def _commands() -> list[tuple[list[str], list[str]]]:
    """Every command's words and its long options, from the application itself."""
    import typer.main

    from fleetwave.cli.main import app

    found: list[tuple[list[str], list[str]]] = []

    def walk(command: object, path: list[str]) -> None:
        subs = getattr(command, "commands", None)
        if subs:
            for name, sub in subs.items():
                walk(sub, [*path, name])
            return
        params = getattr(command, "params", [])
        shown = [p for p in params if not getattr(p, "hidden", False)]
        found.append((path, [o for p in shown for o in p.opts if o.startswith("--")]))

    walk(typer.main.get_command(app), [])
    return found


def test_every_help_names_every_option_whole_at_80_columns(
    cli: Cli, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "80")
    commands = _commands()
    assert len(commands) >= 25 and ["strategy", "create"] in [c for c, _ in commands]
    for words, options in commands:
        res = cli(*words, "--help", db=None)
        assert res.code == 0, (words, res.text)
        lines = res.out.splitlines()
        assert max(len(line) for line in lines) <= 80, words
        assert "…" not in res.out, (words, res.out)
        for option in options:
            assert any(f" {option} " in line for line in lines), (words, option, res.out)
        # a flag shows no type (`--all <bool>` read as if it took a value: a walkthrough),
        # and a repeatable option what one value looks like, not `<list[str]>`
        assert "<bool>" not in res.out and "<list[" not in res.out, (words, res.out)
        if "--db" in options:
            assert any(" --db " in x and " PATH " in x for x in lines), (words, res.out)
    # the flag that would have shown `<bool>` shows nothing in the type column
    (row,) = [
        x for x in cli("strategy", "create", "--help", db=None).out.splitlines() if " --all " in x
    ]
    assert row.split("--all")[1].split()[:2] == ["every", "target"], row


def test_tables_at_80_columns_cut_or_split_no_name(
    cli: Cli, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Target names, conductor ids and state names came out as 'subcloud599…' and
    'updating-pa…' at 80 columns; every one is now whole on one line, in a boxed table
    that fits or in plain columns."""
    names = [f"subcloud-east-rack{i:02d}-node{i:03d}" for i in range(3)]
    add(cli, *names)
    sid = create(cli, "--all")
    assert apply_wait(cli, sid).code == 0
    conductor = history(cli, sid)[0]["conductor"]
    monkeypatch.setenv("COLUMNS", "80")
    step = cli("step", "list", "--strategy", str(sid), "--format", "json").json()[0]["step"]
    for args in (
        ("history", "--strategy", str(sid)),
        ("step", "list", "--strategy", str(sid)),
        ("step", "show", str(step)),
        ("strategy", "list"),
        ("strategy", "show", str(sid)),
        ("target", "list"),
        ("workflow", "show", "patch"),
    ):
        res = cli(*args)
        assert res.code == 0, (args, res.text)
        assert "…" not in res.out, (args, res.out)
        words = {w for line in res.out.splitlines() for w in line.replace("│", " ").split()}
        if args[0] in ("history", "step"):
            assert set(names) & words, (args, res.out)
        if args[0] == "history" or args[:2] == ("step", "show"):
            assert "applying-remote-patch-strategy" in words, (args, res.out)
        if args[0] == "history":
            assert conductor in words and set(names) <= words, (args, res.out)
        boxed = [line for line in res.out.splitlines() if line[:1] in "┏┃┡│└┌"]
        assert all(len(line) <= 80 for line in boxed), (args, res.out)


def test_a_message_is_one_line_however_narrow_the_output(
    cli: Cli, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Messages went through Rich's wrapping at the output's width (80 when piped): a
    grep for one saw half of it."""
    add(cli, "a", latency_ms="60000")
    sid = create(cli, "--all")
    assert cli("strategy", "apply", str(sid)).code == 0
    monkeypatch.setenv("COLUMNS", "40")
    res = cli("strategy", "pause", str(sid))
    assert res.code == 0, res.text
    assert res.out.count("\n") == 1 and len(res.out) > 60, res.out
    assert "('fleetwave strategy resume 1' to go on)" in res.out
    warned = cli("strategy", "abort", str(sid))
    assert warned.err.count("\n") == 1 and warned.err.startswith("warning: "), warned.err


def test_log_lines_and_tables_give_one_time_for_one_event(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A log line was in local time and the history row of the same event in UTC,
    neither marked; both are now UTC, marked Z, whatever TZ says."""
    import time

    from fleetwave.cli.output import utc_log_formatter, when

    monkeypatch.setenv("TZ", "America/New_York")
    time.tzset()
    try:
        at = 1_764_522_336.195  # 2025-11-30 17:05:36.195 UTC
        record = logging.makeLogRecord(
            {"created": at, "msecs": 195.0, "msg": "x", "levelname": "WARNING", "name": "n"}
        )
        line = utc_log_formatter().format(record)
        assert when(at) == "2025-11-30 17:05:36.195Z"
        assert line == "2025-11-30 17:05:36.195Z WARNING n: x"
    finally:
        monkeypatch.delenv("TZ")
        time.tzset()


def test_a_message_with_brackets_is_shown_as_it_is(cli: Cli) -> None:
    """A target's message in brackets ('[/tmp/sock]') was read as Rich markup: `step
    list` and `step show` crashed with a MarkupError, '[bold]' vanished."""
    add(cli, "a", remote_state="[/tmp/sock][bold]")
    sid = create(cli, "--all")
    assert apply_wait(cli, sid).code == 1  # the step fails: an unexpected remote state
    said = "pre-check: target reports unexpected remote state '[/tmp/sock][bold]'"
    for args in (
        ("step", "list", "--strategy", str(sid)),
        (
            "step",
            "show",
            str(cli("step", "list", "--strategy", str(sid), "--format", "json").json()[0]["step"]),
        ),
        ("history", "--strategy", str(sid)),
    ):
        res = cli(*args)
        assert res.code == 0, (args, res.text)
        assert said in res.out, (args, res.out)


def test_version(cli: Cli) -> None:
    import fleetwave

    res = cli("--version", db=None)
    assert (res.code, res.out.strip()) == (0, f"fleetwave {fleetwave.__version__}")


def test_a_drawn_table_never_splits_a_time_over_two_lines() -> None:
    """In a terminal, `step list` printed every time as `2026-12-01` over
    `13:19:13.403Z` (1,004 lines for 500 rows): a time is one word to the table."""
    from fleetwave.cli.output import _column_widths

    row = {
        "target": "sc-001",
        "details": "finishing: failed on target (fail_at=finishing) " * 3,
        "started_at": time.time(),
    }
    widths = _column_widths([row], ["target", "details", "started_at"], False, 80)
    assert widths is not None and widths[2] is not None
    assert widths[2] >= len(when(row["started_at"])) == 24, widths


@settings(max_examples=2000, deadline=None)
@given(
    st.one_of(
        st.floats(min_value=0, max_value=4_102_444_800, allow_nan=False),
        # near a millisecond's and a second's edge, where rounding decides
        st.integers(1_700_000_000, 1_800_000_000).map(lambda s: s + 0.9999995),
        st.integers(1_700_000_000_000, 1_800_000_000_000).map(lambda ms: ms / 1000 + 5e-7),
    )
)
def test_a_time_is_shown_as_datetime_shows_it(ts: float) -> None:
    """Times are formatted from a per-second cache (a history of 600,000 rows spent a
    third of its time on them): to the character what the datetime module gives."""
    expected = datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3] + "Z"
    assert when(ts) == expected
    assert len(expected) == WHEN_WIDTH


def test_help_asked_for_among_repeated_options_is_the_help(cli: Cli) -> None:
    res = cli("target", "list", "--group", "a", "--group", "b", "--help", db=None)
    assert res.code == 0 and "Usage:" in res.out, res.text
