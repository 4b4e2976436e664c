"""Drivers: the code that talks to targets of one kind, found by entry point.

A driver is a class registered under the ``fleetwave.drivers`` entry-point group (the
built-in ``sim``, ``http``, ``redfish`` and ``ssh`` too, in fleetwave's own
``pyproject.toml``). The class implements
:class:`fleetwave.domain.workflow.TargetDriver` and names its per-target settings with
a pydantic model in ``settings_model`` (a ``SecretStr`` field is a secret: see
:mod:`fleetwave.drivers.secrets`). It is made with no arguments, or with ``seed=``
when its ``__init__`` takes one (the conductor's seed, for simulations). A driver may
offer state actions that take parameters from a YAML state (``action: ssh.run`` with
``command: ...``): a static ``actions()`` returning them by name, each a
:class:`~fleetwave.domain.workflow.StateAction` class made with an instance of its
``params_model`` (pydantic).

A driver that holds connections (pools, sessions) closes them in an optional ``async
close_connections()``, which a conductor calls, through :func:`close_drivers`, for the
drivers it made when it ends (the driver may be used again: it opens them anew).

Use :func:`known_drivers`, :func:`driver_class` and :func:`make_drivers`; the
settings' checks and masks are in :mod:`fleetwave.drivers.settings`.
"""

from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Any

from fleetwave.domain.workflow import TargetDriver

#: the entry-point group a driver package registers its classes under
ENTRY_POINT_GROUP = "fleetwave.drivers"
#: the built-in drivers when fleetwave runs from a source tree that is not installed
#: (its entry points are then not registered)
_BUILTIN = {
    "sim": "fleetwave.drivers.sim:SimDriver",
    "http": "fleetwave.drivers.http:HttpDriver",
    "redfish": "fleetwave.drivers.redfish:RedfishDriver",
    "ssh": "fleetwave.drivers.ssh:SshDriver",
}


@dataclass(frozen=True)
class DriverEntry:
    """One driver found: its class, or why it cannot be loaded (``driver list`` says)."""

    name: str
    source: str
    cls: type[Any] | None
    error: str = ""


_found: dict[str, DriverEntry] | None = None


def _load_one(name: str, source: str, load: Any) -> DriverEntry:
    try:
        cls = load()
    except Exception as exc:  # a broken third-party package must not stop the others
        return DriverEntry(name, source, None, f"cannot import: {type(exc).__name__}: {exc}")
    problem = driver_problem(name, cls)
    if problem:
        return DriverEntry(name, source, None, problem)
    return DriverEntry(name, source, cls)


def driver_problem(name: str, cls: Any) -> str:
    """What keeps ``cls`` from being a driver (empty: nothing)."""
    from pydantic import BaseModel

    if not inspect.isclass(cls):
        return f"{cls!r} is not a class"
    for method in ("perform", "observe"):
        if not inspect.iscoroutinefunction(getattr(cls, method, None)):
            return f"{cls.__name__}.{method}: missing, or not an async method"
    model = getattr(cls, "settings_model", None)
    if not (inspect.isclass(model) and issubclass(model, BaseModel)):
        return f"{cls.__name__}.settings_model: missing, or not a pydantic model class"
    if getattr(cls, "name", None) != name:
        return f"{cls.__name__}.name is {getattr(cls, 'name', None)!r}, registered as {name!r}"
    return ""


def drivers_found() -> dict[str, DriverEntry]:
    """Every driver registered (loaded once per process), by name."""
    global _found
    if _found is None:
        found: dict[str, DriverEntry] = {}
        for ep in entry_points(group=ENTRY_POINT_GROUP):
            if ep.name in found:
                continue  # the first one on the path wins, as Python's imports do
            dist = ep.dist.name if ep.dist is not None else "?"
            found[ep.name] = _load_one(ep.name, f"{dist} ({ep.value})", ep.load)
        for name, where in _BUILTIN.items():
            if name not in found:
                module, _, attr = where.partition(":")
                found[name] = _load_one(
                    name,
                    f"fleetwave ({where})",
                    lambda m=module, a=attr: getattr(__import__(m, fromlist=[a]), a),
                )
        _found = found
    return _found


def forget_drivers() -> None:
    """Look the entry points up again on next use (a test that installs a driver)."""
    global _found
    _found = None


def known_drivers() -> frozenset[str]:
    """The names of the drivers that load."""
    return frozenset(n for n, e in drivers_found().items() if e.cls is not None)


def driver_class(name: str) -> type[Any] | None:
    """The class of the driver ``name``, or None if there is no such driver."""
    entry = drivers_found().get(name)
    return entry.cls if entry is not None else None


def make_drivers(seed: int = 0) -> dict[str, TargetDriver]:
    """One instance of every known driver, for one conductor."""
    out: dict[str, TargetDriver] = {}
    for name, entry in drivers_found().items():
        if entry.cls is None:
            continue
        takes_seed = "seed" in inspect.signature(entry.cls).parameters
        out[name] = entry.cls(seed=seed) if takes_seed else entry.cls()
    return out


async def close_drivers(drivers: dict[str, TargetDriver]) -> None:
    """Call each driver's ``close_connections()``, if it has one; a driver that fails to
    close is logged, never raised: the others are closed all the same."""
    for name, driver in drivers.items():
        close = getattr(driver, "close_connections", None)
        if close is None:
            continue
        try:
            await close()
        except Exception as exc:
            logging.getLogger("fleetwave.drivers").warning(
                "driver %s did not close: %s: %s", name, type(exc).__name__, exc
            )
