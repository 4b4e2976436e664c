"""A throw-away OpenSSH ``sshd`` on a free loopback port, for the ssh driver's tests and
benchmark.

    server = Sshd.start(tmp_dir)
    settings = server.target_settings(workdir="/tmp/h1")   # for `target add --set ...`
    ...
    server.stop()

It runs Debian's ``/usr/sbin/sshd`` in the foreground with a private config: a fresh
ed25519 host key and user key in ``tmp_dir``, ``authorized_keys`` there (not in anyone's
home) for the current user only, from 127.0.0.1 only, keys only (no passwords), SFTP
built in; or also a throw-away user of its own (:class:`PasswordUser`, made by root)
with a password, for password logins from 127.0.0.1. As an ordinary user sshd runs
unprivileged (it can only log that user in); as root it needs its privilege-separation
directory ``/run/sshd`` (created when missing, as Debian's service does) and
``StrictModes no`` (the key files sit in a temporary directory under the
world-writable /tmp). ``known_hosts`` beside them
trusts the host key for ``[127.0.0.1]:PORT``.
"""

from __future__ import annotations

import getpass
import os
import secrets
import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: where Debian's openssh-server puts it
SSHD = "/usr/sbin/sshd"


def find_sshd() -> str | None:
    """The sshd binary, or None when openssh-server is not installed."""
    if os.access(SSHD, os.X_OK):
        return SSHD
    return shutil.which("sshd")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def write_keypair(private: Path) -> str:
    """A fresh ed25519 key in OpenSSH's format at ``private`` (mode 600); its public
    key's line."""
    from fleetwave.drivers.ssh import _asyncssh

    asyncssh = _asyncssh()

    key = asyncssh.generate_private_key("ssh-ed25519")
    key.write_private_key(str(private))
    private.chmod(0o600)
    public = key.export_public_key().decode().strip()
    private.with_suffix(".pub").write_text(public + "\n")
    return str(public)


@dataclass
class PasswordUser:
    """A throw-away local user with a password (root only: ``useradd``, ``chpasswd``),
    for password logins; :meth:`remove` deletes it."""

    name: str
    password: str
    home: Path

    @classmethod
    def create(cls) -> PasswordUser:
        """The user, and its home: a new directory of its own under the temporary
        directory (a test's own directories are root's alone)."""
        if os.geteuid() != 0:
            raise RuntimeError("only root can create a user for password logins")
        name = f"fwpw{os.getpid()}{secrets.token_hex(3)}"
        password = secrets.token_urlsafe(18)
        home = Path(tempfile.mkdtemp(prefix=f"{name}-"))
        subprocess.run(
            ["useradd", "--no-create-home", "--home-dir", str(home), "--shell", "/bin/sh", name],
            check=True,
            capture_output=True,
        )
        user = cls(name, password, home)
        try:
            subprocess.run(
                ["chpasswd"], input=f"{name}:{password}\n".encode(), check=True, capture_output=True
            )
            shutil.chown(home, name)
        except BaseException:
            user.remove()
            raise
        return user

    def remove(self) -> None:
        subprocess.run(["userdel", self.name], check=False, capture_output=True)
        shutil.rmtree(self.home, ignore_errors=True)


@dataclass
class Sshd:
    """A running sshd (see the module's docstring)."""

    dir: Path
    port: int
    proc: subprocess.Popen[bytes]
    user: str
    user_key: Path
    known_hosts: Path
    host_public: str
    log: Path

    @classmethod
    def start(
        cls, tmp: Path, timeout_s: float = 20.0, password_user: PasswordUser | None = None
    ) -> Sshd:
        """Start it; with ``password_user``, that user may also log in, with its password
        (from 127.0.0.1 only; the other user with its key alone)."""
        exe = find_sshd()
        if exe is None:
            raise RuntimeError("no sshd: install Debian's openssh-server")
        tmp.mkdir(parents=True, exist_ok=True)
        if os.geteuid() == 0:
            Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)
        host_key, user_key = tmp / "host_key", tmp / "user_key"
        host_public = write_keypair(host_key)
        (tmp / "authorized_keys").write_text(write_keypair(user_key) + "\n")
        port = free_port()
        user = getpass.getuser()
        known_hosts = tmp / "known_hosts"
        known_hosts.write_text(f"[127.0.0.1]:{port} {host_public}\n")
        config = tmp / "sshd_config"
        config.write_text(
            "\n".join(
                [
                    f"ListenAddress 127.0.0.1:{port}",
                    f"HostKey {host_key}",
                    f"PidFile {tmp / 'sshd.pid'}",
                    f"AuthorizedKeysFile {tmp / 'authorized_keys'}",
                    "StrictModes no",
                    "UsePAM no",
                    "PubkeyAuthentication yes",
                    "PasswordAuthentication no",
                    "KbdInteractiveAuthentication no",
                    "PermitRootLogin prohibit-password",
                    f"AllowUsers {user}@127.0.0.1"
                    + (f" {password_user.name}@127.0.0.1" if password_user is not None else ""),
                    "Subsystem sftp internal-sftp",
                    # the benchmark's 20 hosts connect at once (the default drops some
                    # unauthenticated connections above 10)
                    "MaxStartups 200",
                    "LogLevel VERBOSE",
                    *(
                        [
                            f"Match User {password_user.name} Address 127.0.0.1",
                            "    PasswordAuthentication yes",
                        ]
                        if password_user is not None
                        else []
                    ),
                    "",
                ]
            )
        )
        log = tmp / "sshd.log"
        proc = subprocess.Popen(
            [exe, "-D", "-f", str(config), "-E", str(log)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
        )
        server = cls(tmp, port, proc, user, user_key, known_hosts, host_public, log)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=1) as s:
                    if s.recv(64).startswith(b"SSH-2.0"):
                        return server
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                server.stop()
                said = log.read_text() if log.exists() else ""
                raise RuntimeError(f"sshd did not start (exit {proc.returncode}): {said}")
            time.sleep(0.05)

    def target_settings(self, **extra: Any) -> dict[str, Any]:
        """The settings of an ssh target on this server (``workdir=`` for ssh_workdir)."""
        settings: dict[str, Any] = {
            "ssh_host": "127.0.0.1",
            "ssh_port": self.port,
            "ssh_username": self.user,
            "ssh_key_file": str(self.user_key),
            "ssh_known_hosts": str(self.known_hosts),
        }
        if "workdir" in extra:
            settings["ssh_workdir"] = str(extra.pop("workdir"))
        settings.update(extra)
        return settings

    def cpu_s(self) -> float:
        """CPU the server has used so far, its connections' processes too (each is
        waited for by the listener, and counted in its children's time), Linux only."""
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        ticks = sum(int(f) for f in fields[11:15])  # utime stime cutime cstime
        return ticks / os.sysconf("SC_CLK_TCK")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
