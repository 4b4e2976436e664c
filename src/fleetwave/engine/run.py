"""In-memory bookkeeping of one strategy being driven: pending queues and in-flight steps.

Owned by the dispatcher alone (G2): workers read a :class:`StrategyRun` (its workflow,
its id), never change it.
"""

from __future__ import annotations

import asyncio
import heapq
from collections import Counter, deque
from dataclasses import dataclass, field

from fleetwave.domain.models import StrategyOptions
from fleetwave.domain.rollout import phase_stages
from fleetwave.domain.rules import Decision, decide
from fleetwave.domain.workflow import Advance, StateDef, WorkflowDef
from fleetwave.store.callbacks import CallbackRecord
from fleetwave.store.runtime import CallbackMark, StepRecord, StrategyRecord, Transition

UNCAPPED = 1 << 30


_PLAIN_ADVANCE = Advance()


@dataclass(slots=True)
class InFlight:
    """A step holding a slot, and its worker: one task for the step's whole time in flight."""

    rec: StepRecord
    state: str
    fence: int
    recovering: bool = False
    #: the step's worker, made once the step's first state (or takeover) is committed
    task: asyncio.Task[None] | None = None
    #: set for wait-for-callback states: resolved by the dispatcher with the first callback
    waiter: asyncio.Future[CallbackRecord] | None = None
    #: made by the worker when it reports; the dispatcher resolves it after the commit:
    #: True to run the action of :attr:`state`, False when the worker should end
    go: asyncio.Future[bool] | None = None
    #: the attempt now running its action (0: none), and the last one that ran out of time
    running: int = 0
    timed_out: int = 0
    #: which attempt of its state that is (1, 2, ...)
    attempt_no: int = 0
    #: when (loop time) the running attempt runs out of time: armed as it starts, moved
    #: later by its target's heartbeats while it waits for the target's callback
    deadline: float = 0.0
    #: the last heartbeat that moved it (engine clock), None before any
    heard_at: float | None = None
    #: set by the dispatcher once the strategy stops (abort, failure limit): the worker
    #: starts no new attempt of its state (it reads this one flag at any time)
    stopped: bool = False
    #: while the worker waits out a retry's backoff: resolved early when the strategy
    #: stops (an abort does not wait for a retry that will not run)
    backoff: asyncio.Future[None] | None = None
    #: set by the dispatcher on an operator's abort: a wait on the target (for its
    #: callback, or between two polls) ends at once, and the step ends aborted
    aborted: bool = False
    #: while the worker waits on the target (its callback, a poll's interval):
    #: resolved early by an operator's abort
    waiting: asyncio.Future[None] | None = None
    #: a retry recorded and never started, taken over: when it is due (engine clock);
    #: it then runs as that attempt (never through the recover hook)
    retry_due: float | None = None
    #: which visit of :attr:`state` the step is in, and the visits so far of the states
    #: that count them (a bounded cycle's): from its row, then as the dispatcher moves it
    visit: int = 0
    visits: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.visit == 0:
            self.visit = self.rec.visit
            self.visits = dict(self.rec.visits)


@dataclass(slots=True)
class Unsettled:
    """A step whose transition was refused although the strategy is still held."""

    #: the transition refused (None: the step moved between a takeover's read and write)
    refused: Transition | None
    stage: int | None
    #: the group whose slot it holds until settled (``held``)
    group_id: int | None
    held: bool
    #: the callback that caused the refused transition, marked applied with it
    mark: CallbackMark | None = None
    #: refused because that callback had been answered already (by another): the
    #: transition is not applied again; the step is taken over (a wait waits again)
    answered: bool = False


