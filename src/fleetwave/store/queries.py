"""Read models for the CLI and API: plain dicts, ready to print as a table or JSON."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from itertools import islice
from typing import Any

from sqlalchemy import Connection, Table, and_, case, false, func, null, select

from fleetwave.domain.errors import InputError, NotFound
from fleetwave.domain.models import (
    STEP_ABORTED,
    STEP_COMPLETE,
    STEP_FAILED,
    STEP_INITIAL,
    STEP_TERMINAL,
    STRATEGY_TERMINAL,
    StrategyState,
    has_labels,
    shown,
)
from fleetwave.domain.registry import get_workflow
from fleetwave.domain.rollout import APPROVED_EVENT, PlannedStage, stage_progress, time_left_s
from fleetwave.domain.workflow import WorkflowError
from fleetwave.domain.yaml_workflow import parse_workflow_yaml
from fleetwave.store import leases
from fleetwave.store.admin import options_from_json
from fleetwave.store.db import Store
from fleetwave.store.runtime import DRIVEN_STATES, conductor_gone
from fleetwave.store.schema import (
    attempts,
    callbacks,
    conductors,
    deleted_steps,
    events,
    groups,
    journal,
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


#: rows read per transaction by the iterators below: a list printed into a pager that
#: waits must not hold a read transaction open (SQLite could not reset its WAL, and the
#: conductors' writes would grow it without end)
PAGE_ROWS = 5000


def _pages(store: Store, q: Any, key: Any, after: Any, rows: int = PAGE_ROWS) -> Iterator[Any]:
    """Rows of ``q`` in ``key`` order (unique), ``rows`` per read transaction."""
    while True:
        with store.read() as conn:
            page = conn.execute(q.where(key > after).order_by(key).limit(rows)).all()
        yield from page
        if len(page) < rows:
            return
        after = getattr(page[-1], key.key)


@dataclass(frozen=True)
class Page:
    """One page of a long list (the API's cursor pagination): its rows, and the key to
    ask for the next page after (None: this was the last)."""

    rows: list[dict[str, Any]]
    next_after: Any


def _page(keyed: Iterator[tuple[Any, dict[str, Any]]], limit: int) -> Page:
    """The first ``limit`` of rows given with their keys (one more is read, to know
    whether there is a next page)."""
    got = list(islice(keyed, limit + 1))
    more = len(got) > limit
    return Page([row for _, row in got[:limit]], got[limit - 1][0] if more else None)


def iter_targets(
    store: Store,
    group: str | None = None,
    labels: dict[str, str] | None = None,
    *,
    as_text: bool = False,
    after: str = "",
    rows: int = PAGE_ROWS,
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


def get_target(store: Store, name: str) -> dict[str, Any]:
    with store.read() as conn:
        r = conn.execute(_target_query().where(targets.c.name == name)).first()
        if r is None:
            raise NotFound(f"target '{name}' not found")
        out = _target_dict(r)
        # its step in each strategy: the strategy's state and the step's, named apart
        # (one "state" column read as the strategy's)
        out["strategies"] = [
            {
                "strategy": s.strategy_id,
                "strategy_state": s.strategy_state,
                "step": s.id,
                "step_state": s.state,
                "details": s.details,
            }
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
            {
                "strategy": s.strategy_id,
                "strategy_state": s.strategy_state,
                "step": s.id,
                "step_state": s.state,
                "details": s.details,
            }
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


def step_counts(store: Store, sid: int) -> dict[str, int]:
    with store.read() as conn:
        return _step_counts(conn, sid)


def _step_counts(conn: Any, sid: int) -> dict[str, int]:
    counts: dict[str, int] = {}
    for table in _step_tables(conn, sid):
        for state, n in conn.execute(
            select(table.c.state, func.count())
            .where(table.c.strategy_id == sid)
            .group_by(table.c.state)
        ):
            counts[str(state)] = counts.get(str(state), 0) + int(n)
    return counts


#: strategies whose steps left the working tables (``strategy delete``), all of them or
#: some (being deleted): their steps as they ended are in ``deleted_steps``
KEPT_STATES = frozenset({StrategyState.DELETING, StrategyState.DELETED, StrategyState.PRUNING})


def _kept(conn: Any, sid: int) -> bool:
    """Whether strategy ``sid`` was deleted (or is being deleted): its steps, some or
    all, are kept in ``deleted_steps``, its history where it was."""
    state = conn.execute(select(strategies.c.state).where(strategies.c.id == sid)).scalar()
    return state in KEPT_STATES


def _step_tables(conn: Any, sid: int) -> tuple[Table, ...]:
    """Where strategy ``sid``'s steps are: the working table, and for one deleted (or
    being deleted) the kept steps too."""
    return (steps, deleted_steps) if _kept(conn, sid) else (steps,)


def _journal_named(conn: Any, sid: int, table: Table) -> tuple[Any, Any]:
    """What to read ``table`` (journal, events) of strategy ``sid`` from, and its rows'
    target name: through the step and its target, and for a deleted strategy through
    the kept step (the target may be deleted since: the name it had then)."""
    if not _kept(conn, sid):
        return (
            table.outerjoin(steps, steps.c.id == table.c.step_id).outerjoin(
                targets, targets.c.id == steps.c.target_id
            ),
            targets.c.name,
        )
    return (
        table.outerjoin(steps, steps.c.id == table.c.step_id)
        .outerjoin(targets, targets.c.id == steps.c.target_id)
        .outerjoin(deleted_steps, deleted_steps.c.id == table.c.step_id),
        func.coalesce(targets.c.name, deleted_steps.c.target),
    )


def steps_ended(counts: dict[str, int]) -> int:
    """Of a strategy's steps by state (:func:`step_counts`), how many have ended."""
    return sum(n for state, n in counts.items() if state in STEP_TERMINAL)


def _shown_json(raw: Any) -> Any:
    """A stored JSON field for show and list: parsed, or, if a hand edit or another
    tool left it unreadable, its text marked so (the rest of the row is still shown;
    ``fleetwave check`` reports it)."""
    try:
        return json.loads(raw)
    except (TypeError, ValueError):
        return f"(unreadable: {raw!r})"


def _cap_taken(raw_caps: Any, group_id: int) -> Any:
    """The cap a strategy took for a group when it was created (as stored)."""
    caps = _shown_json(raw_caps)
    return caps.get(str(group_id)) if isinstance(caps, dict) else caps


