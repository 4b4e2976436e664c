"""Agents' callbacks over HTTP: ``POST /v1/steps/{step}/callbacks``, with the agent
token the engine issued to that step's waiting state (G6).

The callback is stored (its token checked in the same transaction: see
:mod:`fleetwave.api.intake`) and answered 202 at once: no step lock is taken and the
engine is not waited for. The conductor that drives the step applies it, or records
why it ignored it (a duplicate, a late one), as it does the CLI's. The same
idempotency key sent again for the step stores nothing and answers 200 with the
callback it stored first. A missing, unknown or expired token (401), or one issued for
another step or state (403), is refused and recorded with the caller's address (an
event of kind ``callback-refused``).

The route is the busiest of the API (every agent, every heartbeat), so a well-formed
request is answered by :class:`CallbackFastPath` before FastAPI's routing and
dependencies (about half of a request's CPU): the body is checked by the same model,
and the answer is the route's. Anything else about it (bad JSON, a wrong field, a
query string, another content type) goes on to the FastAPI route, which answers it
as every route does.
"""

from __future__ import annotations

import json
import logging
import re
import time
from typing import Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import Field, ValidationError
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from fleetwave.api.auth import bearer
from fleetwave.api.bodies import Body
from fleetwave.api.errors import ApiError, response_for
from fleetwave.api.intake import CALLBACK_REFUSED, Arrival, Refused
from fleetwave.api.metrics import API_PREFIX
from fleetwave.api.reads import SQL_INT_MAX, StepId, Svc
from fleetwave.api.service import MAX_BODY_BYTES, Service
from fleetwave.store import callbacks as cbs

log = logging.getLogger("fleetwave.api")

router = APIRouter()

__all__ = ["CALLBACK_REFUSED", "CallbackFastPath", "CallbackIn", "router"]

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


def _count(svc: Service, answer: str) -> None:
    if svc.metrics is not None:
        svc.metrics.callback_answered(answer)


async def take_callback_answer(
    svc: Service, step_id: int, body: CallbackIn, token: str | None, who: str
) -> tuple[int, dict[str, object]]:
    """Store an agent's callback: the answer's status and body (an ApiError if its
    token is refused)."""
    report = cbs.report(
        step_id, body.state, body.kind, body.details, time.time(), body.idempotency_key
    )
    record = await svc.intake.accept(Arrival(report, token, who))
    if isinstance(record, Refused):
        log.warning("api: %s", record.said)
        _count(svc, "refused")
        status = record.status
        raise ApiError(
            status,
            "unauthorized" if status == 401 else "forbidden",
            f"Authorization: {record.problem}",
            "Authorization",
            {"WWW-Authenticate": 'Bearer realm="fleetwave agents"'} if status == 401 else None,
        )
    replay = cbs.is_replay(record)
    _count(svc, "replayed" if replay else "late" if record.outcome is not None else "accepted")
    if not replay and record.outcome is None and svc.conductor is not None:
        svc.conductor.callback_stored(record)
    return (200 if replay else 202), record.answer()


@router.post(
    "/steps/{step_id}/callbacks",
    status_code=202,
    response_model=None,
    summary="An agent's report on its step's state (stored and answered at once)",
    responses={200: {"description": "sent again with the same idempotency key: stored before"}},
)
async def callback(svc: Svc, step_id: StepId, body: CallbackIn, request: Request) -> JSONResponse:
    who = request.client.host if request.client is not None else "unknown"
    status, answer = await take_callback_answer(svc, step_id, body, bearer(request), who)
    return JSONResponse(answer, status_code=status)


_PATH = re.compile(re.escape(API_PREFIX) + r"/steps/([0-9]{1,19})/callbacks")
_JSON = re.compile(rb"application/(?:[\w.+-]*\+)?json(?:\s*;.*)?", re.I)
#: the route's template, as the requests' count names it
ROUTE = API_PREFIX + "/steps/{step_id}/callbacks"
_ANSWER_HEADERS = [(b"content-type", b"application/json")]


class CallbackFastPath:
    """``POST /v1/steps/{step}/callbacks``, well formed, answered in front of the whole
    app: not through FastAPI's own layers (error and telemetry middleware, routing,
    dependencies), nor the app's body limit and requests' count, which it does itself
    (a body of a known length within the limit, counted as the route). Any other
    request, and any callback it would not answer itself (no Content-Length, too
    large, not JSON, a wrong field), goes on to ``app`` whole, which answers it as
    every route does."""

    def __init__(self, app: ASGIApp, service: Service) -> None:
        self.app = app
        self.service = service

    def _counted(self, status: int) -> None:
        if self.service.metrics is not None:
            self.service.metrics.request_answered(ROUTE, "POST", status)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        m = None
        if scope["type"] == "http" and scope["method"] == "POST" and not scope["query_string"]:
            m = _PATH.fullmatch(scope["path"])
        if m is None or int(m.group(1)) > SQL_INT_MAX:
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        length = headers.get(b"content-length", b"")
        if not (
            length.isdigit()
            and int(length) <= MAX_BODY_BYTES
            and _JSON.fullmatch(headers.get(b"content-type", b""))
        ):
            await self.app(scope, receive, send)
            return
        chunks: list[bytes] = []
        more = True
        while more:
            message = await receive()
            if message["type"] != "http.request":  # (the client went away)
                return
            chunks.append(message.get("body", b""))
            more = message.get("more_body", False)
        raw = b"".join(chunks)
        try:
            body = CallbackIn.model_validate_json(raw)
        except ValidationError:
            # the route answers what is wrong with it, as every route does
            await self.app(scope, _replay(raw), send)
            return
        authorization = headers.get(b"authorization", b"").decode("latin-1")
        scheme, _, token = authorization.partition(" ")
        given = token.strip() if scheme.lower() == "bearer" and token.strip() else None
        client = scope.get("client")
        who = client[0] if client else "unknown"
        try:
            status, answer = await take_callback_answer(
                self.service, int(m.group(1)), body, given, who
            )
        except Exception as exc:  # answered in the API's one shape, as its handlers do
            response = response_for(scope, exc)
            self._counted(response.status_code)
            await response(scope, receive, send)
            return
        self._counted(status)
        content = json.dumps(answer).encode()  # (the default encoder: made once, in C)
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [*_ANSWER_HEADERS, (b"content-length", str(len(content)).encode())],
            }
        )
        await send({"type": "http.response.body", "body": content})


def _replay(raw: bytes) -> Receive:
    """A receive that gives the body already read, once."""
    sent = False

    async def receive() -> Message:
        nonlocal sent
        if sent:
            return {"type": "http.disconnect"}
        sent = True
        return {"type": "http.request", "body": raw, "more_body": False}

    return receive
