"""Reading a large rollout's record: what an operator narrows it to is found by its
own keys, not by walking the whole strategy (a rollout of 100,000 targets leaves
600,000 journal rows), and still shows exactly the rows asked for."""

from __future__ import annotations

from pathlib import Path

from cli_harness import PATCH_STATES, Cli
from test_cli_strategy import add, apply_wait, create, history
from test_operator_oncall import FLAKY_YAML


def _rerun(cli: Cli) -> tuple[int, int]:
    """Two strategies over the same targets, one after the other (the second a retry)."""
    add(cli, "a", "b", "c")
    first = create(cli, "--all")
    assert apply_wait(cli, first).code == 0
    second = create(cli, "--targets", "a,b")
    assert apply_wait(cli, second).code == 0
    return first, second


def test_history_of_a_target_is_its_step_in_that_strategy_only(cli: Cli) -> None:
    first, second = _rerun(cli)
    path = ["initial", *PATCH_STATES, "complete"]
    for sid in (first, second):
        rows = history(cli, sid, "--target", "a")
        assert {r["strategy"] for r in rows} == {sid}
        assert {r["target"] for r in rows} == {"a"}
        assert [r["from"] for r in rows] == path[:-1]
        assert [r["to"] for r in rows] == path[1:]
    both = history(cli, second, "--target", "a,b")
    assert len(both) == 2 * (len(path) - 1)
    assert [r["at"] for r in both] == sorted(r["at"] for r in both)  # in journal order
    assert {r["target"] for r in both} == {"a", "b"}
    last = history(cli, first, "--target", "c", "--last", "2")
    assert [(r["target"], r["to"]) for r in last] == [("c", "finishing"), ("c", "complete")]


def test_events_of_a_target_are_its_step_s_in_that_strategy_only(cli: Cli, tmp_path: Path) -> None:
    wf = tmp_path / "flaky.yaml"
    wf.write_text(FLAKY_YAML, encoding="utf-8")
    assert cli("workflow", "add", str(wf)).code == 0
    add(cli, "steady")
    add(cli, "shaky", flaky_rate="1.0")  # every attempt fails: two attempt-failed events
    sids = []
    for _ in range(2):
        res = cli("strategy", "create", "--workflow", "flaky-once", "--all", "--format", "json")
        sids.append(int(res.json()["id"]))
        assert apply_wait(cli, sids[-1]).code == 1
    for sid in sids:
        res = cli("events", "--strategy", str(sid), "--target", "shaky", "--format", "json")
        assert res.code == 0, res.text
        rows = res.json()
        assert [r["kind"] for r in rows] == ["attempt-failed", "attempt-failed"]
        assert {(r["strategy"], r["target"]) for r in rows} == {(sid, "shaky")}
        res = cli("events", "--strategy", str(sid), "--target", "steady,shaky", "--format", "json")
        assert len(res.json()) == 2


def test_step_show_lists_its_own_transitions(cli: Cli) -> None:
    _, second = _rerun(cli)
    res = cli("step", "list", "--strategy", str(second), "--target", "b", "--format", "json")
    step = res.json()[0]["step"]
    shown = cli("step", "show", str(step), "--format", "json").json()
    assert [h["to"] for h in shown["history"]] == [*PATCH_STATES, "complete"]
    assert {h["step"] for h in shown["history"]} == {step}
