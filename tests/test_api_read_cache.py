"""The API gives a strategy's show and its step pages again for a while
(``serve --read-cache-ms``): not after a change made through the API, and never with 0."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from fastapi.testclient import TestClient

from api_harness import run_fleetwave
from fleetwave.api.app import make_app
from fleetwave.api.service import READ_CACHE_STALE, Service
from fleetwave.domain.models import StrategyOptions, Target
from fleetwave.domain.registry import get_workflow
from fleetwave.store import admin
from fleetwave.store.db import open_store


@contextmanager
def _client(db: Path, read_cache_s: float) -> Iterator[TestClient]:
    app = make_app(Service(open_store(str(db)), auth=False, read_cache_s=read_cache_s))
    with TestClient(app) as client:
        yield client


def _strategy(tmp_path: Path) -> tuple[Path, int]:
    db = tmp_path / "fleet.db"
    assert run_fleetwave(db, "init").returncode == 0
    assert run_fleetwave(db, "target", "add", "a1").returncode == 0
    assert run_fleetwave(db, "strategy", "create", "--workflow", "patch", "--all").returncode == 0
    return db, 1


def test_a_change_made_elsewhere_shows_once_the_answer_is_old_enough(tmp_path: Path) -> None:
    db, sid = _strategy(tmp_path)
    with _client(db, 3600) as http:
        assert http.get(f"/v1/strategies/{sid}").json()["state"] == "initial"
        steps = http.get(f"/v1/strategies/{sid}/steps").json()["items"]
        admin.apply_strategy(open_store(str(db)), sid)  # (as a command would)
        assert http.get(f"/v1/strategies/{sid}").json()["state"] == "initial"
        assert http.get(f"/v1/strategies/{sid}/steps").json()["items"] == steps
        # a change through the API: read again
        paused = http.post(f"/v1/strategies/{sid}/pause")
        assert paused.status_code == 200, paused.text
        assert http.get(f"/v1/strategies/{sid}").json()["state"] == "paused"


def test_with_no_cache_every_read_goes_to_the_database(tmp_path: Path) -> None:
    db, sid = _strategy(tmp_path)
    with _client(db, 0) as http:
        assert http.get(f"/v1/strategies/{sid}").json()["state"] == "initial"
        admin.apply_strategy(open_store(str(db)), sid)
        assert http.get(f"/v1/strategies/{sid}").json()["state"] == "applying"


def test_an_unknown_strategy_is_not_kept(tmp_path: Path) -> None:
    db, _ = _strategy(tmp_path)
    with _client(db, 3600) as http:
        assert http.get("/v1/strategies/2").status_code == 404
        store = open_store(str(db))
        admin.add_targets(store, [Target(name="a2")])
        workflow = get_workflow("patch")
        assert workflow is not None
        made = admin.create_strategy(store, workflow, StrategyOptions(), target_names=["a2"])
        assert made == 2
        assert http.get("/v1/strategies/2").status_code == 200


def test_an_old_answer_is_given_while_it_is_read_again_then_the_new_one(
    tmp_path: Path,
) -> None:
    """Past its time, an answer is still given (no request waits for a read another
    started) while a newer read runs; then the newer one is given. Never once it is
    READ_CACHE_STALE times its time old."""
    db, sid = _strategy(tmp_path)
    ttl = 0.3
    with _client(db, ttl) as http:
        assert http.get(f"/v1/strategies/{sid}").json()["state"] == "initial"
        admin.apply_strategy(open_store(str(db)), sid)  # (as a command would)
        time.sleep(ttl * 1.2)
        # old: given once more, and read again behind it
        assert http.get(f"/v1/strategies/{sid}").json()["state"] == "initial"
        deadline = time.monotonic() + 10
        while http.get(f"/v1/strategies/{sid}").json()["state"] != "applying":
            assert time.monotonic() < deadline, "the newer read was never given"
            time.sleep(0.02)
        admin.pause_strategy(open_store(str(db)), sid)
        time.sleep(ttl * READ_CACHE_STALE * 1.1)
        # too old to be given: read now
        assert http.get(f"/v1/strategies/{sid}").json()["state"] == "paused"
