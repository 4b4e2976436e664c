"""``fleetwave serve --log-format json``: every line on stderr is one JSON object
(time, level, logger, message), with the strategy, step and target where the log call
knows them, as log shippers read it."""

from __future__ import annotations

import json
import time
from pathlib import Path

from api_harness import new_token, serving
from cli_harness import Cli


def test_every_line_is_one_json_object_with_the_ids(cli: Cli, db_path: Path) -> None:
    assert cli("target", "add", "ok1", "--set", "latency_ms=2").code == 0
    assert cli("target", "add", "bad1", "--set", "fail_at=finishing").code == 0
    assert cli("strategy", "create", "--workflow", "patch", "--all").code == 0
    assert cli("strategy", "apply", "1").code == 0
    token = new_token(db_path, "reader")
    with serving(db_path, "--log-format", "json", env={"FLEETWAVE_LOG": "info"}) as server:
        with server.client(token) as http:
            deadline = time.monotonic() + 60
            while http.get("/v1/strategies/1").json()["state"] != "failed":
                assert time.monotonic() < deadline
                time.sleep(0.1)
        assert server.stop() == 0
    lines = [json.loads(line) for line in server.lines]
    assert lines and all({"time", "level", "logger", "message"} <= set(entry) for entry in lines), (
        server.lines
    )
    assert all(entry["time"].endswith("Z") and "T" in entry["time"] for entry in lines)
    failed = [e for e in lines if "failed: finishing" in e["message"]]
    assert len(failed) == 1, lines
    assert failed[0]["level"] == "warning"
    assert failed[0]["logger"] == "fleetwave.engine.outcomes"
    assert (failed[0]["strategy"], failed[0]["target"]) == (1, "bad1")
    assert isinstance(failed[0]["step"], int)
    # what the command itself says (where it serves, that it stopped), in the same form
    assert any("API on http://127.0.0.1:" in e["message"] for e in lines)
    assert lines[-1]["message"].endswith("stopped; leases handed back")


def test_an_unknown_log_format_is_refused(cli: Cli) -> None:
    res = cli("serve", "--log-format", "xml")
    assert res.code == 2 and res.err.startswith("error: "), res.text
    assert "--log-format" in res.err and "xml" in res.err
