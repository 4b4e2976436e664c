"""Deterministic simulation: the real engine, store and sim driver on virtual time, under faults.

One run, for one seed:

1. a fresh SQLite file, N simulated targets whose settings (failure, flakiness, hangs,
   heavy-tailed latency, misbehaving callbacks) are drawn from the seed;
2. one strategy with options drawn from the seed (max parallel, groups and their caps,
   stop on failure, failure threshold);
3. conductors that crash (killed at a random virtual time, or at a chosen commit,
   before or after it) and restart with a new identity, taking over by lease expiry;
   conductors that stall (run on without renewing their leases) while a rival takes
   over, and must be fenced off; conductors stopped cleanly; transient database errors
   inside write transactions; an operator who aborts the strategy mid-run, who pauses
   it and resumes it later, or who unmanages a few targets while it runs; an outside
   writer that changes the rows of steps in flight (a hand edit, a rogue tool), so the
   conductor's next transitions for them are refused; wall clocks that differ between
   conductors, drift and step (leases must not care);
4. then every guarantee is checked from the journal and final rows, and the journal's
   digest is printed: the same seed gives the same journal, byte for byte. Besides the
   journal, the run watches that no two conductors act on one target at once, that no
   lease is taken from a conductor that renews it, and that every callback is answered
   at once (:mod:`fleetwave.testing.watch`).

``fleetwave sim --seed S`` runs this; the test suite sweeps seeds; a failing seed
replays exactly.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import random
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from sqlalchemy import select
from sqlalchemy.exc import OperationalError

from fleetwave.domain.errors import Conflict, InputError
from fleetwave.domain.models import (
    STEP_TERMINAL,
    STRATEGY_TERMINAL,
    ApplyType,
    Group,
    StrategyOptions,
    Target,
    plural,
    unmanaged_reason,
)
from fleetwave.domain.registry import get_workflow
from fleetwave.domain.rollout import RolloutSpec, parse_amount, parse_batches
from fleetwave.drivers.sim import SimDriver
from fleetwave.engine.clock import LoopClock
from fleetwave.engine.conductor import Conductor
from fleetwave.engine.config import EngineConfig
from fleetwave.engine.errors import SimulatedCrash, StoreUnavailable
from fleetwave.store import admin
from fleetwave.store import runtime as rt
from fleetwave.store.db import Store, open_store
from fleetwave.store.schema import callbacks, events, journal, steps, strategies
from fleetwave.store.schema import targets as target_table
from fleetwave.testing.invariants import check
from fleetwave.testing.vloop import Deadlock, Livelock, VirtualTimeLoop
from fleetwave.testing.watch import (
    ActionWatch,
    LeaseWatch,
    SkewedClocks,
    callback_checks,
)

FAULTS = (
    "errors",
    "hangs",
    "slow",
    "callbacks",
    "db",
    "outage",
    "crash",
    "stall",
    "stop",
    "abort",
    "pause",
    "unmanage",
    "meddle",
    "skew",
)

#: a time a conductor stamped, as the run's own clock read it (see SkewedClocks)
TrueAt = Callable[[str | None, float], float]

#: virtual time after which a strategy that has not ended is a liveness violation
VIRTUAL_LIMIT_S = 7 * 24 * 3600.0


def parse_faults(text: str) -> frozenset[str]:
    if text == "all":
        return frozenset(FAULTS)
    if text == "none":
        return frozenset()
    listed = [x.strip() for x in text.split(",") if x.strip()]
    twice = sorted({x for x in listed if listed.count(x) > 1})
    if twice:  # most often a typo for another fault, which would be left out
        raise ValueError(f"--faults: '{twice[0]}' given more than once")
    chosen = frozenset(listed)
    if not chosen:
        raise ValueError("--faults: must not be empty (all, none, or a list of faults)")
    if chosen & {"all", "none"}:
        raise ValueError("--faults: 'all' and 'none' stand alone, not in a list of faults")
    unknown = chosen - set(FAULTS)
    if unknown:
        raise ValueError(
            f"--faults: unknown fault '{sorted(unknown)[0]}' "
            f"(known: all, none, {', '.join(FAULTS)})"
        )
    return chosen


@dataclass(frozen=True)
class SimConfig:
    seed: int
    targets: int = 200
    workflow: str = "patch"
    faults: frozenset[str] = frozenset(FAULTS)
    keep_db: Path | None = None
    #: the conductor class under test (tests pass deliberately broken ones)
    conductor_cls: type[Conductor] = Conductor
    #: False: no stop on failure and no failure threshold, so every target runs its
    #: course (for runs at scale); the seed's other draws stay the same
    failure_limits: bool = True
    #: True: a random rollout plan too (stages, batches, canaries, stage limits, a wait
    #: between stages), from a generator of its own: the seed's other draws stay the same
    plans: bool = False
    #: a run still going at this virtual time breaks liveness (the guard tests of
    #: deliberately broken conductors use a shorter one: a healthy run takes hours)
    virtual_limit_s: float = VIRTUAL_LIMIT_S


@dataclass
class SimResult:
    seed: int
    workflow: str
    targets: int
    ok: bool
    violations: list[str]
    digest: str
    strategy_state: str
    transitions: int
    crashes: int
    store_retries: int
    callbacks: int
    virtual_s: float
    wall_s: float
    options: dict[str, Any] = field(default_factory=dict)
    #: clean stops (the conductor drained and handed its leases back)
    stops: int = 0
    #: the operator's abort was accepted (the strategy was still applying)
    aborted_by_operator: bool = False
    #: targets the operator unmanaged while the strategy ran
    unmanaged_by_operator: int = 0
    #: the operator paused the strategy (and resumed it, unless it ended while paused)
    paused_by_operator: bool = False
    #: rows of steps in flight an outside writer changed (their fence bumped)
    meddled: int = 0
    #: the database was out (every write failing) for a while during the run
    outage: bool = False
    #: conductors had wall clocks of their own (and a rival ran beside them)
    skewed: bool = False

    def line(self) -> str:
        verdict = "ok" if self.ok else "FAILED"
        return (
            f"seed {self.seed}: {verdict} {self.workflow} x{self.targets} "
            f"-> {self.strategy_state}{' (operator abort)' if self.aborted_by_operator else ''}, "
            f"{plural(self.transitions, 'transition')}, "
            f"{plural(self.crashes, 'crash', 'crashes')}, {plural(self.stops, 'clean stop')}, "
            f"{plural(self.store_retries, 'db retry', 'db retries')}, "
            f"{plural(self.callbacks, 'callback')}, {self.virtual_s / 3600:.1f} h virtual in "
            f"{self.wall_s:.2f} s, journal {self.digest[:16]}"
        )


def _target_settings(rng: random.Random, faults: frozenset[str], calm: bool) -> dict[str, Any]:
    """Per-target behaviour; a calm fleet has only recoverable faults, so it can complete."""
    s: dict[str, Any] = {"latency_ms": rng.choice([200, 1000, 5000])}
    if "slow" in faults:
        # heavy tails: completions arrive out of order, some take many minutes
        s.update(latency="lognormal", latency_sigma=rng.choice([0.5, 1.0, 1.8]))
    if "errors" in faults:
        s["flaky_rate"] = rng.choice([0, 0.02, 0.1])
        if not calm:
            s.update(
                failure_rate=rng.choice([0, 0, 0, 0.002, 0.01]),
                error_rate=rng.choice([0, 0, 0, 0.001]),
            )
            if rng.random() < 0.003:
                s["remote_state"] = "ready-to-apply"
    if "hangs" in faults and not calm:
        s["hang_rate"] = rng.choice([0, 0, 0, 0.002, 0.01])
    if "callbacks" in faults:
        s.update(
            callback_dup_rate=rng.choice([0, 0.1, 0.3]),
            callback_late_rate=rng.choice([0, 0.05, 0.2]),
        )
        if not calm:
            s.update(
                callback_fail_rate=rng.choice([0, 0.01]),
                callback_lost_rate=rng.choice([0, 0, 0.01]),
            )
    if rng.random() < 0.03:
        s["already_done"] = True
    return s


def _journal_digest(store: Store, sid: int) -> str:
    h = hashlib.sha256()
    with store.read() as conn:
        for row in conn.execute(
            select(
                journal.c.id,
                journal.c.step_id,
                journal.c.at,
                journal.c.conductor,
                journal.c.from_state,
                journal.c.to_state,
                journal.c.fence,
                journal.c.details,
            )
            .where(journal.c.strategy_id == sid)
            .order_by(journal.c.id)
        ):
            h.update(repr(tuple(row)).encode())
    return h.hexdigest()


def _extra_checks(store: Store, sid: int, state: str) -> list[str]:
    out: list[str] = []
    if state not in STRATEGY_TERMINAL:
        out.append(f"liveness: strategy {sid} is still {state} after the virtual time limit")
    with store.read() as conn:
        unanswered = conn.execute(
            select(callbacks.c.id, callbacks.c.step_id, callbacks.c.state).where(
                callbacks.c.strategy_id == sid,
                (callbacks.c.outcome.is_(None)) | (callbacks.c.reason.is_(None)),
            )
        ).all()
        held = conn.execute(
            select(steps.c.id, steps.c.owner).where(
                steps.c.strategy_id == sid, steps.c.owner.is_not(None)
            )
        ).all()
    for cb in unanswered:
        out.append(f"callbacks: callback {cb.id} for step {cb.step_id} ({cb.state}) never answered")
    if state in STRATEGY_TERMINAL:
        for st in held:
            out.append(f"lease: step {st.id} still held by {st.owner} after the strategy ended")
    return out


def _target_checks(sim: SimDriver) -> list[str]:
    """What the targets saw: no attempt of a state started twice, every callback stored."""
    out = [
        f"G1 at the target: {t} saw {op} attempt {attempt} started {n} times"
        for (t, op, attempt), n in sorted(sim.starts.items())
        if n > 1
    ]
    lost = sim.callbacks_sent - sim.callbacks_delivered
    if lost:
        out.append(f"G6: {lost} callbacks sent by targets were never accepted")
    return out


class _Faults:
    """The run's fault schedule, drawn from its own generator so it replays exactly."""

    def __init__(
        self,
        rng: random.Random,
        faults: frozenset[str],
        stop_rng: random.Random,
        abort_rng: random.Random,
        outage_rng: random.Random | None = None,
    ) -> None:
        self.rng = rng
        #: a window of virtual time in which every write fails (the database locked by
        #: another program, a disk full), for half the seeds: conductors ride it out
        self.outage: tuple[float, float] | None = None
        if "outage" in faults and outage_rng is not None and outage_rng.random() < 0.5:
            start = outage_rng.uniform(5, 120)
            self.outage = (start, start + outage_rng.uniform(20, 180))
        self.faults = faults
        # Clean stops and aborts draw from their own generators: the other faults of a
        # seed stay what they were before these kinds existed.
        self.stop_rng = stop_rng
        self.stops_left = stop_rng.randint(1, 2) if "stop" in faults else 0
        #: when the operator asks for an abort (virtual seconds), for 40 % of seeds
        self.abort_at: float | None = None
        if "abort" in faults and abort_rng.random() < 0.4:
            self.abort_at = abort_rng.uniform(1, 600)
        self.db_error_rate = rng.choice([0.005, 0.02, 0.05]) if "db" in faults else 0.0
        self.crashes_left = rng.randint(1, 3) if "crash" in faults else 0
        #: generations that stall (stop renewing leases while running on)
        self.stalls_left = rng.randint(1, 2) if "stall" in faults else 0

    def stall_plan(self) -> float | None:
        """Seconds after which a rival conductor starts, while this one stalls."""
        if self.stalls_left <= 0 or self.rng.random() < 0.5:
            return None
        self.stalls_left -= 1
        return self.rng.uniform(0, 300)

    def stop_plan(self) -> float | None:
        """Seconds after which this generation is stopped cleanly (Ctrl-C on serve)."""
        if self.stops_left <= 0 or self.stop_rng.random() < 0.5:
            return None
        self.stops_left -= 1
        return self.stop_rng.uniform(1, 900)

    def write_fault(self) -> None:
        if self.outage is not None:
            try:
                now = asyncio.get_running_loop().time()
            except RuntimeError:  # the harness's own setup and checks: no outage
                now = -1.0
            if self.outage[0] <= now < self.outage[1]:
                raise OperationalError("BEGIN", None, Exception("database is locked (outage)"))
        if self.db_error_rate and self.rng.random() < self.db_error_rate:
            raise OperationalError("BEGIN", None, Exception("database is locked (injected)"))

    def crash_plan(self) -> tuple[str, float | int] | None:
        """How the next conductor dies: ("time", virtual seconds) or (point, commit count)."""
        if self.crashes_left <= 0:
            return None
        self.crashes_left -= 1
        kind = self.rng.choice(["time", "before-commit", "after-commit"])
        if kind == "time":
            return ("time", self.rng.uniform(1, 900))
        return (kind, self.rng.randint(1, 60))


