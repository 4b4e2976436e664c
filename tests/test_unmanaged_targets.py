"""A target unmanaged during a rollout: its step fails when its turn comes, counts against
stop on failure and the failure threshold, and a step already started goes on."""

from __future__ import annotations

import asyncio
import sqlite3
from typing import Any

import pytest

from cli_harness import PATCH_STATES
from conftest import add_sim_targets, applied, rollout
from fleetwave.engine.conductor import Conductor
from fleetwave.engine.config import EngineConfig
from fleetwave.store import admin, queries
from fleetwave.store import runtime as rt
from fleetwave.store.db import Store
from fleetwave.testing.invariants import check
from test_engine_edges import _recorded_run


def test_unmanaged_target_crossing_the_threshold_starts_nothing_more(store: Store) -> None:
    names = add_sim_targets(store, 10)
    admin.set_managed(store, names[0], False)
    sid, final, _ = rollout(store, max_parallel=10, stop_on_failure=True)
    assert final == "failed"
    steps = {s["target"]: (s["state"], s["details"]) for s in queries.list_steps(store, sid)}
    assert steps[names[0]][0] == "failed"
    # Admitted in the same round, after the unmanaged one: none of them may start.
    assert all(state == "aborted" for n, (state, _) in steps.items() if n != names[0])
    assert check(store, sid).ok


def test_target_unmanaged_after_its_step_was_loaded_fails_when_its_turn_comes(
    store: Store,
) -> None:
    """Found by an acceptance run: the managed flag was read when the page of waiting
    steps was loaded, so a target unmanaged during the rollout was still operated on."""
    names = add_sim_targets(store, 3, settings={"latency_ms": 20})
    sid = applied(store, "patch", max_parallel=1)

    def unmanage(c: Conductor) -> None:
        assert sum(len(run.inflight) + run.pending_count() for run in c.runs.values()) == 3
        admin.set_managed(store, names[2], False)  # as `fleetwave target unmanage` does

    final, driver = _recorded_run(store, sid, unmanage)
    assert final == "failed"
    steps = {s["target"]: (s["state"], s["details"]) for s in queries.list_steps(store, sid)}
    assert steps[names[2]] == ("failed", f"Target {names[2]} is unmanaged.")
    assert steps[names[0]][0] == steps[names[1]][0] == "complete"
    assert not [p for p in driver.performed if p[0] == names[2]]  # never touched
    moves = [(h["from"], h["to"]) for h in queries.history(store, sid, target=names[2])]
    assert moves == [("initial", "failed")]
    assert check(store, sid).ok


def test_unmanaged_entry_and_a_refused_move_in_one_batch(store: Store) -> None:
    """The row-by-row commit (taken when a compare-and-set refuses a row) also fails an
    entry whose target is unmanaged, and reports it."""
    names = add_sim_targets(store, 2)
    sid = applied(store, "patch")
    ids = {s["target"]: s["step"] for s in queries.list_steps(store, sid)}
    admin.set_managed(store, names[1], False)
    writer = rt.TransitionWriter(store, "c1")
    entry = rt.Transition(ids[names[1]], sid, "initial", 0, "pre-check", 1, "", 0)
    stale = rt.Transition(ids[names[0]], sid, "pre-check", 7, "updating-patches", 7, "", 1)
    batch = [stale, entry]
    result = writer.commit(batch, [], 1.0)
    assert result.rejected == [stale]
    assert [(t.step_id, t.to_state) for t in result.replaced] == [(ids[names[1]], "failed")]
    assert batch == [stale, entry]  # the caller's batch is left alone
    steps = {s["target"]: (s["state"], s["details"]) for s in queries.list_steps(store, sid)}
    assert steps[names[1]] == ("failed", f"Target {names[1]} is unmanaged.")
    assert steps[names[0]][0] == "initial"
    writer.close()


