"""What every request body of the API is: a JSON object whose unknown fields are
refused (a typo is not ignored), and whose text holds no NUL character (no name, state
or setting has one, and PostgreSQL cannot store one)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, field_validator


def _has_nul(value: Any) -> bool:
    if isinstance(value, str):
        return "\x00" in value
    if isinstance(value, dict):
        return any(_has_nul(k) or _has_nul(v) for k, v in value.items())
    if isinstance(value, list | tuple):
        return any(_has_nul(v) for v in value)
    return False


class Body(BaseModel):
    model_config = ConfigDict(extra="forbid")

    @field_validator("*")
    @classmethod
    def _no_nul(cls, value: Any) -> Any:
        if _has_nul(value):
            raise ValueError("must not contain a NUL character")
        return value
