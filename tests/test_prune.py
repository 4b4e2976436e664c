"""``fleetwave prune --before AGE``: the one way history leaves the database. It drops
strategies deleted or ended before then, whole (steps, journal, attempts, events,
callbacks, the row), says how many rows of each, and with ``--dry-run`` only says it."""

from __future__ import annotations

import asyncio
import sqlite3
import time
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import func, select, update

from cli_harness import Cli, assert_rejected
from conftest import add_sim_targets, rollout
from fleetwave.domain.models import StrategyOptions, StrategyState
from fleetwave.engine.conductor import Conductor
from fleetwave.store import admin, prune, queries
from fleetwave.store.db import Store
from fleetwave.store.schema import (
    attempts,
    callbacks,
    deleted_steps,
    events,
    journal,
    steps,
    strategies,
    strategy_slots,
)
from fleetwave.testing.invariants import check
from rollout_world import PATCH
from test_cli_strategy import add, apply_wait, create
from test_history_after_delete import retried

DAY_S = 86400.0


def _rollout(store: Store, names: list[str]) -> int:
    sid = admin.create_strategy(store, PATCH, StrategyOptions(), target_names=names)
    admin.apply_strategy(store, sid)
    assert asyncio.run(Conductor(store).run(strategy_ids=[sid]))[sid] == "complete"
    return sid


_TABLES = (steps, deleted_steps, journal, attempts, events, callbacks, strategy_slots, strategies)


def _rows(store: Store, sid: int) -> dict[str, int]:
    with store.read() as conn:
        return {
            t.name: int(
                conn.execute(
                    select(func.count()).where(
                        (t.c.id if t is strategies else t.c.strategy_id) == sid
                    )
                ).scalar_one()
            )
            for t in _TABLES
        }


def _ended_days_ago(store: Store, sid: int, days: float) -> None:
    with store.write() as conn:
        conn.execute(
            update(strategies)
            .where(strategies.c.id == sid)
            .values(updated_at=time.time() - days * DAY_S)
        )


@pytest.mark.both_dialects
def test_prune_drops_old_deleted_and_ended_strategies_whole_and_counts_them(
    store: Store,
) -> None:
    names = add_sim_targets(store, 6)
    deleted, ended, recent = (_rollout(store, some) for some in (names[:3], names[3:], names[:2]))
    retried(store, ended, names[4], "pre-check")
    waiting = admin.create_strategy(store, PATCH, StrategyOptions(), target_names=names[2:])
    admin.delete_strategy(store, deleted)
    for sid in (deleted, ended, waiting):
        _ended_days_ago(store, sid, 100)
    _ended_days_ago(store, recent, 10)
    old = {sid: _rows(store, sid) for sid in (deleted, ended)}
    assert old[ended]["attempts"] == 1
    kept = {sid: _rows(store, sid) for sid in (recent, waiting)}
    cutoff = time.time() - 90 * DAY_S

    dry = prune.prune(store, cutoff, dry_run=True)
    assert dry.strategies == [deleted, ended]
    assert dry.rows == {
        "steps": 6,
        "transitions": old[deleted]["journal"] + old[ended]["journal"],
        "attempts": old[ended]["attempts"] + old[deleted]["attempts"],
        "events": old[deleted]["events"] + old[ended]["events"],
        "callbacks": old[deleted]["callbacks"] + old[ended]["callbacks"],
    }
    assert {sid: _rows(store, sid) for sid in (deleted, ended)} == old  # nothing dropped

    done = prune.prune(store, cutoff, chunk=4)
    assert (done.strategies, done.rows) == (dry.strategies, dry.rows)
    for sid in (deleted, ended):
        assert _rows(store, sid) == dict.fromkeys((t.name for t in _TABLES), 0)
    assert {sid: _rows(store, sid) for sid in (recent, waiting)} == kept
    assert prune.prune(store, cutoff).strategies == []  # nothing left that old
    result = check(store)
    assert result.ok, result.violations
    # ids stay taken: the next strategy is not given a pruned one's
    again = admin.create_strategy(store, PATCH, StrategyOptions(), target_names=names[:1])
    assert again > max(deleted, ended, recent, waiting)


