"""The ``ssh`` driver: plain hosts over SSH, with asyncssh.

Settings are named as Ironic names them where it has them (``ssh_host``, ``ssh_port``,
``ssh_username``, ``ssh_key_file``, ``ssh_password``). A state of an ssh target runs one
of the driver's actions, given in a YAML workflow with their parameters
(:mod:`fleetwave.drivers.ssh_actions`):

* ``ssh.run``: :meth:`SshDriver.run_command` runs a command and reports its exit status
  and the tail of its output (:data:`OUTPUT_TAIL_CHARS` characters of stdout and stderr
  together, as they came, on one line);
* ``ssh.upload``: :meth:`SshDriver.upload` copies a file of the conductor's over SFTP
  (to a temporary name beside the destination, then renamed: a file half written is
  never at the destination).

Every operation opens its own connection (a host's sshd is asked for one at a time by a
step) and closes it when done. Host keys are checked against ``ssh_known_hosts`` unless
``ssh_verify_host_key`` is false; a key that is not there fails the step naming the key
(its type and SHA256 fingerprint). A host that cannot be reached fails the attempt with
the reason (``ssh: connection refused at 127.0.0.1:2222``) within
``ssh_connect_timeout_s``.

A command runs under ``sh`` in its own session (``setsid``), its input ``/dev/null``,
watched by a little shell loop that reads the channel's input: when the channel
closes (the command ran past ``ssh_command_timeout_s``, the state timed out, or the
conductor died and its TCP connection went with it), the command's whole process group
gets SIGTERM, and SIGKILL 3 s later. So a command never outlives the conductor that
started it, unless it leaves its session itself (``setsid``, a daemon).
"""

from __future__ import annotations

import asyncio
import getpass
import logging
import os
import shlex
import warnings
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from pydantic import BaseModel, ConfigDict, Field, SecretStr

from fleetwave.domain.models import Target
from fleetwave.domain.rules import one_line
from fleetwave.domain.workflow import ActionContext, RemoteResult, StepFailed, TransientError
from fleetwave.drivers.secrets import SecretError, reveal
from fleetwave.drivers.settings import PerTarget

if TYPE_CHECKING:
    import asyncssh

log = logging.getLogger("fleetwave.drivers.ssh")

#: the characters of a command's output (stdout and stderr together, the last ones, on
#: one line) a step's details keep: they hold at most 4,000 characters, and the exit
#: status and the engine's words go around it
OUTPUT_TAIL_CHARS = 2000
#: bytes of output kept while a command runs (the tail is cut from these)
_KEEP_BYTES = 4 * OUTPUT_TAIL_CHARS
#: how long a command's output is read after its exit status came
_OUTPUT_GRACE_S = 2.0
#: how long a closing connection is waited for (it is closed anyway)
_CLOSE_WAIT_S = 2.0

#: the shell the command runs under; its first argument is the command. It runs the
#: command in a session of its own and kills that session when the channel's input
#: closes (the driver never writes to it: it closes when the channel or the
#: connection does).
_WRAPPER = r"""
exec 3<&0
if command -v setsid >/dev/null 2>&1; then
  setsid sh -c "$1" </dev/null &
else
  sh -c "$1" </dev/null &
fi
job=$!
(
  while read -r _; do :; done <&3
  kill -TERM -"$job" "$job"
  i=0
  while [ "$i" -lt 15 ] && kill -0 -"$job"; do sleep 0.2; i=$((i + 1)); done
  kill -KILL -"$job" "$job"
) >/dev/null 2>&1 &
watch=$!
exec 3<&-
wait "$job"
status=$?
kill "$watch" 2>/dev/null
exit "$status"
"""


