"""The web dashboard end to end, in Debian's chromium driven by Playwright: a real
``fleetwave serve --listen`` on a 2,000-target simulated rollout, watched by an
operator (who applies, pauses and resumes it with the page's buttons) and a reader
(who sees no button), until it ends with the page's counts equal to ``strategy
show``'s; a failed target followed to its step page; the stream's loss said when the
server stops. A screenshot of the strategy page is written to the test's directory.
And the approve button: a strategy of two stages with ``--stage-approval`` waiting
``waiting-approval``, approved by an operator on a phone-sized screen by keyboard alone
(confirming), recorded as ``api:NAME``; the reader sees no button."""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

from api_harness import run_fleetwave, serving
from fleetwave.domain.models import Group, StrategyOptions, Target
from fleetwave.domain.registry import get_workflow
from fleetwave.domain.rollout import RolloutSpec, parse_stages
from fleetwave.store import admin
from fleetwave.store.db import open_store
from fleetwave.store.tokens import Role, create_token

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
TARGETS = 2000
#: targets whose sim operation fails in a state (``fail_at``): the failures to follow
FAILING = {"m-0100": "pre-check", "m-0900": "finishing", "m-1500": "updating-patches"}
#: where to copy the screenshot as well (docs/dashboard.png, for the manual), if set
SHOT_COPY_ENV = "FLEETWAVE_DASHBOARD_SHOT"


@pytest.fixture
def chromium(tmp_path: Path) -> Iterator[Any]:
    """A browser context of Debian's chromium, on a fresh profile."""
    if not os.path.exists(CHROMIUM):
        why = "no /usr/bin/chromium (Debian's chromium; bash scripts/test.sh installs it)"
        if os.environ.get("CI", "").lower() in ("true", "1", "yes"):
            pytest.fail(f"CI runs the dashboard's browser test, but {why}")
        pytest.skip(why)
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        context = p.chromium.launch_persistent_context(
            str(tmp_path / "chromium-profile"),
            executable_path=CHROMIUM,
            headless=True,
            args=CHROMIUM_ARGS,
            viewport={"width": 1280, "height": 720},
        )
        try:
            yield context
        finally:
            context.close()


def _fleet(tmp_path: Path) -> tuple[Path, str, str]:
    """The fleet, its strategy (initial) and the two tokens, written in this process
    (eight commands would take half the test's time on a loaded machine)."""
    db = tmp_path / "fleet.db"
    store = open_store(str(db))
    try:
        admin.add_group(store, Group("canary", 10))
        admin.add_group(store, Group("main", 500))
        fleet = [
            Target(f"c-{i:02d}", group="canary", settings={"latency_ms": 200}) for i in range(20)
        ]
        fleet += [
            Target(
                name,
                group="main",
                settings={
                    "latency_ms": 800,
                    **({"fail_at": FAILING[name]} if name in FAILING else {}),
                },
            )
            for name in (f"m-{i:04d}" for i in range(TARGETS - 20))
        ]
        admin.add_targets(store, fleet)
        patch = get_workflow("patch")
        assert patch is not None
        opts = StrategyOptions(max_parallel=500, stages_by_group=True)
        assert admin.create_strategy(store, patch, opts, all_targets=True) == 1
        reader = create_token(store, "watcher", Role.READER, None)
        operator = create_token(store, "night-shift", Role.OPERATOR, None)
    finally:
        store.dispose()
    return db, reader, operator


def _sign_in(page: Any, base: str, token: str) -> None:
    page.goto(base + "/")
    page.fill("#token", token)
    page.click("#login-form button[type=submit]")
    page.wait_for_selector("#strategies table")


def _counts(page: Any) -> dict[str, int]:
    return {
        chip.get_attribute("data-state"): int(chip.query_selector(".n").inner_text())
        for chip in page.query_selector_all("#counts [data-state]")
    }


def _shown(db: Path, *what: str) -> Any:
    """``strategy show 1`` as JSON, or another command's (``events --strategy 1``)."""
    done = run_fleetwave(db, *(what or ("strategy", "show", "1")), "--format", "json")
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def _act(page: Any, verb: str) -> None:
    """Click the action's button and say yes to its confirmation."""
    page.click(f"#act-{verb}")
    page.wait_for_selector("#confirm[open]")
    assert str(1) in page.inner_text("#confirm-text")
    page.click("#confirm-yes")


