"""Deliberately broken copies of engine pieces, one per seed bug (../shared/seeds).

Never used by fleetwave itself: the simulation tests run them to show that the
simulator catches each bug within a bounded number of seeds.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fleetwave.engine.conductor import Conductor
from fleetwave.engine.messages import ActionFinished
from fleetwave.engine.run import InFlight, StrategyRun
from fleetwave.store import runtime as rt
from fleetwave.store.callbacks import CallbackRecord


class StaleSnapshotConductor(Conductor):
    """Seed 000: a periodic scan reads a snapshot, then dispatches from it.

    As in the reference system, workers are tracked in a table the workers clear
    themselves when done. Between the scan's read and its dispatch, a worker
    finishes its state (the step moves on or completes) and leaves the table; the
    scan sees "no worker" and starts one for the state it read, which was done.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.busy: set[int] = set()

    async def _run_state(self, run: StrategyRun, fl: InFlight, recovering: bool) -> ActionFinished:
        self.busy.add(fl.rec.step_id)
        try:
            return await super()._run_state(run, fl, recovering)
        finally:
            self.busy.discard(fl.rec.step_id)

    async def _rogue_worker(self, run: StrategyRun, rec: rt.StepRecord) -> None:
        self.post(await self._run_state(run, InFlight(rec, rec.state, rec.fence), False))

    async def _periodic(self) -> None:
        scanner = asyncio.create_task(self._scan())
        try:
            await super()._periodic()
        finally:
            scanner.cancel()
            await asyncio.gather(scanner, return_exceptions=True)

    async def _scan(self) -> None:
        while True:
            await asyncio.sleep(self.config.tick_s)
            for run in list(self.runs.values()):
                snapshot, _ = rt.load_open_steps(self.store, run.id)  # the stale read
                await asyncio.sleep(0.5)  # ... meanwhile workers finish ...
                for rec in snapshot:
                    if rec.state == "initial" or rec.step_id in self.busy:
                        continue
                    task = asyncio.create_task(self._rogue_worker(run, rec))
                    self._workers.add(task)


class SelfRemovingWorkerConductor(Conductor):
    """Seed 001: a worker removes itself from the dispatcher's table when it is done."""

    async def _run_state(self, run: StrategyRun, fl: InFlight, recovering: bool) -> ActionFinished:
        msg = await super()._run_state(run, fl, recovering)
        if run.inflight.pop(fl.rec.step_id, None) is not None:
            run.group_load[fl.rec.group_id] -= 1
        return msg


class NodeLocked(Exception):
    pass


class LockingCallbackConductor(Conductor):
    """Seed 003: the callback handler needs the step's lock, which its worker holds.

    Like an RPC ``call`` that tries to lock the node: it fails while the worker runs,
    the agent's callback is lost, and the node waits until its timeout.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.locks: dict[int, asyncio.Lock] = {}

    async def _run_state(self, run: StrategyRun, fl: InFlight, recovering: bool) -> ActionFinished:
        lock = self.locks.setdefault(fl.rec.step_id, asyncio.Lock())
        async with lock:
            return await super()._run_state(run, fl, recovering)

    def receive_callback(
        self, step_id: int, state: str, kind: str, details: str = ""
    ) -> CallbackRecord:
        lock = self.locks.get(step_id)
        if lock is not None and lock.locked():
            raise NodeLocked(f"step {step_id} is locked by its worker")
        return super().receive_callback(step_id, state, kind, details)


class ForgetsAbortConductor(Conductor):
    """An operator's abort is logged, then forgotten: new steps keep starting.

    Not one of the seed documents: it shows the simulator's operator abort is checked,
    not merely issued.
    """

    def _request_stop(self, sid: int, events: list[rt.Event]) -> None:
        super()._request_stop(sid, events)
        run = self.runs.get(sid)
        if run is not None:
            run.stopping = None


class _LoadTimeManagedWriter(rt.TransitionWriter):
    def _end_unmanaged(self, *args: Any, **kwargs: Any) -> list[rt.Transition]:
        return []


class LoadTimeManagedConductor(Conductor):
    """The managed flag is read when a page of waiting steps is loaded, never at the
    step's turn: a target unmanaged meanwhile is still operated on (found by an
    acceptance run before the simulator had the operator's unmanage)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._writer = _LoadTimeManagedWriter(self.store, self.id)


class RetriesAfterAbortConductor(Conductor):
    """An operator's abort stops admissions, but a step waiting to retry its state still
    tries again (found by a bug hunt: workers did not learn that the strategy stopped)."""

    def _request_stop(self, sid: int, events: list[rt.Event]) -> None:
        super()._request_stop(sid, events)
        run = self.runs.get(sid)
        for fl in run.inflight.values() if run is not None else ():
            fl.stopped = False


class LeavesRefusedStepsConductor(Conductor):
    """A transition refused while the strategy is still held (someone else changed the
    step's row) frees the step's slot and nobody drives the step again: the strategy
    can end with that step mid-state."""

    async def _settle(self, run: StrategyRun) -> None:
        run.settle_due = False
        run.unsettled.clear()