@dataclass
class StrategyRun:
    record: StrategyRecord
    workflow: WorkflowDef
    options: StrategyOptions
    #: stage -> group_id -> steps still initial, in admission order
    pending: dict[int, dict[int | None, deque[StepRecord]]] = field(default_factory=dict)
    inflight: dict[int, InFlight] = field(default_factory=dict)
    group_load: Counter[int | None] = field(default_factory=Counter)
    failed: int = 0
    #: why nothing new starts: None while running, else "abort" or "failure"
    stopping: str | None = None
    stop_details: str = ""
    #: a stop for failures is on the strategy's row (its details), for show and list
    stop_said: bool = False
    #: the operator paused it: no new step starts (steps in flight go on to their end)
    paused: bool = False
    db_state: str = "applying"
    #: callbacks that arrived before their step began waiting, by step
    early_callbacks: dict[int, list[CallbackRecord]] = field(default_factory=dict)
    #: waiting steps are loaded page by page, in admission order: the last one loaded
    #: (ordinal and stage), and whether more wait in the database
    waiting_after: int = -1
    waiting_stage: int = 0
    more_waiting: bool = False
    #: free slots, but nothing loaded may take them: load the next page first
    starved: bool = False
    #: how many steps :attr:`pending` holds (asked for on every batch)
    _pending_n: int = 0
    #: the stages :attr:`pending` has keys for, as a heap: the lowest is found without
    #: looking at every stage (a plan of batches of 1 has one per target); a stage
    #: emptied is dropped once it comes to the top
    _stage_heap: list[int] = field(default_factory=list)
    #: steps whose transition was refused although the strategy is still held (their
    #: row was changed by someone else), with their stage if known: read back and
    #: settled before the strategy ends; each keeps its slot (and its stage open) until
    #: then
    unsettled: dict[int, Unsettled] = field(default_factory=dict)
    #: read the unsettled steps' rows on the dispatcher's next turn (new ones, or the
    #: retry timer fired); a retry waits for a tick, so a row that keeps changing costs
    #: one read a tick
    settle_due: bool = False
    settle_timer: asyncio.TimerHandle | None = None
    #: loop time its lease was last written from (claim, or a renewal that got through):
    #: the lease runs out ``lease_ttl_s`` after it
    lease_from: float = 0.0
    #: its lease is lapsing (renewals overdue): the watchdog stopped its actions and
    #: told the dispatcher, which may be stuck in a store retry; until the dispatcher
    #: drops it, nothing of it starts (G2: another conductor may take it over soon)
    lapsed: bool = False
    #: the database refused entries for want of a slot (G7 counted there: another
    #: conductor's steps hold them, or the counts drifted): nothing is admitted until one
    #: of its steps ends or a tick has passed
    no_room: bool = False
    #: another conductor leads it: this one drives the steps it claimed, beside it, and
    #: decides nothing of the strategy's (its end, stop, gates are the leader's)
    shared: bool = False
    #: (led, shared with others) steps still open elsewhere when it was last looked at
    peers_open: bool = False
    #: loop time that was last looked at
    peers_looked_at: float = 0.0
    #: a timer wakes the dispatcher to look again while they are open (see
    #: ``SharingMixin._look_again``)
    looking_again: bool = False
    #: (shared) the part of its max parallel this conductor takes: the cap over the
    #: conductors sharing it, so each gets a part of the free slots
    share_cap: int = 1 << 30

    #: the strategy's id (asked for on every transition: a plain attribute)
    id: int = field(init=False)
    #: its workflow's states by name (asked for on every action: a plain dict)
    defs: dict[str, StateDef] = field(init=False, repr=False)
    #: by state, what :func:`decide` makes of a plain :class:`Advance` (the next state,
    #: no details): nearly every action's outcome, made once
    advance: dict[str, Decision] = field(init=False, repr=False)
    #: its steps run in more than one phase (stages, batches, canaries)
    staged: bool = field(init=False)
    #: by phase (a step's stage column), the index of its stage in the options' plan
    phase_stage: list[int] = field(init=False, repr=False)
    #: failed steps by stage of the plan (for the stages' own limits and canaries)
    failed_in_stage: Counter[int] = field(default_factory=Counter)
    #: whether failures may stop it (a failure limit, a stage's own, canaries)
    limits_failures: bool = field(init=False)
    #: whether something besides the steps' ends holds a phase's start (a wait after a
    #: stage, an approval: see fleetwave.domain.rollout.phase_gate)
    gated: bool = field(init=False)
    #: the phase its gate was found open for (0: none yet): admissions from any other
    #: phase wait until the dispatcher has looked at that one's gate
    gate_phase: int = 0
    #: a phase whose gate the dispatcher is to look at (after its next admissions)
    gate_due: int | None = None
    #: wakes the dispatcher when a gate's time comes (or to look for an approval again)
    gate_timer: asyncio.TimerHandle | None = None

    def __post_init__(self) -> None:
        self.id = self.record.id
        self.defs = {st.name: st for st in self.workflow.states}
        names = self.workflow.state_names
        nexts = self.workflow.done_next
        self.advance = {name: decide(names, name, _PLAIN_ADVANCE, nexts) for name in names}
        self.staged = self.options.staged
        self.phase_stage = phase_stages(self.options.plan)
        self.limits_failures = self.options.failure_limit is not None or any(
            s.canary or s.max_failures is not None for s in self.options.plan
        )
        self.gated = self.options.gated

    @property
    def waits_for_callbacks(self) -> bool:
        return any(st.mode == "wait-for-callback" for st in self.workflow.states)

    @property
    def cap(self) -> int:
        """Its max parallel; when conductors share it, this one's part of it (the
        database holds the whole cap across all of them: G7)."""
        return min(self.options.effective_parallel, self.share_cap)

    def group_cap(self, group_id: int | None) -> int:
        if group_id is None:
            return UNCAPPED
        return self.record.group_caps.get(group_id, UNCAPPED)

    def add_pending(self, rec: StepRecord) -> None:
        self._stage_queues(rec.stage).setdefault(rec.group_id, deque()).append(rec)
        self._pending_n += 1

    def _stage_queues(self, stage: int) -> dict[int | None, deque[StepRecord]]:
        queues = self.pending.get(stage)
        if queues is None:
            queues = self.pending[stage] = {}
            heapq.heappush(self._stage_heap, stage)
        return queues

    def _lowest_pending(self) -> int | None:
        """The lowest stage with a step waiting (stages emptied are dropped)."""
        heap = self._stage_heap
        while heap:
            queues = self.pending.get(heap[0])
            if queues is not None and any(queues.values()):
                return heap[0]
            self.pending.pop(heapq.heappop(heap), None)
        return None

    def pending_count(self) -> int:
        return self._pending_n

    def current_stage(self) -> int | None:
        """The lowest stage with work left; later stages wait until it is all terminal.

        O(log stages): it relies on what admission keeps true, that no step waits in a
        stage below one in flight (a staged strategy's waiting steps are all loaded
        before any starts; a step put back waits in the stage it was taken from)."""
        if not self.staged:
            # All steps share one stage: no need to look at every step in flight.
            for one, groups in self.pending.items():
                if any(groups.values()):
                    return one
            for fl in self.inflight.values():
                return fl.rec.stage
            return None
        # Steps in flight are all of the lowest stage with work left (a later one starts
        # only once the earlier ones have ended): one of them says which, as do the
        # unsettled ones (rare), and the lowest stage waiting.
        stage = self._lowest_pending()
        for fl in self.inflight.values():
            if stage is None or fl.rec.stage < stage:
                stage = fl.rec.stage
            break
        for u in self.unsettled.values():
            if u.stage is not None and (stage is None or u.stage < stage):
                stage = u.stage
        return stage

    def held_slots(self) -> int:
        """Slots taken: steps in flight, and unsettled ones (they may be taken over)."""
        return len(self.inflight) + len(self.unsettled)

    def take_admissions_possible(self) -> bool:
        return (
            self.stopping is None
            and not self.no_room
            and self.held_slots() < self.cap
            and self.pending_count() > 0
        )

    def take_admissions(self, limit: int) -> list[StepRecord]:
        """Pop the steps that may start now: sliding window under every cap."""
        if self.stopping is not None or self.no_room:
            return []
        free = min(limit, self.cap - self.held_slots())
        if free <= 0:
            return []
        stage = self.current_stage()
        if stage is None or stage not in self.pending:
            return []
        if self.gated and stage != self.gate_phase:
            self.gate_due = stage  # the dispatcher looks at its gate first
            return []
        out: list[StepRecord] = []
        for gid, queue in self.pending[stage].items():
            room = min(free - len(out), self.group_cap(gid) - self.group_load[gid])
            while room > 0 and queue:
                out.append(queue.popleft())
                room -= 1
            if len(out) >= free:
                break
        self._pending_n -= len(out)
        return out

    def requeue_front(self, recs: list[StepRecord]) -> None:
        """Put steps taken by :meth:`take_admissions` back, in their order."""
        for rec in reversed(recs):
            self._stage_queues(rec.stage).setdefault(rec.group_id, deque()).appendleft(rec)
        self._pending_n += len(recs)

    def drain_pending(self) -> list[StepRecord]:
        out = [rec for groups in self.pending.values() for q in groups.values() for rec in q]
        self.pending.clear()
        self._stage_heap.clear()
        self._pending_n = 0
        return out

    def is_done(self) -> bool:
        return (
            not self.inflight
            and self.pending_count() == 0
            and not self.more_waiting
            and not self.unsettled
        )
