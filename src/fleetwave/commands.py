"""What each command that changes something does and answers, as one dict: the JSON
that ``fleetwave ... --format json`` prints and that the REST API returns (one shape,
made in one place).

Each function is the store's write (:mod:`fleetwave.store.admin`) plus the answer;
the CLI words its table-format line from the same dict. Blocking (one or a few
transactions): the API runs them in a thread.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from fleetwave.cli.parsing import check_target
from fleetwave.domain.errors import Conflict, InputError, NotFound
from fleetwave.domain.models import ApplyType, StrategyOptions, StrategyState, Target
from fleetwave.domain.registry import get_workflow
from fleetwave.domain.rollout import (
    RolloutSpec,
    parse_amount,
    parse_batches,
    parse_duration,
    parse_stages,
)
from fleetwave.domain.windows import check_times, parse_time, parse_window
from fleetwave.domain.workflow import WorkflowDef
from fleetwave.store import admin, queries, tokens
from fleetwave.store.db import Store
from fleetwave.testing.invariants import CheckResult
from fleetwave.testing.invariants import check as check_invariants


def max_parallel_as_stored(given: int | None, apply_type: ApplyType, what: str) -> int:
    """--max-parallel as stored: serial means one at a time, so a serial group or
    strategy given another number is refused rather than silently run one by one."""
    if apply_type is not ApplyType.SERIAL:
        return admin.DEFAULT_MAX_PARALLEL if given is None else given
    if given is not None and given < 1:
        return given  # refused as every max parallel below 1 is, by the store
    admin.check_serial(given, what)
    return 1


def add_target(store: Store, target: Target) -> dict[str, Any]:
    """``target add``: added, or already there (unchanged)."""
    # (checked against its driver's settings; a secret given in clear sealed)
    target = check_target(target, f"target {target.name}")
    added = bool(admin.ensure_targets(store, [target]))
    return {"name": target.name, "added": added}


def set_managed(store: Store, name: str, managed: bool) -> dict[str, Any]:
    """``target manage`` / ``unmanage``; unmanaging says which steps will fail."""
    waiting = admin.set_managed(store, name, managed)
    if managed:
        return {"name": name, "managed": True}
    return {"name": name, "managed": False, "steps_to_fail": waiting}


def change_target(store: Store, name: str, **changes: Any) -> dict[str, Any]:
    """``target set``: what changed, field by field (see :func:`admin.change_target`)."""
    changed = admin.change_target(
        store, name, check=lambda t: check_target(t, f"target {name}"), **changes
    )
    return {"name": name, "changed": bool(changed), "changes": changed}


def delete_target(store: Store, name: str, *, ignore_missing: bool = False) -> dict[str, Any]:
    """``target delete``: deleted, or (``ignore_missing``) not there."""
    try:
        admin.delete_target(store, name)
    except NotFound:
        if not ignore_missing:
            raise
        return {"name": name, "deleted": False}
    return {"name": name, "deleted": True}


def failed_targets(
    store: Store,
    failed_in: int,
    *,
    target_names: list[str] | None = None,
    group: str | None = None,
    all_targets: bool = False,
    labels: dict[str, str] | None = None,
) -> list[str]:
    """``strategy create --failed-in ID``: the targets whose step there failed or was
    aborted (a retry); it picks them itself, so no other choice of targets is taken."""
    if target_names is not None or group is not None or all_targets or labels:
        raise InputError(
            "--failed-in: picks the targets itself; not with --targets, --group, --all or --label"
        )
    names = queries.ended_badly_in(store, failed_in)
    if not names:
        raise InputError(f"--failed-in: strategy {failed_in} has no failed or aborted step")
    return names


def check_timeouts(wf: WorkflowDef, timeouts_s: dict[str, float]) -> None:
    """``--timeout STATE=SECONDS``: each a state of the workflow."""
    unknown = [state for state in timeouts_s if state not in wf.state_names]
    if unknown:
        raise InputError(
            f"--timeout: {', '.join(unknown)}: workflow {wf.name} has no such state "
            f"(its states: {', '.join(wf.state_names)})"
        )


def strategy_options(
    *,
    max_parallel: int | None = None,
    apply_type: ApplyType = ApplyType.PARALLEL,
    stop_on_failure: bool = False,
    max_failures: str | None = None,
    stages_by_group: bool = False,
    timeouts_s: dict[str, float] | None = None,
    stages: Sequence[str] = (),
    batches: str | None = None,
    canary: str | None = None,
    canary_label: dict[str, str] | None = None,
    stage_max_failures: str | None = None,
    stage_wait: str | None = None,
    stage_approval: bool = False,
    start_after: str | None = None,
    windows: Sequence[str] = (),
    deadline: str | None = None,
) -> tuple[StrategyOptions, RolloutSpec]:
    """``strategy create``'s options as given (text, as typed), checked: the strategy's
    options and its rollout's order. Bad input is refused naming the command line's
    option (``--canary: ...``), through the command line and the API alike."""
    limit = parse_amount(max_failures, "--max-failures") if max_failures is not None else None
    opts = StrategyOptions(
        max_parallel=max_parallel_as_stored(max_parallel, apply_type, "strategy"),
        apply_type=apply_type,
        stop_on_failure=stop_on_failure,
        max_failures=limit.count if limit is not None else None,
        stages_by_group=stages_by_group,
        timeouts_s=dict(timeouts_s or {}),
        max_failures_percent=limit.text if limit is not None and limit.count is None else "",
        stages=[list(s) for s in parse_stages(stages)],
        batches=batches or "",
        canary=canary or "",
        canary_label=dict(canary_label or {}),
        stage_max_failures=stage_max_failures or "",
        stage_wait_s=parse_duration(stage_wait, "--stage-wait") if stage_wait else 0.0,
        stage_approval=stage_approval,
        **_times(start_after, windows, deadline),
    )
    return opts, _rollout_spec(opts)


def _times(start_after: str | None, windows: Sequence[str], deadline: str | None) -> dict[str, Any]:
    """``--start-after``, ``--window`` and ``--deadline`` as options, checked: a deadline
    passed or before the start, and windows that never open before it, are refused."""
    after = parse_time(start_after, "--start-after") if start_after is not None else None
    until = parse_time(deadline, "--deadline") if deadline is not None else None
    parsed = [parse_window(w) for w in windows]
    check_times(after, parsed, until, time.time())
    return {"start_after": after, "windows": [w.text for w in parsed], "deadline": until}


def _rollout_spec(opts: StrategyOptions) -> RolloutSpec:
    """The rollout's order as asked in ``opts`` (checked: bad sizes and limits refused)."""
    if opts.stages and opts.stages_by_group:
        raise InputError("--stage and --stages-by-group: give one of them")
    return RolloutSpec(
        stages=[tuple(s) for s in opts.stages],
        stages_by_group=opts.stages_by_group,
        batches=parse_batches(opts.batches) if opts.batches else [],
        canary=parse_amount(opts.canary, "--canary", least=1) if opts.canary else None,
        canary_label=opts.canary_label,
        stage_max_failures=(
            parse_amount(opts.stage_max_failures, "--stage-max-failures")
            if opts.stage_max_failures
            else None
        ),
    )


