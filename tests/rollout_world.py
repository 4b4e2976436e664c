"""A small fleet in groups, a strategy planned over it (stages, batches, canaries) and
driven on virtual time, and its journal read back by phase: shared by the rollout
control tests (test_stages.py, test_batches.py, test_canary.py, test_thresholds.py)."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import select

from conftest import on_virtual_time
from fleetwave.domain.models import Group, StrategyOptions, Target
from fleetwave.domain.registry import get_workflow
from fleetwave.domain.rollout import RolloutSpec
from fleetwave.engine.clock import LoopClock
from fleetwave.engine.conductor import Conductor
from fleetwave.engine.config import EngineConfig
from fleetwave.store import admin
from fleetwave.store.db import Store
from fleetwave.store.schema import groups, journal, steps, targets

PATCH = get_workflow("patch")
assert PATCH is not None


def fleet(
    store: Store,
    layout: dict[str | None, int],
    *,
    caps: dict[str, int] | None = None,
    latency_ms: float = 1000,
    settings: dict[str, dict[str, Any]] | None = None,
    orders: dict[str, int] | None = None,
) -> list[str]:
    """Targets ``<group>-<i>`` per group (``None``: ungrouped, named ``loose-<i>``),
    each operation taking ``latency_ms``; ``settings``: more sim settings by target."""
    names = []
    for g, n in layout.items():
        if g is not None:
            admin.add_group(
                store,
                Group(g, (caps or {}).get(g, 20), stage_order=(orders or {}).get(g)),
            )
        for i in range(1, n + 1):
            name = f"{g or 'loose'}-{i}"
            own = {"latency_ms": latency_ms, **(settings or {}).get(name, {})}
            admin.add_targets(store, [Target(name, group=g, settings=own)])
            names.append(name)
    return names


def drive(
    store: Store,
    spec: RolloutSpec | None = None,
    *,
    names: Sequence[str] | None = None,
    **options: Any,
) -> tuple[int, str]:
    """Create a strategy of patch over ``names`` (default: all targets) planned as
    ``spec`` asks, apply it and drive it to its end on virtual time."""
    opts = StrategyOptions(**options)
    sid = admin.create_strategy(
        store,
        PATCH,
        opts,
        target_names=names,
        all_targets=names is None,
        spec=spec,
    )
    admin.apply_strategy(store, sid)
    conductor = Conductor(store, clock=LoopClock(), config=EngineConfig(tick_s=1))

    async def go() -> dict[int, str]:
        return await asyncio.wait_for(conductor.run(strategy_ids=[sid]), 1_000_000)

    return sid, on_virtual_time(go())[sid]


@dataclass(frozen=True)
class Entry:
    """One journal row with its step's phase, target and group."""

    id: int
    at: float
    target: str
    group: str | None
    phase: int
    from_state: str
    to_state: str
    details: str


def entries(store: Store, sid: int) -> list[Entry]:
    with store.read() as conn:
        rows = conn.execute(
            select(
                journal.c.id,
                journal.c.at,
                targets.c.name,
                groups.c.name.label("group"),
                steps.c.stage,
                journal.c.from_state,
                journal.c.to_state,
                journal.c.details,
            )
            .join(steps, steps.c.id == journal.c.step_id)
            .join(targets, targets.c.id == steps.c.target_id)
            .outerjoin(groups, groups.c.id == targets.c.group_id)
            .where(journal.c.strategy_id == sid)
            .order_by(journal.c.id)
        ).all()
    return [Entry(*r) for r in rows]


def started(rows: list[Entry]) -> list[Entry]:
    """The entries that started a step (out of initial into a workflow state)."""
    return [e for e in rows if e.from_state == "initial" and e.to_state in PATCH.state_names]


def ended(rows: list[Entry]) -> list[Entry]:
    return [e for e in rows if e.to_state in ("complete", "failed", "aborted")]


def phases_in_order(rows: list[Entry]) -> dict[int, tuple[Entry, Entry]]:
    """Each phase's first start and last end; asserts no step of a phase started
    before every step of the earlier phases had ended (by journal order and time)."""
    spans: dict[int, tuple[Entry, Entry]] = {}
    for phase in sorted({e.phase for e in rows}):
        begun = [e for e in started(rows) if e.phase == phase]
        over = [e for e in ended(rows) if e.phase == phase]
        if begun:
            spans[phase] = (begun[0], over[-1])
    ordered = sorted(spans)
    for before, after in itertools.pairwise(ordered):
        last_end, first_start = spans[before][1], spans[after][0]
        assert last_end.id < first_start.id and last_end.at <= first_start.at, (
            before,
            after,
        )
    return spans


def phase_targets(rows: list[Entry]) -> dict[int, set[str]]:
    out: dict[int, set[str]] = {}
    for e in started(rows):
        out.setdefault(e.phase, set()).add(e.target)
    return out
