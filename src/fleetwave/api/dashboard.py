"""The web dashboard served at ``/`` (docs/dashboard.md): its files, and the routes
under ``/v1`` that only its pages need (who the token is, conductors, a strategy's
grid, a target's time per state, and the live streams).

The pages are plain HTML, CSS and JavaScript shipped in the package
(``fleetwave/api/static``): no build step, nothing fetched from another host. They
need no token to load; every ``/v1`` route they call does (a reader's at least), sent
as ``Authorization: Bearer``, also by the live streams (read with ``fetch``, not
``EventSource``, which cannot send a header).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import FileResponse, StreamingResponse
from fastapi.staticfiles import StaticFiles

from fleetwave.api.auth import bearer
from fleetwave.api.live import Allowed, LiveHub
from fleetwave.api.pages import read_grid, target_timeline
from fleetwave.api.reads import Name, StrategyId, Svc
from fleetwave.api.service import Service, page_answer
from fleetwave.store import queries
from fleetwave.store.tokens import Caller, Role, find_token

#: the dashboard's files (package data)
STATIC_DIR = Path(__file__).parent / "static"

router = APIRouter()

#: the answer of a live stream: never cached or buffered by a proxy
_STREAM_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def static_files() -> StaticFiles:
    return StaticFiles(directory=STATIC_DIR)


async def index() -> FileResponse:
    return FileResponse(STATIC_DIR / "index.html", headers={"Cache-Control": "no-cache"})


def _caller(request: Request) -> Caller:
    who: Caller = request.state.caller
    return who


@router.get("/me", summary="The token's name and role, and what it may do")
async def me(request: Request) -> dict[str, Any]:
    who = _caller(request)
    return {
        "name": who.name,
        "role": who.role.value,
        # pause, resume, abort and approve a strategy
        "may_drive": who.role.allows(Role.OPERATOR),
    }


@router.get("/conductors", summary="List conductors, newest first (conductor list)")
async def list_conductors(svc: Svc) -> dict[str, Any]:
    return page_answer(await svc.call(queries.list_conductors, svc.store), None)


@router.get(
    "/strategies/{strategy_id}/grid",
    summary="A strategy's steps as the dashboard's grid: by stage, group and position",
)
async def grid(svc: Svc, strategy_id: StrategyId) -> dict[str, Any]:
    return (await svc.call(read_grid, svc.store, strategy_id)).columns()


@router.get(
    "/targets/{name}/timeline",
    summary="A target's step in each strategy: transitions and time per state",
)
async def timeline(svc: Svc, name: Name) -> dict[str, Any]:
    return await svc.call(target_timeline, svc.store, name)


def _still_allowed(svc: Service, request: Request) -> Allowed:
    token = bearer(request)

    async def check() -> bool:
        if not svc.auth:
            return True
        return token is not None and (
            await svc.call(find_token, svc.store, token, time.time()) is not None
        )

    return check


def _hub(svc: Service) -> LiveHub:
    assert svc.live is not None  # (made by make_app)
    return svc.live


@router.get("/live", include_in_schema=False)
async def live_overview(svc: Svc, request: Request) -> StreamingResponse:
    """Server-sent events: every strategy and conductor, every 0.7 s."""
    events = _hub(svc).overview(_still_allowed(svc, request))
    return StreamingResponse(events, media_type="text/event-stream", headers=_STREAM_HEADERS)


@router.get("/strategies/{strategy_id}/live", include_in_schema=False)
async def live_strategy(svc: Svc, request: Request, strategy_id: StrategyId) -> StreamingResponse:
    """Server-sent events: one strategy, its grid and charts, twice a second."""
    await svc.call(queries.strategy_exists, svc.store, strategy_id)
    events = _hub(svc).strategy(strategy_id, _still_allowed(svc, request))
    return StreamingResponse(events, media_type="text/event-stream", headers=_STREAM_HEADERS)
