"""What one group commit costs on PostgreSQL: row by row (``executemany``) or as arrays.

The conductor's hot path writes a commit's transitions with one ``executemany`` a table
(psycopg sends them in one pipeline: a statement a row). This measures a commit of the
same shape (the write lock, N compare-and-set UPDATEs of ``steps``, N INSERTs into
``journal``, COMMIT) sent that way and sent as one ``UPDATE ... FROM unnest(...)`` and one
``INSERT ... SELECT FROM unnest(...)``, alternately, on a throw-away server (fsync on,
``synchronous_commit=on``): wall and client CPU per commit, and the server's execution
time (``pg_stat_statements``). An experiment, not a change to the product.

    .venv/bin/python bench/pg_statement_shapes.py [--rows 127] [--commits 40]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fleetwave.domain.models import StrategyOptions, Target
from fleetwave.domain.registry import get_workflow
from fleetwave.store import admin
from fleetwave.store.db import open_store
from fleetwave.store.postgres import WRITE_LOCK_KEY
from pg_throughput import (
    ROOT,
    SERVER_OPTS,
    _new_database,
    _stat_statements,
    _statements,
    _throw_away_server,
)

ROWS_SQL = (
    "UPDATE steps SET state = %s, fence = %s, owner = %s WHERE id = %s AND fence = %s "
    "AND state = %s"
)
JOURNAL_SQL = (
    "INSERT INTO journal (strategy_id, step_id, at, conductor, from_state, to_state, "
    "fence, details, visit) VALUES (%s, %s, %s, %s, %s, %s, %s, %s, 1)"
)
ARRAY_UPDATE_SQL = (
    "UPDATE steps AS s SET state = u.to_state, fence = u.fence, owner = %s "
    "FROM unnest(%s::int[], %s::int[], %s::text[], %s::text[]) "
    "AS u(id, fence, from_state, to_state) "
    "WHERE s.id = u.id AND s.fence = u.fence - 1 AND s.state = u.from_state"
)
ARRAY_JOURNAL_SQL = (
    "INSERT INTO journal (strategy_id, step_id, at, conductor, from_state, to_state, "
    "fence, details, visit) SELECT %s, u.id, %s, %s, u.from_state, u.to_state, u.fence, "
    "'', 1 FROM unnest(%s::int[], %s::int[], %s::text[], %s::text[]) "
    "AS u(id, fence, from_state, to_state)"
)


def _commit_rows(
    conn: psycopg.Connection[tuple[object, ...]], sid: int, chunk: list[tuple[int, int]], rnd: int
) -> None:
    cur = conn.cursor()
    cur.execute(f"BEGIN; SELECT pg_advisory_xact_lock({WRITE_LOCK_KEY})")
    frm, to = f"r{rnd}", f"r{rnd + 1}"
    cur.executemany(ROWS_SQL, [(to, f + 1, "me", i, f, frm) for i, f in chunk])
    assert cur.rowcount == len(chunk)
    now = time.time()
    cur.executemany(JOURNAL_SQL, [(sid, i, now, "me", frm, to, f + 1, "") for i, f in chunk])
    conn.commit()


def _commit_arrays(
    conn: psycopg.Connection[tuple[object, ...]], sid: int, chunk: list[tuple[int, int]], rnd: int
) -> None:
    cur = conn.cursor()
    cur.execute(f"BEGIN; SELECT pg_advisory_xact_lock({WRITE_LOCK_KEY})")
    frm, to = f"r{rnd}", f"r{rnd + 1}"
    ids = [i for i, _ in chunk]
    fences = [f + 1 for _, f in chunk]
    froms = [frm] * len(chunk)
    tos = [to] * len(chunk)
    cur.execute(ARRAY_UPDATE_SQL, ("me", ids, fences, froms, tos))
    assert cur.rowcount == len(chunk)
    cur.execute(ARRAY_JOURNAL_SQL, (sid, time.time(), "me", ids, fences, froms, tos))
    conn.commit()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=127, help="transitions a commit")
    parser.add_argument("--commits", type=int, default=40, help="commits of each shape")
    args = parser.parse_args()
    directory, base = _throw_away_server()
    try:
        url = _new_database(base)
        store = open_store(url)
        n = args.rows * args.commits * 2
        admin.add_targets(store, [Target(name=f"t{i:06d}") for i in range(n)])
        wf = get_workflow("patch")
        assert wf is not None
        sid = admin.create_strategy(store, wf, StrategyOptions(max_parallel=10), all_targets=True)
        store.dispose()
        with psycopg.connect(url, autocommit=True) as conn:
            ids = [
                int(r[0])
                for r in conn.execute(
                    "SELECT id FROM steps WHERE strategy_id = %s ORDER BY id", (sid,)
                )
            ]
            conn.execute("UPDATE steps SET state = 'r0', fence = 0")
            conn.execute("VACUUM ANALYZE steps")
            fence = dict.fromkeys(ids, 0)
            _stat_statements(url)
            figures: dict[str, list[tuple[float, float]]] = {"rows": [], "arrays": []}
            for rnd in range(3):  # three visits of each step, as a step makes its moves
                for c in range(args.commits * 2):
                    chunk = [(i, fence[i]) for i in ids[c * args.rows : (c + 1) * args.rows]]
                    shape = "rows" if (c + rnd) % 2 == 0 else "arrays"
                    wall, cpu = time.perf_counter(), time.process_time()
                    (_commit_rows if shape == "rows" else _commit_arrays)(conn, sid, chunk, rnd)
                    figures[shape].append((time.perf_counter() - wall, time.process_time() - cpu))
                    for i, _ in chunk:
                        fence[i] += 1
        stmts = _statements(url)
    finally:
        subprocess.run(["bash", str(ROOT / "scripts" / "pg.sh"), "stop", directory])
    print(
        f"{args.rows} transitions a commit, {len(figures['rows'])} commits of each shape; "
        f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f}; server {SERVER_OPTS}"
    )
    for shape, values in figures.items():
        walls = sorted(w for w, _ in values)
        cpus = sorted(c for _, c in values)
        print(
            f"{shape:7s} wall median {statistics.median(walls) * 1000:.2f} ms "
            f"(p90 {walls[int(0.9 * (len(walls) - 1))] * 1000:.2f}), client CPU median "
            f"{statistics.median(cpus) * 1000:.2f} ms a commit"
        )
    for st in stmts:
        if "steps" in st.query or "journal" in st.query:
            q = " ".join(st.query.split())[:60]
            print(f"  {st.calls:7,d} calls {st.exec_ms:9,.1f} ms server  {q}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
