"""A conductor's lease length (``--lease-ttl``): its range, and leases that last as long
as told."""

from __future__ import annotations

import asyncio
import itertools

import pytest

from cli_harness import Cli, assert_rejected
from conftest import add_sim_targets, on_virtual_time
from fleetwave.cli.common import TEST_LEASE_TTL_MIN_ENV, engine_config, lease_ttl_min
from fleetwave.domain import registry
from fleetwave.domain.models import StrategyOptions
from fleetwave.engine.clock import LoopClock
from fleetwave.engine.conductor import Conductor
from fleetwave.engine.config import EngineConfig
from fleetwave.store import admin
from fleetwave.store.db import Store


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (("serve", "--lease-ttl", "14"), ["--lease-ttl: must be 15 to 3600 seconds, got 14"]),
        (("serve", "--lease-ttl", "3601"), ["--lease-ttl: must be 15 to 3600 seconds"]),
        (("serve", "--lease-ttl", "nan"), ["--lease-ttl", "got nan"]),
        (("strategy", "apply", "1", "--lease-ttl", "10"), ["--lease-ttl: only with --wait"]),
        (("strategy", "apply", "1", "--wait", "--lease-ttl", "1"), ["--lease-ttl", "got 1"]),
    ],
)
def test_a_lease_length_out_of_range_is_refused_before_anything_changes(
    cli: Cli, args: tuple[str, ...], words: list[str]
) -> None:
    assert cli("target", "add", "a").code == 0
    assert cli("strategy", "create", "--workflow", "patch", "--all").code == 0
    assert_rejected(cli(*args), *words)
    shown = cli("strategy", "show", "1", "--format", "json").json()
    assert (shown["state"], shown["owner"]) == ("initial", None)


@pytest.mark.parametrize(
    ("lowered", "least"), [("8", 8.0), ("5", 5.0), ("4", 15.0), ("20", 15.0), ("x", 15.0)]
)
def test_the_test_suites_lower_lease_minimum_is_kept_within_5_to_15_s(
    cli: Cli, monkeypatch: pytest.MonkeyPatch, lowered: str, least: float
) -> None:
    """``$FLEETWAVE_TEST_LEASE_TTL_MIN_S`` (the ``short_lease`` fixture's) lowers the
    minimum to no less than 5 s; anything else leaves the operators' 15 s."""
    monkeypatch.setenv(TEST_LEASE_TTL_MIN_ENV, lowered)
    assert lease_ttl_min() == least
    assert cli("target", "add", "a").code == 0
    assert cli("strategy", "create", "--workflow", "patch", "--all").code == 0
    below = f"{least - 1:g}"
    assert_rejected(
        cli("strategy", "apply", "1", "--wait", "--lease-ttl", below),
        f"--lease-ttl: must be {least:g} to 3600 seconds, got {below}",
    )
    assert engine_config(least).lease_ttl_s == least


def test_a_conductors_leases_last_as_long_as_it_is_told(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Written leases run ``lease_ttl_s`` from each renewal; a long lease is still
    renewed at least every 10 s, so the conductor keeps counting as serving."""
    from fleetwave.store import runtime as rt

    add_sim_targets(store, 2, {"latency_ms": 45_000})
    wf = registry.get_workflow("patch")
    assert wf is not None
    sid = admin.create_strategy(store, wf, StrategyOptions(), all_targets=True)
    admin.apply_strategy(store, sid)
    renewals: list[tuple[float, float]] = []
    real = rt.heartbeat

    def heartbeat(s: Store, cid: str, now: float, until: float) -> int:
        # (the lease runs on the lease clock: the loop's, here)
        renewals.append((now, until - asyncio.get_running_loop().time()))
        return real(s, cid, now, until)

    monkeypatch.setattr(rt, "heartbeat", heartbeat)

    async def main() -> dict[int, str]:
        config = EngineConfig(lease_ttl_s=600)
        return await Conductor(store, clock=LoopClock(), config=config).run(strategy_ids=[sid])

    assert on_virtual_time(main())[sid] == "complete"
    assert len(renewals) >= 20  # 5 states x 45 s, renewed every 10 s (not every 200 s)
    assert all(left == pytest.approx(600) for _now, left in renewals)
    gaps = [b[0] - a[0] for a, b in itertools.pairwise(renewals)]
    assert max(gaps) <= 11.5, gaps