def _strategy_dict(r: Any) -> dict[str, Any]:
    opts = _shown_json(r.options)
    if not isinstance(opts, dict):
        opts = dict.fromkeys(
            ("max_parallel", "apply_type", "stop_on_failure", "max_failures"), opts
        )
    return {
        "id": r.id,
        "workflow": r.workflow,
        # which version it runs: a stored workflow replaced since keeps its own copy here
        "workflow_version": r.workflow_version,
        "state": r.state,
        "steps": r.step_count,
        "max_parallel": opts.get("max_parallel"),
        "apply_type": opts.get("apply_type"),
        "stop_on_failure": opts.get("stop_on_failure"),
        "max_failures": opts.get("max_failures"),
        "details": r.details,
        "created_at": r.created_at,
        "updated_at": r.updated_at,
        "owner": r.owner,
        # when ``strategy delete`` began (its history kept until ``fleetwave prune``)
        "deleted_at": r.deleted_at,
        "deleted_from": r.deleted_from,
    }


def list_strategies(
    store: Store, *, brief: bool = False, states: Sequence[str] = ()
) -> list[dict[str, Any]]:
    """Every strategy (or those in ``states``), with its steps by state (``step_states``,
    as ``strategy show`` has them), how many have ended (``done``) and who drives
    it (``driven_by``, as ``strategy show`` says it; None once it needs no driving):
    a rollout whose conductor died lists as such, not as one going well. ``brief``:
    ``driven_by`` as a list's column says it (:attr:`Driving.brief`).

    One read (a snapshot), whatever the number of strategies: the conductors are read
    once for all of them."""
    now = time.time()
    with store.read() as conn:
        q = select(strategies).order_by(strategies.c.id)
        if states:
            q = q.where(strategies.c.state.in_(list(states)))
        else:  # deleted ones only when asked for (``--state deleted``)
            q = q.where(strategies.c.state.not_in([StrategyState.DELETED, StrategyState.PRUNING]))
        rows = conn.execute(q).all()
        counts: dict[int, dict[str, int]] = {}
        retrying: dict[int, int] = {}
        retry = and_(steps.c.not_started, steps.c.attempt > 1)
        for sid, state, waits, n in conn.execute(
            select(steps.c.strategy_id, steps.c.state, retry, func.count()).group_by(
                steps.c.strategy_id, steps.c.state, retry
            )
        ):
            mine = counts.setdefault(int(sid), {})
            mine[str(state)] = mine.get(str(state), 0) + int(n)
            if waits and state != STEP_INITIAL and state not in STEP_TERMINAL:
                retrying[int(sid)] = retrying.get(int(sid), 0) + int(n)
        kept = [int(r.id) for r in rows if r.state in KEPT_STATES]
        for sid, state, n in (
            conn.execute(
                select(deleted_steps.c.strategy_id, deleted_steps.c.state, func.count())
                .where(deleted_steps.c.strategy_id.in_(kept))
                .group_by(deleted_steps.c.strategy_id, deleted_steps.c.state)
            )
            if kept
            else ()
        ):
            mine = counts.setdefault(int(sid), {})
            mine[str(state)] = mine.get(str(state), 0) + int(n)
        known = _Conductors.read(conn, now)
    out = []
    for r in rows:
        item = _strategy_dict(r)
        item["step_states"] = counts.get(int(r.id), {})
        item["done"] = steps_ended(item["step_states"])
        # steps between two attempts of a state, waiting out its backoff (as `strategy
        # show` counts them): a rollout that retries does not look idle
        item["waiting_to_retry"] = retrying.get(int(r.id), 0)
        who = _driving(r, now, known)
        item["driven_by"] = who.brief if brief else who.text
        out.append(item)
    return out


#: a conductor that has not renewed its leases for this long is not serving (a
#: conductor renews every third of its lease, and at least every 10 s)
SERVING_WITHIN_S = 30.0


def serving_conductors(store: Store, now: float | None = None) -> list[dict[str, Any]]:
    """Conductors that drive every applying strategy (``fleetwave serve``) and are alive:
    not stopped, renewed lately, and (on this host) their process is there."""
    now = time.time() if now is None else now
    with store.read() as conn:
        return list(_Conductors.read(conn, now).serving)


def list_conductors(store: Store, now: float | None = None) -> list[dict[str, Any]]:
    """Every conductor the database knows, newest first: where it runs, when it started
    and last renewed its leases, what it holds, and its state: ``active``, ``draining``
    (a clean stop under way), ``stopped`` (stopped cleanly) or ``gone`` (its process
    is gone, it runs under an earlier boot's clock, or it has not renewed for
    SERVING_WITHIN_S). Rows stay for the record."""
    now = time.time() if now is None else now
    with store.read() as conn:
        name, _ = leases.reader(conn)
        rows = conn.execute(select(conductors).order_by(conductors.c.started_at.desc())).all()
        held: dict[str, int] = {
            str(owner): int(n)
            for owner, n in conn.execute(
                select(steps.c.owner, func.count())
                .where(steps.c.owner.is_not(None))
                .group_by(steps.c.owner)
            )
        }
        owning: dict[str, int] = {
            str(owner): int(n)
            for owner, n in conn.execute(
                select(strategies.c.owner, func.count())
                .where(strategies.c.owner.is_not(None))
                .group_by(strategies.c.owner)
            )
        }
    out = []
    for r in rows:
        if r.stopped_at is not None:
            state = "stopped"
        elif (
            conductor_gone(r.hostname, r.pid, None)
            or r.lease_clock != name  # (as claims judge it: runtime.dead_conductors)
            or r.heartbeat_at < now - SERVING_WITHIN_S
        ):
            state = "gone"
        elif r.draining_at is not None:
            state = "draining"
        else:
            state = "active"
        out.append(
            {
                "id": r.id,
                "host": shown_host(r.hostname),
                "pid": r.pid,
                "state": state,
                "serves_all": bool(r.serves_all),
                "strategies": owning.get(r.id, 0),
                "steps": held.get(r.id, 0),
                "started_at": r.started_at,
                "heartbeat_at": r.heartbeat_at,
                "stopped_at": r.stopped_at,
            }
        )
    return out


def running_conductors(store: Store, now: float | None = None) -> list[dict[str, Any]]:
    """Conductors of any kind (``serve``, ``apply --wait``, ``demo``) alive on this
    database: not stopped, renewed lately, and (on this host) their process is there.

    Plain SQL on columns every schema revision has: ``init`` asks it before upgrading.
    """
    now = time.time() if now is None else now
    with store.read() as conn:
        rows = conn.exec_driver_sql(
            "SELECT id, hostname, pid FROM conductors "
            f"WHERE stopped_at IS NULL AND heartbeat_at >= {store.hooks.placeholder} "
            "ORDER BY id",
            (now - SERVING_WITHIN_S,),
        ).all()
    return [
        {"id": r.id, "hostname": r.hostname, "pid": r.pid}
        for r in rows
        if not conductor_gone(r.hostname, r.pid, None)
    ]


