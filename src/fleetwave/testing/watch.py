"""What the simulator watches besides the journal: skewed clocks, actions on a target,
leases taken, callbacks answered.

- :class:`SkewedClocks`: the ``skew`` fault gives each conductor its own wall clock
  (an offset, a drift, and forward steps as NTP or a resumed VM make), and maps the
  times it stamped back to the run's own time for the checks that compare times;
- :class:`ActionWatch`: a driver seen through it counts, per target, the actions on it
  at once: two at once (of two conductors, or two workers of one) is a G2 violation;
- :class:`LeaseWatch`: every few virtual seconds, who holds the strategy; a change of
  owner away from a conductor that is running and renewed its lease within the lease
  is a lease taken from a live conductor (G5).
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass, field
from typing import Any

from fleetwave.domain.models import Target
from fleetwave.domain.workflow import ActionContext
from fleetwave.engine.clock import LoopClock
from fleetwave.engine.conductor import Conductor
from fleetwave.store import runtime as rt
from fleetwave.store.db import Store


@dataclass
class _Skew:
    clock: LoopClock
    #: (loop time from which, offset) of each step of the clock, in order
    steps: list[tuple[float, float]] = field(default_factory=list)


class SkewedClocks:
    """Each conductor's wall clock, for seeds that draw the ``skew`` fault (half)."""

    def __init__(self, clock: LoopClock, rng: random.Random, on: bool) -> None:
        self.base = clock
        self.rng = rng
        self.on = on and rng.random() < 0.5
        self._by_id: dict[str, _Skew] = {}

    def clock_for(self, cid: str, loop: asyncio.AbstractEventLoop) -> LoopClock:
        if not self.on:
            return self.base
        offset = self.rng.uniform(-300.0, 300.0)
        clock = LoopClock(self.base.epoch, offset_s=offset, drift=self.rng.uniform(-0.02, 0.02))
        skew = self._by_id[cid] = _Skew(clock, [(0.0, offset)])
        if self.rng.random() < 0.5:
            # stepped forward (NTP catching up, a VM resumed) once, later in its life
            at = loop.time() + self.rng.uniform(1.0, 900.0)
            by = self.rng.uniform(10.0, 300.0)

            def step() -> None:
                clock.offset_s += by
                skew.steps.append((loop.time(), clock.offset_s))

            loop.call_at(at, step)
        return clock

    def true_at(self, cid: str | None, at: float) -> float:
        """A time ``cid`` stamped, as the run's own clock read it then."""
        skew = self._by_id.get(cid or "")
        if skew is None:
            return at
        c = skew.clock
        for since, offset in reversed(skew.steps):
            t = (at - c.epoch - offset) / (1.0 + c.drift)
            if t >= since - 1e-6:
                return c.epoch + t
        return at


class ActionWatch:
    """Counts, per target, the conductors whose actions (or recover hooks) are on it."""

    def __init__(self) -> None:
        self._on: dict[str, dict[str, int]] = {}
        self.violations: list[str] = []

    def driver(self, inner: Any, cid: str, *, counted: bool = True) -> Any:
        """``inner`` as conductor ``cid`` uses it; not ``counted``: a conductor that
        stalls (its actions stand for ones frozen with its process: fenced off at its
        next commit, not running on)."""
        return _Watched(inner, self, cid) if counted else inner

    def enter(self, target: str, cid: str, what: str) -> None:
        on = self._on.setdefault(target, {})
        # (one target is in one step at a time: any two actions on it at once are two
        # executors, of two conductors or of one)
        busy = sorted(c for c, n in on.items() if n)
        if busy and len(self.violations) < 50:
            self.violations.append(
                f"G2 at the target: {target}: {what} by {cid} while {busy[0]} acted on it"
            )
        on[cid] = on.get(cid, 0) + 1

    def leave(self, target: str, cid: str) -> None:
        self._on[target][cid] -= 1


class _Watched:
    """A driver as one conductor uses it: its calls on a target are counted."""

    def __init__(self, inner: Any, watch: ActionWatch, cid: str) -> None:
        object.__setattr__(self, "_inner", inner)
        object.__setattr__(self, "_watch", watch)
        object.__setattr__(self, "_cid", cid)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._inner, name, value)  # (callback_sink: the shared driver's)

    async def _call(self, name: str, target: Target, operation: str, ctx: ActionContext) -> Any:
        self._watch.enter(target.name, self._cid, f"{operation} ({name})")
        try:
            return await getattr(self._inner, name)(target, operation, ctx)
        finally:
            self._watch.leave(target.name, self._cid)

    async def perform(self, target: Target, operation: str, ctx: ActionContext) -> Any:
        return await self._call("perform", target, operation, ctx)

    async def observe(self, target: Target, operation: str, ctx: ActionContext) -> Any:
        return await self._call("observe", target, operation, ctx)

    async def start(self, target: Target, operation: str, ctx: ActionContext) -> Any:
        return await self._call("start", target, operation, ctx)


class LeaseWatch:
    """Who holds the strategy, looked at every ``every_s``: a lease may pass from a
    conductor only once it is gone, stopped, or has not written it (a claim, a renewal)
    for a lease's length (one that stalls never renews: its claim's lease runs out)."""

    def __init__(self, store: Store, sid: int, lease_ttl_s: float, every_s: float = 5.0) -> None:
        self.store = store
        self.sid = sid
        self.lease_ttl_s = lease_ttl_s
        self.every_s = every_s
        self.conductors: dict[str, tuple[Conductor, asyncio.Future[Any], bool]] = {}
        self.violations: list[str] = []

    def add(self, conductor: Conductor, task: asyncio.Future[Any], *, stalls: bool) -> None:
        self.conductors[conductor.id] = (conductor, task, stalls)

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        owner: str | None = None
        while True:
            await asyncio.sleep(self.every_s)
            try:
                _state, now_owner = rt.strategy_state(self.store, self.sid)
            except Exception:  # (an injected fault of the read: look again next time)
                continue
            if owner is not None and now_owner not in (None, owner):
                self._taken(owner, now_owner, loop.time())
            owner = now_owner

    def _taken(self, old: str, new: str, now: float) -> None:
        held = self.conductors.get(old)
        if held is None:
            return
        conductor, task, _stalls = held
        if task.done() or conductor.stopping:
            return
        renewed = conductor.renewed_at
        # (owner changes are seen up to every_s late; a renewal just before the claim
        # and then lost is older than the lease by then only if it was legitimately due)
        live = renewed is not None and now - renewed < self.lease_ttl_s - self.every_s
        if live and renewed is not None and len(self.violations) < 20:
            self.violations.append(
                f"G5: {new} took the strategy from {old}, which renewed its lease "
                f"{now - renewed:.1f} s before (lease {self.lease_ttl_s:g} s)"
            )


def callback_checks(waits: list[tuple[int, str, float]]) -> list[str]:
    """G6: a callback's answer never waits on the engine (on virtual time, it takes none)."""
    return [
        f"G6: the callback for step {step} ({state}) was answered after {waited:.3f} s "
        "of virtual time: it waited on something"
        for step, state, waited in waits[:20]
    ]
