"""Bearer tokens of the REST API, with roles (``fleetwave token create|list|revoke``),
and the agent tokens the engine issues to a step's wait-for-callback state.

A token is shown once, when created; only its SHA-256 is stored (a token is 256
random bits: a slow hash would add nothing but time to every request). A request's
token is found by its hash: unknown, revoked and expired ones are all "not valid".
"""

from __future__ import annotations

import hashlib
import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from sqlalchemy import Connection, delete, insert, select, update
from sqlalchemy.exc import IntegrityError

from fleetwave.domain.errors import Conflict, InputError, NotFound
from fleetwave.domain.models import name_problem, shown
from fleetwave.store import admin, keys
from fleetwave.store.db import Store, hooks_of
from fleetwave.store.schema import agent_tokens, api_tokens

#: what every token starts with (a secret scanner, or a person, can tell one)
API_PREFIX = "fwa_"
#: ... and every agent token
AGENT_PREFIX = "fwg_"
#: how long an agent token lasts after its state's timeout: a late report is still
#: taken (and recorded as late) for this long
AGENT_TOKEN_GRACE_S = 3600.0


class Role(StrEnum):
    """What a token may do: each role may also do what the ones before it may."""

    READER = "reader"
    OPERATOR = "operator"
    ADMIN = "admin"

    def allows(self, needed: Role) -> bool:
        order = list(Role)
        return order.index(self) >= order.index(needed)


@dataclass(frozen=True, slots=True)
class Caller:
    """Who a valid token says is asking."""

    name: str
    role: Role


def token_hash(token: str) -> str:
    return hashlib.sha256(token.encode("utf-8", "surrogatepass")).hexdigest()


def new_secret(prefix: str) -> str:
    return prefix + secrets.token_urlsafe(32)


def create_token(
    store: Store, name: str, role: Role, expires_at: float | None, now: float | None = None
) -> str:
    """A new token called ``name``: returns it (the one time it is known)."""
    problem = name_problem(name)
    if problem:
        raise InputError(f"--name: {problem}")
    now = time.time() if now is None else now
    if expires_at is not None and expires_at <= now:
        raise InputError("--expires: must be in the future")
    token = new_secret(API_PREFIX)
    try:
        with store.write() as conn:
            conn.execute(
                insert(api_tokens).values(
                    name=name,
                    role=role.value,
                    hash=token_hash(token),
                    created_at=now,
                    expires_at=expires_at,
                )
            )
            admin.record_actor(conn, f"token {name} ({role.value}) created")
    except IntegrityError:
        raise Conflict(
            f"--name: a token named {shown(name)} exists already (revoked ones keep their "
            "name: choose another)"
        ) from None
    return token


def find_token(store: Store, token: str, now: float) -> Caller | None:
    """Who ``token`` stands for, if it is valid now (known, not revoked, not expired)."""
    held = token_holder(store, token, now)
    return None if held is None else held[0]


def token_holder(store: Store, token: str, now: float) -> tuple[Caller, float | None] | None:
    """:func:`find_token`, with when the token expires (None: never)."""
    if not token.startswith(API_PREFIX) or len(token) > 200:
        return None
    with store.read() as conn:
        row = conn.execute(
            select(api_tokens.c.name, api_tokens.c.role, api_tokens.c.expires_at).where(
                api_tokens.c.hash == token_hash(token), api_tokens.c.revoked_at.is_(None)
            )
        ).first()
    if row is None or (row.expires_at is not None and row.expires_at <= now):
        return None
    return Caller(str(row.name), Role(row.role)), row.expires_at


