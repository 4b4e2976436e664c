"""The simulated fleet: a driver whose targets behave as their settings say.

Deterministic for a given seed: every random draw comes from a generator seeded
with (seed, target, operation, attempt), so a run replays exactly.

Per-target settings (``fleetwave target add NAME --set key=value``):

===================  =========================================================
``latency_ms``       time an operation takes (default 0): the mean for lognormal
``latency``          ``fixed`` (default), ``uniform`` (0 .. 2 x latency_ms) or
                     ``lognormal`` (median latency_ms, ``latency_sigma`` 0.5)
``failure_rate``     chance an operation fails for good (0..1)
``flaky_rate``       chance an operation fails transiently (retried by policy)
``hang_rate``        chance an operation never returns (exercises timeouts)
``error_rate``       chance the driver itself raises an unexpected exception (a bug)
``fail_at``          a state name: the operation of that state always fails
``fail_visits``      with ``fail_at``: only the state's first N visits fail (a retry
                     loop's later rounds pass); 0, the default: every visit
``hang_at``          a state name: the operation of that state never returns
``already_done``     ``true``: the target reports it is already done (pre-check skips;
                     ``observe`` says so too, for ``skip_if``)
``remote_state``     a state the target reports at ``unexpected_at`` (default: the
                     first operation) that no workflow knows: a clear failure
``callback_fail_rate``  states that wait for a callback: chance it reports failure
``callback_lost_rate``  chance the callback never comes (the state times out)
``callback_dup_rate``   chance the callback is sent twice
``callback_late_rate``  chance an extra copy comes long after the state was left
``callback_url``     the API's base URL (``http://127.0.0.1:8080``): agents call back
                     over HTTP there (below)
===================  =========================================================

For states that wait for a callback, the operation returns at once and the
simulated target's agent reports after the latency: by calling
``callback_sink(step_id, state, kind, details, visit)`` (in the conductor's process), or,
given a ``callback_url``, as a real agent does: ``POST
{callback_url}/v1/steps/{step}/callbacks`` with the agent token the engine issued to
the state (``ActionContext.agent_token``; a recover hook gets none, and the agent keeps
the one it was given), an idempotency key of its own for each report (the same on every
try of it), retrying while the server is unreachable or answers 5xx, and stopping at a
4xx (a refused token: counted in ``callbacks_refused``).
"""

from __future__ import annotations

import asyncio
import heapq
import inspect
import logging
import math
import os
import random
import re
import time
import weakref
from collections import Counter
from collections.abc import Callable, Coroutine
from typing import Any, Literal

import httpx
from pydantic import BaseModel, ConfigDict, Field

from fleetwave.domain.models import Target, shown, typed_as_number
from fleetwave.domain.workflow import ActionContext, RemoteResult, StepFailed, TransientError
from fleetwave.drivers.wakeup import PreciseTimer, on_monotonic_clock

log = logging.getLogger("fleetwave.drivers.sim")

#: the longest simulated operation: a day
MAX_LATENCY_MS = 86_400_000

SETTINGS = (
    "latency_ms",
    "latency",
    "latency_sigma",
    "failure_rate",
    "flaky_rate",
    "hang_rate",
    "error_rate",
    "fail_at",
    "fail_visits",
    "hang_at",
    "already_done",
    "remote_state",
    "unexpected_at",
    "callback_fail_rate",
    "callback_lost_rate",
    "callback_dup_rate",
    "callback_late_rate",
    "callback_url",
)
CALLBACK_RATES = (
    "callback_fail_rate",
    "callback_lost_rate",
    "callback_dup_rate",
    "callback_late_rate",
)
#: (step, state, kind, details, the visit of the state it reports on)
CallbackSink = Callable[[int, str, str, str, int], object]


#: how long a simulated agent keeps trying to deliver its callback (virtual seconds)
AGENT_RETRY_S = 3600.0
#: each HTTP request of an agent that calls back over HTTP (``callback_url``)
AGENT_HTTP_TIMEOUT_S = 10.0
#: what an HTTP agent's send answers when the API refused the report (a 4xx: final)
_REFUSED = object()


class SimSettingError(ValueError):
    pass


def _key(key: str) -> str:
    """A setting's name in a message: as given, unless that would not stay one short line."""
    return key if key and key.isprintable() and len(key) <= 40 else shown(key)


def _float(settings: dict[str, Any], key: str, default: float, lo: float, hi: float) -> float:
    raw = settings.get(key, default)
    try:
        val = float(raw)
    except (TypeError, ValueError):
        raise SimSettingError(f"sim setting {key}: {shown(str(raw))} is not a number") from None
    if not lo <= val <= hi or math.isnan(val):
        # as given (5, not 5.0)
        raise SimSettingError(f"sim setting {key}: {raw} is outside {lo:.15g}..{hi:.15g}")
    return val


