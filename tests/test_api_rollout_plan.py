"""The rollout plan through the API, on a real ``fleetwave serve --listen``: ``POST
/v1/strategies`` takes every option ``strategy create`` takes (stages, batches,
canaries, thresholds in counts or percents, a wait or an approval between stages,
start time, windows, deadline) and stores what the command stores; ``dry_run`` answers
the command's ``--dry-run --format json`` and writes nothing; bad input is a 422
naming the body's field, with the command's own message. ``POST
/v1/strategies/{id}/approve`` (and ``fleetwave --url ... strategy approve``) records
the token's name as who approved."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from api_harness import Server, new_token, serving
from cli_harness import Cli

DAY = 86400.0


def _at(epoch: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%MZ", time.gmtime(epoch))


#: a start and a deadline, days ahead (a week apart: a weekly window opens between)
START = _at(time.time() + 2 * DAY)
DEADLINE = _at(time.time() + 12 * DAY)
#: the next Monday's first hours: a Saturday window never opens between them
_MONDAY = (time.time() // DAY + (4 - (time.time() // DAY)) % 7 + 7) * DAY  # (epoch day 0: Thu)


@pytest.fixture
def fleet(cli: Cli) -> None:
    """Groups a, b, c; a1 labelled ring=0; d1 in no group."""
    for g in ("a", "b", "c"):
        assert cli("group", "add", g).code == 0
    for name, group in (("a1", "a"), ("a2", "a"), ("b1", "b"), ("b2", "b"), ("c1", "c")):
        extra = ["--label", "ring=0"] if name == "a1" else []
        assert (
            cli("target", "add", name, "--group", group, "--set", "latency_ms=2", *extra).code == 0
        )
    assert cli("target", "add", "d1", "--set", "latency_ms=2").code == 0


@pytest.fixture
def server(fleet: None, db_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Server]:
    """The engine and the API; FLEETWAVE_TOKEN an operator's (named ops)."""
    monkeypatch.setenv("FLEETWAVE_TOKEN", new_token(db_path, "operator", "ops"))
    with serving(db_path) as running:
        yield running


def _ops(server: Server) -> httpx.Client:
    import os

    return server.client(os.environ["FLEETWAVE_TOKEN"])


# the same rollout, as the command's options and as the API's body
OPTIONS = [
    "--stage", "a", "--stage", "b,c", "--stage", "rest",
    "--stage-wait", "10m", "--stage-approval",
    "--canary", "1", "--canary-label", "ring=0",
    "--batches", "1,50%",
    "--max-failures", "20%", "--stage-max-failures", "1",
    "--start-after", START, "--window", "Sat 01:00-05:00 UTC", "--window", "Sun 01:00-05:00 UTC",
    "--deadline", DEADLINE, "--max-parallel", "3", "--timeout", "pre-check=60",
]  # fmt: skip
BODY: dict[str, Any] = {
    "stages": ["a", ["b", "c"], "rest"],
    "stage_wait": "10m",
    "stage_approval": True,
    "canary": 1,
    "canary_label": {"ring": "0"},
    "batches": [1, "50%"],
    "max_failures": "20%",
    "stage_max_failures": 1,
    "start_after": START,
    "windows": ["Sat 01:00-05:00 UTC", "Sun 01:00-05:00 UTC"],
    "deadline": DEADLINE,
    "max_parallel": 3,
    "timeouts": {"pre-check": 60},
}


def _shown(cli: Cli, sid: int) -> dict[str, Any]:
    res = cli("strategy", "show", str(sid), "--format", "json")
    assert res.code == 0, res.text
    shown: dict[str, Any] = res.json()
    return shown


def _stages(cli: Cli, sid: int) -> dict[str, Any]:
    res = cli("step", "list", "--strategy", str(sid), "--format", "json")
    assert res.code == 0, res.text
    return {s["target"]: s["stage"] for s in res.json()}


