"""The one schema, shared by SQLite and PostgreSQL (SQLAlchemy 2 Core).

Times are float seconds since the epoch, from the engine's clock. The journal's
unique key on (step_id, to_state, visit) is guarantee G1 in the database itself: a
state is entered once per visit (once, but for the states of a bounded cycle).
"""

from __future__ import annotations

from sqlalchemy import (
    Boolean,
    Column,
    Float,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Table,
    Text,
    UniqueConstraint,
    false,
)

metadata = MetaData()

conductors = Table(
    "conductors",
    metadata,
    Column("id", String(64), primary_key=True),
    Column("hostname", String(255), nullable=False),
    Column("pid", Integer, nullable=False),
    Column("started_at", Float, nullable=False),
    Column("heartbeat_at", Float, nullable=False),
    Column("stopped_at", Float),
    #: ``fleetwave serve`` (every applying strategy), not a conductor started for some
    Column("serves_all", Boolean, nullable=False, server_default=false()),
    #: the clock its leases are written on (see fleetwave.engine.clock): a lease is
    #: compared only with a reading of the same clock
    Column("lease_clock", String(80)),
    #: when it began a clean stop (it starts nothing new, then hands its leases back)
    Column("draining_at", Float),
    #: its own lease, on its lease clock: the steps it drives of strategies another
    #: conductor leads are held under it (renewed with its strategies' leases)
    Column("lease_until", Float),
)

groups = Table(
    "groups",
    metadata,
    Column("id", Integer, primary_key=True),
    Column("name", String(255), nullable=False, unique=True),
    Column("max_parallel", Integer, nullable=False),
    Column("apply_type", String(16), nullable=False),
    #: its place in a rollout by stages (``--stages-by-group``): by this, then by name;
    #: groups without one come after those with one
    Column("stage_order", Integer),
)

targets = Table(
    "targets",
    metadata,
    Column("id", Integer, primary_key=True),
    Column("name", String(255), nullable=False, unique=True),
    Column("group_id", Integer, ForeignKey("groups.id"), index=True),
    Column("driver", String(64), nullable=False),
    Column("settings", Text, nullable=False, default="{}"),
    Column("managed", Boolean, nullable=False, default=True),
    Column("labels", Text, nullable=False, default="{}"),
    Column("created_at", Float, nullable=False),
)

workflows = Table(
    "workflows",
    metadata,
    Column("name", String(255), primary_key=True),
    Column("version", Integer, nullable=False),
    Column("source_yaml", Text, nullable=False),
    Column("created_at", Float, nullable=False),
)

strategies = Table(
    "strategies",
    metadata,
    Column("id", Integer, primary_key=True),
    Column("workflow", String(255), nullable=False),
    Column("workflow_version", Integer, nullable=False),
    Column("states", Text, nullable=False),  # JSON list: the workflow's states, for check
    Column("workflow_yaml", Text),  # a YAML workflow's text as it was at creation
    Column("state", String(32), nullable=False),
    Column("options", Text, nullable=False),  # JSON StrategyOptions
    Column("group_caps", Text, nullable=False),  # JSON {group_id: cap}
    Column("step_count", Integer, nullable=False),
    Column("details", Text, nullable=False, default=""),
    Column("created_at", Float, nullable=False),
    Column("updated_at", Float, nullable=False),
    Column("owner", String(64)),
    Column("fence", Integer, nullable=False, default=0),
    Column("lease_expires_at", Float),
    #: when ``strategy delete`` began (its state ``deleting``, then ``deleted``): its
    #: steps move to ``deleted_steps``, its journal, attempts, events and callbacks stay
    #: for audit until ``fleetwave prune``; ``updated_at`` keeps when it ended
    Column("deleted_at", Float),
    #: a deleted strategy's state when it was deleted (initial, complete, failed, aborted)
    Column("deleted_from", String(32)),
)

