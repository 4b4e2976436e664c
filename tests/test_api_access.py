"""Access control of the REST API on a real server: bearer tokens with roles made by
``fleetwave token create`` (only a hash stored), 401 without a valid one, 403 for a
role that may not, and every change recorded with the token that made it."""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

from sqlalchemy import select

from api_harness import run_fleetwave, serving
from cli_harness import Cli, assert_rejected
from fleetwave.store.db import open_store
from fleetwave.store.schema import api_tokens, events


def _token(db: Path, role: str, name: str, *more: str) -> str:
    made = run_fleetwave(
        db, "token", "create", "--role", role, "--name", name, *more, "--format", "json"
    )
    assert made.returncode == 0, made.stderr
    answer = json.loads(made.stdout)
    assert answer["name"] == name and answer["role"] == role
    return str(answer["token"])


def test_roles_decide_what_a_token_may_do_and_changes_name_their_token(tmp_path: Path) -> None:
    db = tmp_path / "fleet.db"
    assert run_fleetwave(db, "init").returncode == 0
    reader = _token(db, "reader", "dash")
    operator = _token(db, "operator", "ci-bot")
    admin = _token(db, "admin", "ops")
    brief = _token(db, "reader", "brief", "--expires", "1s")

    # only hashes are stored, and the list never shows a token
    store = open_store(str(db))
    with store.read() as conn:
        stored = {r.name: r.hash for r in conn.execute(select(api_tokens))}
    assert stored["ci-bot"] == hashlib.sha256(operator.encode()).hexdigest()
    listed = run_fleetwave(db, "token", "list", "--format", "json")
    assert operator not in listed.stdout and stored["ci-bot"] not in listed.stdout
    assert [t["name"] for t in json.loads(listed.stdout)] == ["dash", "ci-bot", "ops", "brief"]

    with serving(db) as server:
        with server.client() as nobody:
            assert nobody.get("/healthz").status_code == 200
            assert nobody.get("/readyz").status_code == 200
            refused = nobody.get("/v1/targets")
            assert refused.status_code == 401
            assert refused.headers["WWW-Authenticate"].startswith("Bearer")
            assert refused.json()["error"]["code"] == "unauthorized"
        with server.client("fwa_not-a-token") as forged:
            assert forged.get("/v1/targets").status_code == 401
        time.sleep(1.1)
        with server.client(brief) as expired:
            assert expired.get("/v1/targets").status_code == 401

        with server.client(reader) as http:
            assert http.get("/v1/targets").status_code == 200
            denied = http.post("/v1/targets", json={"name": "a1"})
            assert denied.status_code == 403
            assert "dash (reader) may not do this" in denied.json()["error"]["message"]
            assert http.get("/v1/tokens").status_code == 403

        with server.client(operator) as http:
            assert http.post("/v1/targets", json={"name": "a1"}).status_code == 201
            sid = http.post("/v1/strategies", json={"workflow": "patch", "all": True}).json()["id"]
            assert http.post(f"/v1/strategies/{sid}/apply").status_code == 200
            assert http.post("/v1/strategies/99/pause").status_code == 404  # allowed, absent
            assert http.get("/v1/tokens").status_code == 403

        with server.client(admin) as http:
            names = [t["name"] for t in http.get("/v1/tokens").json()["items"]]
            assert names == ["dash", "ci-bot", "ops", "brief"]
            made = http.post("/v1/tokens", json={"name": "late", "role": "reader"})
            assert made.status_code == 201
            with server.client(made.json()["token"]) as late:
                assert late.get("/v1/strategies").status_code == 200
            revoked = http.post("/v1/tokens/ci-bot/revoke")
            assert revoked.json() == {"name": "ci-bot", "revoked": True, "revoked_now": True}

        with server.client(operator) as http:
            assert http.get("/v1/targets").status_code == 401  # revoked: at once

    # who made each change is on the record: the strategy's events, and the others
    shown = run_fleetwave(
        db, "events", "--strategy", str(sid), "--kind", "change-by", "--format", "json"
    )
    said = [e["details"] for e in json.loads(shown.stdout)]
    assert said == [
        f"strategy {sid} created (patch, 1 step) by api:ci-bot",
        f"strategy {sid} applied (it was initial) by api:ci-bot",
    ]
    with store.read() as conn:
        unscoped = conn.execute(
            select(events.c.details).where(
                events.c.kind == "change-by", events.c.strategy_id.is_(None)
            )
        ).scalars()
        assert list(unscoped) == [
            "1 target added ('a1') by api:ci-bot",
            "token late (reader) created by api:ops",
            "token ci-bot revoked by api:ops",
        ]
    store.dispose()


def test_token_commands_refuse_bad_input_and_write_nothing(cli: Cli) -> None:
    for args, words in (
        (("--role", "boss", "--name", "x"), ("--role", "boss")),
        (("--role", "reader", "--name", "two words"), ("--name",)),
        (("--role", "reader", "--name", "x", "--expires", "soon"), ("--expires", "90m")),
        (("--role", "reader", "--name", "x", "--expires", "0d"), ("--expires",)),
    ):
        assert_rejected(cli("token", "create", *args), *words)
    assert cli("token", "list", "--format", "json").json() == []
    assert cli("token", "create", "--role", "reader", "--name", "x").code == 0
    assert_rejected(cli("token", "create", "--role", "admin", "--name", "x"), "exists already")
    assert_rejected(cli("token", "revoke", "y"), "no token named 'y'")
    assert cli("token", "revoke", "x", "--format", "json").json()["revoked_now"] is True
    assert cli("token", "revoke", "x", "--format", "json").json()["revoked_now"] is False