def _unmanage_right_after_loading(store: Store, monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    """The operator unmanages ``name`` just after the conductor loaded its step."""
    real_load = rt.load_waiting_steps

    def load_then_unmanage(*a: Any, **kw: Any) -> list[rt.StepRecord]:
        recs = real_load(*a, **kw)
        admin.set_managed(store, name, False)
        return recs

    monkeypatch.setattr(rt, "load_waiting_steps", load_then_unmanage)


def test_transient_error_after_failing_an_unmanaged_entry_strands_nothing(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found in review: the writer replaced the entry in the conductor's own batch, so
    the commit retried after a transient error found nothing to fail, and the step was
    written failed but kept its slot forever (the strategy never ended)."""
    names = add_sim_targets(store, 2)
    _unmanage_right_after_loading(store, monkeypatch, names[1])
    real_fail = rt.TransitionWriter._end_unmanaged
    calls = {"n": 0}

    def fail_then_disk_error(self: rt.TransitionWriter, *a: Any, **kw: Any) -> Any:
        out = real_fail(self, *a, **kw)
        calls["n"] += 1
        if out and calls["n"] == 1:
            raise sqlite3.OperationalError("disk I/O error (injected)")
        return out

    monkeypatch.setattr(rt.TransitionWriter, "_end_unmanaged", fail_then_disk_error)
    sid = applied(store, "patch", max_parallel=2)
    c = Conductor(store, config=EngineConfig(store_retries_max=3))

    async def go() -> dict[int, str]:
        return await asyncio.wait_for(c.run(strategy_ids=[sid]), 10)

    assert asyncio.run(go())[sid] == "failed"
    assert c.stats.store_retries >= 1
    steps = {s["target"]: s["state"] for s in queries.list_steps(store, sid)}
    assert steps == {names[0]: "complete", names[1]: "failed"}
    assert check(store, sid).ok


def test_stop_on_failure_by_an_unmanaged_target_found_in_the_commit_starts_nothing_more(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found in review: the steps admitted beside the unmanaged one entered their first
    state in the same commit and then ran, though the strategy stops on failure."""
    names = add_sim_targets(store, 10)
    _unmanage_right_after_loading(store, monkeypatch, names[0])
    sid = applied(store, "patch", max_parallel=10, stop_on_failure=True)
    final, driver = _recorded_run(store, sid)
    assert final == "failed"
    assert driver.performed == []  # no target was touched
    steps = {s["target"]: (s["state"], s["details"]) for s in queries.list_steps(store, sid)}
    assert steps[names[0]] == ("failed", f"Target {names[0]} is unmanaged.")
    # Admitted beside it, after it: none entered a state (as when the flag is known at
    # admission: test_unmanaged_target_crossing_the_threshold_starts_nothing_more).
    for n in names[1:]:
        assert [h["to"] for h in queries.history(store, sid, target=n)] == ["aborted"]
        assert steps[n][1] == f"not started: stopped after {names[0]} failed (stop on failure)"
    assert check(store, sid).ok


def test_threshold_crossed_by_unmanaged_targets_found_in_the_commit(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two failures tolerated: the first three unmanaged targets fail (the third one
    exceeds the threshold), and no step after the third starts."""
    names = add_sim_targets(store, 8)
    real_load = rt.load_waiting_steps

    def load_then_unmanage(*a: Any, **kw: Any) -> list[rt.StepRecord]:
        recs = real_load(*a, **kw)
        for n in (names[1], names[3], names[4], names[6]):
            admin.set_managed(store, n, False)
        return recs

    monkeypatch.setattr(rt, "load_waiting_steps", load_then_unmanage)
    sid = applied(store, "patch", max_parallel=8, max_failures=2)
    assert asyncio.run(Conductor(store).run(strategy_ids=[sid]))[sid] == "failed"
    steps = {s["target"]: s for s in queries.list_steps(store, sid)}
    moves = {n: [h["to"] for h in queries.history(store, sid, target=n)] for n in names}
    assert [moves[n] for n in names] == [
        ["pre-check", "aborted"],  # started before the failures: ends its state, stops
        ["failed"],
        ["pre-check", "aborted"],
        ["failed"],
        ["failed"],  # the third failure: past the threshold of 2
        ["aborted"],
        ["aborted"],  # unmanaged too, but never reached: stopped first
        ["aborted"],
    ]
    assert steps[names[5]]["details"] == (
        "not started: stopped: 3 failed steps exceed the failure threshold of 2 "
        f"(the last: {names[4]})"
    )
    assert check(store, sid).ok


def test_a_step_started_before_a_clean_stop_goes_on_although_unmanaged_meanwhile(
    store: Store,
) -> None:
    """A clean stop leaves a step that ran its first state entered in its next one, not
    started; its target is unmanaged before the next conductor takes over. It failed
    there ("Target ... is unmanaged."; a bug hunt: with stop on failure, the whole
    rollout stopped, other targets half-patched), where a step already started is not
    interrupted (README), and was not after a kill -9. It goes on to its end."""
    add_sim_targets(store, 2, settings={"latency_ms": 200})
    sid = applied(store, "patch", max_parallel=1, stop_on_failure=True)
    stop = asyncio.Event()
    first = Conductor(store)

    async def until_stopped() -> None:
        task = asyncio.create_task(first.run(strategy_ids=[sid], stop=stop))
        while not any(run.inflight for run in first.runs.values()):
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)
        stop.set()  # the first step finishes its state; its next state is entered, unstarted
        await task

    asyncio.run(until_stopped())
    entered = [s for s in queries.list_steps(store, sid) if s["state"] not in ("initial",)]
    assert entered, "the stop should leave a step in flight"
    assert entered[0]["state"] == "updating-patches", entered
    target = entered[0]["target"]
    admin.set_managed(store, target, False)
    final, driver = _recorded_run(store, sid)
    assert final == "complete"
    assert [p[1] for p in driver.performed if p[0] == target] == PATCH_STATES[1:]
    assert check(store, sid).ok


def test_takeover_does_not_start_a_step_whose_target_was_unmanaged_meanwhile(
    store: Store,
) -> None:
    """A step entered in its first state but never started there (as a commit writes
    it while its conductor's lease lapses), its target unmanaged before the next
    conductor takes over: it must not start then either (as at an admission)."""
    names = add_sim_targets(store, 2, settings={"latency_ms": 20})
    sid = applied(store, "patch", max_parallel=2)
    _entered_unstarted_by_a_lost_conductor(store, sid)
    (step, _) = queries.list_steps(store, sid)
    admin.set_managed(store, step["target"], False)
    final, driver = _recorded_run(store, sid)
    assert final == "failed"
    assert not [p for p in driver.performed if p[0] == step["target"]]
    steps = {s["target"]: (s["state"], s["details"]) for s in queries.list_steps(store, sid)}
    assert steps[step["target"]] == ("failed", f"Target {step['target']} is unmanaged.")
    assert steps[names[1]][0] == "complete"
    assert check(store, sid).ok


def _entered_unstarted_by_a_lost_conductor(store: Store, sid: int) -> None:
    """Every step of ``sid`` entered in its first state and not started, as a commit
    writes them while its conductor's lease lapses; that conductor gone."""
    with store.write() as conn:
        for step in queries.list_steps(store, sid):
            conn.exec_driver_sql(
                "UPDATE steps SET state = 'pre-check', fence = 1, attempt = 1, "
                f"not_started = 1, owner = 'c-gone' WHERE id = {step['step']}"
            )
            conn.exec_driver_sql(
                "INSERT INTO journal (strategy_id, step_id, at, conductor, from_state, "
                f"to_state, fence, details) VALUES ({sid}, {step['step']}, 0, 'c-gone', "
                "'initial', 'pre-check', 1, '')"
            )


def test_takeover_starts_no_unstarted_step_once_an_unmanaged_one_stops_the_strategy(
    store: Store,
) -> None:
    """Two steps entered in their first state but not started; the second one's target
    is then unmanaged. The next conductor (stop on failure) walks the taken-over steps
    in order: the first is put in flight, the second fails (unmanaged) and stops the
    strategy; the first was started anyway, although the code ends unstarted steps of a
    stopping strategy without starting them."""
    names = add_sim_targets(store, 2, settings={"latency_ms": 200})
    sid = applied(store, "patch", max_parallel=2, stop_on_failure=True)
    _entered_unstarted_by_a_lost_conductor(store, sid)
    admin.set_managed(store, names[1], False)
    final, driver = _recorded_run(store, sid)
    assert final == "failed"
    steps = {s["target"]: (s["state"], s["details"]) for s in queries.list_steps(store, sid)}
    assert steps[names[1]] == ("failed", f"Target {names[1]} is unmanaged.")
    assert steps[names[0]][0] == "aborted", steps
    assert driver.performed == [], f"started after the strategy stopped: {driver.performed}"


def test_target_managed_again_before_its_turn_is_not_failed_as_unmanaged(store: Store) -> None:
    """Found by a bug hunt; the mirror of the unmanaged-after-loading test: the managed
    flag read when the page was loaded was trusted at admission. A target that
    was unmanaged at load time but managed again long before its turn is failed as
    'unmanaged' (and, under stop on failure, stops the whole strategy)."""
    names = add_sim_targets(store, 3, settings={"latency_ms": 20})
    admin.set_managed(store, names[2], False)
    sid = applied(store, "patch", max_parallel=1, stop_on_failure=True)

    def manage(_c: Conductor) -> None:
        admin.set_managed(store, names[2], True)  # `fleetwave target manage`, before its turn

    final, _driver = _recorded_run(store, sid, manage)
    steps = {s["target"]: (s["state"], s["details"]) for s in queries.list_steps(store, sid)}
    assert steps[names[2]][0] == "complete", steps
    assert final == "complete"
