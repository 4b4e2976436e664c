"""The hot path: group commit of transitions (:class:`TransitionWriter`) and what it
writes and answers (:class:`Transition`, :class:`Event`, :class:`CommitResult`, ...).

:meth:`TransitionWriter.commit` writes many transitions, each a compare-and-set on
(step, state, visit, fence, owner) plus its journal row, in one transaction and one fsync
(group commit), checked against the strategy's fence. A row whose compare-and-set
fails, or whose journal insert would enter a state twice (G1), is rejected alone;
the others still commit. :mod:`fleetwave.store.runtime` re-exports all of it.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

from sqlalchemy import Connection, select
from sqlalchemy.exc import DatabaseError, DBAPIError, IntegrityError, OperationalError
from sqlalchemy.pool import PoolProxiedConnection

from fleetwave.domain.models import (
    STEP_ABORTED,
    STEP_FAILED,
    STEP_INITIAL,
    STEP_TERMINAL,
    StrategyState,
    unmanaged_reason,
)
from fleetwave.store.arrays import ArrayStatement
from fleetwave.store.db import Store
from fleetwave.store.schema import (
    journal,
)

#: Strategy states in which no step of the strategy starts: the commit that would start
#: one reads the strategy's state, so once an operator's pause or abort is committed,
#: nothing new starts (steps started before go on).
HOLD_ENTRIES = frozenset({StrategyState.PAUSED.value, StrategyState.ABORT_REQUESTED.value})
#: the fence a conductor passes for a strategy another leads, which it drives some steps
#: of (conductors sharing a strategy): no strategy fence of its own to check
SHARED = -1
#: the states of a strategy whose steps a conductor that does not lead it may still
#: write (not an ended or deleted one)
SHARED_STATES = frozenset(
    {
        StrategyState.APPLYING.value,
        StrategyState.PAUSED.value,
        StrategyState.ABORT_REQUESTED.value,
        StrategyState.ABORTING.value,
    }
)


@dataclass(slots=True)
class Transition:
    """One compare-and-set state change of one step, with its journal row."""

    step_id: int
    strategy_id: int
    from_state: str
    from_fence: int
    to_state: str
    fence: int
    details: str
    attempt: int
    #: the conductor is stopping: it enters ``to_state`` but will not start its action
    not_started: bool = False
    #: when ``to_state`` runs out of time (engine clock); None for terminal states
    deadline_at: float | None = None
    #: written whoever owns the step's row now (settling a row someone else changed,
    #: ending the steps of a strategy nobody can drive): the fence still decides
    any_owner: bool = False
    #: the step's group: an entry or an end counts in its slots too (``strategy_slots``)
    group_id: int | None = None
    #: the visit of ``from_state`` the step is in (its row's ``visit``: checked with its
    #: state and fence), and the visit of ``to_state`` it enters (1 for an end)
    from_visit: int = 1
    visit: int = 1
    #: entering a state that counts its visits: the step's visits so far (JSON), written
    #: on its row; None: the row's are kept
    visits: str | None = None


@dataclass(slots=True)
class Event:
    """A non-transition fact worth keeping: takeover, stale outcome, ignored message."""

    kind: str
    details: str
    strategy_id: int | None = None
    step_id: int | None = None


@dataclass(slots=True)
class CommitResult:
    #: transitions not written: refused by compare-and-set or a unique key, or fenced off
    rejected: list[Transition]
    #: strategies another conductor has claimed since this one did
    lost: set[int]
    #: entries written otherwise: failed, their target unmanaged since it was loaded;
    #: aborted, that failure having stopped the strategy (see :class:`StopRule`), as
    #: are that strategy's moves to a next state in the same commit
    replaced: list[Transition] = field(default_factory=list)
    #: entries not written (the steps still wait): a move of their strategy to an end
    #: was refused, so that step still holds its slot (and its stage); or the strategy
    #: is paused or its abort requested (:data:`HOLD_ENTRIES`)
    deferred: list[Transition] = field(default_factory=list)
    #: entries not written because a cap would have been exceeded (another conductor
    #: took the slots meanwhile), by strategy: how many (they are in :attr:`deferred`)
    no_slot: dict[int, int] = field(default_factory=dict)
    #: steps whose transition was refused because the callback that caused it had been
    #: answered already (another conductor, an operator, the strategy's end): a callback
    #: moves its step once at most (they are in :attr:`rejected`)
    answered: set[int] = field(default_factory=set)
    #: strategies whose entries were held back, and the state that held them: the
    #: operator's pause or abort reached the database before the dispatcher knew of it
    held_back: dict[int, str] = field(default_factory=dict)
    #: strategies whose entries were written as not started (their lease lapsing here,
    #: by the ``lapsing`` predicate when the commit went through): start none of them
    not_started: set[int] = field(default_factory=set)
    #: steps whose retry record (:class:`AttemptDeadline`) was not written: their row
    #: changed under this conductor (its fence or state), so the retry must not run
    retries_refused: set[int] = field(default_factory=set)
    #: steps whose retry was about to start (its start's record) while their strategy's
    #: abort is requested: not written, so the retry does not start (the operator's abort
    #: reached the database before the dispatcher knew of it; see :attr:`held_back`)
    retries_held: set[int] = field(default_factory=set)


def _never(_strategy_id: int) -> bool:
    return False


@dataclass(frozen=True, slots=True)
class StopRule:
    """A strategy's failure limit, as a commit that starts its steps must apply it."""

    #: failures it still tolerates (its limit minus the failed steps so far)
    tolerated: int
    #: why it stops once one more has failed (the not-started steps' details); the
    #: commit puts the name of the target whose failure crossed the limit for TARGET
    details: str
    #: (conductors sharing the strategy) its failure limit, checked in the commit
    #: against the failed steps every conductor counted (its slots row): once they are
    #: past it, the commit starts none of its steps, whoever's failures they were
    limit: int | None = None

    TARGET: ClassVar[str] = "{target}"