@dataclass(frozen=True)
class _Conductors:
    """The conductors as one read saw them: who is gone, who serves the database."""

    gone: frozenset[str]
    present: frozenset[str]
    #: id, hostname and pid of each serving one (see :func:`serving_conductors`)
    serving: tuple[dict[str, Any], ...]
    #: each known one as named for an operator (:func:`conductor_named`)
    where: dict[str, str]
    #: each one's lease clock, and this host's (its name, and its reading)
    clocks: dict[str, str | None]
    lease_clock: tuple[str, float]

    def named(self, cid: str) -> str:
        """A conductor as an operator finds it: its id, host and process."""
        return self.where.get(cid, cid)

    @classmethod
    def read(cls, conn: Any, now: float) -> _Conductors:
        rows = conn.execute(
            select(
                conductors.c.id,
                conductors.c.hostname,
                conductors.c.pid,
                conductors.c.stopped_at,
                conductors.c.heartbeat_at,
                conductors.c.serves_all,
                conductors.c.lease_clock,
            ).order_by(conductors.c.id)
        ).all()
        name, read_clock = leases.reader(conn)
        gone = {r.id for r in rows if conductor_gone(r.hostname, r.pid, r.stopped_at)}
        serving = tuple(
            {"id": r.id, "hostname": r.hostname, "pid": r.pid}
            for r in rows
            if r.serves_all and r.id not in gone and r.heartbeat_at >= now - SERVING_WITHIN_S
        )
        where = {r.id: conductor_named(r._asdict()) for r in rows}
        clocks = {r.id: r.lease_clock for r in rows}
        return cls(
            frozenset(gone),
            frozenset(r.id for r in rows),
            serving,
            where,
            clocks,
            (name, read_clock()),
        )

    def lease_left(self, owner: str | None, lease_expires_at: float | None) -> float | None:
        """Seconds left of ``owner``'s lease (negative: run out that long ago); None when
        there is none, or it is on a clock this host cannot read (another boot's)."""
        if owner is None or lease_expires_at is None:
            return None
        if self.clocks.get(owner) != self.lease_clock[0]:
            return None
        return float(lease_expires_at) - self.lease_clock[1]

    def holds(self, owner: str | None, lease_expires_at: float | None) -> bool:
        """Whether ``owner`` holds a lease that expires then: alive, and not run out."""
        left = self.lease_left(owner, lease_expires_at)
        return owner is not None and left is not None and left > 0 and not self.owner_gone(owner)

    def owner_gone(self, owner: str) -> bool:
        """The owner stopped, or its process on this host is gone (a claim takes over
        now); or the database does not know it."""
        return owner in self.gone or owner not in self.present


def shown_host(identity: str) -> str:
    """A conductor's host as an operator knows it (its record adds the PID namespace)."""
    return identity.split(":pidns", 1)[0]


def conductor_named(row: dict[str, Any]) -> str:
    """A conductor (``id``, ``hostname``, ``pid``) as every message names it: its id, and
    where to find its process."""
    return f"{row['id']} (on {shown_host(row['hostname'])} pid {row['pid']})"


@dataclass(frozen=True)
class Driving:
    """Who drives a strategy that should be driven (applying, aborting)."""

    #: the conductor holding it with a live lease
    owner: str | None
    #: else, a serving conductor that will claim it
    claimer: str | None
    #: ``driven_by``: the same, in words an operator can act on (None when neither
    #: driven nor to be driven)
    text: str | None
    #: with ``claimer``: ``text`` after "nobody yet: " (why not driven now, if it was,
    #: and who serves the database and will claim it)
    claim: str | None = None

    @property
    def nobody(self) -> bool:
        """No conductor drives it, and none will claim it."""
        return self.owner is None and self.claimer is None

    @property
    def wanted(self) -> bool:
        """Its state asks for a conductor (applying, aborting): not ended, and applied."""
        return self.text is not None

    @property
    def brief(self) -> str:
        """As a list's column says it: the conductor, or that nobody drives it (and
        whether a serving conductor is about to claim it); ``strategy show`` says more."""
        if self.text is None:
            return ""  # ended, or not applied yet: nothing to drive
        if self.owner is not None:
            return f"conductor {self.owner}"
        if self.claimer is not None:
            return "nobody yet (a serving conductor claims it)"
        return "NOBODY (see strategy show)"


def driving(store: Store, sid: int, now: float | None = None) -> Driving:
    now = time.time() if now is None else now
    with store.read() as conn:
        r = conn.execute(select(strategies).where(strategies.c.id == sid)).first()
        if r is None:
            raise NotFound(f"strategy {sid} not found")
        return _driving(r, now, _Conductors.read(conn, now))


def _driving(r: Any, now: float, known: _Conductors) -> Driving:
    if r.state not in DRIVEN_STATES:
        return Driving(None, None, None)
    if known.holds(r.owner, r.lease_expires_at):
        return Driving(r.owner, None, f"conductor {known.named(r.owner)}")
    left = known.lease_left(r.owner, r.lease_expires_at)
    expired = left is None or left <= 0
    serving = [known.named(c["id"]) for c in known.serving if c["id"] != r.owner]
    if r.owner is None:
        lapsed = ""
    elif expired:
        ago = f" {-left:.0f}s ago" if left is not None else " (under an earlier boot)"
        lapsed = f"the lease of conductor {known.named(r.owner)} ran out{ago}; "
    else:
        lapsed = f"conductor {known.named(r.owner)} is gone; "
    if serving:
        claim = lapsed + (
            f"conductors {', '.join(serving)} serve this database; one of them claims it"
            if len(serving) > 1
            else f"conductor {serving[0]} serves this database and claims it"
        )
        return Driving(None, serving[0], f"nobody yet: {claim}", claim)
    return Driving(
        None,
        None,
        f"nobody: {lapsed}no conductor serves this database "
        f"(start 'fleetwave serve', or 'fleetwave strategy apply {r.id} --wait')",
    )


def ended_badly_in(store: Store, sid: int) -> list[str]:
    """The targets of strategy ``sid``'s failed and aborted steps (``strategy create
    --failed-in``), in its step order, all read in one transaction: read a page at a
    time, a ``strategy delete`` of it running meanwhile left some out. Refused when the
    strategy is not there or is being deleted (its steps partly gone)."""
    with store.read() as conn:
        state = conn.execute(
            select(strategies.c.state).where(strategies.c.id == sid)
        ).scalar_one_or_none()
        if state is None:
            raise NotFound(f"--failed-in: strategy {sid} not found")
        if state in (StrategyState.DELETING.value, StrategyState.PRUNING.value):
            raise InputError(
                f"--failed-in: strategy {sid} is being deleted, its steps partly gone "
                f"('fleetwave strategy delete {sid}' finishes it)"
            )
        if state == StrategyState.DELETED.value:  # its steps as they ended, kept
            return list(
                conn.execute(
                    select(deleted_steps.c.target)
                    .where(
                        deleted_steps.c.strategy_id == sid,
                        deleted_steps.c.state.in_([STEP_FAILED, STEP_ABORTED]),
                    )
                    .order_by(deleted_steps.c.id)
                ).scalars()
            )
        return list(
            conn.execute(
                select(targets.c.name)
                .join(steps, steps.c.target_id == targets.c.id)
                .where(
                    steps.c.strategy_id == sid,
                    steps.c.state.in_([STEP_FAILED, STEP_ABORTED]),
                )
                .order_by(steps.c.id)
            ).scalars()
        )


