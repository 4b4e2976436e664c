"""The site emulator's HTTP API (FastAPI): the fleet of sites in one dict, one app.

``/sites/{site}/...`` is each site's own API (delayed by its latency, 503 while it is
unreachable, counted); ``/admin/...`` changes and reads the sites for tests and
rehearsals (never delayed, never unreachable); ``/healthz`` says the emulator is up.
Every refusal is a 4xx (or the 503 of an unreachable site) with a JSON body
``{"error": "...", "field": "..."}``. The shapes are in docs/site-emulator.md.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import time
from collections.abc import Callable
from dataclasses import asdict
from typing import Annotated, Any, Literal

from fastapi import Depends, FastAPI, Path, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from fleetwave.emulator.settings import (
    RELEASE_ID,
    ConfigError,
    EmulatorConfig,
    ReleaseUpload,
    SitePatch,
    SiteSettings,
    StrategyType,
    merged_settings,
)
from fleetwave.emulator.site import Site, SiteError

#: the most sites one emulator serves
MAX_SITES = 100_000
#: the longest license text accepted
MAX_LICENSE_CHARS = 1_000_000


def site_names(count: int) -> list[str]:
    """``site-0001`` .. : numbered from 1, zero-padded to at least four digits."""
    width = max(4, len(str(count)))
    return [f"site-{i:0{width}d}" for i in range(1, count + 1)]


class Fleet:
    """The emulated sites, and the site clock: real time divided by ``time_scale``
    (``time_scale`` 0.01 runs a 30 s apply in 0.3 s)."""

    def __init__(
        self,
        count: int,
        *,
        seed: int = 0,
        time_scale: float = 1.0,
        defaults: SiteSettings | None = None,
        config: EmulatorConfig | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        assert 1 <= count <= MAX_SITES and time_scale > 0, (count, time_scale)
        self.seed = seed
        self.time_scale = time_scale
        self._clock = clock
        self._t0 = clock()
        config = config or EmulatorConfig()
        settings = defaults or SiteSettings()
        self.sites = {name: Site(name, settings, seed) for name in site_names(count)}
        for site in self.sites.values():
            site.set_releases(config.releases)
        now = self.now()
        for name, patch in config.sites.items():
            if name not in self.sites:
                raise ConfigError(f"sites.{name}: no such site ({self.span()})")
            try:
                self.patch(self.sites[name], patch, now, where=f"sites.{name}.")
            except SiteError as exc:
                raise ConfigError(f"sites.{name}.{exc.field}: {exc.message}") from None

    def now(self) -> float:
        """The sites' time (site seconds since the emulator started)."""
        return (self._clock() - self._t0) / self.time_scale

    def span(self) -> str:
        names = list(self.sites)
        return f"sites are {names[0]}..{names[-1]}"

    def site(self, name: str) -> Site:
        site = self.sites.get(name)
        if site is None:
            raise SiteError(404, f"unknown site {name[:80]!r} ({self.span()})", "site")
        return site

    @staticmethod
    def patch(site: Site, patch: SitePatch, now: float, where: str = "") -> None:
        """Apply an admin change or a config file's entry: all of it, or nothing if any
        part is refused (a 422 naming the field)."""
        settings = site.settings
        if patch.settings is not None:
            try:
                settings = merged_settings(site.settings, patch.settings, "settings")
            except ConfigError as exc:
                raise SiteError(422, str(exc), str(exc).split(":", 1)[0]) from None
        releases = set(site.releases)
        if patch.releases is not None:
            releases = {r.release_id for r in patch.releases}
        wanted = patch.strategy.release if patch.strategy is not None else None
        if wanted is not None and wanted not in releases:
            raise SiteError(
                422,
                f"{where}strategy.release: {wanted} is not among the site's releases",
                "strategy.release",
            )
        site.settings = settings
        if patch.releases is not None:
            site.set_releases(patch.releases)
        if "strategy" in patch.model_fields_set:
            site.set_strategy(patch.strategy, now)
        if patch.unreachable_for_s is not None:
            site.set_unreachable(patch.unreachable_for_s, now)

    def admin_view(self, site: Site, now: float) -> dict[str, Any]:
        down = site.unreachable_for_s(now)
        return {
            **site.view(now),
            "settings": site.settings.model_dump(),
            "reachable": down == 0,
            "unreachable_for_s": down,
            "counters": asdict(site.counters),
        }


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class CreateStrategy(_Body):
    release: str | None = Field(default=None, pattern=RELEASE_ID)
    """the release (patch, firmware, kubernetes version) the strategy deploys"""


class StrategyAction(_Body):
    action: Literal["apply", "abort"]


class LicenseInstall(_Body):
    license: str = Field(min_length=1, max_length=MAX_LICENSE_CHARS)


def _field(loc: tuple[Any, ...] | list[Any]) -> str:
    parts = [str(p) for p in loc]
    if parts and parts[0] in {"body", "path", "query", "header"}:
        parts = parts[1:] or parts
    return ".".join(parts)


def _fleet(request: Request) -> Fleet:
    fleet: Fleet = request.app.state.fleet
    return fleet


async def _reachable(site: str, request: Request) -> Site:
    """The site named in the path, answering: after its latency, if reachable."""
    fleet = _fleet(request)
    found = fleet.site(site)
    found.counters.requests += 1
    if found.settings.latency_ms:
        await asyncio.sleep(found.settings.latency_ms / 1000)
    now = fleet.now()
    found.advance(now)
    down = found.unreachable_for_s(now)
    if down > 0:
        found.counters.unreachable += 1
        why = "hosts rebooting" if found.reboot_from_s <= now else "unreachable"
        raise SiteError(
            503, f"{found.name}: {why}", retry_after_s=round(down * fleet.time_scale, 3)
        )
    return found