class _OperatorUnmanage:
    """``fleetwave target unmanage NAME`` for a few targets while the strategy runs (40 %
    of seeds, own generator): a step that had not started by then never starts."""

    def __init__(
        self, store: Store, clock: LoopClock, rng: random.Random, names: list[str], on: bool
    ) -> None:
        self.store = store
        self.clock = clock
        #: (virtual time, target names) to unmanage, in time order
        self.plan: list[tuple[float, list[str]]] = []
        if on and names and rng.random() < 0.4:
            for _ in range(rng.randint(1, 3)):
                picked = rng.sample(names, k=min(len(names), rng.randint(1, 5)))
                self.plan.append((rng.uniform(1, 600), picked))
            self.plan.sort()
        #: target name -> when its unmanage was committed (the conductors' clock)
        self.done: dict[str, float] = {}

    def schedule(self, loop: asyncio.AbstractEventLoop) -> None:
        for at, picked in self.plan:
            loop.call_at(at, self._unmanage, picked, 0)

    def _unmanage(self, names: list[str], tries: int) -> None:
        loop = asyncio.get_running_loop()
        for i, name in enumerate(names):
            try:
                admin.set_managed(self.store, name, False)
            except OperationalError:
                if tries < 5:  # an injected database error: the operator tries again
                    loop.call_later(5.0, self._unmanage, names[i:], tries + 1)
                return
            self.done.setdefault(name, self.clock.now())


