"""Agents' callbacks stored a batch at a time (group commit): one transaction, one
fsync, for all the callbacks that came while the one before was being written. The
batch's agent tokens are checked in one query (not a read of its own per request),
just before that transaction, outside the write lock that the engine's group commits
wait for: a refused one is recorded in the transaction, with the caller's address, and
stores nothing. An idempotency key stored before is not read first: the batch's insert
skips its row (``ON CONFLICT DO NOTHING``) and the one stored is read then, the
answer. (A token replaced in between: the step's state is read again in the
transaction.)

A request adds its callback and waits for it to be written; one of the waiting
requests writes everything added so far, on the API's writer thread, at most once
every :data:`BATCH_GAP_S`. The batch's commit is synced after the write lock is let
go (:meth:`Store.write_then_sync`): a 202 is sent once the callback is on disk. The
write goes on if that request goes away (its client hung up): every callback of the
batch is answered. Nothing waits on the engine or on a step's lock (G6).
"""

from __future__ import annotations

import asyncio
import functools
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

from sqlalchemy import Connection, insert, select

from fleetwave.api.service import Service
from fleetwave.domain.errors import InputError
from fleetwave.store import callbacks as cbs
from fleetwave.store import tokens
from fleetwave.store.db import Store
from fleetwave.store.schema import events, steps

#: a batch begins to be written no sooner than this after the one before began: under
#: a steady stream (hundreds of agents) each batch gathers what came meanwhile, so the
#: API takes the database's write lock, and syncs, at most 250 times a second rather
#: than once or twice a callback, and the engine's group commits wait for it less
#: (an isolated callback, none written within it, is written at once)
BATCH_GAP_S = 0.004
#: the kind of event that records a callback refused for its token
CALLBACK_REFUSED = "callback-refused"


@dataclass(frozen=True, slots=True)
class Arrival:
    """A callback as it came: what it reports, the agent token it was sent with, and
    who sent it (the caller's address)."""

    report: cbs.Report
    token: str | None
    who: str


@dataclass(frozen=True, slots=True)
class Refused:
    """A callback refused for its token (nothing stored; the refusal recorded)."""

    #: 401 (no token, an unknown or expired one) or 403 (another step's or state's)
    status: int
    problem: str
    #: what the refusal's event says
    said: str


Answer = cbs.CallbackRecord | Refused | InputError
Waiting = tuple[Arrival, "asyncio.Future[Answer]"]


def judge(arrival: Arrival, grant: tokens.AgentGrant | None) -> Refused | None:
    """Whether the token lets the callback in (None), or why not."""
    r = arrival.report
    status = 401
    if arrival.token is None:
        problem = "no agent token (Authorization: Bearer ...)"
    elif grant is None:
        problem = "the agent token is not valid"
    elif grant.expired:
        problem = f"the agent token expired (it was for step {grant.step_id} {grant.state})"
    elif grant.step_id != r.step_id or grant.state != r.state:
        status = 403
        problem = (
            f"the agent token is for step {grant.step_id} in state {grant.state}, "
            f"not step {r.step_id} in {r.state}"
        )
    else:
        return None
    said = (
        f"callback for step {r.step_id} ({r.state}, {r.kind}) from {arrival.who} refused: {problem}"
    )
    return Refused(status, problem, said)


def _record_refusal(conn: Connection, step_id: int, strategy_id: int | None, said: str) -> None:
    """Record a refused callback (its step's strategy, if the step is there)."""
    if strategy_id is None:
        strategy_id = conn.execute(
            select(steps.c.strategy_id).where(steps.c.id == step_id)
        ).scalar_one_or_none()
    known = strategy_id is not None
    conn.execute(
        insert(events).values(
            at=time.time(),
            conductor=None,
            strategy_id=strategy_id,
            step_id=step_id if known else None,
            kind=CALLBACK_REFUSED,
            details=said,
        )
    )


