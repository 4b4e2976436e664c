"""Bounded cycles in YAML workflows: a branch may go back (a retry loop) when every
state on the cycle declares ``max_visits``. Each visit is its own journal entry (the
journal is unique on step, state and visit: G1 per visit), the compare-and-set that
moves a step checks the visit it is in, a step that would enter a state more than its
``max_visits`` fails saying so, and ``fleetwave check`` tells distinct visits from a
visit entered twice."""

from __future__ import annotations

import asyncio
import sqlite3
import tempfile
from collections import Counter, namedtuple
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import select, update
from sqlalchemy.exc import IntegrityError

from cli_harness import Cli, assert_rejected, one_line
from conftest import add_sim_targets, on_virtual_time
from fleetwave.domain.models import StrategyOptions, Target
from fleetwave.domain.yaml_workflow import parse_workflow_yaml
from fleetwave.drivers.sim import SimDriver
from fleetwave.engine.clock import LoopClock
from fleetwave.engine.conductor import Conductor
from fleetwave.engine.config import EngineConfig
from fleetwave.engine.errors import SimulatedCrash
from fleetwave.store import admin, queries
from fleetwave.store.db import Store, open_store
from fleetwave.store.schema import journal, steps, strategies, targets
from fleetwave.store.writer import Transition, TransitionWriter
from fleetwave.testing import invariants
from fleetwave.testing.invariants import check
from test_cli_strategy import add, apply_wait

FLASH = """\
name: flash-loop
states:
  - name: pre-check
  - name: retry-flash
    max_visits: 3
  - name: verify
    max_visits: 3
    on: {failed: retry-flash}
  - name: finish
"""


def _moves(cli: Cli, sid: int) -> dict[str, list[tuple[str, str, int, str]]]:
    rows = cli("history", "--strategy", str(sid), "--format", "json").json()
    out: dict[str, list[tuple[str, str, int, str]]] = {}
    for r in rows:
        out.setdefault(r["target"], []).append((r["from"], r["to"], r["visit"], r["details"]))
    return out


def _add_workflow(cli: Cli, tmp_path: Path, text: str) -> None:
    f = tmp_path / "wf.yaml"
    f.write_text(text)
    res = cli("workflow", "add", str(f))
    assert res.code == 0, res.text


def test_a_retry_loop_enters_each_looped_state_once_per_visit(cli: Cli, tmp_path: Path) -> None:
    """The sim fails the first verify of `flaky` and passes the second: the step goes
    round the loop once, and the journal has visits 1 and 2 of each looped state."""
    add(cli, "good")
    add(cli, "flaky", fail_at="verify", fail_visits="1")
    _add_workflow(cli, tmp_path, FLASH)
    made = cli("strategy", "create", "--workflow", "flash-loop", "--all", "--format", "json")
    sid = int(made.json()["id"])
    res = apply_wait(cli, sid)
    assert res.code == 0, res.text
    moves = _moves(cli, sid)
    assert [(f, t, v) for f, t, v, _ in moves["flaky"]] == [
        ("initial", "pre-check", 1),
        ("pre-check", "retry-flash", 1),
        ("retry-flash", "verify", 1),
        ("verify", "retry-flash", 2),  # back round the loop: its second visit
        ("retry-flash", "verify", 2),
        ("verify", "finish", 1),
        ("finish", "complete", 1),
    ]
    assert moves["flaky"][3][3] == (
        "verify: failed on target (fail_at=verify); on failed: retry-flash"
    )
    assert [(t, v) for _, t, v, _ in moves["good"]] == [
        ("pre-check", 1),
        ("retry-flash", 1),
        ("verify", 1),
        ("finish", 1),
        ("complete", 1),
    ]
    table = cli("history", "--strategy", str(sid), "--target", "flaky")
    assert table.out.splitlines()[0].split()[:7] == [
        "at", "conductor", "target", "from", "to", "visit", "details",
    ]  # fmt: skip
    assert cli("check").code == 0  # distinct visits are not a G1 violation


def test_a_step_past_max_visits_fails_naming_the_state_and_its_limit(
    cli: Cli, tmp_path: Path
) -> None:
    add(cli, "broken", fail_at="verify")  # every visit of verify fails
    _add_workflow(cli, tmp_path, FLASH)
    made = cli("strategy", "create", "--workflow", "flash-loop", "--all", "--format", "json")
    sid = int(made.json()["id"])
    res = apply_wait(cli, sid)
    assert res.code == 1, res.text
    moves = _moves(cli, sid)["broken"]
    entered = Counter(t for _, t, _, _ in moves)
    assert entered["retry-flash"] == 3 and entered["verify"] == 3
    assert [v for _, t, v, _ in moves if t == "verify"] == [1, 2, 3]
    last = moves[-1]
    assert last[:2] == ("verify", "failed")
    assert last[3].startswith(
        "verify: retry-flash would be entered a 4th time: its max_visits is 3 ("
    ), last[3]
    step = cli("step", "list", "--strategy", str(sid), "--format", "json").json()[0]
    assert step["state"] == "failed" and "max_visits is 3" in step["details"]
    assert cli("check").code == 0