class _OperatorPause:
    """``fleetwave strategy pause``, then ``resume`` a while later, typed while the
    strategy runs (40 % of seeds, own generator). Retried after an (injected) database
    error; refused once the strategy is no longer applying (ended, or aborted)."""

    def __init__(
        self, store: Store, sid: int, clock: LoopClock, rng: random.Random, on: bool
    ) -> None:
        self.store = store
        self.sid = sid
        self.clock = clock
        #: (virtual time of the pause, how long it lasts)
        self.plan: tuple[float, float] | None = None
        if on and rng.random() < 0.4:
            self.plan = (rng.uniform(1, 400), rng.uniform(30, 1800))
        #: when the pause, and the resume, were committed (the conductors' clock)
        self.paused_at: float | None = None
        self.resumed_at: float | None = None

    def schedule(self, loop: asyncio.AbstractEventLoop) -> None:
        if self.plan is not None:
            loop.call_at(self.plan[0], self._pause, 0)

    def window(self, end: float) -> tuple[float, float] | None:
        """From the pause to the resume (or ``end``: the strategy ended while paused)."""
        if self.paused_at is None:
            return None
        return (self.paused_at, end if self.resumed_at is None else self.resumed_at)

    def _pause(self, tries: int) -> None:
        assert self.plan is not None
        loop = asyncio.get_running_loop()
        try:
            admin.pause_strategy(self.store, self.sid)
        except Conflict:
            return  # not applying any more: nothing to pause
        except OperationalError:
            if tries < 5:
                loop.call_later(5.0, self._pause, tries + 1)
            return
        self.paused_at = self.clock.now()
        loop.call_later(self.plan[1], self._resume, 0)

    def _resume(self, tries: int) -> None:
        try:
            admin.resume_strategy(self.store, self.sid)
        except Conflict:
            pass  # aborted while paused: nothing starts either way
        except OperationalError:
            if tries < 50:
                asyncio.get_running_loop().call_later(5.0, self._resume, tries + 1)
                return
        self.resumed_at = self.clock.now()


