"""Between stages: ``--stage-wait`` (the next stage starts that long after the one
before ended, also across a takeover) and ``--stage-approval`` (the strategy waits
``waiting-approval`` until ``strategy approve ID``, recorded with who approved); what
``strategy show`` says meanwhile; bad input."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import pytest

from cli_harness import Cli
from conftest import on_virtual_time
from fleetwave.domain.errors import Conflict, InputError
from fleetwave.domain.models import StrategyOptions
from fleetwave.domain.rollout import RolloutSpec, parse_duration, parse_stages
from fleetwave.engine.clock import LoopClock
from fleetwave.engine.conductor import Conductor
from fleetwave.engine.config import EngineConfig
from fleetwave.store import admin, queries
from fleetwave.store.db import Store, open_store
from fleetwave.testing.invariants import check
from rollout_world import PATCH, entries, fleet, phases_in_order

TWO_STAGES = RolloutSpec(stages=parse_stages(["a", "b"]))


def _created(store: Store, **options: Any) -> int:
    fleet(store, {"a": 2, "b": 2}, latency_ms=1000)
    sid = admin.create_strategy(
        store, PATCH, StrategyOptions(**options), all_targets=True, spec=TWO_STAGES
    )
    admin.apply_strategy(store, sid)
    return sid


def _conductor(store: Store) -> Conductor:
    return Conductor(store, clock=LoopClock(), config=EngineConfig(tick_s=1))


def _meanwhile(
    store: Store, sid: int, *at: tuple[float, Callable[[], None]]
) -> Coroutine[Any, Any, str]:
    """Drive ``sid`` to its end, doing each thing at its time (virtual seconds)."""

    async def go() -> str:
        task = asyncio.create_task(_conductor(store).run(strategy_ids=[sid]))
        for when, what in at:
            await asyncio.sleep(when - asyncio.get_running_loop().time())
            what()
        return (await asyncio.wait_for(task, 100_000))[sid]

    return go()


def test_the_next_stage_starts_the_wait_after_the_stage_before_ended(store: Store) -> None:
    sid = _created(store, stage_wait_s=600)
    seen: dict[str, Any] = {}

    def look() -> None:
        seen.update(queries.get_strategy(store, sid))

    assert on_virtual_time(_meanwhile(store, sid, (300, look))) == "complete"
    spans = phases_in_order(entries(store, sid))
    assert spans[2][0].at - spans[1][1].at == 600  # the journal's times: exactly the wait
    assert seen["state"] == "applying"
    assert seen["details"] == (
        "waiting 10m after stage 1 ended (--stage-wait) before stage 2 of 2 (b)"
    )
    assert queries.get_strategy(store, sid)["details"] == ""  # said no more once over
    assert check(store, sid).ok


def test_a_takeover_during_the_wait_does_not_start_it_again(store: Store) -> None:
    sid = _created(store, stage_wait_s=600)

    async def go() -> str:
        stop = asyncio.Event()
        first = asyncio.create_task(_conductor(store).run(strategy_ids=[sid], stop=stop))
        await asyncio.sleep(300)  # stage a ended at 5 s: in the middle of the wait
        stop.set()
        await first
        return (await _conductor(store).run(strategy_ids=[sid]))[sid]

    assert on_virtual_time(go()) == "complete"
    spans = phases_in_order(entries(store, sid))
    assert spans[2][0].at - spans[1][1].at == 600


def test_the_next_stage_waits_for_an_approval_recorded_with_who(store: Store) -> None:
    sid = _created(store, stage_approval=True)
    seen: dict[str, Any] = {}

    def look() -> None:
        seen.update(queries.get_strategy(store, sid))

    def approve() -> None:
        assert admin.approve_strategy(store, sid, "alice")["stage"] == 2

    final = on_virtual_time(_meanwhile(store, sid, (3600, look), (7200, approve)))
    assert final == "complete"
    assert seen["state"] == "waiting-approval"
    assert seen["details"] == (
        f"waiting for approval of stage 2 of 2 (b): 'fleetwave strategy approve {sid}'"
    )
    assert [s["state"] for s in seen["stages"]] == ["done", "next"]  # held, none started
    spans = phases_in_order(entries(store, sid))
    start_of_b = spans[2][0].at - LoopClock().epoch
    assert 7200 <= start_of_b <= 7201  # at the next tick after the approval
    shown = queries.get_strategy(store, sid)
    assert [a["details"] for a in shown["approvals"]] == ["stage 2 of 2 (b) approved by alice"]
    kinds = [e["kind"] for e in queries.strategy_events(store, sid)]
    assert kinds.count("stage-approved") == 1
    assert check(store, sid).ok


def test_an_abort_ends_a_strategy_waiting_for_approval(store: Store) -> None:
    sid = _created(store, stage_approval=True)

    def abort() -> None:
        assert admin.request_abort(store, sid) is None

    assert on_virtual_time(_meanwhile(store, sid, (60, abort))) == "aborted"
    assert queries.step_counts(store, sid) == {"complete": 2, "aborted": 2}


def test_approve_refuses_a_strategy_not_waiting_and_pause_says_what_to_do(
    store: Store,
) -> None:
    sid = _created(store, stage_approval=True)
    with pytest.raises(Conflict, match="is applying, not waiting for approval"):
        admin.approve_strategy(store, sid, "bob")
    with store.write() as conn:  # as a conductor leaves it after stage a
        conn.exec_driver_sql("UPDATE strategies SET state = 'waiting-approval'")
    for change in (admin.pause_strategy, admin.resume_strategy):
        with pytest.raises(Conflict, match="'fleetwave strategy approve ID' lets the next"):
            change(store, sid)


def test_a_wait_or_an_approval_needs_two_stages(store: Store) -> None:
    fleet(store, {None: 2})
    for opts in (StrategyOptions(stage_wait_s=60), StrategyOptions(stage_approval=True)):
        with pytest.raises(InputError, match="the strategy has one stage"):
            admin.create_strategy(store, PATCH, opts, all_targets=True, spec=RolloutSpec())


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("10m", 600), ("1h30m", 5400), ("45s", 45), ("2d", 172800), ("600", 600), ("1.5s", 1.5)],
)
def test_durations(text: str, seconds: float) -> None:
    assert parse_duration(text, "--stage-wait") == seconds


@pytest.mark.parametrize(
    ("text", "said"),
    [
        ("0", "--stage-wait: must be more than 0, got 0"),
        ("ten", "--stage-wait: expected a duration (10m, 1h30m, 45s), got 'ten'"),
        ("31d", "--stage-wait: at most 30 days, got 31d"),
        ("", "--stage-wait: expected a duration"),
    ],
)
def test_bad_durations(text: str, said: str) -> None:
    with pytest.raises(InputError) as exc:
        parse_duration(text, "--stage-wait")
    assert str(exc.value).startswith(said)


def test_approve_on_the_command_line(cli: Cli, db_path: Path) -> None:
    for g in ("a", "b"):
        assert cli("group", "add", g).code == 0
        assert cli("target", "add", f"{g}1", "--group", g).code == 0
    res = cli(
        "strategy", "create", "--workflow", "patch", "--all", "--stage", "a", "--stage", "b",
        "--stage-approval", "--stage-wait", "5m", "--dry-run",
    )  # fmt: skip
    assert res.code == 0
    assert "after each stage: wait 300s, then wait for 'fleetwave strategy approve'" in res.out
    res = cli("strategy", "create", "--workflow", "patch", "--all", "--stage-approval")
    assert res.code == 2 and res.err.startswith("error: --stage-approval: the strategy has one")
    res = cli(
        "strategy", "create", "--workflow", "patch", "--all", "--stage", "a", "--stage", "b",
        "--stage-approval",
    )  # fmt: skip
    assert res.code == 0
    res = cli("strategy", "approve", "1")
    assert res.code == 2
    assert res.err.strip() == (
        "error: strategy 1: is initial, not waiting for approval; nothing to approve"
    )
    store = open_store(str(db_path))
    try:
        with store.write() as conn:  # as a conductor leaves it after stage a
            conn.exec_driver_sql("UPDATE steps SET state = 'complete' WHERE stage = 1")
            conn.exec_driver_sql("UPDATE strategies SET state = 'waiting-approval'")
    finally:
        store.dispose()
    res = cli("strategy", "approve", "1", "--by", "carol", "--format", "json")
    assert res.code == 0, res.text
    assert res.json() == {
        "id": 1,
        "stage": 2,
        "approved_by": "carol",
        "details": "stage 2 of 2 (b) approved by carol",
    }
    assert cli("strategy", "show", "1", "--format", "json").json()["state"] == "applying"
