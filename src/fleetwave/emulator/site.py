"""One emulated site: its remote strategy, releases, license, hosts and counters, and
how they move with time.

Nothing here reads a clock or sleeps: every method is given ``now`` (site seconds)
and a phase's end is decided when the phase starts (when it ends, how, and whether
the hosts reboot on the way). A site catches up with time when it is asked
(:meth:`Site.advance`), so a thousand sites cost no task, timer or thread each.
Randomness comes from a generator seeded with (seed, site, strategy number): the same
requests give the same outcomes.

Expected errors (a second create, an apply of a strategy not ready) raise
:class:`SiteError` with the HTTP status and the field they are about.
"""

from __future__ import annotations

import math
import random
import uuid
from dataclasses import asdict, dataclass, field
from typing import Any

from fleetwave.emulator.settings import (
    ReleasePreset,
    ReleaseUpload,
    SiteSettings,
    StrategyPreset,
)

#: states a strategy leaves by itself when its phase ends, and the phase
PHASES = {"building": "build", "applying": "apply", "aborting": "abort"}
#: states a strategy can be deleted in (not while a phase runs)
DELETABLE = frozenset({"ready-to-apply", "build-failed", "applied", "apply-failed", "aborted"})
ABORTABLE = frozenset({"building", "ready-to-apply", "applying"})
#: the hosts every site has
HOSTS = ("controller-0",)


class SiteError(Exception):
    """An expected refusal, answered as ``status`` with ``{"error": message, ...}``."""

    def __init__(self, status: int, message: str, field: str | None = None, **extra: Any) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.field = field
        self.extra = extra

    def body(self) -> dict[str, Any]:
        out: dict[str, Any] = {"error": self.message}
        if self.field is not None:
            out["field"] = self.field
        out.update(self.extra)
        return out


@dataclass
class Counters:
    """What the site received (while reachable) and did: a test asserts on these."""

    creates: int = 0
    applies: int = 0
    aborts: int = 0
    deletes: int = 0
    uploads: int = 0
    license_installs: int = 0
    #: strategies whose apply started (an apply refused with 409 is not one)
    applies_started: int = 0
    #: host reboots begun
    reboots: int = 0
    #: requests of the site API answered (503s too)
    requests: int = 0
    #: requests answered 503 while the site was unreachable
    unreachable: int = 0


