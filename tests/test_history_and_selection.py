"""Reading a large rollout's record: what an operator narrows it to is found by its
own keys, not by walking the whole strategy (a rollout of 100,000 targets leaves
600,000 journal rows), and still shows exactly the rows asked for."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from cli_harness import PATCH_STATES, Cli
from conftest import add_sim_targets
from fleetwave.domain.errors import Conflict
from fleetwave.domain.models import Group, StrategyOptions
from fleetwave.domain.registry import get_workflow
from fleetwave.store import admin, queries
from fleetwave.store.db import Store, open_store
from test_cli_strategy import add, apply_wait, create, history
from test_step_details import FLAKY_YAML


def _rerun(cli: Cli) -> tuple[int, int]:
    """Two strategies over the same targets, one after the other (the second a retry)."""
    add(cli, "a", "b", "c")
    first = create(cli, "--all")
    assert apply_wait(cli, first).code == 0
    second = create(cli, "--targets", "a,b")
    assert apply_wait(cli, second).code == 0
    return first, second


def test_history_of_a_target_is_its_step_in_that_strategy_only(cli: Cli) -> None:
    first, second = _rerun(cli)
    path = ["initial", *PATCH_STATES, "complete"]
    for sid in (first, second):
        rows = history(cli, sid, "--target", "a")
        assert {r["strategy"] for r in rows} == {sid}
        assert {r["target"] for r in rows} == {"a"}
        assert [r["from"] for r in rows] == path[:-1]
        assert [r["to"] for r in rows] == path[1:]
    both = history(cli, second, "--target", "a,b")
    assert len(both) == 2 * (len(path) - 1)
    assert [r["at"] for r in both] == sorted(r["at"] for r in both)  # in journal order
    assert {r["target"] for r in both} == {"a", "b"}
    last = history(cli, first, "--target", "c", "--last", "2")
    assert [(r["target"], r["to"]) for r in last] == [("c", "finishing"), ("c", "complete")]


def test_events_of_a_target_are_its_step_s_in_that_strategy_only(cli: Cli, tmp_path: Path) -> None:
    wf = tmp_path / "flaky.yaml"
    wf.write_text(FLAKY_YAML, encoding="utf-8")
    assert cli("workflow", "add", str(wf)).code == 0
    add(cli, "steady")
    add(cli, "shaky", flaky_rate="1.0")  # every attempt fails: two attempt-failed events
    sids = []
    for _ in range(2):
        res = cli("strategy", "create", "--workflow", "flaky-once", "--all", "--format", "json")
        sids.append(int(res.json()["id"]))
        assert apply_wait(cli, sids[-1]).code == 1
    for sid in sids:
        res = cli("events", "--strategy", str(sid), "--target", "shaky", "--format", "json")
        assert res.code == 0, res.text
        rows = res.json()
        assert [r["kind"] for r in rows] == ["attempt-failed", "attempt-failed"]
        assert {(r["strategy"], r["target"]) for r in rows} == {(sid, "shaky")}
        res = cli("events", "--strategy", str(sid), "--target", "steady,shaky", "--format", "json")
        assert len(res.json()) == 2


def test_step_show_lists_its_own_transitions(cli: Cli) -> None:
    _, second = _rerun(cli)
    res = cli("step", "list", "--strategy", str(second), "--target", "b", "--format", "json")
    step = res.json()[0]["step"]
    shown = cli("step", "show", str(step), "--format", "json").json()
    assert [h["to"] for h in shown["history"]] == [*PATCH_STATES, "complete"]
    assert {h["step"] for h in shown["history"]} == {step}


# -- strategy create: chosen before the write lock, checked again under it --------------


def _between_read_and_write(monkeypatch: pytest.MonkeyPatch, change: Callable[[], None]) -> None:
    """Run ``change`` (another command's write) after the targets are chosen and before
    the strategy's write transaction: the moment a concurrent writer can come in."""
    real = admin._order
    done: list[bool] = []

    def order_then_change(rows: list[Any], gnames: dict[int | None, str]) -> None:
        real(rows, gnames)
        if not done:
            done.append(True)
            change()

    monkeypatch.setattr(admin, "_order", order_then_change)


def _steps_of(store: Store, sid: int) -> dict[str | None, int | None]:
    """target name (None: no such target) -> the step's group id, in the steps' order."""
    with store.read() as conn:
        rows = conn.exec_driver_sql(
            "SELECT targets.name, steps.group_id FROM steps LEFT JOIN targets ON "
            "targets.id = steps.target_id WHERE steps.strategy_id = ? ORDER BY steps.ordinal",
            (sid,),
        ).all()
    assert len({name for name, _ in rows}) == len(rows)
    return {name: gid for name, gid in rows}


@pytest.mark.parametrize("fleet", [3, 2_500])  # looked up by id; read in one pass
def test_a_target_deleted_or_moved_meanwhile_is_seen_under_the_lock(
    store: Store, monkeypatch: pytest.MonkeyPatch, fleet: int
) -> None:
    names = add_sim_targets(store, fleet)
    gid = admin.add_group(store, Group(name="g", max_parallel=1))
    gone, moved = names[1], names[-1]

    def change() -> None:
        admin.delete_target(store, gone)
        admin.change_target(store, moved, group="g")

    _between_read_and_write(monkeypatch, change)
    wf = get_workflow("patch")
    assert wf is not None
    sid = admin.create_strategy(store, wf, StrategyOptions(), all_targets=True)
    made = _steps_of(store, sid)
    assert gone not in made and None not in made and len(made) == fleet - 1
    assert made[moved] == gid
    assert next(iter(made)) == moved  # ordered again: group g comes before ungrouped
    with store.read() as conn:
        caps = conn.exec_driver_sql("SELECT group_caps FROM strategies WHERE id = ?", (sid,))
        assert json.loads(caps.scalar_one()) == {str(gid): 1}


@pytest.mark.parametrize("fleet", [3, 2_500])
def test_a_target_taken_by_another_strategy_meanwhile_is_refused(
    store: Store, monkeypatch: pytest.MonkeyPatch, fleet: int
) -> None:
    names = add_sim_targets(store, fleet)
    wf = get_workflow("patch")
    assert wf is not None
    taken: list[int] = []

    def other_create() -> None:
        taken.append(admin.create_strategy(store, wf, StrategyOptions(), target_names=[names[0]]))

    _between_read_and_write(monkeypatch, other_create)
    with pytest.raises(Conflict) as err:
        admin.create_strategy(store, wf, StrategyOptions(), all_targets=True)
    assert str(err.value).startswith(
        f"target {names[0]}: already in active strategy {taken[0]} (initial)"
    )
    with store.read() as conn:  # nothing of it written
        assert conn.exec_driver_sql("SELECT count(*) FROM strategies").scalar_one() == 1
        assert conn.exec_driver_sql("SELECT count(*) FROM steps").scalar_one() == 1


def test_a_fleet_held_in_part_names_the_held_targets(store: Store) -> None:
    names = add_sim_targets(store, 2_500)
    wf = get_workflow("patch")
    assert wf is not None
    first = admin.create_strategy(store, wf, StrategyOptions(), target_names=names[10:17])
    with pytest.raises(Conflict) as err:
        admin.create_strategy(store, wf, StrategyOptions(), all_targets=True)
    assert str(err.value) == (
        f"7 targets ({', '.join(names[10:15])} and 2 more): already in active strategy "
        f"{first} (initial); it was never applied: 'fleetwave strategy delete {first}' "
        "frees its targets"
    )


def test_a_target_table_shows_settings_and_labels_as_its_json_does(cli: Cli) -> None:
    """The table prints the stored JSON text (not parsed and dumped again per row)."""
    assert (
        cli("target", "add", "a", "--set", "latency_ms=5", "--set", "fail_at=pre-check").code == 0
    )
    assert cli("target", "add", "b", "--label", "tier=canary", "--label", "dc=x").code == 0
    assert cli("target", "add", "c", "--label", "tier=main").code == 0
    listed = cli("target", "list", "--format", "json").json()
    table = cli("target", "list").out.splitlines()
    assert len(table) == 2 + len(listed)
    for row, line in zip(listed, table[2:], strict=True):
        settings = json.dumps(row["settings"], sort_keys=True)
        labels = json.dumps(row["labels"], sort_keys=True)
        assert line.split("  ")[0] == row["name"]
        assert f"{settings}  " in line and line.endswith(labels), line
    canary = cli("target", "list", "--label", "tier=canary").out.splitlines()[2:]
    assert [line.split()[0] for line in canary] == ["b"]


def test_a_label_changed_meanwhile_chooses_the_targets_again(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Chosen by label before the lock, a target relabelled in between was rolled out to
    under the label it no longer had (found by a review)."""
    names = add_sim_targets(store, 3, labels={"env": "staging"})
    _between_read_and_write(
        monkeypatch, lambda: admin.change_target(store, names[1], labels={"env": "prod"})
    )
    wf = get_workflow("patch")
    assert wf is not None
    sid = admin.create_strategy(store, wf, StrategyOptions(), labels={"env": "staging"})
    assert list(_steps_of(store, sid)) == [names[0], names[2]]


def test_a_step_s_history_is_read_within_the_strategy_asked_for(cli: Cli, db_path: Path) -> None:
    first, second = _rerun(cli)
    res = cli("step", "list", "--strategy", str(second), "--target", "a", "--format", "json")
    step = res.json()[0]["step"]
    store = open_store(str(db_path))
    try:
        assert len(queries.history(store, second, step_id=step)) == len(PATCH_STATES) + 1
        assert queries.history(store, first, step_id=step) == []  # not strategy 1's rows
    finally:
        store.dispose()
