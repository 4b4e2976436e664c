"""Workflows written in YAML.

    name: site-patch
    version: 1
    description: patch with a longer apply window
    states:
      - name: pre-check
        action: pre-check          # a driver operation, or python:NAME / python:module:Class
        timeout_s: 300
        skip_when_done: true       # target already done: the step completes with a reason
        retry: {attempts: 3, backoff_s: 5, backoff_max_s: 60}
      - name: apply
        action: apply
        timeout_s: 7200
        recover: observe           # observe (default for driver operations) or none
        on: {failed: rollback}     # a failure goes to a later (cleanup) state
      - name: rollback
        cleanup: true              # entered only by a branch; after it the step ends failed

``on: {done: X}`` jumps to another state (or ``next``, ``complete``, ``failed``);
``skip_if: already-done`` skips a state on the driver's report. A branch may go back
(a retry loop) only on a bounded cycle: every state on it declares ``max_visits: N``
(1 to 100), and each visit is its own journal entry; a cycle without is refused.

      - name: retry-flash
        max_visits: 3
      - name: verify
        max_visits: 3
        on: {failed: retry-flash}   # back, at most 3 times round

Errors name the state and the field: ``states[1] (apply): timeout_s: must be > 0``.
"""

from __future__ import annotations

import re
from collections.abc import Hashable
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    model_validator,
)

from fleetwave.domain.models import (
    DECIMAL_FLOAT,
    DECIMAL_INT,
    STATE_NAME,
    STATE_NAME_MAX,
    shown,
    typed_as_number,
)
from fleetwave.domain.registry import action_class, driver_action
from fleetwave.domain.workflow import (
    MAX_VISITS,
    ActionContext,
    DriverOperation,
    NoRecoverHook,
    Outcome,
    RemoteResult,
    StateAction,
    StateDef,
    WorkflowDef,
    WorkflowError,
    back_edges,
    next_in_order,
)

#: the longest timeout, backoff or poll interval a new workflow may give: 30 days
MAX_SECONDS = 2_592_000
#: the highest version (the database keeps it in a 32-bit integer column)
MAX_VERSION = 2**31 - 1


class UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, except that a key given twice in one mapping is refused
    (the safe loader keeps the last one silently). A key given by a merge (``<<:``)
    may still be overridden."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Hashable, Any]:
        first: dict[tuple[str, str], int] = {}
        for key_node, _ in node.value:
            if not isinstance(key_node, yaml.ScalarNode) or key_node.tag.endswith(":merge"):
                continue
            key = (key_node.tag, key_node.value)
            if key in first:
                raise yaml.constructor.ConstructorError(
                    None,
                    None,
                    f"duplicate key '{key_node.value}' (also on line {first[key]})",
                    key_node.start_mark,
                )
            first[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep)


def _yaml_1_2(loader: type[yaml.SafeLoader]) -> None:
    """Type plain scalars as YAML 1.2 does: true/false are the only booleans ('yes',
    'on' stay text), numbers are decimal ('0600' is not octal 384, '1:30' not 90: they
    stay text), no dates."""
    loader.yaml_implicit_resolvers = {
        first: [
            (tag, rx)
            for tag, rx in resolvers
            if tag.rsplit(":", 1)[-1] not in {"bool", "int", "float", "timestamp"}
        ]
        for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
    }
    loader.add_implicit_resolver(
        "tag:yaml.org,2002:bool", re.compile(r"^(?i:true|false)$"), list("tTfF")
    )
    loader.add_implicit_resolver(
        "tag:yaml.org,2002:int", re.compile(rf"^(?:{DECIMAL_INT.pattern})$"), list("-0123456789")
    )
    loader.add_implicit_resolver(
        "tag:yaml.org,2002:float",
        re.compile(rf"^(?:{DECIMAL_FLOAT.pattern})$"),
        list("-+.0123456789"),
    )


class Yaml12Loader(UniqueKeyLoader):
    """:class:`UniqueKeyLoader` with YAML 1.2's typing (see :func:`_yaml_1_2`): new
    workflows and target files."""


