"""What a step's row, events and callbacks say: retries and their attempts, a conductor
gone, failed attempts kept as events, a callback kept for a state not reached yet."""

from __future__ import annotations

import asyncio
import sqlite3
from datetime import datetime
from pathlib import Path

from sqlalchemy import update
from sqlalchemy.exc import OperationalError

from cli_harness import Cli, assert_rejected
from conftest import add_sim_targets, applied, on_virtual_time
from fleetwave.api.callbacks import CALLBACK_REFUSED
from fleetwave.domain.models import StrategyOptions
from fleetwave.domain.registry import register_workflow
from fleetwave.domain.workflow import (
    ActionContext,
    Advance,
    Outcome,
    StateAction,
    StateDef,
    TransientError,
    WorkflowDef,
)
from fleetwave.engine.clock import LoopClock, WallClock
from fleetwave.engine.conductor import Conductor
from fleetwave.engine.config import EngineConfig
from fleetwave.store import admin, queries
from fleetwave.store.db import Store
from fleetwave.store.leases import host_lease_now
from fleetwave.store.schema import conductors, strategies
from fleetwave.store.schema import steps as step_table
from test_cli_strategy import add, apply_wait, create, history, steps


def test_a_step_waiting_to_retry_shows_why_and_which_attempt_comes(store: Store) -> None:
    """Between two attempts the step's row says what failed and which attempt comes
    (it showed attempt 0 and no details until the state ended); the state's recorded
    deadline is the next attempt's."""

    seen: list[dict[str, object]] = []

    class Busy(StateAction):
        """Busy twice, then done; each attempt after the first first reads the row."""

        async def run(self, ctx: ActionContext) -> Outcome:
            if ctx.attempt > 1:
                seen.append(dict(queries.list_steps(store, ctx.strategy_id)[0]))
            if ctx.attempt < 3:
                raise TransientError(f"target busy ({ctx.attempt})")
            return Advance()

    wf = register_workflow(
        WorkflowDef(
            "busy-then-done",
            (StateDef("install", Busy(), timeout_s=600, attempts_max=3, backoff_s=40),),
        ),
        replace=True,
    )
    add_sim_targets(store, 1)
    sid = admin.create_strategy(store, wf, StrategyOptions(), all_targets=True)
    admin.apply_strategy(store, sid)

    async def main() -> dict[int, str]:
        return await Conductor(store, clock=LoopClock()).run(strategy_ids=[sid])

    assert on_virtual_time(main())[sid] == "complete"

    assert [(s["state"], s["attempt"]) for s in seen] == [("install", 2), ("install", 3)]
    first, second = (str(s["details"]) for s in seen)
    # read while the attempt runs: started, not "from" a time now past (an on-call
    # operator took that for a retry still to come)
    assert first.startswith("install: target busy (1) (attempt 1 of 3); attempt 2 started ")
    assert second.startswith("install: target busy (2) (attempt 2 of 3); attempt 3 started ")
    due = [datetime.strptime(d[-20:], "%Y-%m-%d %H:%M:%SZ") for d in (first, second)]
    assert (due[1] - due[0]).total_seconds() == 80  # 40 s backoff, then 80 s
    done = queries.list_steps(store, sid)[0]
    assert (done["state"], done["attempt"]) == ("complete", 3)
    assert done["details"] == "install: done at attempt 3"
    # the failed attempts are kept as events (the row's details are overwritten)
    kept = [
        e for e in queries.get_step(store, done["step"])["events"] if e["kind"] == "attempt-failed"
    ]
    assert [str(e["details"]).split("; ")[0] for e in kept] == [
        "install: target busy (1) (attempt 1 of 3)",
        "install: target busy (2) (attempt 2 of 3)",
    ]
    assert str(kept[0]["details"]).endswith(first[-20:].replace("started", "from"))