@pytest.mark.parametrize(
    ("states", "said"),
    [
        (  # the cycle's states named, and which lack max_visits
            "  - name: flash\n  - name: verify\n    max_visits: 3\n    on: {failed: flash}\n",
            "workflow bad: states flash, verify form a cycle of branches; every state on a "
            "cycle needs max_visits (1 to 100): missing on flash",
        ),
        (
            "  - name: a\n    on: {failed: a}\n",
            "state a branches to itself, a cycle; every state on a cycle needs max_visits "
            "(1 to 100): missing on a",
        ),
        (  # a cycle through a done branch and the plain order
            "  - name: a\n  - name: b\n  - name: c\n    max_visits: 2\n    on: {done: b}\n",
            "states b, c form a cycle of branches",
        ),
        (
            "  - name: a\n    max_visits: 0\n",
            "states[0] (a): max_visits: must be at least 1, got 0",
        ),
        ("  - name: a\n    max_visits: 101\n", "states[0] (a): max_visits: must be at most 100"),
        ("  - name: a\n    max_visits: 2.5\n", "states[0] (a): max_visits: expected a whole"),
        ("  - name: a\n    max_visits: true\n", "states[0] (a): max_visits: expected a number"),
    ],
)
def test_bad_cycles_are_one_error_line_and_nothing_is_stored(
    cli: Cli, tmp_path: Path, db_path: Path, states: str, said: str
) -> None:
    f = tmp_path / "bad.yaml"
    f.write_text("name: bad\nstates:\n" + states)
    assert_rejected(cli("workflow", "validate", str(f)), said)
    one_line(cli("workflow", "add", str(f)))
    with sqlite3.connect(db_path) as conn:
        assert conn.execute("SELECT count(*) FROM workflows").fetchone()[0] == 0


def test_workflow_show_gives_max_visits(cli: Cli, tmp_path: Path) -> None:
    _add_workflow(cli, tmp_path, FLASH)
    shown = cli("workflow", "show", "flash-loop", "--format", "json").json()["states"]
    by = {s["state"]: s for s in shown}
    assert by["verify"]["max_visits"] == 3 and by["verify"]["on_failed"] == "retry-flash"
    assert "max_visits" not in by["pre-check"]


# -- the compare-and-set and the journal's key, on both dialects ----------------------


def _step(store: Store) -> tuple[int, int]:
    wf = parse_workflow_yaml(FLASH, strict=True)
    add_sim_targets(store, 1)
    sid = admin.create_strategy(store, wf, StrategyOptions(), all_targets=True)
    with store.read() as conn:
        step_id = conn.execute(select(steps.c.id).where(steps.c.strategy_id == sid)).scalar_one()
    return sid, step_id


@pytest.mark.both_dialects
def test_a_stale_writer_cannot_re_enter_a_state_it_already_left(store: Store) -> None:
    """A writer still at verify's first visit (same state, same fence as the second)
    is refused once the step went round the loop: the compare-and-set checks the visit.
    A second entry of a visit is refused by the journal's key (G1 per visit)."""
    sid, step = _step(store)
    writer = TransitionWriter(store, "c-1")

    def move(frm: str, to: str, from_visit: int, visit: int, counted: bool) -> Transition:
        return Transition(
            step, sid, frm, 1, to, 1, "", 1,
            from_visit=from_visit, visit=visit,
            visits=f'{{"{to}": {visit}}}' if counted else None,
        )  # fmt: skip

    path = [
        move("initial", "pre-check", 1, 1, False),
        move("pre-check", "retry-flash", 1, 1, True),
        move("retry-flash", "verify", 1, 1, True),
        move("verify", "retry-flash", 1, 2, True),
        move("retry-flash", "verify", 2, 2, True),
    ]
    path[0].from_fence = 0  # (a waiting step is at fence 0; its entry claims 1)
    for t in path:
        got = writer.commit([t], [], 1.0)
        assert not got.rejected, t
    with store.read() as conn:
        row = conn.execute(select(steps.c.state, steps.c.visit).where(steps.c.id == step)).one()
    assert tuple(row) == ("verify", 2)
    # the first visit's outcome, late: same state and fence, another visit
    stale = writer.commit([move("verify", "finish", 1, 1, False)], [], 2.0)
    assert [t.to_state for t in stale.rejected] == ["finish"]
    # retry-flash's second visit entered again: the journal's key refuses it
    again = writer.commit([move("verify", "retry-flash", 2, 2, True)], [], 3.0)
    assert [t.to_state for t in again.rejected] == ["retry-flash"]
    assert writer.commit([move("verify", "retry-flash", 2, 3, True)], [], 4.0).rejected == []
    writer.close()
    with store.read() as conn:
        visits = conn.execute(
            select(journal.c.to_state, journal.c.visit)
            .where(journal.c.step_id == step)
            .order_by(journal.c.id)
        ).all()
    assert [tuple(r) for r in visits][-3:] == [
        ("retry-flash", 2),
        ("verify", 2),
        ("retry-flash", 3),
    ]
    with pytest.raises(IntegrityError), store.write() as conn:
        conn.execute(
            journal.insert().values(
                strategy_id=sid, step_id=step, at=5.0, conductor="x", from_state="verify",
                to_state="retry-flash", fence=1, details="", visit=3,
            )
        )  # fmt: skip
    assert check(store, sid).ok, check(store, sid).violations


