"""Agents call back over HTTP (G6): each waiting state is issued its own agent token
(only its hash stored), handed to the action; ``POST /v1/steps/{step}/callbacks`` with
it is stored and answered at once, and the conductor beside the API applies it. Wrong,
missing, expired and other steps' tokens are refused and recorded with the caller's
address; a key sent again stores nothing; duplicates and late ones are recorded and
ignored with the reason. Through a real uvicorn server on 127.0.0.1."""

from __future__ import annotations

import asyncio
import hashlib
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import httpx
import pytest
from sqlalchemy import select, update

from conftest import add_sim_targets, rollout
from fleetwave import ActionContext, Advance, Outcome, StateAction
from fleetwave.api.serve import bind, serve_api
from fleetwave.api.service import Service
from fleetwave.domain import registry
from fleetwave.domain.models import StrategyOptions
from fleetwave.domain.registry import register_workflow
from fleetwave.domain.workflow import StateDef, WorkflowDef
from fleetwave.engine.conductor import Conductor
from fleetwave.store import admin, queries
from fleetwave.store.callbacks import callback_outcomes
from fleetwave.store.db import Store, open_store
from fleetwave.store.schema import agent_tokens, callbacks, events, steps
from fleetwave.testing.invariants import check


class HandsOutItsToken(StateAction):
    """What a driver does with a waiting state's token: gives it to the target's agent
    (here: keeps it where the test's agents find it)."""

    def __init__(self) -> None:
        self.tokens: dict[int, str | None] = {}
        self.seen = asyncio.Event()

    async def run(self, ctx: ActionContext) -> Outcome:
        self.tokens[ctx.step_id] = ctx.agent_token
        self.seen.set()
        return Advance()


class NoteToken(StateAction):
    def __init__(self) -> None:
        self.tokens: list[str | None] = []

    async def run(self, ctx: ActionContext) -> Outcome:
        self.tokens.append(ctx.agent_token)
        return Advance()


WAIT = HandsOutItsToken()
PLAIN = NoteToken()
WORKFLOW = WorkflowDef(
    "agent-callbacks-test",
    (
        StateDef("boot", WAIT, timeout_s=600, mode="wait-for-callback"),
        StateDef("finish", PLAIN, timeout_s=60),
    ),
)


@pytest.fixture(autouse=True)
def _registered() -> Iterator[None]:
    """The workflow, known while a test runs (other tests list the known ones)."""
    register_workflow(WORKFLOW, replace=True)
    WAIT.tokens.clear()
    PLAIN.tokens.clear()
    try:
        yield
    finally:
        registry._workflows.pop(WORKFLOW.name, None)


Agents = Callable[[httpx.AsyncClient, int], Awaitable[None]]


def _drive_with_api(store: Store, db: str, sid: int, agents: Agents) -> str:
    """Drive strategy ``sid`` with a conductor and the API on one loop (as ``serve
    --listen`` does); ``agents`` call back meanwhile. The strategy's end state."""

    async def main() -> str:
        conductor = Conductor(store)
        service = Service(open_store(db), conductor=conductor)
        sock, base = bind("127.0.0.1:0")
        api_stop = asyncio.Event()
        api = asyncio.create_task(serve_api(service, sock, api_stop))
        driving = asyncio.create_task(conductor.run(strategy_ids=[sid]))
        try:
            async with httpx.AsyncClient(base_url=base, timeout=30) as http:
                while True:  # the server is up once it answers
                    try:
                        if (await http.get("/healthz")).status_code == 200:
                            break
                    except httpx.TransportError:
                        await asyncio.sleep(0.02)
                await agents(http, sid)
            return (await asyncio.wait_for(driving, 60))[sid]
        finally:
            api_stop.set()
            await api
            sock.close()

    return asyncio.run(main())


def _post(
    http: httpx.AsyncClient,
    step: int,
    token: str | None,
    key: str,
    kind: str = "done",
    state: str = "boot",
) -> Awaitable[httpx.Response]:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    body = {"state": state, "idempotency_key": key, "kind": kind, "details": f"agent {key}"}
    return http.post(f"/v1/steps/{step}/callbacks", json=body, headers=headers)


async def _tokens_of(steps: int) -> dict[int, str]:
    while len(WAIT.tokens) < steps:
        WAIT.seen.clear()
        await asyncio.wait_for(WAIT.seen.wait(), 30)
    return {step: str(token) for step, token in WAIT.tokens.items()}