def test_a_state_entered_after_retries_counts_its_own_attempts(store: Store) -> None:
    """The step's attempt is its current state's: entering the next state after the
    first took three attempts shows attempt 1 (it showed 3); the journal keeps that
    the first state needed three."""

    seen: list[tuple[str, int]] = []

    class BusyTwice(StateAction):
        async def run(self, ctx: ActionContext) -> Outcome:
            if ctx.attempt < 3:
                raise TransientError("target busy")
            return Advance()

    class Look(StateAction):
        async def run(self, ctx: ActionContext) -> Outcome:
            row = queries.list_steps(store, ctx.strategy_id)[0]
            seen.append((str(row["state"]), int(row["attempt"])))
            return Advance()

    wf = register_workflow(
        WorkflowDef(
            "busy-then-look",
            (
                StateDef("install", BusyTwice(), attempts_max=3, backoff_s=5),
                StateDef("verify", Look()),
            ),
        ),
        replace=True,
    )
    add_sim_targets(store, 1)
    sid = admin.create_strategy(store, wf, StrategyOptions(), all_targets=True)
    admin.apply_strategy(store, sid)

    async def main() -> dict[int, str]:
        return await Conductor(store, clock=LoopClock()).run(strategy_ids=[sid])

    assert on_virtual_time(main())[sid] == "complete"
    assert seen == [("verify", 1)]
    moves = [(h["from"], h["to"], h["details"]) for h in queries.history(store, sid)]
    assert moves == [
        ("initial", "install", ""),
        ("install", "verify", "install: done at attempt 3"),
        ("verify", "complete", ""),
    ]
    assert queries.list_steps(store, sid)[0]["attempt"] == 1  # verify's one attempt


def test_a_retry_starts_only_once_the_row_names_it(store: Store) -> None:
    """Found by review: a retry started after its backoff even when the dispatcher had
    not recorded it on the step's row yet (its commit retried through a database
    outage), so a takeover then would look at the attempt before, and give the state
    one attempt too many. It waits for the record now."""

    seen: list[tuple[int, int, float]] = []

    class BusyOnce(StateAction):
        async def run(self, ctx: ActionContext) -> Outcome:
            now = asyncio.get_running_loop().time()
            seen.append((ctx.attempt, int(queries.get_step(store, ctx.step_id)["attempt"]), now))
            if ctx.attempt == 1:
                await asyncio.sleep(2)
                raise TransientError("busy")
            return Advance()

    wf = register_workflow(
        WorkflowDef("busy-once", (StateDef("a", BusyOnce(), attempts_max=3, backoff_s=1),)),
        replace=True,
    )
    add_sim_targets(store, 1)
    sid = admin.create_strategy(store, wf, StrategyOptions(), all_targets=True)
    admin.apply_strategy(store, sid)

    def locked() -> None:
        raise OperationalError("BEGIN", None, Exception("database is locked (injected)"))

    async def main() -> dict[int, str]:
        loop = asyncio.get_running_loop()
        loop.call_later(1, setattr, store, "write_fault", locked)  # out from 1 s to 12 s
        loop.call_later(12, setattr, store, "write_fault", None)
        return await Conductor(store, clock=LoopClock()).run(strategy_ids=[sid])

    assert on_virtual_time(main())[sid] == "complete"
    (first, second) = seen
    assert first[:2] == (1, 1)
    assert second[:2] == (2, 2) and second[2] >= 12  # after the record went through


