"""Engine-side queries: conductors, leases, claims, loading work, taking steps over.

The hot path, the group commit of transitions, is :mod:`fleetwave.store.writer`
(re-exported here: ``runtime.TransitionWriter``, ``runtime.Transition``, ...).

By what they read and write: :mod:`.records` (the records given and the rows they come
from), :mod:`.conductors` (registration, heartbeats, who is gone), :mod:`.strategies`
(claims, state, end, phases), :mod:`.steps` (loading, claiming, taking over) and
:mod:`.sharing` (conductors sharing a strategy). Callers use the names here
(``rt.heartbeat``): tests replace them on this module, and the engine calls them
through it.
"""

from __future__ import annotations

from fleetwave.store.runtime.conductors import (
    ConductorUnknown,
    conductor_gone,
    dead_conductors,
    heartbeat,
    live_peers,
    mark_draining,
    register_conductor,
    release_conductor,
    release_strategy,
    server_time,
)
from fleetwave.store.runtime.records import (
    DRIVEN_STATES,
    HOSTNAME,
    PeerView,
    StepRecord,
    StrategyRecord,
    UnreadableRow,
    stored_json,
    strategy_layout,
)
from fleetwave.store.runtime.sharing import (
    failed_counts,
    gone_holders,
    let_go_of_undriven,
    open_elsewhere,
    serving_peers,
    strategies_held,
    strategies_to_help,
    take_from_gone_peers,
)
from fleetwave.store.runtime.steps import (
    claim_waiting_steps,
    load_open_steps,
    load_started_steps,
    load_steps,
    load_waiting_steps,
    release_waiting_steps,
    take_over_steps,
)
from fleetwave.store.runtime.strategies import (
    claim_strategies,
    end_strategy,
    failed_by_stage,
    failure_past_limit,
    gate_facts,
    hold_for_approval,
    recount_slots,
    set_strategy_details,
    set_strategy_state,
    strategy_state,
    strategy_states,
)
from fleetwave.store.writer import (
    HOLD_ENTRIES,
    SHARED,
    SHARED_STATES,
    AttemptDeadline,
    CallbackMark,
    CommitResult,
    Event,
    StopRule,
    Transition,
    TransitionWriter,
)

__all__ = [
    "DRIVEN_STATES",
    "HOLD_ENTRIES",
    "HOSTNAME",
    "SHARED",
    "SHARED_STATES",
    "AttemptDeadline",
    "CallbackMark",
    "CommitResult",
    "ConductorUnknown",
    "Event",
    "PeerView",
    "StepRecord",
    "StopRule",
    "StrategyRecord",
    "Transition",
    "TransitionWriter",
    "UnreadableRow",
    "claim_strategies",
    "claim_waiting_steps",
    "conductor_gone",
    "dead_conductors",
    "end_strategy",
    "failed_by_stage",
    "failed_counts",
    "failure_past_limit",
    "gate_facts",
    "gone_holders",
    "heartbeat",
    "hold_for_approval",
    "let_go_of_undriven",
    "live_peers",
    "load_open_steps",
    "load_started_steps",
    "load_steps",
    "load_waiting_steps",
    "mark_draining",
    "open_elsewhere",
    "recount_slots",
    "register_conductor",
    "release_conductor",
    "release_strategy",
    "release_waiting_steps",
    "server_time",
    "serving_peers",
    "set_strategy_details",
    "set_strategy_state",
    "stored_json",
    "strategies_held",
    "strategies_to_help",
    "strategy_layout",
    "strategy_state",
    "strategy_states",
    "take_from_gone_peers",
    "take_over_steps",
]
