"""When a rollout may start steps: ``--start-after``, ``--window`` and ``--deadline``.

Pure: text in, epoch seconds out. A window repeats each week on its days
(``Sat 01:00-05:00 UTC``, ``Mon-Fri 22:00-02:00 Europe/Berlin``, ``01:00-05:00``:
every day, UTC); one that ends at or before its start runs past midnight into the
next day. :func:`window_at` says whether a time is inside one of a strategy's windows
and when that changes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta, tzinfo
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from fleetwave.domain.errors import InputError
from fleetwave.domain.models import shown

DAYS = ("mon", "tue", "wed", "thu", "fri", "sat", "sun")
_WINDOW = re.compile(
    r"(?:(?P<days>[A-Za-z]{3}(?:[-,][A-Za-z]{3})*)\s+)?"
    r"(?P<start>\d{1,2}:\d{2})\s*-\s*(?P<end>\d{1,2}:\d{2})"
    r"(?:\s+(?P<tz>\S+))?"
)


@dataclass(frozen=True)
class Window:
    """A weekly window: its days (0 = Monday), start and end (minutes into the day), and
    time zone name."""

    days: frozenset[int]
    start_min: int
    end_min: int
    zone: str
    text: str

    def opens(self, start: datetime) -> list[tuple[float, float]]:
        """Its occurrences (opening, closing; epoch seconds) from the day before
        ``start`` to eight days after."""
        tz = zone_of(self.zone)
        local = start.astimezone(tz).date()
        out = []
        for offset in range(-1, 9):
            day = local + timedelta(days=offset)
            if day.weekday() not in self.days:
                continue
            length = (self.end_min - self.start_min) % (24 * 60)
            begin = _at(day, self.start_min, tz)
            out.append((begin, begin + length * 60))
        return out


def _at(day: date, minutes: int, tz: tzinfo) -> float:
    hour, minute = divmod(minutes, 60)
    return datetime(day.year, day.month, day.day, hour, minute, tzinfo=tz).timestamp()


def zone_of(name: str) -> tzinfo:
    if name.upper() in ("UTC", "Z", "GMT"):
        return UTC
    return ZoneInfo(name)


def parse_window(text: str) -> Window:
    """``[DAYS] HH:MM-HH:MM [ZONE]``: DAYS as ``Sat``, ``Mon-Fri`` or ``Sat,Sun`` (none:
    every day), ZONE as ``UTC`` (the default) or a name such as ``Europe/Berlin``."""
    found = _WINDOW.fullmatch(text.strip())
    if found is None:
        raise InputError(
            f"--window: expected [DAYS] HH:MM-HH:MM [ZONE] (Sat 01:00-05:00 UTC), got {shown(text)}"
        )
    days = _days(found.group("days"), text)
    start, end = (_minutes(found.group(k), text) for k in ("start", "end"))
    if start == end:
        raise InputError(f"--window: {shown(text)} never opens (it starts where it ends)")
    zone = found.group("tz") or "UTC"
    try:
        zone_of(zone)
    except (ZoneInfoNotFoundError, ValueError):
        raise InputError(
            f"--window: {shown(zone)} is not a time zone (UTC, Europe/Berlin)"
        ) from None
    return Window(days, start, end, zone, text.strip())


def _days(given: str | None, text: str) -> frozenset[int]:
    if given is None:
        return frozenset(range(7))
    out: set[int] = set()
    for part in given.lower().split(","):
        ends = part.split("-")
        if any(d not in DAYS for d in ends) or len(ends) > 2:
            raise InputError(f"--window: {shown(part)} in {shown(text)} is not a day (Mon ... Sun)")
        first, last = DAYS.index(ends[0]), DAYS.index(ends[-1])
        out.update(d % 7 for d in range(first, first + (last - first) % 7 + 1))
    return frozenset(out)


def _minutes(hhmm: str, text: str) -> int:
    hours, minutes = (int(x) for x in hhmm.split(":"))
    if hours > 23 or minutes > 59:
        raise InputError(f"--window: {hhmm} in {shown(text)} is not a time of day")
    return hours * 60 + minutes


def window_at(windows: list[Window], now: float) -> tuple[bool, float | None]:
    """Whether ``now`` is inside one of ``windows``, and when that changes (the end of
    the window it is in, or the next opening); None: never."""
    if not windows:
        return True, None
    start = datetime.fromtimestamp(now, UTC)
    spans = sorted(span for w in windows for span in w.opens(start))
    inside = [end for begin, end in spans if begin <= now < end]
    if inside:
        # (overlapping windows: open until the last of them that covers now closes)
        until = max(inside)
        for begin, end in spans:
            if begin <= until < end:
                until = max(until, end)
        return True, until
    later = [begin for begin, _ in spans if begin > now]
    return False, min(later) if later else None


def parse_time(text: str, option: str) -> float:
    """An ISO 8601 time with its zone (``2026-12-06T01:00Z``, ``...+01:00``): epoch
    seconds."""
    given = text.strip()
    try:
        when = datetime.fromisoformat(given.replace(" ", "T", 1))
    except ValueError:
        raise InputError(
            f"{option}: expected a time such as 2026-12-06T01:00Z, got {shown(text)}"
        ) from None
    if when.tzinfo is None:
        raise InputError(f"{option}: {shown(given)} has no time zone: add Z (UTC) or +01:00")
    return when.timestamp()


def shown_time(epoch: float) -> str:
    """A time as the strategy's messages give it: ``2026-12-06 01:00Z``."""
    when = datetime.fromtimestamp(epoch, UTC)
    return when.strftime("%Y-%m-%d %H:%M" + (":%S" if when.second else "") + "Z")


def check_times(
    start_after: float | None, windows: list[Window], deadline: float | None, now: float
) -> None:
    """Refuse times that cannot work: a deadline past already or before the start, and
    windows none of which opens between the start and the deadline."""
    start = max(now, start_after or now)
    if deadline is not None:
        if start_after is not None and deadline <= start_after:
            raise InputError(
                f"--deadline: {shown_time(deadline)} is not after --start-after "
                f"{shown_time(start_after)}"
            )
        if deadline <= now:
            raise InputError(f"--deadline: {shown_time(deadline)} has passed already")
    if windows:
        inside, opens = window_at(windows, start)
        if not inside and deadline is not None and (opens is None or opens >= deadline):
            raise InputError(
                f"--window: {'; '.join(w.text for w in windows)} never opens between "
                f"{shown_time(start)} and the deadline {shown_time(deadline)}"
            )


def earliest_start(start_after: float | None, windows: list[Window], now: float) -> float:
    """When a strategy applied at ``now`` may start its first step."""
    start = max(now, start_after or now)
    inside, opens = window_at(windows, start)
    return start if inside or opens is None else opens
