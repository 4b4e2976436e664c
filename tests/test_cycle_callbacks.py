"""A state that waits for a callback on a bounded cycle (``max_visits``): a callback
reports on one visit of its state (its agent token's visit, or the one its sender
named), and applies to that visit only. A late callback of visit 1 that arrives while
the step is in (or on its way back to) visit 2 is recorded and ignored with its
reason, never applied to visit 2; an agent token issued for visit 1 reports on visit 1,
whatever the step is doing when it is used."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select

from cli_harness import Cli
from conftest import on_virtual_time
from fleetwave.api.intake import Arrival, store_arrivals
from fleetwave.domain.models import StrategyOptions, Target
from fleetwave.domain.yaml_workflow import parse_workflow_yaml
from fleetwave.drivers.sim import SimDriver
from fleetwave.engine.clock import LoopClock
from fleetwave.engine.conductor import Conductor
from fleetwave.engine.config import EngineConfig
from fleetwave.store import admin, queries, tokens
from fleetwave.store import callbacks as cbs
from fleetwave.store.db import Store
from fleetwave.store.schema import steps, targets
from fleetwave.testing.invariants import check
from test_cli_strategy import add, apply_wait

#: verify waits for the target's agent; a failed report goes round the loop again
FLASH_AND_WAIT = """\
name: flash-and-wait
states:
  - name: pre-check
  - name: retry-flash
    max_visits: 3
  - name: verify
    max_visits: 3
    mode: wait-for-callback
    timeout_s: 3600
    on: {failed: retry-flash}
  - name: finish
"""


def _strategy(store: Store, *fleet: Target) -> int:
    wf = parse_workflow_yaml(FLASH_AND_WAIT, strict=True)
    admin.add_targets(store, list(fleet))
    sid = admin.create_strategy(store, wf, StrategyOptions(), all_targets=True)
    admin.apply_strategy(store, sid)
    return sid


def _moves(store: Store, sid: int, target: str) -> list[tuple[str, str, int]]:
    return [
        (r["from"], r["to"], r["visit"])
        for r in queries.history(store, sid)
        if r["target"] == target and "attempt" not in r
    ]


LOOPED = [
    ("initial", "pre-check", 1),
    ("pre-check", "retry-flash", 1),
    ("retry-flash", "verify", 1),
    ("verify", "retry-flash", 2),
    ("retry-flash", "verify", 2),
    ("verify", "finish", 1),
    ("finish", "complete", 1),
]


LATE_OF_VISIT_1 = "late: for visit 1 of verify; the step is in visit 2 of it"


@pytest.mark.both_dialects
def test_a_late_callback_of_visit_1_is_ignored_during_visit_2(store: Store) -> None:
    """The test is the target's agent (the sim's never calls back): visit 1 of verify
    reports failure (round the loop), then, while visit 2 waits, a late "done" of visit 1
    comes twice: named by its visit, and with the agent token issued for visit 1. Both
    are recorded and ignored as late; visit 2's own report moves the step on."""
    sid = _strategy(store, Target("t1", settings={"callback_lost_rate": 1.0}))
    with store.read() as conn:
        step_id = int(
            conn.execute(select(steps.c.id).where(steps.c.strategy_id == sid)).scalar_one()
        )
    late_token = tokens.new_secret(tokens.AGENT_PREFIX)

    def at() -> tuple[str, int]:
        with store.read() as conn:
            row = conn.execute(
                select(steps.c.state, steps.c.visit).where(steps.c.id == step_id)
            ).one()
        return str(row.state), int(row.visit)

    async def until(where: tuple[str, int]) -> None:
        for _ in range(10_000):
            if at() == where:
                return
            await asyncio.sleep(0.5)
        raise AssertionError(f"step never reached {where}: at {at()}")

    async def go() -> dict[int, str]:
        conductor = Conductor(
            store, drivers={"sim": SimDriver()}, clock=LoopClock(), config=EngineConfig(tick_s=1)
        )
        run = asyncio.create_task(conductor.run(strategy_ids=[sid]))
        await until(("verify", 1))
        await asyncio.sleep(5)  # (its wait has begun)
        conductor.receive_callback(step_id, "verify", "failed", "flash did not take", visit=1)
        await until(("verify", 2))
        await asyncio.sleep(5)
        # the agent of visit 1, late: once naming its visit, once with its visit's token
        # (issued here as the engine issued it then: for verify, visit 1)
        conductor.receive_callback(step_id, "verify", "done", "visit 1 done, late", visit=1)
        now = conductor.clock.now()
        tokens.issue_agent_tokens(
            store,
            [(sid, step_id, "verify", tokens.token_hash(late_token), now, now + 3600, 1)],
        )
        report = cbs.report(step_id, "verify", "done", "visit 1 done, late (token)", now, "k1")
        (stored,) = store_arrivals(store, [Arrival(report, late_token, "127.0.0.1")])
        assert isinstance(stored, cbs.CallbackRecord) and stored.visit == 1
        conductor.callback_stored(stored)
        await asyncio.sleep(10)
        assert at() == ("verify", 2)  # still waiting: neither moved it
        conductor.receive_callback(step_id, "verify", "done", "visit 2 done")
        return await asyncio.wait_for(run, 100_000)

    assert on_virtual_time(go()) == {sid: "complete"}
    assert _moves(store, sid, "t1") == LOOPED
    said = [
        (c["state"], c["visit"], c["kind"], c["outcome"], c["reason"])
        for c in cbs.callback_outcomes(store, sid)
    ]
    moved, late = "moved the step on from verify", LATE_OF_VISIT_1
    assert said == [
        ("verify", 1, "failed", "applied", moved),
        ("verify", 1, "done", "ignored", late),
        ("verify", 1, "done", "ignored", late),
        ("verify", 2, "done", "applied", moved),
    ]
    result = check(store, sid)
    assert result.ok, result.violations


