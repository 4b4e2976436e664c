"""Plug-in actions and callbacks that misbehave fail their own step, never the conductor:
odd messages and return values, exceptions whose ``str()`` raises, control characters
and megabytes of text (kept on one escaped, bounded line), actions that swallow their
cancel or block the event loop. From a bug hunt of plug-ins (session 16)."""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from conftest import add_sim_targets, applied, on_virtual_time, rollout
from fleetwave import ActionContext, Advance, Outcome, StateAction
from fleetwave.domain.registry import register_workflow
from fleetwave.domain.rules import MAX_DETAILS, details_text
from fleetwave.domain.workflow import (
    Skip,
    StateDef,
    StepFailed,
    TransientError,
    WorkflowDef,
    WorkflowError,
)
from fleetwave.engine.clock import LoopClock
from fleetwave.engine.conductor import Conductor
from fleetwave.engine.config import EngineConfig
from fleetwave.store import queries
from fleetwave.store.callbacks import accept_callback, callback_outcomes
from fleetwave.store.db import Store
from fleetwave.testing.invariants import check


class _Unreadable(Exception):
    def __str__(self) -> str:
        raise TypeError("cannot format")


class _NotText(Exception):
    def __str__(self) -> Any:
        return 42


class _Odd(StateAction):
    """Does what the target's setting ``odd`` says: each one something a plug-in did."""

    async def run(self, ctx: ActionContext) -> Outcome:
        odd = ctx.target.settings.get("odd")
        if odd == "surrogate":  # subprocess output decoded with surrogateescape
            raise StepFailed(b"patch failed: caf\xe9 not found".decode("utf-8", "surrogateescape"))
        if odd == "object-details":
            return Advance(details=object())  # type: ignore[arg-type]
        if odd == "unreadable":
            raise _Unreadable
        if odd == "not-text":
            raise _NotText
        if odd == "unreadable-transient":

            class Flaky(TransientError):
                def __str__(self) -> str:
                    raise ValueError("no")

            raise Flaky
        if odd == "escape":
            raise StepFailed("nul\x00byte and \x1b[31mred\x1b[0m")
        if odd == "huge":
            raise StepFailed("x" * 2_000_000)
        if odd == "skip-surrogate":
            return Skip(reason="done: caf\udce9")
        return Advance()


ODD = WorkflowDef(
    "odd-actions",
    (StateDef("work", _Odd(), timeout_s=5, attempts_max=2, backoff_s=0.01, backoff_max_s=0.01),),
)
register_workflow(ODD)


def _details(store: Store, sid: int) -> dict[str, tuple[str, str]]:
    return {s["target"]: (s["state"], s["details"]) for s in queries.list_steps(store, sid)}


def test_an_action_s_odd_message_or_value_fails_its_step_not_the_conductor(
    store: Store, caplog: pytest.LogCaptureFixture
) -> None:
    odd = [
        "surrogate",
        "object-details",
        "unreadable",
        "not-text",
        "unreadable-transient",
        "escape",
        "huge",
        "skip-surrogate",
    ]
    for kind in odd:
        add_sim_targets(store, 1, prefix=f"{kind}-", settings={"odd": kind})
    add_sim_targets(store, 3, prefix="fine-")
    with caplog.at_level(logging.ERROR):
        sid, result, _ = rollout(store, ODD, max_parallel=20)
    assert result == "failed"  # it ended: no step left holding its slot
    got = _details(store, sid)
    assert all(got[f"fine-{i:05d}"] == ("complete", "") for i in range(3))
    assert got["surrogate-00000"] == ("failed", "work: patch failed: caf\\xe9 not found")
    state, text = got["object-details-00000"]
    assert state == "complete" and text.startswith("<object object at 0x"), text
    assert got["unreadable-00000"] == ("failed", "work: _Unreadable (unreadable message)")
    assert got["not-text-00000"] == ("failed", "work: _NotText (unreadable message)")
    state, text = got["unreadable-transient-00000"]
    assert state == "failed" and text.startswith(
        "work: Flaky (unreadable message) (attempt 2 of 2"
    ), text
    assert got["escape-00000"] == ("failed", "work: nul\\x00byte and \\x1b[31mred\\x1b[0m")
    state, text = got["huge-00000"]
    assert state == "failed" and len(text) < MAX_DETAILS + 100
    assert text.endswith(f"... ({2_000_000 - MAX_DETAILS} more characters)"), text[-60:]
    assert got["skip-surrogate-00000"] == ("complete", "skipped at work: done: caf\\xe9")
    assert check(store).ok
    # the log says the same, on one printable line each
    for record in caplog.records:
        message = record.getMessage()
        assert message.isprintable() and len(message) < MAX_DETAILS + 300, message[:200]


