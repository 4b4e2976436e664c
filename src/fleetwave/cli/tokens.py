"""``fleetwave token``: the REST API's bearer tokens: create (shown once), list, revoke."""

from __future__ import annotations

import re
from typing import Annotated

import typer

from fleetwave import commands
from fleetwave.cli.common import DbOpt, FormatOpt, done, existing_store
from fleetwave.cli.output import Format, console, emit_rows, err_console, print_json
from fleetwave.domain.errors import InputError
from fleetwave.store import tokens

# put under the root command by main.py, which gives it its command class (_Commands)
token_app = typer.Typer(
    help="Bearer tokens of the REST API (serve --listen), with roles.", no_args_is_help=True
)

_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
#: the longest a token may be made to last (--expires): ten years
EXPIRES_MAX_S = 10 * 365 * 86400


def expiry_seconds(given: str) -> float:
    """``--expires 30d`` (s, m, h or d) as seconds."""
    m = re.fullmatch(r"\s*(\d{1,9})\s*([smhd])\s*", given)
    if m is None:
        raise InputError(
            f"--expires: expected a whole number and a unit (90m, 12h, 30d), got {given!r}"
        )
    seconds = int(m.group(1)) * _UNITS[m.group(2)]
    if not 0 < seconds <= EXPIRES_MAX_S:
        raise InputError(f"--expires: must be more than 0 and at most 3650d, got {given}")
    return float(seconds)


@token_app.command("create")
def token_create(
    role: Annotated[
        tokens.Role,
        typer.Option(help="reader (reads), operator (also changes targets and strategies), admin"),
    ],
    name: Annotated[
        str, typer.Option(metavar="NAME", help="who or what uses it (recorded with its changes)")
    ],
    expires: Annotated[
        str | None,
        typer.Option(metavar="DURATION", help="it stops working after this long (90m, 12h, 30d)"),
    ] = None,
    fmt: FormatOpt = Format.table,
    db: DbOpt = None,
) -> None:
    """Create a token and print it, once: only its hash is kept."""
    seconds = expiry_seconds(expires) if expires is not None else None
    answer = commands.create_token(existing_store(db), name, role, seconds)
    if fmt is Format.json:
        print_json(answer)
        return
    console.print(answer["token"], highlight=False)
    err_console.print(
        f"token {name} ({role.value}) created; it is shown this once: keep it safe "
        "(clients send it as 'Authorization: Bearer TOKEN')",
        highlight=False,
    )


@token_app.command("list")
def token_list(fmt: FormatOpt = Format.table, db: DbOpt = None) -> None:
    """List the tokens (never the tokens themselves): name, role, state and times."""
    emit_rows(
        tokens.list_tokens(existing_store(db)),
        ["name", "role", "state", "created_at", "expires_at", "revoked_at"],
        fmt,
    )


@token_app.command("revoke")
def token_revoke(name: str, fmt: FormatOpt = Format.table, db: DbOpt = None) -> None:
    """Revoke a token: requests with it are refused from now on (401)."""
    answer = commands.revoke_token(existing_store(db), name)
    done(
        fmt,
        f"token {name} revoked" if answer["revoked_now"] else f"token {name}: already revoked",
        answer,
    )