class SshSettings(BaseModel):
    """Settings of an ``ssh`` target (``fleetwave driver show ssh``)."""

    model_config = ConfigDict(extra="forbid")

    ssh_host: str = Field(min_length=1, description="the host's name or address")
    ssh_port: int = Field(default=22, ge=1, le=65535, description="its SSH port")
    ssh_username: str | None = Field(
        default=None, min_length=1, description="the user to log in as (default: the conductor's)"
    )
    ssh_key_file: str | None = Field(
        default=None,
        min_length=1,
        description="a private key file on the conductor's machine (neither this nor "
        "ssh_password: the conductor user's keys and agent, as ssh does)",
    )
    ssh_password: SecretStr | None = Field(default=None, description="the user's password")
    ssh_known_hosts: str = Field(
        default="~/.ssh/known_hosts",
        min_length=1,
        description="the known_hosts file the host's key is checked against",
    )
    ssh_verify_host_key: bool = Field(
        default=True, description="check the host's key (false: accept any key)"
    )
    ssh_connect_timeout_s: float = Field(
        default=15.0, gt=0, le=600, description="connecting and logging in"
    )
    ssh_command_timeout_s: float = Field(
        default=600.0,
        gt=0,
        le=2_592_000,
        description="each command (the state's timeout_s bounds it too)",
    )
    ssh_workdir: str | None = Field(
        default=None,
        min_length=1,
        description="the directory commands run in, and relative upload destinations "
        "are under (default: the login directory)",
    )


@dataclass(frozen=True)
class CommandResult:
    """How a command ended: its exit status (None: killed by a signal, named in
    ``signal``), the tail of its output, and how long it ran."""

    exit_status: int | None
    output_tail: str
    elapsed_s: float
    signal: str = ""

    def status_text(self) -> str:
        if self.exit_status is not None:
            return f"exit {self.exit_status}"
        return f"killed by signal {self.signal or '?'}"

    def output_text(self) -> str:
        return f"output: {self.output_tail}" if self.output_tail else "no output"


def output_tail(data: bytes) -> str:
    """The last :data:`OUTPUT_TAIL_CHARS` characters of ``data`` as a step's details
    keep them: decoded (bytes that are not UTF-8 replaced), on one line, control
    characters escaped, cut at the front (``...``)."""
    text = one_line(data.decode("utf-8", "replace")).strip()
    text = "".join(c if c.isprintable() else f"\\x{ord(c):02x}" for c in text)
    if len(text) > OUTPUT_TAIL_CHARS:
        text = "..." + text[-OUTPUT_TAIL_CHARS:]
    return text


def _asyncssh() -> Any:
    """asyncssh, imported when first used (its DSA support warns on import with recent
    cryptography; that says nothing to an operator)."""
    with warnings.catch_warnings():
        # (cryptography's own warning class, a UserWarning)
        warnings.simplefilter("ignore")
        try:
            import asyncssh
        except ImportError:  # pragma: no cover - a dependency of fleetwave
            raise StepFailed("ssh: the asyncssh package is not installed") from None
    return asyncssh


class _Tail:
    """The last bytes a command wrote, stdout and stderr together, as they came."""

    def __init__(self) -> None:
        self._chunks: deque[bytes] = deque()
        self._size = 0

    def add(self, data: bytes) -> None:
        self._chunks.append(data)
        self._size += len(data)
        while self._size - len(self._chunks[0]) >= _KEEP_BYTES:
            self._size -= len(self._chunks.popleft())

    def text(self) -> str:
        return output_tail(b"".join(self._chunks)[-_KEEP_BYTES:])


class _Session:
    """An asyncssh session's callbacks: output into a tail, the exit status, the end."""

    def __init__(self) -> None:
        self.tail = _Tail()
        self.exit_status: int | None = None
        self.signal = ""
        loop = asyncio.get_running_loop()
        #: the command said how it ended (or the channel closed without a word)
        self.ended: asyncio.Future[None] = loop.create_future()
        #: the channel closed: all of its output is in
        self.closed: asyncio.Future[None] = loop.create_future()

    def data_received(self, data: bytes, datatype: Any) -> None:
        self.tail.add(data)

    def exit_status_received(self, status: int) -> None:
        self.exit_status = status
        self._set(self.ended)

    def exit_signal_received(self, signal: str, core_dumped: bool, msg: str, lang: str) -> None:
        self.signal = signal
        self._set(self.ended)

    def connection_lost(self, exc: Exception | None) -> None:
        self._set(self.ended)
        self._set(self.closed)

    @staticmethod
    def _set(future: asyncio.Future[None]) -> None:
        if not future.done():
            future.set_result(None)


