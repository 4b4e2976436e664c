"""The API's tokens (admins only): listed, created (shown once) and revoked, as
``fleetwave token list|create|revoke --format json`` answer."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from pydantic import Field

from fleetwave import commands
from fleetwave.api.bodies import Body
from fleetwave.api.reads import Name, Svc
from fleetwave.api.writes import NoBody
from fleetwave.cli.tokens import EXPIRES_MAX_S
from fleetwave.store import tokens
from fleetwave.store.tokens import Role

router = APIRouter()


class TokenIn(Body):
    """``token create``."""

    name: str = Field(max_length=1024)
    role: Role
    expires_s: float | None = Field(
        default=None, gt=0, le=EXPIRES_MAX_S, description="it stops working after this long"
    )


@router.get("/tokens", summary="List the tokens (never the tokens themselves)")
async def list_tokens(svc: Svc) -> dict[str, Any]:
    return {"items": await svc.call(tokens.list_tokens, svc.store), "next_cursor": None}


@router.post("/tokens", status_code=201, summary="Create a token: it is shown this once")
async def create_token(svc: Svc, body: TokenIn) -> dict[str, Any]:
    return await svc.call(commands.create_token, svc.store, body.name, body.role, body.expires_s)


@router.post("/tokens/{name}/revoke", dependencies=NoBody, summary="Revoke a token")
async def revoke_token(svc: Svc, name: Name) -> dict[str, Any]:
    return await svc.call(commands.revoke_token, svc.store, name)