def _pause_checks(
    store: Store, sid: int, window: tuple[float, float] | None, true_at: TrueAt
) -> list[str]:
    """While paused (from the commit of the pause to that of the resume), no step starts."""
    if window is None:
        return []
    paused, resumed = window
    with store.read() as conn:
        entries = conn.execute(
            select(journal.c.step_id, journal.c.at, journal.c.conductor).where(
                journal.c.strategy_id == sid,
                journal.c.from_state == "initial",
                journal.c.to_state.not_in(sorted(STEP_TERMINAL)),
            )
        ).all()
    started = [(r.step_id, true_at(r.conductor, r.at)) for r in entries]
    return [
        f"pause: step {step} started {at - paused:.1f} s after the operator's pause "
        f"(resumed {resumed - paused:.1f} s after it)"
        for step, at in started
        if paused < at < resumed
    ]


class _OutsideWriter:
    """Someone else writes the row of a step in flight (30 % of seeds, own generator): its
    fence is bumped, as a hand edit or a rogue tool might. The conductor's next
    transition for that step is refused; it must settle the step from the row (take it
    over, its recover hook decides), never leave it to nobody. The usual checks (every
    step ends, no state entered twice, no attempt started twice) cover the rest."""

    def __init__(self, store: Store, rng: random.Random, on: bool) -> None:
        self.store = store
        self.rng = rng
        self.plan: list[float] = []
        if on and rng.random() < 0.3:
            self.plan = sorted(rng.uniform(1, 900) for _ in range(rng.randint(1, 4)))
        self.meddled = 0

    def schedule(self, loop: asyncio.AbstractEventLoop) -> None:
        for at in self.plan:
            loop.call_at(at, self._meddle)

    def _meddle(self) -> None:
        try:
            with self.store.write() as conn:
                rows = conn.exec_driver_sql(
                    "SELECT id FROM steps WHERE state NOT IN "
                    "('initial', 'complete', 'failed', 'aborted') ORDER BY id"
                ).all()
                if not rows:
                    return
                step_id = self.rng.choice(rows)[0]
                conn.exec_driver_sql("UPDATE steps SET fence = fence + 1 WHERE id = ?", (step_id,))
        except OperationalError:
            return  # an injected database error: this edit did not happen
        self.meddled += 1


def _unmanage_checks(store: Store, sid: int, done: dict[str, float], true_at: TrueAt) -> list[str]:
    """A target unmanaged before its step started: the step never starts, and it ends
    failed as unmanaged (or aborted, when the strategy stopped first)."""
    out: list[str] = []
    with store.read() as conn:
        for name, at in sorted(done.items()):
            rows = conn.execute(
                select(
                    journal.c.from_state,
                    journal.c.to_state,
                    journal.c.at,
                    journal.c.details,
                    journal.c.conductor,
                )
                .join(steps, steps.c.id == journal.c.step_id)
                .join(target_table, target_table.c.id == steps.c.target_id)
                .where(journal.c.strategy_id == sid, target_table.c.name == name)
                .order_by(journal.c.id)
            ).all()
            entry = next((r for r in rows if r.from_state == "initial"), None)
            entry_at = true_at(entry.conductor, entry.at) if entry is not None else 0.0
            if entry is None or entry_at < at - 1e-6:
                continue  # started (or ended) before the operator unmanaged it
            if abs(entry_at - at) <= 1e-6:
                continue  # the same virtual instant: either order is right
            if entry.to_state not in ("failed", "aborted"):
                out.append(
                    f"unmanage: {name} started ({entry.to_state}) "
                    f"{entry_at - at:.1f} s after the operator unmanaged it"
                )
            elif entry.to_state == "failed" and entry.details != unmanaged_reason(name):
                out.append(f"unmanage: {name} failed with '{entry.details}', not as unmanaged")
    return out


