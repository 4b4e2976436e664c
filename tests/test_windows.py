"""When steps may start: ``--start-after`` (nothing before it, and apply says so),
``--window`` (weekly; no new step outside it, steps in flight go on to their end) and
``--deadline`` (nothing new after it; the strategy ends failed naming it once the steps
in flight have ended); on virtual time. Bad times refused."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime
from pathlib import Path

import pytest

from cli_harness import Cli
from conftest import on_virtual_time
from fleetwave.domain.errors import InputError
from fleetwave.domain.models import StrategyOptions
from fleetwave.domain.windows import (
    check_times,
    parse_time,
    parse_window,
    window_at,
)
from fleetwave.engine.clock import LoopClock
from fleetwave.engine.conductor import Conductor
from fleetwave.engine.config import EngineConfig
from fleetwave.store import admin, queries
from fleetwave.store.db import Store
from fleetwave.testing.invariants import check
from rollout_world import PATCH, ended, entries, fleet, started

EPOCH = LoopClock().epoch  # 2027-01-15 08:00 UTC, a Friday: the tests' virtual "now"


def _run(
    store: Store, seen_at: float | None = None, tick_s: float = 1, **options: object
) -> tuple[int, str, dict]:
    """Create and apply a strategy over all targets, one at a time; drive it on virtual
    time (``seen_at``: read ``strategy show`` then, seconds from the start; a week of
    it runs with a long tick and lease, or the periodic pass's renewals take minutes)."""
    sid = admin.create_strategy(
        store, PATCH, StrategyOptions(max_parallel=1, **options), all_targets=True
    )
    admin.apply_strategy(store, sid)
    config = EngineConfig(tick_s=tick_s, lease_ttl_s=max(30, 20 * tick_s))
    conductor = Conductor(store, clock=LoopClock(), config=config)
    seen: dict = {}

    async def go() -> str:
        task = asyncio.create_task(conductor.run(strategy_ids=[sid]))
        if seen_at is not None:
            await asyncio.sleep(seen_at)
            seen.update(queries.get_strategy(store, sid))
        return (await asyncio.wait_for(task, 30 * 86_400))[sid]

    return sid, on_virtual_time(go()), seen


def test_nothing_starts_before_start_after(store: Store) -> None:
    fleet(store, {None: 2}, latency_ms=1000)
    sid, final, seen = _run(store, 600, start_after=EPOCH + 3600)
    assert final == "complete"
    first = started(entries(store, sid))[0]
    assert first.at == EPOCH + 3600
    assert seen["details"] == "waiting until 2027-01-15 09:00Z (--start-after)"
    assert seen["state"] == "applying"
    assert check(store, sid).ok


def test_steps_start_only_inside_the_window_and_go_on_to_their_end(store: Store) -> None:
    # a step takes 5 states x 4 min = 20 min; the window is 30 min each Saturday
    fleet(store, {None: 3}, latency_ms=240_000)
    window = "Sat 01:00-01:30 UTC"
    sid, final, seen = _run(store, 3600, tick_s=120, windows=[window])
    assert final == "complete"
    rows = entries(store, sid)
    windows = [parse_window(window)]
    starts = [e.at for e in started(rows)]
    for at in starts:
        assert window_at(windows, at)[0], datetime.fromtimestamp(at, UTC)
    saturday = datetime(2027, 1, 16, 1, 0, tzinfo=UTC).timestamp()
    week = 7 * 86_400
    # the first two in the first window (the second started at 01:20, inside it, and went
    # on past its end), the third a week later
    assert starts == [saturday, saturday + 1200, saturday + week]
    assert ended(rows)[1].at == saturday + 2400  # 01:40: past the window's end
    assert seen["details"] == (
        "waiting for a window (Sat 01:00-01:30 UTC): the next opens at 2027-01-16 01:00Z"
    )
    assert check(store, sid).ok


def test_after_the_deadline_nothing_starts_and_the_strategy_fails_naming_it(
    store: Store,
) -> None:
    # a step takes 12 min; the deadline comes 30 min in, while the third runs
    fleet(store, {None: 5}, latency_ms=144_000)
    sid, final, _ = _run(store, deadline=EPOCH + 1800)
    assert final == "failed"
    why = "stopped: the deadline 2027-01-15 08:30Z passed (--deadline)"
    assert queries.get_strategy(store, sid)["details"] == why
    rows = entries(store, sid)
    assert [e.at - EPOCH for e in started(rows)] == [0, 720, 1440]
    assert queries.step_counts(store, sid) == {"complete": 3, "aborted": 2}
    aborted = [e for e in rows if e.to_state == "aborted"]
    assert {e.details for e in aborted} == {f"not started: {why}"}
    # the third went on to its end (36 min) before the waiting ones were ended
    assert all(e.at == EPOCH + 2160 for e in aborted)
    assert check(store, sid).ok


@pytest.mark.parametrize(
    ("text", "days", "start", "end"),
    [
        ("Sat 01:00-05:00 UTC", {5}, 60, 300),
        ("Mon-Fri 22:00-02:00 Europe/Berlin", {0, 1, 2, 3, 4}, 1320, 120),
        ("Sat,Sun 00:00-23:59", {5, 6}, 0, 1439),
        ("01:00-05:00", set(range(7)), 60, 300),
        ("Fri-Mon 01:00-02:00", {4, 5, 6, 0}, 60, 120),
    ],
)
def test_windows_are_read(text: str, days: set[int], start: int, end: int) -> None:
    w = parse_window(text)
    assert (set(w.days), w.start_min, w.end_min) == (days, start, end)


def test_a_window_past_midnight_and_in_its_zone() -> None:
    w = [parse_window("Fri 23:00-01:00 Europe/Berlin")]
    friday_2330_berlin = datetime(2027, 1, 15, 22, 30, tzinfo=UTC).timestamp()
    inside, closes = window_at(w, friday_2330_berlin)
    assert inside and closes == datetime(2027, 1, 16, 0, 0, tzinfo=UTC).timestamp()
    inside, opens = window_at(w, closes)
    assert not inside and opens == datetime(2027, 1, 22, 22, 0, tzinfo=UTC).timestamp()


@pytest.mark.parametrize(
    ("after", "windows", "deadline", "said"),
    [
        (None, [], "2027-01-15T07:00Z", "--deadline: 2027-01-15 07:00Z has passed already"),
        (
            "2027-01-16T00:00Z",
            [],
            "2027-01-15T12:00Z",
            "--deadline: 2027-01-15 12:00Z is not after --start-after 2027-01-16 00:00Z",
        ),
        (
            None,
            ["Sat 01:00-05:00 UTC"],
            "2027-01-16T00:30Z",
            "--window: Sat 01:00-05:00 UTC never opens between 2027-01-15 08:00Z and the "
            "deadline 2027-01-16 00:30Z",
        ),
    ],
)
def test_times_that_cannot_work_are_refused(
    after: str | None, windows: list[str], deadline: str, said: str
) -> None:
    with pytest.raises(InputError) as exc:
        check_times(
            None if after is None else parse_time(after, "--start-after"),
            [parse_window(w) for w in windows],
            parse_time(deadline, "--deadline"),
            EPOCH,
        )
    assert str(exc.value) == said


@pytest.mark.parametrize(
    ("text", "said"),
    [
        ("Sat 01:00-01:00", "--window: 'Sat 01:00-01:00' never opens (it starts where it ends)"),
        ("Sat 25:00-26:00", "--window: 25:00 in 'Sat 25:00-26:00' is not a time of day"),
        ("Sab 01:00-02:00", "--window: 'sab' in 'Sab 01:00-02:00' is not a day (Mon ... Sun)"),
        ("Sat 01:00-02:00 Mars/Base", "--window: 'Mars/Base' is not a time zone"),
        ("weekends", "--window: expected [DAYS] HH:MM-HH:MM [ZONE]"),
    ],
)
def test_bad_windows_are_refused(text: str, said: str) -> None:
    with pytest.raises(InputError) as exc:
        parse_window(text)
    assert str(exc.value).startswith(said)


def test_times_on_the_command_line(cli: Cli, db_path: Path) -> None:
    assert cli("target", "add", "t1").code == 0
    res = cli("strategy", "create", "--workflow", "patch", "--all", "--start-after", "2027-01-02")
    assert res.code == 2
    assert res.err.strip() == (
        "error: --start-after: '2027-01-02' has no time zone: add Z (UTC) or +01:00"
    )
    res = cli(
        "strategy", "create", "--workflow", "patch", "--all", "--dry-run",
        "--start-after", "2099-01-03T01:00Z", "--window", "Sat 01:00-05:00 UTC",
    )  # fmt: skip
    assert res.code == 0, res.text
    assert "starts 2099-01-03 01:00Z" in res.out  # a Saturday, inside the window
    assert "windows: Sat 01:00-05:00 UTC" in res.out
    res = cli(
        "strategy", "create", "--workflow", "patch", "--all", "--start-after", "2099-01-03T01:00Z"
    )
    assert res.code == 0
    res = cli("strategy", "apply", "1")
    assert "strategy 1: nothing starts before 2099-01-03 01:00Z (--start-after)" in res.out