#: on PostgreSQL its pages are left 30 % free (fillfactor 70, migration 0017): a step's
#: row is updated at every transition, and an update that finds room in its page writes
#: no index entries (HOT)
steps = Table(
    "steps",
    metadata,
    Column("id", Integer, primary_key=True),
    Column("strategy_id", Integer, ForeignKey("strategies.id"), nullable=False),
    Column("target_id", Integer, ForeignKey("targets.id"), nullable=False),
    Column("ordinal", Integer, nullable=False),
    Column("stage", Integer, nullable=False),
    Column("group_id", Integer),
    Column("state", String(64), nullable=False),
    Column("details", Text, nullable=False, default=""),
    Column("started_at", Float),
    Column("finished_at", Float),
    Column("attempt", Integer, nullable=False, default=0),
    Column("fence", Integer, nullable=False, default=0),
    #: the conductor that owns it while it is in one of its workflow's states: every
    #: write of the row checks it (a step is held under its strategy's lease)
    Column("owner", String(64)),
    #: entered ``state`` while its conductor was stopping: the action never started
    Column("not_started", Boolean, nullable=False, server_default=false()),
    #: when ``state`` runs out of time (its first attempt), by the engine's clock
    Column("deadline_at", Float),
    #: which visit of ``state`` this is (1 but for a state on a bounded cycle, entered
    #: again): every compare-and-set checks it with the state and fence
    Column("visit", Integer, nullable=False, server_default="1"),
    #: the visits so far of the states that count them (JSON {state: n}), NULL until a
    #: step enters one
    Column("visits", Text),
    Index("ix_steps_strategy_ordinal", "strategy_id", "ordinal"),
    Index("ix_steps_target", "target_id"),
)

#: the steps of deleted strategies, as they ended (no working columns: owner, fence,
#: deadline), with their target's name as it was: the target may be deleted later, and
#: the history of a deleted strategy still names it. Dropped by ``fleetwave prune``
deleted_steps = Table(
    "deleted_steps",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=False),
    Column("strategy_id", Integer, nullable=False),
    Column("target_id", Integer, nullable=False),
    Column("target", String(255), nullable=False),
    Column("ordinal", Integer, nullable=False),
    Column("stage", Integer, nullable=False),
    Column("group_id", Integer),
    Column("state", String(64), nullable=False),
    Column("details", Text, nullable=False, default=""),
    Column("started_at", Float),
    Column("finished_at", Float),
    Column("attempt", Integer, nullable=False, default=0),
    Index("ix_deleted_steps_strategy_ordinal", "strategy_id", "ordinal"),
)

#: a strategy's slots (G7): a row for the whole strategy (``group_id`` 0) and one for
#: each group it has steps of, each with its cap and the steps in flight (entered a
#: workflow state and not ended), and on the strategy's row its failed steps. Written
#: in the same commit as the entries and ends it counts, and checked there: an entry
#: that would take a strategy or a group past its cap is not written, whichever
#: conductor made it (see DESIGN.md, "How a step moves")
strategy_slots = Table(
    "strategy_slots",
    metadata,
    Column("strategy_id", Integer, primary_key=True),
    Column("group_id", Integer, primary_key=True, autoincrement=False),
    Column("cap", Integer, nullable=False),
    Column("in_flight", Integer, nullable=False, default=0),
    Column("failed", Integer, nullable=False, default=0),
)

journal = Table(
    "journal",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("strategy_id", Integer, nullable=False),
    Column("step_id", Integer, nullable=False),
    Column("at", Float, nullable=False),
    Column("conductor", String(64), nullable=False),
    Column("from_state", String(64), nullable=False),
    Column("to_state", String(64), nullable=False),
    Column("fence", Integer, nullable=False),
    Column("details", Text, nullable=False, default=""),
    #: which visit of ``to_state`` the entry is (1 but on a bounded cycle; 1 for an end)
    Column("visit", Integer, nullable=False, server_default="1"),
    UniqueConstraint("step_id", "to_state", "visit", name="uq_journal_step_state_visit"),
    Index("ix_journal_strategy", "strategy_id", "id"),
)

