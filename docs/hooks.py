"""MkDocs hook: serve bench/RESULTS.md and bench/IO_BOUND.md as pages of the manual.

They live beside the benchmark that writes them (bench/), not in docs/: the manual links
them where they are instead of keeping a copy that would go stale.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

REPO = Path(__file__).resolve().parent.parent
LINKED = ("bench/RESULTS.md", "bench/IO_BOUND.md")


def on_files(files: Files, config: Any) -> Files:
    for rel in LINKED:
        files.append(File.generated(config, rel, abs_src_path=str(REPO / rel)))
    return files
