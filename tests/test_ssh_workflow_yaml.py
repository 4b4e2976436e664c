"""Driver actions with parameters in YAML workflows (``action: ssh.run`` with
``command:``, ``expect_exit:``, ``check:``; ``ssh.upload`` with ``source:``, ``dest:``):
checked like the rest of the file, one error naming the state and the field; what
``workflow show`` says of them; two versions differing only in a command differ."""

from __future__ import annotations

from pathlib import Path

import pytest

from cli_harness import Cli, one_line
from fleetwave.domain.workflow import WorkflowError, describe_workflow
from fleetwave.domain.yaml_workflow import parse_workflow_yaml


def parse(state: str) -> str:
    """The error of a workflow of one state (given as its YAML mapping's lines)."""
    text = "name: w\nstates:\n  - name: s\n" + "".join(
        f"    {line}\n" for line in state.splitlines()
    )
    with pytest.raises(WorkflowError) as err:
        parse_workflow_yaml(text, source="w.yaml", strict=True)
    return str(err.value)


@pytest.mark.parametrize(
    ("state", "error"),
    [
        (
            "action: ssh.run\ncomand: ls",
            "w.yaml: states[0] (s): comand: not a field here (the fields are: name, action, "
            "timeout_s, retry, skip_when_done, recover, mode, poll_interval_s, on, cleanup, "
            "skip_if, max_visits, command, expect_exit, check)",
        ),
        ("action: ssh.run", "w.yaml: states[0] (s): command: missing (it is required)"),
        (
            "action: ssh.run\ncommand: [ls]",
            "w.yaml: states[0] (s): command: expected text, got a list",
        ),
        (
            "action: ssh.run\ncommand: '  '",
            "w.yaml: states[0] (s): command: empty: give the command to run",
        ),
        (
            "action: ssh.run\ncommand: ls\nexpect_exit: zero",
            "w.yaml: states[0] (s): expect_exit: expected a whole number 0-255 (or a list of "
            "them), got 'zero'",
        ),
        (
            "action: ssh.run\ncommand: ls\nexpect_exit: [0, 256]",
            "w.yaml: states[0] (s): expect_exit: an exit status is 0-255, got 256",
        ),
        (
            "action: ssh.run\ncommand: ls\nexpect_exit: true",
            "w.yaml: states[0] (s): expect_exit: expected a whole number 0-255 (or a list of "
            "them), got True",
        ),
        (
            "action: ssh.rn\ncommand: ls",
            "w.yaml: states[0] (s): action: the ssh driver has no action 'rn' (its actions: "
            "ssh.run, ssh.upload)",
        ),
        (
            "action: ssh.upload\nsource: app.conf\ndest: /etc/app.conf",
            "w.yaml: states[0] (s): source: 'app.conf' is not an absolute path (the file is "
            "read on the conductor's machine, wherever it runs)",
        ),
        ("action: ssh.upload\nsource: /a", "w.yaml: states[0] (s): dest: missing (it is required)"),
        (
            "action: ssh.upload\nsource: /a\ndest: b\nskip_when_done: true",
            "w.yaml: states[0] (s): skip_when_done: ssh.upload never reports done already",
        ),
        # a parameter on a state whose action takes none
        (
            "action: pre-check\ncommand: ls",
            "w.yaml: states[0] (s): command: not a field here (the fields are: name, action, "
            "timeout_s, retry, skip_when_done, recover, mode, poll_interval_s, on, cleanup, "
            "skip_if, max_visits)",
        ),
        (
            "action: ssh.run\ncommand: ls\ntimeout_s: -1",
            "w.yaml: states[0] (s): timeout_s: must be more than 0, got -1",
        ),
    ],
)
def test_a_bad_parameter_is_one_error_naming_the_state_and_field(state: str, error: str) -> None:
    assert parse(state) == error


def test_workflow_show_lists_the_parameters_and_what_a_takeover_does() -> None:
    wf = parse_workflow_yaml(
        """\
name: w
states:
  - {name: a, action: ssh.run, command: make install, check: make -q installed}
  - {name: b, action: ssh.run, command: reboot-soon, expect_exit: [0, 3]}
  - {name: c, action: ssh.upload, source: /srv/app.conf, dest: app.conf}
  - {name: d, action: ssh.run, command: ls, recover: none, check: 'true'}
""",
        strict=True,
    )
    states = describe_workflow(wf)["states"]
    assert [(s["action"], s["recover"]) for s in states] == [
        ("ssh.run: make install (expect exit 0; check: make -q installed)", "check"),
        ("ssh.run: reboot-soon (expect exit 0 or 3)", "none"),
        ("ssh.upload: /srv/app.conf -> app.conf", "hook"),
        ("ssh.run: ls (expect exit 0; check: true) (no recover)", "none"),
    ]
    assert states[1]["params"] == {"command": "reboot-soon", "expect_exit": [0, 3], "check": None}
    assert states[2]["params"] == {"source": "/srv/app.conf", "dest": "app.conf"}


def test_a_version_that_changes_only_a_command_is_another_workflow(
    cli: Cli, tmp_path: Path
) -> None:
    f = tmp_path / "w.yaml"
    f.write_text("name: w\nstates:\n  - {name: s, action: ssh.run, command: ls}\n")
    assert cli("workflow", "add", str(f)).code == 0
    assert cli("workflow", "add", str(f)).code == 0  # the same again: fine
    f.write_text("name: w\nstates:\n  - {name: s, action: ssh.run, command: rm -rf build}\n")
    line = one_line(cli("workflow", "add", str(f)))
    assert "version 1 is already stored with other states or settings" in line


def test_the_cli_refuses_a_bad_parameter_in_one_line(cli: Cli, tmp_path: Path) -> None:
    f = tmp_path / "w.yaml"
    f.write_text("name: w\nstates:\n  - {name: s, action: ssh.run, command: ls, expect_exit: -1}\n")
    line = one_line(cli("workflow", "validate", str(f)))
    assert line.endswith("states[0] (s): expect_exit: an exit status is 0-255, got -1"), line
