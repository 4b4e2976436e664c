"""Canaries (``--canary N`` or ``N%``, or chosen by ``--canary-label k=v``): they run
first, nothing else starts until all have ended, and one failing ends the strategy
failed whatever the threshold."""

from __future__ import annotations

import pytest

from fleetwave.domain.errors import InputError
from fleetwave.domain.rollout import RolloutSpec, parse_amount, parse_stages
from fleetwave.store import admin, queries
from fleetwave.store.db import Store
from fleetwave.testing.invariants import check
from rollout_world import drive, entries, fleet, phase_targets, phases_in_order


def _canary(n: str, stages: list[str] | None = None) -> RolloutSpec:
    return RolloutSpec(
        canary=parse_amount(n, "--canary", least=1), stages=parse_stages(stages or [])
    )


def test_canaries_run_first_from_the_first_stage(store: Store) -> None:
    fleet(store, {"a": 3, "b": 3})
    sid, final = drive(store, _canary("2", ["b", "a"]))
    assert final == "complete"
    rows = entries(store, sid)
    spans = phases_in_order(rows)  # nothing else started before both canaries ended
    assert phase_targets(rows) == {1: {"b-1", "b-2"}, 2: {"b-3"}, 3: {"a-1", "a-2", "a-3"}}
    assert spans[2][0].at == spans[1][1].at
    stages = queries.get_strategy(store, sid)["stages"]
    assert [(s["name"], s["steps"]) for s in stages] == [("canaries", 2), ("b", 1), ("a", 3)]
    assert check(store, sid).ok


def test_a_canary_percent_is_of_the_strategys_targets(store: Store) -> None:
    fleet(store, {None: 20})
    sid, final = drive(store, _canary("10%"))
    assert final == "complete"
    assert len(phase_targets(entries(store, sid))[1]) == 2


def test_canaries_chosen_by_label(store: Store) -> None:
    fleet(store, {"a": 2, "b": 2})
    admin.change_target(store, "b-2", labels={"ring": "0"})
    admin.change_target(store, "a-2", labels={"ring": "0"})
    sid, final = drive(store, RolloutSpec(canary_label={"ring": "0"}))
    assert final == "complete"
    assert phase_targets(entries(store, sid))[1] == {"a-2", "b-2"}


def test_a_canary_failure_fails_the_strategy_whatever_the_threshold(store: Store) -> None:
    fleet(store, {None: 6}, settings={"loose-2": {"fail_at": "updating-patches"}})
    sid, final = drive(store, _canary("2"), max_failures=100)
    assert final == "failed"
    # the other canary finished the state it was in, as any step when a strategy stops
    assert queries.step_counts(store, sid) == {"failed": 1, "aborted": 5}
    rows = entries(store, sid)
    assert {e.target for e in rows if e.from_state != "initial"} == {"loose-1", "loose-2"}
    why = "stopped: a canary failed (the last: loose-2)"
    aborted = {e.target: e.details for e in rows if e.to_state == "aborted"}
    assert aborted.pop("loose-1") == f"stopped after updating-patches: {why}"
    assert set(aborted.values()) == {f"not started: {why}"}
    assert queries.get_strategy(store, sid)["details"] == (
        "stopped: a canary failed (the last: loose-2)"
    )
    assert check(store, sid).ok


@pytest.mark.parametrize(
    ("spec", "said"),
    [
        (_canary("6"), "--canary: 6 is 6 canaries, of 6 targets: at most 5"),
        (_canary("100%"), "--canary: 100% is 6 canaries, of 6 targets: at most 5"),
        (
            _canary("4", ["a", "rest"]),
            "--canary: 4 canaries asked, but there are 3 in the first stage (a)",
        ),
        (RolloutSpec(canary_label={"ring": "9"}), "--canary-label: no chosen target has ring=9"),
    ],
)
def test_bad_canaries_are_refused(store: Store, spec: RolloutSpec, said: str) -> None:
    fleet(store, {"a": 3, None: 3})
    with pytest.raises(InputError) as exc:
        drive(store, spec)
    assert str(exc.value) == said or str(exc.value).startswith(said), str(exc.value)
    assert queries.list_strategies(store) == []