def test_details_text_is_printable_bounded_and_never_raises() -> None:
    assert details_text("") == ""
    assert details_text(None) == ""
    assert details_text("plain words, é and 漢字") == "plain words, é and 漢字"
    assert details_text("two\nlines\r\n") == "two; lines"
    assert details_text("a\tb") == "a b"
    assert details_text("\u200b") == "\\u200b"
    assert details_text("caf\udce9") == "caf\\xe9"
    assert details_text(_Unreadable()) == "_Unreadable (unreadable message)"
    assert details_text(12) == "12"
    assert details_text("y" * (MAX_DETAILS + 256)) == "y" * (MAX_DETAILS + 256)
    cut = details_text("y" * (MAX_DETAILS + 257))
    assert cut == "y" * MAX_DETAILS + "... (257 more characters)"
    assert details_text(cut) == cut  # not cut again


def test_a_callback_with_bytes_that_are_not_utf8_is_stored_escaped(store: Store) -> None:
    """`step callback ... --details $'bad\\xffbyte'` printed a 71-line traceback."""
    add_sim_targets(store, 1)
    sid = applied(store, "clean")
    step = queries.list_steps(store, sid)[0]["step"]
    record = accept_callback(store, step, "wait-for-agent", "done", "bad\udcffbyte\x07", 0.0)
    assert record.details == "bad\\xffbyte\\x07"


