"""Count the instructions one rollout costs the conductor's event loop (valgrind).

Timed runs on a shared virtual machine move by a fifth from one minute to the next, so
a change of a few percent of CPU cannot be seen in them without dozens of interleaved
pairs. The instructions the run's event loop executes do not depend on the machine's
speed or on other load: the same code counts the same to within about 1 %. This script
sets up a strategy the way ``bench.py`` does, then drives it under
``valgrind --tool=callgrind`` with collection on only inside libuv's loop (the run
itself, not the setup or the imports), and prints the count::

    .venv/bin/python bench/instructions.py                   # 1,000 targets, commits of 10
    .venv/bin/python bench/instructions.py --targets 2000 --batch-max 128 --sync FULL

The defaults mimic the ``io_bound`` scenario's commits (about 600 of 10 transitions)
with a 1 us latency, so that a run takes about a minute under valgrind; the store is
at ``synchronous=OFF`` (an fsync costs no instructions, only time). Compare two
versions of the code by running this from each checkout. Needs valgrind (Debian's
``valgrind`` package); it is a developer's tool, not a benchmark with a goal.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path


def _child(args: argparse.Namespace) -> None:
    """Set up and drive one strategy (run under valgrind by the parent)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import bench  # the benchmark's own setup
    from fleetwave.engine import loop as event_loop
    from fleetwave.engine.conductor import Conductor, EngineConfig
    from fleetwave.store.db import open_store

    spec = bench.RunSpec(
        targets=args.targets, max_parallel=args.max_parallel, latency_ms=args.latency_ms
    )
    with tempfile.TemporaryDirectory(prefix="fleetwave-instr-") as tmp:
        db = str(Path(tmp) / "instr.db")
        setup = bench.child_setup(db, spec)
        store = open_store(db, synchronous=args.sync)
        conductor = Conductor(store, config=EngineConfig(batch_max=args.batch_max))
        final = event_loop.run(conductor.run(strategy_ids=[setup["sid"]]))
        store.dispose()
    print(
        json.dumps(
            {
                "final": final.get(setup["sid"]),
                "transitions": conductor.stats.transitions,
                "batches": conductor.stats.batches,
            }
        )
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--targets", type=int, default=1000)
    parser.add_argument("--max-parallel", type=int, default=200)
    parser.add_argument("--latency-ms", type=float, default=0.001)
    parser.add_argument("--batch-max", type=int, default=10)
    parser.add_argument("--sync", default="OFF", choices=["OFF", "NORMAL", "FULL"])
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(args)
        return 0
    valgrind = shutil.which("valgrind")
    if valgrind is None:
        print("instructions: valgrind is not installed (Debian: apt install valgrind)")
        return 2
    with tempfile.TemporaryDirectory(prefix="fleetwave-instr-") as tmp:
        out = Path(tmp) / "callgrind.out"
        cmd = [
            valgrind,
            "--tool=callgrind",
            "--toggle-collect=uv_run",  # inside the event loop only
            f"--callgrind-out-file={out}",
            sys.executable,
            str(Path(__file__).resolve()),
            "--child",
            *sys.argv[1:],
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    found = re.search(r"Collected : (\d+)", proc.stderr)
    if proc.returncode != 0 or found is None:
        sys.stderr.write(proc.stderr[-2000:])
        print("instructions: the run under valgrind failed")
        return 1
    run = json.loads(proc.stdout.strip().splitlines()[-1])
    total = int(found.group(1))
    per = total / max(run["transitions"], 1)
    print(
        f"{total:,} instructions in the event loop; {run['transitions']:,} transitions in "
        f"{run['batches']:,} commits ({per:,.0f} a transition); strategy {run['final']}"
    )
    print(f"command: {' '.join(sys.argv)}; python {sys.version.split()[0]}; {os.uname().machine}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
