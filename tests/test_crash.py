"""Crash recovery with a real process: kill -9 mid-rollout, resume from the database alone."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from sqlalchemy import func, select

from conftest import add_sim_targets
from fleetwave.domain.models import StrategyOptions
from fleetwave.domain.registry import get_workflow
from fleetwave.store import admin, queries
from fleetwave.store.db import open_store
from fleetwave.store.schema import journal, steps
from fleetwave.testing.invariants import check

FLEETWAVE = [sys.executable, "-m", "fleetwave.cli.main"]


def _in_flight(db: str) -> int:
    store = open_store(db)
    try:
        with store.read() as conn:
            return int(
                conn.execute(
                    select(func.count()).where(
                        steps.c.state.not_in(["initial", "complete", "failed", "aborted"])
                    )
                ).scalar_one()
            )
    finally:
        store.dispose()


@pytest.mark.both_dialects
def test_kill_9_mid_rollout_then_apply_wait_resumes_without_reentry(db_url: str) -> None:
    db = db_url
    store = open_store(db)
    add_sim_targets(store, 300, settings={"latency_ms": 40})
    wf = get_workflow("patch")
    assert wf is not None
    sid = admin.create_strategy(store, wf, StrategyOptions(max_parallel=30), all_targets=True)
    store.dispose()

    cmd = [*FLEETWAVE, "strategy", "apply", str(sid), "--wait", "--format", "json", "--db", db]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and _in_flight(db) < 10:
        time.sleep(0.05)
    time.sleep(0.3)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)
    lost = _in_flight(db)
    assert lost > 0, "the kill should land mid-rollout"

    started = time.monotonic()
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    # The dead process is on this host: its leases are broken at once, not after the TTL.
    assert time.monotonic() - started < 25

    store = open_store(db)
    assert queries.get_strategy(store, sid)["state"] == "complete"
    events = queries.strategy_events(store, sid)
    taken = [e for e in events if e["kind"] == "step-taken-over"]
    assert len(taken) == lost
    with store.read() as conn:
        dup = conn.execute(
            select(journal.c.step_id)
            .group_by(journal.c.step_id, journal.c.to_state)
            .having(func.count() > 1)
        ).all()
    assert dup == []
    result = check(store, sid)
    assert result.ok, result.violations
    store.dispose()