def test_a_worker_whose_state_run_raises_fails_its_step(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The safety net: whatever escapes a state's run (a bug of ours) fails the step; the
    worker used to end, and its step held a slot with nobody to report on it."""
    real = Conductor._run_state
    calls = {"n": 0}

    async def broken(self: Conductor, run: Any, fl: Any, recovering: bool) -> Any:
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("a bug")
        return await real(self, run, fl, recovering)

    monkeypatch.setattr(Conductor, "_run_state", broken)
    add_sim_targets(store, 3)
    sid, result, _ = rollout(store, "patch", max_parallel=1)
    assert result == "failed"
    states = sorted(s["state"] for s in queries.list_steps(store, sid))
    assert states.count("failed") == 1 and states.count("complete") == 2, states
    failed = next(s for s in queries.list_steps(store, sid) if s["state"] == "failed")
    assert failed["details"].endswith("internal error (RuntimeError): a bug"), failed
    assert check(store).ok


@pytest.mark.parametrize(
    ("body", "said"),
    [
        ("raise SystemExit(0)\n", "cannot import 'odd_plugin': SystemExit: 0"),
        ("import sys\nsys.exit('bye')\n", "cannot import 'odd_plugin': SystemExit: bye"),
        (
            "class Stop(BaseException):\n    pass\nraise Stop('no')\n",
            "cannot import 'odd_plugin': Stop: no",
        ),
    ],
)
def test_a_plug_in_that_exits_while_imported_is_one_error_line(
    tmp_path: Path, body: str, said: str
) -> None:
    """`raise SystemExit(0)` in a plug-in made serve and apply --wait exit 0 with nothing
    said, as if they had done their work."""
    (tmp_path / "odd_plugin.py").write_text(body, encoding="utf-8")
    fleetwave = Path(sys.executable).with_name("fleetwave")
    db = tmp_path / "f.db"
    assert subprocess.run([fleetwave, "init", "--db", db], capture_output=True).returncode == 0
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "FLEETWAVE_PLUGINS": "odd_plugin"}
    res = subprocess.run(
        [fleetwave, "serve", "--db", db], capture_output=True, text=True, env=env, timeout=60
    )
    assert (res.returncode, res.stdout) == (2, ""), res
    assert res.stderr == f"error: FLEETWAVE_PLUGINS: {said}\n"


class _Fine(StateAction):
    async def run(self, ctx: ActionContext) -> Outcome:
        return Advance()


def test_a_state_given_a_class_or_a_function_is_refused_when_defined() -> None:
    """Registered without a word, then `workflow show` printed a traceback and every
    step failed at run time."""
    with pytest.raises(WorkflowError) as err:
        WorkflowDef("w", (StateDef("s", _Fine),))  # type: ignore[arg-type]
    assert str(err.value) == (
        "workflow w: states[0] (s): action: the class _Fine, not an instance of it (give _Fine())"
    )
    with pytest.raises(WorkflowError) as err:
        WorkflowDef("w", (StateDef("s", print),))  # type: ignore[arg-type]
    assert str(err.value) == (
        "workflow w: states[0] (s): action: builtin_function_or_method is not a StateAction"
    )


def test_an_early_callback_for_a_state_that_waits_for_none_is_answered_so(
    store: Store,
) -> None:
    """Kept as early, it was answered at the step's end "its step ended complete before
    reaching final-power-off", though the step had passed through that state."""
    add_sim_targets(store, 2, settings={"latency_ms": 5})
    sid = applied(store, "clean", max_parallel=1)
    first, second = (s["step"] for s in queries.list_steps(store, sid))
    accept_callback(store, first, "final-power-off", "done", "", 0.0)  # a run state
    accept_callback(store, second, "wait-for-agent", "done", "", 0.0)  # not started yet
    result = asyncio.run(Conductor(store).run(strategy_ids=[sid]))
    assert result[sid] in ("complete", "failed")
    ours = {o["id"]: o for o in callback_outcomes(store, sid)}  # (the sim's own too)
    mine = [ours[i] for i in sorted(ours)[:2]]
    assert (mine[0]["step"], mine[0]["outcome"], mine[0]["reason"]) == (
        first,
        "ignored",
        "state final-power-off does not wait for callbacks",
    )
    assert (mine[1]["step"], mine[1]["outcome"]) == (second, "ignored")
    assert mine[1]["reason"].startswith("its step is not under way: not started yet")


class _Stubborn(StateAction):
    """Catches every cancel and goes on (until the test lets it go)."""

    release: asyncio.Event | None = None

    async def run(self, ctx: ActionContext) -> Outcome:
        if ctx.target.settings.get("odd") != "stubborn":
            return Advance()
        while True:
            try:
                await asyncio.sleep(0.05)
                if _Stubborn.release is not None and _Stubborn.release.is_set():
                    return Advance(details="let go at last")
            except asyncio.CancelledError:
                pass


STUBBORN = register_workflow(
    WorkflowDef("stubborn-actions", (StateDef("work", _Stubborn(), timeout_s=0.3),))
)


def test_an_action_that_swallows_its_cancel_is_abandoned_and_its_step_fails(
    store: Store, caplog: pytest.LogCaptureFixture
) -> None:
    """Its step showed "running" long past its deadline, an abort could not end it,
    and a clean stop waited for it for good."""
    add_sim_targets(store, 1, prefix="stubborn-", settings={"odd": "stubborn"})
    add_sim_targets(store, 2, prefix="fine-")

    async def main() -> tuple[str, float]:
        _Stubborn.release = asyncio.Event()
        c = Conductor(store, config=EngineConfig(shutdown_grace_s=0.5, abandon_after_s=0.5))
        sid = applied(store, "stubborn-actions")
        t0 = time.monotonic()
        result = await asyncio.wait_for(c.run(strategy_ids=[sid]), 30)
        took = time.monotonic() - t0
        _Stubborn.release.set()  # the abandoned action ends; its late report is stale
        await asyncio.sleep(0.2)
        return result[sid], took

    with caplog.at_level(logging.ERROR):
        result, took = asyncio.run(main())
    assert result == "failed"
    assert took < 10, took  # the deadline (0.3 s) and the grace (0.5 s), not forever
    sid = queries.list_strategies(store)[-1]["id"]
    got = _details(store, sid)
    assert got["fine-00000"] == ("complete", "")
    assert got["stubborn-00000"] == (
        "failed",
        "work: timed out after 0.3s (attempt 1 of 1); its action did not stop when "
        "cancelled, and was abandoned",
    )
    assert any("did not stop when cancelled" in r.getMessage() for r in caplog.records)
    assert check(store).ok


def test_a_clean_stop_does_not_wait_for_good_for_an_action_that_swallows_its_cancel(
    store: Store, caplog: pytest.LogCaptureFixture
) -> None:
    """SIGTERM said "running actions finish (up to 10 s)"; 20 s later it still waited.
    Stopped, it must not hand back the lease of the step whose action still runs."""
    wf = register_workflow(
        WorkflowDef("stubborn-long", (StateDef("work", _Stubborn(), timeout_s=3600),)),
        replace=True,
    )
    add_sim_targets(store, 1, prefix="stubborn-", settings={"odd": "stubborn"})
    sid = applied(store, wf.name)

    async def main() -> float:
        _Stubborn.release = asyncio.Event()
        stop = asyncio.Event()
        c = Conductor(store, config=EngineConfig(shutdown_grace_s=0.5, abandon_after_s=0.5))
        task = asyncio.create_task(c.run(strategy_ids=[sid], stop=stop))
        await asyncio.sleep(0.5)  # the action runs
        t0 = time.monotonic()
        stop.set()
        await asyncio.wait_for(task, 30)
        took = time.monotonic() - t0
        # (left behind, it would hold asyncio.run's own end, which waits for every task:
        # see the closing note; the conductor's part is done, its leases handed back)
        _Stubborn.release.set()
        await asyncio.sleep(0.2)
        return took

    with caplog.at_level(logging.ERROR):
        took = asyncio.run(main())
    assert took < 5, took  # the drain's grace, then the cancel's: not forever
    assert any("did not stop when cancelled" in r.getMessage() for r in caplog.records)
    # Not handed back: its action still runs here, and another conductor taking the
    # step over now would run it at the same time (G2); the lease runs out by itself.
    assert any("not handing leases back" in r.getMessage() for r in caplog.records)
    with store.read() as conn:
        owner = conn.exec_driver_sql("SELECT owner FROM strategies WHERE id = ?", (sid,))
        assert owner.scalar_one() is not None


class _Blocks(StateAction):
    async def run(self, ctx: ActionContext) -> Outcome:
        time.sleep(2.2)  # what a plug-in should not do: the whole loop stands still
        await asyncio.sleep(0.3)  # (the conductor's periodic pass runs meanwhile)
        return Advance()


BLOCKS = register_workflow(WorkflowDef("blocking-action", (StateDef("work", _Blocks()),)))


def test_a_blocked_event_loop_is_said_with_its_length(
    store: Store, caplog: pytest.LogCaptureFixture
) -> None:
    """One time.sleep(25) in an action lapsed the conductor's leases and failed every
    step in flight as 'conductor lost', and nothing named the stall."""
    add_sim_targets(store, 1)
    with caplog.at_level(logging.WARNING):
        _, result, _ = rollout(store, BLOCKS, config=EngineConfig(tick_s=0.1))
    assert result == "complete"
    said = [r.getMessage() for r in caplog.records if "event loop was blocked" in r.getMessage()]
    assert len(said) == 1, said
    blocked = float(said[0].split("blocked for ")[1].split("s:")[0])
    assert 1.9 <= blocked <= 5, said


class _StartsAgent(StateAction):
    async def run(self, ctx: ActionContext) -> Outcome:
        return Advance()  # the agent reports when done


IN_TIME = register_workflow(
    WorkflowDef(
        "callback-in-time",
        (StateDef("w", _StartsAgent(), mode="wait-for-callback", timeout_s=1.0),),
    )
)


@pytest.mark.parametrize("kind", ["done", "failed"])
def test_a_callback_stored_before_the_deadline_counts_though_not_picked_up_yet(
    store: Store, kind: str
) -> None:
    """Callbacks stored by another process are picked up once a tick: one stored up to
    a second before the deadline lost to it ("timed out ... waiting for the target's
    callback", the callback "strategy ended first")."""
    add_sim_targets(store, 1)
    sid = applied(store, IN_TIME.name)
    (step,) = (s["step"] for s in queries.list_steps(store, sid))

    async def main() -> str:
        c = Conductor(store, config=EngineConfig(tick_s=30))  # no pick-up before the deadline
        task = asyncio.create_task(c.run(strategy_ids=[sid]))
        while queries.list_steps(store, sid)[0]["state"] != "w":
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.3)
        accept_callback(store, step, "w", kind, "agent says so", time.time())  # "elsewhere"
        return (await asyncio.wait_for(task, 30))[sid]

    result = asyncio.run(main())
    (row,) = queries.list_steps(store, sid)
    (cb,) = callback_outcomes(store, sid)
    assert (cb["outcome"], cb["reason"]) == ("applied", "moved the step on from w")
    if kind == "done":
        assert (result, row["state"], row["details"]) == ("complete", "complete", "agent says so")
    else:
        assert (result, row["state"]) == ("failed", "failed")
        assert row["details"] == "w: target reported failure: agent says so"
    assert check(store).ok


