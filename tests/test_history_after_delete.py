"""History survives ``strategy delete``: the steps leave the working tables, the journal,
attempts, events and callbacks stay and answer as before, marked deleted; ``check``
judges a deleted strategy from its kept steps."""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path

import pytest
from sqlalchemy import func, insert, select, update

from cli_harness import Cli, assert_rejected
from conftest import add_sim_targets, rollout
from fleetwave.domain.errors import NotFound
from fleetwave.store import admin, queries
from fleetwave.store.db import Store
from fleetwave.store.schema import attempts, deleted_steps, steps, strategy_slots
from fleetwave.testing.invariants import check
from test_cli_strategy import add, apply_wait, create


def retried(store: Store, sid: int, target: str, state: str) -> None:
    """A second attempt of ``state`` on the record, as a retry writes it (a flaky target
    retries after a backoff of seconds: not waited for here)."""
    step = next(s for s in queries.list_steps(store, sid) if s["target"] == target)
    with store.write() as conn:
        conn.execute(
            insert(attempts).values(
                strategy_id=sid,
                step_id=step["step"],
                state=state,
                attempt=2,
                at=time.time(),
                conductor="c-test",
                fence=1,
                how="retry",
            )
        )


def _record(store: Store, sid: int) -> tuple[object, ...]:
    """What an auditor reads of a strategy: its journal, events, and each step's
    attempts and callbacks."""
    ids = [r["step"] for r in queries.list_steps(store, sid)]
    return (
        queries.history(store, sid),
        list(queries.iter_events(store, sid)),
        [queries.step_attempts(store, i) for i in ids],
        [queries.step_callbacks(store, i) for i in ids],
    )


@pytest.mark.both_dialects
def test_a_deleted_strategys_journal_events_and_attempts_answer_as_before(store: Store) -> None:
    add_sim_targets(store, 8)
    add_sim_targets(store, 2, {"fail_at": "updating-patches"}, prefix="bad")
    sid, state, _ = rollout(store, max_parallel=3)
    assert state == "failed"  # two steps failed
    retried(store, sid, "t00003", "pre-check")
    before = _record(store, sid)
    steps_before = queries.list_steps(store, sid)
    assert any(a["how"] == "retry" for each in before[2] for a in each)

    admin.delete_strategy(store, sid, chunk=3)  # in chunks: 4 of them

    with store.read() as conn:
        assert conn.execute(select(func.count()).where(steps.c.strategy_id == sid)).scalar() == 0
        assert (
            conn.execute(select(func.count()).where(deleted_steps.c.strategy_id == sid)).scalar()
            == 10
        )
        assert (
            conn.execute(select(func.count()).where(strategy_slots.c.strategy_id == sid)).scalar()
            == 0
        )
    assert _record(store, sid) == before
    kept = queries.list_steps(store, sid)
    assert [(s["step"], s["target"], s["state"], s["details"]) for s in kept] == [
        (s["step"], s["target"], s["state"], s["details"]) for s in steps_before
    ]
    shown = queries.get_strategy(store, sid)
    assert shown["state"] == "deleted" and shown["deleted_from"] == state
    assert shown["deleted_at"] is not None and shown["done"] == 10
    assert queries.deleted_note(store, sid) is not None
    result = check(store)
    assert result.ok, result.violations
    assert result.strategies == 1 and result.steps == 10 and result.deleting == []
    with pytest.raises(NotFound, match="deleted already"):
        admin.delete_strategy(store, sid)


@pytest.mark.both_dialects
def test_check_judges_a_deleted_strategy_from_its_kept_steps(store: Store) -> None:
    add_sim_targets(store, 3)
    sid, _, _ = rollout(store)
    admin.delete_strategy(store, sid)
    with store.write() as conn:  # a hand edit of the kept record
        conn.execute(
            update(deleted_steps)
            .where(deleted_steps.c.strategy_id == sid, deleted_steps.c.target == "t00001")
            .values(state="failed")
        )
    result = check(store)
    assert [v for v in result.violations if v.startswith("record:")] == [
        f"record: strategy {sid} step 2 (t00001) row says 'failed' but journal says 'complete'"
    ]


def test_history_and_events_of_a_deleted_strategy_say_so_and_name_deleted_targets(
    cli: Cli, db_path: Path
) -> None:
    add(cli, "a")
    add(cli, "b", fail_at="pre-check")
    sid = create(cli, "--all")
    assert apply_wait(cli, sid).code == 1  # b failed
    res = cli("strategy", "delete", str(sid))
    assert res.code == 0, res.text
    shown_a = cli("target", "show", "a", "--format", "json").json()["strategies"]
    assert [(s["strategy"], s["strategy_state"], s["step_state"]) for s in shown_a] == [
        (sid, "deleted", "complete")
    ]
    assert cli("target", "delete", "b").code == 0  # its history names it still

    table = cli("history", "--strategy", str(sid))
    assert table.code == 0, table.text
    assert f"strategy {sid}: deleted" in table.out and "fleetwave prune" in table.out
    rows = cli("history", "--strategy", str(sid), "--target", "b", "--format", "json").json()
    assert [(r["target"], r["to"]) for r in rows] == [("b", "pre-check"), ("b", "failed")]
    assert all(r["strategy_deleted"] for r in rows)
    events = cli("events", "--strategy", str(sid), "--format", "json").json()
    assert events and all(e["strategy_deleted"] for e in events)
    step_b = rows[0]["step"]
    shown = cli("step", "show", str(step_b), "--format", "json").json()
    assert shown["strategy_deleted"] and shown["target"] == "b" and shown["state"] == "failed"
    assert [h["to"] for h in shown["history"]] == ["pre-check", "failed"]
    # its failures can still be tried again: a from its kept steps (b is gone)
    assert_rejected(cli("strategy", "create", "--workflow", "patch", "--failed-in", str(sid)), "b")
    # a list leaves it out unless asked for
    assert cli("strategy", "list", "--format", "json").json() == []
    listed = cli("strategy", "list", "--state", "deleted", "--format", "json").json()
    assert [(s["id"], s["done"]) for s in listed] == [(sid, 2)]
    # deleting it again: said, and nothing to do for --ignore-missing
    assert_rejected(cli("strategy", "delete", str(sid)), f"strategy {sid}", "deleted already")
    assert cli("strategy", "delete", str(sid), "--ignore-missing").code == 0
    assert cli("check").code == 0
    with sqlite3.connect(db_path) as conn:
        assert conn.execute("SELECT state FROM strategies").fetchall() == [("deleted",)]
