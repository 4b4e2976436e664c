"""The ``http`` driver: remote sites with a subcloud-like software update API.

Each target is one site (setting ``url``: the site's API base, as
``fleetwave site-emulator --targets-csv`` writes it). The built-in ``patch``,
``sw-deploy``, ``firmware`` and ``kube-upgrade`` workflows drive it: every state is an
operation here (:data:`OPERATIONS`), which reads the site before it changes anything,
so that running it again, or after a takeover, attaches to what the site is doing
instead of doing it twice:

* a create that finds a strategy of its type and release attaches to it (building: it
  waits for the build; ready-to-apply or later: done), a finished or failed one (or
  another type's, not running) is deleted and created afresh, a running one of another
  type or release fails the step, naming it;
* an apply reads the strategy first: ``ready-to-apply`` is applied once, ``applying``
  is polled (never applied again: seed 001), ``applied`` is done;
* while an apply runs the site may be unreachable (its hosts reboot): each target has
  an allowance for that (``unreachable_allowance_s``) apart from the state's timeout.

A few ``httpx.AsyncClient`` per event loop serve every target (connection pools, the
targets spread over them by name);
each request has the target's timeout, and only reads (GET) are retried by the driver
(a POST that failed is the state's retry policy's to repeat, after a fresh read).
A site that cannot be reached fails the operation with the reason
(``http: connection refused at http://...``) within its timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import ssl
import zlib
from dataclasses import dataclass
from typing import Any, Literal

import httpx
from pydantic import AnyHttpUrl, BaseModel, ConfigDict, Field, SecretStr

from fleetwave.domain.models import Target
from fleetwave.domain.workflow import ActionContext, RemoteResult, StepFailed, TransientError
from fleetwave.drivers.secrets import SecretError, reveal
from fleetwave.drivers.settings import PerTarget

StrategyType = Literal["sw-patch", "sw-deploy", "fw-update", "kube-upgrade"]
ReleaseKind = Literal["software", "patch", "firmware", "kubernetes"]

#: a strategy's states in which it is working (it cannot be deleted or applied)
RUNNING = frozenset({"building", "applying", "aborting"})
#: a create that finds its own strategy in one of these states attaches to it
ATTACHABLE = frozenset({"building", "ready-to-apply", "applying", "applied"})
#: the most connections the driver keeps open, across every target
MAX_CONNECTIONS = 1024
#: the targets are spread over this many pools (by name): httpcore looks through every
#: connection of a pool for each request it queues and ends, so one pool of 500
#: connections cost the conductor ~3 ms of CPU per request at max parallel 500
POOL_SHARDS = 32


class HttpSettings(BaseModel):
    """Settings of an ``http`` target (``fleetwave driver show http``)."""

    model_config = ConfigDict(extra="forbid")

    url: AnyHttpUrl = Field(
        description="the site's API base, e.g. http://host:9000/sites/site-0001"
    )
    release: str = Field(
        default="stx-10.0.1",
        pattern=r"^[A-Za-z0-9][A-Za-z0-9_.+-]{0,99}$",
        description="the release (patch, software, firmware image, kubernetes version) "
        "the rollout brings the site to",
    )
    license: SecretStr | None = Field(
        default=None, description="license text sw-deploy installs (a secret reference)"
    )
    token: SecretStr | None = Field(
        default=None, description="sent as X-Auth-Token with every request (a secret)"
    )
    timeout_s: float = Field(default=10.0, gt=0, le=600, description="each request's timeout")
    read_retries: int = Field(
        default=2, ge=0, le=10, description="retries of a read (GET) that met no answer"
    )
    build_poll_s: float = Field(
        default=5.0, gt=0, le=3600, description="seconds between two looks at a building strategy"
    )
    apply_poll_s: float = Field(
        default=10.0, gt=0, le=3600, description="seconds between two looks at an apply"
    )
    unreachable_allowance_s: float = Field(
        default=1800.0,
        ge=0,
        le=86_400,
        description="how long the site may be unreachable during an apply (hosts "
        "rebooting) before the step fails",
    )
    verify_tls: bool = Field(default=True, description="check the site's TLS certificate")


class Unreachable(TransientError):
    """No answer from the site (refused, timed out, 503): worth another try;
    ``retry_after_s`` is when the site said to (a 503's ``Retry-After``), if it did."""

    def __init__(self, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class _Progress:
    """When to look at a running phase again: every ``poll_s``, or sooner when the
    progress the site reports says the phase ends before then (the end is not seen
    up to a whole poll late). Never later than ``poll_s``, nor sooner than a tenth of it."""

    def __init__(self, poll_s: float) -> None:
        self.poll_s = poll_s
        #: (when, percent) of the first report of the phase now running, and its state
        self.first: tuple[float, float] | None = None
        self.state: object = None

    def next_look_s(self, strategy: dict[str, Any], now: float) -> float:
        state, percent = strategy.get("state"), strategy.get("progress_percent")
        if state != self.state or not isinstance(percent, int | float):
            self.state, self.first = state, None
        if not isinstance(percent, int | float):
            return self.poll_s
        if self.first is None or percent <= self.first[1]:
            if self.first is None:
                self.first = (now, float(percent))
            return self.poll_s
        began, at = self.first
        left_s = (100.0 - percent) * (now - began) / (percent - at)
        return min(self.poll_s, max(self.poll_s / 10, left_s))


@dataclass(frozen=True)
class Operation:
    """What one workflow state does on the site."""

    kind: Literal["pre-check", "upload", "license", "create", "apply", "finish"]
    strategy: StrategyType | None = None
    release_kind: ReleaseKind = "software"
    #: a release already deployed is "already done" (the state may skip the rest)
    skip_when_deployed: bool = False


OPERATIONS: dict[str, Operation] = {
    # patch
    "pre-check": Operation("pre-check", skip_when_deployed=True),
    "updating-patches": Operation("upload", release_kind="patch"),
    "creating-remote-patch-strategy": Operation("create", "sw-patch", "patch"),
    "applying-remote-patch-strategy": Operation("apply", "sw-patch"),
    "finishing": Operation("finish", "sw-patch"),
    # sw-deploy
    "install-license": Operation("license"),
    "create-remote-strategy": Operation("create", "sw-deploy", "software"),
    "apply-remote-strategy": Operation("apply", "sw-deploy"),
    "finish": Operation("finish", "sw-deploy"),
    # firmware
    "importing-firmware": Operation("upload", release_kind="firmware", skip_when_deployed=True),
    "creating-fw-update-strategy": Operation("create", "fw-update", "firmware"),
    "applying-fw-update-strategy": Operation("apply", "fw-update"),
    "finishing-fw-update": Operation("finish", "fw-update"),
    # kube-upgrade
    "create-kube-upgrade-strategy": Operation("create", "kube-upgrade", "kubernetes"),
    "apply-kube-upgrade-strategy": Operation("apply", "kube-upgrade"),
}


def _why(exc: httpx.HTTPError, url: str, timeout_s: float) -> str:
    """An unreachable site in a few words: ``http: connection refused at URL``."""
    text = str(exc) or type(exc).__name__
    if isinstance(exc, httpx.ConnectTimeout):
        return f"http: no connection within {timeout_s:g}s at {url}"
    if isinstance(exc, httpx.TimeoutException):
        return f"http: no answer within {timeout_s:g}s at {url}"
    if isinstance(exc, httpx.ConnectError):
        if "refused" in text.lower() or _caused_by(exc, ConnectionRefusedError):
            return f"http: connection refused at {url}"
        return f"http: cannot connect to {url}: {text}"
    return f"http: {type(exc).__name__} at {url}: {text}"


def _caused_by(exc: BaseException, kind: type[BaseException]) -> bool:
    """Whether ``kind`` is in the exception's chain (anyio wraps the OS's error in its
    "all connection attempts failed")."""
    seen: BaseException | None = exc
    for _ in range(10):
        if seen is None:
            return False
        if isinstance(seen, kind):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def _error_text(resp: httpx.Response) -> str:
    """The site's own words for a refusal (its ``error``), else the start of the body."""
    try:
        body = resp.json()
    except ValueError:
        return resp.text[:200]
    if isinstance(body, dict) and isinstance(body.get("error"), str):
        return str(body["error"])
    return json.dumps(body)[:200]


class _Site:
    """One target's site for one operation: its settings read, its secrets revealed,
    and the requests it makes (on the driver's shared client)."""

    def __init__(self, client: httpx.AsyncClient, target: Target, cfg: HttpSettings) -> None:
        self.client = client
        self.name = target.name
        self.cfg = cfg
        self.base = str(cfg.url).rstrip("/")
        self.headers: dict[str, str] = {}
        if cfg.token is not None:
            try:
                self.headers["X-Auth-Token"] = reveal(cfg.token.get_secret_value(), "token")
            except SecretError as exc:
                raise StepFailed(f"http: {exc}") from None

    async def request(
        self, method: str, path: str, body: dict[str, Any] | None = None
    ) -> httpx.Response:
        """One request; a GET is retried ``read_retries`` times when there is no answer.
        :class:`Unreachable` when there is none (nor a 503's)."""
        url = self.base + path
        retries = self.cfg.read_retries if method == "GET" else 0
        attempt = 0
        while True:
            try:
                resp = await self.client.request(
                    method, url, json=body, headers=self.headers, timeout=self.cfg.timeout_s
                )
            except httpx.HTTPError as exc:
                error = Unreachable(_why(exc, url, self.cfg.timeout_s))
            else:
                if resp.status_code != 503:
                    return resp
                error = Unreachable(
                    f"http: {url} unreachable (503: {_error_text(resp)})", _retry_after_s(resp)
                )
            if attempt >= retries:
                raise error
            attempt += 1
            await asyncio.sleep(min(5.0, 0.2 * 2**attempt))

    async def read(self, path: str, *, missing_ok: bool = False) -> dict[str, Any] | None:
        """GET a JSON object; None for a 404 when ``missing_ok``."""
        resp = await self.request("GET", path)
        if resp.status_code == 404 and missing_ok:
            return None
        return self.answer(resp, "GET", path)

    def answer(self, resp: httpx.Response, method: str, path: str) -> dict[str, Any]:
        if resp.status_code >= 400:
            raise StepFailed(
                f"http: {method} {self.base + path}: {resp.status_code}: {_error_text(resp)}"
            )
        try:
            body = resp.json()
        except ValueError:
            body = None
        if not isinstance(body, dict):
            raise StepFailed(
                f"http: {method} {self.base + path}: not a JSON object: {resp.text[:100]!r}"
            )
        return body

    # -- what the site says -----------------------------------------------------------

    async def release_state(self) -> str | None:
        """The state of the target's release on the site (None: it does not have it)."""
        found = await self.read(f"/software/releases/{self.cfg.release}", missing_ok=True)
        return None if found is None else str(found.get("state"))

    async def strategy(self, kind: StrategyType) -> dict[str, Any] | None:
        """The site's strategy of ``kind`` (None: it has none of this type)."""
        return await self.read(f"/orchestration/{kind}/strategy", missing_ok=True)

    def ours(self, strategy: dict[str, Any], kind: StrategyType) -> bool:
        """A strategy of this type for this release (one preset without a release is
        taken as ours: a site's own orchestrator names none)."""
        release = strategy.get("release")
        return strategy.get("type") == kind and release in (None, self.cfg.release)


class HttpDriver:
    """Remote sites over HTTP (a subcloud's software update API; its peer for tests and
    rehearsals is ``fleetwave site-emulator``)."""

    name = "http"
    settings_model = HttpSettings

    def __init__(self) -> None:
        #: the clients (connection pools) per event loop, TLS verification and shard
        self._clients: dict[tuple[int, bool, int], httpx.AsyncClient] = {}
        self._tls: ssl.SSLContext | None = None
        #: each target's settings, parsed once per settings object
        self._parsed = PerTarget("http", HttpSettings, lambda _target, cfg: cfg)

    # -- the driver interface ----------------------------------------------------------

    async def perform(self, target: Target, operation: str, ctx: ActionContext) -> RemoteResult:
        op, site = self._begin(target, operation)
        if op.kind == "pre-check":
            return await self._pre_check(site, op)
        if op.kind == "upload":
            return await self._upload(site, op)
        if op.kind == "license":
            return await self._license(site)
        assert op.strategy is not None
        if op.kind == "create":
            return await self._create(site, op, ctx.recovering)
        if op.kind == "apply":
            return await self._apply(site, op.strategy)
        return await self._finish(site, op.strategy)

    async def observe(self, target: Target, operation: str, ctx: ActionContext) -> RemoteResult:
        """How far the operation got on the site, changing nothing (a recover hook asks
        after a takeover: what it hears decides whether ``perform`` runs, and ``perform``
        itself reads before it acts)."""
        op, site = self._begin(target, operation)
        if op.kind == "pre-check":
            return await self._pre_check(site, op)
        if op.kind == "upload":
            state = await site.release_state()
            if state is None:
                return RemoteResult.NOT_STARTED
            if state == "deployed" and op.skip_when_deployed:
                return RemoteResult.ALREADY_DONE
            return RemoteResult.DONE
        if op.kind == "license":
            found = await site.read("/license")
            return (
                RemoteResult.DONE if found and found.get("installed") else RemoteResult.NOT_STARTED
            )
        assert op.strategy is not None
        try:
            strategy = await site.strategy(op.strategy)
        except Unreachable:
            if op.kind == "apply":
                # the hosts may be rebooting mid-apply: perform reads again, patiently
                return RemoteResult.IN_PROGRESS
            raise
        state = strategy.get("state") if strategy is not None else None
        mine = strategy is not None and site.ours(strategy, op.strategy)
        if op.kind == "create":
            if not mine or state in ("aborted", "aborting", "apply-failed"):
                return RemoteResult.NOT_STARTED
            if state == "building":
                return RemoteResult.IN_PROGRESS
            if state == "build-failed":
                raise StepFailed(_failed(site, op.strategy, strategy or {}))
            return RemoteResult.DONE
        if op.kind == "apply":
            if not mine or state in ("building", "ready-to-apply"):
                return RemoteResult.NOT_STARTED
            if state == "applying":
                return RemoteResult.IN_PROGRESS
            if state == "applied":
                return RemoteResult.DONE
            raise StepFailed(_failed(site, op.strategy, strategy or {}))
        # finish: done once the site has no strategy of ours left
        return RemoteResult.NOT_STARTED if mine else RemoteResult.DONE

    async def aclose(self) -> None:
        """Close the connection pools (of the running loop; others are dropped)."""
        clients, self._clients = self._clients, {}
        for client in clients.values():
            with contextlib.suppress(RuntimeError):  # its loop is gone: nothing to close
                await client.aclose()

    #: what a conductor calls when it ends (fleetwave.drivers.close_drivers)
    close_connections = aclose

    # -- helpers --------------------------------------------------------------------------

    def _begin(self, target: Target, operation: str) -> tuple[Operation, _Site]:
        op = OPERATIONS.get(operation)
        if op is None:
            raise StepFailed(
                f"http: no operation {operation!r} (the http driver runs the states of the "
                "patch, sw-deploy, firmware and kube-upgrade workflows)"
            )
        cfg = self._settings(target)
        return op, _Site(self._client(target.name, cfg.verify_tls), target, cfg)

    def _settings(self, target: Target) -> HttpSettings:
        return self._parsed.get(target)

    def _client(self, target: str, verify: bool) -> httpx.AsyncClient:
        """The target's pool: one of :data:`POOL_SHARDS` per event loop and TLS
        verification, chosen by the target's name."""
        shard = zlib.crc32(target.encode()) % POOL_SHARDS
        key = (id(asyncio.get_running_loop()), verify, shard)
        client = self._clients.get(key)
        if client is None:
            each = MAX_CONNECTIONS // POOL_SHARDS
            limits = httpx.Limits(max_connections=each, max_keepalive_connections=each)
            if verify:  # one TLS context for every pool (loading the CAs costs ~20 ms)
                if self._tls is None:
                    self._tls = ssl.create_default_context()
                tls: ssl.SSLContext | bool = self._tls
            else:
                tls = False
            client = self._clients[key] = httpx.AsyncClient(limits=limits, verify=tls)
        return client

    # -- the operations ---------------------------------------------------------------

    async def _pre_check(self, site: _Site, op: Operation) -> RemoteResult:
        """The site answers; its release deployed already: already done."""
        state = await site.release_state()
        if state == "deployed" and op.skip_when_deployed:
            return RemoteResult.ALREADY_DONE
        return RemoteResult.DONE

    async def _upload(self, site: _Site, op: Operation) -> RemoteResult:
        """Upload the release (the site keeps one it has: ``uploaded: false``), and say
        how the site has it: deployed already is "already done" where that skips."""
        release = await self._upload_release(site, op.release_kind)
        if release.get("state") == "deployed" and op.skip_when_deployed:
            return RemoteResult.ALREADY_DONE
        return RemoteResult.DONE

    async def _upload_release(self, site: _Site, kind: ReleaseKind) -> dict[str, Any]:
        """The release as the site has it after the upload."""
        path = "/software/releases"
        resp = await site.request("POST", path, {"release_id": site.cfg.release, "kind": kind})
        release = site.answer(resp, "POST", path).get("release")
        if not isinstance(release, dict):
            raise StepFailed(f"http: POST {site.base + path}: no release in the answer")
        return release

    async def _license(self, site: _Site) -> RemoteResult:
        if site.cfg.license is None:
            found = await site.read("/license")
            if found and found.get("installed"):
                return RemoteResult.DONE
            raise StepFailed(
                f"http: {site.name} has no license installed and the target has no "
                "'license' setting"
            )
        try:
            text = reveal(site.cfg.license.get_secret_value(), "license")
        except SecretError as exc:
            raise StepFailed(f"http: {exc}") from None
        resp = await site.request("POST", "/license", {"license": text})
        site.answer(resp, "POST", "/license")
        return RemoteResult.DONE

    async def _create(self, site: _Site, op: Operation, recovering: bool) -> RemoteResult:
        """Create the strategy and wait for its build. The site refuses a second one
        (409) and says which it has: attached to, or deleted and created afresh; a
        release the site lacks (422) is uploaded first. After a takeover (a recover
        hook: ``recovering``) the strategy is read first: no create is sent to a site
        that has one of ours."""
        kind = op.strategy
        assert kind is not None
        path = f"/orchestration/{kind}/strategy"
        if recovering:
            found = await site.strategy(kind)
            if found is not None and not await self._recreate(site, kind, found):
                return await self._wait_built(site, kind, found)
        uploaded = False
        for _ in range(4):  # a strategy deleted, a release uploaded: then created
            resp = await site.request("POST", path, {"release": site.cfg.release})
            body = _json_or_none(resp)
            if resp.status_code == 422 and _field(body) == "release" and not uploaded:
                await self._upload_release(site, op.release_kind)
                uploaded = True
                continue
            if resp.status_code == 409 and isinstance(_get(body, "strategy"), dict):
                existing: dict[str, Any] = _get(body, "strategy")
                if await self._recreate(site, kind, existing):
                    continue
                return await self._wait_built(site, kind, existing)
            site.answer(resp, "POST", path)
            return await self._wait_built(site, kind, None)
        raise StepFailed(f"http: {site.name}: the {kind} strategy keeps changing under us")

    async def _recreate(self, site: _Site, kind: StrategyType, existing: dict[str, Any]) -> bool:
        """A strategy the site has already, met by a create: True when it was deleted
        (to create ours afresh); False to attach to it (ours, not finished); raises when
        it is another's and still running."""
        state = str(existing.get("state"))
        other_type = existing.get("type")
        if site.ours(existing, kind) and state in (
            "building",
            "ready-to-apply",
            "applying",
            "applied",
        ):
            return False  # attach: its build (or later states) are ours
        if state in RUNNING:
            raise StepFailed(
                f"http: {site.name} has a {other_type} strategy {state} "
                f"(release {existing.get('release')}); not ours to replace while it runs"
            )
        # finished, failed or aborted (or another type's, idle): delete it, create ours
        gone = f"/orchestration/{other_type}/strategy"
        resp = await site.request("DELETE", gone)
        if resp.status_code not in (200, 404):
            site.answer(resp, "DELETE", gone)
        return True

    async def _wait_built(
        self, site: _Site, kind: StrategyType, strategy: dict[str, Any] | None
    ) -> RemoteResult:
        """Until the build ends (``strategy``: as last read; None: just created, building)."""
        loop = asyncio.get_running_loop()
        progress = _Progress(site.cfg.build_poll_s)
        while True:
            if strategy is None or strategy.get("state") == "building":
                seen = strategy or {"state": "building"}
                await asyncio.sleep(progress.next_look_s(seen, loop.time()))
                strategy = await site.strategy(kind)
                if strategy is None:
                    raise StepFailed(
                        f"http: {site.name}: the {kind} strategy vanished while building"
                    )
                continue
            state = strategy.get("state")
            if state in ("ready-to-apply", "applying", "applied"):
                return RemoteResult.DONE
            raise StepFailed(_failed(site, kind, strategy))

    async def _apply(self, site: _Site, kind: StrategyType) -> RemoteResult:
        """Apply the strategy once (only from ready-to-apply), or attach to its apply;
        poll until it ends. Unreachable meanwhile: within the target's allowance."""
        loop = asyncio.get_running_loop()
        path = f"/orchestration/{kind}/strategy"
        allowance = site.cfg.unreachable_allowance_s
        down_since: float | None = None
        applied_by_us = False
        progress = _Progress(site.cfg.apply_poll_s)
        while True:
            try:
                strategy = await site.strategy(kind)
            except Unreachable as exc:
                now = loop.time()
                down_since = now if down_since is None else down_since
                if now - down_since > allowance:
                    raise StepFailed(
                        f"http: {site.name} unreachable for {now - down_since:.3g}s during the "
                        f"apply, over its allowance of {allowance:g}s "
                        f"(unreachable_allowance_s): {exc}"
                    ) from None
                # as the site said (its Retry-After), within the poll and the allowance
                wait = min(site.cfg.apply_poll_s, exc.retry_after_s or math.inf, allowance / 4)
                await asyncio.sleep(max(0.05, wait))
                continue
            down_since = None
            if strategy is None:
                raise StepFailed(
                    f"http: {site.name} has no {kind} strategy to apply (was it deleted?)"
                )
            if not site.ours(strategy, kind):
                raise StepFailed(
                    f"http: {site.name}: the {kind} strategy is for release "
                    f"{strategy.get('release')}, not {site.cfg.release}"
                )
            state = strategy.get("state")
            if state == "ready-to-apply" and not applied_by_us:
                resp = await site.request("POST", path + "/actions", {"action": "apply"})
                if resp.status_code == 409:  # it moved meanwhile: read it again
                    continue
                site.answer(resp, "POST", path + "/actions")
                applied_by_us = True
                state = "applying"  # (it was just now)
            if state == "applied":
                return RemoteResult.DONE
            if state in ("applying", "building", "ready-to-apply"):
                await asyncio.sleep(progress.next_look_s(strategy, loop.time()))
                continue
            raise StepFailed(_failed(site, kind, strategy))

    async def _finish(self, site: _Site, kind: StrategyType) -> RemoteResult:
        """The release deployed; the applied strategy deleted (none left: done)."""
        state = await site.release_state()
        if state != "deployed":
            raise StepFailed(
                f"http: {site.name}: release {site.cfg.release} is {state or 'not on the site'}, "
                "not deployed, after the apply"
            )
        path = f"/orchestration/{kind}/strategy"
        resp = await site.request("DELETE", path)
        if resp.status_code == 409:  # running: not finished (the site says which state)
            strategy = _get(_json_or_none(resp), "strategy")
            raise StepFailed(
                f"http: {site.name}: the {kind} strategy is "
                f"{_get(strategy, 'state') or 'busy'}, not finished"
            )
        if resp.status_code != 404:  # (404: none left)
            site.answer(resp, "DELETE", path)
        return RemoteResult.DONE


def _retry_after_s(resp: httpx.Response) -> float | None:
    """When a 503 says to try again: its body's ``retry_after_s``, or ``Retry-After``."""
    said = _get(_json_or_none(resp), "retry_after_s")
    if isinstance(said, int | float) and not isinstance(said, bool) and 0 <= said < 86_400:
        return float(said)
    header = resp.headers.get("retry-after", "")
    return float(header) if header.isdigit() else None


def _json_or_none(resp: httpx.Response) -> Any:
    try:
        return resp.json()
    except ValueError:
        return None


def _get(body: Any, key: str) -> Any:
    return body.get(key) if isinstance(body, dict) else None


def _field(body: Any) -> str:
    """The field a refusal names (``release`` for a release the site lacks)."""
    return str(_get(body, "field") or "")


def _failed(site: _Site, kind: str, strategy: dict[str, Any]) -> str:
    reason = strategy.get("reason") or "no reason given"
    return f"http: {site.name}: {kind} strategy {strategy.get('state')}: {reason}"
