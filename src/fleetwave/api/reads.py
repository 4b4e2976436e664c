"""The API's reads (``GET /v1/...``): targets, groups, workflows, strategies, steps,
history, events and check, each answered as ``fleetwave ... --format json`` prints it
(lists a page at a time: ``{"items": [...], "next_cursor": ...}``)."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Path, Query

from fleetwave import commands
from fleetwave.api.errors import ApiError
from fleetwave.api.service import (
    PAGE_LIMIT_DEFAULT,
    PAGE_LIMIT_MAX,
    Service,
    decode_cursor,
    page_answer,
    the_service,
)
from fleetwave.catalog import resolve_workflow, workflow_rows
from fleetwave.domain.models import StrategyState
from fleetwave.domain.workflow import describe_workflow
from fleetwave.store import queries

#: the largest whole number the database holds: a larger id is refused, not a 500
SQL_INT_MAX = 2**63 - 1

router = APIRouter()

Svc = Annotated[Service, Depends(the_service)]
Limit = Annotated[
    int,
    Query(ge=1, le=PAGE_LIMIT_MAX, description=f"rows per page (at most {PAGE_LIMIT_MAX})"),
]
Cursor = Annotated[str | None, Query(max_length=2048, description="next_cursor of the page before")]
StrategyId = Annotated[int, Path(ge=0, le=SQL_INT_MAX, description="strategy id")]
StepId = Annotated[int, Path(ge=0, le=SQL_INT_MAX, description="step id")]
Name = Annotated[str, Path(max_length=1024)]
Many = Annotated[list[str] | None, Query(description="repeat it for several")]


def _pairs(given: list[str] | None, field: str) -> dict[str, str]:
    """``key=value`` filters (``label=tier=gold``)."""
    out: dict[str, str] = {}
    for item in given or ():
        key, sep, value = item.partition("=")
        if not sep or not key.strip() or not value.strip():
            raise ApiError(422, "invalid", f"{field}: expected key=value, got {item!r}", field)
        out[key.strip()] = value.strip()
    return out


@router.get("/targets", summary="List targets (by name)")
async def list_targets(
    svc: Svc,
    group: Annotated[str | None, Query(max_length=1024)] = None,
    label: Many = None,
    limit: Limit = PAGE_LIMIT_DEFAULT,
    cursor: Cursor = None,
) -> dict[str, Any]:
    after = decode_cursor(cursor, str, "")
    page = await svc.call(
        queries.targets_page, svc.store, limit, after, group, _pairs(label, "label")
    )
    return page_answer(page.rows, page.next_after)


@router.get("/targets/{name}", summary="Show one target and the strategies it has been in")
async def show_target(svc: Svc, name: Name) -> dict[str, Any]:
    return await svc.call(queries.get_target, svc.store, name)


@router.get("/groups", summary="List groups")
async def list_groups(svc: Svc) -> dict[str, Any]:
    return page_answer(await svc.call(queries.list_groups, svc.store), None)


@router.get("/groups/{name}", summary="Show one group")
async def show_group(svc: Svc, name: Name) -> dict[str, Any]:
    return await svc.call(queries.get_group, svc.store, name)


@router.get("/workflows", summary="List workflows")
async def list_workflows(svc: Svc) -> dict[str, Any]:
    return page_answer(await svc.call(workflow_rows, svc.store), None)


@router.get("/workflows/{name}", summary="Show a workflow's states")
async def show_workflow(svc: Svc, name: Name) -> dict[str, Any]:
    def read() -> dict[str, Any]:
        return describe_workflow(resolve_workflow(svc.store, name, what="name"))

    return await svc.call(read)


@router.get("/strategies", summary="List strategies (by id)")
async def list_strategies(
    svc: Svc,
    state: Many = None,
    limit: Limit = PAGE_LIMIT_DEFAULT,
    cursor: Cursor = None,
    brief: Annotated[
        bool, Query(description="driven_by as the list's table says it, briefly")
    ] = False,
) -> dict[str, Any]:
    after = decode_cursor(cursor, int, 0)
    states = list(state or ())
    known = [s.value for s in StrategyState]
    for one in states:
        if one not in known:
            raise ApiError(
                422,
                "invalid",
                f"state: '{one}' is not a strategy state ({', '.join(known)})",
                "state",
            )
    rows = await svc.call(queries.list_strategies, svc.store, brief=brief, states=states)
    rows = [r for r in rows if int(r["id"]) > after]
    more = len(rows) > limit
    return page_answer(rows[:limit], rows[limit - 1]["id"] if more else None)


@router.get("/strategies/{strategy_id}", summary="Show a strategy with its step counts")
async def show_strategy(svc: Svc, strategy_id: StrategyId) -> dict[str, Any]:
    return await svc.recent(("strategy", strategy_id), queries.get_strategy, svc.store, strategy_id)


@router.get("/strategies/{strategy_id}/steps", summary="List a strategy's steps (in its order)")
async def list_steps(
    svc: Svc,
    strategy_id: StrategyId,
    state: Many = None,
    target: Many = None,
    limit: Limit = PAGE_LIMIT_DEFAULT,
    cursor: Cursor = None,
) -> dict[str, Any]:
    after = decode_cursor(cursor, int, -1)
    states, targets = tuple(state or ()), tuple(target or ())
    page = await svc.recent(
        ("steps", strategy_id, limit, after, states, targets),
        queries.steps_page,
        svc.store,
        strategy_id,
        limit,
        after,
        list(states),
        list(targets),
    )
    return page_answer(page.rows, page.next_after)


@router.get("/steps/{step_id}", summary="Show one step with its journal, events and callbacks")
async def show_step(svc: Svc, step_id: StepId) -> dict[str, Any]:
    return await svc.call(queries.get_step, svc.store, step_id)


@router.get("/strategies/{strategy_id}/history", summary="A strategy's journal (oldest first)")
async def history(
    svc: Svc,
    strategy_id: StrategyId,
    target: Many = None,
    limit: Limit = PAGE_LIMIT_DEFAULT,
    cursor: Cursor = None,
) -> dict[str, Any]:
    after = decode_cursor(cursor, int, 0)
    page = await svc.call(
        queries.history_page, svc.store, strategy_id, limit, after, list(target or ())
    )
    return page_answer(page.rows, page.next_after)


@router.get("/strategies/{strategy_id}/events", summary="A strategy's events (oldest first)")
async def events(
    svc: Svc,
    strategy_id: StrategyId,
    target: Many = None,
    kind: Many = None,
    limit: Limit = PAGE_LIMIT_DEFAULT,
    cursor: Cursor = None,
) -> dict[str, Any]:
    after = decode_cursor(cursor, int, 0)
    page = await svc.call(
        queries.events_page,
        svc.store,
        strategy_id,
        limit,
        after,
        list(target or ()),
        list(kind or ()),
    )
    return page_answer(page.rows, page.next_after)


@router.get("/check", summary="Verify G1, G3, G7 and G8 from the journal")
async def check(
    svc: Svc, strategy: Annotated[int | None, Query(ge=0, le=SQL_INT_MAX)] = None
) -> dict[str, Any]:
    """``ok`` is false when a guarantee was broken (``violations`` says where): the
    answer is still 200, as the check itself went through."""
    _, answer = await svc.call(commands.check, svc.store, strategy)
    return answer
