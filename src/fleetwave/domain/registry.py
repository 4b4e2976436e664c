"""Where workflows and Python state actions are found by name.

Built-in workflows are always registered. Python workflows register themselves
with :func:`register_workflow` when their module is imported (modules listed in
``FLEETWAVE_PLUGINS``, comma separated, are imported by the CLI). YAML workflows
are stored in the database and added by the store layer.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from typing import TypeVar

from fleetwave.domain.builtin import builtin_workflows
from fleetwave.domain.rules import details_text
from fleetwave.domain.workflow import StateAction, WorkflowDef, WorkflowError

A = TypeVar("A", bound=type[StateAction])


class ActionNotFound(WorkflowError):
    """A YAML state's ``action: python:NAME`` is not registered or importable in this
    process (its plug-in is not imported here)."""


class PluginError(WorkflowError):
    """A module named in ``FLEETWAVE_PLUGINS`` cannot be imported (it is missing, or
    raised): a problem of this process's environment, not of any workflow."""


_workflows: dict[str, WorkflowDef] = {}
_actions: dict[str, type[StateAction]] = {}


def register_workflow(wf: WorkflowDef, *, replace: bool = False) -> WorkflowDef:
    if wf.name in _workflows and not replace and _workflows[wf.name] is not wf:
        raise WorkflowError(f"workflow {wf.name}: name: already registered")
    _workflows[wf.name] = wf
    return wf


def register_action(name: str) -> Callable[[A], A]:
    """Class decorator: make a :class:`StateAction` usable from YAML as ``action: python:NAME``."""

    def deco(cls: A) -> A:
        _actions[name] = cls
        return cls

    return deco


def action_class(name: str) -> type[StateAction]:
    if name not in _actions and ":" not in name:
        _ensure_loaded()  # a plug-in registers its actions when imported
    if name in _actions:
        return _actions[name]
    if ":" in name:  # module.path:ClassName
        mod_name, _, cls_name = name.partition(":")
        try:
            obj = getattr(importlib.import_module(mod_name), cls_name)
        except (ImportError, AttributeError) as exc:
            raise ActionNotFound(f"action python:{name}: cannot import it ({exc})") from exc
        if not (isinstance(obj, type) and issubclass(obj, StateAction)):
            raise WorkflowError(f"action python:{name}: is not a StateAction subclass")
        return obj
    hint = ""
    if not os.environ.get("FLEETWAVE_PLUGINS", "").strip():
        hint = (
            " (an action registered by a module is found once the module is named in "
            "FLEETWAVE_PLUGINS, or give it as python:module:Class)"
        )
    raise ActionNotFound(f"action python:{name}: no action registered under that name{hint}")


def driver_action(spec: str) -> type[StateAction] | None:
    """The action a driver offers as ``DRIVER.NAME`` (``ssh.run``), which takes
    parameters from its YAML state (its class's ``params_model``, a pydantic model).
    None when ``spec`` is not of that form or names no driver that offers actions (it
    is then a plain operation's name, as before); :class:`WorkflowError` when the
    driver offers actions, none of them ``NAME``."""
    driver, dot, name = spec.partition(".")
    if not dot or not driver:
        return None
    # (imported here: the drivers import the domain; a driver offers its actions through
    # a static ``actions()``, which imports them when asked)
    from fleetwave.drivers import driver_class

    cls = driver_class(driver)
    offered = getattr(cls, "actions", None) if cls is not None else None
    if offered is None:
        return None
    actions: dict[str, type[StateAction]] = offered()
    if name not in actions:
        raise WorkflowError(
            f"the {driver} driver has no action {name!r} (its actions: "
            f"{', '.join(f'{driver}.{a}' for a in sorted(actions))})"
        )
    return actions[name]


def get_workflow(name: str) -> WorkflowDef | None:
    _ensure_loaded()
    return _workflows.get(name)


def all_workflows() -> list[WorkflowDef]:
    _ensure_loaded()
    return sorted(_workflows.values(), key=lambda w: w.name)


_loaded = False
#: why the plug-ins could not be loaded: every lookup says so, not only the first
_load_error: PluginError | None = None


def load_plugins() -> None:
    """Register the built-ins and import the plug-ins (once); raise :class:`PluginError`
    (every time) if one cannot be imported. Commands that drive strategies call it
    first, so a typo in ``FLEETWAVE_PLUGINS`` stops them before they take anything on."""
    _ensure_loaded()


def _ensure_loaded() -> None:
    global _loaded, _load_error
    if _loaded:
        if _load_error is not None:
            raise _load_error
        return
    _loaded = True
    for wf in builtin_workflows():
        _workflows.setdefault(wf.name, wf)
    for mod in filter(
        None, (m.strip() for m in os.environ.get("FLEETWAVE_PLUGINS", "").split(","))
    ):
        try:
            importlib.import_module(mod)
        except KeyboardInterrupt:
            raise
        except BaseException as exc:  # a missing module, or one that raises when imported
            # (SystemExit too: `raise SystemExit(0)` in a plug-in made serve and apply
            # --wait exit 0 with nothing said, as if they had done their work)
            said = details_text(exc)
            why = said if isinstance(exc, ImportError) else f"{type(exc).__name__}: {said}"
            _load_error = PluginError(f"FLEETWAVE_PLUGINS: cannot import '{mod}': {why}")
            raise _load_error from None
