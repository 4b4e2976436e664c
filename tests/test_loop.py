"""Which event loop drives a conductor (FLEETWAVE_LOOP), and that both drive it correctly."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import pytest

from cli_harness import Cli
from conftest import add_sim_targets, applied
from fleetwave.engine import loop as event_loop
from fleetwave.engine.conductor import Conductor
from fleetwave.store import queries
from fleetwave.store.db import Store
from fleetwave.testing.invariants import check
from test_cli_strategy import add, apply_wait, create, strategies


def test_loop_choice_follows_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLEETWAVE_LOOP", "asyncio")
    assert event_loop.loop_kind() == "asyncio"
    monkeypatch.setenv("FLEETWAVE_LOOP", "uvloop")
    assert event_loop.loop_kind() == "uvloop"  # a test dependency on Linux
    monkeypatch.setenv("FLEETWAVE_LOOP", "")
    assert event_loop.loop_kind() == "uvloop"
    monkeypatch.setenv("FLEETWAVE_LOOP", "tokio")
    with pytest.raises(event_loop.LoopChoiceError, match="unknown event loop 'tokio'"):
        event_loop.loop_kind()


@pytest.mark.parametrize("kind", ["asyncio", "uvloop"])
def test_a_rollout_completes_on_either_loop(
    kind: str, store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FLEETWAVE_LOOP", kind)
    add_sim_targets(store, 40, settings={"latency_ms": 2, "failure_rate": 0.1})
    sid = applied(store, "patch", max_parallel=8)
    seen: list[str] = []

    async def go() -> dict[int, str]:
        seen.append(type(asyncio.get_running_loop()).__module__)
        return await Conductor(store).run(strategy_ids=[sid])

    final = event_loop.run(go())[sid]
    assert seen[0].startswith(kind)
    assert final == "failed"  # some targets fail at random (seeded)
    counts = queries.step_counts(store, sid)
    assert set(counts) <= {"complete", "failed"} and sum(counts.values()) == 40
    assert check(store, sid).ok


def test_an_unknown_loop_is_refused_before_anything_runs(
    cli: Cli, monkeypatch: pytest.MonkeyPatch
) -> None:
    add(cli, "a", "b")
    sid = create(cli, "--all")
    monkeypatch.setenv("FLEETWAVE_LOOP", "tokio")
    res = apply_wait(cli, sid)
    assert res.code == 2
    assert "FLEETWAVE_LOOP: unknown event loop 'tokio'" in res.text
    assert next(s for s in strategies(cli) if s["id"] == sid)["state"] == "initial"


@pytest.mark.parametrize("kind", ["asyncio", "uvloop"])
def test_operations_ending_together_share_commits_on_either_loop(
    kind: str, store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """200 operations of 20 ms at once, five states each: they end in waves, and each
    wave must go to the database in a few group commits. On asyncio's own loop (a clock
    without millisecond grain) the sim driver used to wake one operation per loop turn,
    and every transition was committed alone (6,000 commits for 6,000 transitions)."""
    monkeypatch.setenv("FLEETWAVE_LOOP", kind)
    add_sim_targets(store, 200, settings={"latency_ms": 20})
    sid = applied(store, "patch", max_parallel=200)
    c = Conductor(store)
    assert event_loop.run(c.run(strategy_ids=[sid]))[sid] == "complete"
    assert c.stats.transitions == 200 * 6
    assert c.stats.batches < c.stats.transitions / 5, (c.stats.batches, c.stats.transitions)


@pytest.mark.parametrize("kind", ["uvloop", "asyncio"])
def test_a_task_that_will_not_end_when_cancelled_does_not_hold_the_exit(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, kind: str
) -> None:
    """asyncio.run waited for every task left over, for good: a `serve` that had
    stopped cleanly and handed its leases back never exited while an action that
    catches CancelledError ran (bug hunt)."""
    monkeypatch.setenv("FLEETWAVE_LOOP", kind)
    monkeypatch.setattr(event_loop, "LEFTOVER_GRACE_S", 0.2)

    async def stubborn() -> None:
        while True:
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.Event().wait()

    async def polite() -> None:
        await asyncio.sleep(3600)

    async def main() -> int:
        asyncio.get_running_loop().create_task(stubborn())
        asyncio.get_running_loop().create_task(polite())
        await asyncio.sleep(0.05)
        return 42

    t0 = time.monotonic()
    assert event_loop.run(main()) == 42
    assert time.monotonic() - t0 < 5
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == [
        "1 task(s) did not end when cancelled (an action catches CancelledError): left "
        "behind after 0.2s, the loop closed under them"
    ]
    event_loop._ABANDONED.clear()  # (its coroutine is closed when collected)
