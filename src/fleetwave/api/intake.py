"""Agents' callbacks stored a batch at a time (group commit): one transaction, one
fsync, for all the callbacks that came while the one before was being written.

A request adds its callback and waits for it to be written; one of the waiting
requests writes everything added so far, on the API's writer thread. The write goes
on if that request goes away (its client hung up): every callback of the batch is
answered. Nothing waits on the engine or on a step's lock (G6).
"""

from __future__ import annotations

import asyncio

from fleetwave.api.service import Service
from fleetwave.domain.errors import InputError
from fleetwave.store import callbacks as cbs

Answer = cbs.CallbackRecord | InputError
Waiting = tuple[cbs.Report, "asyncio.Future[Answer]"]


class CallbackIntake:
    def __init__(self, service: Service) -> None:
        self.service = service
        self._waiting: list[Waiting] = []
        self._turn = asyncio.Lock()

    async def accept(self, report: cbs.Report) -> cbs.CallbackRecord:
        """Store ``report`` (with the others waiting now): its record, or a Replay."""
        answered: asyncio.Future[Answer] = asyncio.get_running_loop().create_future()
        self._waiting.append((report, answered))
        async with self._turn:
            if not answered.done():
                batch, self._waiting = self._waiting, []
                reports = [r for r, _ in batch]
                writing = self.service.write_nowait(
                    cbs.accept_callbacks, self.service.store, reports
                )
                writing.add_done_callback(lambda done: _answer(batch, done))
                await asyncio.shield(writing)  # (it goes on if this request goes away)
        answer = await answered
        if isinstance(answer, InputError):
            raise answer
        return answer


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
