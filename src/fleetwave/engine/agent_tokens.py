"""Agent tokens for states that wait for their target's callback, issued in batches.

Each such state is given a random token (only its hash stored) before its action runs,
so the action can hand it to the target's agent (``POST /v1/steps/{step}/callbacks``).
A store call per token would cost a transaction (an fsync) per waiting state: the
states that start in one turn of the loop are issued theirs in one transaction.

The first worker of a turn writes the batch, after letting the others of that turn
add theirs; the others wait for that write. Its failure (the conductor's store calls
give up only when the conductor must stop) is every waiter's.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from fleetwave.store import tokens

#: the conductor's store call (``Conductor._io``): retries, rides out outages
StoreCall = Callable[..., Awaitable[Any]]


Row = tuple[int, int, str, str, float, float, int]


class AgentTokenIssuer:
    """Issues agent tokens for one conductor (its loop, its store calls)."""

    def __init__(self, io: StoreCall, store: Any, now: Callable[[], float]) -> None:
        self._io = io
        self._store = store
        self._now = now
        self._rows: list[Row] = []
        #: the batch being gathered (its rows written, once its leader has)
        self._batch: asyncio.Future[list[Row]] | None = None

    async def issue(
        self, strategy_id: int, step_id: int, state: str, timeout_s: float, visit: int = 1
    ) -> str:
        """A new token for ``step_id``'s ``state`` in that ``visit`` of it, once its hash
        is committed (one issued before for them no longer answers; an earlier visit's
        still does, for that visit: its late report is recorded and ignored as late); it
        lasts until a while after the state's timeout (a late report is still recorded
        as late)."""
        token = tokens.new_secret(tokens.AGENT_PREFIX)
        now = self._now()
        until = now + timeout_s + tokens.AGENT_TOKEN_GRACE_S
        row = (strategy_id, step_id, state, tokens.token_hash(token), now, until, visit)
        self._rows.append(row)
        while True:
            batch = self._batch
            if batch is None:
                await self._lead()
                return token
            # (shielded: a waiter cancelled leaves the write to its leader)
            written = await asyncio.shield(batch)
            if any(r is row for r in written):
                return token
            # its leader was cancelled before it took the rows: this one's goes next

    async def _lead(self) -> None:
        """Write the rows of this turn (the leader's and those added meanwhile)."""
        batch = self._batch = asyncio.get_running_loop().create_future()
        rows: list[Row] = []
        try:
            await asyncio.sleep(0)  # the other workers of this turn add theirs
            rows, self._rows, self._batch = self._rows, [], None
            await self._io(tokens.issue_agent_tokens, self._store, rows)
        except BaseException as exc:
            if not rows:  # (cancelled before it took them: another leads them)
                if self._batch is batch:
                    self._batch = None
                batch.set_result([])
            else:
                batch.set_exception(exc)
                batch.exception()  # (read: not "never retrieved" when nobody waited)
            raise
        batch.set_result(rows)
