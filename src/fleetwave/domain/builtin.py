"""The built-in workflows (DESIGN.md section 6), with timeouts sized for real targets.

Every state runs the driver operation of the same name; the first state of each
is a pre-check (or import) that may finish the step early when the target is
already where the rollout would take it.
"""

from __future__ import annotations

from fleetwave.domain.workflow import DriverOperation, StateDef, WaitMode, WorkflowDef

MINUTE = 60.0
HOUR = 3600.0


def _state(
    name: str,
    timeout_s: float,
    *,
    attempts_max: int = 1,
    backoff_s: float = 10.0,
    skip_when_done: bool = False,
    mode: WaitMode = "run",
) -> StateDef:
    return StateDef(
        name=name,
        action=DriverOperation(name, skip_when_done=skip_when_done),
        timeout_s=timeout_s,
        attempts_max=attempts_max,
        backoff_s=backoff_s,
        backoff_max_s=5 * MINUTE,
        mode=mode,
    )


def builtin_workflows() -> list[WorkflowDef]:
    return [
        WorkflowDef(
            "patch",
            (
                _state("pre-check", 10 * MINUTE, attempts_max=3, skip_when_done=True),
                _state("updating-patches", 30 * MINUTE, attempts_max=3),
                _state("creating-remote-patch-strategy", 10 * MINUTE, attempts_max=3),
                _state("applying-remote-patch-strategy", 2 * HOUR),
                _state("finishing", 10 * MINUTE, attempts_max=3),
            ),
            source="builtin",
            description="Patch each target: check, upload patches, create and apply "
            "the remote patch strategy, clean up.",
        ),
        WorkflowDef(
            "sw-deploy",
            (
                _state("pre-check", 10 * MINUTE, attempts_max=3, skip_when_done=True),
                _state("install-license", 5 * MINUTE, attempts_max=3),
                _state("create-remote-strategy", 15 * MINUTE, attempts_max=3),
                _state("apply-remote-strategy", 3 * HOUR),
                _state("finish", 10 * MINUTE, attempts_max=3),
            ),
            source="builtin",
            description="Deploy a software release: pre-check (skips targets already on "
            "the release), license, remote deploy strategy, finish.",
        ),
        WorkflowDef(
            "firmware",
            (
                _state("importing-firmware", 30 * MINUTE, attempts_max=3, skip_when_done=True),
                _state("creating-fw-update-strategy", 10 * MINUTE, attempts_max=3),
                _state("applying-fw-update-strategy", 3 * HOUR),
                _state("finishing-fw-update", 10 * MINUTE, attempts_max=3),
            ),
            source="builtin",
            description="Update device firmware through a remote firmware update strategy.",
        ),
        WorkflowDef(
            "kube-upgrade",
            (
                _state("pre-check", 10 * MINUTE, attempts_max=3, skip_when_done=True),
                _state("create-kube-upgrade-strategy", 15 * MINUTE, attempts_max=3),
                _state("apply-kube-upgrade-strategy", 4 * HOUR),
            ),
            source="builtin",
            description="Upgrade kubernetes through a remote kube upgrade strategy.",
        ),
        WorkflowDef(
            "clean",
            (
                _state("power-off", 5 * MINUTE, attempts_max=3),
                _state("set-boot-network", 5 * MINUTE, attempts_max=3),
                _state("power-on", 5 * MINUTE, attempts_max=3),
                _state("wait-for-agent", 30 * MINUTE, mode="wait-for-callback"),
                _state("clean-steps", 2 * HOUR, mode="wait-for-callback"),
                _state("final-power-off", 5 * MINUTE, attempts_max=3),
                _state("mark-available", 5 * MINUTE, attempts_max=3),
            ),
            source="builtin",
            description="Clean a bare-metal node: network boot its agent, wait for the "
            "agent's callback, run the clean steps (the agent reports when done), power off.",
        ),
    ]