def test_a_rollout_watched_paused_resumed_and_followed_to_a_failed_step(
    tmp_path: Path, chromium: Any
) -> None:
    db, reader_token, operator_token = _fleet(tmp_path)
    errors: list[str] = []
    with serving(db) as server:
        ops = chromium.new_page()
        ops.on("pageerror", lambda e: errors.append(f"operator page: {e}"))
        _sign_in(ops, server.base, operator_token)
        assert "night-shift (operator)" in ops.inner_text("#who")
        ops.click("a[href='#/strategy/1']")
        ops.wait_for_selector("#counts [data-state=initial]")
        assert _counts(ops) == {"initial": TARGETS}

        # the reader, on a phone-sized screen: the same page, no button
        reader = chromium.new_page()
        reader.set_viewport_size({"width": 390, "height": 844})
        reader.on("pageerror", lambda e: errors.append(f"reader page: {e}"))
        _sign_in(reader, server.base, reader_token)
        reader.goto(server.base + "/#/strategy/1")
        reader.wait_for_selector("#counts [data-state]")
        assert reader.query_selector_all("#actions button") == []
        assert reader.evaluate("document.documentElement.scrollWidth") <= 390

        # a confirmation said no to changes nothing
        ops.click("#act-apply")
        ops.click("#confirm-no")
        with server.client(reader_token) as http:
            assert http.get("/v1/strategies/1").json()["state"] == "initial"
        _act(ops, "apply")
        # (a step takes 1 s as a canary, 10 at a time, then 4 s, 500 at a time: some 18 s)
        ops.wait_for_function(
            "() => [...document.querySelectorAll('#counts [data-state]')]"
            ".some(c => c.dataset.state !== 'initial')",
            timeout=30_000,
        )
        _act(ops, "pause")
        ops.wait_for_selector("#strategy-state .badge.s-paused", timeout=10_000)
        with server.client(reader_token) as http:
            assert http.get("/v1/strategies/1").json()["state"] == "paused"
        reader.wait_for_selector("#strategy-state .badge.s-paused", timeout=10_000)
        assert ops.is_hidden("#act-pause") and ops.is_visible("#act-resume")
        _act(ops, "resume")
        ops.wait_for_selector("#strategy-state .badge.s-applying", timeout=10_000)

        # to the end (failed: three of its steps failed): the page's counts are strategy
        # show's (the reader's too)
        ops.wait_for_selector("#strategy-state .badge.s-failed", timeout=45_000)
        shown = _shown(db)
        assert shown["state"] == "failed"
        assert shown["step_states"] == {"complete": TARGETS - len(FAILING), "failed": 3}
        ops.wait_for_function(
            f"() => document.querySelector('#counts [data-state=complete] .n')?.textContent"
            f" === '{TARGETS - len(FAILING)}'"
        )
        assert _counts(ops) == shown["step_states"]
        reader.wait_for_selector("#strategy-state .badge.s-failed", timeout=10_000)
        assert _counts(reader) == shown["step_states"]
        assert ops.query_selector_all("#actions button:not([hidden])") == []
        shot = tmp_path / "strategy-page.png"
        ops.screenshot(path=str(shot), full_page=True)
        assert shot.stat().st_size > 10_000
        if os.environ.get(SHOT_COPY_ENV):
            shutil.copy(shot, os.environ[SHOT_COPY_ENV])

        # the grid by keyboard: a cell's details, and Enter opens its step
        ops.focus("#grid")
        ops.keyboard.press("ArrowRight")
        assert re.search(r"c-\d\d: complete .*Enter opens the step", ops.inner_text("#cell-info"))

        # the latest failures, each a link to its step: one followed
        failures = ops.query_selector_all("#failures tbody tr")
        assert {row.query_selector("td").inner_text() for row in failures} == set(FAILING)
        ops.click("#failures .failure-link >> nth=0")
        ops.wait_for_selector("#step-summary")
        target = ops.inner_text("#step-summary a[href^='#/target/']")
        assert target in FAILING
        assert "failed" in ops.inner_text("#step-summary")
        journal = ops.inner_text("table[aria-label=Journal]")
        assert "failed" in journal and FAILING[target] in journal

        # the target's page: its time per state, in this strategy
        ops.click("#step-summary a[href^='#/target/']")
        ops.wait_for_selector("text=Strategy #1")
        assert "pre-check" in ops.inner_text("main")

        # the server goes: the page says so
        assert server.stop() == 0
        ops.wait_for_function(
            "() => document.querySelector('#live').textContent.includes('lost')", timeout=10_000
        )
    assert errors == []