def test_a_strategy_made_through_the_api_is_the_one_the_command_makes(
    cli: Cli, server: Server
) -> None:
    made = cli("strategy", "create", "--workflow", "patch", "--all", *OPTIONS, "--format", "json")
    assert made.code == 0, made.text
    stages = _stages(cli, made.json()["id"])
    assert cli("strategy", "delete", "1").code == 0  # (its targets: free again)
    with _ops(server) as http:
        answer = http.post("/v1/strategies", json={"workflow": "patch", "all": True, **BODY})
    assert answer.status_code == 201, answer.text
    by_cli, by_api = made.json(), answer.json()
    assert by_api["id"] == by_cli["id"] + 1
    assert by_api == _shown(cli, by_api["id"])
    # the same plan and options, stored (its canary, stages and batches by phase)
    assert by_api["options"] == by_cli["options"]
    assert by_api["options"]["plan"] and by_api["options"]["stage_approval"] is True
    assert _stages(cli, by_api["id"]) == stages
    for key in ("max_failures", "max_parallel", "steps", "workflow"):
        assert by_api[key] == by_cli[key], key


def test_a_dry_run_answers_the_plan_and_writes_nothing(cli: Cli, server: Server) -> None:
    planned = cli(
        "strategy", "create", "--workflow", "patch", "--all", *OPTIONS, "--dry-run",
        "--format", "json",
    )  # fmt: skip
    assert planned.code == 0, planned.text
    with _ops(server) as http:
        answer = http.post(
            "/v1/strategies", json={"workflow": "patch", "all": True, **BODY, "dry_run": True}
        )
        assert answer.status_code == 200, answer.text
        assert answer.json() == planned.json()
        assert answer.json()["stages"][0]["canary"] is True
        assert http.get("/v1/strategies").json()["items"] == []
    # and the command through the server prints it as it does from the database
    for fmt in ("json", "table"):
        args = ("strategy", "create", "--workflow", "patch", "--all", *OPTIONS, "--dry-run")
        here = cli(*args, "--format", fmt)
        through = cli("--url", server.base, *args, "--format", fmt, db=None)
        assert (through.code, through.out) == (here.code, here.out), through.text


def test_the_command_creates_through_a_server_as_on_the_database(cli: Cli, server: Server) -> None:
    args = ("strategy", "create", "--workflow", "patch", "--group", "a", "--canary", "1")
    here = cli(*args)
    options = _shown(cli, 1)["options"]
    assert cli("strategy", "delete", "1").code == 0
    through = cli("--url", server.base, *args, db=None)
    assert (through.code, through.err) == (here.code, here.err)
    assert through.out == here.out.replace("strategy 1", "strategy 2").replace("apply 1", "apply 2")
    assert _shown(cli, 2)["options"] == options


_NEXT_MONDAY = [_at(_MONDAY), _at(_MONDAY + 6 * 3600)]

# (the command's options, the body's, the field named)
BAD: list[tuple[list[str], dict[str, Any], str]] = [
    (["--stage", "a", "--stage", "nope"], {"stages": ["a", "nope"]}, "stages"),
    (["--stage", "a", "--stage", "a,b"], {"stages": [["a"], ["a", "b"]]}, "stages"),
    (["--stage", "a", "--stage", ","], {"stages": ["a", ","]}, "stages"),
    (["--stage", "a", "--stages-by-group"], {"stages": ["a"], "stages_by_group": True}, "stages"),
    (["--batches", "0"], {"batches": "0"}, "batches"),
    (["--batches", "1,0"], {"batches": [1, 0]}, "batches"),
    (["--batches", "1,,2"], {"batches": "1,,2"}, "batches"),
    (["--max-failures", "150%"], {"max_failures": "150%"}, "max_failures"),
    (["--stage-max-failures", "101%"], {"stage_max_failures": "101%"}, "stage_max_failures"),
    (["--canary", "0"], {"canary": 0}, "canary"),
    (["--canary", "50"], {"canary": "50"}, "canary"),
    (["--canary", "1", "--canary-label", "ring=9"], {"canary": 1, "canary_label": {"ring": "9"}},
     "canary_label"),
    (["--stage-wait", "10m"], {"stage_wait": "10m"}, "stage_wait"),
    (["--stage", "a", "--stage", "b", "--stage-wait", "soon"],
     {"stages": ["a", "b"], "stage_wait": "soon"}, "stage_wait"),
    (["--stage-approval"], {"stage_approval": True}, "stage_approval"),
    (["--deadline", START, "--start-after", DEADLINE], {"deadline": START, "start_after": DEADLINE},
     "deadline"),
    (["--start-after", "tomorrow"], {"start_after": "tomorrow"}, "start_after"),
    (["--window", "Sat 01:00-05:00 UTC", "--start-after", _NEXT_MONDAY[0], "--deadline",
      _NEXT_MONDAY[1]],
     {"windows": ["Sat 01:00-05:00 UTC"], "start_after": _NEXT_MONDAY[0],
      "deadline": _NEXT_MONDAY[1]}, "windows"),
    (["--window", "someday"], {"windows": ["someday"]}, "windows"),
    (["--timeout", "nap=5"], {"timeouts": {"nap": 5}}, "timeouts"),
]  # fmt: skip


