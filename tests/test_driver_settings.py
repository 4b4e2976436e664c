"""Driver settings checked against each driver's model (``target add``, ``import``,
``set``), naming the target and the field; ``driver list`` and ``driver show``."""

from __future__ import annotations

from pathlib import Path

from cli_harness import Cli, assert_rejected, import_refused, one_line, targets
from fleetwave.drivers.settings import describe_driver, is_secret, mask_settings

URL = "http://127.0.0.1:9/sites/site-0001"


def test_a_bad_url_is_refused_naming_target_and_field_and_nothing_is_written(cli: Cli) -> None:
    line = one_line(cli("target", "add", "n1", "--driver", "http", "--set", "url=not-a-url"))
    assert line == "error: target n1: url: not a URL"
    assert targets(cli) == {}


def test_a_missing_or_unknown_setting_is_refused_naming_it(cli: Cli) -> None:
    assert one_line(cli("target", "add", "n1", "--driver", "http")) == (
        "error: target n1: url: required"
    )
    line = one_line(
        cli("target", "add", "n1", "--driver", "http", "--set", f"url={URL}", "--set", "urll=x")
    )
    assert line.startswith("error: target n1: urll: unknown setting of the http driver (known:")
    bad = one_line(
        cli(
            "target", "add", "n1", "--driver", "http", "--set", f"url={URL}", "--set", "timeout_s=0"
        )
    )
    assert bad == "error: target n1: timeout_s: must be greater than 0"
    assert targets(cli) == {}


def test_a_good_target_is_stored_as_given(cli: Cli) -> None:
    res = cli(
        "target", "add", "n1", "--driver", "http", "--set", f"url={URL}", "--set", "release=p1"
    )
    assert res.code == 0, res.text
    assert targets(cli)["n1"]["settings"] == {"url": URL, "release": "p1"}


def test_import_names_the_file_line_and_field(cli: Cli, tmp_path: Path) -> None:
    line = import_refused(
        cli,
        tmp_path / "t.csv",
        f"name,driver,url\nn1,http,{URL}\nn2,http,ftp//nowhere\n",
    )
    assert line == f"error: {tmp_path / 't.csv'} line 3: url: not a URL"


def test_set_checks_against_the_new_driver_and_writes_nothing_when_refused(cli: Cli) -> None:
    assert cli("target", "add", "n1", "--set", "latency_ms=5").code == 0
    assert_rejected(
        cli("target", "set", "n1", "--driver", "http"), "target n1: latency_ms: unknown setting"
    )
    assert_rejected(
        cli("target", "set", "n1", "--driver", "http", "--unset", "latency_ms"),
        "target n1: url: required",
    )
    res = cli(
        "target", "set", "n1", "--driver", "http", "--unset", "latency_ms", "--set", f"url={URL}"
    )
    assert res.code == 0, res.text
    assert targets(cli)["n1"]["driver"] == "http"
    assert_rejected(cli("target", "set", "n1", "--set", "url=x"), "target n1: url: not a URL")
    assert targets(cli)["n1"]["settings"] == {"url": URL}


def test_the_sim_drivers_own_checks_still_speak(cli: Cli) -> None:
    assert_rejected(
        cli("target", "add", "n1", "--set", "latency_ms=x"),
        "target n1: sim setting latency_ms: 'x' is not a number",
    )


def test_driver_list_and_show_name_settings_types_defaults_and_secrets(cli: Cli) -> None:
    listed = {d["name"]: d for d in cli("driver", "list", "--format", "json", db=None).json()}
    assert {"sim", "http"} <= listed.keys()
    assert listed["http"]["status"] == "ok"
    assert listed["http"]["secret"] == "license, token"
    shown = cli("driver", "show", "http", "--format", "json", db=None).json()
    rows = {s["setting"]: s for s in shown["settings"]}
    assert rows["url"] == {
        "setting": "url",
        "type": "URL",
        "default": "(required)",
        "secret": False,
        "description": rows["url"]["description"],
    }
    assert rows["timeout_s"]["type"] == "number" and rows["timeout_s"]["default"] == 10.0
    assert rows["token"]["secret"] and rows["token"]["type"] == "secret (or none)"
    assert_rejected(cli("driver", "show", "nope", db=None), "NAME: no driver named 'nope'")


def test_the_mask_function_the_api_uses() -> None:
    assert is_secret("http", "token") and not is_secret("http", "url")
    assert not is_secret("nope", "token")
    assert mask_settings("http", {"url": URL, "token": "fernet:abc", "license": "env:LIC"}) == {
        "url": URL,
        "token": "***",
        "license": "env:LIC",
    }
    assert describe_driver("sim")["settings"][0]["setting"] == "latency_ms"
