"""Operator-side writes: groups, targets, stored workflows, strategy creation and control.

Each function is one transaction. Validation happens before anything is written,
so a rejected request leaves the database exactly as it was.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from contextvars import ContextVar
from dataclasses import asdict, replace
from typing import Any, NamedTuple

from sqlalchemy import Connection, Table, case, delete, func, insert, select, update

from fleetwave.domain.errors import Conflict, InputError, NotFound
from fleetwave.domain.models import (
    STEP_INITIAL,
    STEP_TERMINAL,
    STRATEGY_ACTIVE,
    ApplyType,
    Group,
    StrategyOptions,
    StrategyState,
    Target,
    has_labels,
    name_problem,
    plural,
    shown,
)
from fleetwave.domain.rollout import (
    APPROVED_EVENT,
    Plan,
    PlannedStage,
    PlanTarget,
    RolloutSpec,
    approval_text,
    parse_amount,
    phase_stages,
    plan_rollout,
)
from fleetwave.domain.windows import earliest_start, parse_window, shown_time
from fleetwave.domain.workflow import WorkflowDef, WorkflowError, describe_workflow
from fleetwave.domain.yaml_workflow import parse_workflow_yaml
from fleetwave.store import slots
from fleetwave.store.db import DialectHooks, Store
from fleetwave.store.notify import notify
from fleetwave.store.schema import (
    agent_tokens,
    callbacks,
    deleted_steps,
    events,
    groups,
    id_counters,
    journal,
    steps,
    strategies,
    targets,
    workflows,
)

_ACTIVE = [s.value for s in STRATEGY_ACTIVE]


#: Where an operator's writes take their time from: the wall clock; a simulation sets its
#: virtual clock here, so that a kept simulation database has one time line.
ADMIN_CLOCK: ContextVar[Callable[[], float]] = ContextVar("fleetwave_admin_clock")


#: a group's cap when the strategy has none for it (it was added after): none
UNCAPPED_GROUP = 1 << 30


def _now() -> float:
    return ADMIN_CLOCK.get(time.time)()


#: Who makes this context's changes when it is not the operator at the command line:
#: ``api:NAME`` (a REST API request, by its token's name). Each change is then recorded
#: with it, in the change's own transaction (an event of kind ``change-by``).
ACTOR: ContextVar[str | None] = ContextVar("fleetwave_actor", default=None)

#: the kind of event that records who made a change through the API
CHANGE_BY = "change-by"


def record_actor(conn: Connection, what: str, strategy_id: int | None = None) -> None:
    """Record who made this change (:data:`ACTOR`), if it is known: in the change's
    own transaction (``conn``)."""
    actor = ACTOR.get()
    if actor is None:
        return
    conn.execute(
        insert(events).values(
            at=_now(),
            conductor=None,
            strategy_id=strategy_id,
            step_id=None,
            kind=CHANGE_BY,
            details=f"{what} by {actor}",
        )
    )


# -- groups -----------------------------------------------------------------


def add_group(store: Store, group: Group) -> int:
    return _add_group(store, group, existing_ok=False)[0]


def ensure_group(store: Store, group: Group) -> bool:
    """Add the group; False when it is there already with the same settings (a script
    run again). Refused (Conflict) when it is there with other settings."""
    return _add_group(store, group, existing_ok=True)[1]


def _add_group(store: Store, group: Group, *, existing_ok: bool) -> tuple[int, bool]:
    problem = name_problem(group.name)
    if problem:
        raise InputError(f"group name: {problem}")
    _check_max_parallel(group.max_parallel)
    with store.write() as conn:
        there = conn.execute(
            select(
                groups.c.id, groups.c.max_parallel, groups.c.apply_type, groups.c.stage_order
            ).where(groups.c.name == group.name)
        ).first()
        if there is not None:
            other = [
                f"{field} {stored} stored, {given} given"
                for field, stored, given in (
                    ("max-parallel", there.max_parallel, group.max_parallel),
                    ("apply-type", there.apply_type, group.apply_type.value),
                    ("order", there.stage_order, group.stage_order),
                )
                if stored != given
            ]
            if other:
                raise Conflict(
                    f"group '{group.name}' already exists with other settings "
                    f"({'; '.join(other)}); 'fleetwave group set {group.name}' changes them"
                )
            if not existing_ok:
                raise Conflict(f"group '{group.name}' already exists")
            return int(there.id), False
        res = conn.execute(
            insert(groups).values(
                name=group.name,
                max_parallel=group.max_parallel,
                apply_type=group.apply_type.value,
                stage_order=group.stage_order,
            )
        )
        return int(res.inserted_primary_key[0]), True  # type: ignore[index]


#: max parallel of a parallel group or strategy when none is given
DEFAULT_MAX_PARALLEL = 20


def _group_row(conn: Connection, name: str) -> Any:
    row = conn.execute(
        select(groups.c.id, groups.c.max_parallel, groups.c.apply_type, groups.c.stage_order).where(
            groups.c.name == name
        )
    ).first()
    if row is None:
        raise NotFound(f"group '{name}' not found")
    return row


def _strategies_using_group(conn: Connection, gid: int, *, active: bool) -> list[int]:
    """Strategies with steps of this group (only the active ones when ``active``)."""
    q = select(steps.c.strategy_id).where(steps.c.group_id == gid).distinct()
    if active:
        q = q.join(strategies, strategies.c.id == steps.c.strategy_id).where(
            strategies.c.state.in_(_ACTIVE)
        )
    return sorted(int(r[0]) for r in conn.execute(q))


def change_group(
    store: Store,
    name: str,
    *,
    max_parallel: int | None = None,
    apply_type: ApplyType | None = None,
    stage_order: int | None = None,
    no_stage_order: bool = False,
) -> dict[str, Any]:
    """Change a group's max parallel or apply type: what it was, what it is, and the
    active strategies that keep the caps they were created with.

    A strategy takes its groups' caps when it is created, so a change applies to the
    strategies created after it. As with ``group add``: a serial group runs one target
    at a time (another max parallel is refused), and a group made parallel without a
    max parallel gets the default (20).
    """
    if max_parallel is None and apply_type is None and stage_order is None and not no_stage_order:
        raise InputError("nothing to change: give --max-parallel, --apply-type or --order")
    if stage_order is not None and no_stage_order:
        raise InputError("--order and --no-order: give one of them")
    if max_parallel is not None:
        _check_max_parallel(max_parallel)
    with store.write() as conn:
        row = _group_row(conn, name)
        old_type = ApplyType(row.apply_type)
        new_type = apply_type or old_type
        if new_type is ApplyType.SERIAL:
            check_serial(max_parallel, "group")
            new_max = 1
        elif max_parallel is not None:
            new_max = max_parallel
        elif old_type is ApplyType.SERIAL:
            new_max = DEFAULT_MAX_PARALLEL  # made parallel: as a group added so
        else:
            new_max = int(row.max_parallel)
        new_order = None if no_stage_order else stage_order or row.stage_order
        conn.execute(
            update(groups)
            .where(groups.c.id == row.id)
            .values(max_parallel=new_max, apply_type=new_type.value, stage_order=new_order)
        )
        # what ran before: a serial group one at a time, whatever an old row says
        old_max = 1 if old_type is ApplyType.SERIAL else int(row.max_parallel)
        return {
            "name": name,
            "before": {
                "max_parallel": old_max,
                "apply_type": old_type.value,
                "order": row.stage_order,
            },
            "after": {"max_parallel": new_max, "apply_type": new_type.value, "order": new_order},
            "changed": (new_max, new_type, new_order) != (old_max, old_type, row.stage_order),
            "active_strategies_unchanged": _strategies_using_group(conn, row.id, active=True),
        }


def delete_group(store: Store, name: str) -> None:
    """Delete a group with no targets and no steps in any strategy; refused otherwise,
    naming what holds it."""
    with store.write() as conn:
        gid = _group_row(conn, name).id
        members = [
            r[0]
            for r in conn.execute(
                select(targets.c.name).where(targets.c.group_id == gid).order_by(targets.c.name)
            )
        ]
        if members:
            raise Conflict(
                f"group {name}: has {plural(len(members), 'target')} ({_some(members)}); "
                f"move {'it' if len(members) == 1 else 'them'} to another group "
                "('fleetwave target set NAME --group OTHER', or --no-group) or delete "
                f"{'it' if len(members) == 1 else 'them'} first"
            )
        used = _strategies_using_group(conn, gid, active=False)
        if used:
            raise Conflict(
                f"group {name}: has history in "
                f"{plural(len(used), 'strategy', 'strategies')} "
                f"({', '.join(map(str, used[:5]))}{' ...' if len(used) > 5 else ''}); "
                "delete those strategies first"
            )
        conn.execute(delete(groups).where(groups.c.id == gid))


def _group_ids(conn: Connection) -> dict[str, int]:
    return {r.name: r.id for r in conn.execute(select(groups.c.id, groups.c.name))}


# -- targets ----------------------------------------------------------------


class TargetBatch(list[Target]):
    """Targets read from a file, with where each one came from ("fleet.csv line 3",
    "fleet.yaml targets[2]"): :func:`add_targets` names it in the errors it finds at
    the database (an unknown group, a name already taken)."""

    def __init__(self, items: Iterable[Target] = (), origins: Iterable[str] = ()) -> None:
        super().__init__(items)
        self.origins = list(origins)
        #: the names whose source gave no labels (a CSV file cannot; a YAML item without
        #: ``labels:``): a target there already keeps its own, and they are not compared
        self.no_labels: set[str] = set()


def add_targets(store: Store, items: Sequence[Target], *, origins: Sequence[str] = ()) -> int:
    """Add many targets in one transaction; all or nothing.

    ``origins`` (or a :class:`TargetBatch`'s own): where each item came from, for the
    errors. New names must follow the name rule (:data:`~fleetwave.domain.models.NAME_RULE`).
    """
    return _add_targets(store, items, origins=origins, existing_ok=False)


def ensure_targets(
    store: Store,
    items: Sequence[Target],
    *,
    origins: Sequence[str] = (),
    managed_kept: list[str] | None = None,
) -> int:
    """As :func:`add_targets`, but a target already there with the same group, driver,
    settings and labels is left as it is (an inventory imported again, grown): how many
    were added. One there with another definition is refused, and nothing is written.
    Whether it is managed is not compared: that is the operator's to change (``target
    manage|unmanage``), not the inventory's; nor are labels where the source gave none
    (:attr:`TargetBatch.no_labels`: a CSV file has no labels column). ``managed_kept``
    gets the names of those given as unmanaged that are there managed (left so: said
    by the caller, as an inventory meant to fence a target off does not)."""
    return _add_targets(store, items, origins=origins, existing_ok=True, managed_kept=managed_kept)


def _add_targets(
    store: Store,
    items: Sequence[Target],
    *,
    origins: Sequence[str],
    existing_ok: bool,
    managed_kept: list[str] | None = None,
) -> int:
    if not items:
        raise InputError("no targets given")
    if not origins and isinstance(items, TargetBatch):
        origins = items.origins

    def at(i: int) -> str:
        return f"{origins[i]}: " if i < len(origins) else ""

    seen: set[str] = set()
    for i, t in enumerate(items):
        problem = name_problem(t.name)
        if problem:
            raise InputError(f"{at(i)}target name: {problem}")
        if t.name in seen:
            raise InputError(f"{at(i)}target {t.name}: name: appears twice in the input")
        seen.add(t.name)
        if not t.driver:
            raise InputError(f"{at(i)}target {t.name}: driver: must not be empty")
    from fleetwave.drivers import known_drivers

    for i, t in enumerate(items):
        if t.driver not in known_drivers():
            raise InputError(
                f"{at(i)}target {t.name}: driver: unknown driver {shown(t.driver)} "
                f"(known: {', '.join(sorted(known_drivers()))})"
            )
    now = _now()
    with store.write() as conn:
        gids = _group_ids(conn)
        for i, t in enumerate(items):
            if t.group is not None and t.group not in gids:
                raise NotFound(f"{at(i)}target {t.name}: group: no group named {shown(t.group)}")
        names = [t.name for t in items]
        stored = _definitions(conn, names)
        if stored:
            unlabelled = items.no_labels if isinstance(items, TargetBatch) else set()
            refused = _clashes(items, stored, existing_ok, unlabelled)
            if refused:
                more = f" and {len(refused) - 1} more" if len(refused) > 1 else ""
                first, why = refused[0]  # the first in the input's order
                how = f"; 'fleetwave target set {names[first]}' changes it" if why else ""
                raise Conflict(f"{at(first)}target {names[first]}: already exists{why}{more}{how}")
            if managed_kept is not None:
                fenced = [t.name for t in items if not t.managed and t.name in stored]
                for start in range(0, len(fenced), 500):
                    chunk = fenced[start : start + 500]
                    managed_kept += [
                        str(name)
                        for name, managed in conn.execute(
                            select(targets.c.name, targets.c.managed)
                            .where(targets.c.name.in_(chunk))
                            .order_by(targets.c.name)
                        )
                        if managed
                    ]
            items = [t for t in items if t.name not in stored]
            if not items:
                return 0
        conn.execute(
            insert(targets),
            [
                {
                    "name": t.name,
                    "group_id": gids[t.group] if t.group else None,
                    "driver": t.driver,
                    "settings": json.dumps(t.settings, sort_keys=True),
                    "managed": t.managed,
                    "labels": json.dumps(t.labels, sort_keys=True),
                    "created_at": now,
                }
                for t in items
            ],
        )
        record_actor(
            conn, f"{plural(len(items), 'target')} added ({_some([t.name for t in items])})"
        )
    return len(items)


#: a stored target's definition: group, driver, settings and labels (as stored, JSON)
_Definition = tuple[str | None, str, str, str]


def _definitions(conn: Connection, names: list[str]) -> dict[str, _Definition]:
    """The definitions of the targets of these names already stored, 500 names a query."""
    stored: dict[str, _Definition] = {}
    for start in range(0, len(names), 500):
        rows = conn.execute(
            select(
                targets.c.name,
                groups.c.name,
                targets.c.driver,
                targets.c.settings,
                targets.c.labels,
            )
            .select_from(targets.outerjoin(groups, groups.c.id == targets.c.group_id))
            .where(targets.c.name.in_(names[start : start + 500]))
        )
        for name, group, driver, settings, labels in rows:
            stored[name] = (group, driver, settings, labels)
    return stored


def _clashes(
    items: Sequence[Target],
    stored: dict[str, _Definition],
    existing_ok: bool,
    unlabelled: set[str],
) -> list[tuple[int, str]]:
    """The items that may not be added over a target of the same name, in input order,
    with what differs (empty: it is there; ``existing_ok`` lets the same one through).
    The labels of those in ``unlabelled`` (their source gave none) are not compared."""
    from fleetwave.drivers.settings import same_settings

    out: list[tuple[int, str]] = []
    for i, t in enumerate(items):
        there = stored.get(t.name)
        if there is None:
            continue
        settings = json.dumps(t.settings, sort_keys=True)
        if settings != there[2]:
            kept = json.loads(there[2])
            if t.driver == there[1] and same_settings(t.driver, kept, t.settings):
                settings = there[2]  # a secret sealed anew: the same secret
            else:  # said as shown (secrets masked), told apart even when they read alike
                shown_there = _masked(there[1], kept)
                settings = _masked(t.driver, t.settings)
                if settings == shown_there:
                    settings += " (a secret differs)"
                there = (there[0], there[1], shown_there, there[3])
        given = (
            t.group,
            t.driver,
            settings,
            there[3] if t.name in unlabelled else json.dumps(t.labels, sort_keys=True),
        )
        other = [
            f"{field}: {_shown_value(a)} stored, {_shown_value(b)} given"
            for field, a, b in zip(
                ("group", "driver", "settings", "labels"), there, given, strict=True
            )
            if a != b
        ]
        if other:
            out.append((i, f" with another definition ({'; '.join(other)})"))
        elif not existing_ok:
            out.append((i, ""))
    return out


def _masked(driver: str, settings: dict[str, Any]) -> str:
    from fleetwave.drivers.settings import mask_settings

    return json.dumps(mask_settings(driver, settings), sort_keys=True)


def _shown_value(value: str | None) -> str:
    return "none" if value is None else value


def _target_id(conn: Connection, name: str) -> int:
    row = conn.execute(select(targets.c.id).where(targets.c.name == name)).first()
    if row is None:
        raise NotFound(f"target '{name}' not found")
    return int(row[0])


def set_managed(store: Store, name: str, managed: bool) -> list[dict[str, Any]]:
    """Mark the target (un)managed. Unmanaged: the active strategies whose step of it has
    not started yet (it fails when its turn comes; one that stops on failure stops), as
    ``{"strategy", "state", "stops": "on failure"/"past N failures"/None}``."""
    with store.write() as conn:
        tid = _target_id(conn, name)
        conn.execute(update(targets).where(targets.c.id == tid).values(managed=managed))
        record_actor(conn, f"target {name} {'managed' if managed else 'unmanaged'}")
        if managed:
            return []
        waiting = conn.execute(
            select(strategies.c.id, strategies.c.state, strategies.c.options)
            .join(steps, steps.c.strategy_id == strategies.c.id)
            .where(
                steps.c.target_id == tid,
                steps.c.state == STEP_INITIAL,
                # (one being aborted ends its steps not started as aborted: not failed)
                strategies.c.state.in_(
                    [StrategyState.INITIAL, StrategyState.APPLYING, StrategyState.PAUSED]
                ),
            )
            .order_by(strategies.c.id)
        ).all()
        out = []
        for sid, state, raw in waiting:
            try:
                opts = options_from_json(raw)
            except (ValueError, TypeError):  # unreadable (a hand edit): not said
                opts = StrategyOptions()
            stops = None
            if opts.stop_on_failure:
                stops = "on failure"
            elif opts.max_failures is not None:
                stops = f"past {plural(opts.max_failures, 'failure')}"
            out.append({"strategy": int(sid), "state": str(state), "stops": stops})
        return out


def _how_it_ends(sid: int, state: str, then: str) -> str:
    """What ends an active strategy, for a refusal that has to wait for its end."""
    if state == StrategyState.INITIAL:
        return f"it was never applied: 'fleetwave strategy delete {sid}' ends it"
    if state in (StrategyState.ABORT_REQUESTED, StrategyState.ABORTING):
        return (
            f"{then} once its abort has finished, which a conductor does: "
            f"'fleetwave serve', or 'fleetwave strategy apply {sid} --wait'"
        )
    return f"{then} once it has ended: 'fleetwave strategy abort {sid}' ends it"


def _active_strategy_of(
    conn: Connection, target_ids: Sequence[int], *, open_steps: bool = False
) -> tuple[int, int] | None:
    """(target_id, strategy_id) of the first target already held by an active strategy
    (``open_steps``: whose step there has not ended)."""
    held = _held_by_active(conn, target_ids, limit=1, open_steps=open_steps)
    for sid, tids in held.items():
        return tids[0], sid
    return None


def _ended_step(conn: Connection, tid: int, sid: int) -> tuple[str, str] | None:
    """(its state, "N of M steps") when the target's step in strategy ``sid`` has ended."""
    state = conn.execute(
        select(steps.c.state).where(steps.c.strategy_id == sid, steps.c.target_id == tid)
    ).scalar()
    if state not in STEP_TERMINAL:
        return None
    total, left = conn.execute(
        select(
            func.count(),
            func.coalesce(func.sum(case((steps.c.state.in_(list(STEP_TERMINAL)), 0), else_=1)), 0),
        ).where(steps.c.strategy_id == sid)
    ).one()
    return str(state), f"{left} of {plural(int(total), 'step')}"


