"""On SQLite at ``synchronous=FULL``, the engine's group commits and the API's callback
batches commit without syncing under the write lock and sync the WAL right after it
(``Store.write_then_sync``): nobody acts on such a commit before that sync (no action
starts, no 202 is sent), the lock is free while it is made, and every connection goes
back to the pool syncing its commits again."""

from __future__ import annotations

import asyncio
import os
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import select, text

from fleetwave import ActionContext, Advance, Outcome, StateAction
from fleetwave.api import intake
from fleetwave.api.service import Service
from fleetwave.domain import registry
from fleetwave.domain.models import StrategyOptions, Target
from fleetwave.domain.registry import register_workflow
from fleetwave.domain.workflow import StateDef, WorkflowDef
from fleetwave.engine.conductor import Conductor
from fleetwave.store import admin, db, tokens
from fleetwave.store.callbacks import report
from fleetwave.store.db import Store, open_store
from fleetwave.store.schema import callbacks
from fleetwave.testing.invariants import check

FULL = 2  # (PRAGMA synchronous's answer for FULL)


class Syncs:
    """Stands for the WAL's sync: notes, when called, the highest journal row then
    committed and whether another connection could take SQLite's write lock."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.journal_upto: list[int] = []
        self.lock_free: list[bool] = []
        self.calls = 0

    def __call__(self, fd: int) -> None:
        self.calls += 1
        other = sqlite3.connect(self.path, timeout=0, isolation_level=None)
        try:
            (upto,) = other.execute("SELECT coalesce(max(id), 0) FROM journal").fetchone()
            self.journal_upto.append(upto)
            try:
                other.execute("BEGIN IMMEDIATE")
                other.execute("ROLLBACK")
                self.lock_free.append(True)
            except sqlite3.OperationalError:
                self.lock_free.append(False)
        finally:
            other.close()


@pytest.fixture
def full(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Store, Syncs]]:
    path = str(tmp_path / "synced.db")
    store = open_store(path)  # (synchronous=FULL: the default)
    syncs = Syncs(path)
    monkeypatch.setattr(db, "_datasync", syncs)
    try:
        yield store, syncs
    finally:
        store.dispose()


class NotesWhatWasSynced(StateAction):
    """An action that, as it starts, notes its own transition's journal row and the
    highest row synced by then."""

    def __init__(self) -> None:
        self.path = ""
        self.syncs: Syncs | None = None
        self.seen: list[tuple[int, int]] = []

    async def run(self, ctx: ActionContext) -> Outcome:
        assert self.syncs is not None
        with sqlite3.connect(self.path) as conn:
            (mine,) = conn.execute(
                "SELECT max(id) FROM journal WHERE step_id = ?", (ctx.step_id,)
            ).fetchone()
        self.seen.append((mine, max(self.syncs.journal_upto, default=0)))
        return Advance()


NOTES = NotesWhatWasSynced()
WORKFLOW = WorkflowDef(
    "synced-commits-test",
    (StateDef("one", NOTES, timeout_s=60), StateDef("two", NOTES, timeout_s=60)),
)


@pytest.fixture(autouse=True)
def _registered() -> Iterator[None]:
    register_workflow(WORKFLOW, replace=True)
    NOTES.seen.clear()
    try:
        yield
    finally:
        registry._workflows.pop(WORKFLOW.name, None)


def test_no_action_starts_before_the_commit_that_started_it_is_synced(
    full: tuple[Store, Syncs],
) -> None:
    store, syncs = full
    NOTES.path, NOTES.syncs = store.url, syncs
    admin.add_targets(store, [Target(f"t{i}", "sim") for i in range(60)])
    sid = admin.create_strategy(store, WORKFLOW, StrategyOptions(max_parallel=20), all_targets=True)
    admin.apply_strategy(store, sid)
    result = asyncio.run(Conductor(store).run(strategy_ids=[sid]))
    assert result[sid] == "complete"
    assert len(NOTES.seen) == 120  # each step's two states
    # each action's own transition was on disk before it started
    late = [(mine, synced) for mine, synced in NOTES.seen if synced < mine]
    assert not late, late
    # the syncs were made with SQLite's write lock free (outside the writers' turn)
    assert syncs.calls >= 1 and all(syncs.lock_free), syncs.lock_free
    assert check(store).ok
    # and every connection back in the pool syncs its commits
    with store.read() as conn:
        assert conn.execute(text("PRAGMA synchronous")).scalar_one() == FULL


def _arrivals(store: Store, n: int) -> list[intake.Arrival]:
    admin.add_targets(store, [Target(f"a{i}", "sim") for i in range(n)])
    sid = admin.create_strategy(store, WORKFLOW, StrategyOptions(), all_targets=True)
    agents = [tokens.new_secret(tokens.AGENT_PREFIX) for _ in range(n)]
    with store.read() as conn:
        step_ids = [r[0] for r in conn.execute(text("SELECT id FROM steps ORDER BY id")).fetchall()]
    tokens.issue_agent_tokens(
        store,
        [
            (sid, s, "one", tokens.token_hash(t), 0.0, None)
            for s, t in zip(step_ids, agents, strict=True)
        ],
    )
    return [
        intake.Arrival(report(s, "one", "heartbeat", f"n{i}", 1.0, f"k{i}"), t, "127.0.0.1")
        for i, (s, t) in enumerate(zip(step_ids, agents, strict=True))
    ]


def test_a_callback_batch_is_synced_outside_the_lock_before_it_is_answered(
    full: tuple[Store, Syncs],
) -> None:
    store, syncs = full
    arrivals = _arrivals(store, 5)
    before = syncs.calls
    answers = intake.store_arrivals(store, arrivals)
    assert syncs.calls == before + 1 and syncs.lock_free[-1]
    assert [a.details for a in answers] == [f"n{i}" for i in range(5)]  # type: ignore[union-attr]
    with store.read() as conn:
        assert len(conn.execute(select(callbacks.c.id)).all()) == 5
        assert conn.execute(text("PRAGMA synchronous")).scalar_one() == FULL


def test_a_write_that_fails_leaves_its_connection_syncing_and_nothing_written(
    full: tuple[Store, Syncs],
) -> None:
    store, syncs = full
    before = syncs.calls
    with pytest.raises(RuntimeError), store.write_then_sync() as conn:
        conn.execute(text("INSERT INTO events (at, kind, details) VALUES (1, 'x', 'y')"))
        raise RuntimeError("half way")
    assert syncs.calls == before  # nothing committed, nothing to sync
    with store.read() as conn:
        assert conn.execute(text("SELECT count(*) FROM events WHERE kind = 'x'")).scalar() == 0
    # every connection the pool holds (the one used above among them) syncs again
    conns = [store.engine.raw_connection() for _ in range(3)]
    try:
        for c in conns:
            assert c.driver_connection.execute("PRAGMA synchronous").fetchone()[0] == FULL
    finally:
        for c in conns:
            c.close()


def test_a_store_opened_without_full_sync_is_not_synced_by_fleetwave(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = open_store(str(tmp_path / "off.db"), synchronous="OFF")
    syncs = Syncs(store.url)
    monkeypatch.setattr(db, "_datasync", syncs)
    try:
        with store.write_then_sync() as conn:
            conn.execute(text("INSERT INTO events (at, kind, details) VALUES (1, 'x', 'y')"))
        assert syncs.calls == 0
        with store.read() as conn:
            assert conn.execute(text("PRAGMA synchronous")).scalar_one() == 0  # OFF
    finally:
        store.dispose()


def test_callbacks_that_come_within_the_gap_after_a_batch_wait_and_go_in_one(
    full: tuple[Store, Syncs], monkeypatch: pytest.MonkeyPatch
) -> None:
    """An isolated callback is written at once; those that come within the gap after
    it are written together when the gap has passed, not one batch each."""
    store, _ = full
    arrivals = _arrivals(store, 11)
    batches: list[tuple[float, int]] = []
    real = intake.store_arrivals

    def counted(s: Store, given: list[intake.Arrival]) -> list[intake.Answer]:
        batches.append((time.monotonic(), len(given)))
        return real(s, given)

    monkeypatch.setattr(intake, "store_arrivals", counted)
    gap = 1.0

    async def main() -> tuple[float, float, list[object]]:
        service = Service(store, auth=False)
        service.intake = intake.CallbackIntake(service, batch_gap_s=gap)
        try:
            t0 = time.monotonic()
            await service.intake.accept(arrivals[0])
            first = time.monotonic() - t0
            rest = [asyncio.create_task(service.intake.accept(a)) for a in arrivals[1:]]
            for _ in range(5):
                await asyncio.sleep(0.01)
            answers = await asyncio.gather(*rest)
            return first, time.monotonic() - t0, answers
        finally:
            service.close()

    first, all_in, answers = asyncio.run(main())
    assert first < gap / 2, first  # not held for the gap
    assert [n for _, n in batches] == [1, 10], batches
    assert batches[1][0] - batches[0][0] >= gap * 0.95
    assert all_in >= gap * 0.95
    assert len(answers) == 10


def test_a_database_named_from_the_home_directory_has_its_wal_synced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``~/fleet.db`` (as FLEETWAVE_DB may say it, unexpanded): the WAL synced is the
    one SQLite writes, beside the file in the home directory."""
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path.parent)  # (not where the database is)
    store = open_store("~/home.db")
    synced: list[str] = []

    def datasync(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))

    monkeypatch.setattr(db, "_datasync", datasync)
    try:
        with store.write_then_sync() as conn:
            conn.execute(text("INSERT INTO events (at, kind, details) VALUES (1, 'x', 'y')"))
        assert synced == [str(tmp_path / "home.db-wal")]
    finally:
        store.dispose()
