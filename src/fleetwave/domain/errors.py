"""Typed errors an operator can cause and fix (exit code 2, HTTP 4xx)."""


class InputError(ValueError):
    """Bad input: the message names the field or object and the problem. Nothing was written."""


class NotFound(InputError):
    """A named target, group, workflow, strategy or step does not exist."""


class Conflict(InputError):
    """The request contradicts current state (target busy in another strategy, ...)."""
