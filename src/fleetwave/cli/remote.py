"""The command line talking to a server: ``fleetwave --url URL strategy list`` (or
``FLEETWAVE_URL``, with ``FLEETWAVE_TOKEN``) reads through the REST API what it would
read from a database, and prints it the same way (the API answers the CLI's JSON).

Reads (targets, groups, workflows, strategies, steps, history, events, check) and
strategy pause, resume and abort work through a server; any other command is refused
with ``--url`` (it needs the database). The standard library's HTTP client: nothing
more to install for it.
"""

from __future__ import annotations

import json
import os
import ssl
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

from fleetwave.domain.errors import Conflict, InputError, NotFound

URL_ENV = "FLEETWAVE_URL"
TOKEN_ENV = "FLEETWAVE_TOKEN"
#: rows asked for per page when a whole list is read
PAGE = 1000
#: how long one request waits for the server
TIMEOUT_S = 60.0

#: the server given to this command (``--url``, or FLEETWAVE_URL), if any
_given: list[str] = []


def set_url(url: str | None) -> None:
    """The root command's ``--url`` (Typer reads FLEETWAVE_URL for it)."""
    _given.clear()
    if url is not None and url.strip():
        _given.append(url.strip().rstrip("/"))


def given() -> str | None:
    return _given[0] if _given else None


def server(db: str | None) -> Remote | None:
    """The server to read through, if the command was given one (not with --db)."""
    url = given()
    if url is None:
        return None
    if db is not None:
        raise InputError("--db and --url: give one of them (a database, or a server)")
    return Remote(url, os.environ.get(TOKEN_ENV) or None)


class Remote:
    """A fleetwave server's REST API (``fleetwave serve --listen``)."""

    def __init__(self, url: str, token: str | None) -> None:
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise InputError(f"--url: expected http://HOST:PORT or https://..., got {url!r}")
        self.url = url
        self.token = token

    def get(self, path: str, **params: Any) -> Any:
        return self._call("GET", path, params)

    def post(self, path: str, body: Any = None) -> Any:
        """A change; ``body`` (if any) sent as JSON."""
        return self._call("POST", path, {}, body)

    def post_text(self, path: str, text: str, content_type: str, **params: Any) -> Any:
        """A change whose body is a file's text (a workflow's YAML, a targets file)."""
        return self._call("POST", path, params, text.encode("utf-8"), content_type)

    def every(self, path: str, **params: Any) -> list[dict[str, Any]]:
        """Every row of a paged list, page after page."""
        rows: list[dict[str, Any]] = []
        cursor = None
        while True:
            page = self.get(path, **params, limit=PAGE, cursor=cursor)
            rows += page["items"]
            cursor = page["next_cursor"]
            if cursor is None:
                return rows

    def _call(
        self,
        method: str,
        path: str,
        params: dict[str, Any],
        body: Any = None,
        content_type: str = "application/json",
    ) -> Any:
        pairs = [
            (key, str(v).lower() if isinstance(v, bool) else str(v))
            for key, value in params.items()
            if value is not None
            for v in (value if isinstance(value, list | tuple) else [value])
        ]
        query = f"?{urllib.parse.urlencode(pairs)}" if pairs else ""
        data = body if body is None or isinstance(body, bytes) else json.dumps(body).encode()
        request = urllib.request.Request(f"{self.url}{path}{query}", data=data, method=method)
        if data is not None:
            request.add_header("Content-Type", content_type)
        if self.token:
            request.add_header("Authorization", f"Bearer {self.token}")
        request.add_header("Accept", "application/json")
        try:
            with urllib.request.urlopen(
                request, timeout=TIMEOUT_S, context=ssl.create_default_context()
            ) as answer:
                return json.loads(answer.read())
        except urllib.error.HTTPError as exc:
            raise _refusal(self.url, exc) from None
        except (urllib.error.URLError, OSError, ValueError) as exc:
            why = getattr(exc, "reason", exc)
            raise InputError(f"--url: cannot reach {self.url}: {why}") from None


def _refusal(url: str, exc: urllib.error.HTTPError) -> InputError:
    """The server's error, as the same command against a database says it."""
    try:
        error = json.loads(exc.read())["error"]
        message = str(error["message"])
    except (ValueError, KeyError, TypeError):
        message = f"{exc.code} {exc.reason}"
    if exc.code == 401:
        how = "" if os.environ.get(TOKEN_ENV) else f" (set {TOKEN_ENV})"
        return InputError(f"--url: {url} wants a valid token{how}: {message}")
    if exc.code == 403:
        return InputError(f"--url: {url} refused: {message}")
    if exc.code == 404:
        return NotFound(message)
    if exc.code == 409:
        return Conflict(message)
    if exc.code >= 500:
        return InputError(f"--url: {url} failed ({exc.code}): {message}")
    return InputError(message)