class _OperatorAbort:
    """``fleetwave strategy abort``, typed while the strategy runs: retried after an
    (injected) database error, refused once the strategy has ended."""

    def __init__(self, store: Store, sid: int) -> None:
        self.store = store
        self.sid = sid
        self.accepted = False
        self.tries = 0

    def request(self) -> None:
        self.tries += 1
        try:
            admin.request_abort(self.store, self.sid)
        except Conflict:
            return  # ended already: nothing to abort
        except OperationalError:
            if self.tries < 5:
                asyncio.get_running_loop().call_later(5.0, self.request)
            return
        self.accepted = True


def _abort_checks(
    store: Store,
    sid: int,
    retries: list[tuple[str, str, int, float]],
    epoch: float,
    true_at: TrueAt,
) -> list[str]:
    """Once a conductor has seen the abort (running, or on taking the strategy over),
    no step enters a workflow state (none starts, none moves on), no state is tried
    again (what the targets saw), and the strategy ends aborted."""
    out: list[str] = []
    with store.read() as conn:
        seen = conn.execute(
            select(events.c.at, events.c.conductor)
            .where(events.c.strategy_id == sid, events.c.kind == "abort-seen")
            .order_by(events.c.id)
        ).first()
        final = conn.execute(select(strategies.c.state).where(strategies.c.id == sid)).scalar()
        if seen is not None:
            seen_at = true_at(seen.conductor, seen.at)
            # (rows of the very batch that saw it share its time, and come after it)
            moves = conn.execute(
                select(
                    journal.c.step_id,
                    journal.c.from_state,
                    journal.c.to_state,
                    journal.c.at,
                    journal.c.conductor,
                ).where(
                    journal.c.strategy_id == sid,
                    journal.c.to_state.not_in(sorted(STEP_TERMINAL)),
                )
            ).all()
            for r in moves:
                at = true_at(r.conductor, r.at)
                if at <= seen_at + 1e-6:
                    continue
                what = "started" if r.from_state == "initial" else f"moved on from {r.from_state}"
                out.append(
                    f"abort: step {r.step_id} {what} ({r.to_state}) "
                    f"{at - seen_at:.1f} s after a conductor saw the operator's abort"
                )
            for name, op, attempt, t in retries:
                if epoch + t > seen_at + 1e-6:
                    out.append(
                        f"abort: {name} saw attempt {attempt} of {op} start "
                        f"{epoch + t - seen_at:.1f} s after a conductor saw the operator's abort"
                    )
            if final != "aborted":
                out.append(f"abort: a conductor saw the operator's abort, yet it ended {final}")
    return out


def _crash_hook(point: str, at_count: int) -> Callable[[str], None]:
    seen = {"n": 0}

    def hook(p: str) -> None:
        if p == point:
            seen["n"] += 1
            if seen["n"] == at_count:
                raise SimulatedCrash(f"{point} #{at_count}")

    return hook