def _held_by_active(
    conn: Connection,
    target_ids: Sequence[int],
    *,
    limit: int | None = None,
    hooks: DialectHooks | None = None,
    open_steps: bool = False,
) -> dict[int, list[int]]:
    """The targets among ``target_ids`` already held by an active strategy, by strategy
    (strategies and targets in id order); at most ``limit`` of them when given.
    ``hooks``: the store's (a whole fleet is then read in one pass)."""
    held: dict[int, list[int]] = {}
    if hooks is not None and limit is None and len(target_ids) > 2_000:
        # A whole fleet: one pass over the active strategies' steps (the driver's own
        # rows) beats hundreds of lookups of 500 (0.7 s at 150,000 targets).
        wanted = set(target_ids)
        for tid, sid in _driver_rows(
            conn,
            "SELECT steps.target_id, steps.strategy_id FROM steps JOIN strategies ON "
            "strategies.id = steps.strategy_id "
            f"WHERE strategies.state IN ({hooks.placeholders(len(_ACTIVE))})",
            _ACTIVE,
        ):
            if tid in wanted:
                held.setdefault(int(sid), []).append(int(tid))
        return {sid: sorted(tids) for sid, tids in sorted(held.items())}
    found = 0
    for start in range(0, len(target_ids), 500):
        chunk = list(target_ids[start : start + 500])
        q = (
            select(steps.c.target_id, steps.c.strategy_id)
            .join(strategies, strategies.c.id == steps.c.strategy_id)
            .where(steps.c.target_id.in_(chunk), strategies.c.state.in_(_ACTIVE))
            .order_by(steps.c.strategy_id, steps.c.target_id)
        )
        if open_steps:
            q = q.where(steps.c.state.not_in(list(STEP_TERMINAL)))
        if limit is not None:
            q = q.limit(limit - found)
        for tid, sid in conn.execute(q):
            held.setdefault(int(sid), []).append(int(tid))
            found += 1
        if limit is not None and found >= limit:
            break
    return dict(sorted(held.items()))


