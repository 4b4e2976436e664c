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

Errors name the state and the field: ``states[1] (apply): timeout_s: must be > 0``.
"""

from __future__ import annotations

from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from fleetwave.domain.registry import action_class
from fleetwave.domain.workflow import (
    ActionContext,
    DriverOperation,
    NoRecoverHook,
    Outcome,
    StateAction,
    StateDef,
    WorkflowDef,
    WorkflowError,
)


class _Retry(BaseModel):
    model_config = ConfigDict(extra="forbid")
    attempts: int = Field(default=1, ge=1, le=100)
    backoff_s: float = Field(default=1.0, ge=0, allow_inf_nan=False)
    backoff_max_s: float = Field(default=300.0, ge=0, allow_inf_nan=False)


class _State(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(min_length=1)
    action: str | None = None
    timeout_s: float = Field(default=600.0, gt=0, allow_inf_nan=False)
    retry: _Retry = Field(default_factory=_Retry)
    skip_when_done: bool = False
    recover: Literal["observe", "none"] = "observe"
    mode: Literal["run", "wait-for-callback", "poll"] = "run"
    #: seconds between two looks at the target in a ``poll`` state
    poll_interval_s: float | None = Field(default=None, gt=0, allow_inf_nan=False)


class _Workflow(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(min_length=1, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
    version: int = Field(default=1, ge=1)
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
                name = str(states[idx].get("name", "?"))
            parts.append(f"states[{idx}] ({name})")
            i += 2
            continue
        parts.append(str(item))
        i += 1
    return ": ".join(parts) if parts else "workflow"


def parse_workflow_yaml(text: str, *, source: str = "<yaml>") -> WorkflowDef:
    """Parse and validate; raise :class:`WorkflowError` naming the state and field."""
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        # One line: where it broke, as the parser says it (line and column).
        where = getattr(exc, "problem_mark", None)
        what = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        at = f" at line {where.line + 1}, column {where.column + 1}" if where is not None else ""
        raise WorkflowError(f"{source}: not valid YAML{at}: {what}") from exc
    if not isinstance(data, dict):
        raise WorkflowError(f"{source}: expected a mapping with name and states")
    try:
        model = _Workflow.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        raise WorkflowError(f"{source}: {_where(err['loc'], data)}: {err['msg']}") from exc
    states: list[StateDef] = []
    for i, st in enumerate(model.states):
        if st.poll_interval_s is not None and st.mode != "poll":
            raise WorkflowError(
                f"{source}: states[{i}] ({st.name}): poll_interval_s: only for mode: poll "
                f"(this state's mode is {st.mode})"
            )
        action: StateAction
        spec = st.action or st.name
        if spec.startswith("python:"):
            try:
                action = action_class(spec.removeprefix("python:"))()
            except WorkflowError as exc:
                raise WorkflowError(f"{source}: states[{i}] ({st.name}): action: {exc}") from exc
        else:
            action = DriverOperation(spec, skip_when_done=st.skip_when_done)
            if st.recover == "none":
                action = _NoRecover(action)
        states.append(
            StateDef(
                name=st.name,
                action=action,
                timeout_s=st.timeout_s,
                attempts_max=st.retry.attempts,
                backoff_s=st.retry.backoff_s,
                backoff_max_s=st.retry.backoff_max_s,
                mode=st.mode,
                **({} if st.poll_interval_s is None else {"poll_interval_s": st.poll_interval_s}),
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
