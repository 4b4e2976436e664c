"""Driving a strategy in the foreground with a live progress bar (on a terminal), or
progress lines (to a log: cron, systemd, CI).

If another live conductor (``fleetwave serve``) owns the strategy, this waits for
it to end, and takes it over if that conductor dies (once its lease has run out,
with a new fence): it never drives it while another does.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from sqlalchemy.exc import DBAPIError, NoResultFound

from fleetwave.cli.output import err_console, when
from fleetwave.domain.models import STRATEGY_TERMINAL, plural
from fleetwave.engine import loop as event_loop
from fleetwave.engine.conductor import Conductor
from fleetwave.engine.config import EngineConfig
from fleetwave.engine.loop import wait_set
from fleetwave.store import queries
from fleetwave.store.db import Store
from fleetwave.store.runtime import strategy_state

#: progress lines (stderr not a terminal): one when the counts or the strategy's state
#: changed, at most this often (seconds) ...
PROGRESS_LINE_EVERY_S = 10.0
#: ... and at least this often, changed or not (a log that stops reads as a hang)
PROGRESS_LINE_QUIET_S = 300.0


def progress_line(sid: int, total: int, counts: dict[str, int], state: str) -> str:
    """One line of a rollout's progress for a log: the time (UTC, as log lines and
    tables give it), the steps ended (by
    final state), under way (in one of their states: running, or waiting out a retry's
    backoff), waiting for their turn, and the strategy's state."""
    ended = {k: counts.get(k, 0) for k in ("complete", "failed", "aborted") if counts.get(k)}
    done = queries.steps_ended(counts)
    waiting = counts.get("initial", 0)
    moving = sum(counts.values()) - done - waiting
    how = ", ".join(f"{n} {k}" for k, n in ended.items())
    return (
        f"{when(time.time())} strategy {sid}: {done} of {plural(total, 'step')} ended"
        f"{f' ({how})' if how else ''}, {moving} under way, {waiting} waiting; {state}"
    )


@dataclass
class DriveResult:
    #: the strategy's final state; ``interrupted`` when Ctrl-C stopped this conductor
    state: str
    conductor: Conductor | None
    #: whether this command was driving the strategy when it was stopped (else it only
    #: watched another conductor drive it)
    held: bool = True


def stop_signals() -> list[signal.Signals]:
    """What stops a command: Ctrl-C, SIGTERM, and SIGHUP (a closed terminal) unless it
    was ignored when the process started (``nohup``: it stays ignored)."""
    signals = [signal.SIGINT, signal.SIGTERM]
    if signal.getsignal(signal.SIGHUP) is not signal.SIG_IGN:
        signals.append(signal.SIGHUP)
    return signals


def stop_on_signals(
    stop: asyncio.Event,
    grace_s: float,
    said: Callable[[], str] | None = None,
    at_once: Callable[[], str] | None = None,
) -> None:
    """Ctrl-C, SIGTERM or SIGHUP (a closed terminal) stops the conductor cleanly:
    nothing new starts, running actions finish for up to ``grace_s``, leases are handed
    back. A second one, of any of them, stops at once: it prints ``at_once()`` and
    exits 130 there and then (the leases run out by themselves), without waiting for
    anything, not even an action blocked in a thread. ``said``: what the first one
    prints. A SIGHUP ignored when the process started (``nohup``) stays ignored."""
    loop = asyncio.get_running_loop()

    def first(sig: signal.Signals) -> None:
        if stop.is_set():  # again: stop now
            if at_once is not None:
                with contextlib.suppress(Exception):  # the database may not answer
                    err_console.print(at_once(), highlight=False)
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(130)
        stop.set()
        err_console.print(
            said()
            if said is not None
            else (
                f"stopping: running actions finish (up to {grace_s:g} s), then the leases "
                "are handed back; Ctrl-C again to stop now"
            ),
            highlight=False,
        )

    for sig in stop_signals():
        loop.add_signal_handler(sig, first, sig)