#: ``change_target(group=KEEP)``: the target stays in its group
KEEP: Any = object()


def change_target(
    store: Store,
    name: str,
    *,
    group: str | None = KEEP,
    driver: str | None = None,
    settings: dict[str, Any] | None = None,
    unset: Sequence[str] = (),
    labels: dict[str, str] | None = None,
    unlabel: Sequence[str] = (),
    check: Callable[[Target], Target | None] | None = None,
) -> dict[str, Any]:
    """Change a target's group (None: no group), driver, settings (set some, unset
    some) or labels: what changed, field by field (empty: nothing did).

    ``check`` is given the target as it would be (its driver's settings validated
    there) and may answer it as it is to be stored (its secrets sealed); nothing is
    written when it raises. Secret settings are masked in what it answers. Refused while
    the target is in an active strategy: a step reads its target's definition when it
    starts, so a change then would apply to some states and not others.
    """
    settings = settings or {}
    labels = labels or {}
    for option, keys, given in (("--unset", unset, settings), ("--unlabel", unlabel, labels)):
        both = sorted(set(keys) & set(given))
        if both:
            raise InputError(f"{option}: {_some(both)} also given a value")
        twice = sorted(k for k, n in Counter(keys).items() if n > 1)
        if twice:
            raise InputError(f"{option}: {_some(twice)} given more than once")
    if driver is not None and not driver:
        raise InputError("--driver: must not be empty")
    with store.write() as conn:
        row = conn.execute(
            select(
                targets.c.id,
                groups.c.name.label("group_name"),
                targets.c.driver,
                targets.c.settings,
                targets.c.labels,
                targets.c.managed,
            )
            .select_from(targets.outerjoin(groups, groups.c.id == targets.c.group_id))
            .where(targets.c.name == name)
        ).first()
        if row is None:
            raise NotFound(f"target '{name}' not found")
        old_settings: dict[str, Any] = json.loads(row.settings)
        old_labels: dict[str, str] = json.loads(row.labels)
        for option, keys, there in (
            ("--unset", unset, old_settings),
            ("--unlabel", unlabel, old_labels),
        ):
            missing = [k for k in keys if k not in there]
            if missing:
                what = "setting" if option == "--unset" else "label"
                raise InputError(
                    f"{option}: target {name} has no {what} {_some(missing)}"
                    + (f" (it has {_some(sorted(there))})" if there else "")
                )
        new_settings = {k: v for k, v in old_settings.items() if k not in unset} | settings
        new_labels = {k: v for k, v in old_labels.items() if k not in unlabel} | labels
        new = Target(
            name=name,
            driver=row.driver if driver is None else driver,
            group=row.group_name if group is KEEP else group,
            settings=new_settings,
            managed=bool(row.managed),
            labels=new_labels,
        )
        from fleetwave.drivers import known_drivers

        if new.driver not in known_drivers():
            raise InputError(
                ("--driver: unknown driver" if driver is not None else f"target {name}: driver")
                + f" {shown(new.driver)}"
                + (" is unknown here" if driver is None else "")
                + f" (known: {', '.join(sorted(known_drivers()))})"
                + ("" if driver is not None else "; give --driver")
            )
        if check is not None:
            new = check(new) or new
            new_settings = new.settings
        gid = None
        if new.group is not None:
            gid = _group_ids(conn).get(new.group)
            if gid is None:
                raise NotFound(f"--group: no group named {shown(new.group)}")
        changes = {
            field: {"before": before, "after": after}
            for field, before, after in (
                ("group", row.group_name, new.group),
                ("driver", row.driver, new.driver),
                ("settings", old_settings, new_settings),
                ("labels", old_labels, new_labels),
            )
            # as stored (JSON): 1 and true, 5 and 5.0 are other values, as for target add
            if json.dumps(before, sort_keys=True) != json.dumps(after, sort_keys=True)
        }
        if not changes:
            return changes
        if "settings" in changes:
            from fleetwave.drivers.settings import mask_settings, same_settings

            if new.driver == row.driver and same_settings(new.driver, old_settings, new_settings):
                # a secret given again as it was: sealed anew, the same all the same
                del changes["settings"]
                if not changes:
                    return changes
                new_settings = old_settings
            else:
                changes["settings"] = {
                    "before": mask_settings(row.driver, old_settings),
                    "after": mask_settings(new.driver, new_settings),
                }
        # Only a step that has not ended reads the target (its group is the step's own
        # copy, taken when the strategy was created): one that has ended holds nothing.
        busy = _active_strategy_of(conn, [row.id], open_steps=True)
        if busy:
            state = _strategy_state(conn, busy[1])
            step_state = conn.execute(
                select(steps.c.state).where(
                    steps.c.strategy_id == busy[1], steps.c.target_id == row.id
                )
            ).scalar()
            raise Conflict(
                f"target {name}: is in active strategy {busy[1]} ({state}), which uses its "
                "group, driver, settings and labels; "
                + _how_it_ends(busy[1], state, "it can be changed")
                + (
                    f"; 'fleetwave target unmanage {name}' keeps the rollout off it meanwhile"
                    f" (its step fails when its turn comes)"
                    if state != StrategyState.INITIAL and step_state == STEP_INITIAL
                    else ""
                )
            )
        conn.execute(
            update(targets)
            .where(targets.c.id == row.id)
            .values(
                group_id=gid,
                driver=new.driver,
                settings=json.dumps(new_settings, sort_keys=True),
                labels=json.dumps(new_labels, sort_keys=True),
            )
        )
        # (which fields, not their values: a setting may be a secret)
        record_actor(conn, f"target {name} changed ({', '.join(changes)})")
        return changes


