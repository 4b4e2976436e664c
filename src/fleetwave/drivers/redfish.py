"""The ``redfish`` driver: bare-metal nodes through their BMC, with the sushy library
(the client Ironic uses).

Settings are named as Ironic names them (``redfish_address``, ``redfish_system_id``,
``redfish_username``, ``redfish_password``, ``redfish_verify_ca``), and the operations
as the built-in ``clean`` workflow's states, so a YAML workflow of those states with
``driver: redfish`` targets runs as it is:

* ``power-off``, ``final-power-off``: force the node off and wait (``power_poll_s``)
  until the BMC reports it off, within ``power_timeout_s``; already off: done;
* ``power-on``: the same, on;
* ``set-boot-network``: boot from the network (PXE) once, read back;
* ``wait-for-agent``, ``clean-steps``, ``mark-available``: nothing on the BMC (the
  node's agent calls back; the conductor records the node available). With
  ``agent_handoff_dir``, a state that waits for the agent writes its agent token there
  for the node (:class:`Handoff`), as its boot configuration would carry it; any other
  state removes it.

sushy is synchronous: each call runs in a worker thread, bounded by the BMC's
``redfish_timeout_s``. A BMC that cannot be reached or refuses fails the operation
with the reason (``redfish: connection refused at https://...``), the password never
in it. ``observe`` reads the power state or boot override, changing nothing; after a
takeover a node not yet in the wanted power state is watched for a while (the lost
conductor may have asked already) before the action is asked for again.
"""

from __future__ import annotations

import asyncio
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import AnyHttpUrl, BaseModel, ConfigDict, Field, SecretStr

from fleetwave.domain.models import Target
from fleetwave.domain.workflow import ActionContext, RemoteResult, StepFailed, TransientError
from fleetwave.drivers.secrets import SecretError, reveal
from fleetwave.drivers.settings import PerTarget

Kind = Literal["power", "boot", "none"]
#: after a takeover, how long a power state may take to land (the lost conductor may
#: have asked for it) before the power action is asked for again
RECOVER_GRACE_S = 30.0


class RedfishSettings(BaseModel):
    """Settings of a ``redfish`` target (``fleetwave driver show redfish``)."""

    model_config = ConfigDict(extra="forbid")

    redfish_address: AnyHttpUrl = Field(description="the BMC's URL, e.g. https://10.0.0.5")
    redfish_system_id: str = Field(
        pattern=r"^/redfish/v1/Systems/[^/\s]+$",
        description="the node's system, e.g. /redfish/v1/Systems/<id>",
    )
    redfish_username: str | None = Field(default=None, description="the BMC user")
    redfish_password: SecretStr | None = Field(default=None, description="its password")
    redfish_verify_ca: bool | str = Field(
        default=True,
        description="check the BMC's TLS certificate (true), not (false), or against "
        "this CA bundle (a path)",
    )
    redfish_timeout_s: float = Field(
        default=30.0, gt=0, le=600, description="each request to the BMC"
    )
    power_timeout_s: float = Field(
        default=300.0, gt=0, le=3600, description="how long a power action may take"
    )
    power_poll_s: float = Field(
        default=2.0, gt=0, le=60, description="seconds between two looks at the power state"
    )
    redfish_retries: int = Field(
        default=3,
        ge=0,
        le=20,
        description="how many times a request the BMC answered with a server error (5xx) "
        "is asked again before the attempt fails as a transient error",
    )
    redfish_retry_delay_s: float = Field(
        default=1.0, ge=0, le=60, description="seconds between two such requests"
    )
    agent_handoff_dir: str | None = Field(
        default=None,
        min_length=1,
        description="a directory where a state that waits for the node's agent writes "
        "<system id>.json (the agent's token, step, state and agent_callback_url) for "
        "the node's boot configuration to carry to its agent",
    )
    agent_callback_url: AnyHttpUrl | None = Field(
        default=None,
        description="the REST API's base URL the node's agent calls back to (written "
        "in the handoff file)",
    )


@dataclass(frozen=True)
class Operation:
    kind: Kind
    #: the power state wanted ("on", "off") for a power operation
    power: str = ""


OPERATIONS: dict[str, Operation] = {
    "power-off": Operation("power", "off"),
    "final-power-off": Operation("power", "off"),
    "power-on": Operation("power", "on"),
    "set-boot-network": Operation("boot"),
    "wait-for-agent": Operation("none"),
    "clean-steps": Operation("none"),
    "mark-available": Operation("none"),
}