#: the approval's fleet: two stages (groups a, then b), a few hundred quick targets
APPROVAL_FLEET = {"a": 100, "b": 200}


def _approval_fleet(tmp_path: Path) -> tuple[Path, str, str]:
    """Strategy 1 over :data:`APPROVAL_FLEET`, staged a then b with ``--stage-approval``,
    applied (``serve`` drives it); a reader's and an operator's tokens."""
    db = tmp_path / "fleet.db"
    store = open_store(str(db))
    try:
        for group, n in APPROVAL_FLEET.items():
            admin.add_group(store, Group(group, 100))
            admin.add_targets(
                store,
                [
                    Target(f"{group}-{i:03d}", group=group, settings={"latency_ms": 20})
                    for i in range(n)
                ],
            )
        patch = get_workflow("patch")
        assert patch is not None
        opts = StrategyOptions(max_parallel=100, stage_approval=True)
        spec = RolloutSpec(stages=parse_stages(list(APPROVAL_FLEET)))
        assert admin.create_strategy(store, patch, opts, all_targets=True, spec=spec) == 1
        admin.apply_strategy(store, 1)
        reader = create_token(store, "watcher", Role.READER, None)
        operator = create_token(store, "night-shift", Role.OPERATOR, None)
    finally:
        store.dispose()
    return db, reader, operator


def _tab_to(page: Any, element_id: str, presses_max: int = 40) -> None:
    """Press Tab until the element has the focus (it is reachable by keyboard)."""
    for _ in range(presses_max):
        page.keyboard.press("Tab")
        if page.evaluate("document.activeElement?.id") == element_id:
            return
    raise AssertionError(f"#{element_id} not reached in {presses_max} presses of Tab")


