"""Drivers: the code that talks to targets of one kind.

A driver implements :class:`fleetwave.domain.workflow.TargetDriver`. ``sim`` ships
with fleetwave and is the embedded default; more kinds plug in here.
"""

from __future__ import annotations

from collections.abc import Callable

from fleetwave.domain.workflow import TargetDriver
from fleetwave.drivers.sim import SimDriver

DriverFactory = Callable[[int], TargetDriver]

_FACTORIES: dict[str, DriverFactory] = {"sim": lambda seed: SimDriver(seed=seed)}


def known_drivers() -> frozenset[str]:
    return frozenset(_FACTORIES)


def make_drivers(seed: int = 0) -> dict[str, TargetDriver]:
    """One instance of every known driver, for one conductor."""
    return {name: factory(seed) for name, factory in _FACTORIES.items()}