class _Yaml12SafeLoader(yaml.SafeLoader):
    """The safe loader with YAML 1.2's typing: stored workflows, read back."""


_yaml_1_2(Yaml12Loader)
_yaml_1_2(_Yaml12SafeLoader)


def load_yaml(text: str, loader: type[yaml.SafeLoader]) -> Any:
    """``yaml.load``, with nesting too deep for the parser (``[[[[...`` hundreds deep)
    reported as a YAML problem, not a RecursionError."""
    try:
        return yaml.load(text, Loader=loader)
    except RecursionError:
        raise yaml.YAMLError("nested too deeply (lists or mappings hundreds deep)") from None


def yaml_problem(exc: yaml.YAMLError) -> str:
    """A YAML error on one line: where it broke, as the parser says it (line and column)."""
    where = getattr(exc, "problem_mark", None)
    what = getattr(exc, "problem", None) or str(exc).splitlines()[0]
    at = f" at line {where.line + 1}, column {where.column + 1}" if where is not None else ""
    return f"not valid YAML{at}: {what}"


def _strict(info: ValidationInfo) -> bool:
    return bool(isinstance(info.context, dict) and info.context.get("strict"))


#: pydantic's "Input should be a valid number ..." errors
_NUMBER_ERRORS = {"float_parsing", "float_type", "int_parsing", "int_type", "int_from_float"}


#: pydantic's "Input should be greater than 0" and the like, in our words
_BOUND_ERRORS = {
    "greater_than": "more than {}",
    "greater_than_equal": "at least {}",
    "less_than": "less than {}",
    "less_than_equal": "at most {}",
    "finite_number": "a finite number",
}


def _given(value: Any) -> str:
    """A value as an error quotes it: text quoted, a list or mapping named."""
    if isinstance(value, str):
        return shown(value)
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "a mapping"
    return "nothing" if value is None else str(value)


def _not_bool(value: Any, info: ValidationInfo) -> Any:
    """YAML's true/false are not numbers (pydantic would take true as 1), nor is text
    (pydantic would take "300", quoted, as 300, yet '1:30' not: a number is unquoted)."""
    if isinstance(value, bool) and _strict(info):
        raise ValueError(f"expected a number, got {str(value).lower()}")
    if isinstance(value, str) and _strict(info) and typed_as_number(value):
        raise ValueError(f"expected a number, got the text {shown(value)} (unquote it)")
    return value


def _only_bool(value: Any, info: ValidationInfo) -> Any:
    """true or false: pydantic would take 'yes', 'off', "false" (quoted) or 1 too, and a
    file meant in YAML 1.1 ('yes') would mean something else than it reads."""
    if _strict(info) and not isinstance(value, bool):
        raise ValueError(f"must be true or false, got {_given(value)}")
    return value


def _whole(value: Any, info: ValidationInfo) -> Any:
    """A count is a whole number: 2.0 is refused (pydantic would take it as 2)."""
    value = _not_bool(value, info)
    if _strict(info) and isinstance(value, float):
        raise ValueError(f"expected a whole number, got {value!r}")
    return value


def _action(value: str | None, info: ValidationInfo) -> str | None:
    """Not empty (an empty action ran the operation named as the state), and one word:
    a driver operation, or python:NAME / python:module:Class."""
    if value is None or not _strict(info):
        return value
    if not value.strip():
        raise ValueError("empty; leave it out to run the operation named as the state")
    if not value.isprintable() or any(c.isspace() for c in value) or len(value) > 200:
        raise ValueError(
            f"{shown(value)} is not an operation name (one word, at most 200 characters) "
            "nor python:NAME or python:module:Class"
        )
    return value


def _seconds_cap(value: float, info: ValidationInfo) -> float:
    if _strict(info) and value > MAX_SECONDS:
        raise ValueError(f"at most {MAX_SECONDS} seconds (30 days), got {value:.15g}")
    return value


