"""The ssh driver's state actions, as a YAML workflow names them, with their parameters.

    states:
      - name: install
        action: ssh.run
        command: ./install.sh --quiet
        expect_exit: 0                 # or a list: [0, 3]
        check: test -e installed.stamp # optional: exit 0 = done already
        timeout_s: 300
      - name: copy-config
        action: ssh.upload
        source: /srv/fleet/app.conf     # on the conductor's machine (absolute)
        dest: conf/app.conf             # relative: under the target's ssh_workdir

``ssh.run`` runs ``check`` first, when given: exit 0 means the work is done already,
and the command is not run (the state moves on; with ``skip_when_done: true`` the step
completes, skipped). Then the command; an exit status not in ``expect_exit`` fails the
attempt (the state's ``retry`` decides). Its exit status and the tail of its output go
into the step's details.

After a takeover (the conductor running the state was lost) a command may have run,
wholly or in part: it is never run again blindly. With ``check``, the recover hook
runs the check and goes on from what it says (done: the state moves on; not done: the
command runs, as on a first attempt; not done while the strategy is stopping: nothing
starts, the step ends aborted). Without ``check``, the step fails with "conductor lost
during <state>". ``ssh.upload`` is idempotent (written to a temporary name, renamed
into place): its recover hook uploads again.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, ValidationInfo

from fleetwave.domain.models import shown
from fleetwave.domain.workflow import (
    ActionContext,
    Advance,
    NoRecoverHook,
    NotStarted,
    Outcome,
    Skip,
    StateAction,
    StepFailed,
    TransientError,
)
from fleetwave.drivers.ssh import CommandResult, SshDriver


def _strict(info: ValidationInfo) -> bool:
    return bool(isinstance(info.context, dict) and info.context.get("strict"))


def _command(value: str, info: ValidationInfo) -> str:
    if not value.strip():
        raise ValueError("empty: give the command to run")
    if "\x00" in value:
        raise ValueError("holds a NUL character")
    return value


def _exit_codes(value: Any, info: ValidationInfo) -> Any:
    """One exit status or a list of them: whole numbers 0-255 (true is not 1)."""
    items = value if isinstance(value, list) else [value]
    if not items:
        raise ValueError("an empty list: give the exit statuses that mean success")
    for item in items:
        if isinstance(item, bool) or not isinstance(item, int):
            raise ValueError(f"expected a whole number 0-255 (or a list of them), got {item!r}")
        if not 0 <= item <= 255:
            raise ValueError(f"an exit status is 0-255, got {item}")
    return items


def _absolute(value: str, info: ValidationInfo) -> str:
    if not value.startswith("/"):
        raise ValueError(
            f"{shown(value)} is not an absolute path (the file is read on the conductor's "
            "machine, wherever it runs)"
        )
    return value


_Command = Annotated[str, AfterValidator(_command)]


class RunParams(BaseModel):
    """``ssh.run``'s parameters."""

    model_config = ConfigDict(extra="forbid")
    command: _Command
    expect_exit: Annotated[list[int], BeforeValidator(_exit_codes)] = Field(
        default_factory=lambda: [0]
    )
    check: _Command | None = None


class UploadParams(BaseModel):
    """``ssh.upload``'s parameters."""

    model_config = ConfigDict(extra="forbid")
    source: Annotated[str, AfterValidator(_absolute)] = Field(min_length=1)
    dest: str = Field(min_length=1)


def _driver(ctx: ActionContext, action: str) -> SshDriver:
    driver = ctx.driver
    if not isinstance(driver, SshDriver):
        raise StepFailed(
            f"{action}: target {ctx.target.name} uses the {driver.name} driver; "
            f"{action} runs on ssh targets"
        )
    return driver


def _cut(text: str, limit: int = 60) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


class SshRun(StateAction):
    """``action: ssh.run``: a command on the host, its exit status checked."""

    params_model = RunParams

    def __init__(self, params: RunParams) -> None:
        self.params = params

    async def run(self, ctx: ActionContext) -> Outcome:
        driver = _driver(ctx, "ssh.run")
        if self.params.check is not None:
            checked = await driver.run_command(ctx.target, self.params.check, ctx)
            if checked.exit_status == 0:
                return self._done(ctx, checked)
        return await self._command(driver, ctx)

    async def recover(self, ctx: ActionContext) -> Outcome:
        if self.params.check is None:
            # the command may have run, wholly or in part: never again blindly
            raise NoRecoverHook(ctx.state)
        driver = _driver(ctx, "ssh.run")
        checked = await driver.run_command(ctx.target, self.params.check, ctx)
        if checked.exit_status == 0:
            return self._done(ctx, checked)
        if ctx.stopping:
            raise NotStarted(f"after a takeover the check says not done ({checked.status_text()})")
        return await self._command(driver, ctx)

    async def _command(self, driver: SshDriver, ctx: ActionContext) -> Outcome:
        result = await driver.run_command(ctx.target, self.params.command, ctx)
        said = f"{result.status_text()} in {result.elapsed_s:.1f}s; {result.output_text()}"
        if result.exit_status in self.params.expect_exit:
            return Advance(details=f"ssh.run: {said}")
        raise TransientError(f"ssh.run: {said} (expected {self._expected()})")

    def _done(self, ctx: ActionContext, checked: CommandResult) -> Outcome:
        said = "ssh.run: the check says done (exit 0); the command not run"
        if ctx.recovering:
            said += " (after a takeover)"
        if self.skip_when_done:
            return Skip(said)
        return Advance(details=said)

    #: set from the state's ``skip_when_done`` (a check that says done skips the step)
    skip_when_done = False

    def _expected(self) -> str:
        codes = self.params.expect_exit
        return f"exit {codes[0]}" if len(codes) == 1 else f"exit {' or '.join(map(str, codes))}"

    def has_recover_hook(self) -> bool:
        return self.params.check is not None

    def describe(self) -> str:
        check = f"; check: {_cut(self.params.check)}" if self.params.check else ""
        return f"ssh.run: {_cut(self.params.command)} (expect {self._expected()}{check})"

    def describe_recover(self) -> str:
        return "check" if self.params.check is not None else "none"

    def describe_params(self) -> dict[str, Any]:
        return self.params.model_dump()


class SshUpload(StateAction):
    """``action: ssh.upload``: a file of the conductor's copied to the host."""

    params_model = UploadParams

    def __init__(self, params: UploadParams) -> None:
        self.params = params

    async def run(self, ctx: ActionContext) -> Outcome:
        driver = _driver(ctx, "ssh.upload")
        size, path = await driver.upload(ctx.target, self.params.source, self.params.dest)
        return Advance(details=f"ssh.upload: {size} bytes from {self.params.source} to {path}")

    async def recover(self, ctx: ActionContext) -> Outcome:
        if ctx.stopping:
            raise NotStarted("an upload is not started again while the strategy stops")
        return await self.run(ctx)  # written aside, renamed into place: idempotent

    def describe(self) -> str:
        return f"ssh.upload: {_cut(self.params.source, 40)} -> {_cut(self.params.dest, 40)}"

    def describe_recover(self) -> str:
        return "hook"

    def describe_params(self) -> dict[str, Any]:
        return self.params.model_dump()
