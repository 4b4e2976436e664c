"""Bad input to the API: a 4xx in the one error shape naming the field, nothing
written, never a 500; and the server goes on serving."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from api_harness import in_process, new_token, run_fleetwave, serving
from fleetwave.api.service import MAX_BODY_BYTES
from fleetwave.store.db import open_store
from fleetwave.store.schema import callbacks, events, strategies, targets

JSON = {"Content-Type": "application/json"}

# (method, path, request keywords, status, field)
CASES: list[tuple[str, str, dict[str, Any], int, str | None]] = [
    ("POST", "/v1/targets", {"content": b'{"name": ', "headers": JSON}, 400, "body"),
    ("POST", "/v1/targets", {"json": ["a1"]}, 400, "body"),
    ("POST", "/v1/targets", {"content": b"name=a1"}, 400, "body"),
    ("POST", "/v1/targets", {"json": {"name": "x", "colour": "red"}}, 422, "colour"),
    ("POST", "/v1/targets", {"json": {"name": 5}}, 422, "name"),
    ("POST", "/v1/targets", {"json": {}}, 422, "name"),
    ("POST", "/v1/targets", {"json": {"name": "two words"}}, 422, "name"),
    ("POST", "/v1/targets", {"json": {"name": "n\u0000ul"}}, 422, "name"),
    ("POST", "/v1/targets", {"json": {"name": "ok", "labels": {"a": "b\u0000"}}}, 422, "labels"),
    ("GET", "/v1/targets", {"params": {"group": "a\u0000b"}}, 422, "group"),
    ("GET", "/v1/targets/a%00b", {}, 422, "name"),
    ("POST", "/v1/targets", {"content": b'{"name": "\\ud800"}', "headers": JSON}, 422, "name"),
    ("POST", "/v1/targets", {"json": {"name": "ok", "labels": {"a": ""}}}, 422, "labels.a"),
    ("POST", "/v1/targets", {"json": {"name": "ok", "group": "nowhere"}}, 404, "group"),
    ("POST", "/v1/targets", {"json": {"name": "ok", "settings": {"latency_ms": -1}}}, 422, None),
    ("POST", "/v1/targets", {"content": b"x" * (MAX_BODY_BYTES + 1), "headers": JSON}, 413, "body"),
    ("PATCH", "/v1/targets/a1", {"json": {}}, 422, None),
    ("PATCH", "/v1/targets/a1", {"json": {"driver": "warp"}}, 422, "driver"),
    ("PATCH", "/v1/targets/ghost", {"json": {"labels": {"a": "b"}}}, 404, None),
    ("POST", "/v1/targets/ghost/manage", {}, 404, None),
    ("DELETE", "/v1/targets/ghost", {}, 404, None),
    ("GET", "/v1/targets", {"params": {"limit": 10**9}}, 422, "limit"),
    ("GET", "/v1/targets", {"params": {"limit": 0}}, 422, "limit"),
    ("GET", "/v1/targets", {"params": {"limit": "many"}}, 422, "limit"),
    ("GET", "/v1/targets", {"params": {"cursor": "not-one"}}, 422, "cursor"),
    ("GET", "/v1/targets", {"params": {"colour": "red"}}, 422, "colour"),
    ("GET", "/v1/targets", {"params": {"label": "ring"}}, 422, "label"),
    ("GET", "/v1/targets", {"params": {"group": "nowhere"}}, 404, "group"),
    ("GET", "/v1/targets/ghost", {}, 404, None),
    ("GET", "/v1/groups/ghost", {}, 404, None),
    ("GET", "/v1/workflows/ghost", {}, 404, "name"),
    ("GET", "/v1/strategies/99", {}, 404, None),
    ("GET", "/v1/strategies/-1", {}, 422, "strategy_id"),
    ("GET", "/v1/strategies/99999999999999999999", {}, 422, "strategy_id"),
    ("GET", "/v1/strategies/abc", {}, 422, "strategy_id"),
    ("GET", "/v1/strategies", {"params": {"state": "sleeping"}}, 422, "state"),
    ("GET", "/v1/strategies/1/steps", {"params": {"state": "sleeping"}}, 422, "state"),
    ("GET", "/v1/strategies/1/steps", {"params": {"target": "ghost"}}, 404, "target"),
    ("GET", "/v1/strategies/1/events", {"params": {"kind": "party"}}, 422, "kind"),
    ("GET", "/v1/strategies/1/history", {"params": {"cursor": "WyJhIl0"}}, 422, "cursor"),
    ("GET", "/v1/steps/99", {}, 404, None),
    ("GET", "/v1/check", {"params": {"strategy": 99}}, 404, None),
    ("POST", "/v1/strategies", {"json": {"workflow": "nope", "all": True}}, 404, "workflow"),
    ("POST", "/v1/strategies", {"json": {"workflow": "patch", "targets": []}}, 422, "targets"),
    (
        "POST",
        "/v1/strategies",
        {"json": {"workflow": "patch", "targets": ["ghost"]}},
        404,
        "targets",
    ),
    (
        "POST",
        "/v1/strategies",
        {"json": {"workflow": "patch", "all": True, "max_parallel": 0}},
        422,
        "max_parallel",
    ),
    (
        "POST",
        "/v1/strategies",
        {"json": {"workflow": "patch", "all": True, "timeouts": {"nap": 5}}},
        422,
        "timeouts",
    ),
    (
        "POST",
        "/v1/strategies",
        {"json": {"workflow": "patch", "all": True, "timeouts": {"pre-check": -5}}},
        422,
        "timeouts.pre-check",
    ),
    ("POST", "/v1/strategies/1/pause", {}, 409, None),
    ("POST", "/v1/strategies/1/apply", {"json": {"force": True}}, 422, "body"),
    ("POST", "/v1/strategies/99/abort", {}, 404, None),
    ("GET", "/v1/nowhere", {}, 404, None),
    ("PUT", "/v1/strategies/1", {}, 405, None),
]


@pytest.fixture
def api(db_path: Path) -> Iterator[httpx.Client]:
    with in_process(db_path) as client:
        assert client.post("/v1/targets", json={"name": "a1"}).status_code == 201
        made = client.post("/v1/strategies", json={"workflow": "patch", "all": True})
        assert made.json()["id"] == 1
        yield client


def _counts(db: Path) -> dict[str, int]:
    store = open_store(str(db))
    try:
        with store.read() as conn:
            return {
                t.name: len(conn.execute(t.select()).all())
                for t in (targets, strategies, events, callbacks)
            }
    finally:
        store.dispose()


@pytest.mark.parametrize(("method", "path", "kw", "status", "field"), CASES)
def test_bad_input_is_a_4xx_naming_the_field_and_writes_nothing(
    api: httpx.Client,
    db_path: Path,
    method: str,
    path: str,
    kw: dict[str, Any],
    status: int,
    field: str | None,
) -> None:
    before = _counts(db_path)
    answer = api.request(method, path, **kw)
    assert answer.status_code == status, answer.text
    error = answer.json()["error"]
    assert set(error) == {"code", "message", "field"}
    assert error["message"]
    assert error["field"] == field, error
    assert _counts(db_path) == before


def test_the_server_goes_on_serving_after_bad_input(tmp_path: Path) -> None:
    db = tmp_path / "fleet.db"
    assert run_fleetwave(db, "init").returncode == 0
    token = new_token(db, "operator")
    with serving(db, "--no-engine") as server, server.client(token) as http:
        for method, path, kw, status, _ in CASES[:14]:
            assert http.request(method, path, **kw).status_code == status
        assert http.post("/v1/targets", json={"name": "a1"}).status_code == 201
        assert http.get("/v1/targets").json()["items"][0]["name"] == "a1"
        assert http.get("/readyz").status_code == 200