class _Endpoint:
    """One target's settings, read once, and how its messages name it."""

    def __init__(self, target: Target, cfg: SshSettings) -> None:
        self.name = target.name
        self.cfg = cfg
        self.where = f"{cfg.ssh_host}:{cfg.ssh_port}"
        self.known_hosts = os.path.expanduser(cfg.ssh_known_hosts)

    def remote_path(self, dest: str) -> str:
        if dest.startswith("/") or self.cfg.ssh_workdir is None:
            return dest
        return f"{self.cfg.ssh_workdir.rstrip('/')}/{dest}"


class _Client:
    """asyncssh's client callbacks: remembers a host key it was asked to trust."""

    def __init__(self) -> None:
        self.refused_key: Any = None

    def validate_host_public_key(self, host: str, addr: str, port: int, key: Any) -> bool:
        self.refused_key = key
        return False


def _session_class() -> type[Any]:
    base: Any = _asyncssh().SSHClientSession

    class Session(_Session, base):  # type: ignore[misc]
        def __init__(self) -> None:
            _Session.__init__(self)
            base.__init__(self)

    return Session


def _client_class() -> type[Any]:
    base: Any = _asyncssh().SSHClient

    class Client(_Client, base):  # type: ignore[misc]
        def __init__(self) -> None:
            _Client.__init__(self)
            base.__init__(self)

    return Client


class SshDriver:
    """Plain hosts over SSH (asyncssh): commands and file uploads, run by the YAML
    actions ssh.run and ssh.upload."""

    name = "ssh"
    settings_model = SshSettings

    def __init__(self) -> None:
        self._endpoints = PerTarget("ssh", SshSettings, _Endpoint)
        self._client: type[Any] | None = None
        self._session: type[Any] | None = None

    @staticmethod
    def actions() -> dict[str, type[Any]]:
        """The state actions a YAML workflow names as ``ssh.NAME`` (with parameters)."""
        from fleetwave.drivers.ssh_actions import SshRun, SshUpload

        return {"run": SshRun, "upload": SshUpload}

    # -- the driver interface: plain operations are not the ssh driver's ------------

    async def perform(self, target: Target, operation: str, ctx: ActionContext) -> RemoteResult:
        raise StepFailed(self._no_operation(operation))

    async def observe(self, target: Target, operation: str, ctx: ActionContext) -> RemoteResult:
        raise StepFailed(self._no_operation(operation))

    @staticmethod
    def _no_operation(operation: str) -> str:
        return (
            f"ssh: no operation {operation!r}: a state of an ssh target runs ssh.run "
            "(command: ...) or ssh.upload (source: ..., dest: ...)"
        )

    # -- what the actions ask for ------------------------------------------------------

    async def run_command(
        self, target: Target, command: str, ctx: ActionContext | None = None
    ) -> CommandResult:
        """Run ``command`` on the target (in ``ssh_workdir``), within
        ``ssh_command_timeout_s``; raise :class:`TransientError` when it runs past it (it
        is killed) or the host cannot be reached, :class:`StepFailed` when it refuses
        the key or the login."""
        end = self._endpoints.get(target)
        script = _script(end.cfg.ssh_workdir, command, ctx)
        loop = asyncio.get_running_loop()
        started = loop.time()
        if self._session is None:
            self._session = _session_class()
        async with self._connection(end) as conn:
            session: _Session = self._session()
            try:
                chan, _ = await conn.create_session(
                    cast(Any, lambda: session), script, encoding=None
                )
            except _asyncssh().Error as exc:
                raise TransientError(f"ssh: {end.where}: cannot start the command: {exc}") from None
            try:
                async with asyncio.timeout(end.cfg.ssh_command_timeout_s):
                    await session.ended
                # the rest of its output; something it left running may hold the channel
                # open (`daemon &` without redirections): its exit status counts all the same
                await asyncio.wait([session.closed], timeout=_OUTPUT_GRACE_S)
            except TimeoutError:
                log.info(
                    "ssh command stopped past its timeout on target %s (%gs)",
                    end.name,
                    end.cfg.ssh_command_timeout_s,
                )
                raise TransientError(
                    f"ssh: {end.name}: the command ran past its "
                    f"{end.cfg.ssh_command_timeout_s:g}s (ssh_command_timeout_s) and was "
                    f"stopped; {CommandResult(None, session.tail.text(), 0).output_text()}"
                ) from None
            finally:
                # (also when the state's deadline cancels us: the channel's close is what
                # stops the command on the host)
                chan.close()
        if session.exit_status is None and not session.signal:
            # the connection went before the command said how it ended (sshd or the
            # host going down): it may have run, wholly or in part
            raise TransientError(
                f"ssh: {end.name}: the connection to {end.where} was lost before the "
                f"command ended; {CommandResult(None, session.tail.text(), 0).output_text()}"
            )
        return CommandResult(
            session.exit_status, session.tail.text(), loop.time() - started, session.signal
        )

    async def upload(self, target: Target, source: str, dest: str) -> tuple[int, str]:
        """Copy the conductor's file ``source`` to ``dest`` on the target (relative:
        under ``ssh_workdir``), through a temporary name renamed into place; the bytes
        copied and the path written."""
        end = self._endpoints.get(target)
        path = end.remote_path(dest)
        try:
            size = Path(source).stat().st_size
        except OSError as exc:
            raise StepFailed(
                f"ssh: cannot read {source} on the conductor: {exc.strerror or exc}"
            ) from None
        asyncssh = _asyncssh()
        partial = f"{path}.fleetwave-partial"
        async with self._connection(end) as conn:
            try:
                async with conn.start_sftp_client() as sftp:
                    await sftp.put(source, partial)
                    try:
                        await sftp.posix_rename(partial, path)  # replaces it at once
                    except asyncssh.SFTPOpUnsupported:
                        if await sftp.exists(path):
                            await sftp.remove(path)
                        await sftp.rename(partial, path)
            except asyncssh.SFTPError as exc:
                raise StepFailed(f"ssh: {end.name}: cannot write {path}: {exc.reason}") from None
            except OSError as exc:
                raise StepFailed(
                    f"ssh: cannot read {source} on the conductor: {exc.strerror or exc}"
                ) from None
        return size, path

    # -- connections -------------------------------------------------------------------

    def _connection(self, end: _Endpoint) -> _Connection:
        if self._client is None:
            self._client = _client_class()
        return _Connection(end, self._client)


