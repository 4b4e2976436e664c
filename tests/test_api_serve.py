"""``fleetwave serve --listen``: the REST API on a real uvicorn server beside the engine
(a rollout created, applied and read through it, to the end), or alone
(``--no-engine``); stopped by SIGTERM; its options refused when wrong."""

from __future__ import annotations

import shutil
import socket
import ssl
import subprocess
import time
from pathlib import Path

import pytest
from sqlalchemy import func, select

from api_harness import in_process, new_token, run_fleetwave, serving
from fleetwave.store.db import open_store
from fleetwave.store.schema import journal


def _init(tmp_path: Path) -> Path:
    db = tmp_path / "fleet.db"
    assert run_fleetwave(db, "init").returncode == 0
    return db


def test_a_rollout_created_applied_and_read_through_the_api_runs_to_the_end(
    tmp_path: Path,
) -> None:
    db = _init(tmp_path)
    token = new_token(db, "operator")
    with serving(db) as server, server.client(token) as http:
        assert http.get("/healthz").json() == {"ok": True}
        ready = http.get("/readyz")
        assert ready.status_code == 200 and ready.json()["ok"] is True
        for i in range(12):
            added = http.post("/v1/targets", json={"name": f"s{i:02d}", "labels": {"ring": "a"}})
            assert added.status_code == 201 and added.json() == {"name": f"s{i:02d}", "added": True}
        created = http.post(
            "/v1/strategies", json={"workflow": "patch", "labels": {"ring": "a"}, "max_parallel": 4}
        )
        assert created.status_code == 201, created.text
        sid = created.json()["id"]
        assert created.json()["steps"] == 12 and created.json()["state"] == "initial"
        applied = http.post(f"/v1/strategies/{sid}/apply").json()
        assert applied["state"] == "applying" and applied["was"] == "initial"
        deadline = time.monotonic() + 60
        state = ""
        while time.monotonic() < deadline:
            state = http.get(f"/v1/strategies/{sid}").json()["state"]
            if state == "complete":
                break
            time.sleep(0.1)
        assert state == "complete"

        # the journal, a page of 7 at a time, all of it once, in order
        rows, cursor = [], None
        while True:
            page = http.get(
                f"/v1/strategies/{sid}/history",
                params={"limit": 7, **({"cursor": cursor} if cursor else {})},
            ).json()
            rows += page["items"]
            cursor = page["next_cursor"]
            if cursor is None:
                break
        store = open_store(str(db))
        with store.read() as conn:
            written = conn.execute(
                select(func.count()).select_from(journal).where(journal.c.strategy_id == sid)
            ).scalar()
        assert len(rows) == written == 12 * 6  # five states and complete, each once
        assert len({(r["step"], r["to"]) for r in rows}) == len(rows)

        checked = http.get("/v1/check").json()
        assert checked["ok"] is True and checked["violations"] == []
    assert server.proc.returncode == 0
    said = "".join(server.lines)
    assert "leases handed back" in said and "API stopped" in said
    assert run_fleetwave(db, "check").returncode == 0


def test_no_engine_serves_the_api_and_drives_nothing(tmp_path: Path) -> None:
    db = _init(tmp_path)
    assert run_fleetwave(db, "target", "add", "a1").returncode == 0
    token = new_token(db, "operator")
    with serving(db, "--no-engine") as server, server.client(token) as http:
        sid = http.post("/v1/strategies", json={"workflow": "patch", "all": True}).json()["id"]
        answer = http.post(f"/v1/strategies/{sid}/apply").json()
        assert answer["driven_by"].startswith("nobody")
        time.sleep(1.0)
        shown = http.get(f"/v1/strategies/{sid}").json()
        assert shown["state"] == "applying" and shown["step_states"] == {"initial": 1}
    assert server.proc.returncode == 0
    assert "conductor" not in "".join(server.lines)