# -- fleetwave check ------------------------------------------------------------------

Move = namedtuple("Move", "step_id from_state to_state fence details visit")


def _check_forged(store: Store, moves: list[tuple[str, str, int]]) -> list[str]:
    """Check a journal as one without the unique key would hold it (a restore that lost
    its indexes): the database refuses these rows itself."""
    sid, step = _step(store)
    with store.read() as conn:
        strat = conn.execute(select(strategies).where(strategies.c.id == sid)).one()
        rows = conn.execute(
            select(steps.c.id, steps.c.group_id, steps.c.stage, steps.c.owner)
            .add_columns(targets.c.name, steps.c.visit)
            .join(targets, targets.c.id == steps.c.target_id)
            .where(steps.c.strategy_id == sid)
        ).all()
    Row = namedtuple("Row", "id state group_id stage owner name visit")
    last = moves[-1]
    step_rows = [Row(r.id, last[1], r.group_id, r.stage, None, r.name, last[2]) for r in rows]
    jrows = [Move(step, frm, to, 1, "", visit) for frm, to, visit in moves]
    result = invariants.CheckResult()
    invariants._check_strategy(result, strat, step_rows, jrows)
    return result.violations


ROUND = [
    ("initial", "pre-check", 1),
    ("pre-check", "retry-flash", 1),
    ("retry-flash", "verify", 1),
    ("verify", "retry-flash", 2),
    ("retry-flash", "verify", 2),
]


def test_check_accepts_distinct_visits(store: Store) -> None:
    assert _check_forged(store, ROUND) == []


def test_check_catches_a_visit_entered_twice(store: Store) -> None:
    bad = _check_forged(store, [*ROUND, ("verify", "retry-flash", 2)])
    assert any("entered 'retry-flash' visit 2 more than once" in v for v in bad), bad


def test_check_catches_a_visit_past_max_visits(store: Store) -> None:
    past = [*ROUND, ("verify", "retry-flash", 3), ("retry-flash", "verify", 3)]
    past += [("verify", "retry-flash", 4)]
    bad = _check_forged(store, past)
    assert any("entered 'retry-flash' 4 times (its max_visits is 3)" in v for v in bad), bad


def test_check_catches_a_move_back_the_workflow_does_not_declare(store: Store) -> None:
    back = _check_forged(store, [*ROUND[:3], ("verify", "pre-check", 1)])
    assert any("entered 'pre-check' more than once" in v for v in back), back
    assert any("does not allow: verify -> pre-check" in v for v in back), back


# -- a property over random bounded loops ---------------------------------------------


@st.composite
def loops(draw: st.DrawFn) -> dict[str, Any]:
    """A workflow of 2-5 states with a branch back from state ``hi`` to ``lo`` (on
    failed), every state on the loop with its ``max_visits``; and targets whose
    ``hi`` fails its first N visits (0: every one)."""
    n = draw(st.integers(2, 5))
    lo = draw(st.integers(0, n - 1))
    hi = draw(st.integers(lo, n - 1))
    limits = {i: draw(st.integers(1, 4)) for i in range(lo, hi + 1)}
    fails = draw(st.lists(st.integers(0, 5), min_size=1, max_size=4))
    return {"n": n, "lo": lo, "hi": hi, "limits": limits, "fails": fails}


