"""Printing results: Rich tables for people, JSON for scripts (``--format json``)."""

from __future__ import annotations

import json
import sys
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any

from rich.console import Console
from rich.table import Table

console = Console()
err_console = Console(stderr=True)


class Format(StrEnum):
    table = "table"
    json = "json"


def when(ts: float | None) -> str:
    if ts is None:
        return ""
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3]


def _cell(key: str, value: Any) -> str:
    if value is None:
        return ""
    if key.endswith("_at") or key == "at":
        return when(float(value))
    if isinstance(value, dict | list):
        return json.dumps(value, sort_keys=True)
    return str(value)


def print_json(data: Any) -> None:
    sys.stdout.write(json.dumps(data, indent=2, sort_keys=True, default=str) + "\n")


def emit_rows(
    rows: list[dict[str, Any]],
    columns: list[str],
    fmt: Format,
    title: str | None = None,
    *,
    whole_first: bool = False,
) -> None:
    """``whole_first``: the first column is never wrapped or cut (short names only)."""
    if fmt is Format.json:
        print_json(rows)
        return
    table = Table(title=title, show_lines=False)
    for i, col in enumerate(columns):
        table.add_column(col, no_wrap=whole_first and i == 0)
    for row in rows:
        table.add_row(*(_cell(c, row.get(c)) for c in columns))
    console.print(table)
    if not rows:
        console.print("(none)")


def emit_one(obj: dict[str, Any], fmt: Format) -> None:
    if fmt is Format.json:
        print_json(obj)
        return
    table = Table(show_header=False)
    table.add_column("field", style="bold")
    table.add_column("value")
    for key, value in obj.items():
        if isinstance(value, list) and value and isinstance(value[0], dict):
            continue
        table.add_row(key, _cell(key, value))
    console.print(table)
    for key, value in obj.items():
        if isinstance(value, list) and value and isinstance(value[0], dict):
            emit_rows(value, list(value[0].keys()), fmt, title=key)