def delete_target(store: Store, name: str) -> None:
    with store.write() as conn:
        tid = _target_id(conn, name)
        busy = _active_strategy_of(conn, [tid])
        if busy:
            state = _strategy_state(conn, busy[1])
            ended = _ended_step(conn, tid, busy[1])
            if ended is not None:
                # Its step is done: aborting the rollout (what the line below says) would
                # not be what an operator wants for one decommissioned target.
                raise Conflict(
                    f"target {name}: its step in active strategy {busy[1]} ({state}) has "
                    f"ended ({ended[0]}), and the strategy keeps its history: the target "
                    f"can be deleted with the strategy's history once the strategy has "
                    f"ended ({ended[1]} still to go; 'fleetwave strategy delete {busy[1]}' "
                    "then)"
                )
            raise Conflict(
                f"target {name}: is in active strategy {busy[1]} ({state}); "
                + _how_it_ends(busy[1], state, "the target can be deleted")
            )
        used = [
            int(r[0])
            for r in conn.execute(
                select(steps.c.strategy_id)
                .where(steps.c.target_id == tid)
                .distinct()
                .order_by(steps.c.strategy_id)
            )
        ]
        if used:
            raise Conflict(
                f"target {name}: has history in "
                f"{plural(len(used), 'strategy', 'strategies')} "
                f"({', '.join(map(str, used[:5]))}{' ...' if len(used) > 5 else ''}); "
                "delete those strategies first"
            )
        conn.execute(delete(targets).where(targets.c.id == tid))
        record_actor(conn, f"target {name} deleted")


# -- workflows ----------------------------------------------------------------


def save_workflow(store: Store, wf: WorkflowDef, source_yaml: str) -> int | None:
    """Store a YAML workflow: the one stored under its name, if any, is replaced only by
    a higher version. The same version again is a no-op when it describes the same
    workflow (comments and layout aside), and refused when it does not: one name and
    version means one workflow, in every listing and history. Strategies keep their
    own copy, so replacing the stored one changes none of them.

    Returns the version replaced, if any (None: nothing was stored under the name).
    """
    with store.write() as conn:
        stored = _stored_version(conn, wf)
        if stored == wf.version:
            return stored
        if stored is not None:
            conn.execute(delete(workflows).where(workflows.c.name == wf.name))
        conn.execute(
            insert(workflows).values(
                name=wf.name, version=wf.version, source_yaml=source_yaml, created_at=_now()
            )
        )
        replacing = f", replacing v{stored}" if stored is not None else ""
        record_actor(conn, f"workflow {wf.name} v{wf.version} stored{replacing}")
        return stored


def delete_workflow(store: Store, name: str) -> int:
    """Remove a stored (YAML) workflow; the version removed. Strategies created from it
    keep their own copy and run on; new ones can no longer name it."""
    with store.write() as conn:
        version = conn.execute(select(workflows.c.version).where(workflows.c.name == name)).scalar()
        if version is None:
            raise NotFound(f"workflow {shown(name)}: no stored workflow of that name")
        conn.execute(delete(workflows).where(workflows.c.name == name))
        return int(version)


def check_workflow_version(store: Store, wf: WorkflowDef) -> int | None:
    """What :func:`save_workflow` would say of ``wf``, without storing it: the version
    it would replace (its own: already stored, unchanged), or None; raises
    :class:`Conflict` as it would (``workflow validate --db``)."""
    with store.read() as conn:
        return _stored_version(conn, wf)


def _stored_version(conn: Connection, wf: WorkflowDef) -> int | None:
    row = conn.execute(
        select(workflows.c.version, workflows.c.source_yaml).where(workflows.c.name == wf.name)
    ).first()
    if row is None:
        return None
    stored = int(row.version)
    if stored > wf.version:
        raise Conflict(
            f"workflow {wf.name}: version {wf.version} is older than the stored "
            f"version {stored}; to replace it, give a version above {stored}"
        )
    if stored == wf.version and not _same_workflow(row.source_yaml, wf):
        raise Conflict(
            f"workflow {wf.name}: version {stored} is already stored with other "
            f"states or settings; to store the change, raise version to {stored + 1}"
        )
    return stored


def _same_workflow(stored_yaml: str, wf: WorkflowDef) -> bool:
    """Whether the stored YAML describes ``wf`` (one that no longer parses does not)."""
    try:
        stored = parse_workflow_yaml(stored_yaml, source="stored")
    except (WorkflowError, InputError):
        return False

    def code(w: WorkflowDef) -> list[str]:
        # describe() names an action's class only: two modules' `Apply` must differ
        return [f"{type(st.action).__module__}.{type(st.action).__qualname__}" for st in w.states]

    return describe_workflow(stored) == describe_workflow(wf) and code(stored) == code(wf)


def stored_workflows(store: Store) -> list[tuple[str, str]]:
    with store.read() as conn:
        return [
            (r.name, r.source_yaml)
            for r in conn.execute(select(workflows.c.name, workflows.c.source_yaml))
        ]


# -- strategies ---------------------------------------------------------------


def options_to_json(opts: StrategyOptions) -> str:
    data: dict[str, Any] = asdict(opts)
    data["apply_type"] = opts.apply_type.value
    return json.dumps(data, sort_keys=True)


#: the most steps a strategy (or a group) may have in flight: far above any fleet's
#: need, and below what the database's integers and LIMITs can hold
MAX_PARALLEL = 1_000_000