def _whole(settings: dict[str, Any], key: str, lo: int, hi: int) -> int:
    """A count: a whole number (2.5 is refused) within ``lo..hi``."""
    val = _float(settings, key, lo, lo, hi)
    if val != int(val):
        raise SimSettingError(f"sim setting {key}: {settings[key]} is not a whole number")
    return int(val)


_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}
#: what a workflow state may be called (as in a YAML workflow)
_STATE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


def _bool(settings: dict[str, Any], key: str) -> bool:
    raw = settings.get(key, False)
    word = str(raw).strip().lower()
    if word not in _TRUE | _FALSE:
        raise SimSettingError(
            f"sim setting {key}: {shown(str(raw))} is not true or false (also yes/no, on/off, 1/0)"
        )
    return word in _TRUE


def _state(settings: dict[str, Any], key: str) -> str | None:
    raw = settings.get(key)
    if raw is None:
        return None
    if not isinstance(raw, str) or not _STATE_NAME.fullmatch(raw):
        raise SimSettingError(f"sim setting {key}: {shown(str(raw))} is not a state name")
    return raw


def _url(settings: dict[str, Any], key: str) -> str | None:
    """An http(s) URL (its trailing ``/`` dropped), or None."""
    raw = settings.get(key)
    if raw is None:
        return None
    text = str(raw).strip()
    try:
        url = httpx.URL(text)
    except (httpx.InvalidURL, TypeError):
        url = None
    if url is None or url.scheme not in ("http", "https") or not url.host or len(text) > 2000:
        raise SimSettingError(f"sim setting {key}: {shown(str(raw))} is not an http(s) URL")
    return text.rstrip("/")


def _remote_state(settings: dict[str, Any]) -> str | None:
    """What the target reports instead of a state a workflow knows: any text a target
    could send (1-255 printable characters; a number is its text), shown in the step's
    details."""
    raw = settings.get("remote_state")
    if raw is None:
        return None
    if isinstance(raw, bool) or not isinstance(raw, str | int | float):
        given = str(raw).lower() if isinstance(raw, bool) else shown(str(raw))  # as typed
        raise SimSettingError(f"sim setting remote_state: {given} is not text")
    text = str(raw)
    if not 1 <= len(text) <= 255 or not text.isprintable() or text != text.strip():
        raise SimSettingError(
            f"sim setting remote_state: {shown(text)} must be 1-255 printable characters, "
            "without leading or trailing spaces"
        )
    return text


#: the settings that are numbers
NUMBERS = (
    "latency_ms",
    "latency_sigma",
    "failure_rate",
    "flaky_rate",
    "hang_rate",
    "error_rate",
    "fail_visits",
    *CALLBACK_RATES,
)


def validate_settings(settings: dict[str, Any]) -> None:
    """Raise :class:`SimSettingError` naming the first bad setting. A number given as
    text (quoted in a YAML file: ``"5"``) is refused: stored as text, the same target
    given as ``--set latency_ms=5`` read as another definition of it."""
    for key in NUMBERS:
        raw = settings.get(key)
        if isinstance(raw, str) and typed_as_number(raw):
            raise SimSettingError(
                f"sim setting {key}: the text {shown(raw)} where a number goes (unquote it)"
            )
    _Profile(settings)


def _rate(what: str) -> Any:
    return Field(default=0.0, ge=0, le=1, description=what)


class SimSettings(BaseModel):
    """The sim driver's settings, as ``driver show sim`` lists them (the checks are
    :func:`validate_settings`, in the sim's own words)."""

    model_config = ConfigDict(extra="forbid")

    latency_ms: float = Field(
        default=0.0, ge=0, le=MAX_LATENCY_MS, description="time each operation takes"
    )
    latency: Literal["fixed", "uniform", "lognormal"] = Field(
        default="fixed",
        description="fixed, uniform (0..2 x latency_ms) or lognormal (median latency_ms)",
    )
    latency_sigma: float = Field(default=0.5, ge=0, le=5, description="lognormal's sigma")
    failure_rate: float = _rate("chance an operation fails for good")
    flaky_rate: float = _rate("chance an operation fails transiently (retried by policy)")
    hang_rate: float = _rate("chance an operation never returns (the timeout ends it)")
    error_rate: float = _rate("chance the driver raises an unexpected exception")
    fail_at: str | None = Field(default=None, description="a state whose operation fails")
    fail_visits: int = Field(
        default=0, ge=0, le=100, description="fail_at fails its first N visits only (0: all)"
    )
    hang_at: str | None = Field(default=None, description="a state whose operation hangs")
    already_done: bool = Field(
        default=False, description="the target reports it is already done (pre-check skips)"
    )
    remote_state: str | None = Field(
        default=None, description="a state the target reports that no workflow knows"
    )
    unexpected_at: str | None = Field(
        default=None, description="where remote_state is reported (default: the first state)"
    )
    callback_fail_rate: float = _rate("a callback reports failure")
    callback_lost_rate: float = _rate("a callback never comes")
    callback_dup_rate: float = _rate("a callback is sent twice")
    callback_late_rate: float = _rate("an extra callback comes long after")
    callback_url: str | None = Field(
        default=None,
        description="the API's base URL: agents POST /v1/steps/{step}/callbacks there "
        "with their agent token (else they call the conductor in its process)",
    )