async def _simulate(cfg: SimConfig, db_path: Path) -> SimResult:
    wall0 = time.perf_counter()
    loop = asyncio.get_running_loop()
    rng = random.Random(cfg.seed)
    clock = LoopClock()
    # the operator's writes (setup, abort, unmanage, pause) on the virtual time line too:
    # a kept database reads as one run (this task's context, and its tasks')
    admin.ADMIN_CLOCK.set(clock.now)
    store = open_store(str(db_path), synchronous="OFF")
    wf = get_workflow(cfg.workflow)
    if wf is None:
        raise ValueError(f"--workflow: unknown workflow '{cfg.workflow}'")

    # the fleet
    n_groups = rng.choice([0, 0, 1, 3])
    groups = [f"g{i}" for i in range(n_groups)]
    for g in groups:
        admin.add_group(
            store,
            Group(
                g,
                max_parallel=rng.choice([1, 2, 5, 20]),
                apply_type=ApplyType.SERIAL if rng.random() < 0.1 else ApplyType.PARALLEL,
            ),
        )
    calm = rng.random() < 0.4
    targets = [
        Target(
            name=f"sc{i:05d}",
            group=rng.choice([*groups, None]) if groups else None,
            settings=_target_settings(rng, cfg.faults, calm),
            managed=calm or "errors" not in cfg.faults or rng.random() > 0.002,
        )
        for i in range(cfg.targets)
    ]
    admin.add_targets(store, targets)
    max_parallel = rng.choice([1, 3, 10, 50, max(1, cfg.targets)])
    stop_on_failure = rng.random() < 0.1
    max_failures = rng.choice([None, None, None, 0, 2, 10])
    opts = StrategyOptions(
        max_parallel=max_parallel,
        stop_on_failure=stop_on_failure and cfg.failure_limits,
        max_failures=max_failures if cfg.failure_limits else None,
        stages_by_group=bool(groups) and rng.random() < 0.3,
    )
    spec = None
    if cfg.plans:
        opts, spec = _random_plan(random.Random(cfg.seed * 7919 + 11), opts, groups, cfg)
    try:
        sid = admin.create_strategy(store, wf, opts, all_targets=True, spec=spec)
    except InputError:
        # a plan this fleet cannot take (more canaries than its first stage, a wait
        # with one stage): the same without canaries and waits
        assert spec is not None
        opts = replace(opts, stage_wait_s=0.0)
        spec = replace(spec, canary=None)
        sid = admin.create_strategy(store, wf, opts, all_targets=True, spec=spec)
    admin.apply_strategy(store, sid)

    faults = _Faults(
        random.Random(cfg.seed * 7919 + 1),
        cfg.faults,
        random.Random(cfg.seed * 7919 + 2),
        random.Random(cfg.seed * 7919 + 5),
        random.Random(cfg.seed * 7919 + 6),
    )
    store.write_fault = faults.write_fault
    sim = SimDriver(seed=cfg.seed)
    sim.count_starts = True  # checked below: no attempt of a state started twice
    # Small pages of waiting steps for some seeds (own generator: other draws unchanged).
    page = random.Random(cfg.seed * 7919 + 3).choice([0, 0, 3, 16])
    prefetch = random.Random(cfg.seed * 7919 + 4).choice([128, 128, 2, 16])
    config = EngineConfig(
        lease_ttl_s=60.0,
        tick_s=10.0,
        seed=cfg.seed,
        waiting_page=page,
        prefetch_page=prefetch,
    )
    skews = SkewedClocks(clock, random.Random(cfg.seed * 7919 + 9), "skew" in cfg.faults)
    actions = ActionWatch()
    leases = LeaseWatch(store, sid, config.lease_ttl_s)
    lease_watch = asyncio.ensure_future(leases.run())
    adopt_rng = random.Random(cfg.seed * 7919 + 10)
    rivals: list[tuple[Conductor, asyncio.Future[dict[int, str]]]] = []
    if skews.on:
        # A second conductor on the same database at a random moment (an operator's
        # `apply --wait` beside `serve`), patient: with leases on one clock it never
        # takes the strategy from one that renews it, whatever its wall clock says.
        def rival() -> None:
            rid = f"sim{cfg.seed}-rival"
            other = cfg.conductor_cls(
                store,
                clock=skews.clock_for(rid, loop),
                config=config,
                drivers={"sim": actions.driver(sim, rid)},
                conductor_id=rid,
            )
            task = asyncio.ensure_future(other.run(strategy_ids=[sid], patient=True))
            leases.add(other, task, stalls=False)
            rivals.append((other, task))

        loop.call_later(skews.rng.uniform(1.0, 600.0), rival)
    crashes = 0
    stops = 0
    retries = 0
    transitions = 0
    generation = 0
    state = "applying"
    stalled: list[tuple[Conductor, asyncio.Future[dict[int, str]]]] = []
    stuck: list[str] = []
    operator_abort = _OperatorAbort(store, sid)
    if faults.abort_at is not None:
        loop.call_at(faults.abort_at, operator_abort.request)
    unmanage = _OperatorUnmanage(
        store,
        clock,
        random.Random(cfg.seed * 7919 + 6),
        [t.name for t in targets],
        "unmanage" in cfg.faults,
    )
    unmanage.schedule(loop)
    pause = _OperatorPause(
        store, sid, clock, random.Random(cfg.seed * 7919 + 8), "pause" in cfg.faults
    )
    pause.schedule(loop)
    outsider = _OutsideWriter(store, random.Random(cfg.seed * 7919 + 7), "meddle" in cfg.faults)
    outsider.schedule(loop)
    while loop.time() < cfg.virtual_limit_s:
        stall_after = faults.stall_plan()
        if stall_after is not None:
            # This generation stalls: it runs on without renewing its leases, and a rival
            # starts later and takes over once they expire. The staller must be fenced off.
            zid = f"sim{cfg.seed}-c{generation}-stalled"
            # Half of them stall between their claim and adopting it, past the rival's
            # takeover: once they go on, they must take none of its steps over.
            late = adopt_rng.random() < 0.5
            zombie = cfg.conductor_cls(
                store,
                clock=skews.clock_for(zid, loop),
                config=replace(
                    config,
                    renew_leases=False,
                    adopt_stall_s=(
                        stall_after + config.lease_ttl_s + adopt_rng.uniform(10, 300)
                        if late
                        else 0.0
                    ),
                ),
                drivers={"sim": actions.driver(sim, zid, counted=False)},
                conductor_id=zid,
            )
            generation += 1
            zombie_task = asyncio.ensure_future(zombie.run(strategy_ids=[sid], patient=True))
            leases.add(zombie, zombie_task, stalls=True)
            stalled.append((zombie, zombie_task))
            await asyncio.sleep(stall_after)
        plan = faults.crash_plan()
        hook = _crash_hook(str(plan[0]), int(plan[1])) if plan and plan[0] != "time" else None
        cid = f"sim{cfg.seed}-c{generation}"
        # A slow adopt for some (longer than a periodic pass): the strategy must not be
        # claimed again meanwhile (a second run of it, two workers a step).
        slow = adopt_rng.uniform(5, 40) if "stall" in cfg.faults and adopt_rng.random() < 0.3 else 0
        conductor = cfg.conductor_cls(
            store,
            clock=skews.clock_for(cid, loop),
            config=replace(config, adopt_stall_s=slow),
            drivers={"sim": actions.driver(sim, cid)},
            conductor_id=cid,
            crash_hook=hook,
        )
        generation += 1
        stop_after = faults.stop_plan()
        stop = asyncio.Event() if stop_after is not None else None
        stopper = loop.call_later(stop_after, stop.set) if stop and stop_after else None
        task = asyncio.ensure_future(conductor.run(strategy_ids=[sid], patient=True, stop=stop))
        leases.add(conductor, task, stalls=False)
        killer: asyncio.TimerHandle | None = None
        if plan and plan[0] == "time":
            killer = loop.call_later(float(plan[1]), task.cancel)
        else:
            # Liveness: a conductor still running at the limit never stops by itself.
            def at_limit(t: asyncio.Future[dict[int, str]] = task) -> None:
                days = cfg.virtual_limit_s / 86400
                stuck.append(f"liveness: a conductor was still running after {days:g} days")
                t.cancel()

            killer = loop.call_at(cfg.virtual_limit_s, at_limit)
        try:
            result = await task
            state = result.get(sid, "unknown")
        except (SimulatedCrash, asyncio.CancelledError, StoreUnavailable):
            me = asyncio.current_task()
            if me is not None and me.cancelling():
                raise  # the run itself is cancelled (an interrupted sweep): no crash
            # (StoreUnavailable: stopped during an outage without handing its leases
            # back; as with a crash, the next conductor takes over once they run out)
            crashes += 1
        finally:
            if killer is not None:
                killer.cancel()
            if stopper is not None:
                stopper.cancel()
            transitions += conductor.stats.transitions
            retries += conductor.stats.store_retries
        if task.cancelled() or task.exception() is not None:
            await asyncio.sleep(rng.uniform(0, 120))  # the process is down for a while
            continue
        if state in STRATEGY_TERMINAL:
            break
        if stop is not None and stop.is_set():
            stops += 1
            await asyncio.sleep(faults.stop_rng.uniform(0, 120))  # restarted a little later
    for zombie, ztask in stalled + rivals:
        if not ztask.done():
            ztask.cancel()
        await asyncio.gather(ztask, return_exceptions=True)
        transitions += zombie.stats.transitions
    lease_watch.cancel()
    await asyncio.gather(lease_watch, return_exceptions=True)
    store.write_fault = None
    await sim.wait_agents()  # late callbacks still arrive after the end
    await sim.aclose()

    final_state, _owner = rt.strategy_state(store, sid)
    verdict = check(store, sid)
    violations = list(verdict.violations) + _extra_checks(store, sid, final_state)
    if operator_abort.accepted:
        violations += _abort_checks(store, sid, sim.retried_at, clock.epoch, skews.true_at)
    violations += _unmanage_checks(store, sid, unmanage.done, skews.true_at)
    violations += _pause_checks(store, sid, pause.window(clock.now()), skews.true_at)
    violations += _target_checks(sim) + stuck
    violations += actions.violations + leases.violations + callback_checks(sim.callback_waits)
    with store.read() as conn:
        n_callbacks = len(conn.execute(select(callbacks.c.id)).all())
    digest = _journal_digest(store, sid)
    store.dispose()
    return SimResult(
        seed=cfg.seed,
        workflow=cfg.workflow,
        targets=cfg.targets,
        ok=not violations,
        violations=violations,
        digest=digest,
        strategy_state=final_state,
        transitions=verdict.transitions,
        crashes=crashes,
        stops=stops,
        aborted_by_operator=operator_abort.accepted,
        unmanaged_by_operator=len(unmanage.done),
        paused_by_operator=pause.paused_at is not None,
        meddled=outsider.meddled,
        outage=faults.outage is not None and faults.outage[0] < loop.time(),
        skewed=skews.on,
        store_retries=retries,
        callbacks=n_callbacks,
        virtual_s=loop.time(),
        wall_s=time.perf_counter() - wall0,
        options={
            "max_parallel": opts.max_parallel,
            "stop_on_failure": opts.stop_on_failure,
            "max_failures": opts.max_failures,
            "groups": len(groups),
            **(
                {
                    "stages": [s.name for s in created.plan],
                    "batches": spec.batches and [b.text for b in spec.batches],
                    "canary": spec.canary and spec.canary.text,
                    "stage_wait_s": opts.stage_wait_s,
                }
                if spec is not None and (created := _options_of(store, sid)).plan
                else {}
            ),
        },
    )


