"""Batch lists (``--batches 1,5,20%``, Ansible's serial): each batch starts when the one
before has ended, the last size repeats, inside each stage; bad sizes refused."""

from __future__ import annotations

import pytest

from fleetwave.domain.errors import InputError
from fleetwave.domain.rollout import RolloutSpec, batch_sizes, parse_batches, parse_stages
from fleetwave.store.db import Store
from fleetwave.testing.invariants import check
from rollout_world import drive, entries, fleet, phase_targets, phases_in_order


def test_each_batch_starts_when_the_one_before_has_ended(store: Store) -> None:
    fleet(store, {None: 10})
    sid, final = drive(store, RolloutSpec(batches=parse_batches("1,2,50%")), max_parallel=3)
    assert final == "complete"
    rows = entries(store, sid)
    spans = phases_in_order(rows)
    # 1, 2, then 50% of 10 (5: at most 3 at once), then the last size again (2 left)
    assert [len(t) for _, t in sorted(phase_targets(rows).items())] == [1, 2, 5, 2]
    # on virtual time: each batch began the instant the one before ended
    for phase in (2, 3, 4):
        assert spans[phase][0].at == spans[phase - 1][1].at
    assert check(store, sid).ok  # the stage order (phases) and max parallel 3, from the journal


def test_batches_start_over_in_each_stage(store: Store) -> None:
    fleet(store, {"a": 3, "b": 2})
    spec = RolloutSpec(stages=parse_stages(["a", "b"]), batches=parse_batches("1,2"))
    sid, final = drive(store, spec)
    assert final == "complete"
    rows = entries(store, sid)
    phases_in_order(rows)
    assert phase_targets(rows) == {
        1: {"a-1"},
        2: {"a-2", "a-3"},
        3: {"b-1"},
        4: {"b-2"},
    }


@pytest.mark.parametrize(
    ("sizes", "whole", "cut"),
    [
        ("1,5,20%", 30, [1, 5, 6, 6, 6, 6]),
        ("10%", 5, [1, 1, 1, 1, 1]),  # 0.5 rounded down, at least 1
        ("100%", 7, [7]),
        ("3", 7, [3, 3, 1]),
        ("2,50%", 1, [1]),
    ],
)
def test_batch_sizes(sizes: str, whole: int, cut: list[int]) -> None:
    assert batch_sizes(parse_batches(sizes), whole) == cut


@pytest.mark.parametrize(
    ("given", "said"),
    [
        ("0", "--batches: must be at least 1, got 0"),
        ("1,0%", "--batches: must be more than 0%, got 0%"),
        ("150%", "--batches: a percent is at most 100%, got 150%"),
        ("1,,2", "--batches: an empty size in '1,,2'"),
        ("five", "--batches: expected a whole number or a percent (5, 20%), got 'five'"),
        ("-1", "--batches: expected a whole number or a percent"),
    ],
)
def test_bad_batches_are_refused(given: str, said: str) -> None:
    with pytest.raises(InputError) as exc:
        parse_batches(given)
    assert str(exc.value).startswith(said)
