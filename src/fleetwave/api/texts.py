"""Routes that take a file's text as their body (not JSON): a YAML workflow validated
or added, a CSV or YAML list of targets imported. Each answers what the command that
reads the file prints with ``--format json`` (``workflow validate``, ``workflow add``,
``target import``), and says what is wrong with the file as the command says it,
naming it by ``?source=`` (the file's name; ``body`` without it).
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse

from fleetwave.api.auth import Admin, Operator, Reader
from fleetwave.api.errors import ApiError
from fleetwave.api.reads import Svc
from fleetwave.catalog import new_yaml_workflow
from fleetwave.cli.parsing import decode_text, targets_from_csv, targets_from_yaml
from fleetwave.domain.errors import Conflict, InputError
from fleetwave.domain.workflow import WorkflowError
from fleetwave.store import admin

router = APIRouter()

Source = Annotated[
    str,
    Query(
        min_length=1,
        max_length=1024,
        description="the file's name, as the answers and errors name it",
    ),
]


def _text_body(description: str) -> dict[str, Any]:
    """The OpenAPI request body of a route that reads its body as text."""
    return {
        "requestBody": {
            "required": True,
            "description": description,
            "content": {"text/plain": {"schema": {"type": "string"}}},
        }
    }


async def _text(request: Request, source: str, *, csv: bool = False) -> str:
    """The body as text, as the command reads a file (UTF-8; a leading BOM dropped)."""
    data = await request.body()
    if not data:
        raise ApiError(422, "invalid", "body: required (the file's text)", "body")
    try:
        text = decode_text(data, source, csv=csv)
    except InputError as exc:
        raise ApiError(422, "invalid", str(exc), "body") from None
    if "\x00" in text:
        raise ApiError(422, "invalid", f"{source}: a NUL character in the text", "body")
    return text


def _validate(svc_store: Any, text: str, source: str) -> dict[str, Any]:
    try:
        wf = new_yaml_workflow(text, source)
        stored = admin.check_workflow_version(svc_store, wf)
    except (InputError, WorkflowError) as exc:
        problem = str(exc)
        if isinstance(exc, Conflict):
            problem = f"{source}: {problem}"
        return {"ok": False, "file": source, "problem": problem}
    add_would = "store" if stored is None else "nothing" if stored == wf.version else "replace"
    return {
        "ok": True,
        "file": source,
        "name": wf.name,
        "version": wf.version,
        "states": list(wf.state_names),
        "add_would": add_would,
        "stored_version": stored,
    }


@router.post(
    "/workflows/validate",
    dependencies=[Reader],
    summary="Check a YAML workflow (the problem, or ok and what add would do)",
    openapi_extra=_text_body("the workflow's YAML (any text content type)"),
)
async def validate_workflow(request: Request, svc: Svc, source: Source = "body") -> dict[str, Any]:
    text = await _text(request, source)
    return await svc.call(_validate, svc.store, text, source)


def _add(svc_store: Any, text: str, source: str) -> JSONResponse:
    wf = new_yaml_workflow(text, source)
    try:
        replaced = admin.save_workflow(svc_store, wf, text)
    except Conflict as exc:
        raise Conflict(f"{source}: {exc}") from None
    stored = replaced != wf.version
    answer = {
        "name": wf.name,
        "version": wf.version,
        "stored": stored,
        "replaced_version": replaced if stored else None,
    }
    return JSONResponse(answer, status_code=201 if stored else 200)


@router.post(
    "/workflows",
    dependencies=[Admin],
    summary="Store a YAML workflow (201; 200 when that version is stored already)",
    response_model=None,
    status_code=201,
    responses={
        201: {"description": "stored (replacing an older version, if any)"},
        200: {"description": "that version is stored already, unchanged"},
    },
    openapi_extra=_text_body("the workflow's YAML (any text content type)"),
)
async def add_workflow(request: Request, svc: Svc, source: Source = "body") -> JSONResponse:
    text = await _text(request, source)
    return await svc.write(_add, svc.store, text, source)


#: what ``Content-Type`` says a targets file is
_KINDS = {
    "text/csv": "csv",
    "application/csv": "csv",
    "application/yaml": "yaml",
    "application/x-yaml": "yaml",
    "text/yaml": "yaml",
    "text/x-yaml": "yaml",
    "application/json": "yaml",  # (JSON is YAML)
}


def _import(svc_store: Any, text: str, source: str, kind: str) -> dict[str, Any]:
    items = targets_from_csv(text, source) if kind == "csv" else targets_from_yaml(text, source)
    kept: list[str] = []
    n = admin.ensure_targets(svc_store, items, managed_kept=kept)
    return {"file": source, "imported": n, "unchanged": len(items) - n, "managed_kept": kept}


@router.post(
    "/targets/import",
    dependencies=[Operator],
    summary="Add targets from a CSV or YAML file, in one transaction",
    openapi_extra=_text_body(
        "the file's text: CSV (Content-Type: text/csv) or YAML (application/yaml; or "
        "JSON, application/json), or any text with ?format="
    ),
)
async def import_targets(
    request: Request,
    svc: Svc,
    source: Source = "body",
    given_format: Annotated[
        str | None,
        Query(
            alias="format",
            pattern="^(csv|yaml)$",
            description="csv or yaml (else from Content-Type)",
        ),
    ] = None,
) -> dict[str, Any]:
    kind = given_format
    if kind is None:
        given = request.headers.get("content-type", "").split(";")[0].strip().lower()
        kind = _KINDS.get(given)
        if kind is None:
            raise ApiError(
                422,
                "invalid",
                f"Content-Type: {given or 'none'}: send text/csv or application/yaml "
                "(or ?format=csv|yaml)",
                "Content-Type",
            )
    text = await _text(request, source, csv=kind == "csv")
    return await svc.write(_import, svc.store, text, source, kind)