def get_strategy(store: Store, sid: int, first_at: float | None = None) -> dict[str, Any]:
    """``strategy show``. ``first_at``: when the strategy's first transition was, if
    the caller knows it (the dashboard's live producer folds the journal): else it is
    its first journal entry's time."""
    now = time.time()
    with store.read() as conn:
        r = conn.execute(select(strategies).where(strategies.c.id == sid)).first()
        if r is None:
            raise NotFound(f"strategy {sid} not found")
        out = _strategy_dict(r)
        out["states"] = _shown_json(r.states)
        out["options"] = _shown_json(r.options)
        out["driven_by"] = _driving(r, now, _Conductors.read(conn, now)).text
        out["step_states"] = counts = _step_counts(conn, sid)
        # Steps in one of their states, by whether its action started: a started one
        # (in flight) and the latest of their deadlines: a stop or an abort lets them
        # finish that state, so it is over by then at the latest (an operator waiting on
        # an abort asked when it would end). One entered but not started (by a conductor
        # that was stopping), or a retry waiting out its backoff, runs nothing meanwhile,
        # and a stop ends it at once: counted apart, no deadline (after a clean stop,
        # they read as actions running somewhere).
        out["in_flight"] = out["not_started"] = out["waiting_to_retry"] = 0
        out["in_flight_until"] = None
        again = steps.c.attempt > 1  # one expression: one bound parameter (PostgreSQL
        # refuses a GROUP BY whose expression differs from the selected one by its name)
        for not_started, retry, n, until in conn.execute(
            select(steps.c.not_started, again, func.count(), func.max(steps.c.deadline_at))
            .where(
                steps.c.strategy_id == sid,
                steps.c.state.not_in([STEP_INITIAL, *sorted(STEP_TERMINAL)]),
            )
            .group_by(steps.c.not_started, again)
        ):
            if not not_started:
                out["in_flight"] += int(n)
                if until is not None:
                    out["in_flight_until"] = max(out["in_flight_until"] or until, until)
            else:
                out["waiting_to_retry" if retry else "not_started"] += int(n)
        # of those in flight, the ones in a state waiting for the target's callback (not
        # running anything here), and the latest of their deadlines
        waits = callback_states(conn, sid)
        out["waiting_for_callback"], out["waiting_for_callback_until"] = 0, None
        if waits:
            n, until = conn.execute(
                select(func.count(), func.max(steps.c.deadline_at)).where(
                    steps.c.strategy_id == sid,
                    steps.c.state.in_(sorted(waits)),
                    steps.c.not_started == false(),
                )
            ).one()
            out["waiting_for_callback"], out["waiting_for_callback_until"] = int(n), until
        # when the rollout last moved (the row's updated_at is its own state's change)
        out["last_transition_at"] = conn.execute(
            select(journal.c.at)
            .where(journal.c.strategy_id == sid)
            .order_by(journal.c.id.desc())
            .limit(1)
        ).scalar_one_or_none()
        plan = _plan_of(r.options)
        kept = r.state in KEPT_STATES
        done_steps = deleted_steps if kept else steps
        if plan:
            ended = _ended_by_stage(conn, sid, done_steps)
            approvals = [
                {"at": e.at, "details": e.details}
                for e in conn.execute(
                    select(events.c.at, events.c.details)
                    .where(events.c.strategy_id == sid, events.c.kind == APPROVED_EVENT)
                    .order_by(events.c.id)
                )
            ]
        took = conn.execute(
            select(func.avg(done_steps.c.finished_at - done_steps.c.started_at)).where(
                done_steps.c.strategy_id == sid,
                done_steps.c.state == STEP_COMPLETE,
                done_steps.c.started_at.is_not(None),
            )
        ).scalar()
        if first_at is None:
            # the first entry written (by the index: its minimum ``at`` was a scan of
            # every row, 9 ms at 60,000, on each ``strategy show``)
            first_at = conn.execute(
                select(journal.c.at)
                .where(journal.c.strategy_id == sid)
                .order_by(journal.c.id)
                .limit(1)
            ).scalar_one_or_none()
    out["done"] = steps_ended(counts)  # as strategy list has it
    total = int(r.step_count)
    out["percent_done"] = round(100 * out["done"] / total, 1) if total else 100.0
    if first_at is not None and r.state not in STRATEGY_TERMINAL | KEPT_STATES:
        out["elapsed_s"] = round(max(0.0, now - float(first_at)), 1)
        left = time_left_s(
            total,
            out["done"],
            None if took is None else float(took),
            int(out.get("max_parallel") or 1),
        )
        out["time_left_estimate_s"] = None if left is None else round(left)
    if plan:
        out["stages"], out["stage_now"] = stage_progress(plan, ended)
        if approvals:
            out["approvals"] = approvals
        if r.state == StrategyState.INITIAL:  # never applied: nothing runs yet
            out["stage_now"] = None
            for stage in out["stages"]:
                stage["state"] = "waiting"
    return out


def _plan_of(options: str) -> list[PlannedStage]:
    """A strategy's plan (stages, batches, canaries) from its options; none if they
    cannot be read (``strategy show`` shows what it can)."""
    try:
        return options_from_json(options).plan
    except (TypeError, ValueError, KeyError):
        return []


def _ended_by_stage(
    conn: Connection, sid: int, table: Table = steps
) -> dict[int, tuple[int, int, int]]:
    """By stage column (phase): its steps, how many of them have ended, and how many
    have started (left ``initial``: ended ones too); ``table``: where its steps are
    (``deleted_steps`` once it is deleted)."""
    ended = case((table.c.state.in_(sorted(STEP_TERMINAL)), 1), else_=0)
    begun = case((table.c.started_at.is_not(None), 1), else_=0)
    return {
        int(stage): (int(n), int(done or 0), int(started or 0))
        for stage, n, done, started in conn.execute(
            select(table.c.stage, func.count(), func.sum(ended), func.sum(begun))
            .where(table.c.strategy_id == sid)
            .group_by(table.c.stage)
        )
    }


def strategy_workflow(store: Store, sid: int) -> tuple[str, str | None]:
    """The strategy's workflow name, and its own copy (YAML) if it keeps one: without
    one, the process that drives it must have the workflow registered (a plug-in)."""
    with store.read() as conn:
        r = conn.execute(
            select(strategies.c.workflow, strategies.c.workflow_yaml).where(strategies.c.id == sid)
        ).first()
    if r is None:
        raise NotFound(f"strategy {sid} not found")
    return str(r.workflow), None if r.workflow_yaml is None else str(r.workflow_yaml)