def check_serial(max_parallel: int | None, what: str) -> None:
    """A serial group or strategy runs one target at a time: another --max-parallel
    is refused rather than silently run one by one."""
    if max_parallel is not None and max_parallel != 1:
        raise InputError(
            f"--max-parallel: a serial {what} runs one target at a time, got {max_parallel} "
            "(leave --max-parallel out, or use --apply-type parallel)"
        )


def _check_max_parallel(value: int) -> None:
    if value < 1:
        raise InputError(f"--max-parallel: must be at least 1, got {value}")
    if value > MAX_PARALLEL:
        raise InputError(f"--max-parallel: must be at most {MAX_PARALLEL}, got {value}")


def options_from_json(raw: str) -> StrategyOptions:
    data = json.loads(raw)
    data["apply_type"] = ApplyType(data["apply_type"])
    data["plan"] = [PlannedStage(**stage) for stage in data.get("plan", ())]
    opts = StrategyOptions(**data)
    if not 1 <= opts.max_parallel <= MAX_PARALLEL:  # written by an earlier version
        raise InputError(f"max_parallel: must be 1 to {MAX_PARALLEL}, got {opts.max_parallel}")
    return opts


def _some(names: list[str], shown: int = 5) -> str:
    """Names quoted for a message: the first few, and how many more."""
    quoted = ", ".join(f"'{n}'" for n in names[:shown])
    return quoted + (f" (and {len(names) - shown} more)" if len(names) > shown else "")


def create_strategy(
    store: Store,
    wf: WorkflowDef,
    opts: StrategyOptions,
    *,
    target_names: Iterable[str] | None = None,
    group: str | None = None,
    all_targets: bool = False,
    labels: dict[str, str] | None = None,
    failed_in: int | None = None,
    workflow_from_store: bool = False,
    spec: RolloutSpec | None = None,
) -> int:
    """Create a strategy over the targets named, those of a group, or all of them;
    ``labels`` keeps only the targets with every one of these labels (of the group,
    or of all targets when neither a group nor names are given). ``failed_in``: the
    strategy the names were read from (its failed and aborted steps): refused if it is
    being deleted by the time the write lock is taken. ``workflow_from_store``: ``wf``
    was read from the stored workflows (not a built-in or plug-in one): refused if it
    was replaced or deleted by the time the write lock is taken. ``spec``: the
    rollout's order (stages, batches, canaries; see :func:`plan_strategy`)."""
    spec = _spec_of(opts, spec)
    names = None if target_names is None else list(target_names)  # (read twice, maybe)
    labels, all_targets = _check_choice(wf, opts, names, group, all_targets, labels)
    now = _now()

    def choose(conn: Connection) -> list[_Pick]:
        return _choose_targets(conn, names, group, labels)

    # The targets are chosen, checked and ordered before the write lock is taken: at
    # 150,000 targets that took 1.6 s of the 2.7 s a running rollout's commits waited
    # for. Under the lock, only what could have changed since is read again.
    with store.read() as conn:
        rows = choose(conn)
        # (a group is never renamed: the order stays right while its targets stay in it)
        gnames, orders = _group_names(conn), _group_orders(conn)
    _order(rows, gnames)
    plan, opts = _planned(rows, gnames, orders, spec, opts)
    # (chosen by label: a label changed meanwhile chooses again too)
    by_label = bool(labels or spec.canary_label)
    picked = {(r.id, r.name, r.group_id, r.labels if by_label else "") for r in rows}
    with store.write() as conn:
        if workflow_from_store:
            _workflow_still_stored(conn, wf)
        if failed_in is not None:
            # Its failed and aborted steps never change (G8), but a delete of it may have
            # begun since they were read: not created from a strategy going away.
            try:
                going = _strategy_state(conn, failed_in) in (
                    StrategyState.DELETING,
                    StrategyState.PRUNING,
                )
            except NotFound:
                going = True
            if going:
                raise Conflict(
                    f"--failed-in: strategy {failed_in} was deleted while the strategy "
                    "was being created; nothing was created"
                )
        if not _still_as_read(conn, picked, store.hooks, with_labels=by_label) or (
            spec.planned and _group_orders(conn) != orders
        ):
            rows = choose(conn)  # the fleet changed meanwhile: chosen again, as of now
            gnames, orders = _group_names(conn), _group_orders(conn)
            _order(rows, gnames)
            plan, opts = _planned(rows, gnames, orders, spec, opts)
        _refuse_held(conn, _in_plan(rows, plan), store.hooks)
        sid = _take_ids(conn, strategies)
        first_step = _take_ids(conn, steps, len(plan.order))
        gcaps = _group_caps(conn)
        record_actor(
            conn, f"strategy {sid} created ({wf.name}, {plural(len(plan.order), 'step')})", sid
        )
        conn.execute(
            insert(strategies).values(
                id=sid,
                workflow=wf.name,
                workflow_version=wf.version,
                states=json.dumps(list(wf.state_names)),
                workflow_yaml=wf.yaml_text,
                state=StrategyState.INITIAL.value,
                options=options_to_json(opts),
                group_caps=json.dumps({str(k): v for k, v in gcaps.items()}),
                step_count=len(plan.order),
                details="",
                created_at=now,
                updated_at=now,
                fence=0,
            )
        )
        group_of = {r.id: r.group_id for r in rows}
        # The driver's executemany of plain rows: through SQLAlchemy's of dicts, 100,000
        # steps held the write lock (and every running rollout's commits) twice as long.
        p = store.hooks.placeholder
        conn.exec_driver_sql(
            "INSERT INTO steps (id, strategy_id, target_id, ordinal, stage, group_id, state, "
            f"details, attempt, fence) VALUES ({p}, {p}, {p}, {p}, {p}, {p}, {p}, '', 0, 0)",
            [
                (first_step + i, sid, tid, i, phase, group_of[tid], STEP_INITIAL)
                for i, (tid, phase) in enumerate(plan.order)
            ],
        )
        # its slots: the strategy's and those of each group it has steps of (G7)
        present = {g for tid, _ in plan.order if (g := group_of[tid]) is not None}
        slots.insert_slots(
            conn,
            store.hooks,
            sid,
            opts.effective_parallel,
            {gid: gcaps.get(gid, UNCAPPED_GROUP) for gid in present},
        )
        return sid


def plan_strategy(
    store: Store,
    wf: WorkflowDef,
    opts: StrategyOptions,
    *,
    target_names: Iterable[str] | None = None,
    group: str | None = None,
    all_targets: bool = False,
    labels: dict[str, str] | None = None,
    spec: RolloutSpec | None = None,
) -> dict[str, Any]:
    """What :func:`create_strategy` would create, as data, writing nothing (``strategy
    create --dry-run``): the same checks (bad input, targets held by an active
    strategy are refused alike), then the plan: its stages in order with their groups
    and caps, batch sizes and canaries, the targets left out and why, and the options
    as they would be stored."""
    spec = _spec_of(opts, spec)
    names = None if target_names is None else list(target_names)
    labels, all_targets = _check_choice(wf, opts, names, group, all_targets, labels)
    with store.read() as conn:
        rows = _choose_targets(conn, names, group, labels)
        gnames, orders = _group_names(conn), _group_orders(conn)
        _order(rows, gnames)
        plan, opts = _planned(rows, gnames, orders, spec, opts)
        _refuse_held(conn, _in_plan(rows, plan), store.hooks)
        caps = _group_caps(conn)
    name_of = {r.id: r.name for r in rows}
    group_of = {r.id: r.group_id for r in rows}
    by_phase: dict[int, list[int]] = {}
    for tid, phase in plan.order:
        by_phase.setdefault(phase, []).append(tid)
    stages_out: list[dict[str, Any]] = []
    phase = 0
    for stage in plan.stages or [PlannedStage("all", [], len(rows), [len(rows)])]:
        batches = []
        ids: list[int] = []
        for size in stage.batches:
            phase += 1
            batch_ids = by_phase.get(phase, [])
            ids += batch_ids
            batches.append(
                {"phase": phase, "size": size, "targets": [name_of[t] for t in batch_ids]}
            )
        gids = list(dict.fromkeys(group_of[t] for t in ids))
        stages_out.append(
            {
                "stage": len(stages_out) + 1,
                "name": stage.name,
                "canary": stage.canary,
                "steps": stage.steps,
                "groups": [
                    {"name": gnames[g], "max_parallel": caps[g]} for g in gids if g is not None
                ]
                + ([{"name": "(no group)", "max_parallel": None}] if None in gids else []),
                "max_failures": stage.max_failures,
                "batches": batches,
            }
        )
    return {
        "workflow": wf.name,
        "steps": len(plan.order),
        "max_parallel": opts.effective_parallel,
        "max_failures": opts.failure_limit,
        "stages": stages_out,
        "left_out": [{"target": n, "why": why} for n, why in plan.left_out],
        "stage_wait_s": opts.stage_wait_s,
        "stage_approval": opts.stage_approval,
        "windows": opts.windows,
        "deadline": opts.deadline,
        "earliest_start": _earliest(opts),
    }


