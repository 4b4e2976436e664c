"""The API's changes: targets added, changed, managed, unmanaged and deleted; strategies
created, applied, paused, resumed, aborted and deleted. Each answers what
``fleetwave ... --format json`` prints (made by :mod:`fleetwave.commands`).

Bodies are JSON objects whose unknown fields are refused (a typo is not ignored).
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query, Request
from pydantic import Field

from fleetwave import commands
from fleetwave.api.bodies import Body
from fleetwave.api.errors import ApiError
from fleetwave.api.reads import SQL_INT_MAX, Name, StrategyId, Svc
from fleetwave.api.service import Service
from fleetwave.catalog import resolve_workflow
from fleetwave.domain.models import ApplyType, StrategyOptions, Target
from fleetwave.domain.yaml_workflow import MAX_SECONDS
from fleetwave.store import admin


async def _no_body(request: Request) -> None:
    """A change that takes no body refuses one (what it asked for would be ignored)."""
    length = request.headers.get("content-length")
    if (length not in (None, "0")) or "transfer-encoding" in request.headers:
        raise ApiError(422, "invalid", "body: this request takes none", "body")


router = APIRouter()
NoBody = [Depends(_no_body)]

#: the most target names one strategy body lists (a fleet of more: --group, --label, --all)
NAMES_MAX = 100_000

IgnoreMissing = Annotated[
    bool, Query(description="one that is not there is no error (deleted: false)")
]


Labels = dict[
    Annotated[str, Field(min_length=1, max_length=255)],
    Annotated[str, Field(min_length=1, max_length=4096)],
]
Settings = dict[Annotated[str, Field(min_length=1, max_length=255)], Any]


class TargetIn(Body):
    """``target add``."""

    name: str = Field(max_length=1024)
    group: str | None = Field(default=None, max_length=1024)
    driver: str = Field(default="sim", max_length=64)
    settings: Settings = Field(default_factory=dict, description="driver settings")
    labels: Labels = Field(default_factory=dict)
    managed: bool = True


class TargetChange(Body):
    """``target set``: only the fields given change; ``"group": null`` takes the target
    out of its group."""

    group: str | None = Field(default=None, max_length=1024)
    driver: str | None = Field(default=None, max_length=64)
    settings: Settings = Field(default_factory=dict, description="settings to add or change")
    unset: list[Annotated[str, Field(max_length=255)]] = Field(
        default_factory=list, max_length=1000, description="settings to remove"
    )
    labels: Labels = Field(default_factory=dict, description="labels to add or change")
    unlabel: list[Annotated[str, Field(max_length=255)]] = Field(
        default_factory=list, max_length=1000, description="labels to remove"
    )


class StrategyIn(Body):
    """``strategy create``: the targets by ``targets``, ``group``, ``labels`` or
    ``all``, or ``failed_in`` (a retry of a strategy's failed and aborted steps)."""

    workflow: str = Field(max_length=1024)
    targets: list[Annotated[str, Field(max_length=1024)]] | None = Field(
        default=None, max_length=NAMES_MAX
    )
    group: str | None = Field(default=None, max_length=1024)
    all: bool = False
    labels: Labels = Field(default_factory=dict)
    failed_in: int | None = Field(default=None, ge=0, le=SQL_INT_MAX)
    max_parallel: int | None = Field(default=None, ge=-SQL_INT_MAX, le=SQL_INT_MAX)
    apply_type: ApplyType = ApplyType.PARALLEL
    stop_on_failure: bool = False
    max_failures: int | None = Field(default=None, ge=0, le=SQL_INT_MAX)
    stages_by_group: bool = False
    timeouts: dict[
        Annotated[str, Field(max_length=255)], Annotated[float, Field(gt=0, le=MAX_SECONDS)]
    ] = Field(default_factory=dict, description="per-state timeout overrides, seconds")


def _create(svc: Service, body: StrategyIn) -> dict[str, Any]:
    store = svc.store
    names = body.targets
    if names is not None and not names:
        raise ApiError(422, "invalid", "targets: names no target", "targets")
    if body.failed_in is not None:
        names = commands.failed_targets(
            store,
            body.failed_in,
            target_names=names,
            group=body.group,
            all_targets=body.all,
            labels=body.labels,
        )
    wf = resolve_workflow(store, body.workflow, what="workflow")
    opts = StrategyOptions(
        max_parallel=commands.max_parallel_as_stored(
            body.max_parallel, body.apply_type, "strategy"
        ),
        apply_type=body.apply_type,
        stop_on_failure=body.stop_on_failure,
        max_failures=body.max_failures,
        stages_by_group=body.stages_by_group,
        timeouts_s=dict(body.timeouts),
    )
    return commands.create_strategy(
        store,
        wf,
        opts,
        target_names=names,
        group=body.group,
        all_targets=body.all,
        labels=body.labels,
        failed_in=body.failed_in,
    )


@router.post("/strategies", status_code=201, summary="Create a strategy (state initial)")
async def create_strategy(svc: Svc, body: StrategyIn) -> dict[str, Any]:
    return await svc.call(_create, svc, body)


@router.post(
    "/strategies/{strategy_id}/apply", dependencies=NoBody, summary="Start (or resume) a strategy"
)
async def apply_strategy(svc: Svc, strategy_id: StrategyId) -> dict[str, Any]:
    return await svc.call(commands.apply_strategy, svc.store, strategy_id)


@router.post(
    "/strategies/{strategy_id}/pause", dependencies=NoBody, summary="Pause: no new step starts"
)
async def pause_strategy(svc: Svc, strategy_id: StrategyId) -> dict[str, Any]:
    return await svc.call(commands.pause_strategy, svc.store, strategy_id)


@router.post(
    "/strategies/{strategy_id}/resume", dependencies=NoBody, summary="Resume a paused strategy"
)
async def resume_strategy(svc: Svc, strategy_id: StrategyId) -> dict[str, Any]:
    return await svc.call(commands.resume_strategy, svc.store, strategy_id)


@router.post(
    "/strategies/{strategy_id}/abort", dependencies=NoBody, summary="Abort: nothing new starts"
)
async def abort_strategy(svc: Svc, strategy_id: StrategyId) -> dict[str, Any]:
    return await svc.call(commands.abort_strategy, svc.store, strategy_id)


@router.post(
    "/strategies/{strategy_id}/approve",
    dependencies=NoBody,
    summary="Approve the next stage of a strategy waiting for approval",
)
async def approve_strategy(svc: Svc, request: Request, strategy_id: StrategyId) -> dict[str, Any]:
    return await svc.call(
        admin.approve_strategy, svc.store, strategy_id, f"api:{request.state.caller.name}"
    )


@router.delete(
    "/strategies/{strategy_id}",
    dependencies=NoBody,
    summary="Delete a strategy that is not running",
)
async def delete_strategy(
    svc: Svc, strategy_id: StrategyId, ignore_missing: IgnoreMissing = False
) -> dict[str, Any]:
    return await svc.call(
        commands.delete_strategy, svc.store, strategy_id, ignore_missing=ignore_missing
    )


@router.post("/targets", status_code=201, summary="Add one target")
async def add_target(svc: Svc, body: TargetIn) -> dict[str, Any]:
    target = Target(
        name=body.name,
        group=body.group,
        driver=body.driver,
        settings=dict(body.settings),
        labels=dict(body.labels),
        managed=body.managed,
    )
    return await svc.call(commands.add_target, svc.store, target)


@router.patch("/targets/{name}", summary="Change a target (not while in an active strategy)")
async def change_target(svc: Svc, name: Name, body: TargetChange) -> dict[str, Any]:
    given = body.model_fields_set
    if not given:
        raise ApiError(
            422,
            "invalid",
            "body: nothing to change: give group, driver, settings, unset, labels or unlabel",
        )
    return await svc.call(
        commands.change_target,
        svc.store,
        name,
        group=body.group if "group" in given else admin.KEEP,
        driver=body.driver,
        settings=dict(body.settings),
        unset=[k.strip() for k in body.unset],
        labels=dict(body.labels),
        unlabel=[k.strip() for k in body.unlabel],
    )


@router.post("/targets/{name}/manage", dependencies=NoBody, summary="Mark a target managed")
async def manage_target(svc: Svc, name: Name) -> dict[str, Any]:
    return await svc.call(commands.set_managed, svc.store, name, True)


@router.post("/targets/{name}/unmanage", dependencies=NoBody, summary="Mark a target unmanaged")
async def unmanage_target(svc: Svc, name: Name) -> dict[str, Any]:
    return await svc.call(commands.set_managed, svc.store, name, False)


@router.delete(
    "/targets/{name}", dependencies=NoBody, summary="Delete a target that is in no strategy"
)
async def delete_target(
    svc: Svc, name: Name, ignore_missing: IgnoreMissing = False
) -> dict[str, Any]:
    return await svc.call(commands.delete_target, svc.store, name, ignore_missing=ignore_missing)