@pytest.mark.both_dialects
def test_the_sims_agents_go_round_the_loop_and_their_late_reports_are_ignored(
    store: Store,
) -> None:
    """The sim's agents report on the visit they were started for: `flaky` fails its
    first verify on the target (its agent still reports "done" afterwards, late: visit 1
    is over by then), and passes the second; `good` passes the first."""
    sid = _strategy(
        store,
        Target("good", settings={"latency_ms": 1000}),
        Target("flaky", settings={"latency_ms": 1000, "fail_at": "verify", "fail_visits": 1}),
    )
    sim = SimDriver()

    async def go() -> dict[int, str]:
        conductor = Conductor(
            store, drivers={"sim": sim}, clock=LoopClock(), config=EngineConfig(tick_s=1)
        )
        ended = await asyncio.wait_for(conductor.run(strategy_ids=[sid]), 100_000)
        await sim.wait_agents()
        return ended

    assert on_virtual_time(go()) == {sid: "complete"}
    assert _moves(store, sid, "flaky") == LOOPED
    assert [to for _, to, _ in _moves(store, sid, "good")] == [
        "pre-check", "retry-flash", "verify", "finish", "complete",
    ]  # fmt: skip
    with store.read() as conn:
        by_step = dict(
            conn.execute(
                select(steps.c.id, targets.c.name)
                .join(targets, targets.c.id == steps.c.target_id)
                .where(steps.c.strategy_id == sid)
            ).all()
        )
    flaky: list[Any] = [
        (c["visit"], c["kind"], c["outcome"], c["reason"])
        for c in cbs.callback_outcomes(store, sid)
        if by_step[c["step"]] == "flaky"
    ]
    assert [c[:3] for c in flaky] == [(1, "done", "ignored"), (2, "done", "applied")]
    assert flaky[0][3].startswith("late: ") and "visit 1 of verify" in flaky[0][3]
    result = check(store, sid)
    assert result.ok, result.violations


def test_the_cli_runs_a_callback_state_on_a_cycle_and_check_passes(
    cli: Cli, tmp_path: Path
) -> None:
    """`workflow validate` and `add` take it (refused before); `apply --wait` goes round
    the loop on the sim's agents; `step show` gives each callback's visit (the late one
    of visit 1 ignored); `fleetwave check` passes; `step callback --visit` names one."""
    f = tmp_path / "wf.yaml"
    f.write_text(FLASH_AND_WAIT)
    assert cli("workflow", "validate", str(f)).code == 0
    assert cli("workflow", "add", str(f)).code == 0
    add(cli, "flaky", latency_ms="200", fail_at="verify", fail_visits="1")
    made = cli("strategy", "create", "--workflow", "flash-and-wait", "--all", "--format", "json")
    sid = int(made.json()["id"])
    done = apply_wait(cli, sid)
    assert done.code == 0, done.text
    shown = cli("step", "show", "1", "--format", "json").json()
    assert shown["state"] == "complete"
    # (the agent of visit 1 may still be on its way when the step ends: then its report
    # comes after, and is answered late at once)
    said = [(c["visit"], c["outcome"]) for c in shown["callbacks"]]
    assert (2, "applied") in said and all(v == 1 for v, o in said if o == "ignored")
    assert cli("check").code == 0
    late = cli("step", "callback", "1", "verify", "--visit", "1", "--format", "json")
    assert late.code == 0, late.text
    assert late.json()["visit"] == 1 and late.json()["outcome"] == "ignored"
    bad = cli("step", "callback", "1", "verify", "--visit", "0")
    assert bad.code == 2 and "--visit" in bad.err, bad.text