def test_a_stage_approved_with_the_button_by_keyboard_on_a_phone(
    tmp_path: Path, chromium: Any
) -> None:
    db, reader_token, operator_token = _approval_fleet(tmp_path)
    errors: list[str] = []
    phone = {"width": 390, "height": 844}
    with serving(db) as server:
        ops = chromium.new_page()
        ops.set_viewport_size(phone)
        ops.on("pageerror", lambda e: errors.append(f"operator page: {e}"))
        posts: list[str] = []  # (a quick Cancel then approve once sent two approvals)
        ops.on("request", lambda r: posts.append(r.url) if r.method == "POST" else None)
        _sign_in(ops, server.base, operator_token)
        ops.goto(server.base + "/#/strategy/1")
        # stage 1 (a) ends, and the strategy waits: approve is offered, pause and abort too
        ops.wait_for_selector("#strategy-state .badge.s-waiting-approval", timeout=30_000)
        assert _counts(ops) == {"complete": APPROVAL_FLEET["a"], "initial": APPROVAL_FLEET["b"]}
        assert ops.is_visible("#act-approve")
        shown = [
            b.get_attribute("id") for b in ops.query_selector_all("#actions button:not([hidden])")
        ]
        assert shown == ["act-pause", "act-approve", "act-abort"]
        assert "approval" in ops.inner_text("#summary")  # what it waits for
        assert ops.evaluate("document.documentElement.scrollWidth") <= phone["width"]

        reader = chromium.new_page()
        reader.on("pageerror", lambda e: errors.append(f"reader page: {e}"))
        _sign_in(reader, server.base, reader_token)
        reader.goto(server.base + "/#/strategy/1")
        reader.wait_for_selector("#strategy-state .badge.s-waiting-approval")
        assert reader.query_selector_all("#actions button") == []

        # by keyboard: Tab to the button, Enter; the dialog's focus starts on Cancel
        ops.focus("#main")
        _tab_to(ops, "act-approve")
        ops.keyboard.press("Enter")
        ops.wait_for_selector("#confirm[open]")
        assert "Approve strategy 1" in ops.inner_text("#confirm-text")
        assert ops.evaluate("document.activeElement.id") == "confirm-no"
        ops.keyboard.press("Enter")  # no: nothing changes
        ops.wait_for_selector("#confirm", state="hidden")

        with server.client(reader_token) as http:
            assert http.get("/v1/strategies/1").json()["state"] == "waiting-approval"
        # (the focus is back on the button the dialog came from)
        assert ops.evaluate("document.activeElement.id") == "act-approve"
        ops.keyboard.press("Enter")
        ops.wait_for_selector("#confirm[open]")
        box = ops.query_selector("#confirm").bounding_box()
        assert box is not None and box["x"] >= 0 and box["x"] + box["width"] <= phone["width"]
        ops.keyboard.press("Tab")
        assert ops.evaluate("document.activeElement.id") == "confirm-yes"
        ops.keyboard.press("Enter")
        ops.wait_for_function(
            "() => document.querySelector('#action-note').textContent.includes('api:night-shift')"
        )
        assert ops.inner_text("#action-note") == (
            "approve: stage 2 of 2 (b) approved by api:night-shift"
        )

        # stage 2 runs to the end; the page, strategy show and the events name the approver
        ops.wait_for_selector("#strategy-state .badge.s-complete", timeout=30_000)
        reader.wait_for_selector("#strategy-state .badge.s-complete", timeout=10_000)
        shown_now = _shown(db)
        assert shown_now["state"] == "complete"
        assert shown_now["step_states"] == {"complete": sum(APPROVAL_FLEET.values())}
        assert [a["details"] for a in shown_now["approvals"]] == [
            "stage 2 of 2 (b) approved by api:night-shift"
        ]
        said = [(e["kind"], e["details"]) for e in _shown(db, "events", "--strategy", "1")]
        assert ("stage-approved", "stage 2 of 2 (b) approved by api:night-shift") in said
        ops.wait_for_function(
            "() => document.querySelector('#summary').textContent.includes('api:night-shift')"
        )
        assert "approved by api:night-shift" in reader.inner_text("#summary")
        assert ops.query_selector_all("#actions button:not([hidden])") == []
        assert ops.evaluate("document.documentElement.scrollWidth") <= phone["width"]
    assert posts == [server.base + "/v1/strategies/1/approve"]
    assert errors == []


def _small_fleet(tmp_path: Path, targets: int, parallel: int, latency_ms: int) -> tuple[Path, str]:
    """Strategy 1 over ``targets`` sim targets, applied (``serve`` drives it), and an
    operator's token."""
    db = tmp_path / "fleet.db"
    store = open_store(str(db))
    try:
        admin.add_targets(
            store,
            [Target(f"s-{i:03d}", settings={"latency_ms": latency_ms}) for i in range(targets)],
        )
        patch = get_workflow("patch")
        assert patch is not None
        opts = StrategyOptions(max_parallel=parallel)
        assert admin.create_strategy(store, patch, opts, all_targets=True) == 1
        admin.apply_strategy(store, 1)
        operator = create_token(store, "night-shift", Role.OPERATOR, None)
    finally:
        store.dispose()
    return db, operator


def _origin(url: str) -> str:
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc}"


