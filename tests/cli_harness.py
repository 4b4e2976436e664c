"""Running the ``fleetwave`` console entry point in-process, for the CLI tests.

``main()`` is what the console script calls: it turns bad input into one
``error: ...`` line and exit code 2, so the tests see exactly what a user sees.
"""

from __future__ import annotations

import json
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from fleetwave.cli.main import main
from fleetwave.store.db import open_store

PATCH_STATES = [
    "pre-check",
    "updating-patches",
    "creating-remote-patch-strategy",
    "applying-remote-patch-strategy",
    "finishing",
]


@dataclass
class Result:
    code: int
    out: str
    err: str

    def json(self) -> Any:
        return json.loads(self.out)

    @property
    def text(self) -> str:
        """stdout and stderr with whitespace runs folded (Rich wraps long lines)."""
        return " ".join((self.out + "\n" + self.err).split())


Cli = Callable[..., Result]


@pytest.fixture(scope="module")
def migrated_db(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A freshly created (migrated) database, made once and copied for each test."""
    path = tmp_path_factory.mktemp("template") / "fleet.db"
    open_store(str(path)).dispose()
    return path


@pytest.fixture
def db_path(tmp_path: Path, migrated_db: Path) -> Path:
    path = tmp_path / "fleet.db"
    shutil.copyfile(migrated_db, path)
    return path


@pytest.fixture
def cli(db_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> Cli:
    """Run ``fleetwave ARGS --db <tmp file>`` in process; return exit code and output."""
    monkeypatch.setattr("logging.basicConfig", lambda **_: None)
    monkeypatch.setenv("COLUMNS", "250")  # Rich reads it on every print: no wrapped tables

    def run(*args: str, db: Path | None = db_path) -> Result:
        argv = ["fleetwave", *args]
        if db is not None:
            argv += ["--db", str(db)]
        capsys.readouterr()
        monkeypatch.setattr(sys, "argv", argv)
        try:
            main()
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        else:
            code = 0
        out, err = capsys.readouterr()
        return Result(code, out, err)

    return run


def as_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    """Print as to a terminal (drawn tables, "(none)"), without colour codes: the
    harness captures output, which is otherwise printed as to a pipe."""
    monkeypatch.setenv("TTY_COMPATIBLE", "1")
    monkeypatch.setenv("TERM", "dumb")


def assert_rejected(res: Result, *words: str) -> None:
    """Exit code 2 and one 'error: ...' line on stderr naming every word."""
    assert res.code == 2, res.text
    assert res.err.startswith("error: "), res.err
    for word in words:
        assert word in res.text, (word, res.text)


def one_line(res: Result) -> str:
    """The refusal: exit 2, nothing on stdout, exactly one ``error:`` line on stderr."""
    assert res.code == 2, res.text
    assert res.out == "", res.out
    lines = res.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), res.err
    return lines[0]


def targets(cli: Cli) -> dict[str, dict[str, Any]]:
    res = cli("target", "list", "--format", "json")
    assert res.code == 0, res.text
    return {t["name"]: t for t in res.json()}


def import_refused(cli: Cli, f: Path, text: str) -> str:
    """Write ``text`` to ``f`` and import it into a fleet with no targets: the one
    ``error:`` line (see :func:`one_line`); nothing was added."""
    f.write_text(text, encoding="utf-8")
    line = one_line(cli("target", "import", str(f)))
    assert targets(cli) == {}
    return line


@pytest.fixture
def ended(cli: Cli) -> int:
    """A patch rollout over five targets, two of them failing in 'finishing': ended."""
    from test_cli_strategy import add, apply_wait, create

    add(cli, "ok1", "ok2", "ok3")
    add(cli, "bad1", "bad2", fail_at="finishing")
    sid = create(cli, "--all")
    assert apply_wait(cli, sid).code == 1  # it ends failed
    return sid