def test_serve_options_that_cannot_work_are_refused(tmp_path: Path) -> None:
    db = _init(tmp_path)
    res = run_fleetwave(db, "serve", "--no-engine")
    assert res.returncode == 2 and "--no-engine: only with --listen" in res.stderr
    res = run_fleetwave(db, "serve", "--listen", "8080")
    assert res.returncode == 2 and "--listen: expected HOST:PORT" in res.stderr
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        res = run_fleetwave(db, "serve", "--listen", f"127.0.0.1:{port}")
    assert res.returncode == 2 and "--listen: cannot listen on" in res.stderr


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs openssl for a certificate")
def test_tls_serves_the_api_over_https(tmp_path: Path) -> None:
    db = _init(tmp_path)
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    made = subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
         "-keyout", str(key), "-out", str(cert)],
        capture_output=True,
    )  # fmt: skip
    assert made.returncode == 0, made.stderr
    token = new_token(db, "reader")
    tls = ("--tls-cert", str(cert), "--tls-key", str(key))
    with serving(db, "--no-engine", *tls) as server:
        assert server.base.startswith("https://127.0.0.1:")
        with server.client(token, verify=ssl.create_default_context(cafile=cert)) as http:
            assert http.get("/v1/strategies").json() == {"items": [], "next_cursor": None}
    res = run_fleetwave(db, "serve", "--listen", "127.0.0.1:0", "--tls-cert", str(cert))
    assert res.returncode == 2 and "give both" in res.stderr
    res = run_fleetwave(
        db, "serve", "--listen", "127.0.0.1:0", "--tls-cert", str(key), "--tls-key", str(key)
    )
    assert res.returncode == 2 and "not a certificate and its key" in res.stderr
    res = run_fleetwave(db, "serve", *tls)
    assert res.returncode == 2 and "only with --listen" in res.stderr


def test_readyz_says_not_ready_for_a_schema_this_fleetwave_does_not_have(tmp_path: Path) -> None:
    db = _init(tmp_path)
    with in_process(db) as http:
        assert http.get("/readyz").json()["ok"] is True
        store = open_store(str(db))
        with store.write() as conn:
            conn.exec_driver_sql("UPDATE alembic_version SET version_num = '0009'")
        store.dispose()
        answer = http.get("/readyz")
        assert answer.status_code == 503
        assert answer.json()["error"]["code"] == "not_ready"
        assert "schema revision 0009" in answer.json()["error"]["message"]
        assert http.get("/healthz").status_code == 200  # (alive all the same)


def _children(pid: int) -> list[int]:
    """The processes ``pid`` started (still running)."""
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        found += [int(c) for c in (task / "children").read_text().split()]
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def test_the_api_is_served_from_a_process_of_its_own_that_stops_with_serve(
    tmp_path: Path,
) -> None:
    db = _init(tmp_path)
    assert run_fleetwave(db, "target", "add", "a1").returncode == 0
    token = new_token(db, "operator")
    with serving(db) as server, server.client(token) as http:
        api = [
            c
            for c in _children(server.proc.pid)
            if b"multiprocessing.spawn" in Path(f"/proc/{c}/cmdline").read_bytes()
        ]
        assert len(api) == 1
        sid = http.post("/v1/strategies", json={"workflow": "patch", "all": True}).json()["id"]
        http.post(f"/v1/strategies/{sid}/apply")
        deadline = time.monotonic() + 60
        while http.get(f"/v1/strategies/{sid}").json()["state"] != "complete":
            assert time.monotonic() < deadline
            time.sleep(0.1)
        # the engine's counts, asked of the engine's process
        assert "fleetwave_transitions_total{" in http.get("/metrics").text
    assert server.proc.returncode == 0
    assert "API stopped" in "".join(server.lines)
    assert not _alive(api[0])


def test_one_process_serves_the_api_on_the_engines_loop(tmp_path: Path) -> None:
    db = _init(tmp_path)
    token = new_token(db, "reader")
    with serving(db, "--one-process") as server, server.client(token) as http:
        assert _children(server.proc.pid) == []
        assert "fleetwave_steps_in_flight" in http.get("/metrics").text
    assert server.proc.returncode == 0
