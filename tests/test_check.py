"""``fleetwave check`` finds each kind of violation in a journal (forged here by hand, as a
broken engine, a bug elsewhere or a hand edit would leave it), and only those."""

from __future__ import annotations

from collections import namedtuple
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select, text

from cli_harness import Cli
from conftest import add_sim_targets
from fleetwave.domain.models import ApplyType, Group, StrategyOptions
from fleetwave.domain.registry import get_workflow
from fleetwave.store import admin, slots
from fleetwave.store.db import Store
from fleetwave.store.schema import steps, strategies, targets
from fleetwave.testing import invariants
from fleetwave.testing.invariants import check

FIRST, SECOND = "pre-check", "updating-patches"

#: every check that takes a store runs on SQLite and on PostgreSQL
pytestmark = pytest.mark.both_dialects


def _strategy(store: Store, n: int = 2, **options: Any) -> tuple[int, list[int]]:
    """A patch strategy over ``n`` targets (t00000...), and its step ids in target order."""
    wf = get_workflow("patch")
    assert wf is not None
    sid = admin.create_strategy(store, wf, StrategyOptions(**options), all_targets=True)
    with store.read() as conn:
        ids = conn.execute(
            text(
                "SELECT s.id FROM steps s JOIN targets t ON t.id = s.target_id "
                "WHERE s.strategy_id = :sid ORDER BY t.name"
            ),
            {"sid": sid},
        ).all()
    return sid, [int(r[0]) for r in ids]


def _journal(
    store: Store, sid: int, moves: list[tuple[int, str, str, int] | tuple[int, str, str, int, str]]
) -> None:
    """Write the moves (step, from, to, fence[, details]) to the journal, in order, and
    each step's row where its last move left it (so only the journal is in question)."""
    with store.write() as conn:
        for i, move in enumerate(moves):
            step, frm, to, fence = move[:4]
            details = move[4] if len(move) == 5 else ""
            conn.execute(
                text(
                    "INSERT INTO journal (strategy_id, step_id, at, conductor, from_state, "
                    "to_state, fence, details) VALUES (:sid, :step, :at, 'c-test', :frm, :to, "
                    ":fence, :details)"
                ),
                dict(sid=sid, step=step, at=float(i), frm=frm, to=to, fence=fence, details=details),
            )
            conn.execute(
                text("UPDATE steps SET state = :to, fence = :fence WHERE id = :step"),
                dict(to=to, fence=fence, step=step),
            )
        slots.recount(conn, store.hooks, sid)  # (counted as a commit counts them)


def _end(store: Store, sid: int, state: str) -> None:
    with store.write() as conn:
        conn.execute(
            text("UPDATE strategies SET state = :s WHERE id = :id"), {"s": state, "id": sid}
        )


def _violations(store: Store, sid: int) -> list[str]:
    return check(store, sid).violations


def test_a_clean_forged_journal_passes(store: Store) -> None:
    """The forging itself is sound: a run as the engine writes it has no violation."""
    add_sim_targets(store, 2)
    sid, (a, b) = _strategy(store, max_parallel=2)
    _journal(store, sid, [(a, "initial", FIRST, 1), (b, "initial", FIRST, 1)])
    _journal(store, sid, [(a, FIRST, "complete", 1), (b, FIRST, "failed", 1, "boom")])
    _end(store, sid, "failed")
    verdict = check(store, sid)
    assert verdict.ok, verdict.violations
    assert (verdict.steps, verdict.transitions) == (2, 4)


def test_a_fence_that_goes_back_is_a_g3_violation(store: Store) -> None:
    add_sim_targets(store, 1)
    sid, (a,) = _strategy(store)
    _journal(store, sid, [(a, "initial", FIRST, 3), (a, FIRST, SECOND, 2)])
    assert _violations(store, sid) == [
        f"G3: strategy {sid} step {a} (t00000) fence went back from 3 to 2"
    ]


def test_a_move_the_workflow_does_not_allow_is_a_g3_violation(store: Store) -> None:
    add_sim_targets(store, 1)
    sid, (a,) = _strategy(store)
    _journal(store, sid, [(a, "initial", SECOND, 1)])  # skipped the first state
    assert _violations(store, sid) == [
        f"G3: strategy {sid} step {a} (t00000) made a move the workflow does not allow: "
        f"initial -> {SECOND}"
    ]


def test_a_group_over_its_cap_is_a_g7_violation(store: Store) -> None:
    admin.add_group(store, Group("racks", max_parallel=1))
    add_sim_targets(store, 2, group="racks")
    sid, (a, b) = _strategy(store, max_parallel=10)
    _journal(store, sid, [(a, "initial", FIRST, 1), (b, "initial", FIRST, 1)])
    (violation,) = _violations(store, sid)
    assert violation.startswith(f"G7: strategy {sid} group ")
    assert violation.endswith(" had 2 in flight (cap 1)")