def _admin_site(site: str, request: Request) -> Site:
    """The site named in the path, whatever its reachability (the admin's view)."""
    fleet = _fleet(request)
    found = fleet.site(site)
    found.advance(fleet.now())
    return found


#: a site's own API answers through this; the admin's through AdminSite
SiteUp = Annotated[Site, Depends(_reachable)]
AdminSite = Annotated[Site, Depends(_admin_site)]
#: the strategy's type in the path (``type`` is Python's)
StrategyKind = Annotated[StrategyType, Path(alias="type")]


def make_app(fleet: Fleet) -> FastAPI:
    """The API over ``fleet``: one app, every site in its dict."""
    app = FastAPI(
        title="fleetwave site emulator",
        summary="N virtual remote sites, each with a subcloud's software update API",
    )
    app.state.fleet = fleet

    @app.exception_handler(SiteError)
    async def _refused(request: Request, exc: SiteError) -> JSONResponse:
        headers = None
        if exc.status == 503:
            headers = {"Retry-After": str(max(1, math.ceil(exc.extra.get("retry_after_s", 1))))}
        return JSONResponse(exc.body(), status_code=exc.status, headers=headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0]
        field = _field(first.get("loc", ()))
        if first.get("type") == "json_invalid":
            return JSONResponse(
                {"error": f"body: not valid JSON ({first.get('msg')})", "field": "body"},
                status_code=400,
            )
        return JSONResponse(
            {"error": f"{field}: {first.get('msg')}", "field": field}, status_code=422
        )

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(
            {"error": f"{request.method} {request.url.path}: {exc.detail}"},
            status_code=exc.status_code,
            headers=exc.headers,
        )

    strategy_path = "/sites/{site}/orchestration/{type}/strategy"

    @app.get("/healthz")
    async def healthz() -> dict[str, Any]:
        return {
            "status": "ok",
            "sites": len(fleet.sites),
            "seed": fleet.seed,
            "time_scale": fleet.time_scale,
        }

    @app.get("/sites")
    async def list_sites() -> dict[str, Any]:
        return {"sites": [{"name": n, "path": f"/sites/{n}"} for n in fleet.sites]}

    @app.get("/sites/{site}")
    async def get_site(site: SiteUp) -> dict[str, Any]:
        return site.view(fleet.now())

    @app.get("/sites/{site}/hosts")
    async def get_hosts(site: SiteUp) -> dict[str, Any]:
        return {"hosts": site.hosts(fleet.now())}

    @app.get(strategy_path)
    async def get_strategy(site: SiteUp, kind: StrategyKind) -> dict[str, Any]:
        return site.get_strategy(kind).view(fleet.now())

    @app.post(strategy_path, status_code=201)
    async def create_strategy(
        site: SiteUp, kind: StrategyKind, body: CreateStrategy | None = None
    ) -> dict[str, Any]:
        now = fleet.now()
        release = body.release if body is not None else None
        return site.create_strategy(kind, release, now).view(now)

    @app.post(strategy_path + "/actions", status_code=202)
    async def strategy_action(
        site: SiteUp, kind: StrategyKind, body: StrategyAction
    ) -> dict[str, Any]:
        now = fleet.now()
        return site.act(kind, body.action, now).view(now)

    @app.delete(strategy_path)
    async def delete_strategy(site: SiteUp, kind: StrategyKind) -> dict[str, Any]:
        now = fleet.now()
        return {"deleted": site.delete_strategy(kind, now).view(now)}

    @app.get("/sites/{site}/software/releases")
    async def list_releases(site: SiteUp) -> dict[str, Any]:
        return {"releases": [r.view() for r in site.releases.values()]}

    @app.get("/sites/{site}/software/releases/{release_id}")
    async def get_release(site: SiteUp, release_id: str) -> dict[str, Any]:
        return site.get_release(release_id).view()

    @app.post("/sites/{site}/software/releases", status_code=201)
    async def upload_release(
        site: SiteUp, body: ReleaseUpload, response: Response
    ) -> dict[str, Any]:
        release, new = site.upload_release(body)
        if not new:
            response.status_code = 200
        return {"release": release.view(), "uploaded": new}

    @app.get("/sites/{site}/license")
    async def get_license(site: SiteUp) -> dict[str, Any]:
        return {"installed": site.license_sha256 is not None, "sha256": site.license_sha256}

    @app.post("/sites/{site}/license")
    async def install_license(site: SiteUp, body: LicenseInstall) -> dict[str, Any]:
        site.install_license(hashlib.sha256(body.license.encode()).hexdigest())
        return {"installed": True, "sha256": site.license_sha256}

    @app.get("/admin/sites/{site}")
    async def admin_get(site: AdminSite) -> dict[str, Any]:
        return fleet.admin_view(site, fleet.now())

    @app.patch("/admin/sites/{site}")
    async def admin_patch(site: AdminSite, body: SitePatch) -> dict[str, Any]:
        now = fleet.now()
        fleet.patch(site, body, now)
        return fleet.admin_view(site, now)

    @app.get("/admin/sites/{site}/counters")
    async def admin_site_counters(site: AdminSite) -> dict[str, Any]:
        return asdict(site.counters)

    @app.get("/admin/counters")
    async def admin_counters() -> dict[str, Any]:
        return {"sites": {name: asdict(s.counters) for name, s in fleet.sites.items()}}

    return app
