"""The conductor's gc.freeze (full collections would rescan every loaded step) must not
keep what it froze for ever: a frozen object in a reference cycle is never freed, so a
`serve` that drove strategy after strategy, or `fleetwave sim --runs N`, grew without
bound (about 1.3 MB a run of 40 targets)."""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Iterator

import pytest

from conftest import add_sim_targets, rollout
from fleetwave import ActionContext, Advance, Outcome, StateAction
from fleetwave.domain.models import StrategyOptions
from fleetwave.domain.registry import register_workflow
from fleetwave.domain.workflow import StateDef, WorkflowDef
from fleetwave.engine.conductor import Conductor
from fleetwave.engine.config import EngineConfig
from fleetwave.store import admin
from fleetwave.store.db import Store


@pytest.fixture(autouse=True)
def nothing_frozen_before() -> Iterator[None]:
    gc.unfreeze()  # whatever an earlier test left frozen
    yield
    gc.unfreeze()


class Observe(StateAction):
    """Records how many objects are frozen while it runs; waits for ``release`` when
    its target's name says so."""

    frozen_seen: list[int] = []
    release: asyncio.Event | None = None

    async def run(self, ctx: ActionContext) -> Outcome:
        Observe.frozen_seen.append(gc.get_freeze_count())
        if ctx.target.name.startswith("slow") and Observe.release is not None:
            await Observe.release.wait()
        return Advance()


WF = WorkflowDef("observe-gc", (StateDef("look", Observe()),))
register_workflow(WF, replace=True)  # a conductor drives registered Python workflows


def test_a_conductor_leaves_nothing_frozen_when_it_ends(store: Store) -> None:
    add_sim_targets(store, 5)
    Observe.frozen_seen = []
    _, final, _ = rollout(store, WF, max_parallel=2)
    assert final == "complete"
    assert Observe.frozen_seen and min(Observe.frozen_seen) > 0  # frozen while it ran
    assert gc.get_freeze_count() == 0  # given back when it ended


def test_a_strategy_ending_gives_back_what_was_frozen_and_the_rest_is_frozen_again(
    store: Store,
) -> None:
    add_sim_targets(store, 2, prefix="fast")
    fast = admin.create_strategy(
        store, WF, StrategyOptions(), target_names=["fast00000", "fast00001"]
    )
    add_sim_targets(store, 1, prefix="slow")
    slow = admin.create_strategy(store, WF, StrategyOptions(), target_names=["slow00000"])
    admin.apply_strategy(store, fast)
    admin.apply_strategy(store, slow)
    Observe.frozen_seen = []
    conductor = Conductor(store, config=EngineConfig(tick_s=0.02))
    seen: dict[str, int] = {}

    async def main() -> dict[int, str]:
        Observe.release = asyncio.Event()
        task = asyncio.create_task(conductor.run(strategy_ids=[fast, slow]))
        for _ in range(500):  # the fast strategy ends while the slow one waits
            await asyncio.sleep(0.01)
            if conductor.finished.get(fast) == "complete":
                break
        seen["after the fast one ended"] = gc.get_freeze_count()
        gc.collect()  # the full collection it waits for before freezing again
        await asyncio.sleep(0.1)  # a few ticks
        seen["after a full collection"] = gc.get_freeze_count()
        Observe.release.set()
        return await task

    try:
        final = asyncio.run(main())
    finally:
        Observe.release = None
    assert final == {fast: "complete", slow: "complete"}
    assert seen["after the fast one ended"] == 0
    assert seen["after a full collection"] > 0  # the slow one's steps, out of sight again
    assert gc.get_freeze_count() == 0


def test_one_conductor_lifting_the_freeze_makes_the_others_freeze_again(store: Store) -> None:
    """gc.freeze is the process's: a conductor that lifted it (its strategy ended)
    lifted it for another in the same process (a simulator's, a test's), which then
    believed itself frozen and never froze again."""
    a, b = Conductor(store), Conductor(store)
    a._freeze()
    b._freeze()
    assert gc.get_freeze_count() > 0
    a._thaw(refreeze=False)
    assert gc.get_freeze_count() == 0
    assert a._refreeze_after is None  # a is done
    assert b._refreeze_after is not None  # b freezes again after the next full collection
    b._thaw(refreeze=False)  # b stops: nothing left to do
    assert b._refreeze_after is None


def test_a_strategy_lost_to_another_conductor_gives_back_what_was_frozen(store: Store) -> None:
    """The other way a strategy leaves a conductor: taken over (fenced off)."""
    from sqlalchemy import update

    from fleetwave.store.schema import strategies

    add_sim_targets(store, 1, prefix="slowlost")
    lost = admin.create_strategy(store, WF, StrategyOptions(), target_names=["slowlost00000"])
    add_sim_targets(store, 1, prefix="slowkept")
    kept = admin.create_strategy(store, WF, StrategyOptions(), target_names=["slowkept00000"])
    admin.apply_strategy(store, lost)
    admin.apply_strategy(store, kept)
    conductor = Conductor(store, config=EngineConfig(tick_s=0.02))
    seen: dict[str, int] = {}

    async def main() -> dict[int, str]:
        Observe.release = asyncio.Event()
        task = asyncio.create_task(conductor.run(strategy_ids=[lost, kept]))
        for _ in range(500):  # both in their action
            await asyncio.sleep(0.01)
            if len(Observe.frozen_seen) == 2:
                break
        seen["while both run"] = gc.get_freeze_count()
        with store.write() as conn:  # another conductor claims it (a new fence)
            conn.execute(
                update(strategies)
                .where(strategies.c.id == lost)
                .values(owner="c-other", fence=strategies.c.fence + 1)
            )
        for _ in range(500):
            await asyncio.sleep(0.01)
            if conductor.finished.get(lost) == "lost":
                break
        seen["after the loss"] = gc.get_freeze_count()
        gc.collect()
        await asyncio.sleep(0.1)
        seen["after a full collection"] = gc.get_freeze_count()
        Observe.release.set()
        return await task

    Observe.frozen_seen = []
    try:
        final = asyncio.run(main())
    finally:
        Observe.release = None
    assert final == {lost: "lost", kept: "complete"}
    assert seen["while both run"] > 0
    assert seen["after the loss"] == 0
    assert seen["after a full collection"] > 0
    assert gc.get_freeze_count() == 0