def _earliest(opts: StrategyOptions) -> str:
    """When a strategy applied now may start its first step, as the dry run says it."""
    if opts.start_after is None and not opts.windows:
        return "when applied"
    now = _now()
    start = earliest_start(opts.start_after, [parse_window(w) for w in opts.windows], now)
    return "when applied" if start <= now else shown_time(start)


def _spec_of(opts: StrategyOptions, spec: RolloutSpec | None) -> RolloutSpec:
    """The rollout's order: ``spec`` as given, or stages by group from the options."""
    if spec is None:
        return RolloutSpec(stages_by_group=opts.stages_by_group)
    if spec.stages and spec.stages_by_group:
        raise InputError("--stage and --stages-by-group: give one of them")
    return spec


def _check_choice(
    wf: WorkflowDef,
    opts: StrategyOptions,
    names: list[str] | None,
    group: str | None,
    all_targets: bool,
    labels: dict[str, str] | None,
) -> tuple[dict[str, str] | None, bool]:
    """Refuse options that contradict each other; returns the labels and whether all
    targets are chosen (``--label`` alone: of all)."""
    _check_max_parallel(opts.max_parallel)
    if opts.max_failures is not None and opts.max_failures < 0:
        raise InputError(f"--max-failures: must not be negative, got {opts.max_failures}")
    if labels and names is not None:
        raise InputError(
            "--label: picks among the targets of --group, or of all; not with --targets "
            "(a named target without the label would be left out without a word)"
        )
    if labels and group is None:
        all_targets = True
    chosen = sum([names is not None, group is not None, all_targets])
    if chosen != 1:
        raise InputError(
            "choose the targets with exactly one of --targets, --group, --all or --failed-in "
            "(--label alone: all targets with those labels)"
        )
    wf.with_timeouts(opts.timeouts_s)  # validates the state names
    return labels, all_targets


def _planned(
    rows: list[_Pick],
    gnames: dict[int | None, str],
    orders: dict[str, int | None],
    spec: RolloutSpec,
    opts: StrategyOptions,
) -> tuple[Plan, StrategyOptions]:
    """The plan of the chosen targets (in the strategy's order), and the options with
    what depends on how many steps there are: the plan, a percent failure limit."""
    chosen = [
        PlanTarget(
            r.id,
            r.name,
            gnames.get(r.group_id) if r.group_id is not None else None,
            json.loads(r.labels) if spec.canary_label else {},
        )
        for r in rows
    ]
    plan = plan_rollout(chosen, spec, group_order=orders)
    if (opts.stage_wait_s or opts.stage_approval) and len(plan.stages) < 2:
        which = "--stage-wait" if opts.stage_wait_s else "--stage-approval"
        raise InputError(
            f"{which}: the strategy has one stage; it holds between stages (--stage, "
            "--stages-by-group, --canary)"
        )
    if opts.max_failures_percent:
        limit = parse_amount(opts.max_failures_percent, "--max-failures").limit_of(len(plan.order))
        opts = replace(opts, max_failures=limit)
    if not spec.planned:
        return plan, opts
    return plan, replace(opts, plan=plan.stages, left_out=len(plan.left_out))


def _in_plan(rows: list[_Pick], plan: Plan) -> list[_Pick]:
    """The chosen targets the plan runs (not those left out of every stage)."""
    if not plan.left_out:
        return rows
    ids = {tid for tid, _ in plan.order}
    return [r for r in rows if r.id in ids]


def _refuse_held(conn: Connection, rows: list[_Pick], hooks: DialectHooks) -> None:
    """Refuse targets already in an active strategy, naming each by strategy."""
    held = _held_by_active(conn, [r.id for r in rows], hooks=hooks)
    if not held:
        return
    name_of = {r.id: r.name for r in rows}
    problems = []
    for busy_sid, tids in held.items():
        state = _strategy_state(conn, busy_sid)
        how = (
            f"it was never applied: 'fleetwave strategy delete {busy_sid}' frees its targets"
            if state == StrategyState.INITIAL
            else _how_it_ends(busy_sid, state, "it frees its targets")
        )
        busy = sorted(name_of[t] for t in tids)
        who = (
            f"target {busy[0]}"
            if len(busy) == 1
            else f"{len(busy)} targets ({', '.join(busy[:5])}"
            + (f" and {len(busy) - 5} more)" if len(busy) > 5 else ")")
        )
        problems.append(f"{who}: already in active strategy {busy_sid} ({state}); {how}")
    raise Conflict("; ".join(problems))


def _group_caps(conn: Connection) -> dict[int, int]:
    return {
        int(g.id): 1 if g.apply_type == ApplyType.SERIAL.value else int(g.max_parallel)
        for g in conn.execute(select(groups))
    }


def _group_orders(conn: Connection) -> dict[str, int | None]:
    """Every group's stage order (``group add --order``; None: none), by name."""
    return {
        str(g.name): g.stage_order
        for g in conn.execute(select(groups.c.name, groups.c.stage_order))
    }


def _workflow_still_stored(conn: Connection, wf: WorkflowDef) -> None:
    """A stored workflow read before the write lock (``wf``) is still stored as read: one
    replaced or deleted meanwhile by another command refuses the new strategy (it was
    made from the copy read before, and both commands said they succeeded)."""
    row = conn.execute(
        select(workflows.c.version, workflows.c.source_yaml).where(workflows.c.name == wf.name)
    ).first()
    if row is None:
        raise Conflict(
            f"--workflow: workflow '{wf.name}' was deleted while the strategy was being "
            "created; nothing was created"
        )
    if row.source_yaml != wf.yaml_text:
        raise Conflict(
            f"--workflow: workflow '{wf.name}' was replaced (version {wf.version} by "
            f"{row.version}) while the strategy was being created; nothing was created: "
            "create it again to use the new version"
        )


class _Pick(NamedTuple):
    """A target chosen for a new strategy (a plain tuple: 150,000 are sorted and read)."""

    id: int
    name: str
    group_id: int | None
    labels: str


def _choose_targets(
    conn: Connection,
    target_names: Iterable[str] | None,
    group: str | None,
    labels: dict[str, str] | None,
) -> list[_Pick]:
    """The targets a new strategy is over; bad input is
    refused with every problem of a list at once."""
    q = select(targets.c.id, targets.c.name, targets.c.group_id, targets.c.labels)
    if target_names is not None:
        given = [n.strip() for n in target_names if n.strip()]
        names = list(dict.fromkeys(given))
        if not names:
            raise InputError("--targets: no target names given")
        problems = []
        if len(names) < len(given):
            # A name given twice is most often a typo for another target, which
            # would then be left out of the rollout without a word.
            counts = Counter(given)
            twice = [n for n in names if counts[n] > 1]
            problems.append(f"{_some(twice)} given more than once")
        rows = []
        for start in range(0, len(names), 500):
            rows += list(conn.execute(q.where(targets.c.name.in_(names[start : start + 500]))))
        found = {r.name for r in rows}
        missing = [n for n in names if n not in found]
        if missing:
            which = "target" if len(missing) == 1 else "targets"
            problems.append(f"no {which} named {_some(missing)}")
        if problems:
            # Every problem of the list at once: fixing one should not reveal another.
            error = InputError if not missing else NotFound
            raise error("--targets: " + "; ".join(problems))
    elif group is not None:
        gid = _group_ids(conn).get(group)
        if gid is None:
            raise NotFound(f"--group: no group named '{group}'")
        rows = list(conn.execute(q.where(targets.c.group_id == gid)))
        if not rows:
            raise InputError(f"--group: group '{group}' has no targets")
    else:
        rows = list(conn.execute(q))
        if not rows:
            raise InputError(
                f"{'--label' if labels else '--all'}: there are no targets; add some "
                "with 'fleetwave target add'"
            )
    if labels:
        rows = [r for r in rows if has_labels(json.loads(r.labels), labels)]
        if not rows:
            among = f"of group '{group}'" if group is not None else ""
            raise InputError(
                f"--label: no target {among}{' ' if among else ''}has "
                + ", ".join(f"{k}={v}" for k, v in labels.items())
            )
    return [_Pick(*r) for r in rows]