def _random_plan(
    rng: random.Random, opts: StrategyOptions, groups: list[str], cfg: SimConfig
) -> tuple[StrategyOptions, RolloutSpec]:
    """A random rollout plan over the fleet's groups (``--stage``, ``--batches``,
    ``--canary``, ``--stage-max-failures``, ``--stage-wait``)."""
    stages: list[tuple[str, ...]] = []
    if groups and not opts.stages_by_group and rng.random() < 0.5:
        cut = rng.randint(1, len(groups))
        named: list[tuple[str, ...]] = [(g,) for g in rng.sample(groups, cut)]
        stages = [*named, ("rest",)]
    spec = RolloutSpec(
        stages=stages,
        stages_by_group=opts.stages_by_group,
        batches=parse_batches(rng.choice(["1,10%", "5", "25%"])) if rng.random() < 0.5 else [],
        canary=parse_amount(rng.choice(["1", "3", "2%"]), "--canary", least=1)
        if rng.random() < 0.3
        else None,
        stage_max_failures=parse_amount(rng.choice(["0", "3", "10%"]), "--stage-max-failures")
        if cfg.failure_limits and rng.random() < 0.3
        else None,
    )
    wait = rng.choice([0.0, 0.0, 30.0]) if stages or opts.stages_by_group else 0.0
    return replace(opts, stage_wait_s=wait), spec


