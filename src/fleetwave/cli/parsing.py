"""Turning command-line text and import files into domain records, with clear errors."""

from __future__ import annotations

import csv
import io
from pathlib import Path
from typing import Any

import yaml

from fleetwave.domain.errors import InputError
from fleetwave.domain.models import Target
from fleetwave.drivers.sim import SimSettingError, validate_settings

TARGET_COLUMNS = {"name", "group", "driver", "managed"}


def scalar(text: str) -> Any:
    """'20' -> 20, '0.5' -> 0.5, 'true' -> True, anything else stays text."""
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError:
        return text
    return value if isinstance(value, int | float | bool | str) else text


def parse_pairs(items: list[str] | None, option: str, *, typed: bool = True) -> dict[str, Any]:
    """key=value pairs; ``typed`` turns numbers and booleans into values (labels stay text)."""
    out: dict[str, Any] = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise InputError(f"{option}: expected key=value, got '{item}'")
        out[key.strip()] = scalar(value.strip()) if typed else value.strip()
    return out


def check_target(t: Target, where: str) -> None:
    if t.driver == "sim":
        try:
            validate_settings(t.settings)
        except SimSettingError as exc:
            raise InputError(f"{where}: {exc}") from None


def _truthy(raw: Any, where: str) -> bool:
    text = str(raw).strip().lower()
    if text in {"", "1", "true", "yes", "managed"}:
        return True
    if text in {"0", "false", "no", "unmanaged"}:
        return False
    raise InputError(f"{where}: managed: expected true or false, got '{raw}'")


def targets_from_csv(text: str, source: str) -> list[Target]:
    reader = csv.DictReader(io.StringIO(text))
    if reader.fieldnames is None or "name" not in reader.fieldnames:
        raise InputError(f"{source}: the first line must name the columns, including 'name'")
    out: list[Target] = []
    first_seen: dict[str, int] = {}
    for row in reader:
        where = f"{source} line {reader.line_num}"
        name = (row.get("name") or "").strip()
        if not name:
            raise InputError(f"{where}: name: must not be empty")
        if name in first_seen:
            raise InputError(
                f"{where}: name: {name} appears twice in the file (also line {first_seen[name]})"
            )
        first_seen[name] = reader.line_num
        settings = {
            k.strip(): scalar(v.strip())
            for k, v in row.items()
            if k is not None and k.strip() not in TARGET_COLUMNS and v not in (None, "")
        }
        t = Target(
            name=name,
            group=(row.get("group") or "").strip() or None,
            driver=(row.get("driver") or "").strip() or "sim",
            settings=settings,
            managed=_truthy(row.get("managed", ""), where),
        )
        check_target(t, where)
        out.append(t)
    return out


def targets_from_yaml(text: str, source: str) -> list[Target]:
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise InputError(f"{source}: not valid YAML: {exc}") from None
    if isinstance(data, dict) and "targets" in data:
        data = data["targets"]
    if not isinstance(data, list):
        raise InputError(f"{source}: expected a list of targets (or a 'targets:' list)")
    out: list[Target] = []
    first_seen: dict[str, int] = {}
    for i, item in enumerate(data):
        where = f"{source} targets[{i}]"
        if not isinstance(item, dict):
            raise InputError(f"{where}: expected a mapping with at least 'name'")
        unknown = set(item) - {"name", "group", "driver", "settings", "labels", "managed"}
        if unknown:
            raise InputError(
                f"{where}: {sorted(unknown)[0]}: unknown field (fields: name, group, driver, "
                "managed, labels, settings; driver settings go under 'settings:')"
            )
        name = str(item.get("name") or "").strip()
        if not name:
            raise InputError(f"{where}: name: must not be empty")
        if name in first_seen:
            raise InputError(
                f"{where}: name: {name} appears twice in the file "
                f"(also targets[{first_seen[name]}])"
            )
        first_seen[name] = i
        for key in ("settings", "labels"):
            if not isinstance(item.get(key, {}), dict):
                raise InputError(f"{where} ({name}): {key}: expected a mapping")
        t = Target(
            name=name,
            group=item.get("group"),
            driver=str(item.get("driver") or "sim"),
            settings=dict(item.get("settings") or {}),
            labels={str(k): str(v) for k, v in (item.get("labels") or {}).items()},
            managed=_truthy(item.get("managed", True), f"{where} ({name})"),
        )
        check_target(t, f"{where} ({name})")
        out.append(t)
    return out


def targets_from_file(path: Path) -> list[Target]:
    if not path.is_file():
        raise InputError(f"FILE: {path} does not exist")
    text = path.read_text(encoding="utf-8")
    if path.suffix.lower() in {".yaml", ".yml"}:
        return targets_from_yaml(text, str(path))
    if path.suffix.lower() == ".csv":
        return targets_from_csv(text, str(path))
    raise InputError(f"FILE: {path}: expected a .csv, .yaml or .yml file")
