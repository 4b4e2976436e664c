"""What an emulated site is told: its settings, the presets of its state, and the
emulator's config file (YAML or JSON).

Every model refuses a field it does not know and a number given as text (strict), so
a mistyped ``fail_at`` or ``"5"`` is an error naming the field, never ignored.
Durations are in site seconds: the emulator's ``--time-scale`` turns them into real
ones.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

#: the remote strategies a site orchestrates (one at a time), as the path names them
STRATEGY_TYPES = ("sw-patch", "sw-deploy", "fw-update", "kube-upgrade")
StrategyType = Literal["sw-patch", "sw-deploy", "fw-update", "kube-upgrade"]
StrategyState = Literal[
    "building",
    "ready-to-apply",
    "build-failed",
    "applying",
    "applied",
    "apply-failed",
    "aborting",
    "aborted",
]
ReleaseState = Literal["available", "deploying", "deployed"]
ReleaseKind = Literal["software", "patch", "firmware", "kubernetes"]
#: a release's name: what a StarlingX release id looks like (stx-10.0.1, PATCH_0001)
RELEASE_ID = r"^[A-Za-z0-9][A-Za-z0-9_.+-]{0,99}$"

#: the longest duration a site can be given: a day
MAX_DURATION_S = 86_400.0
#: the longest latency a site can be given (real milliseconds)
MAX_LATENCY_MS = 60_000.0


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, allow_inf_nan=False)


class SiteSettings(_Strict):
    """How a site behaves. Changing them affects the phases that start afterwards."""

    latency_ms: float = Field(default=0.0, ge=0, le=MAX_LATENCY_MS)
    """each answer of the site's API is delayed by this (real milliseconds, not scaled)"""
    build_s: float = Field(default=5.0, ge=0, le=MAX_DURATION_S)
    apply_s: float = Field(default=30.0, ge=0, le=MAX_DURATION_S)
    abort_s: float = Field(default=2.0, ge=0, le=MAX_DURATION_S)
    reboot_s: float = Field(default=10.0, ge=0, le=MAX_DURATION_S)
    """how long the hosts reboot during an apply (the site unreachable); 0: no reboot"""
    reboot_at: float = Field(default=0.5, ge=0, le=1)
    """when in the apply the hosts reboot, as a fraction of apply_s"""
    fail_at: Literal["build", "apply"] | None = None
    """every strategy's build or apply fails"""
    fail_rate: float = Field(default=0.0, ge=0, le=1)
    """chance a strategy fails (at fail_at, or at build or apply, drawn from the seed)"""
    fail_percent: float = Field(default=100.0, ge=0, le=100)
    """how far into the failing phase it fails (100: at its end, after any reboot)"""


class ReleaseUpload(_Strict):
    """A release (or patch, firmware image, kubernetes version) uploaded to a site."""

    release_id: str = Field(pattern=RELEASE_ID)
    kind: ReleaseKind = "software"
    reboot_required: bool = True
    """whether deploying it reboots the hosts (the site unreachable for reboot_s)"""


class ReleasePreset(ReleaseUpload):
    """A release a site has already, in a given state."""

    state: ReleaseState = "available"


class StrategyPreset(_Strict):
    """A strategy the site has already: a transient state (building, applying,
    aborting) starts its phase at the moment it is set."""

    type: StrategyType
    state: StrategyState
    release: str | None = Field(default=None, pattern=RELEASE_ID)


class SitePatch(_Strict):
    """A change to one site (the admin endpoint, or a site in the config file)."""

    settings: dict[str, Any] | None = None
    """settings to change (the others are kept); validated as SiteSettings"""
    unreachable_for_s: float | None = Field(default=None, ge=0, le=MAX_DURATION_S)
    """the site is unreachable from now for this long (0: reachable again now)"""
    strategy: StrategyPreset | None = None
    """the strategy the site has (null in JSON: none)"""
    releases: list[ReleasePreset] | None = None
    """the releases the site has, replacing its list"""


class EmulatorConfig(_Strict):
    """The config file: settings of every site, releases every site has, and each
    named site's own changes."""

    defaults: dict[str, Any] = Field(default_factory=dict)
    releases: list[ReleasePreset] = Field(default_factory=list)
    sites: dict[str, SitePatch] = Field(default_factory=dict)


class ConfigError(ValueError):
    """A bad config file or setting: the message names the file and field."""


def field_of(error: ValidationError, prefix: str = "") -> tuple[str, str]:
    """The first error of a validation as (field, message): ``sites.site-0007.fail_at``."""
    first = error.errors()[0]
    where = ".".join(str(part) for part in first["loc"])
    field = f"{prefix}.{where}" if prefix and where else prefix or where
    return field, first["msg"]


def merged_settings(base: SiteSettings, changes: dict[str, Any], where: str) -> SiteSettings:
    """``base`` with ``changes``; a bad one raises :class:`ConfigError` naming
    ``where.field``."""
    try:
        return SiteSettings.model_validate({**base.model_dump(), **changes})
    except ValidationError as exc:
        field, msg = field_of(exc, where)
        raise ConfigError(f"{field}: {msg}") from None


def load_config(path: Path) -> EmulatorConfig:
    """The config file (YAML, of which JSON is a part); errors name the file and field."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: cannot read it: {exc}") from None
    try:
        data = (json.loads(text) if path.suffix.lower() == ".json" else yaml.safe_load(text)) or {}
    except (ValueError, yaml.YAMLError) as exc:
        raise ConfigError(f"{path}: not valid {path.suffix.lstrip('.') or 'YAML'}: {exc}") from None
    try:
        return EmulatorConfig.model_validate(data)
    except ValidationError as exc:
        field, msg = field_of(exc)
        raise ConfigError(f"{path}: {field}: {msg}") from None
