"""Read models of the inventory: groups and targets."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

from sqlalchemy import case, func, select

from fleetwave.domain.errors import NotFound
from fleetwave.domain.models import (
    has_labels,
    shown,
)
from fleetwave.store.db import Store
from fleetwave.store.queries.common import Page, _cap_taken, _page, _pages
from fleetwave.store.schema import (
    deleted_steps,
    groups,
    steps,
    strategies,
    targets,
)


def list_groups(store: Store) -> list[dict[str, Any]]:
    with store.read() as conn:
        counts: dict[int | None, int] = {
            gid: int(n)
            for gid, n in conn.execute(
                select(targets.c.group_id, func.count()).group_by(targets.c.group_id)
            )
        }
        return [
            {
                "name": g.name,
                # what runs: a serial group has one target in flight, whatever was set
                "max_parallel": 1 if g.apply_type == "serial" else g.max_parallel,
                "apply_type": g.apply_type,
                "order": g.stage_order,
                "targets": counts.get(g.id, 0),
            }
            for g in conn.execute(select(groups).order_by(groups.c.name))
        ]


def get_group(store: Store, name: str) -> dict[str, Any]:
    """One group: its settings, its targets (how many, how many unmanaged) and the
    strategies with steps of it, with the caps those strategies took when created."""
    with store.read() as conn:
        g = conn.execute(select(groups).where(groups.c.name == name)).first()
        if g is None:
            raise NotFound(f"group '{name}' not found")
        total, unmanaged = conn.execute(
            select(func.count(), func.sum(case((targets.c.managed, 0), else_=1))).where(
                targets.c.group_id == g.id
            )
        ).one()
        used = conn.execute(
            select(
                strategies.c.id,
                strategies.c.state,
                strategies.c.group_caps,
                func.count(steps.c.id).label("steps"),
            )
            .join(steps, steps.c.strategy_id == strategies.c.id)
            .where(steps.c.group_id == g.id)
            .group_by(strategies.c.id, strategies.c.state, strategies.c.group_caps)
            .order_by(strategies.c.id)
        ).all()
        return {
            "name": g.name,
            "max_parallel": 1 if g.apply_type == "serial" else g.max_parallel,
            "apply_type": g.apply_type,
            "order": g.stage_order,
            "targets": int(total),
            "unmanaged": int(unmanaged or 0),
            "strategies": [
                {
                    "strategy": int(s.id),
                    "strategy_state": s.state,
                    "steps": int(s.steps),
                    # the group's cap as the strategy took it when it was created
                    "max_parallel": _cap_taken(s.group_caps, g.id),
                }
                for s in used
            ],
        }


def _target_dict(r: Any, read: Callable[[str], Any] = json.loads) -> dict[str, Any]:
    """A target's row; its settings and labels through ``read`` (``str``: as stored),
    secret settings masked (``fleetwave.drivers.settings.mask_settings``)."""
    from fleetwave.drivers.settings import mask_settings, secret_settings

    settings = read(r.settings)
    if secret_settings(r.driver):
        masked = mask_settings(r.driver, json.loads(r.settings))
        settings = json.dumps(masked, sort_keys=True) if read is str else masked
    return {
        "name": r.name,
        "group": r.group_name,
        "driver": r.driver,
        "managed": bool(r.managed),
        "settings": settings,
        "labels": read(r.labels),
    }


def _target_query() -> Any:
    return select(
        targets.c.name,
        targets.c.driver,
        targets.c.managed,
        targets.c.settings,
        targets.c.labels,
        groups.c.name.label("group_name"),
    ).outerjoin(groups, groups.c.id == targets.c.group_id)


def list_targets(store: Store, group: str | None = None) -> list[dict[str, Any]]:
    return list(iter_targets(store, group))


def iter_targets(
    store: Store,
    group: str | None = None,
    labels: dict[str, str] | None = None,
    *,
    as_text: bool = False,
    after: str = "",
    rows: int | None = None,
) -> Iterator[dict[str, Any]]:
    """The targets (of a group; with every one of ``labels``) a page at a time, as read
    (a fleet of 100,000 is not held in memory). ``as_text``: settings and labels as
    their stored JSON text (written with sorted keys, as a table shows them): a table of
    150,000 targets spent a third of its time parsing them to print them again."""
    q = _target_query()
    if group is not None:
        with store.read() as conn:
            if conn.execute(select(groups.c.id).where(groups.c.name == group)).first() is None:
                raise NotFound(f"--group: no group named {shown(group)}")
        q = q.where(groups.c.name == group)
    for r in _pages(store, q, targets.c.name, after, rows):
        t = _target_dict(r, str if as_text else json.loads)
        if not labels or has_labels(json.loads(t["labels"]) if as_text else t["labels"], labels):
            yield t


def targets_page(
    store: Store,
    limit: int,
    after: str = "",
    group: str | None = None,
    labels: dict[str, str] | None = None,
) -> Page:
    """Up to ``limit`` targets after the name ``after``, by name (as :func:`iter_targets`)."""
    found = iter_targets(store, group, labels, after=after, rows=limit + 1)
    return _page(((t["name"], t) for t in found), limit)


def _target_step(s: Any) -> dict[str, Any]:
    """A target's step in a strategy (``target show``): the strategy's state and the
    step's, named apart."""
    return {
        "strategy": s.strategy_id,
        "strategy_state": s.strategy_state,
        "step": s.id,
        "step_state": s.state,
        "details": s.details,
    }


def get_target(store: Store, name: str) -> dict[str, Any]:
    with store.read() as conn:
        r = conn.execute(_target_query().where(targets.c.name == name)).first()
        if r is None:
            raise NotFound(f"target '{name}' not found")
        out = _target_dict(r)
        # its step in each strategy: the strategy's state and the step's, named apart
        # (one "state" column read as the strategy's)
        out["strategies"] = [
            _target_step(s)
            for s in conn.execute(
                select(
                    steps.c.strategy_id,
                    strategies.c.state.label("strategy_state"),
                    steps.c.id,
                    steps.c.state,
                    steps.c.details,
                )
                .join(targets, targets.c.id == steps.c.target_id)
                .join(strategies, strategies.c.id == steps.c.strategy_id)
                .where(targets.c.name == name)
                .order_by(steps.c.strategy_id)
            )
        ]
        # and its steps in deleted strategies, as they ended (their history is kept)
        kept = [
            _target_step(s)
            for s in conn.execute(
                select(
                    deleted_steps.c.strategy_id,
                    strategies.c.state.label("strategy_state"),
                    deleted_steps.c.id,
                    deleted_steps.c.state,
                    deleted_steps.c.details,
                )
                .join(strategies, strategies.c.id == deleted_steps.c.strategy_id)
                .where(
                    deleted_steps.c.target_id
                    == select(targets.c.id).where(targets.c.name == name).scalar_subquery()
                )
            )
        ]
        if kept:
            out["strategies"] = sorted(out["strategies"] + kept, key=lambda s: s["strategy"])
        return out