def test_step_list_says_what_an_in_flight_step_without_details_is_doing(
    store: Store,
) -> None:
    """A step whose conductor was interrupted showed its state and empty details: not
    whether anything ran it, nor what happens next."""
    add_sim_targets(store, 2, settings={"latency_ms": 60_000})
    sid = applied(store, "patch", max_parallel=2)
    c = Conductor(store, config=EngineConfig(tick_s=0.05))

    def details() -> set[str]:
        return {s["details"] for s in queries.list_steps(store, sid)}

    async def killed_mid_action() -> set[str]:
        task = asyncio.create_task(c.run(strategy_ids=[sid]))
        for _ in range(500):
            await asyncio.sleep(0.01)
            if all(s["state"] == "pre-check" for s in queries.list_steps(store, sid)):
                break
        running = details()
        task.cancel()  # killed: its leases are left to run out
        await asyncio.gather(task, return_exceptions=True)
        return running

    assert asyncio.run(killed_mid_action()) == {f"running on conductor {c.id}"}
    # step show says the same as step list
    first = queries.list_steps(store, sid)[0]
    assert queries.get_step(store, first["step"])["details"] == first["details"]
    with store.write() as conn:  # its conductor is known gone before its lease runs out
        conn.execute(update(conductors).values(stopped_at=1.0))
    (gone_early,) = details()
    assert gone_early.startswith(f"its conductor {c.id} is gone (its process ended); "), gone_early
    with store.write() as conn:
        conn.execute(update(conductors).values(stopped_at=None))
    with store.write() as conn:  # its lease (its strategy's) ran out meanwhile
        conn.execute(update(strategies).values(lease_expires_at=host_lease_now() - 600))
    (gone,) = details()
    assert gone.startswith(f"its conductor {c.id} is gone (its lease ran out at 20"), gone
    assert gone.endswith(
        "the step is taken over when a conductor drives the strategy again (serve, or "
        "strategy apply --wait), and its state's recover setting decides what became of the "
        "action (look at the target, or fail the step: 'fleetwave workflow show' says which)"
    ), gone
    with store.write() as conn:  # handed back (a clean stop) while the action ran
        conn.execute(update(step_table).values(owner=None))
    assert details() == {
        "interrupted (its conductor stopped); the step is taken over when a conductor "
        "drives the strategy again (serve, or strategy apply --wait), and its state's "
        "recover setting decides what became of the action (look at the target, or fail "
        "the step: 'fleetwave workflow show' says which)"
    }
    with store.write() as conn:  # entered while its conductor was stopping
        conn.execute(update(step_table).values(not_started=True))
    assert details() == {
        "entered, its action not started: it starts when a conductor drives the "
        "strategy again (serve, or strategy apply --wait)"
    }
    with store.write() as conn:  # entered while its live conductor is stopping
        conn.execute(update(step_table).values(owner=c.id))
        conn.execute(update(strategies).values(lease_expires_at=host_lease_now() + 600))
    assert details() == {
        f"entered while conductor {c.id} was stopping; its action starts when a "
        "conductor drives the strategy again (serve, or strategy apply --wait)"
    }
    with store.write() as conn:
        conn.execute(update(step_table).values(owner=None))
    with store.write() as conn:  # ... with the details of the move into it
        conn.execute(update(step_table).values(details="pre-check: done at attempt 2"))
    assert details() == {
        "entered, its action not started: it starts when a conductor drives the "
        "strategy again (serve, or strategy apply --wait) (pre-check: done at attempt 2)"
    }


def test_a_step_whose_conductor_is_gone_says_so_before_what_its_row_said(
    cli: Cli, db_path: Path
) -> None:
    """After a kill -9, most in-flight steps said "its conductor ... is gone", but one
    whose row had details (its last state's "done at attempt 2", or a retry's time now
    past) showed only those, as if it were running."""
    add(cli, "a", "b")
    sid = create(cli, "--all")
    assert cli("strategy", "apply", str(sid)).code == 0
    said = "pre-check: timed out after 40s (attempt 1 of 3); attempt 2 from 2026-12-01 13:20:42Z"
    with sqlite3.connect(db_path) as db:
        db.execute(
            "UPDATE steps SET state='pre-check', owner='c-dead', "
            "attempt=2, not_started=0, details=? WHERE strategy_id=?",
            (said, sid),
        )
        db.execute(
            "INSERT INTO conductors (id, hostname, pid, started_at, heartbeat_at, "
            "lease_clock) VALUES ('c-dead', 'elsewhere', 1, 0, 0, ?)",
            (WallClock.lease_clock,),
        )
        db.execute(
            "UPDATE strategies SET owner='c-dead', lease_expires_at=? WHERE id=?",
            (host_lease_now() - 30, sid),
        )
    for row in steps(cli, sid).values():
        assert row["details"].startswith("its conductor c-dead is gone (its lease ran out at ")
        assert row["details"].endswith(f"'fleetwave workflow show' says which) ({said})")


FLAKY_YAML = """\
name: flaky-once
states:
  - name: install
    timeout_s: 30
    retry: {attempts: 3, backoff_s: 0.01, backoff_max_s: 0.02}
"""