def _loop_yaml(case: dict[str, Any]) -> str:
    lines = ["name: loop", "states:"]
    for i in range(case["n"]):
        lines.append(f"  - name: s{i}")
        if i in case["limits"]:
            lines.append(f"    max_visits: {case['limits'][i]}")
        if i == case["hi"]:
            lines.append(f"    on: {{failed: s{case['lo']}}}")
    return "\n".join(lines) + "\n"


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=loops())
def test_random_bounded_loops_never_pass_max_visits_and_check_holds(
    case: dict[str, Any],
) -> None:
    wf = parse_workflow_yaml(_loop_yaml(case), strict=True)
    hi = f"s{case['hi']}"
    with tempfile.TemporaryDirectory() as tmp:
        store = open_store(str(Path(tmp) / "fleet.db"))
        try:
            for i, k in enumerate(case["fails"]):
                sim = {"latency_ms": 100, "fail_at": hi, "fail_visits": k}
                admin.add_targets(store, [Target(f"t{i}", settings=sim)])
            sid = admin.create_strategy(store, wf, StrategyOptions(), all_targets=True)
            admin.apply_strategy(store, sid)
            conductor = Conductor(store, clock=LoopClock(), config=EngineConfig(tick_s=1))

            async def go() -> dict[int, str]:
                return await asyncio.wait_for(conductor.run(strategy_ids=[sid]), 1_000_000)

            on_virtual_time(go())
            result = check(store, sid)
            assert result.ok, result.violations
            with store.read() as conn:
                entries = conn.execute(
                    select(targets.c.name, journal.c.to_state, journal.c.visit)
                    .join(steps, steps.c.id == journal.c.step_id)
                    .join(targets, targets.c.id == steps.c.target_id)
                    .where(journal.c.strategy_id == sid)
                    .order_by(journal.c.id)
                ).all()
                ended = dict(
                    conn.execute(
                        select(targets.c.name, steps.c.state)
                        .join(targets, targets.c.id == steps.c.target_id)
                        .where(steps.c.strategy_id == sid)
                    ).all()
                )
        finally:
            store.dispose()
    counts = Counter((name, state) for name, state, _ in entries)
    for (name, state), n in counts.items():
        limit = wf.max_visits.get(state, 1) if state.startswith("s") else 1
        assert n <= limit, (name, state, n, limit)
        seen = [v for who, s, v in entries if (who, s) == (name, state)]
        assert seen == list(range(1, n + 1))  # each visit once, in order
    most = min(wf.max_visits.values())  # (each round enters every state on the loop)
    for i, k in enumerate(case["fails"]):
        # it passes once hi's visit k + 1 comes, if the loop allows that many rounds
        want = "complete" if 0 < k < most else "failed"
        assert ended[f"t{i}"] == want, (case, i, k)


@pytest.mark.both_dialects
def test_a_takeover_mid_loop_goes_on_from_the_visit_on_the_row(store: Store) -> None:
    """The conductor dies just after committing retry-flash's second visit (its action
    never reached the target). The next owner reads the visits from the step's row: it
    re-sends that visit's operation as its attempt 2 (on the record, per visit), and
    the loop still stops at max_visits, counting the visits before the takeover."""
    wf = parse_workflow_yaml(FLASH, strict=True)
    admin.add_targets(
        store,
        [
            Target("flaky", settings={"fail_at": "verify", "fail_visits": 2}),
            Target("broken", settings={"fail_at": "verify"}),
        ],
    )
    sid = admin.create_strategy(store, wf, StrategyOptions(), all_targets=True)
    admin.apply_strategy(store, sid)
    sim = SimDriver()

    def crash(point: str) -> None:
        if point != "after-commit":
            return
        with store.read() as conn:
            at = conn.execute(
                select(steps.c.state, steps.c.visit).where(steps.c.strategy_id == sid)
            ).all()
        if ("retry-flash", 2) in [tuple(r) for r in at]:
            raise SimulatedCrash(point)

    async def go() -> dict[int, str]:
        first = Conductor(store, drivers={"sim": sim}, crash_hook=crash)
        with pytest.raises(SimulatedCrash):
            await first.run(strategy_ids=[sid])
        with store.write() as conn:  # its lease ran out
            conn.execute(
                update(strategies).where(strategies.c.id == sid).values(lease_expires_at=1.0)
            )
        second = Conductor(store, drivers={"sim": sim}, config=EngineConfig(tick_s=0.05))
        return await asyncio.wait_for(second.run(strategy_ids=[sid]), 60)

    assert asyncio.run(go()) == {sid: "failed"}
    ended = {s["target"]: s for s in queries.list_steps(store, sid)}
    assert ended["flaky"]["state"] == "complete"  # verify's third visit passed
    assert ended["broken"]["state"] == "failed"
    assert (
        "retry-flash would be entered a 4th time: its max_visits is 3"
        in (ended["broken"]["details"])
    )
    rows = queries.history(store, sid)
    resent = [r for r in rows if r["details"].startswith("attempt 2: re-sent")]
    assert {(r["to"], r["visit"]) for r in resent} == {("retry-flash", 2)}
    flaky = [(r["to"], r["visit"]) for r in rows if r["target"] == "flaky" and "attempt" not in r]
    assert flaky.count(("verify", 3)) == 1 and ("verify", 4) not in flaky
    result = check(store, sid)
    assert result.ok, result.violations
