"""Read models for the CLI and API: plain dicts, ready to print as a table or JSON.

By what they read: :mod:`.inventory` (groups, targets), :mod:`.conductors` (who
serves, who drives a strategy), :mod:`.strategies` (lists, ``strategy show``),
:mod:`.steps` (steps, their history, attempts and events), and :mod:`.common` (what
those share: paging, kept strategies). Each public read is named here too, as callers
use it (``queries.get_strategy``)."""

from fleetwave.store.queries.common import (
    KEPT_STATES,
    PAGE_ROWS,
    Page,
    steps_ended,
)
from fleetwave.store.queries.conductors import (
    SERVING_WITHIN_S,
    Driving,
    conductor_named,
    driving,
    list_conductors,
    running_conductors,
    serving_conductors,
    shown_host,
)
from fleetwave.store.queries.inventory import (
    get_group,
    get_target,
    iter_targets,
    list_groups,
    list_targets,
    targets_page,
)
from fleetwave.store.queries.steps import (
    ATTEMPT_WORDS,
    EVENT_KINDS,
    events_page,
    get_step,
    history,
    history_page,
    iter_events,
    iter_history,
    iter_steps,
    list_steps,
    step_attempts,
    step_callbacks,
    step_events,
    steps_page,
    strategy_events,
)
from fleetwave.store.queries.strategies import (
    callback_states,
    deleted_note,
    ended_badly_in,
    get_strategy,
    list_strategies,
    step_counts,
    strategy_exists,
    strategy_workflow,
)

__all__ = [
    "ATTEMPT_WORDS",
    "EVENT_KINDS",
    "KEPT_STATES",
    "PAGE_ROWS",
    "SERVING_WITHIN_S",
    "Driving",
    "Page",
    "callback_states",
    "conductor_named",
    "deleted_note",
    "driving",
    "ended_badly_in",
    "events_page",
    "get_group",
    "get_step",
    "get_strategy",
    "get_target",
    "history",
    "history_page",
    "iter_events",
    "iter_history",
    "iter_steps",
    "iter_targets",
    "list_conductors",
    "list_groups",
    "list_steps",
    "list_strategies",
    "list_targets",
    "running_conductors",
    "serving_conductors",
    "shown_host",
    "step_attempts",
    "step_callbacks",
    "step_counts",
    "step_events",
    "steps_ended",
    "steps_page",
    "strategy_events",
    "strategy_exists",
    "strategy_workflow",
    "targets_page",
]
