"""Read models of the conductors: who serves, who drives a strategy."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from sqlalchemy import func, select

from fleetwave.domain.errors import NotFound
from fleetwave.store import leases
from fleetwave.store.db import Store
from fleetwave.store.runtime import DRIVEN_STATES, conductor_gone
from fleetwave.store.schema import (
    conductors,
    steps,
    strategies,
)

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