#: said when the database does not answer a stopped command's last look (an outage)
UNREAD = "the database did not answer"


def driven_on(store: Store, sid: int) -> str:
    """Who goes on with strategy ``sid`` once this command stops, for a line that says
    so: the conductor that holds it, the serving one that is about to claim it, or that
    nobody does and how to go on."""
    who = queries.driving(store, sid)
    if who.owner is not None:
        return f"conductor {who.owner} drives it on"
    if who.claimer is not None:
        return str(who.claim)
    if who.text is None:
        return "no conductor needs to drive it now"  # it ended meanwhile
    return who.text.replace("nobody: ", "nobody drives it: ", 1)


def now_state(store: Store, sid: int) -> str | None:
    """The strategy's state for a stopped command's last line; None if the database does
    not answer (an outage: what stopped it, perhaps)."""
    try:
        return str(queries.get_strategy(store, sid)["state"])
    except DBAPIError:
        return None


def _is_now(sid: int, state: str) -> str:
    """``strategy 3 is still applying``, or ``... is complete`` once it has ended."""
    still = "" if state in STRATEGY_TERMINAL else "still "
    return f"strategy {sid} is {still}{state}"


def stopping_unheld(store: Store, sid: int) -> str:
    """What the first Ctrl-C of an ``apply --wait`` that does not hold the strategy says
    (it watched another conductor drive it, or could not claim it, or lost it)."""
    try:
        on = driven_on(store, sid)
    except DBAPIError:
        on = f"who drives it could not be read ({UNREAD})"
    return f"stopping: this command does not drive strategy {sid}; {on}"


def stopped_watching(store: Store, sid: int) -> str:
    """What an ``apply --wait`` that did not hold the strategy says when stopped."""
    try:
        now = queries.get_strategy(store, sid)["state"]
        return f"stopped: {_is_now(sid, now)}; {driven_on(store, sid)}"
    except DBAPIError:
        return (
            f"stopped: this command did not drive strategy {sid}; its state and who "
            f"drives it could not be read ({UNREAD})"
        )


def stopped_at_once(store: Store, sid: int, lease_ttl_s: float) -> str:
    """What an ``apply --wait`` that drove the strategy says when stopped at once."""
    now = now_state(store, sid)
    state = f"{_is_now(sid, now)}; its" if now is not None else f"strategy {sid}: its"
    return (
        f"stopped at once: {state} leases were not handed "
        f"back and run out within {lease_ttl_s:g} s. Go on with 'fleetwave strategy "
        f"apply {sid} --wait' or 'fleetwave serve' (they take over then)"
    )


def _read_progress(store: Store, sid: int) -> tuple[dict[str, int], str, str | None, float] | None:
    """A strategy's steps by state, its state and owner, and what reading them took
    (seconds); None when they cannot be read now (a locked or failing database, the
    strategy gone): a watch skips a turn, it never stops the drive."""
    started = time.monotonic()
    try:
        counts = queries.step_counts(store, sid)
        state, owner = strategy_state(store, sid)
    except (DBAPIError, NoResultFound):
        return None
    return counts, state, owner, time.monotonic() - started


def _pause(every_s: float, cost_s: float) -> float:
    """How long a watch waits between two reads: ``every_s``, or longer when a read is
    slow (a strategy of 100,000 steps: about 40 ms), so that watching takes at most
    about 2 % of the event loop that drives the rollout."""
    return max(every_s, 50 * cost_s)


