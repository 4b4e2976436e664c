"""Agents' callbacks over HTTP: ``POST /v1/steps/{step}/callbacks``, with the agent
token the engine issued to that step's waiting state (G6).

The token is checked, the callback is stored (one INSERT, on the API's threads) and
answered 202 at once: no step lock is taken and the engine is not waited for. The
conductor that drives the step applies it, or records why it ignored it (a duplicate,
a late one), as it does the CLI's. The same idempotency key sent again for the step
stores nothing and answers 200 with the callback it stored first. A missing, unknown
or expired token (401), or one issued for another step or state (403), is refused
and recorded with the caller's address (an event of kind ``callback-refused``).
"""

from __future__ import annotations

import logging
import time
from typing import Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import Field
from sqlalchemy import insert, select

from fleetwave.api.auth import bearer
from fleetwave.api.bodies import Body
from fleetwave.api.errors import ApiError
from fleetwave.api.reads import StepId, Svc
from fleetwave.api.service import Service
from fleetwave.store import callbacks as cbs
from fleetwave.store import tokens
from fleetwave.store.db import Store
from fleetwave.store.schema import events, steps

log = logging.getLogger("fleetwave.api")

router = APIRouter()

#: the kind of event that records a callback refused for its token
CALLBACK_REFUSED = "callback-refused"
#: the longest details a callback keeps (longer ones are refused, not cut)
DETAILS_MAX = 4096


class CallbackIn(Body):
    """What an agent reports."""

    state: str = Field(min_length=1, max_length=64, description="the state it reports on")
    idempotency_key: str = Field(
        min_length=1,
        max_length=200,
        description="the sender's key: the same key sent again stores nothing",
    )
    kind: Literal["done", "failed", "heartbeat"]
    details: str = Field(default="", max_length=DETAILS_MAX)


def _refusal(store: Store, step_id: int, strategy_id: int | None, said: str) -> None:
    """Record a refused callback (its step's strategy, if the step is there)."""
    with store.write() as conn:
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


def _count(svc: Service, answer: str) -> None:
    if svc.metrics is not None:
        svc.metrics.callbacks.labels(answer).inc()


@router.post(
    "/steps/{step_id}/callbacks",
    status_code=202,
    response_model=None,
    summary="An agent's report on its step's state (stored and answered at once)",
    responses={200: {"description": "sent again with the same idempotency key: stored before"}},
)
async def callback(svc: Svc, step_id: StepId, body: CallbackIn, request: Request) -> JSONResponse:
    token = bearer(request)
    grant = (
        None
        if token is None
        else await svc.call(tokens.find_agent_token, svc.store, token, time.time())
    )
    problem = None
    status = 401
    if token is None:
        problem = "no agent token (Authorization: Bearer ...)"
    elif grant is None:
        problem = "the agent token is not valid"
    elif grant.expired:
        problem = f"the agent token expired (it was for step {grant.step_id} {grant.state})"
    elif grant.step_id != step_id or grant.state != body.state:
        status = 403
        problem = (
            f"the agent token is for step {grant.step_id} in state {grant.state}, "
            f"not step {step_id} in {body.state}"
        )
    if problem is not None:
        who = request.client.host if request.client is not None else "unknown"
        said = (
            f"callback for step {step_id} ({body.state}, {body.kind}) from {who} refused: {problem}"
        )
        log.warning("api: %s", said)
        _count(svc, "refused")
        await svc.call(
            _refusal, svc.store, step_id, None if grant is None else grant.strategy_id, said
        )
        raise ApiError(
            status,
            "unauthorized" if status == 401 else "forbidden",
            f"Authorization: {problem}",
            "Authorization",
            {"WWW-Authenticate": 'Bearer realm="fleetwave agents"'} if status == 401 else None,
        )
    report = cbs.report(
        step_id, body.state, body.kind, body.details, time.time(), body.idempotency_key
    )
    record = await svc.intake.accept(report)
    replay = cbs.is_replay(record)
    _count(svc, "replayed" if replay else "late" if record.outcome is not None else "accepted")
    if not replay and record.outcome is None and svc.conductor is not None:
        svc.conductor.callback_stored(record)
    return JSONResponse(record.answer(), status_code=200 if replay else 202)