def _version_cap(value: int) -> int:
    if value > MAX_VERSION:
        raise ValueError(f"at most {MAX_VERSION}, got {value}")
    return value


def _state_name(value: str, info: ValidationInfo) -> str:
    if not _strict(info):
        return value
    if len(value) > STATE_NAME_MAX:
        raise ValueError(f"at most {STATE_NAME_MAX} characters, got {len(value)}")
    if not STATE_NAME.fullmatch(value):
        raise ValueError(
            f"{value!r} is not allowed; use letters, digits and _ . -, starting with a "
            "letter or digit (the sim's fail_at and hang_at name states this way)"
        )
    return value


def _workflow_name(value: str, info: ValidationInfo) -> str:
    """A workflow's name: as a state's (letters, digits, _ . -), at most 64 characters
    for a new one (it is listed in tables and named in every unknown-workflow error)."""
    if _strict(info) and len(value) > STATE_NAME_MAX:
        raise ValueError(f"at most {STATE_NAME_MAX} characters, got {len(value)}")
    if not STATE_NAME.fullmatch(value):
        raise ValueError(
            f"{shown(value)} is not allowed; use letters, digits and _ . -, starting with "
            "a letter or digit"
        )
    return value


def _branch_target(value: str) -> str:
    if value != "next" and not STATE_NAME.fullmatch(value):
        raise ValueError(f"{shown(value)} is not a state name, next, complete or failed")
    return value


_Seconds = Annotated[float, BeforeValidator(_not_bool), AfterValidator(_seconds_cap)]
_Count = Annotated[int, BeforeValidator(_whole)]


class _Retry(BaseModel):
    model_config = ConfigDict(extra="forbid")
    attempts: _Count = Field(default=1, ge=1, le=100)
    backoff_s: _Seconds = Field(default=1.0, ge=0, allow_inf_nan=False)
    backoff_max_s: _Seconds = Field(default=300.0, ge=0, allow_inf_nan=False)

    @model_validator(mode="after")
    def _backoff_in_order(self, info: ValidationInfo) -> _Retry:
        if _strict(info) and self.backoff_s > self.backoff_max_s:
            default = "" if "backoff_max_s" in self.model_fields_set else ", the default"
            raise ValueError(
                f"backoff_s ({self.backoff_s:.15g}) must not exceed backoff_max_s "
                f"({self.backoff_max_s:.15g}{default})"
            )
        return self


class _Branches(BaseModel):
    model_config = ConfigDict(extra="forbid")
    done: Annotated[str, AfterValidator(_branch_target)] | None = None
    failed: Annotated[str, AfterValidator(_branch_target)] | None = None