class _ProgressLines:
    """Progress lines of strategies (:func:`progress_line`) on stderr, each said when
    it says something new (its time aside) or the last is :data:`PROGRESS_LINE_QUIET_S`
    old."""

    def __init__(self, store: Store) -> None:
        self.store = store
        #: what was last said of each strategy (without its time), and when
        self.last: dict[int, tuple[str, float]] = {}

    def say(
        self,
        sid: int,
        total: int | None = None,
        suffix: str | Callable[[str, str | None], str] = "",
        *,
        always: bool = False,
    ) -> float | None:
        """Read and maybe say strategy ``sid``'s line (``total``: its steps, else what
        is read; ``suffix``: added to the line, or made from the strategy's state and
        owner); what the read took (seconds), or None when it failed (a turn skipped)."""
        read = _read_progress(self.store, sid)
        if read is None:
            return None
        counts, state, owner, took = read
        line = progress_line(sid, sum(counts.values()) if total is None else total, counts, state)
        seen, now = line.split(" ", 2)[2], time.monotonic()  # without its time or suffix
        line += suffix if isinstance(suffix, str) else suffix(state, owner)
        before = self.last.get(sid)
        if (
            always
            or before is None
            or seen != before[0]
            or now - before[1] >= PROGRESS_LINE_QUIET_S
        ):
            err_console.print(line, highlight=False)
            self.last[sid] = (seen, now)
        return took


async def _log_progress(store: Store, sid: int, total: int, done: asyncio.Event) -> None:
    """Progress as lines on stderr, for a log (see :data:`PROGRESS_LINE_EVERY_S`): the
    first at once, the last (unless the one before said the same) when the drive ends."""
    lines = _ProgressLines(store)
    while True:
        cost = lines.say(sid, total) or 0.0
        if done.is_set():
            return
        await wait_set(done, _pause(PROGRESS_LINE_EVERY_S, cost))


class ServeReport:
    """``fleetwave serve``'s log of what it drives, on stderr: a line when it takes a
    strategy on, then when that strategy's counts change (as :func:`_log_progress`: at
    most every :data:`PROGRESS_LINE_EVERY_S`), and one when it lets it go: ended, lost
    to another conductor, or handed back at a stop. Why it was let go is read from the
    strategy's row, not from what the engine kept (a lease that lapsed leaves no word
    there). Without it a served rollout left no line between "serving" and "stopped".
    :meth:`run` ticks until cancelled; a last ``tick(stopped=True)`` once the conductor
    has stopped lets go of what it still held."""

    def __init__(self, store: Store, conductor: Conductor) -> None:
        self.conductor = conductor
        self._lines = _ProgressLines(store)
        self._held: set[int] = set()  # the strategies it held at the last tick
        self._finished: dict[int, str] = {}  # the conductor's ends, at the last tick
        self._due = 0.0

    async def run(self) -> None:
        while True:
            cost = self.tick()
            # in-memory checks each second; the database read only when due
            await asyncio.sleep(max(1.0, 10 * cost))

    def _let_go_why(self, stopped: bool) -> Callable[[str, str | None], str]:
        def why(state: str, owner: str | None) -> str:
            if state in STRATEGY_TERMINAL:
                return " (ended)"
            if owner is not None and owner != self.conductor.id:
                return f" (lost: conductor {owner} drives it now)"
            if stopped:
                return " (handed back: the next conductor goes on with it)"
            return " (let go: not driven here now; the log says why)"

        return why

    def tick(self, *, stopped: bool = False) -> float:
        """Say what changed; the time the database reads took (seconds). ``stopped``:
        the conductor has stopped: what it still held is let go."""
        now, cost = time.monotonic(), 0.0
        held = set() if stopped else set(self.conductor.runs)
        for sid in sorted(held - self._held):  # taken on (again, after a loss)
            cost += self._lines.say(sid, suffix=" (taken on)", always=True) or 0.0
        if now >= self._due:  # every held strategy, when its line changed
            cost += sum(self._lines.say(sid) or 0.0 for sid in sorted(held & self._held))
            self._due = now + _pause(PROGRESS_LINE_EVERY_S, cost)
        why = self._let_go_why(stopped)
        # held and let go since the last tick; also one taken on and ended between two
        # ticks (a small strategy ends within a second: said once, as it ended)
        finished = dict(self.conductor.finished)
        brief = {
            sid
            for sid, how in finished.items()
            if how != self._finished.get(sid) and sid not in held | self._held
        }
        for sid in sorted((self._held - held) | brief):
            if self._lines.say(sid, suffix=why, always=True) is None:
                err_console.print(f"{when(time.time())} strategy {sid}: let go", highlight=False)
            self._lines.last.pop(sid, None)
        self._held, self._finished = held, finished
        return cost