def _group_names(conn: Connection) -> dict[int | None, str]:
    return {int(g.id): str(g.name) for g in conn.execute(select(groups.c.id, groups.c.name))}


def _order(rows: list[_Pick], gnames: dict[int | None, str]) -> None:
    """A strategy's order: by group name (ungrouped last), then target name."""
    rows.sort(key=lambda r: (r.group_id is None, gnames.get(r.group_id, ""), r.name))


def _still_as_read(
    conn: Connection,
    picked: set[tuple[int, str, int | None, str]],
    hooks: DialectHooks,
    *,
    with_labels: bool,
) -> bool:
    """Whether the targets chosen before the write lock, ``picked`` as (id, name,
    group_id, labels or ""), are all still there, with the same name and group (and
    labels, when chosen by them). Targets added since: the strategy was created just
    before, as good a time as any."""
    columns = "id, name, group_id, " + ("labels" if with_labels else "''")
    if len(picked) > 2_000:  # one pass over the fleet beats thousands of lookups
        return picked <= set(_driver_rows(conn, f"SELECT {columns} FROM targets", ()))
    ids = [row[0] for row in picked]
    now: set[tuple[int, str, int | None, str]] = set()
    for start in range(0, len(ids), 500):
        chunk = ids[start : start + 500]
        sql = f"SELECT {columns} FROM targets WHERE id IN ({hooks.placeholders(len(chunk))})"
        now.update(_driver_rows(conn, sql, chunk))
    return picked <= now


def _driver_rows(conn: Connection, sql: str, params: Sequence[Any]) -> list[Any]:
    """``sql``'s rows as the DBAPI driver gives them (plain tuples): at 150,000 rows
    SQLAlchemy's own took half a second more."""
    cur = conn.connection.driver_connection.cursor()  # type: ignore[union-attr]
    try:
        cur.execute(sql, tuple(params))
        return list(cur.fetchall())
    finally:
        cur.close()


def _strategy_state(conn: Connection, sid: int) -> str:
    row = conn.execute(select(strategies.c.state).where(strategies.c.id == sid)).first()
    if row is None:
        raise NotFound(f"strategy {sid} not found")
    return str(row[0])


def apply_strategy(store: Store, sid: int, *, resume: bool = True) -> str:
    """Mark the strategy applying; returns the state it was in.

    ``resume``: a paused strategy is resumed too; without it, it is left paused (an
    ``apply --wait`` that drives a rollout again after a crash does not undo a pause an
    operator made meanwhile).
    """
    with store.write() as conn:
        state = _strategy_state(conn, sid)
        if state == StrategyState.INITIAL or (resume and state == StrategyState.PAUSED):
            conn.execute(
                update(strategies)
                .where(strategies.c.id == sid, strategies.c.state == state)
                .values(state=StrategyState.APPLYING.value, updated_at=_now())
            )
            notify(conn, "strategy", sid)
            record_actor(conn, f"strategy {sid} applied (it was {state})", sid)
        elif state == StrategyState.DELETING:
            raise Conflict(
                f"strategy {sid}: is being deleted; 'fleetwave strategy delete {sid}' finishes it"
            )
        elif state not in (
            StrategyState.APPLYING,
            StrategyState.PAUSED,
            StrategyState.WAITING_APPROVAL,
            StrategyState.ABORT_REQUESTED,
            StrategyState.ABORTING,
        ):
            raise Conflict(
                f"strategy {sid}: is {state} (over); apply starts an initial strategy or "
                "resumes one still running"
            )
        return state


def pause_strategy(store: Store, sid: int) -> str:
    """applying -> paused: no new step starts; steps in flight go on to their end.

    Returns the state it was in (``paused`` again is not an error). The conductor's
    commit that would start a step reads this state, so nothing starts once this returns.
    """
    hint = {StrategyState.INITIAL.value: " (apply it first)", **_APPROVAL_HINT}
    return _switch_state(
        store, sid, StrategyState.APPLYING, StrategyState.PAUSED, "an applying", "paused", hint
    )


def resume_strategy(store: Store, sid: int) -> str:
    """paused -> applying; returns the state it was in (``applying`` again is not an error)."""
    return _switch_state(
        store,
        sid,
        StrategyState.PAUSED,
        StrategyState.APPLYING,
        "a paused",
        "resumed",
        _APPROVAL_HINT,
    )


#: what pause and resume say of a strategy waiting for approval
_APPROVAL_HINT = {
    StrategyState.WAITING_APPROVAL.value: (
        " (nothing runs while it waits for approval: 'fleetwave strategy approve "
        "ID' lets the next stage start, 'fleetwave strategy abort ID' ends it)"
    )
}


def approve_strategy(store: Store, sid: int, by: str) -> dict[str, Any]:
    """waiting-approval -> applying: the next stage may start. Recorded as an event
    naming the stage and who approved it. Refused (Conflict) when it is not waiting for
    an approval."""
    with store.write() as conn:
        row = conn.execute(
            select(strategies.c.state, strategies.c.options).where(strategies.c.id == sid)
        ).first()
        if row is None:
            raise NotFound(f"strategy {sid} not found")
        if row.state != StrategyState.WAITING_APPROVAL:
            raise Conflict(
                f"strategy {sid}: is {row.state}, not waiting for approval; nothing to approve"
            )
        plan = options_from_json(row.options).plan
        # the stage that waits: the first with a step not ended (the ones before have all
        # ended, or it would not wait)
        open_phase = conn.execute(
            select(func.min(steps.c.stage)).where(
                steps.c.strategy_id == sid, steps.c.state.not_in(sorted(STEP_TERMINAL))
            )
        ).scalar()
        number = phase_stages(plan)[int(open_phase)] + 1 if open_phase is not None else 0
        now = _now()
        details = approval_text(number, plan, by) if number else f"approved by {by}"
        conn.execute(
            update(strategies)
            .where(strategies.c.id == sid, strategies.c.state == row.state)
            .values(state=StrategyState.APPLYING.value, details="", updated_at=now)
        )
        conn.execute(
            insert(events).values(
                at=now, strategy_id=sid, kind=APPROVED_EVENT, details=details, conductor=None
            )
        )
        record_actor(conn, f"strategy {sid} approved", sid)
        return {"id": sid, "stage": number, "approved_by": by, "details": details}


def _switch_state(
    store: Store,
    sid: int,
    src: StrategyState,
    dst: StrategyState,
    which: str,
    done: str,
    hints: dict[str, str],
) -> str:
    """``src`` -> ``dst`` in one transaction; already ``dst`` is not an error; any other
    state is refused, naming it (``hints``: a word more for some states)."""
    with store.write() as conn:
        state = _strategy_state(conn, sid)
        if state == src:
            conn.execute(
                update(strategies)
                .where(strategies.c.id == sid, strategies.c.state == state)
                .values(state=dst.value, updated_at=_now())
            )
            notify(conn, "strategy", sid)
            record_actor(conn, f"strategy {sid} {done}", sid)
        elif state != dst:
            raise Conflict(
                f"strategy {sid}: is {state}; only {which} strategy can be {done}"
                + hints.get(state, "")
            )
        return state


#: an abort asked for again: already on its way, or done (the command succeeds, saying so)
ABORT_UNDER_WAY = frozenset(
    {StrategyState.ABORT_REQUESTED, StrategyState.ABORTING, StrategyState.ABORTED}
)