class _State(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: Annotated[str, AfterValidator(_state_name)] = Field(min_length=1)
    action: Annotated[str | None, AfterValidator(_action)] = None
    timeout_s: _Seconds = Field(default=600.0, gt=0, allow_inf_nan=False)
    retry: _Retry = Field(default_factory=_Retry)
    skip_when_done: Annotated[bool, BeforeValidator(_only_bool)] = False
    recover: Literal["observe", "none"] = "observe"
    mode: Literal["run", "wait-for-callback", "poll"] = "run"
    #: seconds between two looks at the target in a ``poll`` state
    poll_interval_s: _Seconds | None = Field(default=None, gt=0, allow_inf_nan=False)
    #: branches: where ``done`` and ``failed`` go (a later state; ``next``; for done
    #: also ``complete`` or ``failed``)
    on: _Branches | None = None
    #: entered only by a branch (a cleanup after a failure), never in order
    cleanup: Annotated[bool, BeforeValidator(_only_bool)] = False
    #: the driver's reports (before anything is sent) on which the state is skipped
    skip_if: list[Literal["done", "already-done"]] | Literal["done", "already-done"] | None = None
    #: how many times a step may enter the state: needed on a cycle of branches
    max_visits: _Count | None = Field(default=None, ge=1, le=MAX_VISITS)


class _Workflow(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: Annotated[str, AfterValidator(_workflow_name)] = Field(min_length=1)
    version: Annotated[_Count, AfterValidator(_version_cap)] = Field(default=1, ge=1)
    description: str = ""
    states: list[_State] = Field(min_length=1)


class _NoRecover(StateAction):
    """Wraps a driver operation whose state declares ``recover: none``."""

    def __init__(self, inner: StateAction) -> None:
        self.inner = inner

    async def run(self, ctx: ActionContext) -> Outcome:
        return await self.inner.run(ctx)

    async def recover(self, ctx: ActionContext) -> Outcome:
        raise NoRecoverHook(ctx.state)

    def has_recover_hook(self) -> bool:
        return False

    def describe_recover(self) -> str:
        return "none"

    def describe(self) -> str:
        return f"{self.inner.describe()} (no recover)"

    def describe_params(self) -> dict[str, Any] | None:
        return self.inner.describe_params()


def _where(loc: tuple[int | str, ...], data: Any) -> str:
    parts: list[str] = []
    i = 0
    while i < len(loc):
        item = loc[i]
        if item == "states" and i + 1 < len(loc) and isinstance(loc[i + 1], int):
            idx = int(loc[i + 1])
            name = "?"
            states = data.get("states") if isinstance(data, dict) else None
            if isinstance(states, list) and idx < len(states) and isinstance(states[idx], dict):
                given = states[idx].get("name", "?")
                # a name that is not text (a list, a number) is the error itself: not shown
                name = given if isinstance(given, str) else "?"
                if not name.isprintable() or len(name) > 40:
                    name = shown(name)  # the error stays one line
            parts.append(f"states[{idx}] ({name})")
            i += 2
            continue
        parts.append(str(item))
        i += 1
    return ": ".join(parts) if parts else "workflow"


def _fields_at(loc: tuple[Any, ...]) -> list[str]:
    """The fields allowed where an unknown one was found (``loc``: pydantic's path to it)."""
    model: type[BaseModel] = _Workflow
    if len(loc) >= 3 and loc[0] == "states":
        model = _Retry if len(loc) >= 4 and loc[2] == "retry" else _State
    return list(model.model_fields)


def _driver_action_params(data: dict[Any, Any], source: str) -> dict[int, dict[str, Any]]:
    """The states whose action a driver offers (``action: ssh.run``), by index: their keys
    that are not a state's own (``command:``, ``expect_exit:``), the action's parameters."""
    states = data.get("states")
    out: dict[int, dict[str, Any]] = {}
    if not isinstance(states, list):
        return out
    for i, raw in enumerate(states):
        spec = raw.get("action") if isinstance(raw, dict) else None
        if not isinstance(spec, str):
            continue
        try:
            cls = driver_action(spec)
        except WorkflowError as exc:
            where = _where(("states", i, "action"), data)
            raise WorkflowError(f"{source}: {where}: {exc}") from None
        if cls is not None:
            out[i] = {str(k): v for k, v in raw.items() if k not in _State.model_fields}
    return out


def _driver_action(
    spec: str, params: dict[str, Any], where: str, strict: bool, skip_when_done: bool
) -> StateAction:
    """The driver's action ``spec`` made with the state's ``params``, checked against its
    ``params_model`` (errors worded as the rest of the file's)."""
    cls = driver_action(spec)
    assert cls is not None  # (found before)
    model: type[BaseModel] = getattr(cls, "params_model")  # noqa: B009
    try:
        checked = model.model_validate(params, context={"strict": strict})
    except ValidationError as exc:
        errors = exc.errors()
        # a key misspelt is said as such, not as the key it was meant for missing
        err = next((e for e in errors if e["type"] == "extra_forbidden"), errors[0])
        loc = ": ".join(str(p) for p in err["loc"])
        fields = [*_State.model_fields, *model.model_fields]
        raise WorkflowError(f"{where}: {loc or 'action'}: {_message(err, fields)}") from exc
    action: StateAction = cls(checked)  # type: ignore[call-arg]
    if skip_when_done:
        if not hasattr(action, "skip_when_done"):
            raise WorkflowError(f"{where}: skip_when_done: {spec} never reports done already")
        setattr(action, "skip_when_done", True)  # noqa: B010
    return action


def _message(err: Any, fields_here: list[str] | None = None) -> str:
    """One pydantic error in our words (``fields_here``: the fields allowed where an
    unknown one was found, when pydantic's path does not say)."""
    msg = err["msg"]
    if err["type"] == "value_error" and "error" in err.get("ctx", {}):
        msg = str(err["ctx"]["error"])  # our own message, without "Value error, "
    elif err["type"] in _NUMBER_ERRORS:
        # worded as our own checks (true, 2.0), with what was given
        what = "a whole number" if err["type"].startswith("int") else "a number"
        msg = f"expected {what}, got {_given(err.get('input'))}"
    elif err["type"] in _BOUND_ERRORS:
        ctx = err.get("ctx", {})
        bound = _BOUND_ERRORS[err["type"]].format(
            *(f"{v:g}" if isinstance(v, int | float) else v for v in ctx.values())
        )
        msg = f"must be {bound}, got {_given(err.get('input'))}"
    elif err["type"] == "literal_error":
        expected = err.get("ctx", {}).get("expected", "")
        msg = f"must be one of {expected}, got {_given(err.get('input'))}"
    elif err["type"] == "extra_forbidden":
        fields = ", ".join(fields_here or _fields_at(err["loc"]))
        msg = f"not a field here (the fields are: {fields})"
    elif err["type"] in ("model_type", "dict_type"):
        fields = ", ".join(_fields_at((*err["loc"], "?")))
        msg = f"expected a mapping (of {fields}), got {_given(err.get('input'))}"
    elif err["type"] == "list_type":
        msg = f"expected a list of states, got {_given(err.get('input'))}"
    elif err["type"] == "string_type":
        msg = f"expected text, got {_given(err.get('input'))}"
    elif err["type"] in ("bool_parsing", "bool_type"):
        msg = f"must be true or false, got {_given(err.get('input'))}"
    elif err["type"] == "too_short":
        msg = "a workflow needs at least one state, got none"
    elif err["type"] == "missing":
        msg = "missing (it is required)"
    return str(msg)


def loops_of(text: str) -> tuple[dict[str, frozenset[str]], dict[str, int]]:
    """A stored workflow's loops, read without making its actions (``fleetwave check``
    runs where its python: actions may not import): by state, the states it may go back
    to, and the states that count their visits with their ``max_visits``. Empty for
    text that does not read as a workflow."""
    try:
        data = load_yaml(text, _Yaml12SafeLoader)
        raw = data.get("states") if isinstance(data, dict) else None
        if not isinstance(raw, list):
            return {}, {}
        # (a driver action's parameters are not a state's fields: left out)
        only = [
            {k: v for k, v in st.items() if k in _State.model_fields}
            if isinstance(st, dict)
            else st
            for st in raw
        ]
        model = _Workflow.model_validate({**data, "states": only})
    except (yaml.YAMLError, ValidationError):
        return {}, {}
    states: list[StateDef] = []
    for i, st in enumerate(model.states):
        on = st.on or _Branches()
        ahead = next_in_order(model.states, i)
        states.append(
            StateDef(
                st.name,
                StateAction(),
                on_done=ahead if on.done == "next" else on.done,
                on_failed=ahead if on.failed == "next" else on.failed,
                cleanup=st.cleanup,
                max_visits=st.max_visits,
            )
        )
    limits = {s.name: s.max_visits for s in states if s.max_visits is not None}
    return back_edges(states), limits


def parse_workflow_yaml(text: str, *, source: str = "<yaml>", strict: bool = False) -> WorkflowDef:
    """Parse and validate; raise :class:`WorkflowError` naming the state and field.

    ``strict`` (a new workflow: ``workflow validate`` and ``workflow add``) also refuses
    what earlier versions let through: a key given twice, true/false for a number, a
    state name the sim's fail_at cannot name, backoff_s above backoff_max_s, and a
    timeout, backoff or poll interval above 30 days. Workflows stored and strategies
    created before are read without it, so they still load.
    """
    try:
        data = load_yaml(text, Yaml12Loader if strict else _Yaml12SafeLoader)
    except yaml.YAMLError as exc:
        raise WorkflowError(f"{source}: {yaml_problem(exc)}") from exc
    if not isinstance(data, dict):
        raise WorkflowError(f"{source}: expected a mapping with name and states")
    params_at = _driver_action_params(data, source)
    if params_at:
        # the state without its action's parameters: checked as any state is
        data = {
            **data,
            "states": [
                {k: v for k, v in st.items() if k in _State.model_fields} if i in params_at else st
                for i, st in enumerate(data["states"])
            ],
        }
    try:
        model = _Workflow.model_validate(data, context={"strict": strict})
    except ValidationError as exc:
        err = exc.errors()[0]
        raise WorkflowError(f"{source}: {_where(err['loc'], data)}: {_message(err)}") from exc
    states: list[StateDef] = []
    for i, st in enumerate(model.states):
        if st.poll_interval_s is not None and st.mode != "poll":
            raise WorkflowError(
                f"{source}: states[{i}] ({st.name}): poll_interval_s: only for mode: poll "
                f"(this state's mode is {st.mode})"
            )
        where = f"{source}: states[{i}] ({st.name})"
        if strict and st.mode == "wait-for-callback" and st.retry.attempts > 1:
            # settings that would do nothing: workflow show would promise retries
            raise WorkflowError(
                f"{where}: retry: attempts: a wait-for-callback state is not retried (its "
                f"target's agent is started once); got {st.retry.attempts}, use 1"
            )
        if strict and st.poll_interval_s is not None and st.poll_interval_s >= st.timeout_s:
            raise WorkflowError(
                f"{where}: poll_interval_s: {st.poll_interval_s:g}s is not shorter than the "
                f"state's timeout_s ({st.timeout_s:g}s): it would time out before a second look"
            )
        action: StateAction
        spec = st.action or st.name
        if i in params_at:
            action = _driver_action(spec, params_at[i], where, strict, st.skip_when_done)
            if st.recover == "none":
                action = _NoRecover(action)
        elif spec.startswith("python:"):
            try:
                action = action_class(spec.removeprefix("python:"))()
            except WorkflowError as exc:
                # the same kind: an action missing here (ActionNotFound) is not a bad file
                raise type(exc)(f"{source}: states[{i}] ({st.name}): action: {exc}") from exc
        else:
            skips = [st.skip_if] if isinstance(st.skip_if, str) else list(st.skip_if or ())
            action = DriverOperation(
                spec,
                skip_when_done=st.skip_when_done,
                skip_if=frozenset(RemoteResult(x) for x in skips),
            )
            if st.recover == "none":
                action = _NoRecover(action)
        if st.skip_if and spec.startswith("python:"):
            raise WorkflowError(
                f"{where}: skip_if: only for a driver operation (a python: action decides itself)"
            )
        on = st.on or _Branches()
        ahead = next_in_order(model.states, i)
        states.append(
            StateDef(
                name=st.name,
                action=action,
                timeout_s=st.timeout_s,
                attempts_max=st.retry.attempts,
                backoff_s=st.retry.backoff_s,
                backoff_max_s=st.retry.backoff_max_s,
                mode=st.mode,
                poll_interval_s=10.0 if st.poll_interval_s is None else st.poll_interval_s,
                on_done=ahead if on.done == "next" else on.done,
                on_failed=ahead if on.failed == "next" else on.failed,
                cleanup=st.cleanup,
                max_visits=st.max_visits,
            )
        )
    try:
        return WorkflowDef(
            model.name,
            tuple(states),
            model.version,
            model.description,
            source="yaml",
            yaml_text=text,
        )
    except WorkflowError as exc:
        raise WorkflowError(f"{source}: {exc}") from exc
