"""Secret driver settings: given as ``env:VAR``, ``file:/path`` or in clear (then
stored encrypted with ``FLEETWAVE_SECRET_KEY``); never in clear in the database, never
printed (``***``); read only when a driver needs them."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from cli_harness import Cli, assert_rejected, one_line, targets
from fleetwave.drivers.secrets import KEY_VARIABLE, SecretError, new_key, reveal, seal

URL = "http://127.0.0.1:9/sites/site-0001"
CLEAR = "hunter2-very-secret"


def _add(cli: Cli, *sets: str) -> tuple[int, str]:
    args = ["target", "add", "n1", "--driver", "http", "--set", f"url={URL}"]
    for s in sets:
        args += ["--set", s]
    res = cli(*args)
    return res.code, res.text


def _stored(db: Path) -> str:
    with sqlite3.connect(db) as conn:
        return str(conn.execute("select settings from targets").fetchone()[0])


def test_a_clear_secret_is_stored_sealed_and_never_printed(
    cli: Cli, db_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(KEY_VARIABLE, new_key())
    code, text = _add(cli, f"token={CLEAR}")
    assert code == 0 and CLEAR not in text
    assert '"token": "fernet:' in _stored(db_path)
    assert CLEAR.encode() not in db_path.read_bytes()
    for args in (
        ("target", "list"),
        ("target", "list", "--format", "json"),
        ("target", "show", "n1"),
        ("target", "show", "n1", "--format", "json"),
    ):
        res = cli(*args)
        assert res.code == 0 and CLEAR not in res.text and "fernet:" not in res.text, args
        assert "***" in res.text
    assert targets(cli)["n1"]["settings"]["token"] == "***"
    # given again as it was: the same target (sealed anew, the same secret)
    code, text = _add(cli, f"token={CLEAR}")
    assert code == 0 and "already exists, unchanged" in text
    assert cli("target", "set", "n1", "--set", f"token={CLEAR}").text.endswith(
        "unchanged (it is so already)"
    )
    # another value: a clash, said masked
    code, text = _add(cli, "token=other")
    assert code == 2 and "other" not in text.replace("another", "") and "***" in text
    res = cli("target", "set", "n1", "--set", "token=other2", "--format", "json")
    assert res.code == 0 and "other2" not in res.text
    assert res.json()["changes"]["settings"] == {
        "before": {"url": URL, "token": "***"},
        "after": {"url": URL, "token": "***"},
    }
    assert b"other2" not in db_path.read_bytes()


def test_without_a_key_a_clear_secret_is_refused_without_its_value(
    cli: Cli, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(KEY_VARIABLE, raising=False)
    res = cli(
        "target", "add", "n1", "--driver", "http", "--set", f"url={URL}", "--set", f"token={CLEAR}"
    )
    line = one_line(res)
    assert line.startswith(f"error: target n1: token: {KEY_VARIABLE} is not set")
    assert CLEAR not in res.text
    assert targets(cli) == {}
    monkeypatch.setenv(KEY_VARIABLE, "not-a-key")
    assert_rejected(
        cli("target", "add", "n1", "--driver", "http", "--set", f"url={URL}", "--set", "token=x"),
        f"target n1: token: {KEY_VARIABLE}: not a Fernet key",
    )


def test_references_are_stored_and_shown_as_given(
    cli: Cli, db_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(KEY_VARIABLE, raising=False)  # not needed for references
    assert _add(cli, "token=env:SITE_TOKEN", "license=file:/etc/site.lic")[0] == 0
    assert targets(cli)["n1"]["settings"]["token"] == "env:SITE_TOKEN"
    assert '"license": "file:/etc/site.lic"' in _stored(db_path)
    assert_rejected(
        cli("target", "set", "n1", "--set", "license=file:relative.lic"),
        "target n1: license: file: must name an absolute path",
    )
    assert_rejected(cli("target", "set", "n1", "--set", "token=env:"), "token: env: must name")
    assert_rejected(cli("target", "set", "n1", "--set", "token="), "token: a secret must be")


def test_reveal_reads_the_secret_where_its_reference_says(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SITE_TOKEN", "from-env")
    assert reveal("env:SITE_TOKEN", "token") == "from-env"
    secret_file = tmp_path / "lic"
    secret_file.write_text("from-file\n")
    assert reveal(f"file:{secret_file}", "license") == "from-file"
    monkeypatch.setenv(KEY_VARIABLE, new_key())
    sealed = seal(CLEAR)
    assert sealed.startswith("fernet:") and CLEAR not in sealed
    assert reveal(sealed, "token") == CLEAR
    for stored, said in (
        ("env:NOT_SET_ANYWHERE", "token: environment variable NOT_SET_ANYWHERE is not set"),
        (f"file:{tmp_path / 'missing'}", "token: cannot read"),
    ):
        with pytest.raises(SecretError, match=said):
            reveal(stored, "token")
    monkeypatch.setenv(KEY_VARIABLE, new_key())  # another key
    with pytest.raises(SecretError) as wrong:
        reveal(sealed, "token")
    assert "cannot decrypt it" in str(wrong.value) and CLEAR not in str(wrong.value)