class _Profile:
    """A target's settings, parsed once."""

    __slots__ = (
        "already_done",
        "callback_rates",
        "callback_url",
        "error",
        "fail_at",
        "fail_visits",
        "failure",
        "flaky",
        "hang",
        "hang_at",
        "kind",
        "latency_s",
        "plain",
        "remote_state",
        "result",
        "sigma",
        "unexpected_at",
    )

    def __init__(self, settings: dict[str, Any]) -> None:
        unknown = set(settings) - set(SETTINGS)
        if unknown:
            raise SimSettingError(
                f"sim setting {_key(sorted(map(str, unknown))[0])}: unknown "
                f"(known: {', '.join(SETTINGS)})"
            )
        if str(settings.get("latency", "fixed")) not in {"fixed", "uniform", "lognormal"}:
            raise SimSettingError(
                f"sim setting latency: {shown(str(settings['latency']))} is not fixed, "
                "uniform or lognormal"
            )
        self.latency_s = _float(settings, "latency_ms", 0, 0, MAX_LATENCY_MS) / 1000.0
        self.kind = str(settings.get("latency", "fixed"))
        self.sigma = _float(settings, "latency_sigma", 0.5, 0, 5)
        self.failure = _float(settings, "failure_rate", 0, 0, 1)
        self.flaky = _float(settings, "flaky_rate", 0, 0, 1)
        self.hang = _float(settings, "hang_rate", 0, 0, 1)
        self.error = _float(settings, "error_rate", 0, 0, 1)
        self.fail_at = _state(settings, "fail_at")
        self.fail_visits = _whole(settings, "fail_visits", 0, 100)
        self.hang_at = _state(settings, "hang_at")
        self.already_done = _bool(settings, "already_done")
        self.remote_state = _remote_state(settings)
        self.unexpected_at = _state(settings, "unexpected_at")
        self.callback_rates = {k: _float(settings, k, 0, 0, 1) for k in CALLBACK_RATES}
        self.callback_url = _url(settings, "callback_url")
        #: what every operation reports when nothing about the state can change it
        #: (no remote_state, no fail_at): asked once here, not at each operation's end
        self.result: RemoteResult | None = None
        if self.remote_state is None and self.fail_at is None:
            self.result = RemoteResult.ALREADY_DONE if self.already_done else RemoteResult.DONE
        self.plain = (
            self.failure == 0
            and self.flaky == 0
            and self.hang == 0
            and self.error == 0
            and self.kind == "fixed"
            and self.hang_at is None
        )


