"""Failure thresholds in percent (``--max-failures 5%``: of the strategy's steps, stops
once exceeded, not equalled) and per stage (``--stage-max-failures N|P%``)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from sqlalchemy import select

from cli_harness import Cli
from conftest import on_virtual_time
from fleetwave.domain.models import StrategyOptions
from fleetwave.domain.rollout import RolloutSpec, parse_amount, parse_stages
from fleetwave.engine.clock import LoopClock
from fleetwave.engine.conductor import Conductor
from fleetwave.engine.config import EngineConfig
from fleetwave.store import admin, queries
from fleetwave.store.db import Store, open_store
from fleetwave.store.schema import strategies
from fleetwave.testing.invariants import check
from rollout_world import PATCH, drive, entries, fleet, phases_in_order, started

FAIL = {"fail_at": "updating-patches"}


def _failing(*names: str) -> dict[str, dict[str, str]]:
    return {name: FAIL for name in names}


@pytest.mark.parametrize(
    ("failing", "final", "counts"),
    [
        # 20% of 10 tolerates 2: two failures equal it, the rollout goes on to the end
        (("loose-2", "loose-5"), "failed", {"complete": 8, "failed": 2}),
        # the third exceeds it: nothing starts after it (by name: loose-1, loose-10,
        # loose-2, ... loose-6 ran; 7, 8 and 9 did not)
        (("loose-2", "loose-5", "loose-6"), "failed", {"complete": 4, "failed": 3, "aborted": 3}),
        ((), "complete", {"complete": 10}),
    ],
)
def test_a_percent_threshold_stops_when_exceeded_not_equalled(
    store: Store, failing: tuple[str, ...], final: str, counts: dict[str, int]
) -> None:
    fleet(store, {None: 10}, settings=_failing(*failing))
    # one at a time: the order the failures come in is the targets' order
    sid, got = drive(store, max_parallel=1, max_failures_percent="20%")
    assert got == final
    assert queries.step_counts(store, sid) == counts
    shown = queries.get_strategy(store, sid)
    assert shown["max_failures"] == 2
    if len(failing) > 2:
        assert shown["details"] == (
            "stopped: 3 failed steps exceed the failure threshold of 2 (the last: loose-6)"
        )
    assert check(store, sid).ok


def test_a_stage_over_its_own_threshold_stops_the_strategy(store: Store) -> None:
    fleet(store, {"a": 3, "b": 2}, settings=_failing("a-1", "a-3"))
    spec = RolloutSpec(
        stages=parse_stages(["a", "b"]),
        stage_max_failures=parse_amount("50%", "--stage-max-failures"),  # of 3: 1
    )
    sid, final = drive(store, spec, max_parallel=1, max_failures=10)
    assert final == "failed"
    rows = entries(store, sid)
    phases_in_order(rows)
    assert not [e for e in rows if e.phase == 2 and e.to_state != "aborted"]  # b never ran
    why = "stopped: 2 failed steps exceed the failure threshold of stage a (1) (the last: a-3)"
    assert queries.get_strategy(store, sid)["details"] == why
    assert {e.details for e in rows if e.phase == 2} == {f"not started: {why}"}
    assert check(store, sid).ok


def test_a_stage_within_its_threshold_lets_the_next_stage_run(store: Store) -> None:
    fleet(store, {"a": 3, "b": 2}, settings=_failing("a-1"))
    spec = RolloutSpec(
        stages=parse_stages(["a", "b"]),
        stage_max_failures=parse_amount("1", "--stage-max-failures"),
    )
    sid, final = drive(store, spec, max_parallel=1)
    assert final == "failed"  # a step failed; nothing stopped
    assert queries.step_counts(store, sid) == {"complete": 4, "failed": 1}
    assert check(store, sid).ok


def test_percent_thresholds_on_the_command_line(cli: Cli, db_path: Path) -> None:
    for i in range(30):
        assert cli("target", "add", f"t{i:02d}").code == 0
    res = cli(
        "strategy", "create", "--workflow", "patch", "--all", "--max-failures", "5%",
        "--stage-max-failures", "10%", "--format", "json",
    )  # fmt: skip
    assert res.code == 0, res.text
    made = res.json()
    assert made["max_failures"] == 1  # 5% of 30 = 1.5: a second failure exceeds it
    store = open_store(str(db_path))
    try:
        with store.read() as conn:
            stored = json.loads(conn.execute(select(strategies.c.options)).scalar_one())
    finally:
        store.dispose()
    assert stored["max_failures_percent"] == "5%"
    assert stored["plan"][0]["max_failures"] == 3  # 10% of 30


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["--max-failures", "101%"], "--max-failures"),
        (["--max-failures", "5.5.5%"], "--max-failures"),
        (["--stage-max-failures", "200%"], "--stage-max-failures"),
        (["--max-failures", "-1%"], "--max-failures"),
    ],
)
def test_bad_thresholds_are_refused(cli: Cli, args: list[str], said: str) -> None:
    assert cli("target", "add", "t1").code == 0
    res = cli("strategy", "create", "--workflow", "patch", "--all", *args)
    assert res.code == 2
    lines = res.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and said in lines[0], lines
    assert cli("strategy", "list", "--format", "json").json() == []


def test_a_conductor_taking_over_counts_the_stages_failures_so_far(store: Store) -> None:
    fleet(store, {"a": 3, "b": 2}, settings=_failing("a-1", "a-3"))
    spec = RolloutSpec(
        stages=parse_stages(["a", "b"]),
        stage_max_failures=parse_amount("1", "--stage-max-failures"),
    )
    sid = admin.create_strategy(
        store, PATCH, StrategyOptions(max_parallel=1), all_targets=True, spec=spec
    )
    admin.apply_strategy(store, sid)

    def conductor() -> Conductor:
        return Conductor(store, clock=LoopClock(), config=EngineConfig(tick_s=1))

    async def go() -> str:
        stop = asyncio.Event()
        first = asyncio.create_task(conductor().run(strategy_ids=[sid], stop=stop))
        await asyncio.sleep(3)  # a-1 failed (at 2 s); a-2 runs
        stop.set()
        await first
        return (await conductor().run(strategy_ids=[sid]))[sid]

    assert on_virtual_time(go()) == "failed"
    why = "stopped: 2 failed steps exceed the failure threshold of stage a (1) (the last: a-3)"
    assert queries.get_strategy(store, sid)["details"] == why
    rows = entries(store, sid)
    assert {e.target for e in started(rows)} == {"a-1", "a-2", "a-3"}  # b never started
    assert check(store, sid).ok
