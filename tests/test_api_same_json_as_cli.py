"""The API answers each read and each change as ``fleetwave ... --format json`` prints
it: one test per family of commands, on the same database."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from api_harness import in_process
from cli_harness import Cli


@pytest.fixture
def api(db_path: Path) -> Iterator[httpx.Client]:
    with in_process(db_path) as client:
        yield client


def _json(cli: Cli, *args: str) -> Any:
    res = cli(*args, "--format", "json")
    assert res.code in (0, 1), res.text
    return res.json()


def _all(api: httpx.Client, path: str, **params: Any) -> list[Any]:
    """Every page of a list, joined (pages of 2, to go through the cursors)."""
    rows: list[Any] = []
    cursor = None
    while True:
        answer = api.get(
            path, params={**params, "limit": 2, **({"cursor": cursor} if cursor else {})}
        )
        assert answer.status_code == 200, answer.text
        rows += answer.json()["items"]
        cursor = answer.json()["next_cursor"]
        if cursor is None:
            return rows


def _fleet(cli: Cli) -> int:
    assert cli("group", "add", "east", "--max-parallel", "2").code == 0
    for name in ("a1", "a2", "a3"):
        assert cli("target", "add", name, "--group", "east", "--label", "ring=1").code == 0
    assert cli("target", "add", "b1", "--set", "fail_at=finishing").code == 0
    made = _json(cli, "strategy", "create", "--workflow", "patch", "--all")
    assert cli("strategy", "apply", str(made["id"]), "--wait").code == 1  # b1 fails
    return int(made["id"])


def test_targets_and_groups_read_alike(cli: Cli, api: httpx.Client) -> None:
    _fleet(cli)
    assert _all(api, "/v1/targets") == _json(cli, "target", "list")
    assert _all(api, "/v1/targets", group="east", label="ring=1") == _json(
        cli, "target", "list", "--group", "east", "--label", "ring=1"
    )
    assert api.get("/v1/targets/a1").json() == _json(cli, "target", "show", "a1")
    assert api.get("/v1/groups").json()["items"] == _json(cli, "group", "list")
    assert api.get("/v1/groups/east").json() == _json(cli, "group", "show", "east")


def test_workflows_read_alike(cli: Cli, api: httpx.Client) -> None:
    assert api.get("/v1/workflows").json()["items"] == _json(cli, "workflow", "list")
    assert api.get("/v1/workflows/clean").json() == _json(cli, "workflow", "show", "clean")


def test_strategies_steps_history_events_and_check_read_alike(cli: Cli, api: httpx.Client) -> None:
    sid = _fleet(cli)
    assert _all(api, "/v1/strategies") == _json(cli, "strategy", "list")
    assert api.get(f"/v1/strategies/{sid}").json() == _json(cli, "strategy", "show", str(sid))
    steps = _json(cli, "step", "list", "--strategy", str(sid))
    assert _all(api, f"/v1/strategies/{sid}/steps") == steps
    assert _all(api, f"/v1/strategies/{sid}/steps", state="failed") == _json(
        cli, "step", "list", "--strategy", str(sid), "--state", "failed"
    )
    step = steps[-1]["step"]
    assert api.get(f"/v1/steps/{step}").json() == _json(cli, "step", "show", str(step))
    assert _all(api, f"/v1/strategies/{sid}/history") == _json(
        cli, "history", "--strategy", str(sid)
    )
    assert _all(api, f"/v1/strategies/{sid}/history", target="b1") == _json(
        cli, "history", "--strategy", str(sid), "--target", "b1"
    )
    assert _all(api, f"/v1/strategies/{sid}/events") == _json(cli, "events", "--strategy", str(sid))
    assert api.get("/v1/check").json() == _json(cli, "check")


def test_changes_answer_alike(cli: Cli, api: httpx.Client) -> None:
    assert cli("target", "add", "a1").code == 0
    made = api.post("/v1/strategies", json={"workflow": "patch", "all": True}).json()
    sid = str(made["id"])
    assert made == _json(cli, "strategy", "show", sid)
    # each change made, then asked again of the API and of the CLI: the same answer
    for verb in ("apply", "pause", "resume", "abort"):
        _json(cli, "strategy", verb, sid)
        by_api = api.post(f"/v1/strategies/{sid}/{verb}").json()
        assert by_api == _json(cli, "strategy", verb, sid), verb
    assert api.post("/v1/targets", json={"name": "a1"}).json() == _json(cli, "target", "add", "a1")
    assert cli("target", "add", "z9").code == 0
    assert api.post("/v1/targets/z9/unmanage").json() == _json(cli, "target", "unmanage", "z9")
    assert api.post("/v1/targets/z9/manage").json() == _json(cli, "target", "manage", "z9")
    changed = api.patch("/v1/targets/z9", json={"labels": {"ring": "2"}}).json()
    assert changed == {
        "name": "z9",
        "changed": True,
        "changes": {"labels": {"before": {}, "after": {"ring": "2"}}},
    }
    assert _json(cli, "target", "set", "z9", "--label", "ring=2")["changed"] is False
    assert api.delete("/v1/targets/z9").json() == {"name": "z9", "deleted": True}
    assert api.delete("/v1/targets/z9", params={"ignore_missing": "true"}).json() == _json(
        cli, "target", "delete", "z9", "--ignore-missing"
    )