def create_strategy(
    store: Store,
    wf: WorkflowDef,
    opts: StrategyOptions,
    *,
    target_names: list[str] | None = None,
    group: str | None = None,
    all_targets: bool = False,
    labels: dict[str, str] | None = None,
    failed_in: int | None = None,
    spec: RolloutSpec | None = None,
) -> dict[str, Any]:
    """``strategy create``: the new strategy as ``strategy show`` has it (the targets
    of ``failed_in`` are picked by :func:`failed_targets` first; ``spec``: its stages,
    batches and canaries)."""
    check_timeouts(wf, opts.timeouts_s)
    sid = admin.create_strategy(
        store,
        wf,
        opts,
        target_names=target_names,
        group=group,
        all_targets=all_targets,
        labels=labels or {},
        failed_in=failed_in,
        # (a built-in or plug-in workflow of that name comes first: then not the store's)
        workflow_from_store=get_workflow(wf.name) is None,
        spec=spec,
    )
    return queries.get_strategy(store, sid)


def apply_strategy(store: Store, sid: int) -> dict[str, Any]:
    """``strategy apply`` (without ``--wait``): its state now, the state it was in, and
    who drives it (as ``strategy show`` says it)."""
    before = admin.apply_strategy(store, sid)
    now = "applying" if before in ("initial", "paused", "applying") else before
    return {"id": sid, "state": now, "was": before, "driven_by": queries.driving(store, sid).text}


