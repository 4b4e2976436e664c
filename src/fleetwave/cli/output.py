"""Printing results: Rich tables for people, JSON for scripts (``--format json``)."""

from __future__ import annotations

import io
import json
import logging
import math
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from datetime import UTC, datetime
from enum import StrEnum
from itertools import chain, islice
from typing import IO, Any, TextIO, cast

from rich.cells import cell_len
from rich.console import Console
from rich.table import Table


class _Console(Console):
    def on_broken_pipe(self) -> None:
        """The reader went away: as for a plain write (Rich's own answer exits 1, which
        the exit codes keep for "no"); ``main`` exits 141."""
        self.quiet = True
        raise BrokenPipeError


# A message is one line however long (the terminal wraps it on screen; a pipe, grep or
# a log keeps it whole): Rich would break it at 80 columns when not writing to a
# terminal. Tables are still drawn to the width.
# No markup unless a call asks for it: what is printed, table cells too, holds
# operators' and targets' text (a message with "[/tmp/sock]" made Rich fail).
console = _Console(soft_wrap=True, markup=False)
err_console = _Console(stderr=True, soft_wrap=True, markup=False)


class ConsoleLogHandler(logging.Handler):
    """Log lines go through the same console as the live progress bar, which Rich
    then keeps below them (a plain stream handler wrote into the bar's line)."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            err_console.print(self.format(record), highlight=False)
        except Exception:
            self.handleError(record)


class Format(StrEnum):
    table = "table"
    json = "json"


#: the seconds part of times shown lately ("2026-12-01 13:19:13"), by whole second: a
#: rollout's journal has thousands of rows in each second (history of 600,000 rows spent
#: a third of its time formatting dates)
_SECONDS: dict[int, str] = {}


def when(ts: float | None) -> str:
    """A stored time as tables show it: UTC, to the millisecond, marked Z (as log lines).

    As ``datetime.fromtimestamp(ts, UTC)`` gives it: rounded to the microsecond (half
    to even), then cut to the millisecond."""
    if ts is None:
        return ""
    frac, whole = math.modf(ts)
    second, us = int(whole), round(frac * 1_000_000)
    if us >= 1_000_000:
        second, us = second + 1, us - 1_000_000
    elif us < 0:
        second, us = second - 1, us + 1_000_000
    base = _SECONDS.get(second)
    if base is None:
        if len(_SECONDS) > 4096:
            _SECONDS.clear()
        base = _SECONDS[second] = datetime.fromtimestamp(second, UTC).strftime("%Y-%m-%d %H:%M:%S")
    return f"{base}.{us // 1000:03d}Z"


#: what :func:`when` gives is always this wide
WHEN_WIDTH = len("2026-12-01 13:19:13.403Z")


def utc_log_formatter() -> logging.Formatter:
    """Log lines timed as tables are (UTC, marked Z): one event, one time, on any TZ."""
    formatter = logging.Formatter(
        "%(asctime)s.%(msecs)03dZ %(levelname)s %(name)s: %(message)s",
        datefmt="%Y-%m-%d %H:%M:%S",
    )
    formatter.converter = time.gmtime
    return formatter


#: what every log record has: the fields a log call adds (``extra=``) are the others
_RECORD_FIELDS = frozenset(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {
    "message",
    "asctime",
    "taskName",
}


class LogFormat(StrEnum):
    """``serve --log-format``: how log lines are written."""

    text = "text"
    json = "json"


class JsonLogFormatter(logging.Formatter):
    """``serve --log-format json``: a log record as one JSON object on one line: its
    ``time`` (UTC, ISO 8601, to the millisecond), ``level``, ``logger`` and ``message``,
    and the fields its log call gave (``strategy``, ``step``, ``target``, ``state``)."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": when(record.created).replace(" ", "T"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key not in _RECORD_FIELDS and not key.startswith("_"):
                entry.setdefault(key, value)
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False, default=str)


class JsonLines(io.TextIOBase):
    """A stream whose every line becomes a JSON log object (``logger`` fleetwave.cli;
    ``level`` warning or error when the line says so): what the command itself says on
    stderr (where it serves, how it stopped) in the same form as its log lines."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self._held = ""

    def writable(self) -> bool:
        return True

    def isatty(self) -> bool:
        return False

    def write(self, text: str) -> int:
        *lines, self._held = (self._held + text).split("\n")
        for line in lines:
            if line.strip():
                self._say(line)
        return len(text)

    def flush(self) -> None:
        self.stream.flush()

    def _say(self, line: str) -> None:
        level = next((lv for lv in ("warning", "error") if line.startswith(f"{lv}: ")), "info")
        entry = {
            "time": when(time.time()).replace(" ", "T"),
            "level": level,
            "logger": "fleetwave.cli",
            "message": line,
        }
        self.stream.write(json.dumps(entry, ensure_ascii=False) + "\n")


def use_json_logs() -> None:
    """From now on, every line on stderr is a JSON object: log records (through
    :class:`JsonLogFormatter`), and what the command prints there."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonLogFormatter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    err_console.file = cast(IO[str], JsonLines(sys.stderr))