class _Sleeps:
    """The targets' simulated latencies, on one timer.

    A simulated fleet has thousands of operations sleeping at once: one heap of
    (due, seq, future) and one timer for its earliest entry cost less per operation
    than a loop timer each (about 7 % of the CPU of a 20 ms-latency rollout). When the
    timer fires, every entry due by then wakes; a cancelled sleeper stays in the heap
    until then. One loop at a time: sleeping on a new loop forgets the old one's
    sleepers (tests run a loop per case; one driver never serves two loops at once).

    The timer is a :class:`~fleetwave.drivers.wakeup.PreciseTimer` where there is one
    (Linux) and the loop runs on the monotonic clock: an operation then ends when it is
    due (never before, and not held to a millisecond tick), as a real target's reply
    wakes the loop when it arrives.
    The loop's own timers (elsewhere, and on a virtual-time loop) wake on millisecond
    ticks: every operation due within one wakes with the others, half a tick late, and
    operations that started apart end together, in cohorts that each wait for all of
    their members (0.02 of the I/O-bound benchmark's ratio to its ideal).
    """

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, asyncio.Future[None]]] = []
        self._seq = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        #: the loop's timer for the earliest entry, when not on the precise timer
        self._timer: asyncio.TimerHandle | None = None
        #: the precise timer (made once, on the first loop that can use it), and whether
        #: this loop does (due times are then on the monotonic clock, not the loop's)
        self._precise: PreciseTimer | None = None
        self._on_precise = False
        #: when the timer goes off next (None: it is not set)
        self._at: float | None = None
        #: the due time of the last sleep asked for
        self.due = 0.0

    def clock(self) -> float:
        """The time on the clock the sleeps keep and their due times are on (the
        monotonic clock on the precise timer, the loop's otherwise), on the loop of the
        last :meth:`sleep`."""
        if self._on_precise:
            return time.monotonic()
        assert self._loop is not None
        return self._loop.time()

    def sleep(self, delay: float) -> asyncio.Future[None]:
        """A future that is done ``delay`` seconds from now (its due time is then
        :attr:`due`, on :meth:`clock`)."""
        if delay != delay:
            raise ValueError("a simulated latency is not a number")
        loop = asyncio.get_running_loop()
        if loop is not self._loop:
            self._use(loop)
        fut = loop.create_future()
        when = self.due = (time.monotonic() if self._on_precise else loop.time()) + delay
        self._seq += 1
        heapq.heappush(self._heap, (when, self._seq, fut))
        at = self._at
        if at is None or when < at:
            self._set(when)
        return fut

    def _use(self, loop: asyncio.AbstractEventLoop) -> None:
        """Sleep on ``loop`` from now on (tests run several): the old one's sleepers went
        with it."""
        if self._timer is not None:
            self._timer.cancel()
        self._loop, self._heap, self._timer, self._at = loop, [], None, None
        self._on_precise = False
        if self._precise is not None and self._precise.pid != os.getpid():
            self._precise = None  # a forked child's: the parent's timer, not its own
        if on_monotonic_clock(loop):
            if self._precise is None:
                self._precise = PreciseTimer.open()
                if self._precise is not None:
                    # The loop holds what it calls back: a weak reference here, so that
                    # a driver dropped while its loop lives (a conductor made per
                    # takeover) takes its timer, and the timer's descriptor, with it.
                    weakref.finalize(self, self._precise.close)
            if self._precise is not None:
                self._precise.attach(loop, _fire_weakly(weakref.ref(self)))
                self._on_precise = True
        elif self._precise is not None:
            self._precise.close()  # detached from the loop it watched on
            self._precise = None

    def _set(self, when: float) -> None:
        self._at = when
        if self._on_precise:
            assert self._precise is not None
            self._precise.arm(when)
            return
        assert self._loop is not None
        if self._timer is not None:
            self._timer.cancel()
        self._timer = self._loop.call_at(when, self._fire)

    def _fire(self) -> None:
        heap = self._heap
        assert self._loop is not None
        if self._on_precise:
            # (it reads as ready until set again, which the end of this does)
            due = time.monotonic()
        else:
            # Everyone due by now, not only by the timer's own time: a timer fires late
            # when the loop was busy, and on a loop whose clock has no millisecond grain
            # (asyncio's own) each sleeper has its own due time, so releasing only those
            # due at the timer's time woke one operation per loop turn (and the
            # dispatcher committed each one alone: five times the ideal wall time in the
            # I/O-bound benchmark).
            self._timer = None
            due = max(self._at or 0.0, self._loop.time())
        while heap and heap[0][0] <= due:
            fut = heapq.heappop(heap)[2]
            if not fut.done():
                fut.set_result(None)
        if heap:
            self._set(heap[0][0])
        else:
            self._at = None
            if self._on_precise:
                assert self._precise is not None
                self._precise.disarm()


def _fire_weakly(ref: weakref.ReferenceType[_Sleeps]) -> Callable[[], None]:
    """The timer's callback on the loop, holding its sleeps only weakly."""

    def fire() -> None:
        sleeps = ref()
        if sleeps is not None:
            sleeps._fire()

    return fire


class _Run:
    """One run of one operation on one target, as the target sees it, while it runs.

    What a caller that joins it awaits is made when one does: most runs are never
    joined, and a future costs more than the rest of a plain run's bookkeeping.
    """

    __slots__ = ("joiners",)

    def __init__(self) -> None:
        self.joiners: asyncio.Future[RemoteResult] | None = None

    def joined(self) -> asyncio.Future[RemoteResult]:
        if self.joiners is None:
            self.joiners = asyncio.get_running_loop().create_future()
        return self.joiners

    def ended(self, result: RemoteResult | None, error: Exception | None = None) -> None:
        joined = self.joiners
        if joined is None or joined.done():
            return
        if error is not None:
            joined.set_exception(error)
            joined.exception()  # retrieved: a joiner may have stopped waiting
        else:
            joined.set_result(result)  # type: ignore[arg-type]