def pause_strategy(store: Store, sid: int) -> dict[str, Any]:
    before = admin.pause_strategy(store, sid)
    return {"id": sid, "state": "paused", "was": str(before)}


def resume_strategy(store: Store, sid: int) -> dict[str, Any]:
    before = admin.resume_strategy(store, sid)
    return {"id": sid, "state": "applying", "was": str(before)}


def abort_strategy(store: Store, sid: int) -> dict[str, Any]:
    """``strategy abort``: its state now (aborted at once when it was never applied), and
    whether this call asked for the abort (False: one was asked for before)."""
    before = admin.request_abort(store, sid)
    after: dict[str | None, str] = {
        None: StrategyState.ABORT_REQUESTED.value,
        StrategyState.INITIAL.value: StrategyState.ABORTED.value,
    }
    return {
        "id": sid,
        "state": after.get(before, str(before)),
        "asked_now": before is None or before == StrategyState.INITIAL,
    }


def delete_strategy(store: Store, sid: int, *, ignore_missing: bool = False) -> dict[str, Any]:
    try:
        admin.delete_strategy(store, sid)
    except NotFound:
        if not ignore_missing:
            raise
        return {"id": sid, "deleted": False}
    return {"id": sid, "deleted": True}


def check(store: Store, strategy: int | None = None) -> tuple[CheckResult, dict[str, Any]]:
    """``fleetwave check``: G1, G3, G7 and G8 verified from the journal, and notes on
    work left waiting (an applying strategy no conductor drives); the result, and the
    answer (``ok`` says whether the guarantees held)."""
    if strategy is not None:
        queries.strategy_exists(store, strategy)
    result = check_invariants(store, strategy)
    if strategy is not None and result.deleting:
        raise Conflict(
            f"strategy {strategy}: is being deleted (part of its journal is gone already); "
            f"'fleetwave strategy delete {strategy}' finishes it"
        )
    return result, result.to_json() | {"notes": _undriven_notes(store, strategy)}


def _undriven_notes(store: Store, only: int | None) -> list[str]:
    """Strategies that should be moving and that no conductor drives nor will claim (a
    conductor killed, none serving): not a violation, but work left waiting."""
    notes = []
    for row in queries.list_strategies(store, brief=True):
        sid = int(row["id"])
        if (only is not None and sid != only) or row["state"] not in (
            StrategyState.APPLYING,
            StrategyState.ABORT_REQUESTED,
            StrategyState.ABORTING,
        ):
            continue
        who = queries.driving(store, sid)
        if who.nobody:
            notes.append(
                f"strategy {sid} is {row['state']} and no conductor drives it: it goes on "
                f"once 'fleetwave serve' runs (or 'fleetwave strategy apply {sid} --wait')"
            )
    return notes


def create_token(
    store: Store, name: str, role: tokens.Role, expires_s: float | None
) -> dict[str, Any]:
    """``token create``: the token (shown this once), its name, role and expiry."""
    now = time.time()
    expires_at = now + expires_s if expires_s is not None else None
    token = tokens.create_token(store, name, role, expires_at, now)
    return {"name": name, "role": role.value, "token": token, "expires_at": expires_at}


def revoke_token(store: Store, name: str) -> dict[str, Any]:
    """``token revoke``: revoked, and whether by this call."""
    return {"name": name, "revoked": True, "revoked_now": tokens.revoke_token(store, name)}