def _options_of(store: Store, sid: int) -> StrategyOptions:
    with store.read() as conn:
        raw = conn.execute(select(strategies.c.options).where(strategies.c.id == sid))
        return admin.options_from_json(raw.scalar_one())


class Interrupt:
    """Stops a sweep of runs from a signal handler, as ``asyncio.run`` handles Ctrl-C:
    the run going on is cancelled and its tasks unwound (an exception raised at a
    random point of the engine's tasks left the loop's tasks pending and logged
    hundreds of errors), then :func:`run_simulation` raises ``KeyboardInterrupt``."""

    def __init__(self) -> None:
        self.requested = False
        self._cancel: Callable[[], None] | None = None

    def request(self) -> None:
        """Safe from a signal handler (the run's loop is woken through its self-pipe)."""
        self.requested = True
        if self._cancel is not None:
            self._cancel()


def _unwind(loop: asyncio.AbstractEventLoop) -> None:
    """Cancel every task left on ``loop`` and let them finish (as ``asyncio.run`` does)."""
    left = asyncio.all_tasks(loop)
    for task in left:
        task.cancel()
    if left:
        with contextlib.suppress(BaseException):
            loop.run_until_complete(asyncio.gather(*left, return_exceptions=True))


def run_simulation(cfg: SimConfig, interrupt: Interrupt | None = None) -> SimResult:
    """Run one seed on a fresh virtual-time loop and database.

    ``interrupt``: requested before or during the run, it raises ``KeyboardInterrupt``
    once the run's tasks are cancelled and unwound."""
    if interrupt is not None and interrupt.requested:
        raise KeyboardInterrupt
    tmp = Path(tempfile.mkdtemp(prefix=f"fleetwave-sim-{cfg.seed}-"))
    db_path = cfg.keep_db or tmp / "sim.db"
    loop = VirtualTimeLoop()
    main = loop.create_task(_simulate(cfg, db_path))
    if interrupt is not None:

        def cancel() -> None:
            loop.call_soon_threadsafe(main.cancel)

        interrupt._cancel = cancel
        if interrupt.requested:  # asked for while this run was being set up
            main.cancel()
    try:
        result = loop.run_until_complete(main)
        if interrupt is not None and interrupt.requested:
            # asked for as the run was ending: its result may be cut short, not kept
            _unwind(loop)
            raise KeyboardInterrupt
        return result
    except asyncio.CancelledError:
        if interrupt is None or not interrupt.requested:
            raise
        _unwind(loop)
        raise KeyboardInterrupt from None
    except (Livelock, Deadlock) as exc:
        return SimResult(
            seed=cfg.seed,
            workflow=cfg.workflow,
            targets=cfg.targets,
            ok=False,
            violations=[f"liveness: {exc}"],
            digest="",
            strategy_state="unknown",
            transitions=0,
            crashes=0,
            store_retries=0,
            callbacks=0,
            virtual_s=loop.time(),
            wall_s=0.0,
        )
    finally:
        if interrupt is not None:
            interrupt._cancel = None
        with contextlib.suppress(Livelock, Deadlock):
            loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()
        shutil.rmtree(tmp, ignore_errors=True)