def deleted_note(store: Store, sid: int) -> str | None:
    """For a deleted strategy (or one being deleted or pruned), what a reader of its
    history is told first: that it was deleted, when, and what keeps its history."""
    with store.read() as conn:
        r = conn.execute(
            select(strategies.c.state, strategies.c.deleted_at).where(strategies.c.id == sid)
        ).first()
    if r is None or r.state not in KEPT_STATES:
        return None
    at = (
        ""
        if r.deleted_at is None
        else " " + time.strftime("%Y-%m-%d %H:%M:%SZ", time.gmtime(float(r.deleted_at)))
    )
    if r.state == StrategyState.PRUNING:
        return f"strategy {sid}: deleted{at}, its history being pruned (partly gone)"
    if r.state == StrategyState.DELETING:
        return f"strategy {sid}: being deleted (since{at}); its history is kept"
    return f"strategy {sid}: deleted{at}; its history is kept until 'fleetwave prune'"


def strategy_exists(store: Store, sid: int) -> None:
    with store.read() as conn:
        if conn.execute(select(strategies.c.id).where(strategies.c.id == sid)).first() is None:
            raise NotFound(f"strategy {sid} not found")


def list_steps(
    store: Store, sid: int, state: str | None = None, limit: int | None = None
) -> list[dict[str, Any]]:
    return list(iter_steps(store, sid, state, limit))


def iter_steps(
    store: Store,
    sid: int,
    state: str | Sequence[str] | None = None,
    limit: int | None = None,
    *,
    target: str | Sequence[str] | None = None,
) -> Iterator[dict[str, Any]]:
    """A strategy's steps one at a time, as read; an unknown strategy is refused at
    once, before the first row is asked for, and so is a state it has no step can be in.
    ``state`` and ``target``: one, or several (steps in any of them)."""
    states = [state] if isinstance(state, str) else list(state or ())
    names = [target] if isinstance(target, str) else list(target or ())
    if not states:
        strategy_exists(store, sid)
    else:  # one read: the strategy's states say whether it exists too
        with store.read() as conn:
            row = conn.execute(select(strategies.c.states).where(strategies.c.id == sid)).first()
        if row is None:
            raise NotFound(f"strategy {sid} not found")
        own = _shown_json(row[0] or "[]")  # empty for a strategy of an early version
        if not isinstance(own, list):
            own = []  # unreadable (a hand edit): any state name is looked for
        known = [STEP_INITIAL, *own, *sorted(STEP_TERMINAL)]
        for one in states if own else ():
            if one not in known:
                raise InputError(
                    f"--state: '{one}' is not a state of strategy {sid} ({', '.join(known)})"
                )
    for name in names:
        _target_in(store, sid, name)
    return (row for _, row in _iter_steps(store, sid, states, limit, names))


def steps_page(
    store: Store,
    sid: int,
    limit: int,
    after: int = -1,
    state: Sequence[str] = (),
    target: Sequence[str] = (),
) -> Page:
    """Up to ``limit`` of a strategy's steps in its order, after the step at position
    ``after`` (as :func:`iter_steps` checks and shows them)."""
    iter_steps(store, sid, state, target=target)  # (its checks: unknown states, names)
    return _page(
        _iter_steps(store, sid, list(state), None, list(target), after=after, rows=limit + 1),
        limit,
    )


def _target_in(store: Store, sid: int, target: str) -> int:
    """The step of ``target`` in the strategy; refuse ``--target`` naming no target, or
    one the strategy has no step for."""
    with store.read() as conn:
        tid = conn.execute(select(targets.c.id).where(targets.c.name == target)).scalar()
        in_it = conn.execute(
            select(steps.c.id).where(steps.c.strategy_id == sid, steps.c.target_id == tid)
        ).first()
        if in_it is None and _kept(conn, sid):
            # a deleted strategy's step, by the name its target had (deleted since, maybe)
            in_it = conn.execute(
                select(deleted_steps.c.id).where(
                    deleted_steps.c.strategy_id == sid, deleted_steps.c.target == target
                )
            ).first()
        if in_it is None:
            if tid is None:
                raise NotFound(f"--target: no target named {shown(target)}")
            raise NotFound(f"--target: target {shown(target)} is not in strategy {sid}")
        return int(in_it[0])


def _iter_steps(
    store: Store,
    sid: int,
    states: list[str],
    limit: int | None,
    names: list[str],
    *,
    after: int = -1,
    rows: int = PAGE_ROWS,
) -> Iterator[tuple[int, dict[str, Any]]]:
    """The steps with their positions (``ordinal``), after ``after``."""
    q = (
        select(
            steps.c.id,
            targets.c.name,
            steps.c.stage,
            steps.c.state,
            steps.c.details,
            steps.c.started_at,
            steps.c.finished_at,
            steps.c.attempt,
            steps.c.owner,
            steps.c.ordinal,
            steps.c.not_started,
            steps.c.deadline_at,
        )
        .join(targets, targets.c.id == steps.c.target_id)
        .where(steps.c.strategy_id == sid)
    )
    if states:
        q = q.where(steps.c.state.in_(states))
    if names:
        q = q.where(targets.c.name.in_(names))
    found = _pages(store, q, steps.c.ordinal, after, rows)
    with store.read() as conn:
        deleted = conn.execute(
            select(strategies.c.state).where(strategies.c.id == sid)
        ).scalar() in (StrategyState.DELETED, StrategyState.PRUNING)
    if deleted:  # its steps as they ended (their targets as they were named then)
        kept = select(
            deleted_steps.c.id,
            deleted_steps.c.target.label("name"),
            deleted_steps.c.stage,
            deleted_steps.c.state,
            deleted_steps.c.details,
            deleted_steps.c.started_at,
            deleted_steps.c.finished_at,
            deleted_steps.c.attempt,
            null().label("owner"),
            deleted_steps.c.ordinal,
            false().label("not_started"),
            null().label("deadline_at"),
        ).where(deleted_steps.c.strategy_id == sid)
        if states:
            kept = kept.where(deleted_steps.c.state.in_(states))
        if names:
            kept = kept.where(deleted_steps.c.target.in_(names))
        found = _pages(store, kept, deleted_steps.c.ordinal, after, rows)
    now = time.time()
    lease = _step_lease(store, sid, now)
    for r in found if limit is None else islice(found, limit):
        details = _shown_details(r, lease)
        yield (
            r.ordinal,
            {
                "step": r.id,
                "strategy": sid,
                "target": r.name,
                "stage": r.stage,
                "state": r.state,
                "details": details,
                "started_at": r.started_at,
                "finished_at": r.finished_at,
                "attempt": r.attempt,
                "owner": r.owner,
            },
        )


