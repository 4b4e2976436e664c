"""``GET /metrics``: Prometheus's text format, through prometheus-client, on the app's
own registry.

The engine's numbers are read when scraped, from the plain counts its conductor keeps
(:class:`fleetwave.engine.meters.Meters`), by a custom collector: nothing of the
metrics library runs on its hot path. The API's own (requests by route and status,
agents' callbacks by answer) are prometheus-client counters: a request costs far more.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from fleetwave.engine.meters import Histogram, Meters

#: the API's routes are under it (fleetwave.api.app)
API_PREFIX = "/v1"

if TYPE_CHECKING:
    from fleetwave.api.service import Service


class EngineCollector(Collector):
    """The conductor's counts, read when scraped (on the loop it runs on)."""

    def __init__(self, service: Service) -> None:
        self.service = service

    def collect(self) -> Iterator[Metric]:
        conductor = self.service.conductor
        if conductor is None or conductor.meters is None:
            return
        meters: Meters = conductor.meters
        transitions = CounterMetricFamily(
            "fleetwave_transitions",
            "Transitions written, by workflow and the state entered",
            labels=["workflow", "state"],
        )
        for (workflow, entered), n in sorted(meters.transitions.items()):
            transitions.add_metric([workflow, entered], n)
        yield transitions
        in_flight = waiting = 0
        for run in list(conductor.runs.values()):
            for fl in list(run.inflight.values()):
                in_flight += 1
                st = run.defs.get(fl.state)
                if st is not None and st.mode == "wait-for-callback":
                    waiting += 1
        yield GaugeMetricFamily(
            "fleetwave_steps_in_flight", "Steps in one of their states here", value=in_flight
        )
        yield GaugeMetricFamily(
            "fleetwave_steps_waiting_for_callback",
            "Steps in flight whose state waits for its target's callback",
            value=waiting,
        )
        yield _histogram(
            "fleetwave_dispatch_latency_seconds",
            "From a commit to the next action's start",
            meters.dispatch_s,
        )
        yield _histogram(
            "fleetwave_commit_seconds", "How long one group commit took", meters.commit_s
        )
        yield _histogram(
            "fleetwave_commit_batch_size",
            "Rows of one group commit (transitions, events, callback answers)",
            meters.batch_size,
        )
        answered = CounterMetricFamily(
            "fleetwave_callbacks_answered",
            "Callbacks the engine applied or ignored (reason: why it ignored one)",
            labels=["outcome", "reason"],
        )
        for (outcome, reason), n in sorted(meters.callbacks.items()):
            answered.add_metric([outcome, reason], n)
        yield answered
        stats = conductor.stats
        yield CounterMetricFamily(
            "fleetwave_store_retries",
            "Store calls that failed and were tried again (outages included)",
            value=stats.store_retries,
        )
        yield CounterMetricFamily(
            "fleetwave_store_outages",
            "Times the database did not answer (locked, busy, unreachable): ridden out",
            value=stats.store_outages,
        )
        since = stats.outage_since
        yield GaugeMetricFamily(
            "fleetwave_store_outage_seconds",
            "How long the database has not answered (0: it answers)",
            # (scraped on the conductor's loop, whose clock the outage is timed on)
            value=0.0 if since is None else max(0.0, asyncio.get_running_loop().time() - since),
        )
        yield CounterMetricFamily(
            "fleetwave_lease_takeovers",
            "Strategies this conductor took over from another (its lease expired)",
            value=stats.takeovers,
        )


class LiveCollector(Collector):
    """The dashboard's live streams (fleetwave.api.live): how many are open, how many
    subjects are read for them, and how many passes those reads made."""

    def __init__(self, service: Service) -> None:
        self.service = service

    def collect(self) -> Iterator[Metric]:
        live = self.service.live
        if live is None:
            return
        yield GaugeMetricFamily(
            "fleetwave_live_streams", "Dashboard pages following a live stream", value=live.streams
        )
        yield GaugeMetricFamily(
            "fleetwave_live_producers",
            "Subjects read live for those pages (one per strategy watched, and the overview)",
            value=len(live.producers),
        )
        yield CounterMetricFamily(
            "fleetwave_live_reads",
            "Passes the live producers made over the store (each a few queries)",
            value=live.reads,
        )
        yield CounterMetricFamily(
            "fleetwave_live_pass_cpu_seconds",
            "CPU seconds the strategies' live passes took in this process (their threads)",
            value=live.pass_cpu_s,
        )


def _histogram(name: str, doc: str, h: Histogram) -> HistogramMetricFamily:
    return HistogramMetricFamily(name, doc, buckets=h.cumulative(), sum_value=h.total)


class ApiMetrics:
    """The app's registry: the engine's collector and the API's own counters."""

    def __init__(self, service: Service) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(EngineCollector(service))
        self.registry.register(LiveCollector(service))
        self.requests = Counter(
            "fleetwave_api_requests",
            "API requests, by route (its template), method and status",
            ["route", "method", "status"],
            registry=self.registry,
        )
        self.callbacks = Counter(
            "fleetwave_api_callbacks",
            "Agents' callbacks by answer: accepted (stored), replayed (same key: not "
            "stored again), late (stored and ignored at once), refused (401, 403)",
            ["answer"],
            registry=self.registry,
        )
        #: each counter's child per labels, found once (a label lookup per callback was
        #: a measurable part of the busiest route)
        self._children: dict[tuple[Counter, tuple[str, ...]], Any] = {}

    def _inc(self, counter: Counter, *labels: str) -> None:
        child = self._children.get((counter, labels))
        if child is None:
            child = self._children[(counter, labels)] = counter.labels(*labels)
        child.inc()

    def callback_answered(self, answer: str) -> None:
        """Count a callback's answer."""
        self._inc(self.callbacks, answer)

    def request_answered(self, route: str, method: str, status: int) -> None:
        """Count a request by its route's template, method and status."""
        self._inc(self.requests, route, method, str(status))

    def text(self) -> bytes:
        return generate_latest(self.registry)


class CountRequests:
    """Count each request by its route's template (bounded: never the raw path)."""

    def __init__(self, app: ASGIApp, metrics: ApiMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = [500]

        async def sent(message: Message) -> None:
            if message["type"] == "http.response.start":
                status[0] = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, sent)
        finally:
            self.metrics.request_answered(route_of(scope), scope.get("method", ""), status[0])


def route_of(scope: Scope) -> str:
    """The template of the route that answered (``/v1/steps/{step_id}``). FastAPI names
    a route of an included router by its own path, without the prefix it was
    included under (in its recent versions)."""
    path = getattr(scope.get("route"), "path", None)
    if not isinstance(path, str):
        return "(unmatched)"
    if scope.get("path", "").startswith(API_PREFIX + "/") and not path.startswith(API_PREFIX):
        return API_PREFIX + path
    return path
