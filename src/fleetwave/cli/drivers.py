"""``fleetwave driver``: the drivers this installation has (built-in and third-party,
found by entry point), each one's settings, and a key for secrets stored encrypted."""

from __future__ import annotations

import typer

from fleetwave.cli.common import FormatOpt
from fleetwave.cli.output import Format, console, emit_one, emit_rows
from fleetwave.domain.errors import NotFound
from fleetwave.domain.models import shown
from fleetwave.drivers import drivers_found
from fleetwave.drivers.secrets import KEY_VARIABLE, new_key
from fleetwave.drivers.settings import describe_driver

# put under the root command by main.py, which gives it its command class (_Commands)
driver_app = typer.Typer(
    help="Drivers: the code that talks to targets of one kind.", no_args_is_help=True
)


@driver_app.command("list")
def driver_list(fmt: FormatOpt = Format.table) -> None:
    """List the drivers: built-in, and those other packages register (entry points)."""
    rows = []
    for name in sorted(drivers_found()):
        d = describe_driver(name)
        secret = [s["setting"] for s in d["settings"] if s["secret"]]
        rows.append(
            {
                "name": name,
                "settings": ", ".join(s["setting"] for s in d["settings"]),
                "secret": ", ".join(secret),
                "source": d["source"],
                "status": f"broken: {d['error']}" if "error" in d else "ok",
            }
        )
    emit_rows(rows, ["name", "status", "settings", "secret", "source"], fmt, whole_first=True)


@driver_app.command("show")
def driver_show(name: str, fmt: FormatOpt = Format.table) -> None:
    """Show one driver: each setting's type, default, and whether it is secret."""
    found = drivers_found()
    if name not in found:
        raise NotFound(f"NAME: no driver named {shown(name)} (known: {', '.join(sorted(found))})")
    emit_one(describe_driver(name), fmt)


@driver_app.command("new-key")
def driver_new_key() -> None:
    """Print a new key for FLEETWAVE_SECRET_KEY (secrets given in clear are stored
    encrypted with it)."""
    console.print(new_key(), highlight=False)
    if console.is_terminal:
        console.print(f"(export {KEY_VARIABLE}=... where fleetwave runs; keep it safe)")