class _Bmc:
    """One node's BMC through sushy (blocking: called from a worker thread)."""

    def __init__(self, name: str, cfg: RedfishSettings) -> None:
        self.name = name
        self.cfg = cfg
        self.address = str(cfg.redfish_address).rstrip("/")
        self._system: Any = None
        self._root: Any = None

    def close(self) -> None:
        """Close the HTTP session to the BMC (its pooled connections)."""
        root, self._root, self._system = self._root, None, None
        if root is not None:
            root._conn.close()

    def system(self) -> Any:
        if self._system is None:
            import sushy

            self.close()  # (a session given up after an error: its connections too)

            password = None
            if self.cfg.redfish_password is not None:
                password = reveal(self.cfg.redfish_password.get_secret_value(), "redfish_password")
            root = sushy.Sushy(
                self.address,
                username=self.cfg.redfish_username,
                password=password,
                verify=self.cfg.redfish_verify_ca,
                server_side_retries=0,
                read_timeout=self.cfg.redfish_timeout_s,
                connect_timeout=self.cfg.redfish_timeout_s,
            )
            self._root = root
            self._system = root.get_system(self.cfg.redfish_system_id)
        else:
            self._system.refresh(force=True)
        return self._system

    def power_state(self) -> str:
        state = self.system().power_state
        return str(getattr(state, "value", state)).lower()

    def reset(self, power: str) -> None:
        import sushy

        kind = sushy.ResetType.ON if power == "on" else sushy.ResetType.FORCE_OFF
        self.system().reset_system(kind)

    def boot_network(self) -> None:
        import sushy

        self.system().set_system_boot_options(
            target=sushy.BootSource.PXE, enabled=sushy.BootSourceOverrideEnabled.ONCE
        )

    def boots_network(self) -> bool:
        boot = self.system().boot
        target = getattr(boot.target, "value", boot.target)
        enabled = getattr(boot.enabled, "value", boot.enabled)
        return target == "Pxe" and enabled in ("Once", "Continuous")