class _HttpAgent:
    """One simulated agent that reports over HTTP, as a real one does (see the module)."""

    __slots__ = ("driver", "key", "state", "step", "token", "url")

    def __init__(
        self,
        driver: SimDriver,
        base: str,
        token: str | None,
        step: int,
        state: str,
        key: str,
    ) -> None:
        self.driver = driver
        self.url = f"{base}/v1/steps/{step}/callbacks"
        self.token = token
        self.step = step
        self.state = state
        self.key = key

    def sender(self, kind: str, details: str, key: str) -> Callable[[], object]:
        async def send() -> object:
            return await self.post(kind, details, key)

        return send

    async def post(self, kind: str, details: str, key: str) -> object:
        """Send one report: None once stored (2xx), :data:`_REFUSED` for a 4xx (the
        answer is final: counted and logged); raise for what is worth another try (no
        answer, a 5xx)."""
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        body = {"state": self.state, "idempotency_key": key, "kind": kind, "details": details}
        answer = await self.driver._agent_client().post(self.url, json=body, headers=headers)
        if answer.status_code >= 500:
            raise TransientError(f"callback answered {answer.status_code}")
        if answer.status_code >= 400:
            try:
                said = str(answer.json()["error"]["message"])
            except (ValueError, KeyError, TypeError):
                said = answer.text[:200]
            self.driver.callbacks_refused.append(
                (self.step, self.state, kind, answer.status_code, said)
            )
            log.warning(
                "sim agent: callback for step %s (%s, %s) refused: %s %s",
                self.step,
                self.state,
                kind,
                answer.status_code,
                said,
            )
            return _REFUSED
        return None


