"""The API's one error shape, ``{"error": {"code", "message", "field"}}``, and what each
kind of failure answers.

An operator's bad input (:class:`~fleetwave.domain.errors.InputError` and its kinds, a
request FastAPI cannot read) is a 4xx naming the field where one is known; a database
that does not answer is a 503; anything else is a 500 with a message that says no more
than that (the traceback goes to the log).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from sqlalchemy.exc import DataError, DBAPIError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Scope

from fleetwave.domain.errors import Conflict, InputError, NotFound
from fleetwave.domain.workflow import WorkflowError
from fleetwave.store.db import StoreError
from fleetwave.store.postgres import redact

log = logging.getLogger("fleetwave.api")


class ErrorBody(BaseModel):
    code: str
    message: str
    field: str | None = None


class ErrorAnswer(BaseModel):
    """Every error the API answers (4xx, 5xx)."""

    error: ErrorBody


class ApiError(Exception):
    """An error answered as it is: its status, code, message and field."""

    def __init__(
        self,
        status: int,
        code: str,
        message: str,
        field: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.field = field
        self.headers = headers


def error_response(
    status: int,
    code: str,
    message: str,
    field: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    body = {"error": {"code": code, "message": message, "field": field}}
    return JSONResponse(body, status_code=status, headers=headers)


#: a message that starts with what it is about: "--state: ...", "target name: ...",
#: "STATE: ..." (the CLI's words for an option or an argument)
_NAMED = re.compile(
    r"^(?:(?:target|group|workflow) [^\s:]+: )?(--[a-z][a-z0-9-]*|[A-Z][A-Z_]*|[a-z][a-z _]*?):\s"
)


def field_of(message: str) -> str | None:
    """The field an operator's error names (the CLI's ``--max-parallel`` is the API's
    ``max_parallel``), if it begins with one."""
    m = _NAMED.match(message)
    if m is None:
        return None
    named = m.group(1).lstrip("-").lower()
    if named == "target name":
        return "name"
    if " " in named:
        return None  # a sentence, not a field ("strategy 3: is being deleted")
    return named.replace("-", "_").replace(" ", "_")


#: HTTP statuses by what was wrong
_STATUS = {NotFound: (404, "not_found"), Conflict: (409, "conflict")}


def _status_of(exc: Exception) -> tuple[int, str]:
    return next((sc for kind, sc in _STATUS.items() if isinstance(exc, kind)), (422, "invalid"))


def _input_error(_: Request, exc: Exception) -> JSONResponse:
    status, code = _status_of(exc)
    message = str(exc)
    return error_response(status, code, message, field_of(message))


@contextmanager
def fields_named(names: Mapping[str, str]) -> Iterator[None]:
    """Bad input raised within names the body's field where the command line's option
    is named otherwise (``--stage: ...``: ``stages``), its message as the command's."""
    try:
        yield
    except (InputError, WorkflowError) as exc:
        status, code = _status_of(exc)
        message = str(exc)
        field = field_of(message)
        if field is None and (first := _FIRST_OPTION.match(message)) is not None:
            field = first.group(1).replace("-", "_")  # ("--stage and --stages-by-group: ...")
        raise ApiError(status, code, message, names.get(field or "", field)) from None


#: the option a message about two of them names first
_FIRST_OPTION = re.compile(r"^--([a-z][a-z0-9-]*) and --")


def _api_error(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, ApiError)
    return error_response(exc.status, exc.code, exc.message, exc.field, exc.headers)


def _validation_error(_: Request, exc: Exception) -> JSONResponse:
    """A request FastAPI could not read: malformed JSON (400), or a value of the wrong
    type, a missing or unknown field (422). The first problem is named."""
    assert isinstance(exc, RequestValidationError)
    problems: list[Any] = list(exc.errors())
    first = problems[0] if problems else {}
    where = [str(p) for p in first.get("loc", ()) if p not in ("body", "query", "path")]
    field = ".".join(where) or None
    kind = first.get("type", "")
    if kind == "json_invalid":
        return error_response(400, "malformed", "body: not valid JSON", "body")
    if field is None and kind in ("model_attributes_type", "dict_type", "model_type"):
        # not an object (a list, a number; or JSON sent without its content type)
        return error_response(
            400, "malformed", "body: must be a JSON object (Content-Type: application/json)", "body"
        )
    if kind == "extra_forbidden":
        message = f"{field}: unknown field"
    elif kind == "missing":
        message = f"{field}: required"
    else:
        said = str(first.get("msg", "invalid")).removeprefix("Value error, ")
        message = f"{field or 'body'}: {said}"
    if len(problems) > 1:
        message += f" (and {len(problems) - 1} more)"
    return error_response(422, "invalid", message, field)