@dataclass(slots=True)
class AttemptDeadline:
    """A retry of a step still in ``state`` at ``fence``: its deadline, its attempt
    number and why (not a transition). With no attempt, only its deadline moves (a
    heartbeat on a state that waits for its target's callback)."""

    step_id: int
    strategy_id: int
    state: str
    fence: int
    deadline_at: float
    #: None: the row's attempt is kept, and no attempt starts
    attempt: int | None
    #: None: the row's details are kept
    details: str | None
    #: 1 while the retry waits to start (a takeover then runs it as this attempt, once
    #: due), 0 once it starts
    not_started: int = 0
    #: its attempt row's ``how`` (retry, resent)
    how: str = "retry"
    #: the visit of ``state`` the step is in (checked with its state and fence)
    visit: int = 1


@dataclass(slots=True)
class CallbackMark:
    """How the dispatcher answered one stored callback."""

    callback_id: int
    outcome: str  # applied | ignored
    reason: str
    strategy_id: int = 0
    #: for ``applied`` by a transition: its step (the mark is written only with it, and
    #: the transition only with the mark: a callback answered already moves nothing)
    step_id: int | None = None


# -- the hot path -------------------------------------------------------------------


def _moves(m: CallbackMark) -> bool:
    """Whether ``m`` is the answer of the callback that moves its step (written with the
    step's transition, and that transition with it: see :meth:`TransitionWriter.commit`)."""
    return m.outcome == "applied" and m.step_id is not None


def _is_entry(t: Transition) -> bool:
    """A step starting: out of ``initial`` into one of its workflow's states."""
    return t.from_state == STEP_INITIAL and t.to_state not in STEP_TERMINAL


def _held_back(t: Transition, hold: dict[int, str]) -> bool:
    """Whether ``hold`` (strategies by a state that holds steps back) keeps ``t`` from
    being written as it is: any entry of a paused or aborting strategy, and a move to
    a next state of one whose abort is requested."""
    state = hold.get(t.strategy_id)
    if state is None or t.to_state in STEP_TERMINAL:
        return False
    return t.from_state == STEP_INITIAL or state == StrategyState.ABORT_REQUESTED.value


def _starts(d: AttemptDeadline) -> bool:
    """Whether ``d`` records an attempt's start (its attempt row)."""
    return not d.not_started and d.attempt is not None


def _start_held(d: AttemptDeadline, hold: dict[int, str]) -> bool:
    """Whether ``hold`` keeps a retry from starting: its start (not its record made
    before the backoff) in a strategy whose abort is requested. A pause does not: the
    step is in flight, and goes on to its end."""
    return _starts(d) and hold.get(d.strategy_id) == StrategyState.ABORT_REQUESTED.value


def _slot_keys(t: Transition) -> tuple[tuple[int, int], ...]:
    """The slots a step's entry or end counts in: its strategy's, and its group's."""
    if t.group_id is None:
        return ((t.strategy_id, 0),)
    return ((t.strategy_id, 0), (t.strategy_id, t.group_id))


def _slot_change(t: Transition) -> tuple[int, int]:
    """What ``t`` changes in its slots: (in flight, failed)."""
    to_state = t.to_state
    if t.from_state == STEP_INITIAL:
        if to_state not in STEP_TERMINAL:
            return 1, 0
        return 0, int(to_state == STEP_FAILED)
    if to_state in STEP_TERMINAL:
        return -1, int(to_state == STEP_FAILED)
    return 0, 0


def _slot_changes(batch: list[Transition]) -> dict[tuple[int, int], list[int]]:
    """A batch's changes to slots: by (strategy, group 0 or the step's), [in flight,
    failed] (a failure counts on the strategy's row only)."""
    changes: dict[tuple[int, int], list[int]] = {}
    for t in batch:
        flight, failed = _slot_change(t)
        if not (flight or failed):
            continue  # (most moves: from one workflow state to the next)
        whole = (t.strategy_id, 0)
        row = changes.get(whole)
        if row is None:
            row = changes[whole] = [0, 0]
        row[0] += flight
        row[1] += failed
        if flight and t.group_id is not None:
            key = (t.strategy_id, t.group_id)
            row = changes.get(key)
            if row is None:
                row = changes[key] = [0, 0]
            row[0] += flight
    return changes


def _slot_rows(changes: dict[tuple[int, int], list[int]]) -> list[tuple[int, int, int, int]]:
    return [
        (flight, failed, sid, gid)
        for (sid, gid), (flight, failed) in sorted(changes.items())
        if flight or failed
    ]


