"""Shared fixtures: a real store per test (SQLite, or each dialect for the tests marked
``both_dialects``), and a helper to roll a workflow out."""

from __future__ import annotations

import asyncio
import itertools
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fleetwave.cli.common import TEST_LEASE_TTL_MIN_ENV
from fleetwave.domain.models import StrategyOptions, Target
from fleetwave.domain.registry import get_workflow
from fleetwave.domain.workflow import ActionContext, Advance, Outcome, StateAction, WorkflowDef
from fleetwave.engine.conductor import Conductor
from fleetwave.engine.config import EngineConfig
from fleetwave.store import admin
from fleetwave.store.db import Store, open_store
from fleetwave.testing.vloop import VirtualTimeLoop

#: the CLI tests' fixtures (cli, db_path, migrated_db)
pytest_plugins = ["cli_harness"]


#: the store's dialects: a test or module marked ``both_dialects`` runs once on each
DIALECTS = ("sqlite", "postgresql")
#: the throw-away PostgreSQL server's URL (``scripts/test.sh`` starts one and sets it)
PG_URL_ENV = "FLEETWAVE_TEST_PG_URL"


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "dialect" in metafunc.fixturenames and metafunc.definition.get_closest_marker(
        "both_dialects"
    ):
        metafunc.parametrize("dialect", DIALECTS)


@pytest.fixture(scope="session", autouse=True)
def _hangup_as_from_a_terminal() -> Iterator[None]:
    """The commands the tests start get SIGHUP as from a terminal (its default), even
    when the test run itself was started with it ignored (``nohup``, a runner's
    background job): a command keeps an ignored SIGHUP ignored, as it should, and the
    tests that send one to a command would then see it do nothing. (A test of ``nohup``
    sets it ignored for its own command.)"""
    hup = getattr(signal, "SIGHUP", None)
    if hup is None or signal.getsignal(hup) is not signal.SIG_IGN:
        yield
        return
    signal.signal(hup, signal.SIG_DFL)
    try:
        yield
    finally:
        signal.signal(hup, signal.SIG_IGN)


@pytest.fixture
def dialect() -> str:
    """The store's dialect: SQLite (or ``$FLEETWAVE_TEST_DIALECT``, to run every test
    that takes a store on PostgreSQL), unless the test is marked ``both_dialects``."""
    return os.environ.get("FLEETWAVE_TEST_DIALECT") or "sqlite"


@pytest.fixture(scope="session")
def pg_server() -> str:
    """The URL of the test PostgreSQL server's maintenance database. Without one the test
    is skipped, except in CI (``CI=true``), where it fails: CI must run them."""
    url = os.environ.get(PG_URL_ENV)
    if not url:
        why = (
            f"no PostgreSQL server: {PG_URL_ENV} is not set "
            "(bash scripts/test.sh starts a throw-away one and sets it)"
        )
        if os.environ.get("CI", "").lower() in ("true", "1", "yes"):
            pytest.fail(f"CI runs the PostgreSQL tests, but {why}")
        pytest.skip(why)
    return url


#: the lease that takeover tests with real processes give ``serve`` and ``apply --wait``
#: (operators get 15 s at least; the ``short_lease`` fixture lowers that for its test)
SHORT_LEASE_S = 8.0


@pytest.fixture
def short_lease(monkeypatch: pytest.MonkeyPatch) -> float:
    """Let ``--lease-ttl`` go down to :data:`SHORT_LEASE_S` in this test (and in the
    processes it starts, through ``$FLEETWAVE_TEST_LEASE_TTL_MIN_S``): a takeover after
    a freeze waits that long, not the 15 s an operator's lease lasts at least."""
    monkeypatch.setenv(TEST_LEASE_TTL_MIN_ENV, f"{SHORT_LEASE_S:g}")
    return SHORT_LEASE_S


_databases = itertools.count()


@pytest.fixture
def pg_url(pg_server: str) -> Iterator[str]:
    """A new, empty database on the test server (no schema), dropped afterwards."""
    import psycopg
    from sqlalchemy.engine import make_url

    name = f"fwt_{os.getpid()}_{next(_databases)}"
    with psycopg.connect(pg_server, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    yield make_url(pg_server).set(database=name).render_as_string(hide_password=False)
    with psycopg.connect(pg_server, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture
def db_url(dialect: str, tmp_path: Path, request: pytest.FixtureRequest) -> str:
    """Where a new database goes: an SQLite file's path, or a new PostgreSQL database."""
    if dialect == "postgresql":
        return str(request.getfixturevalue("pg_url"))
    return str(tmp_path / "fleet.db")


@pytest.fixture
def store(db_url: str) -> Iterator[Store]:
    s = open_store(db_url)
    yield s
    s.dispose()


def add_sim_targets(
    store: Store, n: int, settings: dict[str, Any] | None = None, prefix: str = "t", **kw: Any
) -> list[str]:
    names = [f"{prefix}{i:05d}" for i in range(n)]
    admin.add_targets(store, [Target(name=x, settings=dict(settings or {}), **kw) for x in names])
    return names


def applied(store: Store, workflow: str = "patch", **options: Any) -> int:
    """Create a strategy of ``workflow`` over all targets and mark it applying."""
    wf = get_workflow(workflow)
    assert wf is not None
    sid = admin.create_strategy(store, wf, StrategyOptions(**options), all_targets=True)
    admin.apply_strategy(store, sid)
    return sid


def rollout(
    store: Store,
    workflow: str | WorkflowDef = "patch",
    *,
    conductor: Conductor | None = None,
    config: EngineConfig | None = None,
    **options: Any,
) -> tuple[int, str, Conductor]:
    """Create and apply a strategy over all targets, drive it to the end."""
    wf = get_workflow(workflow) if isinstance(workflow, str) else workflow
    assert wf is not None
    sid = admin.create_strategy(store, wf, StrategyOptions(**options), all_targets=True)
    admin.apply_strategy(store, sid)
    c = conductor or Conductor(store, config=config or EngineConfig())
    result = asyncio.run(c.run(strategy_ids=[sid]))
    return sid, result[sid], c


def on_virtual_time(main: Any) -> Any:
    """Run a coroutine to completion on a fresh virtual-time loop."""
    loop = VirtualTimeLoop()
    try:
        return loop.run_until_complete(main)
    finally:
        loop.close()


class Sleeps(StateAction):
    """An action that takes ``seconds`` and advances."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    async def run(self, ctx: ActionContext) -> Outcome:
        await asyncio.sleep(self.seconds)
        return Advance()
