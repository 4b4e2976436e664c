"""The sim driver's own machinery: shared latency timer and settings profiles."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import add_sim_targets, applied, on_virtual_time
from fleetwave.domain.models import StrategyOptions, Target
from fleetwave.domain.workflow import (
    ActionContext,
    Advance,
    DriverOperation,
    NotOnTarget,
    NotStarted,
    RemoteResult,
    StepFailed,
)
from fleetwave.drivers.sim import SimDriver, _Sleeps
from fleetwave.engine.conductor import Conductor
from fleetwave.store.db import Store


@settings(max_examples=40, deadline=None)
@given(delays=st.lists(st.integers(0, 30), min_size=1, max_size=40), cancel=st.data())
def test_shared_timer_wakes_each_sleeper_at_its_time_in_order(
    delays: list[int], cancel: st.DataObject
) -> None:
    """Sleeps of any mix of delays wake no earlier than asked, in due order; cancelling
    one leaves the others be."""
    sleeps = _Sleeps()
    cancelled = cancel.draw(st.sets(st.integers(0, len(delays) - 1), max_size=3))
    woke: list[tuple[int, tuple[float, int], float]] = []

    async def one(i: int, ms: int) -> None:
        loop = asyncio.get_running_loop()
        fut = sleeps.sleep(ms / 1000)
        # its own due time (and place among equal ones): a time read here before or
        # after it can be a preemption away from it on a loaded machine
        due = next((when, seq) for when, seq, f in sleeps._heap if f is fut)
        await fut
        woke.append((i, due, loop.time()))

    async def main() -> None:
        tasks = [asyncio.create_task(one(i, ms)) for i, ms in enumerate(delays)]
        await asyncio.sleep(0)
        for i in cancelled:
            tasks[i].cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    asyncio.run(main())  # the standard loop: its timers never fire early
    assert sorted(i for i, _, _ in woke) == sorted(set(range(len(delays))) - cancelled)
    assert all(at >= due for _, (due, _), at in woke)
    dues = [due for _, due, _ in woke]
    assert dues == sorted(dues)  # in due order, equal ones first come first


def test_shared_timer_survives_a_new_event_loop() -> None:
    """A driver outlives a loop (tests run several): sleeping on the next one works."""
    sleeps = _Sleeps()

    async def pending_forever() -> None:
        sleeps.sleep(0.001)  # abandoned with its loop, before it is due

    asyncio.run(pending_forever())

    async def short() -> float:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        await asyncio.wait_for(sleeps.sleep(0.01), 2.0)  # a timer left on the old loop: never
        return loop.time() - t0

    assert 0.01 <= asyncio.run(short()) < 1.0


def test_profiles_are_shared_by_settings_not_kept_per_target() -> None:
    sim = SimDriver()
    shared = {"latency_ms": 5}
    a = sim._profile(Target(name="a", settings=shared))
    b = sim._profile(Target(name="b", settings=shared))
    c = sim._profile(Target(name="c", settings={"latency_ms": 5}))  # equal, not the same
    d = sim._profile(Target(name="d", settings={"latency_ms": 7}))
    assert a is b is c and d is not a
    assert d.latency_s == 0.007 and a.latency_s == 0.005
    assert len(sim._by_settings) == 2  # one per combination, nothing per target


def _ctx(driver: SimDriver, target: Target, state: str, *, step_id: int = 7) -> ActionContext:
    return ActionContext(
        target=target, state=state, attempt=1, strategy_id=1, step_id=step_id, driver=driver
    )


def test_a_target_remembers_its_last_operation_for_a_recover_hook() -> None:
    """What a recover hook asks after a takeover: the operation of the state the step is
    in. The target answers for the last one it ran for that step (done, failed, running,
    or never started); earlier ones are behind the step and not kept."""
    driver = SimDriver()
    ok = Target(name="ok", settings={"latency": "uniform", "latency_ms": 1})
    bad = Target(name="bad", settings={"latency": "uniform", "latency_ms": 1, "fail_at": "apply"})

    async def main() -> None:
        assert (
            await driver.observe(ok, "check", _ctx(driver, ok, "check")) is RemoteResult.NOT_STARTED
        )
        running = asyncio.create_task(driver.perform(ok, "check", _ctx(driver, ok, "check")))
        await asyncio.sleep(0)
        assert (
            await driver.observe(ok, "check", _ctx(driver, ok, "check")) is RemoteResult.IN_PROGRESS
        )
        assert await running is RemoteResult.DONE
        assert await driver.observe(ok, "check", _ctx(driver, ok, "check")) is RemoteResult.DONE
        await driver.perform(ok, "apply", _ctx(driver, ok, "apply"))
        assert await driver.observe(ok, "apply", _ctx(driver, ok, "apply")) is RemoteResult.DONE
        # the step went on: 'check' is behind it
        assert (
            await driver.observe(ok, "check", _ctx(driver, ok, "check")) is RemoteResult.NOT_STARTED
        )
        with pytest.raises(StepFailed):
            await driver.perform(bad, "apply", _ctx(driver, bad, "apply", step_id=8))
        with pytest.raises(StepFailed, match=r"^failed on target \(fail_at=apply\)$"):
            await driver.observe(bad, "apply", _ctx(driver, bad, "apply", step_id=8))

    asyncio.run(main())


def test_a_plain_operation_is_on_the_target_record_and_outlives_a_lost_caller() -> None:
    """A plain target (fixed latency, no faults) runs its operation in the caller's task.
    It kept no record: a conductor that crashed after (or while) the operation ran was
    followed by a recover hook that found it 'not started' and started it again, which
    the simulator counted as a second start of attempt 1 (`fleetwave sim --seed 1
    --faults crash,db`, the README's example, failed with G1 at the target)."""
    driver = SimDriver()
    driver.count_starts = True
    plain = Target(name="p", settings={"latency_ms": 10})
    lost = Target(name="q", settings={"latency_ms": 10})
    failing = Target(name="f", settings={"latency_ms": 1, "fail_at": "apply"})
    op = DriverOperation("apply")

    def recovering(target: Target, step_id: int) -> ActionContext:
        return replace(_ctx(driver, target, "apply", step_id=step_id), recovering=True)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        # ends: recorded as a remote run's end is
        assert await driver.perform(plain, "apply", _ctx(driver, plain, "apply")) is (
            RemoteResult.DONE
        )
        assert await driver.observe(plain, "apply", _ctx(driver, plain, "apply")) is (
            RemoteResult.DONE
        )
        assert await op.recover(recovering(plain, 7)) == Advance()
        with pytest.raises(StepFailed):
            await driver.perform(failing, "apply", _ctx(driver, failing, "apply", step_id=8))
        with pytest.raises(StepFailed, match="fail_at=apply"):
            await driver.observe(failing, "apply", _ctx(driver, failing, "apply", step_id=8))
        # its caller lost mid-way: the rest runs on the target, and a recover hook joins it
        started = loop.time()
        caller = asyncio.create_task(
            driver.perform(lost, "apply", _ctx(driver, lost, "apply", step_id=9))
        )
        await asyncio.sleep(0.004)
        caller.cancel()
        with pytest.raises(asyncio.CancelledError):
            await caller
        assert await driver.observe(lost, "apply", _ctx(driver, lost, "apply", step_id=9)) is (
            RemoteResult.IN_PROGRESS
        )
        assert await op.recover(recovering(lost, 9)) == Advance()
        # its own 10 ms (started again, it would end 4 ms later)
        assert loop.time() - started == pytest.approx(0.010, abs=0.001)
        assert await driver.observe(lost, "apply", _ctx(driver, lost, "apply", step_id=9)) is (
            RemoteResult.DONE
        )

    # on virtual time: on a loaded machine (CI's test run) a 10 ms timer fired 4 ms late
    on_virtual_time(main())
    # each run started once: the recover hooks observed or joined, and started nothing
    assert dict(driver.starts) == {("p", "apply", 1): 1, ("f", "apply", 1): 1, ("q", "apply", 1): 1}


def test_closing_the_driver_ends_the_runs_left_on_targets_and_their_joiners() -> None:
    """A run left going on by its lost caller, cancelled as the driver closes: it was
    left in progress for good, and a caller joining it waited for ever."""
    driver = SimDriver()
    plain = Target(name="p", settings={"latency_ms": 50})

    async def main() -> None:
        caller = asyncio.create_task(driver.perform(plain, "apply", _ctx(driver, plain, "apply")))
        await asyncio.sleep(0.005)
        caller.cancel()
        with pytest.raises(asyncio.CancelledError):
            await caller
        ctx = replace(_ctx(driver, plain, "apply"), recovering=True)
        joiner = asyncio.create_task(driver.perform(plain, "apply", ctx))
        await asyncio.sleep(0)
        await driver.aclose()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(joiner, 1.0)
        assert await driver.observe(plain, "apply", _ctx(driver, plain, "apply")) is (
            RemoteResult.NOT_STARTED
        )

    asyncio.run(main())


def test_a_driver_keeps_nothing_of_a_strategy_once_it_ended(store: Store) -> None:
    """Every finished operation's record (a future each) was kept for the driver's life:
    a third slower at 100,000 targets, and a serve using the sim grew without end."""
    add_sim_targets(store, 20, settings={"latency": "uniform", "latency_ms": 2})
    sid = applied(store, "patch", max_parallel=5)
    driver = SimDriver()
    final = asyncio.run(Conductor(store, drivers={"sim": driver}).run(strategy_ids=[sid]))
    assert final[sid] == "complete"
    assert driver._remote == {} and driver._finished == {}


def test_an_operation_that_finishes_after_its_strategy_ended_is_not_recorded(
    store: Store,
) -> None:
    """Found by a review: a step that timed out leaves its operation running on the
    target; when it finished after the strategy ended, its record came back for good."""
    from fleetwave.domain.registry import register_workflow
    from fleetwave.domain.workflow import DriverOperation, StateDef, WorkflowDef
    from fleetwave.engine.clock import LoopClock
    from fleetwave.store import admin
    from fleetwave.testing.vloop import VirtualTimeLoop

    add_sim_targets(store, 3, settings={"latency_ms": 2000, "latency": "uniform"})
    wf = register_workflow(
        WorkflowDef("slow-op", (StateDef("op", DriverOperation("op"), timeout_s=0.1),)),
        replace=True,
    )
    driver = SimDriver()

    async def main() -> None:
        for _ in range(2):
            sid = admin.create_strategy(store, wf, StrategyOptions(), all_targets=True)
            admin.apply_strategy(store, sid)
            c = Conductor(store, clock=LoopClock(), drivers={"sim": driver})
            assert (await c.run(strategy_ids=[sid]))[sid] == "failed"  # timed out
            await asyncio.sleep(10)  # the targets finish what the steps gave up on

    loop = VirtualTimeLoop()
    try:
        loop.run_until_complete(main())
    finally:
        loop.close()
    assert driver._finished == {} and driver._remote == {}


def test_a_bad_setting_value_is_quoted_short_and_on_one_line() -> None:
    """A sim setting's bad value went into the message raw: a terminal escape sequence
    reached the screen, and a YAML alias bomb made one 200 MB line."""
    from fleetwave.drivers.sim import SimSettingError, validate_settings

    with pytest.raises(SimSettingError) as bad:
        validate_settings({"fail_at": "a\x1b[31mred"})
    assert str(bad.value) == "sim setting fail_at: 'a\\x1b[31mred' is not a state name"
    with pytest.raises(SimSettingError) as huge:
        validate_settings({"latency_ms": "9" * 100_000 + "x"})
    msg = str(huge.value)
    assert msg == f"sim setting latency_ms: {'9' * 40!r}... is not a number", msg
    with pytest.raises(SimSettingError) as key:
        validate_settings({"bad\nkey": 1})
    assert "\n" not in str(key.value) and "'bad\\nkey': unknown" in str(key.value)


def test_a_recover_hook_does_not_start_an_operation_once_the_strategy_is_stopping() -> None:
    """After a takeover, the recover hook of a driver operation that never reached the
    target started it: an attempt begun after the operator's abort had been seen.
    Stopping, it says so instead (the step ends aborted); otherwise it says the target
    never got it (NotOnTarget): the engine records the next attempt, then sends it."""
    driver = SimDriver()
    driver.count_starts = True
    t = Target(name="t1", settings={"latency_ms": 1})
    op = DriverOperation("apply")

    def ctx(stopping: bool) -> ActionContext:
        return replace(_ctx(driver, t, "apply"), recovering=True, is_stopping=lambda: stopping)

    async def main() -> None:
        with pytest.raises(NotStarted, match="the target reports apply not started"):
            await op.recover(ctx(True))
        assert driver.starts == {}
        with pytest.raises(NotOnTarget, match="the target reports apply not started"):
            await op.recover(ctx(False))
        assert driver.starts == {}  # sent by the engine, as the next attempt

    asyncio.run(main())


def test_a_simulated_agents_second_report_says_what_its_kind_says() -> None:
    """A duplicate report of kind failed read "wait-for-agent finished (again)", so the
    step's failure said "target reported failure: ... finished (again)" (an acceptance
    pass): a report's details now agree with its kind."""
    driver = SimDriver(seed=3)
    sent: list[tuple[str, str]] = []
    driver.callback_sink = lambda _step, _state, kind, details, _visit: sent.append((kind, details))
    target = Target(name="t", settings={"latency_ms": 1, "callback_dup_rate": 1.0})

    async def go() -> None:
        for step in range(40):
            ctx = ActionContext(
                target=target,
                state="wait-for-agent",
                attempt=1,
                strategy_id=1,
                step_id=step,
                driver=driver,
                callback_expected=True,
            )
            await driver.perform(target, f"op{step}", ctx)
        await driver.wait_agents()

    asyncio.run(go())
    again = [(kind, details) for kind, details in sent if details.endswith("(again)")]
    assert {kind for kind, _ in again} == {"done", "failed", "heartbeat"}, again
    for kind, details in again:
        said = {
            "done": " finished",
            "failed": " failed on the agent",
            "heartbeat": " still running",
        }
        assert said[kind] in details, (kind, details)