class _BlocksThenWaits(StateAction):
    async def run(self, ctx: ActionContext) -> Outcome:
        if ctx.attempt == 1:
            time.sleep(1.0)  # the loop stands still past the deadline and the grace
            await asyncio.sleep(30)  # and then stops as soon as it is cancelled
        return Advance()


LATE_EXPIRY = register_workflow(
    WorkflowDef(
        "late-expiry",
        (
            StateDef(
                "work",
                _BlocksThenWaits(),
                timeout_s=0.3,
                attempts_max=2,
                backoff_s=0.01,
                backoff_max_s=0.01,
            ),
        ),
    )
)


def test_a_deadline_handled_late_gives_the_action_its_grace_before_abandoning_it(
    store: Store,
) -> None:
    """The grace was counted from the deadline: a loop blocked past both abandoned an
    action before it had a chance to stop, and the state was not retried (a review)."""
    add_sim_targets(store, 1)
    sid, result, _ = rollout(
        store, LATE_EXPIRY, config=EngineConfig(abandon_after_s=0.5, tick_s=0.1)
    )
    (row,) = queries.list_steps(store, sid)
    assert (result, row["state"]) == ("complete", "complete"), row
    assert check(store).ok


class OddBaseException(BaseException):
    """Like gevent's Timeout or a library's own cancellation: not an Exception."""