def test_bad_rollout_options_are_refused_as_the_command_refuses_them(
    cli: Cli, server: Server
) -> None:
    """Each of :data:`BAD` (one server for all: starting one takes seconds)."""
    with _ops(server) as http:
        for options, body, field in BAD:
            said = cli("strategy", "create", "--workflow", "patch", "--all", *options)
            assert said.code == 2 and said.err.startswith("error: "), (options, said.text)
            answer = http.post("/v1/strategies", json={"workflow": "patch", "all": True, **body})
            assert answer.status_code == 422, (body, answer.text)
            assert answer.json()["error"] == {
                "code": "invalid",
                "message": " ".join(said.err.removeprefix("error: ").split()),
                "field": field,
            }, body
        assert http.get("/v1/strategies").json()["items"] == []


def test_an_approval_through_the_api_is_recorded_with_the_tokens_name(
    cli: Cli, server: Server, db_path: Path
) -> None:
    reader = new_token(db_path, "reader", "watcher")
    with _ops(server) as http:
        made = http.post(
            "/v1/strategies",
            json={"workflow": "patch", "group": "a", "stages": ["a"], "canary": 1,
                  "stage_approval": True},
        )  # fmt: skip
        assert made.status_code == 201, made.text
        sid = made.json()["id"]
        early = http.post(f"/v1/strategies/{sid}/approve")
        assert early.status_code == 409
        assert early.json()["error"]["message"] == (
            f"strategy {sid}: is initial, not waiting for approval; nothing to approve"
        )
        assert http.post(f"/v1/strategies/{sid}/apply").status_code == 200
        _wait_for(http, sid, "waiting-approval")
        with server.client(reader) as read_only:
            assert read_only.post(f"/v1/strategies/{sid}/approve").status_code == 403
        by = cli("--url", server.base, "strategy", "approve", str(sid), "--by", "x", db=None)
        assert by.code == 2 and by.err.startswith("error: --by: through a server"), by.text
        approved = cli(
            "--url", server.base, "strategy", "approve", str(sid), "--format", "json", db=None
        )
        assert approved.code == 0, approved.text
        assert approved.json() == {
            "id": sid,
            "stage": 2,
            "approved_by": "api:ops",
            "details": "stage 2 of 2 (a) approved by api:ops",
        }
        _wait_for(http, sid, "complete")
        events = http.get(f"/v1/strategies/{sid}/events").json()["items"]
    said = [(e["kind"], e["details"]) for e in events]
    assert ("stage-approved", "stage 2 of 2 (a) approved by api:ops") in said
    assert ("change-by", f"strategy {sid} approved by api:ops") in said
    shown = _shown(cli, sid)
    assert [a["details"] for a in shown["approvals"]] == ["stage 2 of 2 (a) approved by api:ops"]


def _wait_for(http: httpx.Client, sid: int, state: str) -> None:
    deadline = time.monotonic() + 60
    while True:
        now = http.get(f"/v1/strategies/{sid}").json()["state"]
        if now == state:
            return
        assert time.monotonic() < deadline, f"strategy {sid} is {now}, not {state}"
        time.sleep(0.1)
