"""Turning command-line text and import files into domain records, with clear errors."""

from __future__ import annotations

import csv
import io
import math
from dataclasses import replace
from pathlib import Path
from typing import Any

import yaml

from fleetwave.domain.errors import InputError
from fleetwave.domain.models import DECIMAL_FLOAT, DECIMAL_INT, Target, name_problem, shown
from fleetwave.domain.yaml_workflow import (
    Yaml12Loader,
    load_yaml,
    yaml_problem,
)
from fleetwave.drivers.settings import SettingsError, checked_settings
from fleetwave.store.admin import TargetBatch

TARGET_COLUMNS = {"name", "group", "driver", "managed"}

_INT = DECIMAL_INT
_FLOAT = DECIMAL_FLOAT
_BOOL = {"true": True, "false": False}


def scalar(text: str) -> Any:
    """'20' -> 20, '0.5' -> 0.5, '1e3' -> 1000.0, 'true'/'FALSE' -> a bool; anything
    else ('yes', 'on', '0x10', '1:30', '010') stays the text typed."""
    if _INT.fullmatch(text):
        try:
            return int(text)
        except ValueError:  # more digits than Python turns into an int
            return text
    if _FLOAT.fullmatch(text):
        value = float(text)
        return value if math.isfinite(value) else text
    return _BOOL.get(text.lower(), text)


def parse_pairs(items: list[str] | None, option: str, *, typed: bool = True) -> dict[str, Any]:
    """key=value pairs; ``typed`` turns numbers and booleans into values (labels stay text)."""
    out: dict[str, Any] = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise InputError(f"{option}: expected key=value, got {shown(item)}")
        if key.strip() in out:
            # the last one silently winning hides a typo (another key meant)
            raise InputError(f"{option}: {shown(key.strip())} given more than once")
        if option == "--label" and not value.strip():
            # as a file's labels: an empty value is no label (and no target has one)
            raise InputError(f"--label: {key.strip()}: no value (give one, or leave it out)")
        out[key.strip()] = scalar(value.strip()) if typed else value.strip()
    return out


def several(option: str, given: list[str] | None) -> list[str]:
    """A filter option given once or more, each perhaps ``a,b``: the values, in order,
    each once (a step in any of them is shown). An empty value is refused."""
    out: list[str] = []
    for each in given or ():
        for value in (v.strip() for v in each.split(",")):
            if not value:
                raise InputError(f"{option}: an empty value in {each!r}")
            if value not in out:
                out.append(value)
    return out


def check_target(t: Target, where: str) -> Target:
    """The target's name (by the name rule) and its driver settings, checked against the
    driver's settings model; ``where`` names it in the settings' errors. The target to
    store: its secrets given in clear sealed (``fleetwave.drivers.secrets``)."""
    problem = name_problem(t.name)
    if problem:
        raise InputError(f"target name: {problem}")
    try:
        settings = checked_settings(t.driver, t.settings)
    except SettingsError as exc:
        raise InputError(f"{where}: {exc}") from None
    return t if settings is t.settings else replace(t, settings=settings)


def _check_row(t: Target, where: str) -> Target:
    """A target read from a file: its name's errors name the file and line too."""
    problem = name_problem(t.name)
    if problem:
        raise InputError(f"{where}: name: {problem}")
    return check_target(t, where)


def _truthy(raw: Any, where: str) -> bool:
    text = str(raw).strip().lower()
    if text in {"", "1", "true", "yes", "on", "managed"}:
        return True
    if text in {"0", "false", "no", "off", "unmanaged"}:
        return False
    raise InputError(f"{where}: managed: expected true or false, got {shown(str(raw))}")


# -- files ----------------------------------------------------------------------------------


