"""Run ``fleetwave`` commands as processes without paying its import each time.

Importing the command line takes most of a second; the manual's examples run dozens of
commands. A server imports it once and forks one child per command. The child is a
process of its own, as the console script's would be: its own arguments, working
directory, environment, stdin, stdout and stderr (passed over a Unix socket), and it
runs the console script's entry point (``fleetwave.cli.entry.run``), so what it prints
and its exit code are the command's. A ``fleetwave`` client script on the ``PATH``
forwards each command to the server.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import struct
import sys
from pathlib import Path

CLIENT = """\
#!{python} -S
# fleetwave, forwarded to the fork server at {sock} (tests/cli_forkserver.py)
import json, os, socket, struct, sys
s = socket.socket(socket.AF_UNIX)
s.connect({sock!r})
msg = json.dumps({{"argv": sys.argv[1:], "cwd": os.getcwd(), "env": dict(os.environ)}}).encode()
socket.send_fds(s, [struct.pack("!I", len(msg)) + msg], [0, 1, 2])
code = s.recv(4)
sys.exit(struct.unpack("!i", code)[0] if len(code) == 4 else 1)
"""


def write_client(bin_dir: Path, sock: Path) -> None:
    """A ``fleetwave`` script in ``bin_dir`` that forwards to the server at ``sock``."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    client = bin_dir / "fleetwave"
    client.write_text(CLIENT.format(python=sys.executable, sock=str(sock)), encoding="utf-8")
    client.chmod(0o755)


def _recv_exact(conn: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = conn.recv(n - len(data))
        if not chunk:
            raise EOFError("the client went away")
        data += chunk
    return data


def _child(request: dict[str, object], fds: list[int]) -> None:
    """In the forked child: become the command, run it, exit with its code."""
    code = 1
    try:
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        env = request["env"]
        assert isinstance(env, dict)
        os.environ.clear()
        os.environ.update(env)
        os.chdir(str(request["cwd"]))
        extra = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        sys.path[:0] = extra
        argv = request["argv"]
        assert isinstance(argv, list)
        sys.argv = ["fleetwave", *argv]
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(
                sig, signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL
            )
        from fleetwave.cli.entry import run

        try:
            run()
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
            if exc.code is not None and not isinstance(exc.code, int):
                print(exc.code, file=sys.stderr)
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def serve(sock: Path) -> None:
    """Import the command line once, then fork a child per command until killed."""
    import fleetwave.cli.entry
    import fleetwave.cli.main  # noqa: F401  (the import the children share)

    server = socket.socket(socket.AF_UNIX)
    server.bind(str(sock))
    server.listen(4)
    print("ready", flush=True)
    while True:
        conn, _ = server.accept()
        with conn:
            header, fds, _flags, _addr = socket.recv_fds(conn, 4, 3)
            if len(header) < 4:
                continue
            size = struct.unpack("!I", header + _recv_exact(conn, 4 - len(header)))[0]
            request = json.loads(_recv_exact(conn, size))
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                conn.close()
                server.close()
                _child(request, fds)
            for fd in fds:
                os.close(fd)
            _pid, status = os.waitpid(pid, 0)
            code = os.waitstatus_to_exitcode(status)
            conn.sendall(struct.pack("!i", code if code >= 0 else 128 - code))


if __name__ == "__main__":
    serve(Path(sys.argv[1]))