@pytest.mark.both_dialects
def test_an_interrupted_prune_is_not_judged_and_is_finished_by_pruning_again(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    add_sim_targets(store, 3)
    sid, _, _ = rollout(store)
    _ended_days_ago(store, sid, 100)
    real = prune.in_chunks
    calls = {"n": 0}

    def interrupted(*args: Any) -> None:
        calls["n"] += 1
        if calls["n"] == 2:  # the journal went, the attempts' turn
            raise KeyboardInterrupt
        real(*args)

    monkeypatch.setattr(prune, "in_chunks", interrupted)
    with pytest.raises(KeyboardInterrupt):
        prune.prune(store, time.time())
    monkeypatch.undo()
    assert queries.get_strategy(store, sid)["state"] == StrategyState.PRUNING
    assert _rows(store, sid)["journal"] == 0 and _rows(store, sid)["deleted_steps"] == 3
    assert "being pruned" in (queries.deleted_note(store, sid) or "")
    result = check(store)
    assert result.ok and result.deleting == [sid]
    assert prune.prune(store, time.time()).strategies == [sid]
    assert _rows(store, sid) == dict.fromkeys((t.name for t in _TABLES), 0)


def test_prune_on_the_command_line_says_what_it_drops(cli: Cli, db_path: Path) -> None:
    add(cli, "a", "b")
    sid = create(cli, "--all")
    assert apply_wait(cli, sid).code == 0
    assert cli("strategy", "delete", str(sid)).code == 0
    nothing = cli("prune", "--before", "90d")
    assert nothing.code == 0 and "nothing to prune" in nothing.out
    with sqlite3.connect(db_path) as conn:
        conn.execute("UPDATE strategies SET updated_at = updated_at - 91 * 86400")

    dry = cli("prune", "--before", "90d", "--dry-run")
    assert dry.code == 0, dry.text
    assert f"would drop 1 strategy ({sid})" in dry.out
    assert "2 steps, 12 transitions" in dry.out and "nothing dropped" in dry.out
    assert cli("history", "--strategy", str(sid)).code == 0  # still there
    as_data = cli("prune", "--before", "90d", "--dry-run", "--format", "json").json()
    assert as_data["dry_run"] and as_data["strategies"] == [sid]
    assert as_data["rows"]["transitions"] == 12

    res = cli("prune", "--before", "90d", "--format", "json")
    assert res.code == 0, res.text
    assert res.json()["strategies"] == [sid] and res.json()["rows"]["steps"] == 2
    assert_rejected(cli("history", "--strategy", str(sid)), f"strategy {sid}", "not found")
    assert cli("check").code == 0


@pytest.mark.parametrize(
    ("given", "said"),
    [
        ("soon", "expected a duration"),
        ("0", "more than 0"),
        ("-5d", "expected a duration"),
        ("40000d", "at most 36500 days"),
        ("", "expected a duration"),
    ],
)
def test_a_bad_age_is_one_error_line_and_drops_nothing(
    cli: Cli, db_path: Path, given: str, said: str
) -> None:
    add(cli, "a")
    sid = create(cli, "--all")
    assert cli("strategy", "delete", str(sid)).code == 0
    with sqlite3.connect(db_path) as conn:
        conn.execute("UPDATE strategies SET updated_at = 0")
    assert_rejected(cli("prune", "--before", given), "--before", said)
    assert_rejected(cli("prune", "--before", given, "--dry-run"), "--before", said)
    with sqlite3.connect(db_path) as conn:
        assert conn.execute("SELECT id, state FROM strategies").fetchall() == [(sid, "deleted")]