class TransitionWriter:
    """Group commit of transitions. Not thread-safe: one conductor owns it."""

    def __init__(self, store: Store, conductor_id: str) -> None:
        self.store = store
        self.cid = conductor_id
        self._raw: PoolProxiedConnection | None = None
        #: the hot path's DBAPI connection and cursor (kept while ``_raw`` is), and module
        self._driver: Any = None
        self._cur: Any = None
        self._dbapi: Any = store.engine.dialect.dbapi
        #: the commit being written: its time, whether a strategy's lease is lapsing,
        #: and the strategies whose entries it wrote as not started for that
        self._at = 0.0
        self._lapsing: Callable[[int], bool] = _never
        self._lapsed_now: set[int] = set()
        #: the commit's answers of ``_lapsing``, by strategy
        self._lapsing_now: dict[int, bool] = {}
        #: how a boolean column is bound (index by the value)
        self._flags = (store.hooks.flag(False), store.hooks.flag(True))
        p = store.hooks.placeholder
        # One compare-and-set UPDATE per kind of move, so that what a kind always sets to
        # NULL is written in the SQL: binding a None costs the driver an adapter lookup
        # (SQLite: about 2.5 us a row, a quarter of the statement).
        head = f"UPDATE steps SET state={p}, fence={p}, details={p}, attempt={p}, "
        # The step's owner is checked with its state and fence: a step in a workflow
        # state is written only by the conductor that owns it (a row whose owner was
        # changed or cleared is refused, read back and settled); a waiting one has none.
        # A waiting step (``initial``) is started by the conductor that claimed it, or
        # by any when none has (one conductor loads its waiting steps without claiming).
        # The visit too: a state entered again (on a bounded cycle) is at the same state
        # and fence as its visit before; a write meant for that one must not apply.
        cas = (
            f" WHERE id={p} AND state={p} AND fence={p} AND visit={p} AND (owner={p} OR {p} "
            f"OR (owner IS NULL AND {p}))"
        )
        enter = (
            f"{head}owner={p}, started_at=COALESCE(started_at, {p}), "
            f"finished_at=NULL, not_started={p}, deadline_at={p}, visit={p}"
        )
        #: into a workflow state: owned by this conductor (under its strategy's lease)
        self._enter_sql = f"{enter}{cas}"
        #: the same, into a state that counts its visits: the step's visits written too
        self._enter_counted_sql = f"{enter}, visits={p}{cas}"
        #: a started step ends
        self._finish_sql = (
            f"{head}owner=NULL, started_at=COALESCE(started_at, {p}), "
            f"finished_at={p}, not_started={p}, deadline_at=NULL{cas}"
        )
        #: a step ends without having started (aborted, unmanaged): no started_at
        self._end_unstarted_sql = (
            f"{head}owner=NULL, finished_at={p}, not_started={p}, deadline_at=NULL{cas}"
        )
        #: an attempt released to its target (see :data:`attempts`)
        self._attempt_sql = (
            "INSERT INTO attempts (strategy_id, step_id, state, attempt, at, conductor, "
            f"fence, how, visit) VALUES ({p}, {p}, {p}, {p}, {p}, {p}, {p}, {p}, {p})"
        )
        self._journal_sql = (
            "INSERT INTO journal (strategy_id, step_id, at, conductor, from_state, to_state, "
            f"fence, details, visit) VALUES ({p}, {p}, {p}, {p}, {p}, {p}, {p}, {p}, {p})"
        )
        #: a retry: its deadline, attempt and why; a step that has moved on since is
        #: left alone
        self._deadline_sql = (
            f"UPDATE steps SET deadline_at={p}, attempt=COALESCE({p}, attempt), "
            f"details=COALESCE({p}, details), "
            f"not_started={p} WHERE id={p} AND state={p} AND fence={p} AND visit={p} "
            f"AND owner={p}"
        )
        self._mark_sql = (
            f"UPDATE callbacks SET outcome={p}, reason={p}, processed_at={p} "
            f"WHERE id={p} AND outcome IS NULL"
        )
        #: the fence check's statement by how many strategies a commit touches
        self._held_sql: dict[int, str] = {}
        self._event_sql = (
            "INSERT INTO events (at, conductor, strategy_id, step_id, kind, details) "
            f"VALUES ({p}, {p}, {p}, {p}, {p}, {p})"
        )
        #: a commit's entries and ends, counted in their strategy's and group's slots
        self._slot_sql = (
            f"UPDATE strategy_slots SET in_flight = in_flight + {p}, failed = failed + {p} "
            f"WHERE strategy_id = {p} AND group_id = {p}"
        )
        #: the same, in the hot path: a row that would go past its cap is not written
        self._slot_fit_sql = f"{self._slot_sql} AND ({p} <= 0 OR in_flight + {p} <= cap)"
        #: the slots of the strategies a commit starts steps of, by how many strategies
        self._slots_sql: dict[int, str] = {}
        #: PostgreSQL: each hot-path statement's rows sent as arrays, by its row SQL
        self._arrays: dict[str, ArrayStatement] = {}
        if store.hooks.name == "postgresql":
            self._arrays = self._array_statements()

    def _array_statements(self) -> dict[str, ArrayStatement]:
        """The hot path's statements (PostgreSQL) with each placeholder's type."""
        i4, f8, tx, bo = "int4", "float8", "text", "bool"
        # the compare-and-set: id, state, fence, visit, owner, any owner, initial
        cas = (i4, tx, i4, i4, tx, bo, bo)
        enter = (tx, i4, tx, i4, tx, f8, bo, f8, i4)
        shapes = {
            self._enter_sql: enter + cas,
            self._enter_counted_sql: (*enter, tx, *cas),
            self._finish_sql: (tx, i4, tx, i4, f8, f8, bo, *cas),
            self._end_unstarted_sql: (tx, i4, tx, i4, f8, bo, *cas),
        }
        # (each keyed by the step's id: the compare-and-set's first parameter)
        out = {
            sql: ArrayStatement(sql, types, (len(types) - len(cas),), by="id")
            for sql, types in shapes.items()
        }
        out[self._journal_sql] = ArrayStatement(
            self._journal_sql, (i4, i4, f8, tx, tx, tx, i4, tx, i4)
        )
        out[self._attempt_sql] = ArrayStatement(
            self._attempt_sql, (i4, i4, tx, i4, f8, tx, i4, tx, i4)
        )
        out[self._event_sql] = ArrayStatement(self._event_sql, (f8, tx, i4, i4, tx, tx))
        out[self._mark_sql] = ArrayStatement(self._mark_sql, (tx, tx, f8, i4), (3,), by="id")
        out[self._deadline_sql] = ArrayStatement(
            self._deadline_sql, (f8, i4, tx, bo, i4, tx, i4, i4, tx), (4,), by="id"
        )
        out[self._slot_fit_sql] = ArrayStatement(self._slot_fit_sql, (i4,) * 6, (2, 3))
        return out

    def _many(self, cur: Any, sql: str, rows: list[tuple[Any, ...]]) -> int:
        """Write ``rows`` of ``sql`` (as arrays on PostgreSQL); the rows written."""
        shape = self._arrays.get(sql)
        if shape is None:
            cur.executemany(sql, rows)
            return int(cur.rowcount)
        return shape.execute(cur, rows)

    def _params(self, t: Transition) -> tuple[str, tuple[Any, ...], tuple[Any, ...]]:
        """The step's compare-and-set UPDATE (statement and parameters), its journal row.

        Written at the commit's time (``self._at``: a commit retried through an outage
        went through later than it was decided). The step's attempt is its current
        state's: 1 entering a state; once ended, the attempts its last state took. An
        entry of a strategy whose lease is lapsing here is marked not started: nothing
        of it starts here any more, and the next owner starts it afresh.
        """
        at = self._at
        flags = self._flags
        to_state, fence, details = t.to_state, t.fence, t.details
        step_id, from_state, from_fence = t.step_id, t.from_state, t.from_fence
        upd: tuple[Any, ...]
        # (each tuple built at once, in the statement's order: once a transition)
        visit = 1
        if to_state not in STEP_TERMINAL:
            visit = t.visit
            sql = self._enter_sql if t.visits is None else self._enter_counted_sql
            sid = t.strategy_id
            stale = self._lapsing_now.get(sid)
            if stale is None:
                # (asked once a commit for each strategy)
                stale = self._lapsing_now[sid] = self._lapsing(sid)
                if stale:
                    self._lapsed_now.add(sid)
            upd = (
                to_state,
                fence,
                details,
                1,  # the attempt: a state is entered at its first
                self.cid,
                at,
                flags[t.not_started or stale],
                t.deadline_at,
                visit,
                *(() if t.visits is None else (t.visits,)),
                step_id,
                from_state,
                from_fence,
                t.from_visit,
                self.cid,
                flags[t.any_owner],
                flags[from_state == STEP_INITIAL],
            )
        else:
            # an end: without started_at if the step never started, else with it
            unstarted = from_state == STEP_INITIAL
            sql = self._end_unstarted_sql if unstarted else self._finish_sql
            stamps = (at,) if unstarted else (at, at)
            upd = (
                to_state,
                fence,
                details,
                t.attempt,
                *stamps,
                flags[t.not_started],
                step_id,
                from_state,
                from_fence,
                t.from_visit,
                self.cid,
                flags[t.any_owner],
                flags[unstarted],
            )
        jr = (t.strategy_id, step_id, at, self.cid, from_state, to_state, fence, details, visit)
        return sql, upd, jr

    def commit(
        self,
        batch: list[Transition],
        evts: list[Event],
        now: float,
        marks: list[CallbackMark] | None = None,
        fences: dict[int, int] | None = None,
        deadlines: list[AttemptDeadline] | None = None,
        stops: dict[int, StopRule] | None = None,
        lapsing: Callable[[int], bool] | None = None,
    ) -> CommitResult:
        """Commit a batch in one transaction (group commit).

        ``fences`` maps each strategy the batch touches to the fence this conductor
        claimed it with: if another conductor has claimed it since (this one was
        presumed dead), nothing of that strategy is written and it is reported lost.
        ``marks`` record how callbacks were answered, ``deadlines`` when retries run
        out of time, in the same transaction.

        A step about to start whose target an operator has unmanaged since it was
        loaded is written as failed instead (the check is in this transaction, so an
        unmanage either comes before the step starts or after). If that exceeds its
        strategy's failure limit (``stops``), the strategy's later entries in the batch
        are written as aborted, not started. Both are listed in
        :attr:`CommitResult.replaced`; ``batch`` itself is left as it is.

        ``lapsing``: whether a strategy's lease is lapsing at this conductor, asked once
        for each strategy as the commit is written (each attempt of a retried one asks
        again): all of its entries in the commit are then written as not started
        (:attr:`CommitResult.not_started`), or none.
        """
        self._at, self._lapsing = now, lapsing or _never
        self._lapsed_now = set()
        self._lapsing_now = {}
        # A callback that moves a step is marked with a compare-and-set (still open) that
        # the step's transition depends on; the others' marks are written as they can be.
        mk = [(m.outcome, m.reason, now, m.callback_id) for m in marks or () if not _moves(m)]
        mk_cas = [(m.outcome, m.reason, now, m.callback_id) for m in marks or () if _moves(m)]
        flags = self._flags  # (its 0 or 1 as the boolean column is bound)
        dl = [
            (
                d.deadline_at,
                d.attempt,
                d.details,
                flags[d.not_started],
                d.step_id,
                d.state,
                d.fence,
                d.visit,
                self.cid,
            )
            for d in deadlines or ()
        ]
        ups: list[tuple[str, tuple[Any, ...]]] = []
        jrs: list[tuple[Any, ...]] = []
        for t in batch:
            sql, u, j = self._params(t)
            ups.append((sql, u))
            jrs.append(j)
        ev = [(now, self.cid, e.strategy_id, e.step_id, e.kind, e.details) for e in evts]
        fences = fences or {}
        # Each attempt replaces entries in its own copies: the caller's batch stays as it
        # was, so the slower path, or a retried commit (a transient error), decides again.
        stops = stops or {}
        replaced: list[Transition] = []
        with self.store.writer_turn():  # (as every write: see Store.writer_turn)
            fast = self._commit_fast(
                list(batch),
                list(ups),
                list(jrs),
                ev,
                mk,
                mk_cas,
                fences,
                dl,
                stops,
                replaced,
                deadlines or [],
            )
        if fast:
            if self.store.syncs_outside_lock:  # (its connection's commits do not sync)
                self._sync()
            return CommitResult([], set(), replaced, not_started=self._lapsed_now)
        return self._commit_one_by_one(
            list(batch),
            ups,
            jrs,
            ev,
            marks or [],
            now,
            fences,
            deadlines or [],
            stops,
        )

    def _held(self, cur: Any, fences: dict[int, int]) -> tuple[set[int], dict[int, str]]:
        """Strategies no longer held by this conductor at the fence it claimed them with;
        and, of those still held, the ones whose steps may not start now (by state)."""
        if not fences:
            return set(), {}
        ids = sorted(fences)
        sql = self._held_sql.get(len(ids))
        if sql is None:
            sql = self._held_sql[len(ids)] = (
                "SELECT id, owner, fence, state FROM strategies "
                f"WHERE id IN ({self.store.hooks.placeholders(len(ids))})"
            )
        cur.execute(sql, ids)
        held: set[int] = set()
        hold: dict[int, str] = {}
        for sid, owner, fence, state in cur.fetchall():
            if (owner == self.cid and fence == fences[sid]) or (
                # a strategy another conductor leads, this one drives some steps of: its
                # steps' own fences and owner decide (checked row by row)
                fences[sid] == SHARED and state in SHARED_STATES
            ):
                held.add(int(sid))
                if state in HOLD_ENTRIES:
                    hold[int(sid)] = str(state)
        return set(ids) - held, hold

    def _past_counted_limit(
        self,
        cur: Any,
        batch: list[Transition],
        ups: list[tuple[str, tuple[Any, ...]]],
        jrs: list[tuple[Any, ...]],
        stops: dict[int, StopRule],
    ) -> list[Transition]:
        """Conductors sharing a strategy: once the failed steps all of them counted (its
        slots row, read in this transaction) are past its limit, its entries in the batch
        are written as not started, and its moves to a next state end aborted (as
        :meth:`_end_unmanaged` does for a stop in this commit). ``stops`` is narrowed to
        what the counted failures still tolerate."""
        limited = {sid: r.limit for sid, r in stops.items() if r.limit is not None}
        if not limited:
            return []
        entering = {t.strategy_id for t in batch if _is_entry(t)} & set(limited)
        if not entering:
            return []
        ids = sorted(entering)
        cur.execute(
            "SELECT strategy_id, failed FROM strategy_slots WHERE group_id = 0 AND "
            f"strategy_id IN ({self.store.hooks.placeholders(len(ids))})",
            ids,
        )
        stopped: dict[int, str] = {}
        for sid, failed in cur.fetchall():
            sid, limit = int(sid), limited[int(sid)]
            assert limit is not None
            rule = stops[sid]
            if int(failed) > limit:
                stopped[sid] = rule.details.replace(StopRule.TARGET, "another conductor's step")
            elif limit - int(failed) < rule.tolerated:
                stops[sid] = StopRule(limit - int(failed), rule.details, limit)
        out: list[Transition] = []
        for i, t in enumerate(batch):
            sid = t.strategy_id
            if sid not in stopped or t.to_state in STEP_TERMINAL:
                continue
            if t.from_state == STEP_INITIAL:
                details = f"not started: {stopped[sid]}"
            else:
                details = f"stopped after {t.from_state}: {stopped[sid]}"
            out.append(self._end_instead(batch, ups, jrs, i, STEP_ABORTED, details))
        return out

    def _end_unmanaged(
        self,
        cur: Any,
        batch: list[Transition],
        ups: list[tuple[str, tuple[Any, ...]]],
        jrs: list[tuple[Any, ...]],
        stops: dict[int, StopRule],
    ) -> list[Transition]:
        """Steps about to start whose target is unmanaged now: fail them instead; and
        once that exceeds a strategy's failure limit, start none of its later ones.

        Entries are replaced, in ``batch`` and in the statements' parameters (the
        caller's copies): ``initial -> failed`` with the unmanaged reason, or ``initial
        -> aborted`` as not started, as the dispatcher would have decided had it known;
        so are that strategy's moves to a next state in the batch (they end aborted
        after the state they finished). One query, only for batches that start steps.
        """
        at = {
            t.step_id: i
            for i, t in enumerate(batch)
            if t.from_state == STEP_INITIAL and t.to_state not in STEP_TERMINAL
        }
        if not at:
            return []
        hooks = self.store.hooks
        ids = list(at)
        # Lists padded to a power of two (with a repeated id): each length is its own
        # statement, and one per batch size would crowd the driver's statement cache,
        # which holds the hot path's UPDATEs and INSERTs.
        size = 1 << (len(ids) - 1).bit_length()
        ids += [ids[-1]] * (size - len(ids))
        cur.execute(
            "SELECT s.id, t.name FROM steps s JOIN targets t ON t.id = s.target_id "
            f"WHERE s.id IN ({hooks.placeholders(size)}) AND t.managed = {hooks.placeholder}",
            [*ids, hooks.flag(False)],
        )
        unmanaged = dict(cur.fetchall())
        if not unmanaged:
            return []
        tolerated = {sid: rule.tolerated for sid, rule in stops.items()}
        stopped: dict[int, str] = {}
        out: list[Transition] = []
        for i in sorted(at.values()):
            t = batch[i]
            sid = t.strategy_id
            if sid in stopped:
                to_state, details = STEP_ABORTED, f"not started: {stopped[sid]}"
            elif t.step_id in unmanaged:
                to_state, details = STEP_FAILED, unmanaged_reason(unmanaged[t.step_id])
                if sid in tolerated:
                    tolerated[sid] -= 1
                    if tolerated[sid] < 0:
                        who = unmanaged[t.step_id]
                        stopped[sid] = stops[sid].details.replace(StopRule.TARGET, who)
            else:
                continue
            out.append(self._end_instead(batch, ups, jrs, i, to_state, details))
        if stopped:
            # The stop happened in this commit: a step of that strategy moving on in it
            # must not start its next state either (the dispatcher, deciding the move,
            # did not know). It ends aborted after the state it finished.
            for i, t in enumerate(batch):
                sid = t.strategy_id
                if sid not in stopped or t.from_state == STEP_INITIAL:
                    continue
                if t.to_state in STEP_TERMINAL:
                    continue
                details = f"stopped after {t.from_state}: {stopped[sid]}"
                out.append(self._end_instead(batch, ups, jrs, i, STEP_ABORTED, details))
        return out

    def _end_instead(
        self,
        batch: list[Transition],
        ups: list[tuple[str, tuple[Any, ...]]],
        jrs: list[tuple[Any, ...]],
        i: int,
        to_state: str,
        details: str,
    ) -> Transition:
        """Write ``batch[i]`` as an end (``to_state``, at its fence) instead of what the
        dispatcher decided, in the batch and the statements' parameters (the caller's
        copies); the transition written."""
        batch[i] = ended = replace(
            batch[i],
            to_state=to_state,
            fence=batch[i].from_fence,
            details=details,
            not_started=False,
            deadline_at=None,
        )
        sql, u, j = self._params(ended)
        ups[i], jrs[i] = (sql, u), j
        return ended

    def _commit_fast(
        self,
        batch: list[Transition],
        ups: list[tuple[str, tuple[Any, ...]]],
        jrs: list[tuple[Any, ...]],
        ev: list[tuple[Any, ...]],
        mk: list[tuple[Any, ...]],
        mk_cas: list[tuple[Any, ...]],
        fences: dict[int, int],
        dl: list[tuple[Any, ...]],
        stops: dict[int, StopRule],
        replaced: list[Transition],
        deadlines: list[AttemptDeadline],
    ) -> bool:
        """The hot path: one transaction on a dedicated DBAPI connection, four executemany
        (the caller holds the writers' turn: see ``Store.writer_turn``).

        False (rolled back) when a strategy was lost, or a compare-and-set or a unique
        key refused a row (a callback that moves a step answered already, too): the
        caller then sorts the batch out row by row.
        """
        dbapi = self._dbapi
        raw_conn = self._raw
        if raw_conn is None:
            raw_conn = self._raw = self._connect()
            self._driver = raw_conn.driver_connection
            if self.store.syncs_outside_lock:
                # its commits sync after the writers' turn (see Store.write_then_sync)
                self.store.relax_sync(self._driver, raw_conn.info)
        raw = self._driver
        cur = self._cur
        if cur is None:
            # (kept from one commit to the next: made anew each time, it cost the hot
            # path; let go after an error, which may leave a statement open on it)
            cur = self._cur = raw.cursor()
        self.store.wait_for_locks(raw, raw_conn.info)
        try:
            cur.execute(self.store.hooks.begin_write_sql)
            if self.store.write_fault is not None:
                self.store.write_fault()
            lost, hold = self._held(cur, fences)
            if lost or (
                hold
                and (
                    any(_held_back(t, hold) for t in batch)
                    or any(_start_held(d, hold) for d in deadlines)
                )
            ):
                raw.rollback()  # the row-by-row path says what was not written, and why
                return False
            replaced += self._past_counted_limit(cur, batch, ups, jrs, stops)
            replaced += self._end_unmanaged(cur, batch, ups, jrs, stops)
            changes = _slot_changes(batch)
            ats = [self._attempt_row(d) for d in deadlines if _starts(d)] if dl else []
            by_sql: dict[str, list[tuple[Any, ...]]] = {}
            for sql, u in ups:
                by_sql.setdefault(sql, []).append(u)
            for sql, rows in by_sql.items():
                if self._many(cur, sql, rows) != len(rows):
                    raw.rollback()
                    return False
            if jrs:
                self._many(cur, self._journal_sql, jrs)
            if ats:
                self._many(cur, self._attempt_sql, ats)
            if ev:
                self._many(cur, self._event_sql, ev)
            if mk_cas and self._many(cur, self._mark_sql, mk_cas) != len(mk_cas):
                raw.rollback()  # answered already: the row-by-row path refuses its move
                return False
            if mk:
                self._many(cur, self._mark_sql, mk)
            if dl and self._many(cur, self._deadline_sql, dl) != len(dl):
                raw.rollback()  # a retry's row changed: the slower path says which
                return False
            rows_s = [(f, x, sid, gid, f, f) for f, x, sid, gid in _slot_rows(changes)]
            # Counted, each row only if it stays within its cap (G7): one that would not
            # is not written, and the row-by-row path writes the entries that fit.
            if rows_s and self._many(cur, self._slot_fit_sql, rows_s) != len(rows_s):
                raw.rollback()
                return False
            raw.commit()
            return True
        except dbapi.IntegrityError:
            self._rollback(raw)
            return False
        except dbapi.OperationalError as exc:
            self._rollback(raw)
            raise OperationalError("commit", None, exc) from exc
        except dbapi.DatabaseError as exc:  # a malformed file, ...: as SQLAlchemy says it
            self._rollback(raw)
            raise DatabaseError("commit", None, exc) from exc
        except BaseException:
            self._rollback(raw)
            raise

    def _read_slots(self, cur: Any, sids: set[int]) -> dict[tuple[int, int], list[int]]:
        """The slots of strategies ``sids``, locked for this transaction: by (strategy,
        group), [cap, in flight]."""
        ids = sorted(sids)
        sql = self._slots_sql.get(len(ids))
        if sql is None:
            sql = self._slots_sql[len(ids)] = (
                "SELECT strategy_id, group_id, cap, in_flight FROM strategy_slots "
                f"WHERE strategy_id IN ({self.store.hooks.placeholders(len(ids))})"
                + self.store.hooks.for_update
            )
        cur.execute(sql, ids)
        return {(int(r[0]), int(r[1])): [int(r[2]), int(r[3])] for r in cur.fetchall()}

    def _attempt_row(self, d: AttemptDeadline) -> tuple[Any, ...]:
        """A retry's (or a re-send's) start: its attempt row."""
        return (
            d.strategy_id,
            d.step_id,
            d.state,
            d.attempt,
            self._at,
            self.cid,
            d.fence,
            d.how,
            d.visit,
        )

    def _rollback(self, raw: Any) -> None:
        """After an error in the hot path's transaction: roll it back, and let go of the
        cursor (a statement it left half read would keep a read snapshot of the WAL open
        until the next commit, holding back checkpoints; rollback does not reset it)."""
        self._drop_cursor()
        try:
            raw.rollback()
        except self._dbapi.Error:
            # The connection itself is gone (PostgreSQL ended it: a restart, a dropped
            # link): let go of it for good, and the next commit opens a new one.
            self._lose_connection()

    def _lose_connection(self) -> None:
        raw_conn, self._raw, self._driver = self._raw, None, None
        if raw_conn is not None:
            raw_conn.invalidate()

    def _drop_cursor(self) -> None:
        cur, self._cur = self._cur, None
        if cur is not None:
            with contextlib.suppress(Exception):
                cur.close()

    def _commit_one_by_one(
        self,
        batch: list[Transition],
        ups: list[tuple[str, tuple[Any, ...]]],
        jrs: list[tuple[Any, ...]],
        ev: list[tuple[Any, ...]],
        marks: list[CallbackMark],
        now: float,
        fences: dict[int, int],
        deadlines: list[AttemptDeadline],
        stops: dict[int, StopRule],
    ) -> CommitResult:
        rejected: list[Transition] = []
        deferred: list[Transition] = []
        held_back: dict[int, str] = {}
        # the callback that moves each step, marked with its transition or not at all
        moving = {m.step_id: m for m in marks if _moves(m)}
        answered: set[int] = set()
        with self.store.write() as conn:
            raw: Any = conn.connection.driver_connection
            lost, hold = self._held(raw.cursor(), fences)
            stopped_now: list[Transition] = []
            if hold:
                # Paused, or its abort requested: none of its steps starts. Its entries
                # are not written (they wait again); its other moves are, but once its
                # abort is requested, a move to a next state ends the step instead
                # (aborted after the state it finished), as the dispatcher would decide.
                keep = [
                    i for i, t in enumerate(batch) if not (_is_entry(t) and t.strategy_id in hold)
                ]
                for i in sorted(set(range(len(batch))) - set(keep)):
                    deferred.append(batch[i])
                    held_back[batch[i].strategy_id] = hold[batch[i].strategy_id]
                batch = [batch[i] for i in keep]
                ups = [ups[i] for i in keep]
                jrs = [jrs[i] for i in keep]
                for i, t in enumerate(batch):
                    if _held_back(t, hold):
                        details = f"stopped after {t.from_state}: aborted by operator"
                        stopped_now.append(
                            self._end_instead(batch, ups, jrs, i, STEP_ABORTED, details)
                        )
                        held_back[t.strategy_id] = hold[t.strategy_id]
            replaced = stopped_now + self._past_counted_limit(raw.cursor(), batch, ups, jrs, stops)
            replaced += self._end_unmanaged(raw.cursor(), batch, ups, jrs, stops)
            rows = list(zip(batch, ups, jrs, strict=True))
            held: Counter[int] = Counter()
            # The slots of the strategies this batch starts steps of: by (strategy,
            # group), [cap, in flight], as of now (this transaction holds them)
            entering = {t.strategy_id for t in batch if _is_entry(t)}
            slot_rows = self._read_slots(raw.cursor(), entering) if entering else {}
            done: list[Transition] = []
            no_slot: Counter[int] = Counter()

            def fits(t: Transition) -> bool:
                """Whether entering ``t`` leaves its strategy's and group's slots within
                their caps, after what this transaction wrote so far."""
                return all(
                    slot_rows[k][1] < slot_rows[k][0] for k in _slot_keys(t) if k in slot_rows
                )

            def count(t: Transition) -> None:
                done.append(t)
                flight = _slot_change(t)[0]
                for k in _slot_keys(t) if flight else ():
                    if k in slot_rows:
                        slot_rows[k][1] += flight

            def write(t: Transition, sql: str, u: tuple[Any, ...], j: tuple[Any, ...]) -> None:
                if t.strategy_id in lost:
                    rejected.append(t)
                    return
                sp = conn.begin_nested()
                try:
                    res = conn.exec_driver_sql(sql, u)
                    if res.rowcount != 1:
                        sp.rollback()
                        if not self._already_applied(conn, t):
                            rejected.append(t)
                            held[t.strategy_id] += t.to_state in STEP_TERMINAL
                        return
                    m = moving.get(t.step_id)
                    if m is not None:
                        marked = conn.exec_driver_sql(
                            self._mark_sql, (m.outcome, m.reason, now, m.callback_id)
                        )
                        if marked.rowcount != 1:
                            # answered already (by another): it moves its step once at most
                            sp.rollback()
                            answered.add(t.step_id)
                            rejected.append(t)
                            held[t.strategy_id] += t.to_state in STEP_TERMINAL
                            return
                    conn.exec_driver_sql(self._journal_sql, j)
                    sp.commit()
                    count(t)
                except IntegrityError:
                    sp.rollback()
                    rejected.append(t)
                    held[t.strategy_id] += t.to_state in STEP_TERMINAL

            # Moves first, then the entries. The dispatcher admitted entries as soon as it
            # decided that steps ended (their slots free, perhaps their stage done); if such
            # an end is refused, the step is still in a state, so none of its strategy's
            # entries in this batch is written: they wait, and the dispatcher admits again
            # once it has read that step's row (more than max parallel in flight, or a
            # stage started before the last one ended, otherwise).
            for t, (sql, u), j in rows:
                if not _is_entry(t):
                    write(t, sql, u, j)
            for t, (sql, u), j in rows:
                if not _is_entry(t):
                    continue
                if held[t.strategy_id] and t.strategy_id not in lost:
                    deferred.append(t)
                elif t.strategy_id not in lost and not fits(t):
                    # Another conductor took the slot since this one decided (G7): the
                    # step waits again, still this conductor's to start.
                    deferred.append(t)
                    no_slot[t.strategy_id] += 1
                else:
                    write(t, sql, u, j)
            # (an entry and an end of one strategy in a batch cancel out: no row at all,
            # and no statement, which with no rows would run once without parameters)
            counts = _slot_rows(_slot_changes(done))
            if counts:
                conn.exec_driver_sql(self._slot_sql, counts)
            for t in rejected:
                why = (
                    "strategy claimed by another conductor (fenced off)"
                    if t.strategy_id in lost
                    else "its callback was answered already"
                    if t.step_id in answered
                    else "step no longer at that state and fence, or state already entered"
                )
                ev.append(
                    (
                        now,
                        self.cid,
                        t.strategy_id,
                        t.step_id,
                        "transition-rejected",
                        f"{t.from_state} -> {t.to_state} at fence {t.from_fence}: {why}",
                    )
                )
            if ev:
                conn.exec_driver_sql(self._event_sql, ev)
            # Callbacks of a lost strategy stay open: its new owner answers them. So does
            # one whose transition was refused: it is applied when that is settled.
            refused_steps = {t.step_id for t in rejected} | {t.step_id for t in deferred}
            mk = [
                (m.outcome, m.reason, now, m.callback_id)
                for m in marks
                if m.strategy_id not in lost
                and m.step_id not in refused_steps
                and not _moves(m)  # (written with its transition above)
            ]
            if mk:
                conn.exec_driver_sql(self._mark_sql, mk)
            retries_refused: set[int] = set()
            retries_held: set[int] = set()
            for d in deadlines:
                if d.strategy_id in lost:
                    continue
                if _start_held(d, hold):
                    retries_held.add(d.step_id)
                    held_back[d.strategy_id] = hold[d.strategy_id]
                    continue
                sp = conn.begin_nested()
                try:
                    written = conn.exec_driver_sql(
                        self._deadline_sql,
                        (
                            d.deadline_at,
                            d.attempt,
                            d.details,
                            self._flags[d.not_started],
                            d.step_id,
                            d.state,
                            d.fence,
                            d.visit,
                            self.cid,
                        ),
                    )
                    if written.rowcount == 1 and _starts(d):
                        # (an attempt recorded twice is refused: it must not run twice)
                        conn.exec_driver_sql(self._attempt_sql, self._attempt_row(d))
                except IntegrityError:
                    sp.rollback()
                    retries_refused.add(d.step_id)
                    continue
                sp.commit()
                if written.rowcount != 1:
                    retries_refused.add(d.step_id)
        refused = {id(t) for t in rejected} | {id(t) for t in deferred}
        return CommitResult(
            rejected,
            lost,
            [t for t in replaced if id(t) not in refused],
            deferred,
            no_slot=dict(no_slot),
            answered=answered,
            held_back=held_back,
            not_started=self._lapsed_now,
            retries_refused=retries_refused,
            retries_held=retries_held,
        )

    def _sync(self) -> None:
        """The fast path's commit made durable, outside the writers' turn (a failure to
        sync: as the database's own error, a store outage to retry)."""
        try:
            self.store.sync_wal()
        except OSError as exc:
            raise OperationalError("sync", None, exc) from exc

    def close(self) -> None:
        self._drop_cursor()
        self._driver = None
        if self._raw is not None:
            self._raw.close()  # (the pool restores its commits' sync: Store.relax_sync)
            self._raw = None

    def _connect(self) -> PoolProxiedConnection:
        """The hot path's own connection; a failure to connect (a server that is not
        there) as SQLAlchemy's error, as every other store call's is."""
        try:
            return self.store.engine.raw_connection()
        except self._dbapi.Error as exc:
            raise DBAPIError.instance("connect", None, exc, self._dbapi.Error) from exc

    def _already_applied(self, conn: Connection, t: Transition) -> bool:
        """True when this very transition is already committed (a retried, ambiguous commit)."""
        row = conn.execute(
            select(journal.c.fence, journal.c.conductor, journal.c.from_state).where(
                journal.c.step_id == t.step_id,
                journal.c.to_state == t.to_state,
                journal.c.visit == (1 if t.to_state in STEP_TERMINAL else t.visit),
            )
        ).first()
        return (
            row is not None
            and row.fence == t.fence
            and row.conductor == self.cid
            and row.from_state == t.from_state
        )