class Handoff:
    """What a node's agent needs to call back, handed over through a file
    ``{agent_handoff_dir}/{system uuid}.json``: ``{"target", "strategy", "step",
    "state", "token", "callback_url"}``, written (0600, atomically) when a state that
    waits for the agent starts, replaced by the next such state's, removed by any other
    state. What serves it to the node (a PXE or HTTP boot server's per-node config,
    a virtual-media image built from it) is the deployment's."""

    def __init__(self, cfg: RedfishSettings) -> None:
        assert cfg.agent_handoff_dir is not None
        node = cfg.redfish_system_id.rsplit("/", 1)[-1]
        self.path = Path(os.path.expanduser(cfg.agent_handoff_dir)) / f"{node}.json"
        self.url = str(cfg.agent_callback_url).rstrip("/") if cfg.agent_callback_url else None

    def write(self, ctx: ActionContext, token: str) -> None:
        said = {
            "target": ctx.target.name,
            "strategy": ctx.strategy_id,
            "step": ctx.step_id,
            "state": ctx.state,
            "token": token,
            "callback_url": self.url,
        }
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=f".{self.path.name}.")
        try:
            with os.fdopen(fd, "w") as out:  # (mkstemp: 0600)
                json.dump(said, out)
            os.replace(tmp, self.path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def remove(self) -> None:
        self.path.unlink(missing_ok=True)


class RedfishDriver:
    """Bare-metal nodes through their BMC's Redfish API (sushy, as Ironic)."""

    name = "redfish"
    settings_model = RedfishSettings

    def __init__(self) -> None:
        self._bmcs = PerTarget(
            "redfish", RedfishSettings, lambda target, cfg: _Bmc(target.name, cfg)
        )

    async def close_connections(self) -> None:
        """Close every BMC's session (the conductor ends)."""
        for bmc in self._bmcs.forget_all():
            await asyncio.to_thread(bmc.close)

    async def perform(self, target: Target, operation: str, ctx: ActionContext) -> RemoteResult:
        op, bmc = self._begin(target, operation)
        if bmc.cfg.agent_handoff_dir is not None:
            await self._hand_over(bmc, ctx)
        if op.kind == "none":
            return RemoteResult.DONE
        if op.kind == "boot":
            await self._call(bmc, bmc.boot_network)
            if not await self._call(bmc, bmc.boots_network):
                raise StepFailed(f"redfish: {bmc.name}: the BMC did not keep the network boot")
            return RemoteResult.DONE
        if await self._call(bmc, bmc.power_state) == op.power:
            return RemoteResult.ALREADY_DONE
        if ctx.recovering or ctx.resent:
            # The conductor that was lost may have asked already, and a BMC says nothing
            # of a power action under way: give it time to land before asking again.
            grace_s = min(bmc.cfg.power_timeout_s, RECOVER_GRACE_S)
            if await self._wait_power(bmc, op.power, grace_s) == op.power:
                return RemoteResult.DONE
        await self._call(bmc, lambda: bmc.reset(op.power))
        state = await self._wait_power(bmc, op.power, bmc.cfg.power_timeout_s)
        if state == op.power:
            return RemoteResult.DONE
        raise StepFailed(
            f"redfish: {bmc.name}: still {state} {bmc.cfg.power_timeout_s:g}s after "
            f"powering {op.power} (power_timeout_s)"
        )

    @staticmethod
    async def _hand_over(bmc: _Bmc, ctx: ActionContext) -> None:
        """The agent's token to its handoff file (a state that waits for the agent), or
        the file removed (any other state; a recover hook leaves it: the agent keeps
        the token it had)."""
        handoff = Handoff(bmc.cfg)
        try:
            if ctx.agent_token is not None:
                await asyncio.to_thread(handoff.write, ctx, ctx.agent_token)
            elif not ctx.callback_expected:
                await asyncio.to_thread(handoff.remove)
        except OSError as exc:
            raise StepFailed(
                f"redfish: {bmc.name}: cannot write the agent's handoff file "
                f"{handoff.path} (agent_handoff_dir): {exc.strerror or exc}"
            ) from None

    async def _wait_power(self, bmc: _Bmc, power: str, for_s: float) -> str:
        """Until the BMC reports ``power``, for ``for_s`` at most: the state last read."""
        loop = asyncio.get_running_loop()
        give_up = loop.time() + for_s
        while True:
            await asyncio.sleep(bmc.cfg.power_poll_s)
            state: str = await self._call(bmc, bmc.power_state)
            if state == power or loop.time() >= give_up:
                return state

    async def observe(self, target: Target, operation: str, ctx: ActionContext) -> RemoteResult:
        op, bmc = self._begin(target, operation)
        if op.kind == "none":
            return RemoteResult.DONE
        if op.kind == "boot":
            done = await self._call(bmc, bmc.boots_network)
        else:
            done = await self._call(bmc, bmc.power_state) == op.power
        return RemoteResult.DONE if done else RemoteResult.NOT_STARTED

    def _begin(self, target: Target, operation: str) -> tuple[Operation, _Bmc]:
        op = OPERATIONS.get(operation)
        if op is None:
            raise StepFailed(
                f"redfish: no operation {operation!r} (it runs {', '.join(OPERATIONS)}: the "
                "clean workflow's states)"
            )
        return op, self._bmcs.get(target)

    async def _call(self, bmc: _Bmc, call: Any) -> Any:
        """One blocking BMC call in a worker thread; sushy's errors in a few words."""
        try:
            import sushy.exceptions as sushy_errors
        except ImportError:
            raise StepFailed(
                "redfish: the sushy package is not installed (pip install 'fleetwave[redfish]')"
            ) from None
        try:
            for retries_left in range(bmc.cfg.redfish_retries, -1, -1):
                try:
                    return await asyncio.to_thread(call)
                except sushy_errors.ServerSideError:
                    # A BMC busy or briefly broken (a 5xx): every call here may be made
                    # again (a power state already reached, or a boot override already
                    # set, is the same asked twice).
                    if retries_left == 0:
                        raise
                    bmc._system = None  # read afresh
                    await asyncio.sleep(bmc.cfg.redfish_retry_delay_s)
            raise AssertionError("unreachable")
        except SecretError as exc:
            raise StepFailed(f"redfish: {exc}") from None
        except sushy_errors.ConnectionError as exc:
            bmc._system = None  # connect afresh next time
            text = str(exc)
            if "refused" in text.lower():
                raise TransientError(f"redfish: connection refused at {bmc.address}") from None
            if "timed out" in text.lower() or "timeout" in text.lower():
                raise TransientError(
                    f"redfish: no answer within {bmc.cfg.redfish_timeout_s:g}s at {bmc.address}"
                ) from None
            raise TransientError(f"redfish: cannot reach {bmc.address}") from None
        except sushy_errors.AccessError:
            bmc._system = None
            raise StepFailed(
                f"redfish: {bmc.address} refused access (check redfish_username and "
                "redfish_password)"
            ) from None
        except sushy_errors.ResourceNotFoundError:
            raise StepFailed(
                f"redfish: {bmc.address} has no system {bmc.cfg.redfish_system_id}"
            ) from None
        except sushy_errors.ServerSideError as exc:
            raise TransientError(
                f"redfish: {bmc.address} answered {getattr(exc, 'status_code', '?')} "
                f"{getattr(exc, 'detail', '') or exc}, asked {bmc.cfg.redfish_retries + 1} "
                f"time{'s' if bmc.cfg.redfish_retries else ''} (redfish_retries)"
            ) from None
        except sushy_errors.HTTPError as exc:
            raise StepFailed(
                f"redfish: {bmc.address} refused: {getattr(exc, 'status_code', '?')} "
                f"{getattr(exc, 'detail', '') or exc}"
            ) from None
