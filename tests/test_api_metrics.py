"""``GET /metrics`` on a real ``serve --listen``: the engine's transitions, steps in
flight, dispatch and commit latency and callbacks answered, and the API's requests by
route and status, in Prometheus's format (parsed as Prometheus would)."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from api_harness import new_token, run_fleetwave, serving


def _samples(http: httpx.Client) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    answer = http.get("/metrics")
    assert answer.status_code == 200, answer.text
    assert answer.headers["content-type"].startswith("text/plain")
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(answer.text)
        for s in family.samples
    }


def _until_ended(http: httpx.Client, sid: int) -> str:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        state = str(http.get(f"/v1/strategies/{sid}").json()["state"])
        if state in ("complete", "failed", "aborted"):
            return state
        time.sleep(0.1)
    raise AssertionError(f"strategy {sid} did not end")


def test_metrics_count_what_the_engine_and_the_api_did(tmp_path: Path) -> None:
    db = tmp_path / "fleet.db"
    assert run_fleetwave(db, "init").returncode == 0
    token = new_token(db, "operator")
    with serving(db) as server, server.client(token) as http:
        with server.client() as nobody:
            assert nobody.get("/metrics").status_code == 401
        for i in range(10):
            assert http.post("/v1/targets", json={"name": f"n{i}"}).status_code == 201
        patch = http.post("/v1/strategies", json={"workflow": "patch", "all": True}).json()
        http.post(f"/v1/strategies/{patch['id']}/apply")
        assert _until_ended(http, patch["id"]) == "complete"
        clean = http.post("/v1/strategies", json={"workflow": "clean", "all": True}).json()
        http.post(f"/v1/strategies/{clean['id']}/apply")
        assert _until_ended(http, clean["id"]) == "complete"
        got = _samples(http)

    def one(name: str, **labels: str) -> float:
        return got[(name, tuple(sorted(labels.items())))]

    for state in ("pre-check", "updating-patches", "finishing", "complete"):
        assert one("fleetwave_transitions_total", workflow="patch", state=state) == 10
    assert one("fleetwave_transitions_total", workflow="clean", state="wait-for-agent") == 10
    # each clean node's agent reported twice (its two waiting states), each applied
    assert one("fleetwave_callbacks_answered_total", outcome="applied", reason="") == 20
    assert one("fleetwave_steps_in_flight") == 0
    assert one("fleetwave_dispatch_latency_seconds_count") >= 10 * 12
    assert one("fleetwave_commit_seconds_count") > 0
    assert one("fleetwave_commit_batch_size_sum") >= 10 * 6 + 10 * 8
    assert (
        one("fleetwave_api_requests_total", route="/v1/targets", method="POST", status="201") == 10
    )
    shown = one(
        "fleetwave_api_requests_total",
        route="/v1/strategies/{strategy_id}",
        method="GET",
        status="200",
    )
    assert shown >= 2
    assert one("fleetwave_api_requests_total", route="/metrics", method="GET", status="401") == 1
    # nothing taken over, no outage (their counts: see the test below and
    # test_database_outages)
    assert one("fleetwave_lease_takeovers_total") == 0
    assert one("fleetwave_store_outages_total") == 0
    assert one("fleetwave_store_outage_seconds") == 0


def test_a_strategy_taken_over_from_a_dead_conductor_is_counted(tmp_path: Path) -> None:
    """A strategy whose conductor died (its lease long expired) is claimed by the serve
    that starts: one lease takeover."""
    from sqlalchemy import update

    from fleetwave.store.db import open_store
    from fleetwave.store.schema import strategies

    db = tmp_path / "fleet.db"
    assert run_fleetwave(db, "init").returncode == 0
    assert run_fleetwave(db, "target", "add", "n1").returncode == 0
    assert run_fleetwave(db, "strategy", "create", "--workflow", "patch", "--all").returncode == 0
    assert run_fleetwave(db, "strategy", "apply", "1").returncode == 0
    store = open_store(str(db))
    try:
        with store.write() as conn:
            conn.execute(update(strategies).values(owner="c-dead", fence=1, lease_expires_at=1.0))
    finally:
        store.dispose()
    token = new_token(db, "reader")
    with serving(db) as server, server.client(token) as http:
        assert _until_ended(http, 1) == "complete"
        got = _samples(http)
    assert got[("fleetwave_lease_takeovers_total", ())] == 1


def test_an_ignored_callback_is_counted_under_a_few_known_reasons() -> None:
    from fleetwave.engine.meters import reason_class

    assert reason_class("duplicate: this state already had its callback") == "duplicate"
    assert reason_class("late: step already complete") == "late"
    assert reason_class("state final-power-off does not wait for callbacks") == (
        "state_does_not_wait"
    )
    assert reason_class("its step is not under way: not started yet") == "step_not_under_way"
    assert reason_class("ignored: strategy ended first") == "strategy_ended"
    assert reason_class("something new") == "other"