def test_agents_call_back_with_their_tokens_and_the_wrong_ones_are_refused(
    store: Store, db_url: str
) -> None:
    add_sim_targets(store, 40)
    sid = admin.create_strategy(store, WORKFLOW, StrategyOptions(max_parallel=40), all_targets=True)
    admin.apply_strategy(store, sid)
    answers: Counter[int] = Counter()

    async def agents(http: httpx.AsyncClient, _: int) -> None:
        tokens = await _tokens_of(40)
        steps = sorted(tokens)
        first, second = steps[0], steps[1]
        # refused, nothing stored: no token, a forged one, another step's
        for refused in await asyncio.gather(
            _post(http, first, None, "k-none"),
            _post(http, first, "fwg_forged", "k-forged"),
            _post(http, first, tokens[second], "k-other"),
            _post(http, first, tokens[first], "k-state", state="finish"),
        ):
            answers[refused.status_code] += 1
            assert refused.json()["error"]["field"] == "Authorization"
        # a heartbeat, then each agent's report, 40 at once; one sent twice with its key
        assert (await _post(http, first, tokens[first], "hb-1", "heartbeat")).status_code == 202
        sent = await asyncio.gather(*(_post(http, s, tokens[s], f"done-{s}") for s in steps))
        for answer in sent:
            answers[answer.status_code] += 1
            assert answer.json()["state"] == "boot" and answer.json()["outcome"] is None
        again = await _post(http, first, tokens[first], f"done-{first}")
        # (the one stored first, as it is now: perhaps applied already)
        assert again.status_code == 200 and again.json()["id"] == sent[0].json()["id"]
        # another report for the same state, with another key: stored, then ignored
        assert (await _post(http, second, tokens[second], "done-twice")).status_code == 202

    assert _drive_with_api(store, db_url, sid, agents) == "complete"
    assert answers == {401: 2, 403: 2, 202: 40}
    # only a waiting state's action gets a token
    assert PLAIN.tokens == [None] * 40

    outcomes = callback_outcomes(store, sid)
    assert Counter((o["kind"], o["outcome"]) for o in outcomes) == {
        ("done", "applied"): 40,
        ("heartbeat", "applied"): 1,
        ("done", "ignored"): 1,
    }
    ignored = [o for o in outcomes if o["outcome"] == "ignored"]
    # (a duplicate while the step waits on; late once it has moved on)
    assert ignored[0]["reason"].startswith(("duplicate", "late: step already"))
    with store.read() as conn:
        keys = conn.execute(select(callbacks.c.idempotency_key)).scalars().all()
        assert len(keys) == len(set(keys)) == 42  # the key sent twice: stored once
        refusals = conn.execute(
            select(events.c.strategy_id, events.c.details).where(
                events.c.kind == "callback-refused"
            )
        ).all()
        stored = set(conn.execute(select(agent_tokens.c.hash)).scalars())
    assert len(refusals) == 4 and {r.strategy_id for r in refusals} == {sid}
    assert all("from 127.0.0.1 refused" in r.details for r in refusals)
    # only hashes are kept
    assert stored == {hashlib.sha256(str(t).encode()).hexdigest() for t in WAIT.tokens.values()}
    assert check(store, sid).ok


def test_a_late_report_is_recorded_as_late_and_an_expired_token_is_refused(
    store: Store, db_url: str, tmp_path: Path
) -> None:
    add_sim_targets(store, 2)
    sid = admin.create_strategy(store, WORKFLOW, StrategyOptions(), all_targets=True)
    admin.apply_strategy(store, sid)

    async def agents(http: httpx.AsyncClient, _: int) -> None:
        tokens = await _tokens_of(2)
        for step, token in tokens.items():
            assert (await _post(http, step, token, f"done-{step}")).status_code == 202

    assert _drive_with_api(store, db_url, sid, agents) == "complete"
    (late_step, late_token), (old_step, old_token) = sorted(WAIT.tokens.items())
    with store.write() as conn:
        conn.execute(
            update(agent_tokens).where(agent_tokens.c.step_id == old_step).values(expires_at=1.0)
        )

    async def after_the_end(http: httpx.AsyncClient, _: int) -> None:
        late = await _post(http, late_step, late_token, "late-1")
        assert late.status_code == 202
        assert late.json()["outcome"] == "ignored"
        assert late.json()["reason"] == "late: step already complete"
        expired = await _post(http, old_step, old_token, "late-2")
        assert expired.status_code == 401
        assert "expired" in expired.json()["error"]["message"]

    assert _drive_with_api(store, db_url, sid, after_the_end) == "complete"
    assert check(store, sid).ok