def request_abort(store: Store, sid: int) -> str | None:
    """Ask for the strategy's abort. None when this call asked for it; ``initial`` when
    it was never applied (this call aborted it and every step, at once); the state it
    is in when an abort was asked for before (abort-requested, aborting, aborted):
    asking twice is no error (a script, or two operators, may). Refused (Conflict) once
    it ended otherwise (complete, failed) or is being deleted."""
    with store.write() as conn:
        state = _strategy_state(conn, sid)
        if state in ABORT_UNDER_WAY:
            return state
        if state == StrategyState.INITIAL:
            # Nothing ever ran: every step is aborted at once, by this transaction.
            now = _now()
            ids = [
                r[0]
                for r in conn.execute(
                    select(steps.c.id).where(steps.c.strategy_id == sid).order_by(steps.c.id)
                )
            ]
            conn.execute(
                update(steps)
                .where(steps.c.strategy_id == sid)
                .values(
                    state="aborted", details="strategy aborted before it started", finished_at=now
                )
            )
            conn.execute(
                insert(journal),
                [
                    {
                        "strategy_id": sid,
                        "step_id": i,
                        "at": now,
                        "conductor": "cli",
                        "from_state": STEP_INITIAL,
                        "to_state": "aborted",
                        "fence": 0,
                        "details": "strategy aborted before it started",
                    }
                    for i in ids
                ],
            )
            conn.execute(
                update(strategies)
                .where(strategies.c.id == sid)
                .values(
                    state=StrategyState.ABORTED.value,
                    updated_at=now,
                    details="aborted before it started",
                )
            )
            # No conductor will ever drive it: callbacks stored for its steps are
            # answered here (G6), as a conductor's end of a strategy answers its own.
            conn.execute(
                update(callbacks)
                .where(callbacks.c.strategy_id == sid, callbacks.c.outcome.is_(None))
                .values(
                    outcome="ignored",
                    reason="strategy aborted before it started",
                    processed_at=now,
                )
            )
            record_actor(conn, f"strategy {sid} aborted (it was never applied)", sid)
            return StrategyState.INITIAL.value
        if state not in (
            StrategyState.APPLYING,
            StrategyState.PAUSED,
            StrategyState.WAITING_APPROVAL,
        ):
            raise Conflict(
                f"strategy {sid}: is {state}; only a strategy not yet ended can be aborted"
            )
        conn.execute(
            update(strategies)
            .where(strategies.c.id == sid, strategies.c.state == state)
            .values(state=StrategyState.ABORT_REQUESTED.value, updated_at=_now())
        )
        notify(conn, "strategy", sid)
        record_actor(conn, f"strategy {sid} abort requested", sid)
        return None


def _take_ids(conn: Connection, table: Table, count: int = 1) -> int:
    """The first of ``count`` ids of ``table`` never given before, also after deletes
    (in the caller's write transaction, which holds the write lock: two creations
    cannot get the same ids). Strategy and step ids are never reused: a ticket or a log
    line names one rollout, and a late callback for a deleted strategy's step finds no
    step rather than a new strategy's step that got its id."""
    last = conn.execute(
        select(id_counters.c.last_id).where(id_counters.c.name == table.name)
    ).scalar_one_or_none()
    highest = conn.execute(select(func.coalesce(func.max(table.c.id), 0))).scalar_one()
    first = max(int(last or 0), int(highest)) + 1
    end = first + count - 1
    if last is None:
        conn.execute(insert(id_counters).values(name=table.name, last_id=end))
    else:
        conn.execute(
            update(id_counters).where(id_counters.c.name == table.name).values(last_id=end)
        )
    return first


#: rows moved or removed per transaction when a strategy is deleted or pruned: each
#: holds the write lock for some milliseconds, so running rollouts barely notice
DELETE_CHUNK = 5000
#: the longest pause between two chunks (each as long as its chunk took)
DELETE_PAUSE_MAX_S = 0.05


def in_chunks(store: Store, one_chunk: Callable[[Connection, int], int], chunk: int) -> None:
    """Run ``one_chunk(conn, chunk)`` a transaction at a time until it does fewer than
    ``chunk`` rows: one transaction for a strategy of 100,000 targets (600,000 journal
    rows) would hold the database's write lock for seconds, and every running rollout's
    commits with it."""
    while True:
        began = time.monotonic()
        with store.write() as conn:
            done = one_chunk(conn, chunk)
        if done < chunk:
            return
        # SQLite's lock is not fair: taken again at once, a conductor waiting to commit
        # (polling every few ms) found it held until the whole delete was done (a
        # rollout stood still for 1.3 s). As long a pause as the chunk took lets it in.
        time.sleep(min(DELETE_PAUSE_MAX_S, time.monotonic() - began))


#: what a deleted strategy's step keeps (``deleted_steps``): the step as it ended
_KEPT_STEP_COLUMNS = (
    "id", "strategy_id", "target_id", "ordinal", "stage", "group_id", "state", "details",
    "started_at", "finished_at", "attempt",
)  # fmt: skip


def _archive_steps(conn: Connection, sid: int, chunk: int) -> int:
    """Move up to ``chunk`` of the strategy's steps to ``deleted_steps`` (with their
    target's name), in one transaction; how many moved."""
    some = (
        select(
            *(steps.c[name] for name in _KEPT_STEP_COLUMNS),
            targets.c.name,
        )
        .join(targets, targets.c.id == steps.c.target_id)
        .where(steps.c.strategy_id == sid)
        .order_by(steps.c.id)
        .limit(chunk)
    )
    rows = conn.execute(some).all()
    if not rows:
        return 0
    conn.execute(
        insert(deleted_steps),
        [dict(zip((*_KEPT_STEP_COLUMNS, "target"), r, strict=True)) for r in rows],
    )
    conn.execute(delete(steps).where(steps.c.id.in_([r.id for r in rows])))
    return len(rows)


#: why the callbacks of a deleted strategy that no conductor had handled are ignored
DELETED_REASON = "strategy deleted"


def delete_strategy(store: Store, sid: int, *, chunk: int | None = None) -> None:
    """Delete an ended (or never applied) strategy: its steps leave the working tables,
    its history stays for audit.

    The strategy is marked ``deleting`` first, then its steps move to ``deleted_steps``
    a chunk per transaction (:func:`in_chunks`), then its slots go and it is marked
    ``deleted``. Its journal, attempts, events and callbacks stay (``history`` and
    ``events`` still answer) until ``fleetwave prune`` drops them; its row stays too, so
    its id names this rollout for good. Interrupted (Ctrl-C, a crash), it stays
    ``deleting``; deleting it again finishes. Deleted already: NotFound.
    """
    chunk = chunk or DELETE_CHUNK
    with store.write() as conn:
        state = _strategy_state(conn, sid)
        if state == StrategyState.DELETED:
            raise NotFound(
                f"strategy {sid}: deleted already (its history is kept until 'fleetwave prune')"
            )
        if state == StrategyState.PRUNING:
            raise NotFound(
                f"strategy {sid}: deleted already, its history partly pruned "
                "('fleetwave prune' again finishes it)"
            )
        if state not in (
            StrategyState.INITIAL,
            StrategyState.COMPLETE,
            StrategyState.FAILED,
            StrategyState.ABORTED,
            StrategyState.DELETING,
        ):
            raise Conflict(
                f"strategy {sid}: is {state}; " + _how_it_ends(sid, state, "it can be deleted")
            )
        if state != StrategyState.DELETING:
            # updated_at stays when it ended: ``prune --before`` goes by that
            conn.execute(
                update(strategies)
                .where(strategies.c.id == sid)
                .values(state=StrategyState.DELETING.value, deleted_at=_now(), deleted_from=state)
            )
    # Once a step is gone no callback can be stored for it; one stored before and not
    # handled is closed as ignored below.
    in_chunks(store, lambda conn, n: _archive_steps(conn, sid, n), chunk)
    with store.write() as conn:
        slots.delete_slots(conn, store.hooks, [sid])
        now = _now()
        conn.execute(
            update(callbacks)
            .where(callbacks.c.strategy_id == sid, callbacks.c.outcome.is_(None))
            .values(outcome="ignored", reason=DELETED_REASON, processed_at=now)
        )
        # its steps' agent tokens are of no use any more (working rows, not history)
        conn.execute(delete(agent_tokens).where(agent_tokens.c.strategy_id == sid))
        conn.execute(
            update(strategies)
            .where(strategies.c.id == sid)
            .values(state=StrategyState.DELETED.value)
        )
        record_actor(conn, f"strategy {sid} deleted", sid)
