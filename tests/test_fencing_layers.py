"""Each layer of fencing, alone: every test here fails when its layer is taken out
while the others stay (the mutation check in scripts/mutation_check.py does that).

A transition is written only if (1) the step is still at the state and fence the
conductor started from and owned by it (the step's compare-and-set), (2) the conductor
still holds the strategy at the fence it claimed it with (the strategy fence), and
(3) the step never entered that state before (the journal's unique key, G1)."""

from __future__ import annotations

from pathlib import Path

import pytest

from fleetwave.domain.models import StrategyOptions, Target
from fleetwave.domain.registry import get_workflow
from fleetwave.store import admin, queries
from fleetwave.store import runtime as rt
from fleetwave.store.db import Store, open_store


def _claimed(tmp_path: Path) -> tuple[Store, int, int]:
    """One step of a claimed strategy, at pre-check -> updating-patches (fence 1)."""
    store = open_store(str(tmp_path / "fence.db"))
    admin.add_targets(store, [Target(name="t0")])
    wf = get_workflow("patch")
    assert wf is not None
    sid = admin.create_strategy(store, wf, StrategyOptions(), all_targets=True)
    admin.apply_strategy(store, sid)
    (rec,) = rt.claim_strategies(store, "c1", 1.0, 100.0, register=True)
    (waiting,) = rt.load_waiting_steps(store, sid, -1, 10)
    writer = rt.TransitionWriter(store, "c1")
    step = waiting.step_id
    for t in (
        rt.Transition(step, sid, "initial", 0, "pre-check", 1, "", 1),
        rt.Transition(step, sid, "pre-check", 1, "updating-patches", 1, "", 1),
    ):
        res = writer.commit([t], [], 2.0, fences={sid: rec.fence})
        assert res.rejected == [] and res.lost == set()
    writer.close()
    return store, sid, step


def _commit(store: Store, t: rt.Transition, fence: int = 1, cid: str = "c1") -> rt.CommitResult:
    writer = rt.TransitionWriter(store, cid)
    try:
        return writer.commit([t], [], 3.0, fences={t.strategy_id: fence})
    finally:
        writer.close()


def _row(store: Store, step: int) -> tuple[str, int, str | None]:
    with store.read() as conn:
        r = conn.exec_driver_sql("SELECT state, fence, owner FROM steps WHERE id = ?", (step,))
        state, fence, owner = r.one()
    return str(state), int(fence), owner


def test_the_step_compare_and_set_refuses_a_stale_state(tmp_path: Path) -> None:
    """A move decided from a stale read (the step left pre-check since) into a state
    it never entered: only the step's compare-and-set on its state refuses it (the
    strategy is held, and the journal has no such state yet)."""
    store, sid, step = _claimed(tmp_path)
    stale = rt.Transition(step, sid, "pre-check", 1, "finishing", 1, "", 1)
    result = _commit(store, stale)
    assert result.rejected == [stale]
    assert _row(store, step) == ("updating-patches", 1, "c1")
    store.dispose()


def test_the_step_compare_and_set_refuses_a_stale_fence(tmp_path: Path) -> None:
    """A worker of a fenced-off attempt (the step was taken over at fence 2 by this same
    conductor): its report at fence 1 is refused, though state and owner match."""
    store, sid, step = _claimed(tmp_path)
    with store.write() as conn:
        conn.exec_driver_sql("UPDATE steps SET fence = 2 WHERE id = ?", (step,))
    stale = rt.Transition(step, sid, "updating-patches", 1, "finishing", 1, "", 1)
    assert _commit(store, stale).rejected == [stale]
    assert _row(store, step) == ("updating-patches", 2, "c1")
    store.dispose()


@pytest.mark.parametrize("owner", [None, "c2"])
def test_a_step_is_written_only_by_its_owner(tmp_path: Path, owner: str | None) -> None:
    """A step in a workflow state whose owner was cleared (or changed) by anyone (an
    action, a hand edit) is not written by the conductor that believed it owned it:
    the owner column is checked with the state and fence."""
    store, sid, step = _claimed(tmp_path)
    with store.write() as conn:
        conn.exec_driver_sql("UPDATE steps SET owner = ? WHERE id = ?", (owner, step))
    move = rt.Transition(step, sid, "updating-patches", 1, "finishing", 1, "", 1)
    assert _commit(store, move).rejected == [move]
    assert _row(store, step) == ("updating-patches", 1, owner)
    store.dispose()


