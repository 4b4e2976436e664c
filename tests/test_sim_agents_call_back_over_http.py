"""The simulated fleet's agents report over HTTP when their targets have a
``callback_url``: ``POST /v1/steps/{step}/callbacks`` with the agent token the engine
issued to the waiting state, each report with its own idempotency key. The built-in
``clean`` workflow over sim targets runs to the end under a real ``fleetwave serve
--listen`` process, its callbacks stored through the API (their keys are the agents'),
applied, and on record; a duplicate report is ignored with the reason; bad URLs are
refused naming the setting."""

from __future__ import annotations

import json
import time
from collections import Counter
from pathlib import Path

from sqlalchemy import select

from api_harness import new_token, run_fleetwave, serving
from fleetwave.store.callbacks import callback_outcomes
from fleetwave.store.db import open_store
from fleetwave.store.schema import callbacks, events

WAITING = ("wait-for-agent", "clean-steps")


def test_the_clean_workflow_over_sim_targets_completes_with_agents_calling_back_over_http(
    tmp_path: Path,
) -> None:
    db = tmp_path / "fleet.db"
    assert run_fleetwave(db, "init").returncode == 0
    reader = new_token(db, "reader")
    with serving(db) as server, server.client(reader) as http:
        rows = [f"n{i},20,{server.base},0" for i in range(6)]
        # its agents report each state twice: its clean-steps report is "done", then a
        # contradicting "failed" 1.8 times as late. At 20 ms a state that was 22 ms, and
        # on a loaded machine the two requests sometimes arrived the other way round (the
        # step failed); at 600 ms they are 0.66 s apart.
        rows.append(f"dup,600,{server.base},1")
        fleet = tmp_path / "fleet.csv"
        fleet.write_text(
            "name,latency_ms,callback_url,callback_dup_rate\n" + "\n".join(rows) + "\n"
        )
        assert run_fleetwave(db, "target", "import", str(fleet)).returncode == 0
        made = run_fleetwave(
            db, "strategy", "create", "--workflow", "clean", "--all", "--format", "json"
        )
        assert made.returncode == 0, made.stderr
        sid = json.loads(made.stdout)["id"]
        # applied from another process: the conductor in `serve` drives it
        assert run_fleetwave(db, "strategy", "apply", str(sid)).returncode == 0
        deadline = time.monotonic() + 90
        state = ""
        while time.monotonic() < deadline:
            state = http.get(f"/v1/strategies/{sid}").json()["state"]
            if state in ("complete", "failed", "aborted"):
                break
            time.sleep(0.2)
        assert state == "complete", "".join(server.lines)
        metrics = http.get("/metrics").text
    assert server.proc.returncode == 0

    outcomes = callback_outcomes(open_store(str(db)), sid)
    # every target's two waiting states: one report each, applied; the duplicates ignored
    reports = [o for o in outcomes if o["kind"] != "heartbeat"]
    applied = Counter(o["state"] for o in reports if o["outcome"] == "applied")
    assert applied == {state: 7 for state in WAITING}, outcomes
    moved_by = {(o["step"], o["state"]): o["id"] for o in reports if o["outcome"] == "applied"}
    # (the "dup" target's second report on a state may be a heartbeat: applied only
    # when it came before that state's report, while the step still waited)
    beats = [o for o in outcomes if o["kind"] == "heartbeat" and o["outcome"] == "applied"]
    assert all(
        int(str(o["id"])) < moved_by[(o["step"], o["state"])]
        and str(o["reason"]).startswith("heartbeat")
        for o in beats
    ), outcomes
    # (the last one may come as its step ends: stored just before, taken up just after)
    ignored = [o for o in outcomes if o["outcome"] == "ignored"]
    assert len(ignored) + len(beats) == 2 and all(
        str(o["reason"]).startswith(("duplicate", "late", "its step is not under way"))
        for o in ignored
    ), outcomes
    store = open_store(str(db))
    with store.read() as conn:
        keys = (
            conn.execute(select(callbacks.c.idempotency_key).where(callbacks.c.strategy_id == sid))
            .scalars()
            .all()
        )
        refused = (
            conn.execute(select(events.c.details).where(events.c.kind == "callback-refused"))
            .scalars()
            .all()
        )
    # the agents' own keys: each came through the HTTP endpoint, with its token
    assert len(keys) == len(set(keys)) == 16
    assert all(str(k).startswith("sim:") for k in keys)
    assert refused == []
    accepted = [
        line for line in metrics.splitlines() if line.startswith("fleetwave_api_callbacks_total")
    ]
    assert any('"accepted"' in line and not line.endswith(" 0.0") for line in accepted), accepted

    # on record for the operator: each step's history shows the report that moved it on
    history = run_fleetwave(db, "history", "--strategy", str(sid), "--format", "json")
    assert history.returncode == 0, history.stderr
    moved = [r for r in json.loads(history.stdout) if r["from"] in WAITING]
    assert len(moved) == 14
    assert all(str(r["details"]).startswith(f"{r['from']} finished") for r in moved), moved[:2]
    assert run_fleetwave(db, "check").returncode == 0


def test_a_callback_url_that_is_not_a_url_is_refused_naming_the_setting(tmp_path: Path) -> None:
    db = tmp_path / "fleet.db"
    assert run_fleetwave(db, "init").returncode == 0
    for bad in ("ftp://host/", "not a url", "http://"):
        res = run_fleetwave(db, "target", "add", "n1", "--set", f"callback_url={bad}")
        assert res.returncode == 2, res.stderr
        assert "callback_url" in res.stderr and "not an http(s) URL" in res.stderr
    ok = run_fleetwave(db, "target", "add", "n1", "--set", "callback_url=http://127.0.0.1:8080/")
    assert ok.returncode == 0, ok.stderr
