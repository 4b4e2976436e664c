"""``fleetwave prune``: the one way history leaves the database.

``strategy delete`` keeps a strategy's history (its journal, attempts, events,
callbacks, and its steps as they ended); prune drops the whole record of strategies
that ended (or were deleted) before a given time, a chunk per transaction as a delete
goes, and says how many rows of each kind went. A strategy being pruned is marked
``pruning`` first (its history partly gone: ``check`` does not judge it); pruning again
finishes it. Ids stay taken (``id_counters``): a pruned strategy's id is never given
to another.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from sqlalchemy import Connection, Table, delete, func, select, update

from fleetwave.domain.models import StrategyState
from fleetwave.store.admin import DELETE_CHUNK, delete_strategy, in_chunks
from fleetwave.store.db import Store
from fleetwave.store.schema import (
    attempts,
    callbacks,
    deleted_steps,
    events,
    journal,
    steps,
    strategies,
)

#: what prune may drop: strategies that will not move again (and those it or a delete
#: left half-done, which it finishes)
PRUNABLE = (
    StrategyState.COMPLETE,
    StrategyState.FAILED,
    StrategyState.ABORTED,
    StrategyState.DELETING,
    StrategyState.DELETED,
    StrategyState.PRUNING,
)

#: the history tables, by the name prune reports them under (steps: working and kept)
_HISTORY = {
    "transitions": journal,
    "attempts": attempts,
    "events": events,
    "callbacks": callbacks,
}


@dataclass
class Pruned:
    """What a prune dropped (or, dry, would drop): the strategies, and rows by kind."""

    strategies: list[int] = field(default_factory=list)
    rows: dict[str, int] = field(default_factory=lambda: dict.fromkeys(("steps", *_HISTORY), 0))


def prunable(store: Store, before: float) -> list[int]:
    """Strategies that ended (or were deleted, by when they had ended) before
    ``before`` (epoch seconds), oldest first."""
    with store.read() as conn:
        return [
            int(sid)
            for sid in conn.execute(
                select(strategies.c.id)
                .where(
                    strategies.c.state.in_([s.value for s in PRUNABLE]),
                    strategies.c.updated_at < before,
                )
                .order_by(strategies.c.updated_at, strategies.c.id)
            ).scalars()
        ]


def _count(conn: Connection, sid: int) -> dict[str, int]:
    def rows_of(table: Table) -> int:
        return int(
            conn.execute(select(func.count()).where(table.c.strategy_id == sid)).scalar_one()
        )

    out = {"steps": rows_of(steps) + rows_of(deleted_steps)}
    for kind, table in _HISTORY.items():
        out[kind] = rows_of(table)
    return out


def prune(
    store: Store, before: float, *, dry_run: bool = False, chunk: int | None = None
) -> Pruned:
    """Drop the history of every strategy :func:`prunable` names (``dry_run``: count
    it only). An ended strategy not deleted is deleted first (its steps moved as a
    delete moves them); then its journal, attempts, events, callbacks and kept steps go,
    a chunk per transaction, and its row last."""
    chunk = chunk or DELETE_CHUNK
    out = Pruned()
    for sid in prunable(store, before):
        with store.read() as conn:
            counted = _count(conn, sid)
        if not dry_run and not _drop(store, sid, before, chunk):
            continue  # changed meanwhile (it is not counted)
        out.strategies.append(sid)
        for kind, n in counted.items():
            out.rows[kind] += n
    return out


def _drop(store: Store, sid: int, before: float, chunk: int) -> bool:
    with store.read() as conn:
        row = conn.execute(
            select(strategies.c.state, strategies.c.updated_at).where(strategies.c.id == sid)
        ).first()
    if row is None or row.state not in PRUNABLE or row.updated_at >= before:
        return False
    if row.state not in (StrategyState.DELETED, StrategyState.PRUNING):
        delete_strategy(store, sid, chunk=chunk)  # its steps leave the working tables
    with store.write() as conn:
        conn.execute(
            update(strategies)
            .where(strategies.c.id == sid)
            .values(state=StrategyState.PRUNING.value)
        )
    for table in (*_HISTORY.values(), deleted_steps):

        def one_chunk(conn: Connection, n: int, table: Table = table) -> int:
            some = select(table.c.id).where(table.c.strategy_id == sid).limit(n)
            return int(conn.execute(delete(table).where(table.c.id.in_(some))).rowcount)

        in_chunks(store, one_chunk, chunk)
    with store.write() as conn:
        conn.execute(delete(strategies).where(strategies.c.id == sid))
    return True