class RaisesBaseException(StateAction):
    async def run(self, ctx: ActionContext) -> Outcome:
        await asyncio.sleep(1)
        raise OddBaseException("library-internal interrupt")


def test_an_action_raising_a_base_exception_does_not_strand_its_step(store: Store) -> None:
    """_run_state catches CancelledError and Exception, not other BaseException
    subclasses: the worker task dies with it (_worker_ended only discards it), no
    ActionFinished is ever posted, the deadline timer sees a finished task and does
    nothing. The step keeps its slot in state 'a' for ever and run() never returns."""
    add_sim_targets(store, 1)
    wf = register_workflow(
        WorkflowDef("rv-baseexc", (StateDef("a", RaisesBaseException(), timeout_s=10),)),
        replace=True,
    )
    sid = applied(store, wf.name)
    c = Conductor(store, clock=LoopClock())

    async def go() -> dict[int, str]:
        return await asyncio.wait_for(c.run(strategy_ids=[sid]), 3600)

    try:
        result = on_virtual_time(go())
    except TimeoutError:
        result = {sid: "still running after an hour"}
    steps = [(s["state"], s["details"]) for s in queries.list_steps(store, sid)]
    assert result[sid] == "failed", (result, steps)


class ClientTimesOut(StateAction):
    """The action's own client gives up after 2 s (httpx, asyncssh and asyncio.timeout
    all raise the builtin TimeoutError)."""

    async def run(self, ctx: ActionContext) -> Outcome:
        await asyncio.sleep(2)
        raise TimeoutError("connect to bmc: timed out")


def test_an_actions_own_timeout_error_is_not_reported_as_the_state_deadline(
    store: Store,
) -> None:
    """_run_state catches the action's own TimeoutError in the same clause as the
    state's deadline and writes 'timed out after 600s' (the state's timeout): the
    record says the state ran for 10 minutes when the action failed after 2 s, and the
    client's message is dropped."""
    add_sim_targets(store, 1)
    wf = register_workflow(
        WorkflowDef("rv-client-timeout", (StateDef("a", ClientTimesOut(), timeout_s=600),)),
        replace=True,
    )
    sid = applied(store, wf.name)
    c = Conductor(store, clock=LoopClock())
    assert on_virtual_time(asyncio.wait_for(c.run(strategy_ids=[sid]), 60))[sid] == "failed"
    ((_, details),) = [(s["state"], s["details"]) for s in queries.list_steps(store, sid)]
    assert "600" not in details and "connect to bmc" in details, details