def read_text_file(path: Path) -> str:
    """The text of a UTF-8 file (a leading byte-order mark, as Excel's "CSV UTF-8"
    writes, is dropped); anything else is one clear error."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise InputError(f"{path}: cannot read it: {exc.strerror or exc}") from None
    return decode_text(data, str(path), csv=path.suffix.lower() == ".csv")


def decode_text(data: bytes, where: str, *, csv: bool = False) -> str:
    """UTF-8 text read from a file or stdin (``where`` names it in an error): a leading
    byte-order mark dropped; anything not UTF-8 refused, naming the line and column."""
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        column = exc.start - (data.rfind(b"\n", 0, exc.start) + 1) + 1
        how = "save it as UTF-8"
        if data.startswith((b"\xff\xfe", b"\xfe\xff")):
            how = "it is UTF-16 (a byte-order mark says so); save it as UTF-8"
        if csv:
            how += " (Excel: 'CSV UTF-8')"
        raise InputError(
            f"{where}: not UTF-8 text (byte 0x{data[exc.start]:02x} at line {line}, "
            f"column {column}); {how}"
        ) from None


def targets_from_csv(text: str, source: str) -> TargetBatch:
    # strict: a quote left open is an error, not a field running to the end of the file
    reader = csv.DictReader(io.StringIO(text.removeprefix("\ufeff")), strict=True)
    out = TargetBatch()
    try:
        header = reader.fieldnames
        if header is None:
            raise InputError(f"{source}: the file is empty; its first line must name the columns")
        header = reader.fieldnames = [h.strip() for h in header]
        _check_header(header, source)
        columns = f"{len(header)} column{'' if len(header) == 1 else 's'}"
        first_seen: dict[str, int] = {}
        for row in reader:
            where = f"{source} line {reader.line_num}"
            extra = row.pop(None, None)
            if extra and any(str(v).strip() for v in extra):
                raise InputError(
                    f"{where}: {len(header) + len(extra)} fields, but the first line names "
                    f"{columns}"
                )
            if any(v is None for v in row.values()):
                # a short row: which columns it lacks cannot be told apart from empty ones
                given = sum(v is not None for v in row.values())
                raise InputError(
                    f"{where}: {given} field{'' if given == 1 else 's'}, but the first line "
                    f"names {columns} (leave a field empty with nothing between its commas)"
                )
            name = (row.get("name") or "").strip()
            if not name:
                raise InputError(f"{where}: name: must not be empty")
            if name in first_seen:
                raise InputError(
                    f"{where}: name: {name} appears twice in the file "
                    f"(also line {first_seen[name]})"
                )
            first_seen[name] = reader.line_num
            settings = {
                k: scalar(v.strip())
                for k, v in row.items()
                if k not in TARGET_COLUMNS and v not in (None, "")
            }
            t = Target(
                name=name,
                group=(row.get("group") or "").strip() or None,
                driver=(row.get("driver") or "").strip() or "sim",
                settings=settings,
                managed=_truthy(row.get("managed", ""), where),
            )
            out.append(_check_row(t, where))
            out.origins.append(where)
            out.no_labels.add(out[-1].name)
    except csv.Error as exc:
        # the record that failed starts on the line after the last one read whole
        why = str(exc)
        if why == "unexpected end of data":
            why = "a quote opened in this record is never closed"
        raise InputError(f"{source} line {reader.line_num + 1}: not valid CSV: {why}") from None
    if not out:
        raise InputError(f"{source}: no targets (the file has only its header line)")
    return out


def _check_header(header: list[str], source: str) -> None:
    """The first line names the columns: name (required), group, driver, managed, and
    every other column a driver setting."""
    where = f"{source} line 1"
    if "name" not in header:
        said = ", ".join(shown(h) for h in header[:5]) + (", ..." if len(header) > 5 else "")
        raise InputError(
            f"{where}: no 'name' column (the first line reads {said}); the first line must "
            "name the columns: name, then any of group, driver, managed, and driver settings"
        )
    for i, column in enumerate(header, 1):
        if not column:
            raise InputError(f"{where}: column {i} has no name (an extra comma?)")
        if header.count(column) > 1:
            raise InputError(f"{where}: column '{column}' appears twice")
        if column == "labels":
            raise InputError(
                f"{where}: labels: not a CSV column (every column past name, group, driver "
                "and managed is a driver setting); give labels in a YAML file, or with "
                "'fleetwave target add NAME --label k=v'"
            )


class _TargetsLoader(Yaml12Loader):
    """YAML for target files, typed as YAML 1.2 (and ``--set``) type it: true/false are
    the only booleans ('yes', 'no', 'on', 'off' stay text: a sim state may be called
    'on'), numbers are decimal ('010', '0x10' and '1:30' stay text), no dates."""


def _yaml_int(loader: yaml.SafeLoader, node: yaml.Node) -> Any:
    text = str(loader.construct_scalar(node))  # type: ignore[arg-type]
    if _INT.fullmatch(text):
        return int(text)
    raise yaml.constructor.ConstructorError(
        None, None, f"'{text}' is not a decimal integer", node.start_mark
    )


def _yaml_float(loader: yaml.SafeLoader, node: yaml.Node) -> Any:
    text = str(loader.construct_scalar(node))  # type: ignore[arg-type]
    return scalar(text) if _FLOAT.fullmatch(text) else text


_TargetsLoader.add_constructor("tag:yaml.org,2002:int", _yaml_int)
_TargetsLoader.add_constructor("tag:yaml.org,2002:float", _yaml_float)


def _kind(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "a mapping"
    return f"{shown(str(value))} ({type(value).__name__}; quote it)"


def _text(item: dict[Any, Any], key: str, where: str) -> str | None:
    """name, group or driver: text (a whole number is taken as its digits: group 5 is
    group '5'); a list, mapping, true/false or fraction is refused."""
    value = item.get(key)
    if value is None:
        return None
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    if not isinstance(value, str):
        raise InputError(f"{where}: {key}: expected text, got {_kind(value)}")
    return value.strip()


def targets_from_yaml(text: str, source: str) -> TargetBatch:
    try:
        data = load_yaml(text, _TargetsLoader)
    except yaml.YAMLError as exc:
        raise InputError(f"{source}: {yaml_problem(exc)}") from None
    if isinstance(data, dict) and "targets" in data:
        others = sorted(str(k) for k in data if k != "targets")
        if others:
            raise InputError(
                f"{source}: {others[0]}: unknown top-level field (the file is a list of "
                "targets, or one 'targets:' list)"
            )
        data = data["targets"]
    if not isinstance(data, list):
        raise InputError(f"{source}: expected a list of targets (or a 'targets:' list)")
    if not data:
        raise InputError(f"{source}: no targets (the list is empty)")
    out = TargetBatch()
    first_seen: dict[str, int] = {}
    for i, item in enumerate(data):
        where = f"{source} targets[{i}]"
        if not isinstance(item, dict):
            raise InputError(f"{where}: expected a mapping with at least 'name'")
        unknown = set(item) - {"name", "group", "driver", "settings", "labels", "managed"}
        if unknown:
            raise InputError(
                f"{where}: {sorted(map(str, unknown))[0]}: unknown field (fields: name, group, "
                "driver, managed, labels, settings; driver settings go under 'settings:')"
            )
        name = _text(item, "name", where) or ""
        if not name:
            raise InputError(f"{where}: name: must not be empty")
        problem = name_problem(name)
        if problem:
            raise InputError(f"{where}: name: {problem}")
        if name in first_seen:
            raise InputError(
                f"{where}: name: {name} appears twice in the file "
                f"(also targets[{first_seen[name]}])"
            )
        first_seen[name] = i
        named = f"{where} ({name})"
        for key in ("settings", "labels"):
            if item.get(key) is not None and not isinstance(item[key], dict):
                raise InputError(f"{named}: {key}: expected a mapping")
        labels = item.get("labels") or {}
        for k, v in labels.items():
            if isinstance(v, list | dict):
                raise InputError(f"{named}: labels: {k}: expected text, got {_kind(v)}")
            if v is None:
                raise InputError(f"{named}: labels: {k}: no value (give one, or leave it out)")
        t = Target(
            name=name,
            group=_text(item, "group", named) or None,
            driver=_text(item, "driver", named) or "sim",
            settings=dict(item.get("settings") or {}),
            # true stays "true", as --label k=true stores it (not Python's "True")
            labels={
                str(k): str(v).lower() if isinstance(v, bool) else str(v) for k, v in labels.items()
            },
            managed=_truthy(item.get("managed", True), named),
        )
        out.append(_check_row(t, named))
        out.origins.append(where)
        if item.get("labels") is None:
            out.no_labels.add(name)
    return out


def target_file_text(path: Path) -> tuple[str, str]:
    """A targets file's kind (``csv`` or ``yaml``, by its name) and text."""
    if path.is_dir():
        raise InputError(f"FILE: {path} is a directory, not a .csv or .yaml file")
    if not path.is_file():
        raise InputError(f"FILE: {path} does not exist")
    suffix = path.suffix.lower()
    if suffix not in {".csv", ".yaml", ".yml"}:
        raise InputError(f"FILE: {path}: expected a .csv, .yaml or .yml file")
    return ("csv" if suffix == ".csv" else "yaml"), read_text_file(path)


def targets_from_file(path: Path) -> TargetBatch:
    kind, text = target_file_text(path)
    if kind == "csv":
        return targets_from_csv(text, str(path))
    return targets_from_yaml(text, str(path))
