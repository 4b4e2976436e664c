"""Pure parts: transition rules, retry maths, workflow validation, YAML parsing."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fleetwave.domain.builtin import builtin_workflows
from fleetwave.domain.rules import decide, is_allowed_move
from fleetwave.domain.workflow import (
    Advance,
    DriverOperation,
    Skip,
    StateDef,
    WorkflowDef,
    WorkflowError,
)
from fleetwave.domain.yaml_workflow import parse_workflow_yaml

STATES = ("a", "b", "c")


def test_advance_goes_to_next_then_complete() -> None:
    assert decide(STATES, "a", Advance()).to_state == "b"
    assert decide(STATES, "c", Advance()).to_state == "complete"


def test_skip_completes_with_reason() -> None:
    d = decide(STATES, "a", Skip("already patched"))
    assert d.to_state == "complete"
    assert "already patched" in d.details and "skipped at a" in d.details


def test_branch_forward_allowed_backward_fails() -> None:
    assert decide(STATES, "a", Advance(to="c")).to_state == "c"
    back = decide(STATES, "b", Advance(to="a"))
    assert back.to_state == "failed" and "not a later state" in back.details
    unknown = decide(STATES, "a", Advance(to="zzz"))
    assert unknown.to_state == "failed" and "zzz" in unknown.details
    # its own state is not a later one either (G1: it would be entered twice)
    same = decide(STATES, "b", Advance(to="b"))
    assert (same.to_state, same.details) == (
        "failed",
        "b: action chose 'b', which is not a later state",
    )


def test_a_timeout_for_a_state_the_workflow_does_not_have_is_refused() -> None:
    """A misspelt state in a strategy's timeouts would be ignored, the state running with
    its default timeout."""
    wf = WorkflowDef(
        "w", (StateDef("a", DriverOperation("a")), StateDef("b", DriverOperation("b")))
    )
    assert wf.with_timeouts({"b": 5}).states[1].timeout_s == 5
    with pytest.raises(WorkflowError, match=r"timeout given for unknown state\(s\) \['bb'\]"):
        wf.with_timeouts({"a": 5, "bb": 5})


@given(st.sampled_from(("initial", *STATES)), st.sampled_from((*STATES, "complete", "failed")))
def test_allowed_moves_only_go_forward(frm: str, to: str) -> None:
    order = ("initial", *STATES)
    allowed = is_allowed_move(STATES, frm, to)
    if to in ("complete", "failed"):
        assert allowed
    elif frm == "initial":
        assert allowed == (to == "a")
    else:
        assert allowed == (order.index(to) > order.index(frm))


def test_nothing_leaves_a_terminal_state() -> None:
    for term in ("complete", "failed", "aborted"):
        for to in (*STATES, "complete", "failed"):
            assert not is_allowed_move(STATES, term, to)


@given(st.floats(0, 100), st.floats(0, 1000), st.integers(1, 30))
def test_backoff_is_exponential_and_capped(base: float, cap: float, n: int) -> None:
    s = StateDef("x", DriverOperation("x"), backoff_s=base, backoff_max_s=cap)
    assert s.backoff_for(n) == pytest.approx(min(cap, base * 2 ** (n - 1)))
    assert s.backoff_for(n) <= cap


def test_builtin_workflows_match_design() -> None:
    wfs = {wf.name: wf.state_names for wf in builtin_workflows()}
    assert wfs["patch"] == (
        "pre-check",
        "updating-patches",
        "creating-remote-patch-strategy",
        "applying-remote-patch-strategy",
        "finishing",
    )
    assert set(wfs) == {"patch", "sw-deploy", "firmware", "kube-upgrade", "clean"}
    clean = next(wf for wf in builtin_workflows() if wf.name == "clean")
    assert clean.state("wait-for-agent").mode == "wait-for-callback"
    assert wfs["kube-upgrade"][0] == "pre-check"


@pytest.mark.parametrize(
    ("states", "needle"),
    [
        ((), "at least one state"),
        ((StateDef("complete", DriverOperation("x")),), "reserved"),
        ((StateDef("a", DriverOperation("a")), StateDef("a", DriverOperation("a"))), "duplicate"),
        ((StateDef("a", DriverOperation("a"), timeout_s=0),), "timeout_s"),
        ((StateDef("a", DriverOperation("a"), attempts_max=0),), "attempts"),
    ],
)
def test_invalid_workflows_are_rejected(states: tuple[StateDef, ...], needle: str) -> None:
    with pytest.raises(WorkflowError, match=needle):
        WorkflowDef("w", states)


GOOD = """
name: site-patch
version: 2
states:
  - name: pre-check
    timeout_s: 300
    skip_when_done: true
    retry: {attempts: 3, backoff_s: 5}
  - name: apply
    action: apply-patch
    timeout_s: 7200
    recover: none
"""


def test_yaml_workflow_parses() -> None:
    wf = parse_workflow_yaml(GOOD)
    assert wf.name == "site-patch" and wf.version == 2
    assert wf.state_names == ("pre-check", "apply")
    assert wf.state("pre-check").attempts_max == 3
    assert wf.state("apply").timeout_s == 7200
    assert "apply-patch" in wf.state("apply").action.describe()


@pytest.mark.parametrize(
    ("text", "needles"),
    [
        (GOOD.replace("timeout_s: 7200", "timeout_s: -1"), ["states[1] (apply)", "timeout_s"]),
        (GOOD.replace("recover: none", "recover: maybe"), ["states[1] (apply)", "recover"]),
        (GOOD.replace("attempts: 3", "attempts: 0"), ["states[0] (pre-check)", "attempts"]),
        (GOOD.replace("skip_when_done: true", "colour: red"), ["states[0]", "colour"]),
        (GOOD.replace("name: apply", "name: pre-check"), ["duplicate"]),
        (GOOD.replace("name: apply", "name: failed"), ["reserved"]),
        ("name: x\nstates: []\n", ["states"]),
        ("- just a list", ["mapping"]),
        ("name: [unclosed", ["YAML"]),
        (GOOD.replace("action: apply-patch", "action: python:nosuch"), ["states[1]", "action"]),
    ],
)
def test_yaml_errors_name_state_and_field(text: str, needles: list[str]) -> None:
    with pytest.raises(WorkflowError) as err:
        parse_workflow_yaml(text, source="wf.yaml")
    for needle in needles:
        assert needle in str(err.value)