def store_arrivals(store: Store, arrivals: Sequence[Arrival]) -> list[Answer]:
    """Check the tokens of ``arrivals`` and store those they let in, in one
    transaction: each one's answer, in order (its record, a Replay, a Refused, or
    the error that refused it: an unknown step)."""
    given = [a.token for a in arrivals if a.token is not None]
    now = max(a.report.now for a in arrivals)
    # What needs no write lock is read first: the write lock is every writer's, the
    # engine's group commits included, and it is held for as little as can be (one
    # query for the steps, the insert, the commit).
    with store.read() as conn:
        grants = tokens.find_agent_tokens(conn, given, now)
    with store.write_then_sync() as conn:  # (its sync outside the write lock)
        return _store_on(conn, arrivals, grants)


def _store_on(
    conn: Connection,
    arrivals: Sequence[Arrival],
    grants: dict[str, tokens.AgentGrant],
) -> list[Answer]:
    answers: list[Answer | None] = []
    let_in: list[int] = []
    for a in arrivals:
        grant = grants.get(a.token) if a.token is not None else None
        refused = judge(a, grant)
        if refused is None:
            let_in.append(len(answers))
            answers.append(None)
            continue
        _record_refusal(
            conn, a.report.step_id, None if grant is None else grant.strategy_id, refused.said
        )
        answers.append(refused)
    records = cbs.insert_callbacks(
        conn,
        [_of_visit(arrivals[i].report, grants.get(arrivals[i].token or "")) for i in let_in],
    )
    for place, answer in zip(let_in, records, strict=True):
        answers[place] = answer
    return [a for a in answers if a is not None]


def _of_visit(report: cbs.Report, grant: tokens.AgentGrant | None) -> cbs.Report:
    """The report as on the visit its token was issued for: a late agent of an earlier
    visit of a state on a cycle reports on that visit, and is ignored as late, never
    applied to the visit the step is in now."""
    if grant is None:
        return report
    r = report
    return cbs.Report(r.step_id, r.state, r.kind, r.details, r.now, r.idempotency_key, grant.visit)


class CallbackIntake:
    def __init__(self, service: Service, batch_gap_s: float = BATCH_GAP_S) -> None:
        self.service = service
        self.batch_gap_s = batch_gap_s
        self._waiting: list[Waiting] = []
        #: the task writing batches while there are callbacks waiting (None: none)
        self._writing: asyncio.Task[None] | None = None
        #: when the last batch began to be written (monotonic)
        self._last_batch = -math.inf

    async def accept(self, arrival: Arrival) -> cbs.CallbackRecord | Refused:
        """Check and store ``arrival`` (with the others waiting now): its record, a
        Replay, or why its token was refused."""
        answered: asyncio.Future[Answer] = asyncio.get_running_loop().create_future()
        self._waiting.append((arrival, answered))
        if self._writing is None:
            self._writing = asyncio.create_task(self._write_all(), name="fleetwave-intake")
        answer = await answered  # (a request that goes away: its callback is still written)
        if isinstance(answer, InputError):
            raise answer
        return answer

    async def _write_all(self) -> None:
        """Write what is waiting, a batch at a time, until nothing is (one write at a
        time: what comes meanwhile goes in the next)."""
        try:
            while self._waiting:
                wait = self._last_batch + self.batch_gap_s - time.monotonic()
                if wait > 0:  # (what comes meanwhile joins this batch)
                    await asyncio.sleep(wait)
                self._last_batch = time.monotonic()
                batch, self._waiting = self._waiting, []
                writing = self.service.write_nowait(
                    store_arrivals, self.service.store, [a for a, _ in batch]
                )
                try:
                    await asyncio.shield(writing)  # (it goes on if this task is cancelled)
                finally:
                    if writing.done():
                        _answer(batch, writing)
                    else:
                        writing.add_done_callback(functools.partial(_answer, batch))
        finally:
            self._writing = None


def _answer(batch: list[Waiting], done: asyncio.Future[list[Answer]]) -> None:
    """Answer each request of a batch written (or its error, if the write failed)."""
    error = done.exception() if not done.cancelled() else asyncio.CancelledError()
    answers = done.result() if error is None else [error] * len(batch)
    for (_, answered), answer in zip(batch, answers, strict=True):
        if answered.done():
            continue
        if isinstance(answer, BaseException) and not isinstance(answer, InputError):
            answered.set_exception(answer)
        else:
            answered.set_result(answer)
