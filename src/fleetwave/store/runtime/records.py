"""The records the engine's store calls give (steps, strategies), and the rows they
come from."""

from __future__ import annotations

import json
import os
import socket
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import Connection

from fleetwave.domain.models import (
    StrategyState,
    Target,
)
from fleetwave.store.db import Store


def _host_identity() -> str:
    """This host and PID namespace: a PID is only comparable inside the same namespace."""
    try:
        ns = f":pidns{os.stat('/proc/self/ns/pid').st_ino}"
    except OSError:
        ns = ""
    return socket.gethostname() + ns


HOSTNAME = _host_identity()


#: Strategy states a conductor drives.
DRIVEN_STATES = (
    StrategyState.APPLYING.value,
    StrategyState.PAUSED.value,
    StrategyState.WAITING_APPROVAL.value,
    StrategyState.ABORT_REQUESTED.value,
    StrategyState.ABORTING.value,
)


@dataclass(slots=True)
class StepRecord:
    step_id: int
    strategy_id: int
    stage: int
    group_id: int | None
    state: str
    fence: int
    attempt: int
    owner: str | None
    target: Target
    #: its state was entered by a conductor that stopped before starting the action
    not_started: bool = False
    #: when its state runs out of time (engine clock), if recorded
    deadline_at: float | None = None
    #: its place in the strategy's admission order (stages come in this order too)
    ordinal: int = 0
    #: which visit of its state it is in (1 but on a bounded cycle), and the visits so
    #: far of the states that count them
    visit: int = 1
    visits: dict[str, int] = field(default_factory=dict)


@dataclass
class StrategyRecord:
    id: int
    workflow: str
    state: str
    options: str
    group_caps: dict[int, int]
    owner: str | None
    fence: int
    lease_expires_at: float | None
    details: str
    #: the workflow's states when the strategy was created
    states: list[str] = field(default_factory=list)
    #: a YAML workflow's text as it was when the strategy was created
    workflow_yaml: str | None = None
    #: why its row cannot be driven (a field that is not readable), if so
    broken: str | None = None
    #: claimed from another conductor (its id): a lease taken over
    taken_from: str | None = None


class UnreadableRow(ValueError):
    """A stored field is not what fleetwave writes there (a hand edit, another tool)."""


def stored_json(raw: Any, what: str) -> Any:
    """A JSON field of a row, parsed; :class:`UnreadableRow` naming it if it is not JSON."""
    try:
        return json.loads(raw)
    except (TypeError, ValueError) as exc:
        shown = repr(raw)
        shown = shown if len(shown) <= 60 else shown[:57] + "..."
        raise UnreadableRow(f"its stored {what} are not readable ({exc}): {shown}") from None


def strategy_layout(raw_states: Any, raw_caps: Any) -> tuple[list[str], dict[int, int]]:
    """A strategy row's states and group caps, as stored (JSON); :class:`UnreadableRow`
    saying which is not what fleetwave writes (a hand edit, another tool)."""
    got = stored_json(raw_states, "states")
    if not isinstance(got, list) or not all(isinstance(x, str) for x in got):
        raise UnreadableRow(f"its stored states are not a list of names: {raw_states!r}")
    raw = stored_json(raw_caps, "group caps")
    try:
        caps = {int(k): int(v) for k, v in raw.items()}
    except (AttributeError, TypeError, ValueError):
        caps = {}
    if not isinstance(raw, dict) or len(caps) != len(raw) or any(v < 1 for v in caps.values()):
        # a cap below 1 would start nothing of its group, for ever
        raise UnreadableRow(f"its stored group caps are not a map of group to cap: {raw_caps!r}")
    return got, caps


def _strategy_record(r: Any) -> StrategyRecord:
    """A claimed strategy's row as the engine needs it. Fields that cannot be read do
    not fail the claim (of every strategy with it): the record says what is wrong
    (:attr:`StrategyRecord.broken`), and that strategy alone fails."""
    broken: str | None = None
    caps: dict[int, int] = {}
    states: list[str] = []
    try:
        states, caps = strategy_layout(r.states, r.group_caps)
    except UnreadableRow as exc:
        broken = str(exc)
    return StrategyRecord(
        id=r.id,
        workflow=r.workflow,
        state=r.state,
        options=r.options,
        group_caps=caps,
        owner=r.owner,
        fence=r.fence,
        lease_expires_at=r.lease_expires_at,
        details=r.details,
        states=states,
        workflow_yaml=r.workflow_yaml,
        broken=broken,
    )


_STEP_COLUMNS = (
    "SELECT s.id, s.stage, s.group_id, s.state, s.fence, s.attempt, s.owner, "
    "t.name, t.driver, t.settings, t.managed, t.labels, g.name, s.not_started, "
    "s.deadline_at, s.ordinal, s.visit, s.visits "
    "FROM steps s JOIN targets t ON t.id = s.target_id "
    "LEFT JOIN groups g ON g.id = s.group_id "
)


def _step_records(
    conn: Connection,
    store: Store,
    sid: int,
    where: str,
    params: tuple[Any, ...],
    limit: int | None = None,
) -> list[StepRecord]:
    """Steps of one strategy in admission order, as the engine needs them.

    Plain SQL and shared parses: this runs before actions start, for up to every
    step of the strategy (100,000 of them in a large rollout).
    """
    p = store.hooks.placeholder
    sql = f"{_STEP_COLUMNS}WHERE s.strategy_id = {p} AND {where} ORDER BY s.ordinal"
    if limit is not None:
        sql += f" LIMIT {int(limit)}"
    rows = conn.exec_driver_sql(sql, (sid, *params)).all()
    parsed: dict[str, Any] = {}  # many targets share settings and labels: parse each once

    def parse(raw: str) -> Any:
        got = parsed.get(raw)
        if got is None:
            got = parsed[raw] = json.loads(raw)
        return got

    return [
        StepRecord(
            step_id=r[0],
            strategy_id=sid,
            stage=r[1],
            group_id=r[2],
            state=r[3],
            fence=r[4],
            attempt=r[5],
            owner=r[6],
            target=Target(
                name=r[7],
                driver=r[8],
                group=r[12],
                settings=parse(r[9]),
                managed=bool(r[10]),
                labels=parse(r[11]),
            ),
            not_started=bool(r[13]),
            deadline_at=r[14],
            ordinal=r[15],
            visit=r[16],
            visits=_visits(r[17]),
        )
        for r in rows
    ]


def _visits(raw: str | None) -> dict[str, int]:
    """A step row's ``visits`` (JSON {state: n}, or NULL): as the engine counts them. A
    value that is not that (a hand edit) counts nothing: the journal's unique key on
    (step, state, visit) still refuses a visit entered twice."""
    if raw is None:
        return {}
    try:
        got = json.loads(raw)
    except ValueError:
        return {}
    if not isinstance(got, dict):
        return {}
    return {str(k): v for k, v in got.items() if type(v) is int and v > 0}


@dataclass(frozen=True)
class PeerView:
    """Who is asking, and the lease clock's reading to judge the others' leases by."""

    me: str
    lease_clock: str | None
    lease_now: float