def _is_time(key: str) -> bool:
    """A field holding a stored time (shown as one, never split over two lines)."""
    return key.endswith(("_at", "_until")) or key == "at"


def _cell(key: str, value: Any) -> str:
    return _time_text(value) if _is_time(key) else _text(value)


def _time_text(value: Any) -> str:
    return "" if value is None else when(float(value))


def _text(value: Any) -> str:
    """A value that is not a time as a cell shows it."""
    if value is None:
        return ""
    if isinstance(value, dict | list):
        return json.dumps(value, sort_keys=True)
    return str(value)


def print_json(data: Any) -> None:
    sys.stdout.write(json.dumps(data, indent=2, sort_keys=True, default=str) + "\n")


def emit_rows(
    rows: Iterable[dict[str, Any]] | Callable[[], Iterable[dict[str, Any]]],
    columns: list[str],
    fmt: Format,
    title: str | None = None,
    *,
    whole_first: bool = False,
) -> None:
    """Print rows as a table or JSON: a list, or a function that reads them afresh
    each time it is called (a long table is then read twice, once for its column
    widths and once to print, instead of being held whole).

    ``whole_first``: the first column is never wrapped or cut (short names only).
    """
    read = rows if callable(rows) else _held(rows)
    it = iter(read())
    if fmt is Format.json:
        _json_rows(it)
        return
    if not console.is_terminal:
        # Piped or redirected: plain columns, one line per row whatever the width (a
        # drawn table wrapped long cells over several lines, and changed its shape with
        # $COLUMNS and the data): grep and awk see whole rows. No "(none)" line either:
        # no rows is a header alone.
        _plain_rows(it, read, columns, title)
        return
    head = list(islice(it, PLAIN_ABOVE + 1))
    if len(head) > PLAIN_ABOVE:
        _plain_rows(chain(head, it), read, columns, title)
        return
    widths = _column_widths(head, columns, whole_first, console.width)
    if widths is None:
        # Some word (a target name, a state, a conductor id) is wider than the column
        # a boxed table could give it at this width: Rich would cut or fold it. Plain
        # columns keep every value whole, one line per row (the terminal wraps it).
        _plain_rows(head, lambda: head, columns, title)
        if not head:
            console.print("(none)")
        return
    table = Table(title=title, show_lines=False)
    for i, col in enumerate(columns):
        whole = (whole_first and i == 0) or _is_time(col)
        table.add_column(col, no_wrap=whole, overflow="fold", width=widths[i])
    for row in head:
        table.add_row(*(_cell(c, row.get(c)) for c in columns))
    console.print(table, soft_wrap=False)  # a drawn table: its title centred
    if not head:
        console.print("(none)")


#: past this many rows a table is printed as plain aligned columns: Rich measures and
#: wraps every cell (12,000 journal rows took 16 s; a 100,000-target strategy's
#: history would take many minutes), plain columns print at once
PLAIN_ABOVE = 500


def first_then(
    first: Iterator[dict[str, Any]], again: Callable[[], Iterator[dict[str, Any]]]
) -> Callable[[], Iterator[dict[str, Any]]]:
    """Rows for :func:`emit_rows` to read twice: the reader already made (its checks
    done before anything is printed), then fresh ones."""
    made = [first]

    def read() -> Iterator[dict[str, Any]]:
        return made.pop() if made else again()

    return read


def _column_widths(
    rows: list[dict[str, Any]], columns: list[str], whole_first: bool, room: int
) -> list[int | None] | None:
    """Column widths for a boxed table of ``rows`` in ``room`` cells that splits no
    word (a name, an id, a state): None when no such table fits; each None (Rich
    sizes it) when the table fits whole.

    Each column gets at least its longest word, header included (its whole first
    cell when ``whole_first``); the room left goes to the columns whose text is
    longer than that, in proportion. Rich's own sizing splits or cuts words before
    it wraps text at spaces, and a minimum width made it overflow the terminal.
    """
    need = [max((_width(w) for w in col.split()), default=0) for col in columns]
    full = [_width(col) for col in columns]
    # a time is one word
    whole = [(whole_first and i == 0) or _is_time(col) for i, col in enumerate(columns)]
    for row in rows:
        for i, col in enumerate(columns):
            text = _cell(col, row.get(col))
            full[i] = max(full[i], *(_width(line) for line in text.splitlines() or [""]))
            for word in [text] if whole[i] else text.split():
                need[i] = max(need[i], _width(word))
    room -= 3 * len(columns) + 1  # a border and two spaces of padding per column
    if sum(full) <= room:
        return [None] * len(columns)
    if sum(need) > room:
        return None
    spare, wants = room - sum(need), [f - n for f, n in zip(full, need, strict=True)]
    widths: list[int | None] = [
        n + spare * w // sum(wants) for n, w in zip(need, wants, strict=True)
    ]
    return widths


