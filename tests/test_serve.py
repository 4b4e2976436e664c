"""``fleetwave serve`` drives applied strategies; ``apply --wait`` elsewhere waits for
the end (and takes over only if the owner dies)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

from sqlalchemy import select

from fleetwave.store.db import open_store
from fleetwave.store.schema import conductors, steps
from fleetwave.testing.invariants import check

FLEETWAVE = [sys.executable, "-m", "fleetwave.cli.main"]


def _cli(db: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*FLEETWAVE, *args, "--db", db], capture_output=True, text=True, timeout=120
    )


def test_serve_drives_apply_and_a_second_process_only_watches(tmp_path: Path) -> None:
    db = str(tmp_path / "serve.db")
    assert _cli(db, "init").returncode == 0
    csv = tmp_path / "fleet.csv"
    csv.write_text(
        "name,latency_ms\n" + "".join(f"s{i:03d},100\n" for i in range(60)), encoding="utf-8"
    )
    assert _cli(db, "target", "import", str(csv)).returncode == 0
    created = _cli(
        db,
        "strategy",
        "create",
        "--workflow",
        "patch",
        "--all",
        "--max-parallel",
        "10",
        "--format",
        "json",
    )
    sid = json.loads(created.stdout)["id"]

    serve = subprocess.Popen(
        [*FLEETWAVE, "serve", "--db", db],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        applied = _cli(db, "strategy", "apply", str(sid))
        assert applied.returncode == 0, applied.stderr
        assert "applying" in applied.stdout
        owner = None
        deadline = time.monotonic() + 20
        while owner is None and time.monotonic() < deadline:
            shown = _cli(db, "strategy", "show", str(sid), "--format", "json")
            owner = json.loads(shown.stdout)["owner"]
            time.sleep(0.1)
        assert owner is not None, "serve should claim the applied strategy"
        assert json.loads(shown.stdout)["driven_by"] == f"conductor {owner}"
        # A second process asks to drive it too: it must only wait on the live owner.
        waited = _cli(db, "strategy", "apply", str(sid), "--wait", "--format", "json")
        assert waited.returncode == 0, waited.stderr
        assert json.loads(waited.stdout)["state"] == "complete"
    finally:
        serve.send_signal(signal.SIGTERM)
        _out, err = serve.communicate(timeout=30)
    assert serve.returncode == 0, err
    assert "leases handed back" in err

    store = open_store(db)
    with store.read() as conn:
        drivers = {r[0] for r in conn.execute(select(steps.c.owner)) if r[0]}
        live = conn.execute(select(conductors.c.id, conductors.c.stopped_at)).all()
        serves_all = dict(conn.execute(select(conductors.c.id, conductors.c.serves_all)).all())
    # Both processes registered as conductors, but the journal shows one drove it.
    hist = json.loads(_cli(db, "history", "--strategy", str(sid), "--format", "json").stdout)
    assert {h["conductor"] for h in hist} == {owner}
    assert drivers == set()
    assert all(stopped is not None for _, stopped in live)
    # serve drives every strategy; apply --wait only its own (so it does not count as
    # serving the database when another strategy is applied)
    assert serves_all == {owner: True} | {c: False for c in serves_all if c != owner}
    assert len(serves_all) == 2
    assert check(store, sid).ok
    store.dispose()