def test_a_step_started_after_the_failure_threshold_is_reported(store: Store) -> None:
    add_sim_targets(store, 2)
    sid, (a, b) = _strategy(store, max_parallel=2, max_failures=0)
    _journal(
        store,
        sid,
        [(a, "initial", FIRST, 1), (a, FIRST, "failed", 1, "boom"), (b, "initial", FIRST, 1)],
    )
    assert _violations(store, sid) == [
        f"threshold: strategy {sid} step {b} (t00001) started after the failure threshold "
        "(0) was exceeded"
    ]


def test_a_stop_without_enough_failures_is_reported(store: Store) -> None:
    """Steps ended 'not started' for a threshold that was never crossed (the failure
    counted was not written, say): the journal does not explain the stop."""
    add_sim_targets(store, 2)
    sid, (a, b) = _strategy(store, max_parallel=1, max_failures=1)
    _journal(
        store,
        sid,
        [
            (a, "initial", FIRST, 1),
            (a, FIRST, "failed", 1, "boom"),
            (b, "initial", "aborted", 0, "not started: 2 steps failed (threshold 1)"),
        ],
    )
    _end(store, sid, "failed")
    assert _violations(store, sid) == [
        f"threshold: strategy {sid} step {b} (t00001) was stopped although only 1 steps "
        "failed (threshold 1)"
    ]


def test_an_ended_strategy_with_a_step_mid_state_is_reported(store: Store) -> None:
    add_sim_targets(store, 2)
    sid, (a, b) = _strategy(store, max_parallel=2)
    _journal(
        store, sid, [(a, "initial", FIRST, 1), (a, FIRST, "complete", 1), (b, "initial", FIRST, 1)]
    )
    _end(store, sid, "complete")
    assert _violations(store, sid) == [
        f"terminal: strategy {sid} is complete but strategy {sid} step {b} (t00001) is '{FIRST}'"
    ]


def test_leases_left_on_ended_work_are_reported(store: Store) -> None:
    """A terminal step, or an ended strategy, still owned: nobody would free them."""
    add_sim_targets(store, 1)
    sid, (a,) = _strategy(store)
    _journal(store, sid, [(a, "initial", FIRST, 1), (a, FIRST, "complete", 1)])
    _end(store, sid, "complete")
    with store.write() as conn:
        conn.execute(text("UPDATE steps SET owner = 'c-gone' WHERE id = :id"), {"id": a})
        conn.execute(text("UPDATE strategies SET owner = 'c-gone' WHERE id = :id"), {"id": sid})
    assert _violations(store, sid) == [
        f"lease: strategy {sid} step {a} (t00000) is terminal but still owned by c-gone",
        f"lease: strategy {sid} is terminal but still owned by c-gone",
    ]


