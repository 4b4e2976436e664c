"""Shared fixtures: a real SQLite store per test, and a helper to roll a workflow out."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

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


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    s = open_store(str(tmp_path / "fleet.db"))
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