def test_abort_asks_first_and_no_request_leaves_the_origin(tmp_path: Path, chromium: Any) -> None:
    """Abort's confirmation said no to (Cancel, then Escape) sends nothing; said yes to,
    it aborts, as ``strategy show`` agrees. Every request the pages make over the run
    (sign-in, each page, the streams, the abort) goes to the server's own origin."""
    db, operator_token = _small_fleet(tmp_path, targets=40, parallel=4, latency_ms=300)
    errors: list[str] = []
    requests: list[tuple[str, str]] = []
    chromium.on("request", lambda r: requests.append((r.method, r.url)))
    with serving(db) as server:
        ops = chromium.new_page()
        ops.on("pageerror", lambda e: errors.append(str(e)))
        _sign_in(ops, server.base, operator_token)
        for page in ("#/conductors", "#/target/s-000", "#/step/1", "#/strategy/1"):
            ops.goto(server.base + "/" + page)
            ops.wait_for_selector("#live:not(:empty)")
        ops.wait_for_selector("#strategy-state .badge.s-applying", timeout=10_000)

        ops.click("#act-abort")
        ops.wait_for_selector("#confirm[open]")
        assert "Abort strategy 1" in ops.inner_text("#confirm-text")
        ops.click("#confirm-no")
        ops.wait_for_selector("#confirm", state="hidden")
        ops.click("#act-abort")
        ops.wait_for_selector("#confirm[open]")
        ops.keyboard.press("Escape")
        ops.wait_for_selector("#confirm", state="hidden")
        # (a pass of the live stream later: still applying, nothing was sent)
        ops.wait_for_timeout(700)
        assert [u for m, u in requests if m == "POST"] == []
        with server.client(operator_token) as http:
            assert http.get("/v1/strategies/1").json()["state"] == "applying"
        assert ops.is_visible("#act-abort")

        _act(ops, "abort")
        ops.wait_for_selector(
            "#strategy-state .badge.s-aborted, #strategy-state .badge.s-aborting, "
            "#strategy-state .badge.s-abort-requested",
            timeout=10_000,
        )
        ops.wait_for_selector("#strategy-state .badge.s-aborted", timeout=30_000)
        shown = _shown(db)
        assert shown["state"] == "aborted"
        assert shown["step_states"].get("aborted", 0) > 0
        ops.wait_for_function(
            "([n]) => document.querySelector('#counts [data-state=aborted] .n')?.textContent"
            " === String(n)",
            arg=[shown["step_states"]["aborted"]],
        )
        assert _counts(ops) == shown["step_states"]
        assert ops.query_selector_all("#actions button:not([hidden])") == []
    assert [u for m, u in requests if m == "POST"] == [server.base + "/v1/strategies/1/abort"]
    assert requests, "no request recorded"
    elsewhere = {u for _, u in requests if not u.startswith("data:")} - {
        u for _, u in requests if _origin(u) == server.base
    }
    assert elsewhere == set()
    assert any(u.endswith("/v1/strategies/1/live") for _, u in requests)
    assert any(u.endswith("/ui/app.js") for _, u in requests)
    assert errors == []


def test_the_page_says_it_lost_the_stream_and_follows_a_new_server(
    tmp_path: Path, chromium: Any
) -> None:
    """The server stops: the page says the live stream is lost and keeps trying; a server
    started again on the same port and database is found, and the page is live and
    moving again (its engine drives the rollout on)."""
    db, operator_token = _small_fleet(tmp_path, targets=60, parallel=6, latency_ms=300)
    errors: list[str] = []
    ops = chromium.new_page()
    ops.on("pageerror", lambda e: errors.append(str(e)))
    with serving(db) as server:
        base = server.base
        _sign_in(ops, base, operator_token)
        ops.goto(base + "/#/strategy/1")
        ops.wait_for_selector("#strategy-state .badge.s-applying", timeout=10_000)
        ops.wait_for_selector("#live:not(.lost)")
        assert server.stop() == 0
        ops.wait_for_selector("#live.lost", timeout=10_000)
        assert re.search(r"Live updates lost \(.+\): reconnecting", ops.inner_text("#live"))
        counts_then = _counts(ops)
        updates_then = ops.evaluate("window.fleetwaveTimes.updates.length")
        ops.wait_for_timeout(1000)  # (lost: nothing moves on the page)
        assert _counts(ops) == counts_then
        assert ops.evaluate("window.fleetwaveTimes.updates.length") == updates_then
    with serving(db, listen=base.removeprefix("http://")) as again:
        assert again.base == base
        # (tried every 5 s at most: found within 5 s of the server's start)
        ops.wait_for_selector("#live:not(.lost)", timeout=10_000)
        assert ops.inner_text("#live").startswith("Live")
        # updating: live events arrive, and the rollout moves on the page
        ops.wait_for_function(
            "([n]) => window.fleetwaveTimes.updates.length >= n + 2", arg=[updates_then]
        )
        ops.wait_for_function(
            "([then]) => JSON.stringify(Object.fromEntries([...document.querySelectorAll("
            "'#counts [data-state]')].map(c => [c.dataset.state, +c.querySelector('.n')"
            ".textContent]))) !== JSON.stringify(then)",
            arg=[counts_then],
            timeout=10_000,
        )
        assert not ops.is_visible("#live.lost")
    assert errors == []