def test_the_strategy_fence_refuses_a_conductor_claimed_over(tmp_path: Path) -> None:
    """Another conductor claimed the strategy (fence 2): a commit at fence 1 writes
    nothing, though the step's state, fence and owner still match."""
    store, sid, step = _claimed(tmp_path)
    with store.write() as conn:
        conn.exec_driver_sql("UPDATE strategies SET owner = 'c2', fence = fence + 1")
    move = rt.Transition(step, sid, "updating-patches", 1, "finishing", 1, "", 1)
    result = _commit(store, move)
    assert result.lost == {sid}
    assert _row(store, step) == ("updating-patches", 1, "c1")
    store.dispose()


def test_the_journals_unique_key_refuses_a_state_entered_before(tmp_path: Path) -> None:
    """A move back into pre-check, from where the step is, at its fence, by its owner,
    in a strategy still held: only the unique key on (step, state) refuses it (G1).
    (Entered as not started, as by a conductor that is stopping.)"""
    store, sid, step = _claimed(tmp_path)
    again = rt.Transition(step, sid, "updating-patches", 1, "pre-check", 1, "", 1, True)
    assert _commit(store, again).rejected == [again]
    assert _row(store, step) == ("updating-patches", 1, "c1")
    with store.read() as conn:
        n = conn.exec_driver_sql(
            "SELECT count(*) FROM journal WHERE step_id = ? AND to_state = 'pre-check'", (step,)
        ).scalar_one()
    assert n == 1
    store.dispose()


def test_an_attempt_is_recorded_once(tmp_path: Path) -> None:
    """Each attempt after a state's first (its journal entry) is a row unique on (step,
    state, attempt), committed before it is sent: recording attempt 2 of a state twice
    is refused the second time."""
    store, sid, step = _claimed(tmp_path)
    start = rt.AttemptDeadline(step, sid, "updating-patches", 1, 500.0, 2, "attempt 2", 0)
    writer = rt.TransitionWriter(store, "c1")
    first = writer.commit([], [], 4.0, fences={sid: 1}, deadlines=[start])
    second = writer.commit([], [], 5.0, fences={sid: 1}, deadlines=[start])
    writer.close()
    assert first.retries_refused == set()
    assert second.retries_refused == {step}
    with store.read() as conn:
        rows = conn.exec_driver_sql(
            "SELECT state, attempt, how FROM attempts WHERE step_id = ? ORDER BY id", (step,)
        ).all()
    assert [tuple(r) for r in rows] == [("updating-patches", 2, "retry")]
    # a state's first attempt is its journal entry: step show lists both
    shown = [(a["state"], a["attempt"], a["how"]) for a in queries.step_attempts(store, step)]
    assert shown == [
        ("pre-check", 1, "entry"),
        ("updating-patches", 1, "entry"),
        ("updating-patches", 2, "retry"),
    ]
    store.dispose()


def test_check_finds_an_attempt_sent_on_no_record(tmp_path: Path) -> None:
    """`fleetwave check` reads the attempts: a retry recorded with no attempt before it,
    or an attempt of a state the step never entered, is a violation."""
    from fleetwave.testing.invariants import check

    store, sid, step = _claimed(tmp_path)
    assert check(store, sid).ok
    with store.write() as conn:
        for state, attempt in (("updating-patches", 3), ("finishing", 1)):
            conn.exec_driver_sql(
                "INSERT INTO attempts (strategy_id, step_id, state, attempt, at, conductor, "
                "fence, how) VALUES (?, ?, ?, ?, 5.0, 'c1', 1, 'retry')",
                (sid, step, state, attempt),
            )
    found = check(store, sid).violations
    assert any(
        "recorded attempt 3 of 'updating-patches' where attempt 2 was due" in v for v in found
    )
    assert any("attempt 1 of 'finishing', never entered" in v for v in found)
    store.dispose()


def test_a_step_whose_first_attempt_was_released_is_not_started_afresh(tmp_path: Path) -> None:
    """A step marked entered-but-not-started whose first attempt is on record all the
    same (a hand edit, a bug): the takeover does not start it afresh (the attempt may
    have been sent), its recover hook looks instead."""
    store, sid, step = _claimed(tmp_path)
    with store.write() as conn:
        conn.exec_driver_sql("UPDATE steps SET not_started = 1 WHERE id = ?", (step,))
        conn.exec_driver_sql(
            "INSERT INTO attempts (strategy_id, step_id, state, attempt, at, conductor, "
            "fence, how) VALUES (?, ?, 'updating-patches', 1, 1.0, 'c0', 1, 'afresh')",
            (sid, step),
        )
    (rec,), _failed = rt.load_open_steps(store, sid)
    assert rec.not_started
    taken = rt.take_over_steps(store, [rec], "c1", 5.0, held=(sid, 1), afresh={step})
    assert taken is not None and [t.step_id for t in taken] == [step]
    assert not taken[0].not_started  # taken over as possibly started
    store.dispose()
