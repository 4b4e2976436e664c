"""The conductor's log of failed steps: a line each for the first, then sums every ten
seconds, and how the strategy ended."""

from __future__ import annotations

import asyncio
import logging

import pytest

from conftest import add_sim_targets, applied, on_virtual_time
from fleetwave.engine.clock import LoopClock
from fleetwave.engine.conductor import Conductor
from fleetwave.store import queries
from fleetwave.store.db import Store


def test_the_service_log_names_each_failed_step_and_how_the_strategy_ended(
    store: Store, caplog: pytest.LogCaptureFixture
) -> None:
    """At the default level a serve's log held nothing of a rollout's 18 failures, and
    its end read "strategy 1: failed 21 steps failed"."""
    add_sim_targets(store, 2)
    add_sim_targets(store, 1, settings={"fail_at": "finishing"}, prefix="bad")
    add_sim_targets(store, 1, prefix="off", managed=False)
    sid = applied(store)
    caplog.set_level(logging.WARNING, logger="fleetwave.engine")
    assert asyncio.run(asyncio.wait_for(Conductor(store).run(strategy_ids=[sid]), 30)) == {
        sid: "failed"
    }
    said = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    bad, off = (queries.list_steps(store, sid, state="failed")[i]["step"] for i in (0, 1))
    why = "finishing: failed on target (fail_at=finishing)"
    assert f"strategy {sid}: step {bad} (target bad00000) failed: {why}" in said
    assert (
        f"strategy {sid}: step {off} (target off00000) failed: Target off00000 is unmanaged."
        in said
    )
    assert said[-1] == f"strategy {sid}: ended failed: 2 steps failed", said


def test_a_fleet_wide_failure_is_logged_in_a_few_lines(
    store: Store, caplog: pytest.LogCaptureFixture
) -> None:
    """Found by a review: a warning per failed step, written on the dispatcher's loop,
    doubled the time of a rollout of 20,000 failing steps. A strategy's first 20 are
    logged one by one, the rest one line per batch with the count so far."""
    from fleetwave.engine.outcome_log import FAILURES_LOGGED_ALONE

    add_sim_targets(store, 300, settings={"fail_at": "pre-check"})
    sid = applied(store, max_parallel=100)
    caplog.set_level(logging.WARNING, logger="fleetwave.engine")
    assert asyncio.run(asyncio.wait_for(Conductor(store).run(strategy_ids=[sid]), 60)) == {
        sid: "failed"
    }
    said = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    alone = [line for line in said if " (target t" in line]
    assert len(alone) == FAILURES_LOGGED_ALONE == 20
    summaries = [line for line in said if " in all): 'fleetwave step list" in line]
    assert 1 <= len(summaries) <= 10, said
    assert summaries[-1].endswith(
        f"(300 in all): 'fleetwave step list --strategy {sid} --state failed' says why"
    ), summaries[-1]
    assert said[-1] == f"strategy {sid}: ended failed: 300 steps failed"


def test_failures_that_come_one_at_a_time_are_summed_every_ten_seconds(
    store: Store, caplog: pytest.LogCaptureFixture
) -> None:
    """Found by a scale pass: at one failure per commit, "one line per commit" was one
    line per failed step. Past the first 20, a line at most every 10 s, and one as the
    strategy ends, count every failure once."""

    add_sim_targets(store, 60, settings={"fail_at": "pre-check", "latency_ms": 1000})
    sid = applied(store, max_parallel=1)
    caplog.set_level(logging.WARNING, logger="fleetwave.engine")

    async def main() -> dict[int, str]:
        return await Conductor(store, clock=LoopClock()).run(strategy_ids=[sid])

    assert on_virtual_time(main()) == {sid: "failed"}
    said = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len([line for line in said if " (target t" in line]) == 20
    summaries = [line for line in said if " in all): " in line]
    assert 3 <= len(summaries) <= 6, summaries  # 40 failures over about 40 s
    counts = [int(line.split(": ", 1)[1].split(" more step")[0]) for line in summaries]
    assert sum(counts) == 40 and "(60 in all)" in summaries[-1], summaries