@dataclass(frozen=True)
class _StepLease:
    """The lease a strategy's steps in flight are held under (their strategy's)."""

    #: the conductor holding it now (alive, its lease not run out), if any
    holder: str | None
    #: the strategy's owner, and the lease's time left (None: none, or not readable)
    owner: str | None
    left: float | None
    #: when it ran out (wall time, for an operator), if it has
    ran_out_at: float | None
    #: the strategy's workflow states that wait for the target's callback
    waits: frozenset[str] = frozenset()


def _step_lease(store: Store, sid: int, now: float) -> _StepLease:
    with store.read() as conn:
        r = conn.execute(
            select(strategies.c.owner, strategies.c.lease_expires_at).where(strategies.c.id == sid)
        ).first()
        known = _Conductors.read(conn, now)
        waits = callback_states(conn, sid)
    owner = r.owner if r is not None else None
    until = r.lease_expires_at if r is not None else None
    left = known.lease_left(owner, until)
    return _StepLease(
        owner if known.holds(owner, until) else None,
        owner,
        left,
        now + left if left is not None and left <= 0 else None,
        waits,
    )


def callback_states(conn: Any, sid: int) -> frozenset[str]:
    """The states of strategy ``sid``'s workflow that wait for the target's callback
    (``mode: wait-for-callback``): from its own YAML copy, or the registered workflow
    of its name; none when this process cannot have it (a plug-in not loaded here)."""
    r = conn.execute(
        select(strategies.c.workflow, strategies.c.workflow_yaml).where(strategies.c.id == sid)
    ).first()
    if r is None:
        return frozenset()
    try:
        wf = (
            get_workflow(r.workflow)
            if r.workflow_yaml is None
            else parse_workflow_yaml(r.workflow_yaml, source=f"strategy {sid}")
        )
    except WorkflowError:
        return frozenset()
    if wf is None:
        return frozenset()
    return frozenset(st.name for st in wf.states if st.mode == "wait-for-callback")


#: what a takeover does with a state whose conductor was lost: its workflow says (a
#: state with ``recover: none`` fails the step; the text said a recover hook looked)
_RECOVERS = (
    "its state's recover setting decides what became of the action (look at the target, "
    "or fail the step: 'fleetwave workflow show' says which)"
)


def _utc_shown(at: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%SZ", time.gmtime(at))


def _shown_details(r: Any, lease: _StepLease) -> str:
    """A step's details as shown (``r``: its row): for one in its workflow's states
    that nobody drives now, or entered but not started, what is happening to it and
    what comes next, then what its row says (a step whose conductor was killed showed
    only its last state's "done at attempt 2" or an old retry's time, as if running)."""
    state: str = r.state
    details: str = r.details
    owner: str | None = r.owner
    not_started, attempt = bool(r.not_started), int(r.attempt)
    if state == STEP_INITIAL or state in STEP_TERMINAL:
        return details
    resumes = "when a conductor drives the strategy again (serve, or strategy apply --wait)"
    live = owner is not None and owner == lease.holder
    if not_started and attempt > 1:
        # a retry recorded, waiting to start
        if live:
            return details or f"attempt {attempt} waits out its backoff on conductor {owner}"
        said = f"attempt {attempt} not started: it starts, once due, {resumes}"
    elif not_started:
        # entered by a conductor that was stopping: the next owner starts it afresh
        said = f"entered, its action not started: it starts {resumes}"
        if live:
            said = f"entered while conductor {owner} was stopping; its action starts {resumes}"
    elif live and state in lease.waits:
        # its action sent the work; the target's agent reports when it is done
        deadline = getattr(r, "deadline_at", None)
        until = "" if deadline is None else f" until {_utc_shown(float(deadline))}"
        said = f"waiting for callback{until} (on conductor {owner})"
        return f"{said}: {details}" if details else said
    elif live:
        # what it last said (a retry's reason, its last state's end) while it runs
        return details or f"running on conductor {owner}"
    elif owner is not None:
        why = "its process ended"
        if owner == lease.owner and lease.ran_out_at is not None:
            at = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(lease.ran_out_at))
            why = f"its lease ran out at {at}Z"
        elif owner == lease.owner and lease.left is None:
            why = "its lease was taken under an earlier boot of this host"
        said = (
            f"its conductor {owner} is gone ({why}); the step is taken over {resumes}, "
            f"and {_RECOVERS}"
        )
    else:
        said = (
            f"interrupted (its conductor stopped); the step is taken over {resumes}, and "
            f"{_RECOVERS}"
        )
    return f"{said} ({details})" if details else said


def get_step(store: Store, step_id: int) -> dict[str, Any]:
    now = time.time()
    with store.read() as conn:
        r = conn.execute(
            select(steps, targets.c.name.label("target"))
            .join(targets, targets.c.id == steps.c.target_id)
            .where(steps.c.id == step_id)
        ).first()
        if r is None:
            return _kept_step(store, step_id)
        out = {
            "step": r.id,
            "strategy": r.strategy_id,
            "target": r.target,
            "stage": r.stage,
            "state": r.state,
            "details": _shown_details(r, lease := _step_lease(store, r.strategy_id, now)),
            "started_at": r.started_at,
            "finished_at": r.finished_at,
            "attempt": r.attempt,
            "fence": r.fence,
            "owner": r.owner,
            # the lease it is held under (its strategy's), as wall time
            "lease_expires_at": (
                now + lease.left
                if r.owner is not None and r.owner == lease.owner and lease.left is not None
                else None
            ),
            # when the current state runs out of time; None once terminal
            "deadline_at": r.deadline_at,
            # entered by a conductor that stopped before starting its action
            "not_started": bool(r.not_started),
        }
    out["history"] = history(store, int(out["strategy"]), step_id=step_id)
    out["events"] = step_events(store, step_id)
    out["callbacks"] = step_callbacks(store, step_id)
    out["attempts"] = step_attempts(store, step_id)
    return out


def _kept_step(store: Store, step_id: int) -> dict[str, Any]:
    """A step of a deleted strategy, as it ended, with its history (``step show``)."""
    with store.read() as conn:
        r = conn.execute(select(deleted_steps).where(deleted_steps.c.id == step_id)).first()
    if r is None:
        raise NotFound(f"step {step_id} not found")
    out: dict[str, Any] = {
        "step": r.id,
        "strategy": r.strategy_id,
        "strategy_deleted": True,
        "target": r.target,
        "stage": r.stage,
        "state": r.state,
        "details": r.details,
        "started_at": r.started_at,
        "finished_at": r.finished_at,
        "attempt": r.attempt,
    }
    out["history"] = history(store, int(r.strategy_id), step_id=step_id)
    out["events"] = step_events(store, step_id)
    out["callbacks"] = step_callbacks(store, step_id)
    out["attempts"] = step_attempts(store, step_id)
    return out


