"""Driver settings: checked against the driver's model, secrets sealed and masked.

Every driver class names its per-target settings with a pydantic model
(``settings_model``). This module is what the rest of fleetwave asks about them:

* :func:`checked_settings`: the settings to store for a target (``target add``,
  ``import``, ``set``), or :class:`SettingsError` naming the field
  (``url: not a URL``); secrets given in clear come back sealed
  (:mod:`fleetwave.drivers.secrets`);
* :func:`secret_settings` / :func:`is_secret` / :func:`mask_settings`: which settings
  are secret, and the settings as any output shows them (the REST API masks with
  these too);
* :func:`describe_driver`: each setting's type, default and secrecy (``driver show``);
* :func:`parsed_settings`: the model a driver reads at run time, and
  :class:`PerTarget`: what a driver keeps per target, made from that model.
"""

from __future__ import annotations

import functools
import json
import types
import typing
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from pydantic import BaseModel, SecretStr, ValidationError
from pydantic.fields import FieldInfo

from fleetwave.domain.models import Target, shown
from fleetwave.domain.workflow import StepFailed
from fleetwave.drivers import driver_class, drivers_found
from fleetwave.drivers.secrets import (
    MASK,
    SecretError,
    check_reference,
    same_secret,
    seal,
    shown_secret,
)


class SettingsError(ValueError):
    """A setting is refused; the message starts with the setting's name and never holds
    a secret's value."""


def _model(driver: str) -> type[BaseModel] | None:
    cls = driver_class(driver)
    model = getattr(cls, "settings_model", None) if cls is not None else None
    return model if isinstance(model, type) and issubclass(model, BaseModel) else None


def _is_secret_field(info: FieldInfo) -> bool:
    ann = info.annotation
    return ann is SecretStr or (
        typing.get_origin(ann) in (typing.Union, types.UnionType)
        and SecretStr in typing.get_args(ann)
    )


def secret_settings(driver: str) -> frozenset[str]:
    """The names of the driver's secret settings (none for an unknown driver)."""
    model = _model(driver)
    return frozenset() if model is None else _secret_fields(model)


@functools.cache
def _secret_fields(model: type[BaseModel]) -> frozenset[str]:
    # asked per row of a target list (100,000 of them): worked out once per model
    return frozenset(n for n, f in model.model_fields.items() if _is_secret_field(f))


def is_secret(driver: str, key: str) -> bool:
    """Whether the setting ``key`` of a target of ``driver`` is a secret."""
    return key in secret_settings(driver)


def mask_settings(driver: str, settings: dict[str, Any]) -> dict[str, Any]:
    """The settings as any output shows them: a secret's reference (``env:VAR``,
    ``file:/path``) as it is, any other secret value ``***``."""
    secret = secret_settings(driver)
    if not secret or not secret & settings.keys():
        return settings
    return {k: shown_secret(v) if k in secret else v for k, v in settings.items()}


def _problem(error: Any, secret: bool) -> str:
    """One pydantic error in a few words (never with a secret's value)."""
    kind: str = error.get("type", "")
    if kind.startswith("url"):
        return "not a URL" if kind != "url_scheme" else f"not a URL ({error.get('msg', '')})"
    if kind == "missing":
        return "required"
    if kind in ("int_parsing", "int_type", "int_from_float"):
        return "not a whole number"
    if kind in ("float_parsing", "float_type"):
        return "not a number"
    if kind in ("bool_parsing", "bool_type"):
        return "not true or false"
    if kind in ("string_type",):
        return "not text"
    msg = str(error.get("msg", "not valid"))
    msg = msg.replace("Input should be", "must be").replace("Value error, ", "")
    if not secret and "input" in error and kind.startswith(("literal", "enum")):
        msg = f"{shown(str(error['input']))}: {msg}"
    return msg


def checked_settings(driver: str, settings: dict[str, Any]) -> dict[str, Any]:
    """The settings to store for a target of ``driver``: checked against its model (and
    its ``check_settings``, if it has one), secrets given in clear sealed. Raises
    :class:`SettingsError` naming the first bad setting. An unknown driver's settings
    come back as given (whoever adds the target refuses the driver)."""
    cls = driver_class(driver)
    model = _model(driver)
    if cls is None or model is None:
        return settings
    own_check = getattr(cls, "check_settings", None)
    if own_check is not None:
        # the driver's own words (the sim's checks are stricter than a model says)
        try:
            own_check(settings)
        except ValueError as exc:
            raise SettingsError(str(exc)) from None
        return settings
    fields = model.model_fields
    unknown = sorted(str(k) for k in settings if k not in fields)
    if unknown:
        key = unknown[0] if unknown[0].isidentifier() else shown(unknown[0])
        raise SettingsError(
            f"{key}: unknown setting of the {driver} driver (known: {', '.join(fields) or 'none'})"
        )
    secret = secret_settings(driver)
    given: dict[str, Any] = {}
    for key, value in settings.items():
        info = fields[key]
        if _wants_text(info) and isinstance(value, int | float) and not isinstance(value, bool):
            value = str(value)  # typed as a number on the command line: meant as text
        if key in secret:
            if not isinstance(value, str) or not value:
                raise SettingsError(f"{key}: a secret must be non-empty text")
            problem = check_reference(value)
            if problem:
                raise SettingsError(f"{key}: {problem}")
        given[key] = value
    try:
        model.model_validate(given)
    except ValidationError as exc:
        first = exc.errors()[0]
        loc = ".".join(str(p) for p in first.get("loc", ())) or "settings"
        raise SettingsError(f"{loc}: {_problem(first, loc in secret)}") from None
    out = dict(given)
    for key in secret & given.keys():
        try:
            out[key] = seal(given[key])
        except SecretError as exc:
            raise SettingsError(f"{key}: {exc}") from None
    return out


