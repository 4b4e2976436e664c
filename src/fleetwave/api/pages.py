"""What the dashboard's pages read that no command prints: a strategy's fleet grid (one
cell per step, by stage and group), what moved in it since a live pass's last (the
steps, and its journal summed up for the charts), and a target's time per state in
each strategy it has been in.

Plain reads, each in one snapshot (``store.read()``); blocking, so the API runs them on
its threads (:meth:`fleetwave.api.service.Service.call`).
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass
from typing import Any

from sqlalchemy import func, select

from fleetwave.domain.errors import NotFound
from fleetwave.domain.models import STEP_TERMINAL
from fleetwave.store import queries
from fleetwave.store.db import Store
from fleetwave.store.schema import (
    attempts,
    deleted_steps,
    groups,
    journal,
    steps,
    strategies,
    targets,
)

#: a step's group when it has none (shown as such on the grid)
NO_GROUP = "(no group)"


@dataclass(frozen=True)
class Grid:
    """A strategy's steps in the grid's order (stage, group name, position): the same
    index in each list is one cell."""

    step: list[int]
    target: list[str]
    stage: list[int]
    group: list[str]
    state: list[str]
    attempt: list[int]

    def columns(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "target": self.target,
            "stage": self.stage,
            "group": self.group,
            "state": self.state,
            "attempt": self.attempt,
        }


def _step_table(conn: Any, sid: int) -> Any:
    state = conn.execute(select(strategies.c.state).where(strategies.c.id == sid)).scalar()
    if state is None:
        raise NotFound(f"strategy {sid} not found")
    return deleted_steps if state in queries.KEPT_STATES else steps


def read_grid(store: Store, sid: int) -> Grid:
    """Every step of strategy ``sid`` (a deleted one's as they ended), in grid order."""
    with store.read() as conn:
        return _grid(conn, sid, store.hooks.placeholder)


def _grid(conn: Any, sid: int, p: str) -> Grid:
    """(Through the driver's own cursor: 10,000 rows through SQLAlchemy's cost several
    times the query, and the page waits for them.)"""
    table = _step_table(conn, sid)
    name = "t.name" if table is steps else "s.target"
    join = f"JOIN {targets.name} t ON t.id = s.target_id " if table is steps else ""
    cur = conn.connection.driver_connection.cursor()
    try:
        cur.execute(
            f"SELECT s.id, {name}, s.stage, g.name, s.state, s.attempt, s.ordinal "
            f"FROM {table.name} s {join}"
            f'LEFT JOIN "{groups.name}" g ON g.id = s.group_id '
            f"WHERE s.strategy_id = {p}",
            (sid,),
        )
        rows = cur.fetchall()
    finally:
        cur.close()
    rows.sort(key=lambda r: (r[2], r[3] or NO_GROUP, r[6]))
    return Grid(
        step=[int(r[0]) for r in rows],
        target=[str(r[1]) for r in rows],
        stage=[int(r[2]) for r in rows],
        group=[str(r[3] or NO_GROUP) for r in rows],
        state=[str(r[4]) for r in rows],
        attempt=[int(r[5]) for r in rows],
    )


@dataclass(frozen=True)
class Marks:
    """The last journal row and attempt row of a strategy that a reader has seen."""

    journal: int
    attempts: int


def _marks(conn: Any, sid: int) -> Marks:
    last_j = conn.execute(
        select(func.max(journal.c.id)).where(journal.c.strategy_id == sid)
    ).scalar()
    last_a = conn.execute(
        select(func.max(attempts.c.id)).where(attempts.c.strategy_id == sid)
    ).scalar()
    return Marks(int(last_j or 0), int(last_a or 0))


def read_grid_marked(store: Store, sid: int) -> tuple[Grid, Marks]:
    """:func:`read_grid`, and the journal and attempt rows it has seen (one snapshot):
    what :func:`read_pass` reads after."""
    with store.read() as conn:
        return _grid(conn, sid, store.hooks.placeholder), _marks(conn, sid)


#: a journal row as the live pages need it: (id, step id, at, to state)
JournalRow = tuple[int, int, float, str]


@dataclass(frozen=True)
class Moved:
    """What moved in a strategy after some marks, read in one snapshot by
    :func:`read_pass`."""

    marks: Marks
    #: the new journal rows, oldest first
    journal: list[JournalRow]
    #: (step id, state, attempt) now of the steps a new attempt row names (a retry:
    #: the journal says nothing of it), or of every step when asked
    steps: list[tuple[int, str, int]]


def _journal_rows(conn: Any, p: str, sid: int, after: int, upto: int) -> list[JournalRow]:
    """(Through the driver's own cursor: SQLAlchemy's rows cost more than the read.)"""
    if upto <= after:
        return []
    cur = conn.connection.driver_connection.cursor()
    try:
        cur.execute(
            "SELECT id, step_id, at, to_state FROM journal "
            f"WHERE strategy_id = {p} AND id > {p} AND id <= {p} ORDER BY id",
            (sid, after, upto),
        )
        rows: list[JournalRow] = cur.fetchall()
    finally:
        cur.close()
    return rows


def read_journal(store: Store, sid: int, upto: Marks) -> list[JournalRow]:
    """Strategy ``sid``'s journal rows up to ``upto`` (as :attr:`Moved.journal`)."""
    with store.read() as conn:
        return _journal_rows(conn, store.hooks.placeholder, sid, 0, upto.journal)


def read_pass(store: Store, sid: int, after: Marks, every_step: bool = False) -> Moved:
    """What moved in strategy ``sid`` after ``after``: its new journal rows (the few
    columns the live charts and grid need, through the driver: a 10,000-target
    rollout writes some 10,000 a second), and the steps its new attempt rows name
    (``every_step``: all its steps) with their state and attempt now."""
    p = store.hooks.placeholder
    with store.read() as conn:
        table = _step_table(conn, sid)
        now = _marks(conn, sid)
        rows = _journal_rows(conn, p, sid, after.journal, now.journal)
        step_q = select(table.c.id, table.c.state, table.c.attempt)
        if every_step:
            step_q = step_q.where(table.c.strategy_id == sid)
        elif now.attempts > after.attempts:
            step_q = step_q.where(
                table.c.id.in_(
                    select(attempts.c.step_id).where(
                        attempts.c.strategy_id == sid,
                        attempts.c.id > after.attempts,
                        attempts.c.id <= now.attempts,
                    )
                )
            )
        else:
            return Moved(now, rows, [])
        moved = [(int(i), str(st), int(a)) for i, st, a in conn.execute(step_q)]
    return Moved(now, rows, moved)


@dataclass(frozen=True)
class Transition:
    id: int
    step: int
    at: float
    conductor: str
    came_from: str
    to: str
    details: str


#: a journal row as :class:`Transition` is made of it (in its fields' order)
_TRANSITION_COLUMNS = (
    journal.c.id,
    journal.c.step_id,
    journal.c.at,
    journal.c.conductor,
    journal.c.from_state,
    journal.c.to_state,
    journal.c.details,
)


def _transition(r: Any) -> Transition:
    return Transition(int(r.id), int(r.step_id), float(r.at), r.conductor, r[4], r[5], r.details)


def read_transitions(store: Store, ids: list[int]) -> list[Transition]:
    """Journal rows by id, oldest first."""
    if not ids:
        return []
    with store.read() as conn:
        return [
            _transition(r)
            for r in conn.execute(
                select(*_TRANSITION_COLUMNS).where(journal.c.id.in_(ids)).order_by(journal.c.id)
            )
        ]


def time_per_state(rows: list[Transition], now: float) -> dict[str, float]:
    """Seconds a step spent in each state, from its journal rows (oldest first): a state
    lasts from its entry to the next; the state it is in, not ended, until ``now``."""
    spent: dict[str, float] = {}
    for one, nxt in itertools.pairwise(rows):
        spent[one.to] = spent.get(one.to, 0.0) + max(0.0, nxt.at - one.at)
    if rows and rows[-1].to not in STEP_TERMINAL:
        last = rows[-1]
        spent[last.to] = spent.get(last.to, 0.0) + max(0.0, now - last.at)
    return {state: round(s, 3) for state, s in spent.items()}


def target_timeline(store: Store, name: str) -> dict[str, Any]:
    """Target ``name`` and its step in each strategy it has been in (deleted ones
    too), each with its transitions and the time it spent in each state."""
    now = time.time()
    shown = queries.get_target(store, name)
    step_ids = [int(s["step"]) for s in shown["strategies"]]
    by_step: dict[int, list[Transition]] = {i: [] for i in step_ids}
    if step_ids:
        with store.read() as conn:
            for r in conn.execute(
                select(*_TRANSITION_COLUMNS)
                .where(journal.c.step_id.in_(step_ids))
                .order_by(journal.c.id)
            ):
                by_step[int(r.step_id)].append(_transition(r))
    out = []
    for s in shown["strategies"]:
        rows = by_step[int(s["step"])]
        out.append(
            {
                **s,
                "started_at": rows[0].at if rows else None,
                "ended_at": rows[-1].at if rows and rows[-1].to in STEP_TERMINAL else None,
                "time_per_state_s": time_per_state(rows, now),
                "transitions": [
                    {
                        "at": t.at,
                        "from": t.came_from,
                        "to": t.to,
                        "conductor": t.conductor,
                        "details": t.details,
                    }
                    for t in rows
                ],
            }
        )
    return {"target": shown["name"], "group": shown.get("group"), "strategies": out}
