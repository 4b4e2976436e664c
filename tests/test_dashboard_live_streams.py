"""The dashboard's server side on a real ``fleetwave serve --listen``: its files served
from the package (naming no other host), its live streams behind the same tokens as
the API, and their fan-out bounded: five pages on one strategy are one producer reading
the store twice a second, not five."""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx

from api_harness import Server, serving
from fleetwave.api.dashboard import STATIC_DIR
from fleetwave.domain.models import StrategyOptions, Target
from fleetwave.domain.registry import get_workflow
from fleetwave.store import admin
from fleetwave.store.db import open_store
from fleetwave.store.tokens import Role, create_token

TARGETS = 40


def _fleet(tmp_path: Path, latency_ms: int = 300) -> tuple[Path, str]:
    db = tmp_path / "fleet.db"
    store = open_store(str(db))
    try:
        admin.add_targets(
            store,
            [Target(f"t-{i:02d}", settings={"latency_ms": latency_ms}) for i in range(TARGETS)],
        )
        patch = get_workflow("patch")
        assert patch is not None
        admin.create_strategy(store, patch, StrategyOptions(max_parallel=10), all_targets=True)
        token = create_token(store, "pages", Role.READER, None)
    finally:
        store.dispose()
    return db, token


def _events(response: httpx.Response) -> Iterator[tuple[str, dict[str, Any]]]:
    """The server-sent events of a stream, as (event, data)."""
    name, data = "message", ""
    for line in response.iter_lines():
        if line.startswith("event: "):
            name = line[7:]
        elif line.startswith("data: "):
            data += line[6:]
        elif line == "" and data:
            yield name, json.loads(data)
            name, data = "message", ""


def _metric(server: Server, token: str, name: str) -> float:
    with server.client(token) as http:
        text = http.get("/metrics").text
    found = re.search(rf"^{name} (\S+)$", text, re.M)
    assert found, f"{name} not in /metrics"
    return float(found.group(1))


def test_the_pages_are_served_from_the_package_and_name_no_other_host(tmp_path: Path) -> None:
    db, _ = _fleet(tmp_path)
    with serving(db) as server, server.client() as http:
        page = http.get("/")
        assert page.status_code == 200 and "text/html" in page.headers["content-type"]
        for ref in re.findall(r'(?:src|href)="([^"]+)"', page.text):
            assert ref.startswith(("/", "#", "data:")), ref
            if ref.startswith("/ui/"):
                assert http.get(ref).status_code == 200
        script = http.get("/ui/app.js")
        assert "javascript" in script.headers["content-type"]
    for path in STATIC_DIR.iterdir():
        text = path.read_text()
        # (the SVG namespace is a name, not a request)
        hosts = set(re.findall(r"https?://[^\s\"'`)]+", text)) - {"http://www.w3.org/2000/svg"}
        assert hosts == set(), (path.name, hosts)


def test_streams_need_a_token_and_a_strategy_that_exists(tmp_path: Path) -> None:
    db, token = _fleet(tmp_path)
    with serving(db) as server:
        with server.client() as anonymous:
            refused = anonymous.get("/v1/strategies/1/live")
            assert refused.status_code == 401
            assert refused.json()["error"]["field"] == "Authorization"
            assert anonymous.get("/v1/live").status_code == 401
        with server.client(token) as http:
            missing = http.get("/v1/strategies/99/live")
            assert missing.status_code == 404
            assert missing.json()["error"]["message"] == "strategy 99 not found"
            assert http.get("/v1/me").json() == {
                "name": "pages",
                "role": "reader",
                "may_drive": False,
            }


