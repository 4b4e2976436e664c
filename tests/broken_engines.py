"""Deliberately broken copies of engine pieces, one per seed bug (../shared/seeds).

Never used by fleetwave itself: the simulation tests run them to show that the
simulator catches each bug within a bounded number of seeds.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fleetwave.engine.conductor import Conductor
from fleetwave.engine.run import StrategyRun
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

    async def _work(self, run: StrategyRun, rec: rt.StepRecord, *args: Any) -> None:
        self.busy.add(rec.step_id)
        try:
            await super()._work(run, rec, *args)
        finally:
            self.busy.discard(rec.step_id)

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
                    task = asyncio.create_task(
                        self._work(run, rec, rec.state, rec.fence, False, None)
                    )
                    self._workers.add(task)


class SelfRemovingWorkerConductor(Conductor):
    """Seed 001: a worker removes itself from the dispatcher's table when it is done."""

    async def _work(self, run: StrategyRun, rec: rt.StepRecord, *args: Any) -> None:
        await super()._work(run, rec, *args)
        if run.inflight.pop(rec.step_id, None) is not None:
            run.group_load[rec.group_id] -= 1


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

    async def _work(self, run: StrategyRun, rec: rt.StepRecord, *args: Any) -> None:
        lock = self.locks.setdefault(rec.step_id, asyncio.Lock())
        async with lock:
            await super()._work(run, rec, *args)

    def receive_callback(
        self, step_id: int, state: str, kind: str, details: str = ""
    ) -> CallbackRecord:
        lock = self.locks.get(step_id)
        if lock is not None and lock.locked():
            raise NodeLocked(f"step {step_id} is locked by its worker")
        return super().receive_callback(step_id, state, kind, details)