def _http_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    codes = {404: "not_found", 405: "method_not_allowed", 401: "unauthorized", 403: "forbidden"}
    headers = dict(exc.headers) if exc.headers else {}
    if exc.status_code == 405:
        # every method the path takes (Starlette's names only the first route's)
        headers["Allow"] = ", ".join(_methods_of(request))
    return error_response(
        exc.status_code,
        codes.get(exc.status_code, "http_error"),
        str(exc.detail),
        None,
        headers or None,
    )


def _methods_of(request: Request) -> list[str]:
    """The methods the API documents for the request's path."""
    app = request.app
    paths: list[tuple[re.Pattern[str], list[str]]] | None = getattr(app.state, "paths", None)
    if paths is None:
        paths = app.state.paths = [
            (
                re.compile("^" + re.sub(r"\\\{[^/]+?\\\}", "[^/]+", re.escape(path)) + "$"),
                [m.upper() for m in item],
            )
            for path, item in app.openapi().get("paths", {}).items()
        ]
    matched = [(rx, methods) for rx, methods in paths if rx.match(request.url.path)]
    # a path of its own (/v1/targets/import) is documented apart from the template it
    # also matches (/v1/targets/{name}): its own methods are the ones it documents
    literal = [methods for rx, methods in matched if "[^/]+" not in rx.pattern]
    return sorted({m for methods in literal or [m for _, m in matched] for m in methods})


def _store_error(_: Request, exc: Exception) -> JSONResponse:
    """The database cannot be used (an older schema, a file gone): not the caller's fault."""
    return error_response(503, "store_unavailable", redact(str(exc)))


def _database_error(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, DBAPIError)
    log.warning("api: database error: %s", redact(" ".join(str(exc.orig).split())))
    return error_response(
        503,
        "store_unavailable",
        "the database did not answer (locked, busy or unreachable); its transaction was "
        "rolled back: try again",
        headers={"Retry-After": "1"},
    )


def _unstorable(_: Request, exc: Exception) -> JSONResponse:
    """A value the database refused to hold (PostgreSQL: a NUL character in text, a
    number out of its range): bad input that got past the checks, not an outage."""
    assert isinstance(exc, DataError)
    said = redact(" ".join(str(exc.orig).split()))
    log.info("api: a value the database cannot hold: %s", said)
    return error_response(422, "invalid", f"a value the database cannot hold: {said}")


def _internal_error(_: Request, exc: Exception) -> JSONResponse:
    log.error("api: internal error", exc_info=exc)
    return error_response(500, "internal", "internal error (logged by the server)")


_HANDLERS: dict[type[Exception], Callable[[Request, Exception], JSONResponse]] = {
    ApiError: _api_error,
    InputError: _input_error,
    WorkflowError: _input_error,
    RequestValidationError: _validation_error,
    StarletteHTTPException: _http_error,
    StoreError: _store_error,
    DBAPIError: _database_error,
    DataError: _unstorable,
    Exception: _internal_error,
}


def install(app: FastAPI) -> None:
    """Answer every failure in the one shape."""
    for kind, handler in _HANDLERS.items():
        app.add_exception_handler(kind, handler)


def response_for(scope: Scope, exc: Exception) -> JSONResponse:
    """The answer to ``exc`` raised outside FastAPI's handling (the callbacks' fast
    path): the handler of its nearest kind, as Starlette picks it."""
    kind = next(k for k in type(exc).__mro__ if k in _HANDLERS)
    return _HANDLERS[kind](Request(scope), exc)