def step_callbacks(store: Store, step_id: int) -> list[dict[str, Any]]:
    """What the step's target reported (callbacks), oldest first, with what became of
    each (applied, ignored and why; open until a conductor has handled it)."""
    with store.read() as conn:
        return [
            {
                "received_at": r.received_at,
                "state": r.state,
                "visit": r.visit,
                "kind": r.kind,
                "details": r.details,
                "outcome": r.outcome or "open",
                "reason": r.reason or "",
            }
            for r in conn.execute(
                select(callbacks).where(callbacks.c.step_id == step_id).order_by(callbacks.c.id)
            )
        ]


def history(
    store: Store, sid: int, target: str | None = None, step_id: int | None = None
) -> list[dict[str, Any]]:
    return list(iter_history(store, sid, target, step_id))


def iter_history(
    store: Store,
    sid: int,
    target: str | Sequence[str] | None = None,
    step_id: int | None = None,
    last: int | None = None,
) -> Iterator[dict[str, Any]]:
    """A strategy's journal one transition at a time, as read (600,000 rows for a
    rollout of 100,000 targets), or only its ``last`` transitions, oldest first;
    unknown names are refused before the first row."""
    _check_last(last)
    strategy_exists(store, sid)
    q = _history_query(store, sid)
    names = [target] if isinstance(target, str) else list(target or ())
    step_ids = _steps_of(store, sid, names)
    if step_id is not None:
        step_ids = [s for s in step_ids if s == step_id] if names else [step_id]
    # Some steps' rows are found through the journal's (step, state) key; by strategy,
    # only the strategy's whole journal (600,000 rows at 100,000 targets) would do.
    if names or step_id is not None:
        # (+ 0: still only this strategy's rows, checked row by row, not by its index)
        q = q.where(journal.c.step_id.in_(step_ids), journal.c.strategy_id + 0 == sid)
    else:
        q = q.where(journal.c.strategy_id == sid)
    sends = _attempt_rows(store, sid, step_ids if names or step_id is not None else None)
    moves = _iter_history(store, sid, _only_last(store, q, journal.c.id, last))
    return _with_attempts((row for _, row in moves), sends, last)


def history_page(
    store: Store, sid: int, limit: int, after: int = 0, target: Sequence[str] = ()
) -> Page:
    """Up to ``limit`` transitions of a strategy's journal after the one ``after`` (its
    journal id), oldest first (as :func:`iter_history` has them, without the attempts
    a takeover made between them)."""
    iter_history(store, sid, list(target))  # (its checks: the strategy, the names)
    q = _history_query(store, sid).where(journal.c.strategy_id == sid)
    if target:
        q = q.where(journal.c.step_id.in_(_steps_of(store, sid, list(target))))
    return _page(_iter_history(store, sid, q, after, limit + 1), limit)


def _history_query(store: Store, sid: int) -> Any:
    """The journal's rows with their targets' names (a deleted strategy's: as its kept
    steps name them)."""
    with store.read() as conn:
        kept = _kept(conn, sid)
        source, name = _journal_named(conn, sid, journal)
    columns = (
        journal.c.id,
        journal.c.at,
        journal.c.conductor,
        name,
        journal.c.step_id,
        journal.c.from_state,
        journal.c.to_state,
        journal.c.fence,
        journal.c.details,
        journal.c.visit,
    )
    if kept:
        return select(*columns).select_from(source)
    # every transition's step is there: joined, not outer-joined
    return (
        select(*columns)
        .join(steps, steps.c.id == journal.c.step_id)
        .join(targets, targets.c.id == steps.c.target_id)
    )


#: what ``history`` says of an attempt a takeover made (``attempts``): a retry is not
#: shown there (its failed attempt is an ``attempt-failed`` event, the move on says
#: "done at attempt 3"); ``step show`` lists every attempt
ATTEMPT_WORDS = {
    "resent": "re-sent after takeover (the target did not have it)",
    "afresh": "started by the next owner (its conductor stopped before sending it)",
}


def _attempt_rows(store: Store, sid: int, step_ids: list[int] | None) -> list[dict[str, Any]]:
    """The strategy's attempts a takeover made (re-sends, starts by the next owner), as
    ``history`` rows, oldest first: few (one per step taken over), read whole."""
    with store.read() as conn:
        source, name = _journal_named(conn, sid, attempts)
        q = (
            select(
                attempts.c.at,
                attempts.c.conductor,
                name,
                attempts.c.step_id,
                attempts.c.state,
                attempts.c.attempt,
                attempts.c.fence,
                attempts.c.how,
                attempts.c.visit,
            )
            .select_from(source)
            .where(attempts.c.strategy_id == sid, attempts.c.how.in_(sorted(ATTEMPT_WORDS)))
            .order_by(attempts.c.id)
        )
        if step_ids is not None:
            q = q.where(attempts.c.step_id.in_(step_ids))
        rows = conn.execute(q).all()
    return [
        {
            "at": at,
            "strategy": sid,
            "conductor": conductor,
            "target": target,
            "step": step,
            "from": state,
            "to": state,
            "visit": visit,
            "fence": fence,
            "details": f"attempt {attempt}: {ATTEMPT_WORDS.get(how, how)}",
            "attempt": attempt,
        }
        for at, conductor, target, step, state, attempt, fence, how, visit in rows
    ]


def _with_attempts(
    moves: Iterator[dict[str, Any]], sends: list[dict[str, Any]], last: int | None
) -> Iterator[dict[str, Any]]:
    """The journal's transitions with the attempts between them, by time (an attempt
    comes after its state's entry). With ``--last``: only attempts from the first
    transition shown on."""
    i = 0
    first = True
    for move in moves:
        if first and last is not None:
            while i < len(sends) and sends[i]["at"] < move["at"]:
                i += 1  # before the transitions shown
        first = False
        while i < len(sends) and sends[i]["at"] < move["at"]:
            yield sends[i]
            i += 1
        yield move
    if not first or last is None:
        yield from sends[i:]


def _check_last(last: int | None) -> None:
    if last is not None and last < 1:
        raise InputError(f"--last: must be at least 1, got {last}")


def _steps_of(store: Store, sid: int, names: list[str]) -> list[int]:
    """The strategy's steps of these targets; a name not in the strategy is refused."""
    return [_target_in(store, sid, name) for name in names]


def _only_last(store: Store, q: Any, key: Any, last: int | None) -> Any:
    """``q`` narrowed to its ``last`` rows in ``key`` order (all when None): where they
    begin is found by one index walk back."""
    if last is None:
        return q
    with store.read() as conn:
        start = conn.execute(
            q.with_only_columns(key).order_by(key.desc()).offset(last - 1).limit(1)
        ).scalar_one_or_none()
    return q if start is None else q.where(key >= start)