def test_past_the_reporting_limit_violations_are_counted_not_listed(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(invariants, "MAX_REPORTED", 2)
    add_sim_targets(store, 5)
    sid, ids = _strategy(store, max_parallel=5)
    _journal(store, sid, [(step, "initial", SECOND, 1) for step in ids])  # 5 bad moves
    verdict = check(store, sid)
    assert len(verdict.violations) == 2
    assert verdict.truncated == 3
    assert verdict.to_json()["violations_not_shown"] == 3


def test_a_state_entered_twice_is_a_g1_violation(store: Store) -> None:
    """The journal's unique key refuses a second entry in SQLite, so the check is shown
    a journal as one without that key would hold it (a restore that lost its indexes)."""
    add_sim_targets(store, 1)
    sid, (a,) = _strategy(store)
    _journal(store, sid, [(a, "initial", FIRST, 1), (a, FIRST, SECOND, 1)])
    with store.read() as conn:
        strat = conn.execute(select(strategies).where(strategies.c.id == sid)).one()
        step_rows = conn.execute(
            select(steps.c.id, steps.c.state, steps.c.group_id, steps.c.stage, steps.c.owner)
            .add_columns(targets.c.name, steps.c.visit)
            .join(targets, targets.c.id == steps.c.target_id)
            .where(steps.c.strategy_id == sid)
        ).all()
    Move = namedtuple("Move", "step_id from_state to_state fence details visit")
    jrows = [
        Move(a, "initial", FIRST, 1, "", 1),
        Move(a, FIRST, SECOND, 1, "", 1),
        Move(a, SECOND, FIRST, 1, "", 1),  # back into pre-check: entered twice, and backwards
    ]
    result = invariants.CheckResult()
    invariants._check_strategy(result, strat, step_rows, jrows)
    assert f"G1: strategy {sid} step {a} (t00000) entered '{FIRST}' more than once" in (
        result.violations
    )
    assert result.transitions == 3


def test_check_notes_a_strategy_nobody_drives(cli: Cli, db_path: Path) -> None:
    """After a kill -9 with no serve, check said only "ok": the strategy waiting for a
    conductor is not a violation, but it is work left waiting (audit of session 11)."""
    assert cli("target", "add", "a").code == 0
    created = cli("strategy", "create", "--workflow", "patch", "--all", "--format", "json")
    sid = created.json()["id"]
    assert cli("strategy", "apply", str(sid)).code == 0
    note = (
        f"strategy {sid} is applying and no conductor drives it: it goes on once "
        f"'fleetwave serve' runs (or 'fleetwave strategy apply {sid} --wait')"
    )
    res = cli("check")
    assert res.code == 0
    assert f"note: {note}" in res.out.splitlines(), res.out
    got = cli("check", "--format", "json").json()
    assert got["ok"] is True and got["notes"] == [note]
    shown = cli("strategy", "show", str(sid), "--format", "json").json()
    assert shown["done"] == 0  # as strategy list has it


# Found by a mutation audit: each check below could be switched off (or made one too
# lenient) with every test still passing.


def test_a_move_out_of_a_terminal_state_is_a_g8_violation(store: Store) -> None:
    add_sim_targets(store, 1)
    sid, (a,) = _strategy(store)
    _journal(
        store,
        sid,
        [(a, "initial", FIRST, 1), (a, FIRST, "complete", 1), (a, "complete", SECOND, 1)],
    )
    assert _violations(store, sid) == [
        f"G8: strategy {sid} step {a} (t00000) moved complete -> {SECOND} after terminal 'complete'"
    ]


def test_a_move_from_a_state_the_step_had_left_is_a_g3_violation(store: Store) -> None:
    """A stale worker reporting from the state before: a forward move, so only the
    'was at' comparison catches it."""
    add_sim_targets(store, 1)
    sid, (a,) = _strategy(store)
    third = "creating-remote-patch-strategy"
    _journal(
        store,
        sid,
        [(a, "initial", FIRST, 1), (a, FIRST, SECOND, 1), (a, FIRST, third, 1)],
    )
    assert _violations(store, sid) == [
        f"G3: strategy {sid} step {a} (t00000) moved from '{FIRST}' but was at '{SECOND}'"
    ]


@pytest.mark.parametrize("apply_type", ["parallel", "serial"])
def test_more_steps_in_flight_than_the_strategys_max_is_a_g7_violation(
    store: Store, apply_type: str
) -> None:
    add_sim_targets(store, 3)
    max_parallel = 2 if apply_type == "parallel" else 1
    sid, (a, b, c) = _strategy(store, max_parallel=max_parallel, apply_type=ApplyType(apply_type))
    starts = [(a, "initial", FIRST, 1), (b, "initial", FIRST, 1), (c, "initial", FIRST, 1)]
    _journal(store, sid, starts[: max_parallel + 1])
    assert _violations(store, sid) == [
        f"G7: strategy {sid} had {max_parallel + 1} steps in flight (max {max_parallel})"
    ]


def test_a_row_that_disagrees_with_the_journal_is_reported(store: Store) -> None:
    add_sim_targets(store, 1)
    sid, (a,) = _strategy(store)
    _journal(store, sid, [(a, "initial", FIRST, 1), (a, FIRST, "complete", 1)])
    with store.write() as conn:
        conn.execute(text("UPDATE steps SET state = 'failed' WHERE id = :id"), {"id": a})
    assert _violations(store, sid) == [
        f"record: strategy {sid} step {a} (t00000) row says 'failed' but journal says 'complete'",
        # (the hand edit went past the slots a commit counts, too)
        f"G7: strategy {sid}: slots do not match its steps: strategy: slots row says 0 "
        "failed, steps 1",
    ]


def test_a_step_taken_over_by_a_conductor_not_holding_its_strategy_is_a_g2_violation(
    store: Store,
) -> None:
    """Replaying claims and takeovers in commit order: A claims, B claims after it, then
    A takes a step over (an adopt that did not check it still held the strategy)."""
    add_sim_targets(store, 1)
    sid, step_ids = _strategy(store, 1)
    with store.write() as conn:
        for kind, who, step, details in (
            ("strategy-claimed", "A", None, "from nobody"),
            ("step-taken-over", "A", step_ids[0], "in pre-check from c0 (fence 1 -> 2)"),
            ("strategy-claimed", "B", None, "from A"),
            ("step-taken-over", "B", step_ids[0], "in pre-check from A (fence 2 -> 3)"),
            ("step-taken-over", "A", step_ids[0], "in pre-check from B (fence 3 -> 4)"),
        ):
            conn.execute(
                text(
                    "INSERT INTO events (at, conductor, strategy_id, step_id, kind, details) "
                    "VALUES (0, :who, :sid, :step, :kind, :details)"
                ),
                {"who": who, "sid": sid, "step": step, "kind": kind, "details": details},
            )
    found = check(store, sid).violations
    assert found == [
        f"G2: strategy {sid} step {step_ids[0]} taken over by A (in pre-check from B "
        "(fence 3 -> 4)) while B held the strategy"
    ]