def test_failed_attempts_are_kept_as_events_and_listed(cli: Cli, tmp_path: Path) -> None:
    """A timeout or a transient failure that a retry got past left nothing once the
    step went on (the row's details are overwritten): each failed attempt is an
    `attempt-failed` event, listed by `fleetwave events` with claims and takeovers."""
    wf = tmp_path / "flaky.yaml"
    wf.write_text(FLAKY_YAML, encoding="utf-8")
    assert cli("workflow", "add", str(wf)).code == 0
    add(cli, "steady")
    add(cli, "shaky", flaky_rate="1.0")  # every attempt fails for now: 3 of 3
    res = cli("strategy", "create", "--workflow", "flaky-once", "--all", "--format", "json")
    sid = int(res.json()["id"])
    assert apply_wait(cli, sid).code == 1
    res = cli("events", "--strategy", str(sid), "--format", "json")
    assert res.code == 0, res.text
    rows = res.json()
    assert [r["kind"] for r in rows] == ["strategy-claimed", "attempt-failed", "attempt-failed"]
    failed = rows[1:]
    assert {(r["target"], r["strategy"]) for r in failed} == {("shaky", sid)}
    assert [r["details"].split("; ")[0] for r in failed] == [
        "install: target busy (simulated) (attempt 1 of 3)",
        "install: target busy (simulated) (attempt 2 of 3)",
    ]
    assert all("; attempt " in r["details"] and " from " in r["details"] for r in failed)
    only = cli("events", "--strategy", str(sid), "--kind", "attempt-failed", "--last", "1")
    assert only.code == 0 and "attempt 2 of 3" in only.out and "claimed" not in only.out
    steady = cli("events", "--strategy", str(sid), "--target", "steady", "--format", "json")
    assert steady.json() == []
    assert_rejected(
        cli("events", "--strategy", str(sid), "--kind", "attempt-failed,nope"),
        "--kind: 'nope' is not a kind of event",
    )
    assert_rejected(cli("events", "--strategy", "99"), "strategy 99 not found")
    # the journal's rows name their strategy, as a step's row does
    assert {r["strategy"] for r in history(cli, sid)} == {sid}


def test_every_kind_of_event_written_can_be_asked_for() -> None:
    """`events --kind transition-rejected` was refused although the engine writes such
    events: the kinds `--kind` takes are every hyphenated word the store and the
    engine write as an event's kind (the words below are not kinds)."""
    import re

    src = Path(queries.__file__).parents[2]
    words: set[str] = set()
    for path in (
        *sorted((src / "store/runtime").glob("*.py")),
        src / "store/writer.py",
        src / "domain/rollout.py",  # (the kind `strategy approve` writes)
        *sorted((src / "engine").glob("*.py")),
    ):
        text = path.read_text(encoding="utf-8")
        words |= set(re.findall(r"[\"']([a-z]+(?:-[a-z]+)+)[\"']", text))
    not_kinds = {
        "wait-for-callback",  # a state's mode
        "before-commit",  # crash points of the tests
        "after-commit",
        "not-drivable-here",  # what run() says of a strategy
        "fleetwave-periodic",  # tasks' names
        "fleetwave-callback-watch",
    }
    # (and those the REST API writes: who made a change, a callback refused)
    api_kinds = {admin.CHANGE_BY, CALLBACK_REFUSED}
    assert words - not_kinds == set(queries.EVENT_KINDS) - api_kinds
    assert api_kinds <= set(queries.EVENT_KINDS)


def test_a_callback_for_a_state_the_step_has_not_reached_says_it_is_kept(
    cli: Cli, tmp_path: Path
) -> None:
    """An operator walkthrough: a `done` callback for clean-steps sent while the step
    was still in wait-for-agent was answered "stored; the conductor answers it", then
    moved the step through clean-steps at once. Such a report is kept for the state
    (an agent's report can overtake the step's move); the answer now says so."""
    wf = tmp_path / "agent.yaml"
    wf.write_text(
        "name: agent-wf\nstates:\n  - name: prep\n  - name: wait-agent\n"
        "    mode: wait-for-callback\n    timeout_s: 60\n  - name: last\n",
        encoding="utf-8",
    )
    assert cli("workflow", "add", str(wf)).code == 0
    add(cli, "a")
    res = cli("strategy", "create", "--workflow", "agent-wf", "--all", "--format", "json")
    sid = int(res.json()["id"])
    (step,) = cli("step", "list", "--strategy", str(sid), "--format", "json").json()
    # a step not under way yet keeps nothing (its conductor ignores such a report): not
    # said to be kept
    early = cli("step", "callback", str(step["step"]), "wait-agent")
    assert early.code == 0 and "kept" not in early.out and "stored;" in early.out, early.out
    with sqlite3.connect(tmp_path / "fleet.db") as db:
        db.execute("UPDATE steps SET state='prep', fence=1 WHERE id=?", (step["step"],))
    kept = cli("step", "callback", str(step["step"]), "wait-agent")
    assert kept.code == 0, kept.err
    assert kept.out.strip() == (
        f"callback 2 for step {step['step']} (wait-agent, done) stored and kept: the step is "
        "in prep, before wait-agent; it counts once the step reaches wait-agent, and is "
        "ignored if the step ends first"
    )
    # a state that waits for no callback: the conductor ignores it, no "kept"
    plain = cli("step", "callback", str(step["step"]), "last")
    assert plain.code == 0 and "kept" not in plain.out and "stored;" in plain.out, plain.out
