"""What a conductor is given and what it counts: :class:`EngineConfig` (its settings,
and the lease lengths it may be given) and :class:`EngineStats` (its counters).

Usage::

    Conductor(store, config=EngineConfig(lease_ttl_s=60.0))
"""

from __future__ import annotations

from dataclasses import dataclass, field

#: lease lengths a conductor may be given (``--lease-ttl``), seconds
#: (the watchdog stops actions at 80 % of the lease, up to a tick and a few busy
#: timeouts (a twentieth each) late: under 15 s that could be after it ran out)
LEASE_TTL_MIN_S = 15.0
LEASE_TTL_MAX_S = 3600.0


#: :attr:`EngineConfig.batch_max` on SQLite
BATCH_MAX_EMBEDDED = 128
#: :attr:`EngineConfig.batch_max` on PostgreSQL: a commit's round trips, its BEGIN with
#: the write lock, fence read and COMMIT are shared by twice as many transitions
BATCH_MAX_SERVER = 256


@dataclass
class EngineConfig:
    #: how long a strategy's lease (and its steps') lasts unless renewed: a conductor
    #: that died on another host is taken over this long after its last renewal
    lease_ttl_s: float = 30.0
    tick_s: float = 1.0
    #: SQLite: look this often for callbacks another process stored (the API served
    #: from a process of its own: ``serve --listen``), with one cheap read of the
    #: highest callback id; None: at each periodic pass only (PostgreSQL's NOTIFY
    #: wakes the conductor at once)
    callback_watch_s: float | None = None
    seed: int = 0
    #: record each dispatch latency (commit done -> action started), seconds
    measure_latency: bool = False
    #: most transitions per group commit: bounds how many actions one commit releases
    #: at once, and so the dispatch latency of the last of them. 0: by the database,
    #: :data:`BATCH_MAX_EMBEDDED` on SQLite, :data:`BATCH_MAX_SERVER` on PostgreSQL,
    #: whose commits cost more round trips each (see docs/benchmarks.md)
    batch_max: int = 0
    #: waiting steps loaded from the database at a time when free slots need them
    #: (0: twice max parallel, at least 512): the first actions start without loading
    #: the whole strategy first. The first load takes just enough to fill the window.
    waiting_page: int = 0
    #: while the dispatcher is idle, waiting steps are topped up this many at a time
    #: (0: as ``waiting_page``), so a busy moment rarely has to stop for a page load
    prefetch_page: int = 128
    #: on a clean stop, how long running actions may take to finish and commit
    shutdown_grace_s: float = 10.0
    #: how long an action cancelled (its deadline, a stop) has to end before it is
    #: abandoned (it catches CancelledError): its step fails, or its lease is left to
    #: run out
    abandon_after_s: float = 10.0
    #: a database error that is not an outage is retried this many times before the
    #: conductor stops
    store_retries_max: int = 8
    #: an outage (locked, busy, unreachable, full, read-only) is retried for as long as
    #: it lasts (the lease watchdog stops the actions meanwhile); False: as any error
    ride_out_outages: bool = True
    #: after a takeover, the recover hook gets what is left of the state's recorded
    #: deadline plus this much (to observe the target even when the deadline has passed)
    recover_grace_s: float = 30.0
    #: after loading a strategy, move what is loaded out of the collector's sight
    #: (gc.freeze): full collections otherwise rescan every loaded step, pausing
    #: dispatch for 50-200 ms at a time, while they find almost nothing to free. Given
    #: back to the collector when a strategy ends and when the conductor stops (what
    #: a freeze holds is never freed otherwise, if it is part of a reference cycle)
    gc_freeze: bool = True
    #: False makes a stalled conductor (a long GC pause, SIGSTOP, a partition from the
    #: database): it keeps running but stops renewing its leases. For fault injection.
    renew_leases: bool = True
    #: seconds to wait between a claim's commit and adopting the strategy (a slow adopt:
    #: a page load behind a busy disk, a pause of the process). For fault injection.
    adopt_stall_s: float = 0.0
    #: conductors share strategies: this one drives steps of strategies others lead,
    #: beside them, and claims the waiting steps it starts (None: when it serves every
    #: strategy on PostgreSQL, where conductors on several hosts are expected)
    share: bool | None = None


@dataclass
class EngineStats:
    transitions: int = 0
    batches: int = 0
    rejected: int = 0
    stale_outcomes: int = 0
    store_retries: int = 0
    #: strategies claimed from another conductor (its lease taken over)
    takeovers: int = 0
    #: outages met by store calls (the database locked, busy or unreachable; ridden
    #: out), and since when (loop time) the one going on has lasted, if any
    store_outages: int = 0
    outage_since: float | None = None
    dispatch_latency_s: list[float] = field(default_factory=list)
