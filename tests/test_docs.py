"""The README and the manual say what the program does: their marked shell examples run
against a fresh database with the installed ``fleetwave``, the outputs they show are
found in what the commands printed, and the CLI reference names every command and option.

Marks, as HTML comments a reader does not see, on the line before a fenced block:

- ``<!-- example: NAME -->`` before a ``sh`` block: run it (bash, ``set -eo pipefail``)
  in the example's own temporary directory, with ``FLEETWAVE_DB`` there; the blocks of
  one NAME in one file run in order, in the same directory.
- ``<!-- file: PATH -->`` before any block: write its text to PATH in that directory
  (of the example named by the next ``example`` mark) before the next block runs.
- ``<!-- output: NAME -->`` before a ``text`` block: each of its lines is found in one
  line of what NAME's blocks printed (stdout and stderr); ``...`` in it stands for
  anything (a time, a conductor's id), and runs of spaces count as one.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tempfile
import unicodedata
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

import pytest
import typer

from cli_forkserver import write_client

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
MARK = re.compile(r"<!-- (example|file|output): (\S+) -->\n(`{3,})(\w*)\n(.*?)\n\3\n", re.DOTALL)
#: the pages whose examples run (every page with a mark is found; these must have some)
MUST_RUN = ("README.md", "docs/getting-started.md", "docs/rollout-control.md")


@dataclass
class Example:
    """One named example of one file: its files and shell blocks in order, and outputs."""

    page: str
    name: str
    steps: list[tuple[str, str]] = field(default_factory=list)  # ("file", path) / ("sh", "")
    texts: list[str] = field(default_factory=list)
    outputs: list[str] = field(default_factory=list)


def examples_of(rel: str) -> list[Example]:
    text = (ROOT / rel).read_text(encoding="utf-8")
    found: dict[str, Example] = {}
    pending_files: list[tuple[str, str]] = []
    for kind, arg, _fence, lang, body in MARK.findall(text):
        if kind == "file":
            pending_files.append((arg, body + "\n"))
            continue
        ex = found.setdefault(arg, Example(rel, arg))
        if kind == "example":
            assert lang in ("sh", "bash"), f"{rel}: example {arg} is a {lang!r} block, not sh"
            for path, content in pending_files:
                ex.steps.append(("file", path))
                ex.texts.append(content)
            pending_files = []
            ex.steps.append(("sh", ""))
            ex.texts.append(body + "\n")
        else:
            ex.outputs.append(body)
    assert not pending_files, f"{rel}: a file mark with no example after it"
    return list(found.values())


def all_examples() -> list[Example]:
    pages = ["README.md", *sorted(str(p.relative_to(ROOT)) for p in DOCS.rglob("*.md"))]
    return [ex for rel in pages for ex in examples_of(rel)]


@pytest.fixture(scope="module")
def fleetwave_bin() -> Iterator[Path]:
    """A directory whose ``fleetwave`` runs each command as a process of its own, forked
    from a server that imported the command line once (``cli_forkserver``): the same
    entry point, output and exit code, without a second's import per command.
    ``FLEETWAVE_DOCS_REAL_CLI=1`` runs the installed console script instead."""
    if os.environ.get("FLEETWAVE_DOCS_REAL_CLI") == "1":
        yield Path(sys.executable).parent
        return
    where = Path(tempfile.mkdtemp(prefix="fw-docs-"))
    sock = where / "cli.sock"
    server = subprocess.Popen(
        [sys.executable, str(Path(__file__).with_name("cli_forkserver.py")), str(sock)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert server.stdout is not None and server.stdout.readline() == "ready\n"
        write_client(where / "bin", sock)
        yield where / "bin"
    finally:
        server.kill()
        server.wait()
        shutil.rmtree(where, ignore_errors=True)


def _matches(expected: str, printed: list[str]) -> bool:
    parts = [re.escape(" ".join(p.split())) for p in expected.split("...")]
    pattern = re.compile(".*".join(parts))
    return any(pattern.search(" ".join(line.split())) for line in printed)


def test_the_pages_that_must_run_examples_have_some() -> None:
    pages = {ex.page for ex in all_examples() if any(k == "sh" for k, _ in ex.steps)}
    assert set(MUST_RUN) <= pages, f"no runnable example in {sorted(set(MUST_RUN) - pages)}"


@pytest.mark.parametrize("ex", all_examples(), ids=lambda ex: f"{ex.page}:{ex.name}")
def test_an_example_runs_and_prints_what_the_page_shows(
    ex: Example, tmp_path: Path, fleetwave_bin: Path
) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLEETWAVE_")}
    env["PATH"] = f"{fleetwave_bin}{os.pathsep}{env.get('PATH', '')}"
    env["FLEETWAVE_DB"] = str(tmp_path / "fleet.db")
    env["PYTHONPATH"] = str(tmp_path)  # a plug-in module an example writes
    printed: list[str] = []
    for (kind, path), text in zip(ex.steps, ex.texts, strict=True):
        if kind == "file":
            (tmp_path / path).write_text(text, encoding="utf-8")
            continue
        run = subprocess.run(
            ["bash", "-c", "set -eo pipefail\n" + text],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        printed += (run.stdout + run.stderr).splitlines()
        assert run.returncode == 0, (
            f"{ex.page} example {ex.name} exited {run.returncode}:\n{text}\n"
            f"--- it printed:\n{run.stdout}{run.stderr}"
        )
    missing = [
        line
        for block in ex.outputs
        for line in block.splitlines()
        if line.strip() and not _matches(line, printed)
    ]
    assert not missing, (
        f"{ex.page} example {ex.name}: lines the page shows that the commands did not print:\n"
        + "\n".join(missing)
        + "\n--- they printed:\n"
        + "\n".join(printed)
    )


def test_an_expected_line_must_be_printed_to_match() -> None:
    printed = ["2026-12-06 02:38:39.264Z strategy 1: 4 of 4 steps ended (4 complete)"]
    assert _matches("... strategy 1: 4 of 4   steps ended ...", printed)
    assert not _matches("strategy 1: 3 of 4 steps ended", printed)
    assert not _matches("complete) ... strategy 1", printed)  # in order


def _cli_reference() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "cli_reference", ROOT / "scripts/cli_reference.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up there
    spec.loader.exec_module(module)
    return module


def test_the_cli_reference_is_what_the_command_tree_says() -> None:
    ref = _cli_reference()
    assert ref.PAGE.read_text(encoding="utf-8") == ref.render(), (
        "docs/reference/cli.md is stale: run .venv/bin/python scripts/cli_reference.py"
    )


def test_the_cli_reference_names_every_command_and_option() -> None:
    from fleetwave.cli.main import app

    page = (DOCS / "reference" / "cli.md").read_text(encoding="utf-8")
    missing: list[str] = []

    def visit(command: typer.core.TyperGroup, path: tuple[str, ...]) -> None:
        heading = f"`{' '.join(('fleetwave', *path))}`"
        section = ""
        if not re.search(rf"^#+ {re.escape(heading)}$", page, re.MULTILINE):
            missing.append(heading)
        else:
            start = re.search(rf"^#+ {re.escape(heading)}$", page, re.MULTILINE)
            assert start is not None
            following = re.search(r"^#+ `", page[start.end() :], re.MULTILINE)
            end = start.end() + following.start() if following else len(page)
            section = page[start.end() : end]
        for param in command.params:
            if getattr(param, "hidden", False):
                continue
            for opt in [*param.opts, *param.secondary_opts]:
                if opt.startswith("-") and not re.search(rf"`[^`]*{re.escape(opt)}\b", section):
                    missing.append(f"{heading} {opt}")
        for name, sub in getattr(command, "commands", {}).items():
            if not sub.hidden:
                visit(sub, (*path, name))

    visit(typer.main.get_command(app), ())
    assert not missing, f"missing from docs/reference/cli.md: {missing}"


def test_the_tests_readme_names_only_tests_that_exist() -> None:
    text = (ROOT / "tests" / "README.md").read_text(encoding="utf-8")
    here = ROOT / "tests"
    missing = [f for f in set(re.findall(r"`(test_\w+\.py)", text)) if not (here / f).exists()]
    for file, name in re.findall(r"`(test_\w+\.py)::(test_\w+)`", text):
        if (here / file).exists() and not re.search(
            rf"def {name}\b", (here / file).read_text(encoding="utf-8")
        ):
            missing.append(f"{file}::{name}")
    assert not missing, f"tests/README.md names tests that are not there: {sorted(missing)}"


def _slug(heading: str) -> str:
    """The anchor Python-Markdown's toc extension gives a heading (the manual's links)."""
    text = unicodedata.normalize("NFKD", heading).encode("ascii", "ignore").decode()
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def test_the_readmes_links_lead_somewhere() -> None:
    """README.md is not part of the manual's build, whose strict mode checks the pages'
    links: its own links to files, and to headings in them, are checked here."""
    broken = []
    for readme in (ROOT / "README.md", ROOT / "tests" / "README.md"):
        text = readme.read_text(encoding="utf-8")
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+://", target):
                continue
            path, _, anchor = target.partition("#")
            file = (readme.parent / path).resolve()
            if not file.exists():
                broken.append(f"{readme.name}: {target}")
            elif anchor:
                headings = re.findall(r"^#+ (.+)$", file.read_text(encoding="utf-8"), re.M)
                if anchor not in {_slug(h.replace("`", "")) for h in headings}:
                    broken.append(f"{readme.name}: {target} (no such heading)")
    assert not broken, broken