class _Connection:
    """``async with``: one logged-in connection to the target; its errors in a few
    words (the password never in them); closed on the way out."""

    def __init__(self, end: _Endpoint, client: type[Any]) -> None:
        self.end = end
        self.client_class = client
        self.conn: asyncssh.SSHClientConnection | None = None

    async def __aenter__(self) -> asyncssh.SSHClientConnection:
        asyncssh = _asyncssh()
        end, cfg = self.end, self.end.cfg
        options: dict[str, Any] = {
            "username": cfg.ssh_username or getpass.getuser(),
            "known_hosts": end.known_hosts if cfg.ssh_verify_host_key else None,
            "connect_timeout": cfg.ssh_connect_timeout_s,
            "login_timeout": cfg.ssh_connect_timeout_s,
            "config": None,  # the target's settings, not the conductor user's ~/.ssh/config
        }
        try:
            if cfg.ssh_password is not None:
                options["password"] = reveal(cfg.ssh_password.get_secret_value(), "ssh_password")
        except SecretError as exc:
            raise StepFailed(f"ssh: {exc}") from None
        if cfg.ssh_key_file is not None:
            options["client_keys"] = [os.path.expanduser(cfg.ssh_key_file)]
            options["agent_path"] = None
        elif cfg.ssh_password is not None:
            options["client_keys"] = None
            options["agent_path"] = None
        if cfg.ssh_verify_host_key and not os.path.isfile(end.known_hosts):
            raise StepFailed(
                f"ssh: {end.name}: no known_hosts file {end.known_hosts} (ssh_known_hosts) "
                "to check the host's key against"
            )
        client = self.client_class()
        try:
            async with asyncio.timeout(cfg.ssh_connect_timeout_s):
                self.conn, _ = await asyncssh.create_connection(
                    lambda: client, cfg.ssh_host, cfg.ssh_port, **options
                )
        except asyncssh.HostKeyNotVerifiable:
            said = _refused_key(end, client.refused_key)
            # (someone may be in between: said on the conductor's log too, not only in
            # the step's details)
            log.warning("ssh host key refused for target %s: %s", end.name, said)
            raise StepFailed(said) from None
        except asyncssh.PermissionDenied:
            raise StepFailed(
                f"ssh: {options['username']}@{end.where} refused the login (check "
                "ssh_username, ssh_key_file, ssh_password)"
            ) from None
        except asyncssh.KeyImportError as exc:
            raise StepFailed(f"ssh: ssh_key_file: {cfg.ssh_key_file}: {exc}") from None
        except ConnectionRefusedError:
            raise TransientError(f"ssh: connection refused at {end.where}") from None
        except TimeoutError:
            raise TransientError(
                f"ssh: no answer within {cfg.ssh_connect_timeout_s:g}s at {end.where} "
                "(ssh_connect_timeout_s)"
            ) from None
        except OSError as exc:
            if cfg.ssh_key_file is not None and exc.filename == options["client_keys"][0]:
                raise StepFailed(
                    f"ssh: ssh_key_file: cannot read {cfg.ssh_key_file}: {exc.strerror}"
                ) from None
            raise TransientError(f"ssh: cannot reach {end.where}: {exc.strerror or exc}") from None
        except asyncssh.Error as exc:
            raise TransientError(f"ssh: {end.where}: {exc.reason or exc}") from None
        return self.conn

    async def __aexit__(self, *exc: object) -> None:
        conn = self.conn
        if conn is None:
            return
        conn.close()
        # a close that is not answered in time is left to finish by itself
        try:
            async with asyncio.timeout(_CLOSE_WAIT_S):
                await asyncio.shield(conn.wait_closed())
        except (TimeoutError, asyncio.CancelledError):
            pass


