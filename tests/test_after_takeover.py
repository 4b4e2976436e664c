"""Telling the truth after a takeover: an operation a recover hook finds the target never
got is sent again as the next attempt, recorded before it is sent (``history``:
"attempt 2: re-sent after takeover"); and a step waiting for its target's callback
shows so, with its deadline, not as running."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
from sqlalchemy import insert, select, update

from cli_harness import Cli
from conftest import add_sim_targets, applied
from fleetwave.drivers.sim import SimDriver
from fleetwave.engine.conductor import Conductor
from fleetwave.store import queries
from fleetwave.store.db import Store, open_store
from fleetwave.store.schema import attempts, conductors, journal, steps, strategies
from fleetwave.testing.invariants import check

RESENT = "attempt 2: re-sent after takeover (the target did not have it)"


def _left_by_a_ghost(store: Store, sid: int, path: list[str], *, lease_s: float) -> Conductor:
    """Step 1 entered ``path``'s last state by conductor "ghost" on another host, which
    died before sending it (the target never got it); its lease lasts ``lease_s``.
    Returns a conductor of this database (its clock is the leases')."""
    here = Conductor(store)
    with store.write() as conn:
        conn.execute(
            insert(conductors).values(
                id="ghost",
                hostname="elsewhere",
                pid=1,
                started_at=0,
                heartbeat_at=time.time(),
                lease_clock=here.clock.lease_clock,
            )
        )
        conn.execute(
            update(strategies).values(
                owner="ghost", fence=1, lease_expires_at=here.clock.lease_now() + lease_s
            )
        )
        conn.execute(
            update(steps)
            .where(steps.c.id == 1)
            .values(
                state=path[-1],
                owner="ghost",
                fence=3,
                attempt=1,
                started_at=time.time(),
                deadline_at=time.time() + 1800,
            )
        )
        for frm, to in zip(["initial", *path], path, strict=False):
            conn.execute(  # as the ghost journalled it (G9)
                insert(journal).values(
                    strategy_id=sid,
                    step_id=1,
                    at=time.time(),
                    conductor="ghost",
                    from_state=frm,
                    to_state=to,
                    fence=3,
                    details="",
                )
            )
    return here


@pytest.mark.both_dialects
def test_an_operation_the_target_never_got_is_resent_as_attempt_2_on_the_record(
    store: Store,
) -> None:
    add_sim_targets(store, 2)
    sid = applied(store, "patch", max_parallel=2)
    _left_by_a_ghost(store, sid, ["pre-check", "updating-patches"], lease_s=-1)
    sim = SimDriver()
    sim.count_starts = True
    result = asyncio.run(Conductor(store, drivers={"sim": sim}).run(strategy_ids=[sid]))
    assert result[sid] == "complete"
    with store.read() as conn:
        rows = conn.execute(
            select(attempts.c.step_id, attempts.c.state, attempts.c.attempt, attempts.c.how)
        ).all()
    assert [tuple(r) for r in rows] == [(1, "updating-patches", 2, "resent")]
    # the target got it once, as attempt 2 (attempt 1 never reached it)
    assert sim.starts[("t00000", "updating-patches", 2)] == 1
    assert ("t00000", "updating-patches", 1) not in sim.starts
    said = [(h["from"], h["to"], h["details"]) for h in queries.history(store, sid, "t00000")]
    entry = said.index(("pre-check", "updating-patches", ""))
    assert said[entry + 1] == ("updating-patches", "updating-patches", RESENT)
    assert [
        a["how"] for a in queries.step_attempts(store, 1) if a["state"] == "updating-patches"
    ] == [
        "entry",
        "resent",
    ]
    result_check = check(store)
    assert result_check.ok, result_check.violations
    # the other target's history has no attempt rows: nothing was sent twice there
    assert all("attempt" not in h for h in queries.history(store, sid, "t00001"))


def test_history_on_the_command_line_says_attempt_2_re_sent_after_takeover(
    cli: Cli, db_path: Path
) -> None:
    store = open_store(str(db_path))
    add_sim_targets(store, 1)
    sid = applied(store, "patch")
    _left_by_a_ghost(store, sid, ["pre-check"], lease_s=-1)
    assert asyncio.run(Conductor(store).run(strategy_ids=[sid]))[sid] == "complete"
    store.dispose()
    res = cli("history", "--strategy", str(sid))
    assert res.code == 0, res.text
    lines = res.out.splitlines()
    at = next(i for i, line in enumerate(lines) if RESENT.split(" (")[0] in line)
    assert "initial" in lines[at - 1] and "pre-check" in lines[at - 1]  # right after entry
    rows = cli("history", "--strategy", str(sid), "--format", "json").json()
    assert [r.get("attempt") for r in rows if "attempt" in r] == [2]
    assert cli("check").code == 0


def test_a_step_waiting_for_its_callback_says_so_with_its_deadline(cli: Cli, db_path: Path) -> None:
    store = open_store(str(db_path))
    add_sim_targets(store, 2)
    sid = applied(store, "clean", max_parallel=2)
    _left_by_a_ghost(  # alive, its lease running: it drives the strategy
        store, sid, ["power-off", "set-boot-network", "power-on", "wait-for-agent"], lease_s=600
    )
    with store.write() as conn:  # the other one runs power-off on the ghost
        conn.execute(
            update(steps)
            .where(steps.c.id == 2)
            .values(state="power-off", owner="ghost", fence=3, deadline_at=time.time() + 300)
        )
        conn.execute(
            insert(journal).values(
                strategy_id=sid,
                step_id=2,
                at=time.time(),
                conductor="ghost",
                from_state="initial",
                to_state="power-off",
                fence=3,
                details="",
            )
        )
        until = conn.execute(select(steps.c.deadline_at).where(steps.c.id == 1)).scalar_one()
    store.dispose()
    shown_until = time.strftime("%Y-%m-%d %H:%M:%SZ", time.gmtime(until))

    listed = {
        s["target"]: s["details"]
        for s in cli("step", "list", "--strategy", str(sid), "--format", "json").json()
    }
    assert listed["t00000"] == f"waiting for callback until {shown_until} (on conductor ghost)"
    assert listed["t00001"] == "running on conductor ghost"
    step = cli("step", "show", "1", "--format", "json").json()
    assert step["details"].startswith("waiting for callback until")
    assert step["deadline_at"] == until
    shown = cli("strategy", "show", str(sid), "--format", "json").json()
    assert shown["in_flight"] == 2 and shown["waiting_for_callback"] == 1
    assert shown["waiting_for_callback_until"] == until
    table = cli("step", "list", "--strategy", str(sid))
    assert "waiting for callback until" in table.out and "running on" in table.out
