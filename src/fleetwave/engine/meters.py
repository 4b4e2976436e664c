"""What a conductor counts for ``/metrics``, in plain ints on its own loop.

The hot path commits some 60,000 transitions a second: a call into a metrics library
per transition would cost more than the bookkeeping it measures. A conductor given a
:class:`Meters` (``fleetwave serve --listen``) adds to dicts and lists of ints here, once
per commit and once per action; the API's collector (:mod:`fleetwave.api.metrics`)
reads them when scraped. A conductor without one counts nothing.
"""

from __future__ import annotations

import re
from bisect import bisect_left
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

#: upper bounds (seconds) of the dispatch latency histogram: from a commit to the next
#: action's start, microseconds when all is well
DISPATCH_BUCKETS_S = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.1, 1.0)
#: ... of the commit latency histogram: one group commit, an fsync or a network round trip
COMMIT_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0, 5.0)
#: ... of the commit batch size histogram (transitions, events and marks of one commit)
BATCH_BUCKETS = (1, 2, 5, 10, 25, 50, 100, 250, 500, 1000, 2500)


@dataclass(slots=True)
class Histogram:
    """Counts by bucket (the last counts what is above every bound), and their sum."""

    bounds: Sequence[float]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.total += value

    def cumulative(self) -> list[tuple[str, int]]:
        """``(le, count)`` pairs as Prometheus has them, ``+Inf`` last."""
        out, running = [], 0
        for bound, n in zip([*map(str, self.bounds), "+Inf"], self.counts, strict=True):
            running += n
            out.append((bound, running))
        return out


#: a callback's reason for being ignored, by its first words (bounded: the reason's
#: text names steps and states)
_REASONS = (
    ("duplicate", "duplicate"),
    ("late", "late"),
    ("its step's state ended first", "state_ended_first"),
    ("its step ended", "step_ended_first"),
    ("its step is not under way", "step_not_under_way"),
    ("strategy aborted before it started", "strategy_ended"),
    ("strategy ended first", "strategy_ended"),
)
_DOES_NOT_WAIT = re.compile(r"state .* does not wait for callbacks")


def reason_class(reason: str) -> str:
    """A label for why a callback was ignored, from a few known ones (``other``)."""
    for start, label in _REASONS:
        if reason.startswith(start) or reason.startswith(f"ignored: {start}"):
            return label
    if _DOES_NOT_WAIT.search(reason):
        return "state_does_not_wait"
    return "other"


@dataclass(slots=True)
class Meters:
    """A conductor's counts since it started."""

    #: transitions written, by (workflow, state entered)
    transitions: dict[tuple[str, str], int] = field(default_factory=dict)
    #: callbacks answered by the dispatcher, by (outcome, reason class)
    callbacks: dict[tuple[str, str], int] = field(default_factory=dict)
    dispatch_s: Histogram = field(default_factory=lambda: Histogram(DISPATCH_BUCKETS_S))
    commit_s: Histogram = field(default_factory=lambda: Histogram(COMMIT_BUCKETS_S))
    batch_size: Histogram = field(default_factory=lambda: Histogram(BATCH_BUCKETS))

    def committed(
        self,
        workflow_of: dict[int, str],
        written: Iterable[tuple[int, str]],
        marks: Iterable[tuple[str, str]],
        size: int,
        elapsed_s: float,
    ) -> None:
        """One commit: ``written``, the (strategy, state entered) of each transition it
        wrote; ``marks``, each callback's (outcome, reason)."""
        counts = self.transitions
        for sid, state in written:
            key = (workflow_of.get(sid, "?"), state)
            counts[key] = counts.get(key, 0) + 1
        answered = self.callbacks
        for outcome, reason in marks:
            key = (outcome, "" if outcome == "applied" else reason_class(reason))
            answered[key] = answered.get(key, 0) + 1
        self.batch_size.observe(size)
        self.commit_s.observe(elapsed_s)
