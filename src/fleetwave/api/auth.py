"""Who may call which route: a bearer token with a role (``fleetwave token create``).

Readers read; operators also change targets and drive strategies; admins also manage
tokens. No valid token: 401; a role that may not: 403. The caller's token name is set
for the request (:data:`fleetwave.store.admin.ACTOR`): every change it makes is
recorded with it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from fastapi import Depends, Request

from fleetwave.api.errors import ApiError
from fleetwave.api.service import service_of
from fleetwave.store import admin
from fleetwave.store.tokens import Caller, Role

#: what a request without a valid token is told to send
CHALLENGE = {"WWW-Authenticate": 'Bearer realm="fleetwave"'}

#: who asks when the app runs without tokens (tests only: ``Service(auth=False)``)
NOBODY_CHECKS = Caller("(no auth)", Role.ADMIN)


def bearer(request: Request) -> str | None:
    """The token of ``Authorization: Bearer TOKEN``, if the request has one."""
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


def need(role: Role) -> Callable[[Request], Awaitable[Caller]]:
    """A dependency: the caller, whose token must allow ``role``."""

    async def caller(request: Request) -> Caller:
        svc = service_of(request)
        if not svc.auth:
            who = NOBODY_CHECKS
        else:
            token = bearer(request)
            if token is None:
                raise ApiError(
                    401,
                    "unauthorized",
                    "Authorization: a bearer token is needed ('fleetwave token create')",
                    "Authorization",
                    CHALLENGE,
                )
            found = await svc.caller_of(token)
            if found is None:
                raise ApiError(
                    401,
                    "unauthorized",
                    "Authorization: the token is not valid (unknown, revoked or expired)",
                    "Authorization",
                    CHALLENGE,
                )
            who = found
            if not who.role.allows(role):
                raise ApiError(
                    403,
                    "forbidden",
                    f"token {who.name} ({who.role.value}) may not do this: it needs the "
                    f"{role.value} role",
                )
        # (the request's own context: its store calls carry it to their thread)
        admin.ACTOR.set(f"api:{who.name}")
        request.state.caller = who
        return who

    return caller


Reader = Depends(need(Role.READER))
Operator = Depends(need(Role.OPERATOR))
Admin = Depends(need(Role.ADMIN))