def _held(rows: Iterable[dict[str, Any]]) -> Callable[[], Iterable[dict[str, Any]]]:
    """Rows already in memory, to be read as often as asked."""
    held = rows if isinstance(rows, list) else list(rows)
    return lambda: held


def _json_rows(rows: Iterator[dict[str, Any]]) -> None:
    """A JSON array written a row at a time, one row per line (memory stays flat)."""
    write = sys.stdout.write
    sep = "[\n"
    for row in rows:
        write(sep + "  " + json.dumps(row, sort_keys=True, default=str))
        sep = ",\n"
    write("[]\n" if sep == "[\n" else "\n]\n")


def _width(text: str) -> int:
    """Terminal cells, not characters: a CJK name takes two per character; a name the
    output's encoding cannot show is printed backslash-escaped (``\\xf1``), and takes
    the escapes' width (the columns after it stayed where the name would have ended)."""
    if text.isascii():
        return len(text)
    encoding = getattr(sys.stdout, "encoding", None) or "utf-8"
    try:
        text.encode(encoding)
    except UnicodeEncodeError:
        text = text.encode(encoding, "backslashreplace").decode(encoding)
    except LookupError:
        pass
    return cell_len(text)


def _plain_cells(row: dict[str, Any], columns: list[str]) -> tuple[str, ...]:
    return tuple(_one_line(_cell(c, row.get(c))) for c in columns)


def _one_line(text: str) -> str:
    """A cell on one line: its line breaks and tabs as spaces."""
    if "\n" in text or "\t" in text:
        return text.replace("\n", " ").replace("\t", " ")
    return text


def _plain_text(value: Any) -> str:
    """A value that is not a time as a plain table's cell shows it: on one line."""
    return _one_line(_text(value))


def _plain_rows(
    first: Iterable[dict[str, Any]],
    again: Callable[[], Iterable[dict[str, Any]]],
    columns: list[str],
    title: str | None,
) -> None:
    """Columns padded to their widest value, two spaces apart, one line per row. The
    widths come from one read, the lines from a second, so memory stays flat (rows
    added in between are printed; a longer value only shifts its line)."""
    widths = [_width(col) for col in columns]
    # Each column's way to show a value, chosen once (rows of 600,000 are read twice).
    # A time's width is known: only whether there is one.
    times = [(i, col) for i, col in enumerate(columns) if _is_time(col)]
    texts = [(i, col) for i, col in enumerate(columns) if not _is_time(col)]
    for row in first:
        for i, col in texts:
            w = _width(_plain_text(row.get(col)))
            if w > widths[i]:
                widths[i] = w
        for i, col in times:
            if widths[i] < WHEN_WIDTH and row.get(col) is not None:
                widths[i] = WHEN_WIDTH
    shows = [(col, _time_text if _is_time(col) else _plain_text) for col in columns]
    write = sys.stdout.write
    if title:
        # after a blank line, ending in a colon: not read as a field with no value
        write(f"\n{title}:\n")
    write(_line(columns, widths) + "\n" + _line(["-" * w for w in widths], widths) + "\n")
    for row in again():
        write(_line([show(row.get(col)) for col, show in shows], widths) + "\n")


def _line(values: Iterable[str], widths: list[int]) -> str:
    return "  ".join(
        v + " " * max(0, w - _width(v)) for v, w in zip(values, widths, strict=True)
    ).rstrip()


def emit_one(obj: dict[str, Any], fmt: Format) -> None:
    if fmt is Format.json:
        print_json(obj)
        return
    # a list of rows (history, events, callbacks) with none: "none" among the fields
    # (it prints as a table of its own below them when it has some)
    obj = {k: "none" if isinstance(v, list) and not v else v for k, v in obj.items()}
    if not console.is_terminal:
        # piped: one "field  value" line each, never wrapped (as emit_rows' plain rows)
        fields = [
            (key, _plain_cells({key: value}, [key])[0])
            for key, value in obj.items()
            if not _is_section(value)
        ]
        width = max((_width(key) for key, _ in fields), default=0)
        sys.stdout.write("".join(_line([k, v], [width, 0]) + "\n" for k, v in fields))
    else:
        _boxed_fields(obj)
    for key, value in obj.items():
        if _is_section(value):
            emit_rows(value, list(value[0].keys()), fmt, title=key)


def _is_section(value: Any) -> bool:
    """A list of rows in a shown object: a table of its own after the fields."""
    return isinstance(value, list) and bool(value) and isinstance(value[0], dict)


def _boxed_fields(obj: dict[str, Any]) -> None:
    table = Table(show_header=False)
    table.add_column("field", style="bold", no_wrap=True)
    table.add_column("value", overflow="fold")
    for key, value in obj.items():
        if not _is_section(value):
            table.add_row(key, _cell(key, value))
    console.print(table, soft_wrap=False)  # a drawn table: its title centred
