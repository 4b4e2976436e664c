"""Files through the API, on a real ``fleetwave serve --listen``: a YAML workflow
validated (``POST /v1/workflows/validate``: ok, or the problem) and added (``POST
/v1/workflows``, an admin's token), and targets imported from CSV, YAML or JSON (``POST
/v1/targets/import``, an operator's). ``fleetwave --url ... workflow validate|add`` and
``target import`` go through them, and print what they print on a database, errors
included."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import select

from api_harness import Server, new_token, serving
from cli_harness import Cli
from fleetwave.store.db import open_store
from fleetwave.store.schema import events
from test_cli_workflow import GOOD, write

YAML = {"Content-Type": "application/yaml"}


@pytest.fixture
def server(db_path: Path) -> Iterator[Server]:
    with serving(db_path, "--no-engine") as running:
        yield running


@pytest.fixture
def local(db_path: Path, tmp_path: Path, migrated_db: Path) -> Path:
    """Another database, for the same commands run on a database rather than a server."""
    other = tmp_path / "local.db"
    shutil.copyfile(migrated_db, other)
    return other


def _tokens(db_path: Path) -> dict[str, str]:
    return {role: new_token(db_path, role, f"{role}-1") for role in ("reader", "operator", "admin")}


def _alike(
    cli: Cli, server: Server, local: Path, token: str, monkeypatch: pytest.MonkeyPatch, *args: str
) -> tuple[int, str]:
    """The command through the server prints what it prints on a database (same exit,
    same stdout and stderr), as JSON and as text; its exit code and JSON."""
    monkeypatch.setenv("FLEETWAVE_TOKEN", token)
    said: list[tuple[int, str]] = []
    for fmt in ("json", "table"):
        here = cli(*args, "--format", fmt, db=local)
        through = cli("--url", server.base, *args, "--format", fmt, db=None)
        assert (through.code, through.out, through.err) == (here.code, here.out, here.err), args
        said.append((through.code, through.out))
    return said[0]


def test_a_workflow_validated_and_added_through_the_server(
    cli: Cli,
    server: Server,
    db_path: Path,
    local: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    tokens = _tokens(db_path)
    good = write(tmp_path, GOOD, "site.yaml")
    bad = write(tmp_path, GOOD.replace("timeout_s: 30", "timeout_s: -1"), "bad.yaml")
    builtin = write(tmp_path, GOOD.replace("name: site-patch", "name: patch"), "p.yaml")
    newer = write(tmp_path, GOOD.replace("timeout_s: 30", "timeout_s: 31"), "same-v3.yaml")

    # validate: a reader may; the problem or ok, and what add would do
    with server.client(tokens["reader"]) as http:
        ok = http.post("/v1/workflows/validate?source=site.yaml", content=GOOD, headers=YAML)
        assert ok.status_code == 200, ok.text
        assert ok.json() == {
            "ok": True,
            "file": "site.yaml",
            "name": "site-patch",
            "version": 3,
            "states": ["check", "apply", "verify"],
            "add_would": "store",
            "stored_version": None,
        }
        wrong = http.post("/v1/workflows/validate", content=bad.read_text(), headers=YAML)
        assert wrong.status_code == 200
        assert wrong.json()["ok"] is False
        assert (
            wrong.json()["problem"]
            == "body: states[0] (check): timeout_s: must be more than 0, got -1"
        )
        assert http.post("/v1/workflows", content=GOOD).status_code == 403
    for f in (good, bad, builtin):
        _alike(cli, server, local, tokens["reader"], monkeypatch, "workflow", "validate", str(f))

    # add: an admin's; then stored as on a database, and listed by the server
    with server.client(tokens["operator"]) as http:
        refused = http.post("/v1/workflows", content=GOOD, headers=YAML)
        assert refused.status_code == 403
        assert "needs the admin role" in refused.json()["error"]["message"]
    code, out = _alike(
        cli, server, local, tokens["admin"], monkeypatch, "workflow", "add", str(good)
    )
    assert code == 0 and json.loads(out)["stored"] is True
    for f in (good, newer, builtin, bad):
        _alike(cli, server, local, tokens["admin"], monkeypatch, "workflow", "add", str(f))
        _alike(cli, server, local, tokens["admin"], monkeypatch, "workflow", "validate", str(f))
    with server.client(tokens["admin"]) as http:
        again = http.post("/v1/workflows?source=site.yaml", content=GOOD, headers=YAML)
        assert (again.status_code, again.json()["stored"]) == (200, False)
        clash = http.post("/v1/workflows?source=same-v3.yaml", content=newer.read_text())
        assert clash.status_code == 409, clash.text
        assert clash.json()["error"]["message"].startswith("same-v3.yaml: ")
        listed = {w["name"]: w for w in http.get("/v1/workflows").json()["items"]}
        assert listed["site-patch"]["source"] == "yaml"
        assert listed["site-patch"]["version"] == 3
    # who stored it, on the record (an event of no strategy)
    assert _changes(db_path) == ["workflow site-patch v3 stored by api:admin-1"]


CSV = "name,group,driver,latency_ms\nn1,,sim,5\nn2,,sim,7\n"
TARGETS_YAML = "targets:\n  - name: y1\n    labels: {ring: a}\n  - name: y2\n    managed: false\n"


def test_targets_imported_through_the_server(
    cli: Cli,
    server: Server,
    db_path: Path,
    local: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    tokens = _tokens(db_path)
    with server.client(tokens["operator"]) as http:
        imported = http.post(
            "/v1/targets/import?source=fleet.csv",
            content=CSV,
            headers={"Content-Type": "text/csv"},
        )
        assert imported.status_code == 200, imported.text
        assert imported.json() == {
            "file": "fleet.csv",
            "imported": 2,
            "unchanged": 0,
            "managed_kept": [],
        }
        as_yaml = http.post("/v1/targets/import", content=TARGETS_YAML, headers=YAML)
        assert as_yaml.json()["imported"] == 2
        as_json = http.post(
            "/v1/targets/import",
            json=[{"name": "j1"}, {"name": "n1", "settings": {"latency_ms": 5}}],
        )
        assert as_json.json() == {"file": "body", "imported": 1, "unchanged": 1, "managed_kept": []}
        shown = http.get("/v1/targets/n2").json()
        assert shown["settings"] == {"latency_ms": 7}
        assert http.get("/v1/targets/y1").json()["labels"] == {"ring": "a"}
        assert http.get("/v1/targets/y2").json()["managed"] is False
        # refused, nothing written
        unsure = http.post("/v1/targets/import", content=CSV)
        assert unsure.status_code == 422
        assert unsure.json()["error"]["field"] == "Content-Type"
        broken = http.post(
            "/v1/targets/import?format=csv&source=x.csv",
            content="name,colour\nz1,red\nz1,blue\n",
            headers={"Content-Type": "text/plain"},
        )
        assert broken.status_code == 422, broken.text
        assert broken.json()["error"]["message"].startswith("x.csv")
        names = [t["name"] for t in http.get("/v1/targets").json()["items"]]
        assert names == ["j1", "n1", "n2", "y1", "y2"]
    with server.client(tokens["reader"]) as http:
        assert (
            http.post(
                "/v1/targets/import", content=CSV, headers={"Content-Type": "text/csv"}
            ).status_code
            == 403
        )

    # the command through the server, as on a database: a file imported, again, refused
    fleet = write(tmp_path, CSV.replace("n1", "m1").replace("n2", "m2"), "fleet.csv")
    yml = write(tmp_path, TARGETS_YAML.replace("y1", "w1").replace("y2", "w2"), "more.yaml")
    dup = write(tmp_path, "name\nd1\nd1\n", "dup.csv")
    notutf = tmp_path / "latin.csv"
    notutf.write_bytes("name\ncaf\xe9\n".encode("latin-1"))
    for f in (fleet, yml, dup, notutf, tmp_path / "none.csv", tmp_path / "fleet.txt"):
        _alike(cli, server, local, tokens["operator"], monkeypatch, "target", "import", str(f))
    monkeypatch.setenv("FLEETWAVE_TOKEN", tokens["operator"])
    listed = cli("--url", server.base, "target", "list", "--format", "json", db=None)
    assert {"m1", "m2", "w1", "w2"} <= {t["name"] for t in listed.json()}
    assert "d1" not in {t["name"] for t in listed.json()}
    changes = _changes(db_path)
    assert changes[0] == "2 targets added ('n1', 'n2') by api:operator-1"
    assert len(changes) == 5, changes  # (three here, two by the command through the server)


def _changes(db: Path) -> list[str]:
    store = open_store(str(db))
    try:
        with store.read() as conn:
            return list(
                conn.execute(
                    select(events.c.details)
                    .where(events.c.kind == "change-by")
                    .order_by(events.c.id)
                ).scalars()
            )
    finally:
        store.dispose()