async def _watch(
    store: Store, sid: int, total: int, progress: Progress | None, done: asyncio.Event
) -> None:
    task = None
    if progress is not None:
        # Steps ended before this watch (a resumed rollout) are where the bar starts, not
        # progress made: the time left is estimated from what ends from now on.
        ended_before = queries.steps_ended(queries.step_counts(store, sid))
        task = progress.add_task(f"strategy {sid}", total=total, completed=ended_before)
    cost = 0.0
    while True:
        read = _read_progress(store, sid) if task is not None else None
        if progress is not None and task is not None and read is not None:
            counts, state, _owner, cost = read
            finished = queries.steps_ended(counts)
            ended = f"{counts.get('failed', 0)} failed"
            if counts.get("aborted"):
                ended += f", {counts['aborted']} aborted"
            if state == "paused":
                ended += ", paused: 'fleetwave strategy resume' to go on"
            elif state == "waiting-approval":
                ended += f", waiting for approval: 'fleetwave strategy approve {sid}' to go on"
            elif state in ("abort-requested", "aborting"):
                ended += ", aborting"
            progress.update(task, completed=finished, description=f"strategy {sid} ({ended})")
        if done.is_set():
            return
        await wait_set(done, _pause(0.25, cost))


async def _drive(store: Store, sid: int, show_progress: bool, config: EngineConfig) -> DriveResult:
    total = int(queries.get_strategy(store, sid)["steps"])
    conductor = Conductor(store, config=config)
    done = asyncio.Event()
    progress = (
        Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("left"),
            TimeRemainingColumn(),
            console=err_console,
            transient=False,
        )
        if show_progress and err_console.is_terminal
        else None
    )
    if progress is not None:
        progress.start()
        watcher = asyncio.create_task(_watch(store, sid, total, progress, done))
    elif show_progress:  # to a log: a live bar would show only its last frame
        watcher = asyncio.create_task(_log_progress(store, sid, total, done))
    else:
        watcher = asyncio.create_task(_watch(store, sid, total, None, done))
    stop = asyncio.Event()
    driving = [conductor]
    held = [True]

    def said() -> str:
        held[0] = sid in driving[0].runs
        if held[0]:
            return (
                f"stopping: running actions finish (up to {config.shutdown_grace_s:g} s), "
                "then the leases are handed back; Ctrl-C again to stop now"
            )
        return stopping_unheld(store, sid)

    def at_once() -> str:
        if not held[0]:
            return stopped_watching(store, sid)
        return stopped_at_once(store, sid, config.lease_ttl_s)

    with contextlib.suppress(NotImplementedError, RuntimeError):  # not the main thread
        stop_on_signals(stop, config.shutdown_grace_s, said, at_once)
    try:
        # Patient: while another live conductor drives it, this one waits for the end,
        # and takes over if that conductor dies (its lease runs out). Fenced off by
        # another ("lost"), it goes on waiting the same way.
        result = await conductor.run(strategy_ids=[sid], patient=True, stop=stop)
        state = result.get(sid, "unknown")
        while state == "lost" and not stop.is_set():
            conductor = driving[0] = Conductor(store, config=config)
            result = await conductor.run(strategy_ids=[sid], patient=True, stop=stop)
            state = result.get(sid, "unknown")
        if stop.is_set() and state not in STRATEGY_TERMINAL:
            state = "interrupted"
        done.set()
        await watcher
    finally:
        watcher.cancel()
        if progress is not None:
            progress.stop()
    return DriveResult(state, conductor, held[0])


def drive_strategy(
    store: Store, sid: int, *, show_progress: bool, config: EngineConfig | None = None
) -> DriveResult:
    return event_loop.run(_drive(store, sid, show_progress, config or EngineConfig()))