def same_settings(driver: str, stored: dict[str, Any], given: dict[str, Any]) -> bool:
    """Whether two stored forms of a target's settings say the same (a secret sealed
    twice reads alike only opened)."""
    if stored.keys() != given.keys():
        return False
    secret = secret_settings(driver)
    # as stored (JSON): 1 and true, 5 and 5.0 are other values
    return all(
        same_secret(v, given[k]) if k in secret else _json(v) == _json(given[k])
        for k, v in stored.items()
    )


def _json(value: Any) -> str:
    return json.dumps(value, sort_keys=True)


def _wants_text(info: FieldInfo) -> bool:
    ann = info.annotation
    args = typing.get_args(ann) if typing.get_origin(ann) else (ann,)
    return str in args or SecretStr in args


def parsed_settings(model: type[BaseModel], settings: dict[str, Any]) -> BaseModel:
    """The settings as the driver's model reads them (stored settings were checked when
    they were written; a database edited by hand fails here, naming the field)."""
    try:
        return model.model_validate(settings)
    except ValidationError as exc:
        first = exc.errors()[0]
        loc = ".".join(str(p) for p in first.get("loc", ())) or "settings"
        raise SettingsError(f"{loc}: {_problem(first, True)}") from None


M = TypeVar("M", bound=BaseModel)
T = TypeVar("T")


class PerTarget(Generic[M, T]):
    """What a driver keeps for each target (its settings read, a client), made by
    ``make`` from the target's settings as the driver's ``model`` reads them, and made
    again when they change (a new ``settings`` dict: the conductor reads targets afresh
    for each strategy). Settings a database edited by hand got wrong fail the step,
    naming the target and the setting."""

    def __init__(self, driver: str, model: type[M], make: Callable[[Target, M], T]) -> None:
        self._driver = driver
        self._model = model
        self._make = make
        self._kept: dict[str, tuple[dict[str, Any], T]] = {}

    def get(self, target: Target) -> T:
        kept = self._kept.get(target.name)
        if kept is not None and kept[0] is target.settings:
            return kept[1]
        try:
            cfg = parsed_settings(self._model, target.settings)
        except SettingsError as exc:
            raise StepFailed(f"{self._driver}: target {target.name}: {exc}") from None
        assert isinstance(cfg, self._model)
        made = self._make(target, cfg)
        self._kept[target.name] = (target.settings, made)
        return made

    def forget_all(self) -> list[T]:
        """Forget every target's (the driver is closing): what was kept, to close."""
        kept, self._kept = self._kept, {}
        return [made for _, made in kept.values()]


# -- describing ---------------------------------------------------------------------------


def _type_name(ann: Any) -> str:
    origin = typing.get_origin(ann)
    if origin is typing.Literal:
        return " | ".join(str(a) for a in typing.get_args(ann))
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(ann) if a is not type(None)]
        name = " | ".join(_type_name(a) for a in args)
        return name + (" (or none)" if len(args) < len(typing.get_args(ann)) else "")
    if origin is typing.Annotated:
        return _type_name(typing.get_args(ann)[0])
    if ann is SecretStr:
        return "secret"
    simple = {str: "text", int: "integer", float: "number", bool: "true/false"}
    if ann in simple:
        return simple[ann]
    name = getattr(ann, "__name__", str(ann))
    return "URL" if "Url" in name else name


def describe_driver(name: str) -> dict[str, Any]:
    """A driver as ``driver show`` prints it: where it comes from, what it says of itself,
    and each setting (name, type, default, secret, description)."""
    entry = drivers_found()[name]
    out: dict[str, Any] = {"name": name, "source": entry.source}
    if entry.cls is None:
        out["error"] = entry.error
        out["settings"] = []
        return out
    doc = (entry.cls.__doc__ or "").strip().split("\n\n")[0]
    out["description"] = " ".join(doc.split())
    model = _model(name)
    rows = []
    for key, info in model.model_fields.items() if model is not None else ():
        secret = _is_secret_field(info)
        default = None if info.is_required() else info.get_default(call_default_factory=True)
        if isinstance(default, SecretStr):
            default = MASK
        rows.append(
            {
                "setting": key,
                "type": _type_name(info.annotation),
                "default": "(required)" if info.is_required() else default,
                "secret": secret,
                "description": " ".join((info.description or "").split()),
            }
        )
    out["settings"] = rows
    return out