def test_an_agents_heartbeats_over_http_keep_its_wait_alive(store: Store, db_url: str) -> None:
    """A wait of 2s whose agent sends a heartbeat every 0.4s for 4s, then its report:
    the step completes (without them it fails at 2s), each heartbeat moving the
    deadline on the step's row and in a ``deadline-extended`` event."""
    wf = register_workflow(
        WorkflowDef(
            "agent-heartbeats-http",
            (StateDef("boot", WAIT, timeout_s=2, mode="wait-for-callback"),),
        ),
        replace=True,
    )
    try:
        add_sim_targets(store, 1)
        sid = admin.create_strategy(store, wf, StrategyOptions(), all_targets=True)
        admin.apply_strategy(store, sid)
        deadlines: list[float] = []

        async def agent(http: httpx.AsyncClient, _: int) -> None:
            ((step, token),) = (await _tokens_of(1)).items()
            loop = asyncio.get_running_loop()
            began, beat = loop.time(), 0
            while loop.time() - began < 4:
                beat += 1
                sent = await _post(http, step, token, f"hb-{beat}", "heartbeat")
                assert sent.status_code == 202, sent.text
                await asyncio.sleep(0.4)
                # (off the loop, as the API's store calls are: the loop runs the engine)
                deadlines.append(await asyncio.to_thread(_deadline_of, store, step))
            assert (await _post(http, step, token, "done")).status_code == 202

        assert _drive_with_api(store, db_url, sid, agent) == "complete"
    finally:
        registry._workflows.pop(wf.name, None)
    outcomes = callback_outcomes(store, sid)
    beats = [o for o in outcomes if o["kind"] == "heartbeat"]
    assert len(beats) >= 8 and all(o["outcome"] == "applied" for o in beats)
    moved = queries.strategy_events(store, sid, "deadline-extended")
    assert len(moved) >= 8
    # the row's deadline moved on with them, each time to 2s after a heartbeat
    assert deadlines == sorted(deadlines) and len(set(deadlines)) >= 8
    assert deadlines[-1] - deadlines[0] > 2.5
    assert check(store, sid).ok


def _deadline_of(store: Store, step: int) -> float:
    with store.read() as conn:
        return float(
            conn.execute(select(steps.c.deadline_at).where(steps.c.id == step)).scalars().one()
        )


@pytest.mark.slow
def test_two_hundred_agents_at_once_while_the_engine_drives_two_thousand_steps(
    store: Store, db_url: str
) -> None:
    """200 agents report concurrently, each for ten steps, while the engine drives 2,000
    steps at max parallel 500; each also sends a duplicate, a forged token and another
    step's token now and then. Every step completes, every callback's outcome is on
    record, and ``check`` passes."""
    add_sim_targets(store, 2000)
    sid = admin.create_strategy(
        store, WORKFLOW, StrategyOptions(max_parallel=500), all_targets=True
    )
    admin.apply_strategy(store, sid)
    answers: Counter[int] = Counter()

    async def agent(http: httpx.AsyncClient, mine: list[int]) -> None:
        for step in mine:
            while step not in WAIT.tokens:
                await asyncio.sleep(0.01)
            token = str(WAIT.tokens[step])
            sent = [
                _post(http, step, token, f"done-{step}"),
                _post(http, step, token, f"done-{step}"),  # the same key again
            ]
            if step % 10 == 0:
                other = str(WAIT.tokens.get(step + 1, "fwg_none"))
                sent += [
                    _post(http, step, "fwg_forged", f"f-{step}"),
                    _post(http, step, other, f"o-{step}"),
                    _post(http, step, token, f"again-{step}"),  # a duplicate report
                ]
            for answer in await asyncio.gather(*sent):
                answers[answer.status_code] += 1

    async def agents(http: httpx.AsyncClient, _: int) -> None:
        while not WAIT.tokens:
            await asyncio.sleep(0.01)
        steps = sorted(range(min(WAIT.tokens), min(WAIT.tokens) + 2000))
        await asyncio.gather(*(agent(http, steps[i::200]) for i in range(200)))

    assert _drive_with_api(store, db_url, sid, agents) == "complete"
    assert answers[500] == 0
    # each step's report: stored once (202), then answered from the record (200) when
    # sent again with its key; forged and other steps' tokens refused
    assert answers[202] >= 2000 and answers[401] >= 200 and answers[403] >= 1
    outcomes = callback_outcomes(store, sid)
    assert all(o["outcome"] in ("applied", "ignored") for o in outcomes)
    assert Counter(o["outcome"] for o in outcomes)["applied"] == 2000
    with store.read() as conn:
        refused = conn.execute(select(events.c.id).where(events.c.kind == "callback-refused")).all()
    assert len(refused) == answers[401] + answers[403]
    assert check(store, sid).ok


