"""Read models: what the others share (paging, kept strategies, shown JSON)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import islice
from typing import Any

from sqlalchemy import Table, func, select

from fleetwave.domain.models import (
    STEP_TERMINAL,
    StrategyState,
)
from fleetwave.store.db import Store
from fleetwave.store.schema import (
    deleted_steps,
    steps,
    strategies,
    targets,
)

#: rows read per transaction by the iterators below: a list printed into a pager that
#: waits must not hold a read transaction open (SQLite could not reset its WAL, and the
#: conductors' writes would grow it without end)
PAGE_ROWS = 5000


def _pages(store: Store, q: Any, key: Any, after: Any, rows: int | None = None) -> Iterator[Any]:
    """Rows of ``q`` in ``key`` order (unique), ``rows`` per read transaction (None:
    :data:`PAGE_ROWS`, as it is when the first page is read)."""
    rows = rows or PAGE_ROWS
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
