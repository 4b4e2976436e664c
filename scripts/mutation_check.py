"""Break the engine on purpose, one way at a time, and fail unless each is caught.

Each mutation is one or more textual changes to a copy of ``src/`` (the script stops
if a text is not found exactly once, so it stays in step with the code). Its
detectors run against that copy: the tests written for that layer, and simulator
seeds (a run stops at its first violation). Every detector named must catch it:
a mutation that one of them misses fails the check.

Usage: python scripts/mutation_check.py [--seeds N] [--only NAME]
(``scripts/test.sh`` runs it; about 3 minutes on two cores.)
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

SIM = """
import sys
from fleetwave.testing.simulate import SimConfig, parse_faults, run_simulation
workflow, first, count, targets = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
for seed in range(first, first + count):
    r = run_simulation(SimConfig(seed=seed, targets=targets, workflow=workflow))
    if not r.ok:
        print(f"seed {seed}: {r.violations[0]}")
        sys.exit(1)
print(f"{count} seeds ok")
"""


@dataclass(frozen=True)
class Mutation:
    name: str
    path: str
    old: str
    new: str
    #: more changes made with this one: (path, old, new)
    also: tuple[tuple[str, str, str], ...] = ()
    #: test node ids that must fail
    tests: tuple[str, ...] = ()
    #: simulator runs that must find a violation: (workflow, targets)
    sims: tuple[tuple[str, int], ...] = field(default_factory=tuple)


ENGINE = "src/fleetwave/engine/"
STORE = "src/fleetwave/store/"

MUTATIONS = [
    Mutation(
        "d1: adopt takes steps over without checking it still holds the strategy",
        ENGINE + "claims.py",
        "        taken = await self._take_over(run, lost, (rec.id, rec.fence), now)",
        "        taken = await self._take_over(run, lost, None, now)",
        tests=(
            "tests/test_adoption.py::test_a_conductor_fenced_off_before_adopting_takes_no_step_over",
        ),
        sims=(("patch", 60),),
    ),
    Mutation(
        "d1b: a strategy stops being 'claiming' before it is adopted",
        ENGINE + "conductor.py",
        "                try:\n                    recover += await self._adopt(",
        "                self._claiming.discard(msg.record.id)\n"
        "                try:\n                    recover += await self._adopt(",
        tests=(
            "tests/test_adoption.py::"
            "test_a_store_error_while_adopting_does_not_claim_the_strategy_again",
        ),
    ),
    Mutation(
        "d1 and d1b together (the adopt as it was before the audit)",
        ENGINE + "conductor.py",
        "                try:\n                    recover += await self._adopt(",
        "                self._claiming.discard(msg.record.id)\n"
        "                try:\n                    recover += await self._adopt(",
        also=(
            (
                ENGINE + "claims.py",
                "        taken = await self._take_over(run, lost, (rec.id, rec.fence), now)",
                "        taken = await self._take_over(run, lost, None, now)",
            ),
        ),
        sims=(("patch", 60),),
    ),
    Mutation(
        "d4: leases written and compared on the conductor's wall clock",
        ENGINE + "clock.py",
        "    def lease_now(self) -> float:\n        return asyncio.get_running_loop().time()",
        "    def lease_now(self) -> float:\n        return self.now()",
        tests=("tests/test_lease_clock.py::test_a_wall_clock_ahead_takes_no_live_lease",),
        sims=(("patch", 60),),
    ),
    Mutation(
        "step compare-and-set: state and fence not checked",
        STORE + "writer.py",
        'f" WHERE id={p} AND state={p} AND fence={p} AND visit={p} AND (owner={p} OR {p} "',
        'f" WHERE id={p} AND {p} IS NOT NULL AND {p} IS NOT NULL AND visit={p} '
        'AND (owner={p} OR {p} "',
        tests=(
            "tests/test_fencing_layers.py::test_the_step_compare_and_set_refuses_a_stale_state",
            "tests/test_fencing_layers.py::test_the_step_compare_and_set_refuses_a_stale_fence",
        ),
    ),
    Mutation(
        "a callback answered already still moves its step (applied twice)",
        STORE + "writer.py",
        'f"WHERE id={p} AND outcome IS NULL"',
        'f"WHERE id={p}"',
        tests=(
            "tests/test_callbacks.py::"
            "test_the_writer_refuses_a_move_whose_callback_was_answered_already",
            "tests/test_callbacks.py::test_a_callback_answered_by_another_moves_its_step_not_at_all",
        ),
    ),
    Mutation(
        "step owner not checked by its writes",
        STORE + "writer.py",
        'f" WHERE id={p} AND state={p} AND fence={p} AND visit={p} AND (owner={p} OR {p} "',
        'f" WHERE id={p} AND state={p} AND fence={p} AND visit={p} AND ({p} IS NOT NULL OR {p} "',
        tests=("tests/test_fencing_layers.py::test_a_step_is_written_only_by_its_owner",),
    ),
    Mutation(
        "step compare-and-set: the visit not checked (a state on a bounded cycle)",
        STORE + "writer.py",
        'f" WHERE id={p} AND state={p} AND fence={p} AND visit={p} AND (owner={p} OR {p} "',
        'f" WHERE id={p} AND state={p} AND fence={p} AND {p} IS NOT NULL AND (owner={p} OR {p} "',
        tests=(
            "tests/test_bounded_cycles.py::"
            "test_a_stale_writer_cannot_re_enter_a_state_it_already_left[sqlite]",
        ),
    ),
    Mutation(
        "a commit does not check the strategy's slots (G7 across conductors)",
        STORE + "writer.py",
        'f"{self._slot_sql} AND ({p} <= 0 OR in_flight + {p} <= cap)"',
        'f"{self._slot_sql} AND ({p} <= 0 OR {p} IS NOT NULL)"',
        also=((STORE + "writer.py", "not fits(t):", "False:"),),
        tests=(
            "tests/test_slots_across_conductors.py::"
            "test_an_entry_past_the_cap_is_not_written_whoever_made_it[sqlite]",
            "tests/test_slots_across_conductors.py::"
            "test_no_interleaving_exceeds_a_cap_or_shares_a_step[sqlite]",
        ),
    ),
    Mutation(
        "a claimed step may be started by another conductor",
        STORE + "writer.py",
        'f"OR (owner IS NULL AND {p}))"',
        'f"OR ({p} IS NOT NULL))"',
        tests=(
            "tests/test_slots_across_conductors.py::"
            "test_a_step_claimed_by_one_conductor_is_not_started_by_another[sqlite]",
        ),
    ),
    Mutation(
        "strategy fence not checked by a commit",
        STORE + "writer.py",
        "            if (owner == self.cid and fence == fences[sid]) or (",
        "            if True or (",
        tests=(
            "tests/test_fencing_layers.py::test_the_strategy_fence_refuses_a_conductor_claimed_over",
        ),
    ),
    Mutation(
        "journal without its unique key on (step, state, visit)",
        STORE + "migrations/versions/0014_state_visits.py",
        "        batch.create_unique_constraint(\n"
        '            "uq_journal_step_state_visit", ["step_id", "to_state", "visit"]\n'
        "        )\n",
        "",
        tests=(
            "tests/test_fencing_layers.py::"
            "test_the_journals_unique_key_refuses_a_state_entered_before",
        ),
    ),
    Mutation(
        "attempts without their unique key",
        STORE + "migrations/versions/0014_state_visits.py",
        "        batch.create_unique_constraint(\n"
        '            "uq_attempts_step_state_visit", ["step_id", "state", "visit", "attempt"]\n'
        "        )\n",
        "",
        tests=("tests/test_fencing_layers.py::test_an_attempt_is_recorded_once",),
    ),
    Mutation(
        "a takeover runs the action again instead of its recover hook",
        ENGINE + "worker.py",
        "                        outcome = await st.action.recover(ctx)",
        "                        outcome = await st.action.run(ctx)",
        sims=(("patch", 200),),
    ),
    Mutation(
        "a retry runs its action twice in one attempt",
        ENGINE + "worker.py",
        "                    else:\n                        outcome = await st.action.run(ctx)\n",
        "                    else:\n                        outcome = await st.action.run(ctx)\n"
        "                        if attempts > 1:\n"
        "                            outcome = await st.action.run(ctx)\n",
        sims=(("patch", 200),),
    ),
    Mutation(
        "a callback waits for the dispatcher (a call, not a cast)",
        ENGINE + "conductor.py",
        "    def _sink(self, step_id: int, state: str, kind: str, details: str, visit: int) "
        "-> None:\n"
        "        self.receive_callback(step_id, state, kind, details, visit)",
        "    def _sink(self, step_id: int, state: str, kind: str, details: str, visit: int) "
        "-> Any:\n"
        "        self.receive_callback(step_id, state, kind, details, visit)\n"
        "        return asyncio.sleep(self.config.tick_s)  # until the next pass handles it",
        sims=(("clean", 60),),
    ),
]


def _mutated(m: Mutation, into: Path) -> None:
    shutil.copytree(ROOT / "src", into / "src")
    for path, old, new in ((m.path, m.old, m.new), *m.also):
        target = into / path
        text = target.read_text()
        if text.count(old) != 1:
            raise SystemExit(f"mutation '{m.name}': its text is in {path} {text.count(old)} times")
        target.write_text(text.replace(old, new))


def _caught(m: Mutation, into: Path, seeds: int) -> tuple[list[str], list[str]]:
    """What caught the mutation, and which detectors missed it."""
    env = {**os.environ, "PYTHONPATH": str(into / "src"), "PYTHONDONTWRITEBYTECODE": "1"}
    caught: list[str] = []
    missed: list[str] = []
    for test in m.tests:
        run = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", test],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
        )
        name = test.split("::")[-1]
        (caught if run.returncode != 0 else missed).append(f"test {name}")
    for workflow, targets in m.sims:
        run = subprocess.run(
            [sys.executable, "-c", SIM, workflow, "1", str(seeds), str(targets)],
            cwd=into,
            env=env,
            capture_output=True,
            text=True,
        )
        if run.returncode != 0:
            said = (run.stdout.strip().splitlines() or [run.stderr.strip()[-200:]])[-1]
            caught.append(f"simulator ({workflow}): {said}")
        else:
            missed.append(f"simulator ({workflow}, {seeds} seeds)")
    return caught, missed


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, default=30, help="simulator seeds per run (from 1)")
    ap.add_argument("--only", help="run the mutations whose name contains this")
    args = ap.parse_args()
    chosen = [m for m in MUTATIONS if not args.only or args.only in m.name]
    missed = 0
    t0 = time.perf_counter()
    for m in chosen:
        with tempfile.TemporaryDirectory(prefix="fleetwave-mutant-") as tmp:
            _mutated(m, Path(tmp))
            started = time.perf_counter()
            caught, not_by = _caught(m, Path(tmp), args.seeds)
        took = time.perf_counter() - started
        if not_by:
            missed += 1
            print(f"NOT CAUGHT ({took:.0f}s): {m.name}: missed by {'; '.join(not_by)}")
        else:
            print(f"caught ({took:.0f}s): {m.name}: {'; '.join(caught)}")
    print(
        f"{len(chosen) - missed} of {len(chosen)} mutations caught "
        f"in {time.perf_counter() - t0:.0f}s"
    )
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
