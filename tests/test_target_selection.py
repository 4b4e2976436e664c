"""Choosing a strategy's targets: ``--failed-in`` retries, ``--targets`` from a file or
stdin, and sources that name nothing."""

from __future__ import annotations

import io
import sqlite3
from pathlib import Path

import pytest

from cli_harness import Cli, assert_rejected
from test_cli_strategy import add, apply_wait, create, steps


def test_a_retry_of_the_failed_targets_is_one_command(
    cli: Cli, ended: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Retrying only the targets that failed took jq or awk between `step list` and
    `strategy create --targets` (`--targets @failed.txt` and `-` were target names)."""
    retry = create(cli, "--failed-in", str(ended))
    assert sorted(steps(cli, retry)) == ["bad1", "bad2"]
    assert cli("strategy", "delete", str(retry)).code == 0
    listed = tmp_path / "failed.txt"
    listed.write_text("# the failed ones\nbad1\n\nbad2, ok1  # and one more\n", encoding="utf-8")
    from_file = create(cli, "--targets", f"@{listed}")
    assert sorted(steps(cli, from_file)) == ["bad1", "bad2", "ok1"]
    assert cli("strategy", "delete", str(from_file)).code == 0
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(b"ok2\nok3\n")))
    from_stdin = create(cli, "--targets", "-")
    assert sorted(steps(cli, from_stdin)) == ["ok2", "ok3"]


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (("--failed-in", "{sid}", "--all"), ["--failed-in: picks the targets itself"]),
        (("--failed-in", "99"), ["strategy 99 not found"]),
        (("--targets", "@{tmp}/none.txt"), ["--targets: @", "none.txt: no such file"]),
        (("--targets", "@{tmp}/empty.txt"), ["--targets: @", "empty.txt names no target"]),
        (("--targets", "@{tmp}/typo.txt"), ["--targets: no target named 'bad3'"]),
        (("--targets", "@{tmp}"), ["--targets: @", ": a directory"]),
        (("--targets", "@{tmp}/latin1.txt"), ["latin1.txt: not UTF-8 text (byte 0xe9 at line 2"]),
        (("--targets", "ok1,,ok2"), ["--targets: an empty name in 'ok1,,ok2'"]),
        (("--targets", "ok1,"), ["--targets: an empty name in 'ok1,'"]),
    ],
)
def test_a_bad_target_source_is_refused(
    cli: Cli, ended: int, tmp_path: Path, args: tuple[str, ...], words: list[str]
) -> None:
    (tmp_path / "empty.txt").write_text("# nobody\n\n", encoding="utf-8")
    (tmp_path / "typo.txt").write_text("bad1\nbad3\n", encoding="utf-8")
    (tmp_path / "latin1.txt").write_bytes("ok1\ncaf\u00e9\n".encode("latin-1"))
    given = [a.format(sid=ended, tmp=tmp_path) for a in args]
    res = cli("strategy", "create", "--workflow", "patch", *given)
    assert_rejected(res, *words)
    assert len(cli("strategy", "list", "--format", "json").json()) == 1  # nothing written


def test_names_from_stdin_or_a_file_are_text_as_a_file_is(
    cli: Cli, ended: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A byte that is not UTF-8 on stdin printed a traceback; a file saved with a
    byte-order mark (Windows) named its first target with an invisible character."""
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(b"ok1\nbad1\xff\n")))
    assert_rejected(
        cli("strategy", "create", "--workflow", "patch", "--targets", "-"),
        "--targets: stdin: not UTF-8 text (byte 0xff at line 2, column 5)",
    )
    marked = tmp_path / "bom.txt"
    marked.write_bytes(b"\xef\xbb\xbfok1\r\nok2\r\n")
    sid = create(cli, "--targets", f"@{marked}")
    assert sorted(steps(cli, sid)) == ["ok1", "ok2"]


def test_failed_in_a_strategy_that_completed_says_there_is_nothing_to_retry(cli: Cli) -> None:
    add(cli, "fine")
    sid = create(cli, "--all")
    assert apply_wait(cli, sid).code == 0
    assert_rejected(
        cli("strategy", "create", "--workflow", "patch", "--failed-in", str(sid)),
        f"--failed-in: strategy {sid} has no failed or aborted step",
    )


def test_failed_in_a_strategy_being_deleted_is_refused(cli: Cli, ended: int, db_path: Path) -> None:
    """An interrupted delete leaves some of its steps: a retry taken from what is left
    would leave failed targets out without a word (found by a review)."""
    with sqlite3.connect(db_path) as db:
        db.execute("UPDATE strategies SET state = 'deleting' WHERE id = ?", (ended,))
    assert_rejected(
        cli("strategy", "create", "--workflow", "patch", "--failed-in", str(ended)),
        f"--failed-in: strategy {ended} is being deleted",
        f"'fleetwave strategy delete {ended}' finishes it",
    )