class SimDriver:
    """The simulated fleet: targets behave as their settings say (deterministic for a
    seed); the embedded default."""

    name = "sim"
    settings_model = SimSettings
    #: the settings' checks (fleetwave.drivers.settings calls it instead of the model's)
    check_settings = staticmethod(validate_settings)

    def __init__(self, seed: int = 0) -> None:
        self.seed = seed
        self._by_settings: dict[str, _Profile] = {}
        self._sleeps = _Sleeps()
        #: the last settings seen and their profile: targets loaded together share one
        #: settings object per combination, so most operations stop here
        self._last: tuple[dict[str, Any], _Profile] | None = None
        #: every operation started by an action (not a recover hook), as (target,
        #: operation, attempt): what the targets saw; kept when ``record`` is set
        self.performed: list[tuple[str, str, int]] = []
        self.record = False
        #: how many times each (target, operation, attempt) was started by an action: a
        #: correct engine never starts the same attempt of a state twice
        self.starts: Counter[tuple[str, str, int]] = Counter()
        #: count :attr:`starts` (the simulator does): off by default, as it grows with
        #: every operation of every target for the life of the driver
        self.count_starts = False
        #: with :attr:`count_starts`, every retry as (target, operation, attempt, loop time)
        self.retried_at: list[tuple[str, str, int, float]] = []
        #: where simulated agents send callbacks (set by whoever runs the conductor)
        self.callback_sink: CallbackSink | None = None
        self.callbacks_sent = 0
        self.callbacks_delivered = 0
        #: callbacks whose answer took virtual time (step, state, seconds): none should
        self.callback_waits: list[tuple[int, str, float]] = []
        self._agents: set[asyncio.Task[None]] = set()
        #: agents that call back over HTTP (``callback_url``): their connections, the
        #: tokens they were handed (by strategy, then step and state), and the reports
        #: the API refused, as (step, state, kind, status, what it said)
        self._http: tuple[asyncio.AbstractEventLoop, httpx.AsyncClient] | None = None
        self._agent_tokens: dict[int, dict[tuple[int, str], str]] = {}
        self.callbacks_refused: list[tuple[int, str, str, int, str]] = []
        #: the targets' own view of each operation; remote work outlives a lost conductor:
        #: the operations running now, and per strategy and step the last one finished
        #: and how (None: it succeeded; else its error and whether that was transient; a
        #: step starts an operation only once the one before is behind it, so that is
        #: all a recover hook or a poll can ask about). Kept small: the
        #: futures of every finished operation, kept before, slowed a 100,000-target
        #: rollout by a third. Forgotten when the strategy ends.
        self._remote: dict[tuple[int, str, str], _Run] = {}
        #: (state, operation, error): two states may run the same operation
        self._finished: dict[int, dict[int, tuple[str, str, tuple[str, bool] | None]]] = {}
        #: strategies ended: an operation still running on a target (its step timed out)
        #: that finishes afterwards is not recorded
        self._ended: set[int] = set()
        self._work: set[asyncio.Task[None]] = set()

    def _profile(self, target: Target) -> _Profile:
        settings = target.settings
        last = self._last
        if last is not None and last[0] is settings:
            return last[1]
        # Fleets share a handful of setting combinations: parse each combination once.
        # (Nothing is kept per target: a driver may serve 100,000 of them.)
        key = repr(sorted(settings.items()))
        prof = self._by_settings.get(key)
        if prof is None:
            prof = self._by_settings[key] = _Profile(settings)
        self._last = (settings, prof)
        return prof

    async def perform(self, target: Target, operation: str, ctx: ActionContext) -> RemoteResult:
        """Start the operation on the target, or join the run already going; wait for it."""
        prof = self._profile(target)
        key = (ctx.strategy_id, target.name, operation)
        running = self._remote.get(key) if self._remote else None
        joins = running is not None  # a run is in progress until it is removed
        # A recover hook that joins the run going on starts nothing; one that finds the
        # operation never started starts it here, as the action would have.
        if not (ctx.recovering and joins):
            if self.count_starts:
                self.starts[(target.name, operation, ctx.attempt)] += 1
                if ctx.attempt > 1 or ctx.recovering:  # when it began (loop time)
                    self.retried_at.append(
                        (target.name, operation, ctx.attempt, asyncio.get_running_loop().time())
                    )
            if self.record:
                self.performed.append((target.name, operation, ctx.attempt))
        if running is not None and joins:
            return await asyncio.shield(running.joined())  # idempotent: join, don't restart
        if prof.plain and not ctx.callback_expected:
            # A plain operation (fixed latency, no faults) runs in the caller's task: no
            # task of its own, which costs more than the operation (nor a coroutine). On
            # the target's side it is a remote run all the same: in progress while it
            # runs (a recover hook joins it), its end recorded, and if its caller is lost
            # mid-way (its conductor crashed or stalled, its state timed out) the rest of
            # it runs on, as its own task.
            run = self._remote[key] = _Run()
            if prof.latency_s > 0:
                sleeps = self._sleeps
                slept = sleeps.sleep(prof.latency_s)
                due = sleeps.due  # (on the clock the sleeps keep)
                try:
                    await slept
                except asyncio.CancelledError:
                    left = due - sleeps.clock()
                    self._spawn(self._execute(prof, target, operation, ctx, run, left))
                    raise
            try:
                result = prof.result if prof.result is not None else self._finish(prof, ctx)
            except StepFailed as exc:
                run.ended(None, exc)
                self._ran(ctx, key, run, (str(exc), False))
                raise
            run.ended(result)
            self._ran(ctx, key, run, None)
            return result
        run = self._remote[key] = _Run()
        self._spawn(self._execute(prof, target, operation, ctx, run))
        return await asyncio.shield(run.joined())

    def _spawn(self, work: Coroutine[Any, Any, None]) -> None:
        """The target's side of a run, as its own task (kept until it ends)."""
        task = asyncio.create_task(work)
        self._work.add(task)
        task.add_done_callback(self._work.discard)

    async def _execute(
        self,
        prof: _Profile,
        target: Target,
        operation: str,
        ctx: ActionContext,
        run: _Run,
        left: float | None = None,
    ) -> None:
        """The remote side's work: runs on even if the conductor that asked is lost.
        ``left``: what is left of a plain run whose caller was lost (:meth:`perform`)."""
        error: tuple[str, bool] | None = None
        key = (ctx.strategy_id, target.name, operation)
        try:
            if left is None:
                result = await self._remote_work(prof, target, operation, ctx)
            else:
                if left > 0:
                    await self._sleeps.sleep(left)
                result = self._finish(prof, ctx)
        except asyncio.CancelledError:
            # the driver is closing: the run is gone, and whoever joined it hears so
            if self._remote.get(key) is run:
                del self._remote[key]
            if run.joiners is not None:
                run.joiners.cancel()
            raise
        except Exception as exc:
            run.ended(None, exc)
            error = (str(exc) or type(exc).__name__, isinstance(exc, TransientError))
        else:
            run.ended(result)
        self._ran(ctx, key, run, error)

    def _ran(
        self,
        ctx: ActionContext,
        key: tuple[int, str, str],
        run: _Run,
        error: tuple[str, bool] | None,
    ) -> None:
        """A run ended: no longer in progress, and the target's record of how this
        step's last run of an operation ended (what :meth:`observe` reports), kept until
        the strategy ends."""
        if self._remote.get(key) is run:
            del self._remote[key]
        sid = ctx.strategy_id
        if sid not in self._ended:
            finished = self._finished.get(sid)
            if finished is None:
                finished = self._finished[sid] = {}
            finished[ctx.step_id] = (ctx.state, key[2], error)

    def strategy_ended(self, strategy_id: int) -> None:
        """The conductor ended the strategy: what its targets did is no longer asked."""
        self._finished.pop(strategy_id, None)
        self._agent_tokens.pop(strategy_id, None)
        self._ended.add(strategy_id)

    async def _remote_work(
        self, prof: _Profile, target: Target, operation: str, ctx: ActionContext
    ) -> RemoteResult:
        if prof.plain:
            if prof.latency_s > 0:
                await self._sleeps.sleep(prof.latency_s)
        else:
            rng = random.Random(f"{self.seed}:{target.name}:{operation}:{ctx.attempt}")
            if prof.hang_at == ctx.state or (prof.hang and rng.random() < prof.hang):
                await asyncio.Event().wait()  # never set: only a timeout ends the wait
            delay = self._latency(prof, rng)
            if delay > 0:
                await self._sleeps.sleep(delay)
            if prof.error and rng.random() < prof.error:
                raise RuntimeError("simulated driver bug: unexpected None from target API")
            if prof.flaky and rng.random() < prof.flaky:
                raise TransientError("target busy (simulated)")
            if prof.failure and rng.random() < prof.failure:
                raise StepFailed("failed on target (simulated)")
        if ctx.callback_expected:
            self._start_agent(prof, target, operation, ctx)
        return self._finish(prof, ctx)

    @staticmethod
    def _finish(prof: _Profile, ctx: ActionContext) -> RemoteResult:
        if prof.remote_state and (prof.unexpected_at or ctx.state) == ctx.state:
            raise StepFailed(f"target reports unexpected remote state '{prof.remote_state}'")
        if prof.fail_at == ctx.state and (not prof.fail_visits or ctx.visit <= prof.fail_visits):
            raise StepFailed(f"failed on target (fail_at={prof.fail_at})")
        return RemoteResult.ALREADY_DONE if prof.already_done else RemoteResult.DONE

    def _start_agent(
        self, prof: _Profile, target: Target, operation: str, ctx: ActionContext
    ) -> None:
        """The simulated target works on, then calls back, like a real agent would."""
        rng = random.Random(f"{self.seed}:{target.name}:{operation}:cb")
        rates = prof.callback_rates
        agent: _HttpAgent | None = None
        if prof.callback_url is not None:
            agent = self._http_agent(prof.callback_url, target, ctx)
        if rates["callback_lost_rate"] and rng.random() < rates["callback_lost_rate"]:
            return
        kind = "done"
        details = f"{operation} finished"
        if rates["callback_fail_rate"] and rng.random() < rates["callback_fail_rate"]:
            kind, details = "failed", f"{operation} failed on the agent (simulated)"
        base = max(prof.latency_s, 0.001)
        sends = [(rng.uniform(0.5, 1.5) * base, kind, details)]
        if rates["callback_dup_rate"] and rng.random() < rates["callback_dup_rate"]:
            # a second report, perhaps contradicting the first, perhaps arriving before it
            again = rng.choice([kind, "failed" if kind == "done" else "done", "heartbeat"])
            said = {
                "done": f"{operation} finished",
                "failed": f"{operation} failed on the agent (simulated)",
                "heartbeat": f"{operation} still running",
            }[again]  # its details say what its kind says
            sends.append((rng.uniform(0.2, 3.0) * base, again, said + " (again)"))
        if rates["callback_late_rate"] and rng.random() < rates["callback_late_rate"]:
            sends.append((base * 10 + rng.uniform(60, 600), "done", details + " (late)"))
        for n, (delay, k, d) in enumerate(sends):
            send: Callable[[], object] | None = None
            if agent is not None:
                send = agent.sender(k, d, f"{agent.key}:{n}")
            task = asyncio.create_task(
                self._call_back(delay, ctx.step_id, ctx.state, k, d, send, ctx.visit)
            )
            self._agents.add(task)
            task.add_done_callback(self._agents.discard)

    def _http_agent(self, url: str, target: Target, ctx: ActionContext) -> _HttpAgent:
        """The agent of a target that calls back over HTTP, with the token it was handed
        (kept: a recover hook hands none, and the agent goes on using the one it has)."""
        kept = self._agent_tokens.setdefault(ctx.strategy_id, {})
        token = ctx.agent_token
        if token is not None:
            kept[(ctx.step_id, ctx.state)] = token
        else:
            token = kept.get((ctx.step_id, ctx.state))
        return _HttpAgent(
            self,
            url,
            token,
            ctx.step_id,
            ctx.state,
            # the agent's key for each of its reports: the same on every try of one (and
            # its own per visit of a state on a cycle: else visit 2's would replay 1's)
            f"sim:{target.name}:{ctx.step_id}:{ctx.state}:{ctx.attempt}"
            + (f":v{ctx.visit}" if ctx.visit > 1 else ""),
        )

    async def _call_back(
        self,
        delay: float,
        step_id: int,
        state: str,
        kind: str,
        details: str,
        send: Callable[[], object] | None = None,
        visit: int = 1,
    ) -> None:
        """Report after ``delay`` on that ``visit`` of ``state``: through ``send`` (over
        HTTP, with the visit's agent token) if given, else to the conductor's callback
        sink."""
        await asyncio.sleep(delay)
        self.callbacks_sent += 1
        # A real agent retries while the endpoint is unavailable, for as long as its work
        # matters: backoff doubling to a minute, for up to an hour. (Ten tries, about four
        # minutes, lost a callback to a three-minute database outage and then one more
        # error: simulator seed 61142.)
        loop = asyncio.get_running_loop()
        give_up = loop.time() + AGENT_RETRY_S
        attempt = 0
        while send is not None or self.callback_sink is not None:
            asked = loop.time()
            try:
                if send is not None:
                    answer = send()
                else:
                    assert self.callback_sink is not None
                    answer = self.callback_sink(step_id, state, kind, details, visit)
                if inspect.isawaitable(answer):
                    answer = await answer
            except Exception:
                if loop.time() >= give_up:
                    return
                await asyncio.sleep(min(60.0, 0.5 * 2**attempt))
                attempt += 1
                continue
            if answer is _REFUSED:
                return
            self.callbacks_delivered += 1
            waited = loop.time() - asked
            if waited > 0 and send is None:
                # stored and answered at once, always (G6): on virtual time, it takes none
                self.callback_waits.append((step_id, state, waited))
            return

    async def wait_agents(self) -> None:
        """Wait until every simulated agent has sent what it meant to send."""
        while self._agents:
            await asyncio.gather(*list(self._agents), return_exceptions=True)

    async def aclose(self) -> None:
        """Stop all remote work and agents (they otherwise outlive conductors, as real ones
        do), and close the agents' HTTP connections."""
        tasks = [*self._agents, *self._work]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.close_connections()

    def _agent_client(self) -> httpx.AsyncClient:
        """The HTTP agents' connections (made again after :meth:`close_connections`)."""
        loop = asyncio.get_running_loop()
        if self._http is None or self._http[0] is not loop:  # (a client serves one loop)
            self._http = (loop, httpx.AsyncClient(timeout=AGENT_HTTP_TIMEOUT_S))
        return self._http[1]

    async def close_connections(self) -> None:
        """Close the HTTP agents' connections (the conductor ends); the targets' work
        and agents go on, and open new ones if they call back again."""
        http, self._http = self._http, None
        if http is not None and http[0] is asyncio.get_running_loop():
            await http[1].aclose()

    async def observe(self, target: Target, operation: str, ctx: ActionContext) -> RemoteResult:
        prof = self._profile(target)
        if (ctx.strategy_id, target.name, operation) in self._remote:
            return RemoteResult.IN_PROGRESS
        last = self._finished.get(ctx.strategy_id, {}).get(ctx.step_id)
        if last is None or last[:2] != (ctx.state, operation):
            # a target already up to date says so when asked (``skip_if``), sent or not
            return RemoteResult.ALREADY_DONE if prof.already_done else RemoteResult.NOT_STARTED
        if last[2] is not None:
            # in the words the operation failed with, as a run state's failure reads
            message, transient = last[2]
            if transient:  # a poll's next attempt starts it again
                raise TransientError(message)
            raise StepFailed(message)
        return RemoteResult.ALREADY_DONE if prof.already_done else RemoteResult.DONE

    async def start(self, target: Target, operation: str, ctx: ActionContext) -> RemoteResult:
        """Start the operation on the target and return at once (a ``poll`` state looks
        at it with :meth:`observe`): ``in-progress``, or ``done`` if this step's last run
        of it succeeded (idempotent: a run going on is joined, a finished one kept)."""
        prof = self._profile(target)
        key = (ctx.strategy_id, target.name, operation)
        if key in self._remote:
            return RemoteResult.IN_PROGRESS
        last = self._finished.get(ctx.strategy_id, {}).get(ctx.step_id)
        if last is not None and last[:2] == (ctx.state, operation) and last[2] is None:
            return RemoteResult.ALREADY_DONE if prof.already_done else RemoteResult.DONE
        if self.count_starts:
            self.starts[(target.name, operation, ctx.attempt)] += 1
        if self.record:
            self.performed.append((target.name, operation, ctx.attempt))
        run = self._remote[key] = _Run()
        self._spawn(self._execute(prof, target, operation, ctx, run))
        return RemoteResult.IN_PROGRESS

    @staticmethod
    def _latency(prof: _Profile, rng: random.Random) -> float:
        if prof.latency_s <= 0:
            return 0.0
        if prof.kind == "uniform":
            return rng.uniform(0, 2 * prof.latency_s)
        if prof.kind == "lognormal":
            return rng.lognormvariate(math.log(prof.latency_s), prof.sigma)
        return prof.latency_s
