"""The REST API as one FastAPI app: ``make_app(service)``.

Routes are versioned under ``/v1``; ``/healthz`` (the process answers), ``/readyz``
(the database answers and its schema is this fleetwave's), ``/metrics`` (Prometheus),
``/openapi.json`` and ``/docs`` are not. Every error is answered in one shape
(:mod:`fleetwave.api.errors`); a body larger than
:data:`~fleetwave.api.service.MAX_BODY_BYTES` is refused unread, and so is a query
parameter the route does not take.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.types import ASGIApp, Message, Receive, Scope, Send

import fleetwave
from fleetwave.api import callbacks, dashboard, errors, reads, texts, tokens, writes
from fleetwave.api.auth import Admin, Operator, Reader
from fleetwave.api.callbacks import CallbackFastPath
from fleetwave.api.errors import ApiError, ErrorAnswer, error_response
from fleetwave.api.intake import CallbackIntake
from fleetwave.api.live import LiveHub
from fleetwave.api.metrics import API_PREFIX, ApiMetrics, CountRequests
from fleetwave.api.service import MAX_BODY_BYTES, Service, service_of
from fleetwave.engine.meters import Meters
from fleetwave.store.db import HEAD_REVISION, current_revision
from fleetwave.store.postgres import redact


async def _known_query(request: Request) -> None:
    """A query parameter the route does not take is refused, naming it (a misspelt
    filter would otherwise list everything). (``async``: on the loop, not a thread.)"""
    route = request.scope.get("route")
    dependant = getattr(route, "dependant", None)
    if dependant is None:
        return
    known: set[str] = set()
    todo = [dependant]
    while todo:
        one = todo.pop()
        known.update(p.alias for p in one.query_params)
        todo.extend(one.dependencies)
    for key in request.query_params:
        if key not in known:
            raise ApiError(422, "invalid", f"{key}: unknown query parameter", key)
    _no_nul(request.path_params.items())
    _no_nul(request.query_params.multi_items())


def _no_nul(pairs: Iterable[tuple[str, Any]]) -> None:
    """A NUL character is in no name, state or cursor (and PostgreSQL cannot hold one)."""
    for key, value in pairs:
        if isinstance(value, str) and "\x00" in value:
            raise ApiError(422, "invalid", f"{key}: must not contain a NUL character", key)


#: requests that change nothing: the answers of recent reads may be given again after them
_READS = frozenset({"GET", "HEAD", "OPTIONS"})


class NoteChanges:
    """Any request that may change something (not a read, not an agent's callback, which
    changes nothing a read shows) makes :meth:`Service.recent` read again: as it
    starts (a read beginning meanwhile may see the change) and once it has ended."""

    def __init__(self, app: ASGIApp, service: Service) -> None:
        self.app = app
        self.service = service

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] != "http"
            or scope.get("method") in _READS
            or scope.get("path", "").endswith("/callbacks")
        ):
            await self.app(scope, receive, send)
            return
        self.service.changed()
        try:
            await self.app(scope, receive, send)
        finally:
            self.service.changed()


class BodyLimit:
    """Refuse a request body larger than ``limit`` bytes (413), by its Content-Length
    or, sent in chunks, once that many have come: nothing of it is handled."""

    def __init__(self, app: ASGIApp, limit: int = MAX_BODY_BYTES) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                try:
                    length = int(value)
                except ValueError:
                    length = -1
                if length < 0 or length > self.limit:
                    await self._refuse(scope, receive, send)
                    return
        seen = 0

        async def limited() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    raise _TooLarge
            return message

        try:
            await self.app(scope, limited, send)
        except _TooLarge:
            await self._refuse(scope, receive, send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        response = error_response(
            413,
            "too_large",
            f"body: larger than the {self.limit} bytes a request may send",
            "body",
            {"Connection": "close"},
        )
        await response(scope, receive, send)


class _TooLarge(Exception):
    pass


def served_app(service: Service) -> ASGIApp:
    """What the server runs: the app of :func:`make_app` with the agents' callbacks
    answered in front of it (:class:`~fleetwave.api.callbacks.CallbackFastPath`)."""
    return CallbackFastPath(make_app(service), service)


def make_app(service: Service) -> FastAPI:
    """The API over ``service`` (its store, and the engine beside it if any)."""

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        try:
            yield
        finally:
            await service.live_close()
            service.close()

    app = FastAPI(
        title="fleetwave",
        version=fleetwave.__version__,
        summary="Roll one operation across a fleet of targets, exactly once per state.",
        lifespan=lifespan,
        dependencies=[Depends(_known_query)],
        responses={
            code: {"model": ErrorAnswer, "description": what}
            for code, what in (
                (400, "malformed request"),
                (401, "no valid bearer token"),
                (403, "the token's role may not do this"),
                (404, "not found"),
                (409, "conflicts with the current state"),
                (413, "body too large"),
                (422, "invalid input (the field is named)"),
            )
        },
    )
    app.state.service = service
    errors.install(app)
    metrics = service.metrics = ApiMetrics(service)
    service.intake = CallbackIntake(service)
    service.live = LiveHub(service)
    if service.conductor is not None and service.conductor.meters is None:
        service.conductor.meters = Meters()

    v1 = API_PREFIX
    app.include_router(reads.router, prefix=v1, tags=["reads"], dependencies=[Reader])
    app.include_router(writes.router, prefix=v1, tags=["changes"], dependencies=[Operator])
    # (files' text as the body; each route says its role)
    app.include_router(texts.router, prefix=v1, tags=["changes"])
    app.include_router(tokens.router, prefix=v1, tags=["tokens"], dependencies=[Admin])
    app.include_router(dashboard.router, prefix=v1, tags=["dashboard"], dependencies=[Reader])
    # the dashboard's pages (no token to load them: every /v1 request they make sends one)
    app.get("/", include_in_schema=False)(dashboard.index)
    app.mount("/ui", dashboard.static_files(), name="ui")
    # (agents send their own token, for one step's state: not an API token)
    app.include_router(callbacks.router, prefix=v1, tags=["agents"])
    # (the last added is the outermost)
    app.add_middleware(NoteChanges, service=service)
    app.add_middleware(BodyLimit)
    app.add_middleware(CountRequests, metrics=metrics)

    @app.get(
        "/metrics",
        tags=["health"],
        summary="Prometheus metrics (a reader's token)",
        dependencies=[Reader],
        response_model=None,
        responses={
            200: {
                "description": "Prometheus's text format",
                "content": {"text/plain": {"schema": {"type": "string"}}},
            }
        },
    )
    async def prometheus() -> PlainTextResponse:
        # (on the loop: the engine's counts are read where they are kept; or asked of
        # the engine's process, off the loop)
        engine = b""
        if service.engine_metrics is not None:
            engine = await service.call(service.engine_metrics)
        return PlainTextResponse(metrics.text() + engine, media_type=CONTENT_TYPE_LATEST)

    @app.get("/healthz", tags=["health"], summary="The server answers")
    async def healthz() -> dict[str, Any]:
        return {"ok": True}

    @app.get("/readyz", tags=["health"], summary="The database answers; its schema is current")
    async def readyz(request: Request) -> Any:
        svc = service_of(request)
        try:
            revision = await svc.call(current_revision, svc.store)
        except Exception as exc:  # any failure to read it: not ready
            return error_response(
                503, "not_ready", f"the database does not answer: {redact(str(exc))}"
            )
        if revision != HEAD_REVISION:
            return error_response(
                503,
                "not_ready",
                f"the database has schema revision {revision}, this fleetwave needs "
                f"{HEAD_REVISION} ('fleetwave init' upgrades it)",
            )
        return JSONResponse({"ok": True, "schema": revision})

    return app