#: one row per attempt of a state sent to a target after its first, written (committed)
#: before it is sent: the unique key means no attempt is sent twice (G1 at the target).
#: A state's first attempt is its entry in the journal (unique on step, state and visit),
#: and has a row here only when the state was entered by a conductor that was
#: stopping and started by the next owner (``afresh``)
attempts = Table(
    "attempts",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("strategy_id", Integer, nullable=False),
    Column("step_id", Integer, nullable=False),
    Column("state", String(64), nullable=False),
    Column("attempt", Integer, nullable=False),
    Column("at", Float, nullable=False),
    Column("conductor", String(64), nullable=False),
    Column("fence", Integer, nullable=False),
    #: retry (after a failed attempt), afresh (entered by a conductor that was stopping,
    #: started by the next owner)
    Column("how", String(16), nullable=False),
    #: the visit of ``state`` the attempt is of (see ``steps.visit``)
    Column("visit", Integer, nullable=False, server_default="1"),
    UniqueConstraint("step_id", "state", "visit", "attempt", name="uq_attempts_step_state_visit"),
    Index("ix_attempts_strategy", "strategy_id", "id"),
)

events = Table(
    "events",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("at", Float, nullable=False),
    Column("conductor", String(64)),
    Column("strategy_id", Integer),
    Column("step_id", Integer),
    Column("kind", String(64), nullable=False),
    Column("details", Text, nullable=False, default=""),
    Index("ix_events_strategy", "strategy_id", "id"),
)

callbacks = Table(
    "callbacks",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("strategy_id", Integer, nullable=False),
    Column("step_id", Integer, nullable=False),
    Column("state", String(64), nullable=False),
    Column("kind", String(16), nullable=False),
    Column("details", Text, nullable=False, default=""),
    Column("received_at", Float, nullable=False),
    Column("outcome", String(16)),  # NULL until processed: applied | ignored
    Column("reason", Text),
    Column("processed_at", Float),
    #: the sender's key (an agent over HTTP): a callback sent again with it is not
    #: stored again
    Column("idempotency_key", String(200)),
    #: which visit of ``state`` it reports on (1 but for a state on a bounded cycle): its
    #: agent token's, the one its sender named, else the step's when it was stored
    Column("visit", Integer, nullable=False, server_default="1"),
    Index("ix_callbacks_open", "strategy_id", "outcome", "id"),
    Index("uq_callbacks_step_key", "step_id", "idempotency_key", unique=True),
)

#: the last id handed out per table whose ids must never come back (SQLite gives a new
#: row the highest id plus one, so deleting the newest strategy would free its id and
#: its steps' for the next: "strategy 12" would mean two rollouts, and a late callback
#: for a deleted step would move another strategy's step)
id_counters = Table(
    "id_counters",
    metadata,
    Column("name", String(64), primary_key=True),
    Column("last_id", Integer, nullable=False),
)

#: bearer tokens of the REST API (``fleetwave token create``): a name, a role, and only
#: the SHA-256 of the token (it is shown once, when created); kept when revoked (the
#: changes made with it name it)
api_tokens = Table(
    "api_tokens",
    metadata,
    Column("id", Integer, primary_key=True),
    Column("name", String(255), nullable=False, unique=True),
    Column("role", String(16), nullable=False),
    Column("hash", String(64), nullable=False, unique=True),
    Column("created_at", Float, nullable=False),
    Column("expires_at", Float),
    Column("revoked_at", Float),
)

#: the token a step's wait-for-callback state gives its target's agent (one per step
#: and state, issued when the state is entered): only its SHA-256; it answers for that
#: step and state alone, and no longer once the state has ended
agent_tokens = Table(
    "agent_tokens",
    metadata,
    Column("id", Integer, primary_key=True),
    Column("strategy_id", Integer, nullable=False),
    Column("step_id", Integer, nullable=False),
    Column("state", String(64), nullable=False),
    Column("hash", String(64), nullable=False, unique=True),
    Column("issued_at", Float, nullable=False),
    Column("expires_at", Float),
    #: the visit of ``state`` it answers for: a callback sent with it reports on that
    #: visit, never on a later one (a late agent's is recorded, and ignored as late)
    Column("visit", Integer, nullable=False, server_default="1"),
    UniqueConstraint("step_id", "state", "visit", name="uq_agent_tokens_step_state_visit"),
    Index("ix_agent_tokens_strategy", "strategy_id"),
)