def _iter_history(
    store: Store, sid: int, q: Any, after: int = 0, rows: int = PAGE_ROWS
) -> Iterator[tuple[int, dict[str, Any]]]:
    """The journal's rows with their ids, after ``after``."""
    # by position: a history of 600,000 rows spent a sixth of its time naming columns
    for id_, at, conductor, target, step, frm, to, fence, details, visit in _pages(
        store, q, journal.c.id, after, rows
    ):
        yield (
            id_,
            {
                "at": at,
                "strategy": sid,
                "conductor": conductor,
                "target": target,
                "step": step,
                "from": frm,
                "to": to,
                # which visit of ``to`` (1 but for a state on a bounded cycle)
                "visit": visit,
                "fence": fence,
                "details": details,
            },
        )


def step_attempts(store: Store, step_id: int) -> list[dict[str, Any]]:
    """Each attempt of a state sent to the step's target: when it was released, by which
    conductor at which fence, and how: ``entry`` (a state's first, sent as it was
    entered: its journal row), ``afresh`` (entered by a conductor that was stopping,
    started by the next owner), ``retry``; and of which visit of the state (1 but on a
    bounded retry loop)."""
    with store.read() as conn:
        entries = conn.execute(
            select(
                journal.c.to_state,
                journal.c.at,
                journal.c.conductor,
                journal.c.fence,
                journal.c.visit,
            )
            .where(
                journal.c.step_id == step_id,
                journal.c.to_state.not_in(sorted(STEP_TERMINAL)),
            )
            .order_by(journal.c.id)
        ).all()
        rows = conn.execute(
            select(
                attempts.c.state,
                attempts.c.attempt,
                attempts.c.at,
                attempts.c.conductor,
                attempts.c.fence,
                attempts.c.how,
                attempts.c.visit,
            )
            .where(attempts.c.step_id == step_id)
            .order_by(attempts.c.id)
        ).all()
    recorded = [dict(r._mapping) for r in rows]
    afresh = {(r["state"], r["visit"]) for r in recorded if r["how"] == "afresh"}
    firsts = [
        {"state": e.to_state, "attempt": 1, "at": e.at, "conductor": e.conductor,
         "fence": e.fence, "how": "entry", "visit": e.visit}
        for e in entries
        if (e.to_state, e.visit) not in afresh
    ]  # fmt: skip
    return sorted(firsts + recorded, key=lambda r: (r["at"], r["attempt"]))


def step_events(store: Store, step_id: int) -> list[dict[str, Any]]:
    return _events(store, select(events).where(events.c.step_id == step_id))


def strategy_events(store: Store, sid: int, kind: str | None = None) -> list[dict[str, Any]]:
    q = select(events).where(events.c.strategy_id == sid)
    if kind is not None:
        q = q.where(events.c.kind == kind)
    return _events(store, q)


#: what the events of a strategy can be (``fleetwave events --kind``)
EVENT_KINDS = {
    "strategy-claimed": "a conductor took the strategy on (from whom)",
    "step-taken-over": "a step's lease passed to a new conductor (in which state, fences)",
    "attempt-failed": "an attempt of a state failed and is retried (why, which comes when)",
    "transition-rejected": "a transition was refused (fenced off, or the state entered)",
    "step-settled": "a transition was refused and the step's row read back",
    "stale-outcome-ignored": "a report for a step that had moved on, ignored",
    "pause-seen": "the conductor saw a pause",
    "resume-seen": "the conductor saw a resume",
    "abort-seen": "the conductor saw an abort",
    "abort-too-late": "an abort came after every step had ended (the strategy ended so)",
    "takeover-incomplete": "steps moved on while a takeover read them",
    "strategy-undrivable": "the strategy cannot be driven (why)",
    APPROVED_EVENT: "an operator approved the next stage (which, by whom)",
    "change-by": "a change made through the REST API, and by which token",
    "callback-refused": "an agent's callback refused for its token (from which address, why)",
    "deadline-extended": "a heartbeat moved a waiting state's deadline (to when)",
    "slots-recounted": "a strategy's slots (G7) counted again from its steps: they had drifted",
}


def iter_events(
    store: Store,
    sid: int,
    target: Sequence[str] = (),
    kind: Sequence[str] = (),
    last: int | None = None,
) -> Iterator[dict[str, Any]]:
    """A strategy's events (what is not a transition: claims, takeovers, failed attempts,
    operator actions seen), oldest first, a page at a time; of some targets or kinds, or
    the ``last`` ones. Unknown names and kinds are refused before the first row."""
    _check_last(last)
    for k in kind:
        if k not in EVENT_KINDS:
            raise InputError(f"--kind: '{k}' is not a kind of event ({', '.join(EVENT_KINDS)})")
    strategy_exists(store, sid)
    q = _events_query(store, sid, target, kind)
    return (row for _, row in _iter_events(store, sid, _only_last(store, q, events.c.id, last)))


def _events_query(store: Store, sid: int, target: Sequence[str], kind: Sequence[str]) -> Any:
    with store.read() as conn:
        source, name = _journal_named(conn, sid, events)
    q = select(events, name.label("target")).select_from(source).where(events.c.strategy_id == sid)
    if target:
        q = q.where(events.c.step_id.in_(_steps_of(store, sid, list(target))))
    if kind:
        q = q.where(events.c.kind.in_(list(kind)))
    return q


def events_page(
    store: Store,
    sid: int,
    limit: int,
    after: int = 0,
    target: Sequence[str] = (),
    kind: Sequence[str] = (),
) -> Page:
    """Up to ``limit`` of a strategy's events after the one ``after`` (its id), oldest
    first (as :func:`iter_events` has them)."""
    iter_events(store, sid, target, kind)  # (its checks)
    q = _events_query(store, sid, target, kind)
    return _page(_iter_events(store, sid, q, after, limit + 1), limit)


def _iter_events(
    store: Store, sid: int, q: Any, after: int = 0, rows: int = PAGE_ROWS
) -> Iterator[tuple[int, dict[str, Any]]]:
    for r in _pages(store, q, events.c.id, after, rows):
        yield (
            r.id,
            {
                "at": r.at,
                "strategy": sid,
                "conductor": r.conductor,
                "target": r.target,
                "step": r.step_id,
                "kind": r.kind,
                "details": r.details,
            },
        )


def _events(store: Store, q: Any) -> list[dict[str, Any]]:
    """Events (non-transition facts: takeovers, rejections, ignored outcomes), oldest first."""
    with store.read() as conn:
        return [
            {
                "at": r.at,
                "step": r.step_id,
                "kind": r.kind,
                "details": r.details,
                "conductor": r.conductor,
            }
            for r in conn.execute(q.order_by(events.c.id))
        ]