@dataclass
class Release:
    release_id: str
    kind: str
    state: str
    reboot_required: bool

    def view(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Strategy:
    uuid: str
    type: str
    release: str | None
    state: str
    #: when the state was entered, and when its phase ends (inf: it has none)
    since_s: float
    ends_s: float = math.inf
    #: the state the phase ends in, and why (a failure's reason)
    outcome: str = ""
    outcome_reason: str = ""
    reason: str = ""
    #: the phase the strategy fails in ("build", "apply"), drawn when created
    fails_in: str | None = None

    def view(self, now: float) -> dict[str, Any]:
        phase = PHASES.get(self.state)
        progress: int | None = None
        if phase is not None:
            span = self.ends_s - self.since_s
            done = 1.0 if span <= 0 else (now - self.since_s) / span
            progress = max(0, min(99, int(done * 100)))
        elif self.state == "applied":
            progress = 100
        return {
            "uuid": self.uuid,
            "type": self.type,
            "release": self.release,
            "state": self.state,
            "current_phase": phase,
            "progress_percent": progress,
            "reason": self.reason,
        }


@dataclass
class Site:
    name: str
    settings: SiteSettings
    seed: int
    strategy: Strategy | None = None
    releases: dict[str, Release] = field(default_factory=dict)
    license_sha256: str | None = None
    counters: Counters = field(default_factory=Counters)
    #: unreachable until then (set by the admin endpoint or the config)
    down_until_s: float = -math.inf
    #: the hosts' reboot during an apply: [from, until), and whether it has begun
    reboot_from_s: float = math.inf
    reboot_until_s: float = -math.inf
    reboot_counted: bool = True
    #: strategies created, the seed of the next one's draws
    strategies_made: int = 0

    # -- time ----------------------------------------------------------------------

    def advance(self, now: float) -> None:
        """Catch up with ``now``: a phase due to end ends, a reboot due to begin begins."""
        if not self.reboot_counted and now >= self.reboot_from_s:
            self.reboot_counted = True
            self.counters.reboots += 1
        s = self.strategy
        if s is None or s.state not in PHASES or now < s.ends_s:
            return
        ended_in = s.state
        s.state, s.since_s, s.reason = s.outcome, s.ends_s, s.outcome_reason
        s.ends_s = math.inf
        release = self.releases.get(s.release) if s.release else None
        if release is not None and (ended_in == "applying" or s.state == "aborted"):
            if s.state == "applied":
                release.state = "deployed"
            elif release.state == "deploying":
                release.state = "available"

    def unreachable_for_s(self, now: float) -> float:
        """How much longer the site is unreachable (0: it is reachable)."""
        rebooting = self.reboot_until_s - now if self.reboot_from_s <= now else 0.0
        return max(0.0, self.down_until_s - now, rebooting)

    # -- the site's API ------------------------------------------------------------

    def get_strategy(self, kind: str) -> Strategy:
        s = self.strategy
        if s is None or s.type != kind:
            other = f" (it has a {s.type} strategy)" if s is not None else ""
            raise SiteError(404, f"{self.name}: no {kind} strategy{other}", "type")
        return s

    def create_strategy(self, kind: str, release_id: str | None, now: float) -> Strategy:
        self.counters.creates += 1
        if self.strategy is not None:
            s = self.strategy
            raise SiteError(
                409,
                f"{self.name}: a {s.type} strategy already exists (state {s.state}): "
                "apply, abort or delete it first",
                "strategy",
                strategy=s.view(now),
            )
        release = self._release(release_id) if release_id is not None else None
        rng = self._next_draws()
        fails_in = self.settings.fail_at
        if self.settings.fail_rate and rng.random() < self.settings.fail_rate:
            fails_in = fails_in or rng.choice(("build", "apply"))
        s = Strategy(
            uuid=str(uuid.UUID(int=rng.getrandbits(128), version=4)),
            type=kind,
            release=release_id,
            state="building",
            since_s=now,
            fails_in=fails_in,
        )
        self._start_build(s, release, now)
        self.strategy = s
        return s

    def act(self, kind: str, action: str, now: float) -> Strategy:
        s = self.get_strategy(kind)
        if action == "apply":
            self.counters.applies += 1
            if s.state != "ready-to-apply":
                raise SiteError(
                    409,
                    f"{self.name}: cannot apply a {kind} strategy in state {s.state} "
                    "(only in ready-to-apply)",
                    "action",
                    strategy=s.view(now),
                )
            self.counters.applies_started += 1
            self._start_apply(s, now)
            return s
        assert action == "abort", action  # the API's model allows no other
        self.counters.aborts += 1
        if s.state not in ABORTABLE:
            raise SiteError(
                409,
                f"{self.name}: cannot abort a {kind} strategy in state {s.state}",
                "action",
                strategy=s.view(now),
            )
        self._start_abort(s, now)
        return s

    def delete_strategy(self, kind: str, now: float) -> Strategy:
        s = self.get_strategy(kind)
        self.counters.deletes += 1
        if s.state not in DELETABLE:
            raise SiteError(
                409,
                f"{self.name}: cannot delete a {kind} strategy in state {s.state} "
                "(abort it, or wait for it to end)",
                "strategy",
                strategy=s.view(now),
            )
        self.strategy = None
        return s

    def upload_release(self, preset: ReleaseUpload) -> tuple[Release, bool]:
        """The release, and whether it is new (uploading one the site has changes nothing)."""
        self.counters.uploads += 1
        known = self.releases.get(preset.release_id)
        if known is not None:
            return known, False
        release = self.releases[preset.release_id] = Release(
            preset.release_id, preset.kind, "available", preset.reboot_required
        )
        return release, True

    def get_release(self, release_id: str) -> Release:
        return self._release(release_id, field="release_id")

    def install_license(self, sha256: str) -> None:
        self.counters.license_installs += 1
        self.license_sha256 = sha256

    # -- presets (the admin endpoint and the config file) --------------------------

    def set_releases(self, presets: list[ReleasePreset]) -> None:
        self.releases = {
            p.release_id: Release(p.release_id, p.kind, p.state, p.reboot_required) for p in presets
        }

    def set_strategy(self, preset: StrategyPreset | None, now: float) -> None:
        """The site has this strategy now (None: no strategy); a transient state's
        phase starts now."""
        self._cancel_reboot(now)
        if preset is None:
            self.strategy = None
            return
        if preset.release is not None:
            self._release(preset.release, field="strategy.release")
        rng = self._next_draws()
        s = Strategy(
            uuid=str(uuid.UUID(int=rng.getrandbits(128), version=4)),
            type=preset.type,
            release=preset.release,
            state=preset.state,
            since_s=now,
            fails_in=self.settings.fail_at,
        )
        if preset.state.endswith("-failed"):
            s.reason = f"{preset.state.removesuffix('-failed')} failed (preset)"
        self.strategy = s
        if preset.state == "building":
            self._start_build(s, self.releases.get(preset.release or ""), now)
        elif preset.state == "applying":
            self._start_apply(s, now)
        elif preset.state == "aborting":
            self._start_abort(s, now)

    def set_unreachable(self, for_s: float, now: float) -> None:
        self.down_until_s = now + for_s

    def _next_draws(self) -> random.Random:
        """The random draws of the site's next strategy (one generator per strategy)."""
        rng = random.Random(f"{self.seed}:{self.name}:{self.strategies_made}")
        self.strategies_made += 1
        return rng

    # -- phases ---------------------------------------------------------------------

    def _start_build(self, s: Strategy, release: Release | None, now: float) -> None:
        cfg = self.settings
        s.state, s.since_s, s.ends_s = "building", now, now + cfg.build_s
        s.outcome, s.outcome_reason = "ready-to-apply", ""
        if release is not None and release.state == "deployed":
            s.outcome = "build-failed"
            s.outcome_reason = f"release {release.release_id} is already deployed"
        elif s.fails_in == "build":
            s.ends_s = now + cfg.build_s * cfg.fail_percent / 100
            s.outcome = "build-failed"
            s.outcome_reason = f"build failed (emulated, at {cfg.fail_percent:g}% of the build)"

    def _start_apply(self, s: Strategy, now: float) -> None:
        cfg = self.settings
        release = self.releases.get(s.release) if s.release else None
        reboots = cfg.reboot_s > 0 and (release is None or release.reboot_required)
        total = cfg.apply_s + (cfg.reboot_s if reboots else 0.0)
        s.state, s.since_s, s.ends_s, s.reason = "applying", now, now + total, ""
        s.outcome, s.outcome_reason = "applied", ""
        if s.fails_in == "apply":
            s.ends_s = now + total * cfg.fail_percent / 100
            s.outcome = "apply-failed"
            s.outcome_reason = f"apply failed (emulated, at {cfg.fail_percent:g}% of the apply)"
        if release is not None:
            release.state = "deploying"
        reboot_from = now + cfg.apply_s * cfg.reboot_at
        if reboots and reboot_from < s.ends_s:
            self.reboot_from_s = reboot_from
            self.reboot_until_s = reboot_from + cfg.reboot_s
            self.reboot_counted = False

    def _start_abort(self, s: Strategy, now: float) -> None:
        self._cancel_reboot(now)
        s.state, s.since_s, s.ends_s, s.reason = "aborting", now, now + self.settings.abort_s, ""
        s.outcome, s.outcome_reason = "aborted", "aborted by request"

    def _cancel_reboot(self, now: float) -> None:
        """A reboot not begun yet does not happen; one under way runs its course."""
        if self.reboot_from_s > now:
            self.reboot_from_s, self.reboot_until_s = math.inf, -math.inf
            self.reboot_counted = True

    def _release(self, release_id: str, field: str = "release") -> Release:
        release = self.releases.get(release_id)
        if release is None:
            known = ", ".join(sorted(self.releases)) or "none"
            raise SiteError(
                404 if field == "release_id" else 422,
                f"{self.name}: release {release_id} is not on the site (it has: {known}); "
                "upload it first",
                field,
            )
        return release

    # -- reading ----------------------------------------------------------------------

    def view(self, now: float) -> dict[str, Any]:
        return {
            "name": self.name,
            "strategy": self.strategy.view(now) if self.strategy else None,
            "releases": [r.view() for r in self.releases.values()],
            "license_installed": self.license_sha256 is not None,
            "hosts": self.hosts(now),
        }

    def hosts(self, now: float) -> list[dict[str, Any]]:
        return [
            {
                "hostname": name,
                "personality": "controller",
                "availability": "rebooting" if self.unreachable_for_s(now) else "available",
                "reboots": self.counters.reboots,
            }
            for name in HOSTS
        ]