def _refused_key(end: _Endpoint, key: Any) -> str:
    """Why a host key was refused, naming the key (type and SHA256 fingerprint)."""
    shown = "its key"
    if key is not None:
        shown = f"its key {key.get_algorithm()} {key.get_fingerprint('sha256')}"
    known = _known_for(end)
    if known:
        why = f"does not match the key known for it in {end.known_hosts} ({', '.join(known)})"
    else:
        why = f"is not in {end.known_hosts}"
    return (
        f"ssh: host key refused: {end.where} offered {shown}, which {why} (ssh_known_hosts; "
        "a host reinstalled, or someone in between)"
    )


def _known_for(end: _Endpoint) -> list[str]:
    """The fingerprints known_hosts lists for the target's host and port."""
    asyncssh = _asyncssh()
    port = end.cfg.ssh_port if end.cfg.ssh_port != 22 else None
    try:
        keys = asyncssh.read_known_hosts(end.known_hosts).match(end.cfg.ssh_host, "", port)[0]
    except (OSError, ValueError, asyncssh.Error):
        return []
    return [f"{k.get_algorithm()} {k.get_fingerprint('sha256')}" for k in keys]


def _script(workdir: str | None, command: str, ctx: ActionContext | None) -> str:
    """The remote command line: the wrapper run by ``sh`` (whatever the login shell),
    with the step's names in its environment and the working directory."""
    env = []
    if ctx is not None:
        env = [
            f"FLEETWAVE_TARGET={shlex.quote(ctx.target.name)}",
            f"FLEETWAVE_STATE={shlex.quote(ctx.state)}",
            f"FLEETWAVE_STRATEGY={ctx.strategy_id}",
            f"FLEETWAVE_STEP={ctx.step_id}",
            f"FLEETWAVE_ATTEMPT={ctx.attempt}",
        ]
    cd = f"cd {shlex.quote(workdir)} && " if workdir else ""
    exports = f"export {' '.join(env)} && " if env else ""
    return f"{cd}{exports}exec sh -c {shlex.quote(_WRAPPER)} fleetwave-ssh {shlex.quote(command)}"