def list_tokens(store: Store, now: float | None = None) -> list[dict[str, Any]]:
    """Every token, oldest first: its name, role, times and state (active, expired,
    revoked); never the token itself."""
    now = time.time() if now is None else now
    with store.read() as conn:
        rows = conn.execute(select(api_tokens).order_by(api_tokens.c.id)).all()
    return [
        {
            "name": r.name,
            "role": r.role,
            "state": (
                "revoked"
                if r.revoked_at is not None
                else "expired"
                if r.expires_at is not None and r.expires_at <= now
                else "active"
            ),
            "created_at": r.created_at,
            "expires_at": r.expires_at,
            "revoked_at": r.revoked_at,
        }
        for r in rows
    ]


def revoke_token(store: Store, name: str, now: float | None = None) -> bool:
    """Revoke the token called ``name``: True if this call did (False: it was already)."""
    now = time.time() if now is None else now
    with store.write() as conn:
        row = conn.execute(select(api_tokens.c.revoked_at).where(api_tokens.c.name == name)).first()
        if row is None:
            raise NotFound(f"NAME: no token named {shown(name)}")
        if row.revoked_at is not None:
            return False
        conn.execute(update(api_tokens).where(api_tokens.c.name == name).values(revoked_at=now))
        admin.record_actor(conn, f"token {name} revoked")
    return True


def issue_agent_tokens(
    store: Store,
    rows: Sequence[
        tuple[int, int, str, str, float, float | None]
        | tuple[int, int, str, str, float, float | None, int]
    ],
) -> None:
    """Store the hashes of agent tokens, in one transaction: each row is a token's
    (strategy, step, state, hash, issued at, expires at[, visit of the state: 1 if not
    given]). Each replaces one issued before for its step, state and visit (the state
    started afresh); an earlier visit's stays valid for that visit's late reports."""
    if not rows:
        return
    with store.write() as conn:
        for start in range(0, len(rows), keys.CHUNK):
            chunk = rows[start : start + keys.CHUNK]
            conn.execute(
                delete(agent_tokens).where(
                    keys.any_of(
                        conn,
                        agent_tokens,
                        (agent_tokens.c.step_id, agent_tokens.c.state, agent_tokens.c.visit),
                        [
                            (step, state, visit[0] if visit else 1)
                            for _, step, state, _, _, _, *visit in chunk
                        ],
                    )
                )
            )
        conn.execute(
            insert(agent_tokens),
            [
                {
                    "strategy_id": sid,
                    "step_id": step,
                    "state": state,
                    "hash": digest,
                    "issued_at": at,
                    "expires_at": until,
                    "visit": visit[0] if visit else 1,
                }
                for sid, step, state, digest, at, until, *visit in rows
            ],
        )


@dataclass(frozen=True, slots=True)
class AgentGrant:
    """What an agent token answers for: one step's one state, in one visit of it."""

    strategy_id: int
    step_id: int
    state: str
    expired: bool
    visit: int = 1


def find_agent_tokens(conn: Connection, given: Sequence[str], now: float) -> dict[str, AgentGrant]:
    """What each of the ``given`` tokens was issued for, by token (one missing: no
    such token), in one query a few hundred at a time (the API's callback intake
    checks a batch's tokens in the transaction that stores it)."""
    by_hash = {token_hash(t): t for t in given if t.startswith(AGENT_PREFIX) and len(t) <= 200}
    hashes = sorted(by_hash)
    found: dict[str, AgentGrant] = {}
    marks = hooks_of(conn).placeholders
    for start in range(0, len(hashes), 500):
        some = tuple(hashes[start : start + 500])
        # (on the driver: through SQLAlchemy's expanding IN this one read was two
        # fifths of the intake's time for a batch of a few callbacks)
        for hash_, sid, step_id, state, expires_at, visit in conn.exec_driver_sql(
            "SELECT hash, strategy_id, step_id, state, expires_at, visit FROM agent_tokens "
            f"WHERE hash IN ({marks(len(some))})",
            some,
        ):
            expired = expires_at is not None and expires_at <= now
            found[by_hash[hash_]] = AgentGrant(
                int(sid), int(step_id), str(state), expired, int(visit)
            )
    return found