def test_five_pages_on_one_strategy_share_one_producer(tmp_path: Path) -> None:
    db, token = _fleet(tmp_path)
    operator = new_operator(db)
    with serving(db) as server:
        seen: list[list[tuple[str, dict[str, Any]]]] = [[] for _ in range(5)]
        stop = threading.Event()

        def watch(i: int, http: httpx.Client) -> None:
            with http.stream("GET", "/v1/strategies/1/live") as response:
                assert response.headers["content-type"].startswith("text/event-stream")
                for event in _events(response):
                    seen[i].append(event)
                    if stop.is_set():
                        return

        with ExitStack() as stack:
            clients = [stack.enter_context(server.client(token)) for _ in range(5)]
            threads = [
                threading.Thread(target=watch, args=(i, c), daemon=True)
                for i, c in enumerate(clients)
            ]
            for t in threads:
                t.start()
            deadline = time.monotonic() + 30
            while not all(seen) and time.monotonic() < deadline:
                time.sleep(0.1)
            assert all(seen), "a page got no event"
            assert _metric(server, token, "fleetwave_live_streams") == 5
            assert _metric(server, token, "fleetwave_live_producers") == 1
            with server.client(operator) as ops:
                assert ops.post("/v1/strategies/1/apply").status_code == 200
            reads_before = _metric(server, token, "fleetwave_live_reads_total")
            time.sleep(4)
            reads = _metric(server, token, "fleetwave_live_reads_total") - reads_before
            # twice a second for the five pages (a pass late on a loaded machine: fewer)
            assert 2 <= reads <= 10, reads
            stop.set()
            for t in threads:
                t.join(timeout=10)
        for events in seen:
            # the whole grid first, then each pass's changes
            first, data = events[0]
            assert first == "full"
            assert len(data["grid"]["step"]) == TARGETS
            assert data["strategy"]["step_states"] == {"initial": TARGETS}
            assert {name for name, _ in events[1:]} <= {"tick", "full"}
            moved = [c for name, d in events[1:] if name == "tick" for c in d["changes"]]
            assert moved, "no change reached the page"
            assert all(0 <= c[0] < TARGETS for c in moved)
        # the pages gone, nothing is read for them
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if _metric(server, token, "fleetwave_live_producers") == 0:
                break
            time.sleep(0.2)
        assert _metric(server, token, "fleetwave_live_streams") == 0
        assert _metric(server, token, "fleetwave_live_producers") == 0


def new_operator(db: Path) -> str:
    store = open_store(str(db))
    try:
        return create_token(store, "ops", Role.OPERATOR, None)
    finally:
        store.dispose()


def test_a_stream_followed_to_the_end_has_the_grid_and_charts_of_the_store(
    tmp_path: Path,
) -> None:
    """A page's grid (the first ``full``, then each ``tick``'s changes) ends equal to the
    steps' states and attempts, and its charts count every transition and every state
    left, as the journal has them."""
    db, token = _fleet(tmp_path, latency_ms=50)  # (a rollout of about a second)
    operator = new_operator(db)
    with serving(db) as server, server.client(token) as http:
        cells: dict[str, list[Any]] = {}
        last: dict[str, Any] = {}
        with (
            http.stream("GET", "/v1/strategies/1/live") as response,
            server.client(operator) as ops,
        ):
            applied = False
            for name, data in _events(response):
                if name == "full":
                    cells = data["grid"]
                for i, state, attempt in data.get("changes", []):
                    cells["state"][i], cells["attempt"][i] = state, attempt
                last = data
                if not applied:
                    assert ops.post("/v1/strategies/1/apply").status_code == 200
                    applied = True
                if data["strategy"]["state"] == "complete":
                    break
        assert cells == http.get("/v1/strategies/1/grid").json()
        steps = http.get("/v1/strategies/1/steps", params={"limit": 1000}).json()["items"]
        assert len(steps) == TARGETS
        assert {s["step"]: (s["target"], s["state"], s["attempt"]) for s in steps} == {
            step: (target, state, attempt)
            for step, target, state, attempt in zip(
                cells["step"], cells["target"], cells["state"], cells["attempt"], strict=True
            )
        }
        assert set(cells["state"]) == {"complete"}
        journal = http.get("/v1/strategies/1/history", params={"limit": 1000}).json()["items"]
        assert len(journal) == TARGETS * 6
        made = last["throughput"]
        assert round(sum(made["transitions_per_s"]) * made["bucket_s"]) == len(journal)
        assert round(sum(made["ended_per_s"]) * made["bucket_s"]) == TARGETS
        left = {state: sum(d["counts"]) for state, d in last["durations"]["states"].items()}
        workflow_states = {t["to"] for t in journal} - {"complete"}
        assert left == dict.fromkeys(workflow_states, TARGETS)
