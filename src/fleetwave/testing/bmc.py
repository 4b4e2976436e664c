"""sushy-tools' Redfish emulator (``sushy-emulator --fake``) on a free loopback port,
serving fake systems behind basic auth, for the redfish driver's tests and benchmark.

    bmc = FakeBmc.start(tmp_dir, nodes=5, password="...")
    bmc.system_id(1)        # "/redfish/v1/Systems/00000001-0000-0000-0000-000000000000"
    bmc.system(1)           # the system as the BMC shows it (JSON)
    bmc.stop()

Its fake systems apply a power action 1 to 11 s after it is asked (sushy-tools' own
pacing: ``int(now) + randint(1, 11)``), or 1 to ``max_delay_s`` (``start``'s, for
tests that need not wait on it); :meth:`FakeBmc.pending_power` reads the emulator's
state file for the moment each one lands.
"""

from __future__ import annotations

import pickle
import shutil
import socket
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

#: the system a node of index ``i`` (from 1) is
SYSTEM_PREFIX = "/redfish/v1/Systems/"


#: the longest a fake system takes to apply a power action (sushy-tools' pacing), seconds
MAX_DELAY_S = 11

#: ``sushy-emulator`` with its fake driver's delay drawn from 1 to ``most`` s, not 1 to 11
_CAPPED_DELAY = """\
import random
import sys

from sushy_tools.emulator.resources.systems import fakedriver


class Capped(random.Random):
    def randint(self, a, b):
        return super().randint(a, min(b, {most}))


fakedriver.random = Capped()
from sushy_tools.emulator.main import main

sys.exit(main())
"""


def node_uuid(index: int) -> str:
    """The fake system's UUID of node ``index`` (1, 2, ...)."""
    return f"{index:08d}-0000-0000-0000-000000000000"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class FakeBmc:
    """A running ``sushy-emulator --fake``, its systems ``node-1`` ... ``node-N`` powered on."""

    def __init__(self, proc: subprocess.Popen[bytes], port: int, tmp: Path, password: str) -> None:
        import httpx

        self.proc = proc
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.log = tmp / "emulator.log"
        self.state = tmp / "state" / "fakedriver.sqlite"
        self.http = httpx.Client(base_url=self.url, auth=("admin", password), timeout=10)

    @classmethod
    def start(
        cls, tmp: Path, *, nodes: int, password: str, max_delay_s: int = MAX_DELAY_S
    ) -> FakeBmc:
        """Start it with ``nodes`` fake systems (user ``admin``), and wait until it serves.
        Its power actions land 1 to ``max_delay_s`` s after they are asked (sushy-tools'
        own 11 s at most unless lower: the emulator then runs with its fake driver's
        random delay capped)."""
        import bcrypt
        import httpx

        port = _free_port()
        auth = tmp / "htpasswd"
        # The fewest bcrypt rounds: the emulator checks the password of every request
        # (basic auth), and at bcrypt's default (12 rounds, ~0.3 s of CPU) it served
        # two requests a second on this machine: the benchmark measured the hash.
        salt = bcrypt.gensalt(rounds=4)
        auth.write_text(f"admin:{bcrypt.hashpw(password.encode(), salt).decode()}\n")
        systems = [
            {"uuid": node_uuid(i), "name": f"node-{i}", "power_state": "On"}
            for i in range(1, nodes + 1)
        ]
        config = tmp / "emulator.conf"
        config.write_text(
            f"SUSHY_EMULATOR_FAKE_SYSTEMS = {systems!r}\n"
            f"SUSHY_EMULATOR_AUTH_FILE = {str(auth)!r}\n"
            f"SUSHY_EMULATOR_STATE_DIR = {str(tmp / 'state')!r}\n"
        )
        exe = Path(sys.executable).parent / "sushy-emulator"
        if max_delay_s < MAX_DELAY_S:
            command = [sys.executable, "-c", _CAPPED_DELAY.format(most=max(1, int(max_delay_s)))]
        else:
            command = [str(exe if exe.exists() else shutil.which("sushy-emulator"))]
        with (tmp / "emulator.log").open("w") as out:
            proc = subprocess.Popen(
                [
                    *command,
                    *("--config", str(config), "-i", "127.0.0.1", "-p", str(port), "--fake"),
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        bmc = cls(proc, port, tmp, password)
        deadline = time.monotonic() + 30
        while True:
            try:
                if bmc.http.get("/redfish/v1/").status_code == 200:
                    return bmc
            except httpx.TransportError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                bmc.stop()
                raise RuntimeError(f"sushy-emulator did not start: {bmc.log.read_text()}")
            time.sleep(0.1)

    @staticmethod
    def system_id(index: int) -> str:
        return SYSTEM_PREFIX + node_uuid(index)

    def system(self, index: int) -> dict[str, Any]:
        r = self.http.get(self.system_id(index))
        if r.status_code != 200:
            raise RuntimeError(f"the BMC answered {r.status_code} for node {index}: {r.text}")
        return dict(r.json())

    def pending_power(self) -> dict[str, tuple[str, float]]:
        """Per system UUID, the power action it has not applied yet, as (the state it
        goes to, the time it lands): read from the emulator's state file."""
        out: dict[str, tuple[str, float]] = {}
        with sqlite3.connect(f"file:{self.state}?mode=ro", uri=True, timeout=5) as conn:
            for key, value in conn.execute("select key, value from cache"):
                # (pickles the emulator itself wrote, in a directory of ours)
                system = pickle.loads(value)
                pending = system.get("pending_power") if isinstance(system, dict) else None
                if pending:
                    out[str(pickle.loads(key))] = (
                        str(pending["power_state"]),
                        float(pending["apply_time"]),
                    )
        return out

    def stop(self) -> None:
        self.http.close()
        if self.proc.poll() is None:
            self.proc.terminate()
        self.proc.wait(timeout=10)