def test_the_tokens_of_states_started_in_one_turn_are_stored_in_one_transaction(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A transaction (an fsync) per waiting state would slow a `clean` rollout: the
    tokens of the states that start in one turn of the loop are written together."""
    from fleetwave.store import tokens

    writes: list[int] = []
    store_them = tokens.issue_agent_tokens

    def counted(s: Store, rows: list[tuple[int, int, str, str, float, float]]) -> None:
        writes.append(len(rows))
        store_them(s, rows)

    monkeypatch.setattr(tokens, "issue_agent_tokens", counted)
    add_sim_targets(store, 300)
    sid, final, _ = rollout(store, "clean", max_parallel=300)
    assert final == "complete"
    with store.read() as conn:
        hashes = conn.execute(select(agent_tokens.c.hash)).scalars().all()
    assert len(hashes) == len(set(hashes)) == sum(writes) == 600  # two waiting states each
    assert len(writes) < 60
    assert check(store, sid).ok


def test_a_batch_whose_leader_is_cancelled_before_writing_is_written_by_another() -> None:
    from fleetwave.engine.agent_tokens import AgentTokenIssuer

    written: list[list[int]] = []

    async def io(_fn: object, _store: object, rows: list[tuple[int, ...]]) -> None:
        written.append([r[1] for r in rows])

    async def main() -> list[str]:
        issuer = AgentTokenIssuer(io, None, lambda: 0.0)
        tasks = [asyncio.create_task(issuer.issue(1, step, "boot", 60)) for step in (1, 2, 3)]
        await asyncio.sleep(0)  # each has added its row; the first leads, and waits a turn
        tasks[0].cancel()
        done = await asyncio.gather(*tasks, return_exceptions=True)
        return [d for d in done if isinstance(d, str)]

    issued = asyncio.run(main())
    assert len(issued) == 2
    assert written == [[1, 2, 3]]  # (the cancelled one's row went with them: harmless)


def test_callbacks_stored_together_are_answered_each_as_alone(store: Store) -> None:
    """The intake stores what came at once in one transaction: each is still answered
    as it would be alone (a key twice: stored once; an unknown step: refused; an ended
    step: late), and nothing of the others is lost to one that is refused."""
    from fleetwave.domain.errors import NotFound
    from fleetwave.store.callbacks import Replay, accept_callbacks, report

    add_sim_targets(store, 2)
    sid = admin.create_strategy(store, WORKFLOW, StrategyOptions(), all_targets=True)
    with store.write() as conn:
        conn.execute(update(steps).where(steps.c.id == 2).values(state="complete"))
    answers = accept_callbacks(
        store,
        [
            report(1, "boot", "done", "first", 1.0, "k1"),
            report(99, "boot", "done", "", 1.0, "k9"),
            report(1, "boot", "done", "again", 1.0, "k1"),
            report(2, "boot", "done", "", 1.0, "k2"),
        ],
    )
    first, unknown, again, late = answers
    assert not isinstance(first, Exception) and first.outcome is None
    assert isinstance(unknown, NotFound)
    assert isinstance(again, Replay) and again.id == first.id and again.details == "first"
    assert not isinstance(late, Exception) and late.reason == "late: step already complete"
    outcomes = callback_outcomes(store, sid)
    assert [(o["step"], o["outcome"]) for o in outcomes] == [(1, None), (2, "ignored")]
    # sent again later, with its key: the one stored
    (later,) = accept_callbacks(store, [report(1, "boot", "done", "", 2.0, "k1")])
    assert isinstance(later, Replay) and later.id == first.id


def test_each_callback_of_a_batch_is_answered_with_its_own_row(store: Store) -> None:
    """A batch's rows go in one statement that returns their ids in the database's own
    order: each answer still names the row stored for it (keyed and keyless ones mixed,
    several steps, the same key on two steps)."""
    import random

    from fleetwave.store.callbacks import accept_callbacks, report
    from fleetwave.store.schema import callbacks

    add_sim_targets(store, 6)
    admin.create_strategy(store, WORKFLOW, StrategyOptions(), all_targets=True)
    sent = [
        report(1 + i % 6, "boot", "heartbeat", f"d{i}", 1.0, None if i % 4 == 0 else f"k{i % 9}")
        for i in range(60)
    ]
    # (a key at most once a step in the batch: the same key again is a replay, above)
    seen: set[tuple[int, str | None]] = set()
    batch = []
    for r in sent:
        if r.idempotency_key is None or (r.step_id, r.idempotency_key) not in seen:
            seen.add((r.step_id, r.idempotency_key))
            batch.append(r)
    random.Random(7).shuffle(batch)
    answers = accept_callbacks(store, batch)
    with store.read() as conn:
        rows = {int(r.id): r for r in conn.execute(callbacks.select())}
    assert len(rows) == len(batch)
    for r, answer in zip(batch, answers, strict=True):
        assert not isinstance(answer, Exception)
        row = rows[answer.id]
        assert (row.step_id, row.details, row.idempotency_key) == (
            r.step_id,
            r.details,
            r.idempotency_key,
        )


def test_a_batch_checks_its_tokens_where_it_stores_refusing_some_and_storing_the_rest(
    store: Store,
) -> None:
    """The intake checks a batch's agent tokens in the transaction that stores it: a
    refused one (none, forged, expired, another step's) stores nothing and is recorded
    with the caller's address; the ones let in are stored as alone."""
    from fleetwave.api.intake import Arrival, Refused, store_arrivals
    from fleetwave.store import tokens
    from fleetwave.store.callbacks import CallbackRecord, report

    add_sim_targets(store, 2)
    sid = admin.create_strategy(store, WORKFLOW, StrategyOptions(), all_targets=True)
    good, old = (tokens.new_secret(tokens.AGENT_PREFIX) for _ in range(2))
    tokens.issue_agent_tokens(
        store,
        [
            (sid, 1, "boot", tokens.token_hash(good), 0.0, 100.0),
            (sid, 2, "boot", tokens.token_hash(old), 0.0, 5.0),
        ],
    )

    def arrival(step: int, token: str | None, key: str) -> Arrival:
        return Arrival(report(step, "boot", "done", "", 10.0, key), token, "10.0.0.9")

    answers = store_arrivals(
        store,
        [
            arrival(1, good, "a"),
            arrival(1, None, "b"),
            arrival(1, "fwg_forged", "c"),
            arrival(2, old, "d"),
            arrival(2, good, "e"),
            arrival(1, good, "a"),
        ],
    )
    stored, missing, forged, expired, elsewhere, again = answers
    assert isinstance(stored, CallbackRecord) and isinstance(again, CallbackRecord)
    assert again.id == stored.id
    assert [(a.status, a.problem.split(" (")[0]) for a in (missing, forged, expired)] == [
        (401, "no agent token"),
        (401, "the agent token is not valid"),
        (401, "the agent token expired"),
    ] and all(isinstance(a, Refused) for a in (missing, forged, expired))
    assert isinstance(elsewhere, Refused) and elsewhere.status == 403
    with store.read() as conn:
        rows = conn.execute(select(callbacks.c.step_id, callbacks.c.idempotency_key)).all()
        refusals = conn.execute(
            select(events.c.step_id, events.c.details).where(events.c.kind == "callback-refused")
        ).all()
    assert [tuple(r) for r in rows] == [(1, "a")]
    assert sorted(r.step_id for r in refusals) == [1, 1, 2, 2]
    assert all("from 10.0.0.9 refused" in r.details for r in refusals)


def test_a_callback_answered_ahead_of_fastapi_is_counted_and_bad_ones_still_refused(
    tmp_path: Path,
) -> None:
    """A well-formed callback is answered ahead of FastAPI's routing (its busiest
    route): counted under its route like any request; one that is not (bad JSON, an
    unknown field, a query string) goes on to the route and gets its usual 4xx."""
    from prometheus_client.parser import text_string_to_metric_families

    from api_harness import in_process
    from fleetwave.store import tokens

    db = tmp_path / "fleet.db"
    store = open_store(str(db))
    add_sim_targets(store, 1)
    sid = admin.create_strategy(store, WORKFLOW, StrategyOptions(), all_targets=True)
    token = tokens.new_secret(tokens.AGENT_PREFIX)
    tokens.issue_agent_tokens(store, [(sid, 1, "boot", tokens.token_hash(token), 0.0, None)])
    store.dispose()
    agent = {"Authorization": f"Bearer {token}"}
    body = {"state": "boot", "idempotency_key": "k", "kind": "heartbeat"}
    with in_process(db) as client:
        assert client.post("/v1/steps/1/callbacks", json=body, headers=agent).status_code == 202
        assert client.post("/v1/steps/1/callbacks", json=body, headers=agent).status_code == 200
        bad_json = client.post(
            "/v1/steps/1/callbacks",
            content=b"{",
            headers={**agent, "Content-Type": "application/json"},
        )
        assert bad_json.status_code == 400 and bad_json.json()["error"]["field"] == "body"
        unknown = client.post("/v1/steps/1/callbacks", json={**body, "extra": 1}, headers=agent)
        assert unknown.status_code == 422 and unknown.json()["error"]["field"] == "extra"
        query = client.post("/v1/steps/1/callbacks?x=1", json=body, headers=agent)
        assert query.status_code == 422 and query.json()["error"]["field"] == "x"
        nobody = client.post("/v1/steps/1/callbacks", json={**body, "idempotency_key": "n"})
        assert nobody.status_code == 401
        assert nobody.json()["error"]["field"] == "Authorization"
        metrics = client.get("/metrics").text
    counted = {
        s.labels["status"]: s.value
        for family in text_string_to_metric_families(metrics)
        for s in family.samples
        if s.name == "fleetwave_api_requests_total"
        and s.labels["route"] == "/v1/steps/{step_id}/callbacks"
    }
    assert counted == {"202": 1, "200": 1, "400": 1, "422": 2, "401": 1}


def test_callbacks_that_come_together_are_written_in_few_batches_and_a_request_gone_still_counts(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The intake writes what came while a batch was being written in the next batch
    (one write at a time), answers each request with its own callback, and writes the
    callback of a request that went away (its client hung up) all the same."""
    from fleetwave.api import intake
    from fleetwave.store import tokens
    from fleetwave.store.callbacks import report

    add_sim_targets(store, 30)
    sid = admin.create_strategy(store, WORKFLOW, StrategyOptions(), all_targets=True)
    agents = [tokens.new_secret(tokens.AGENT_PREFIX) for _ in range(30)]
    tokens.issue_agent_tokens(
        store,
        [(sid, i + 1, "boot", tokens.token_hash(t), 0.0, None) for i, t in enumerate(agents)],
    )
    batches: list[int] = []
    real = intake.store_arrivals

    def counted(s: Store, arrivals: list[intake.Arrival]) -> list[intake.Answer]:
        batches.append(len(arrivals))
        return real(s, arrivals)

    monkeypatch.setattr(intake, "store_arrivals", counted)

    async def main() -> list[object]:
        service = Service(store, auth=False)
        service.intake = intake.CallbackIntake(service)
        try:
            sent = [
                asyncio.create_task(
                    service.intake.accept(
                        intake.Arrival(
                            report(i + 1, "boot", "heartbeat", f"n{i}", 1.0, f"k{i}"),
                            agents[i],
                            "127.0.0.1",
                        )
                    )
                )
                for i in range(30)
            ]
            await asyncio.sleep(0)  # (all have added theirs; the first batch is on its way)
            sent[7].cancel()  # its client hung up
            return await asyncio.gather(*sent, return_exceptions=True)
        finally:
            service.close()

    answers = asyncio.run(main())
    assert isinstance(answers[7], asyncio.CancelledError)
    for i, answer in enumerate(answers):
        if i != 7:
            assert not isinstance(answer, BaseException | intake.Refused), answer
            assert (answer.step_id, answer.details) == (i + 1, f"n{i}")
    assert sum(batches) == 30 and len(batches) <= 2, batches
    with store.read() as conn:
        stored = {r.details for r in conn.execute(select(callbacks.c.details))}
    assert stored == {f"n{i}" for i in range(30)}  # the one gone too
