"""Secret driver settings, by reference: what is stored, and how a driver reads it.

A secret setting (a ``SecretStr`` field of a driver's settings model) is stored as one
of:

* ``env:VAR``: the value of the environment variable ``VAR`` of the conductor;
* ``file:/path``: the text of a file the conductor can read (one trailing newline
  dropped);
* ``fernet:TOKEN``: the value encrypted with the operator's key
  (``FLEETWAVE_SECRET_KEY``, a Fernet key), which :func:`seal` makes of a value given
  in clear.

A value in clear is never stored, shown or logged: :func:`shown_secret` is what a
command prints (a reference as it is, anything else ``***``). :func:`reveal` turns a
reference into the value, when a driver needs it and not before.
"""

from __future__ import annotations

import os
from pathlib import Path

from cryptography.fernet import Fernet, InvalidToken

#: the environment variable holding the operator's key
KEY_VARIABLE = "FLEETWAVE_SECRET_KEY"
MASK = "***"
_ENV, _FILE, _SEALED = "env:", "file:", "fernet:"
#: the longest secret file read
MAX_SECRET_FILE_BYTES = 64 * 1024


class SecretError(ValueError):
    """A secret cannot be stored or read; the message never holds the value."""


def is_reference(value: object) -> bool:
    """``env:VAR`` or ``file:/path``: says where the secret is, not what it is."""
    return isinstance(value, str) and value.startswith((_ENV, _FILE))


def is_sealed(value: object) -> bool:
    return isinstance(value, str) and value.startswith(_SEALED)


def shown_secret(value: object) -> str:
    """What any command, log or error shows of a stored secret."""
    return value if is_reference(value) and isinstance(value, str) else MASK


def _key() -> Fernet:
    key = os.environ.get(KEY_VARIABLE, "").strip()
    if not key:
        raise SecretError(
            f"{KEY_VARIABLE} is not set (a secret given in clear is stored encrypted with "
            "it; or give the secret as env:VAR or file:/path)"
        )
    try:
        return Fernet(key.encode())
    except ValueError:
        raise SecretError(
            f"{KEY_VARIABLE}: not a Fernet key (32 url-safe base64-encoded bytes; "
            "'fleetwave driver new-key' makes one)"
        ) from None


def new_key() -> str:
    """A fresh key for ``FLEETWAVE_SECRET_KEY``."""
    return Fernet.generate_key().decode()


def check_reference(value: str) -> str:
    """A stored form of a secret as given (a reference, or sealed already): the problem
    with it, if any (empty: fine). A value in clear is fine (it is then sealed)."""
    if value.startswith(_ENV):
        var = value[len(_ENV) :]
        if not var or not var.replace("_", "a").isalnum():
            return "env: must name an environment variable (env:VAR: letters, digits, _)"
    elif value.startswith(_FILE) and not Path(value[len(_FILE) :]).is_absolute():
        return "file: must name an absolute path (file:/path)"
    return ""


def seal(value: str) -> str:
    """The stored form of a secret given as ``value``: a reference or a sealed value as
    it is; a value in clear encrypted with the operator's key (:class:`SecretError` if
    there is none)."""
    if is_reference(value) or is_sealed(value):
        return value
    return _SEALED + _key().encrypt(value.encode()).decode()


def reveal(stored: str, field: str) -> str:
    """The secret's value, read where its stored form says; ``field`` names the setting
    in a :class:`SecretError`."""
    if stored.startswith(_ENV):
        var = stored[len(_ENV) :]
        value = os.environ.get(var)
        if value is None:
            raise SecretError(f"{field}: environment variable {var} is not set")
        return value
    if stored.startswith(_FILE):
        path = Path(stored[len(_FILE) :])
        try:
            with path.open("rb") as f:
                data = f.read(MAX_SECRET_FILE_BYTES + 1)
        except OSError as exc:
            raise SecretError(f"{field}: cannot read {path}: {exc.strerror or exc}") from None
        if len(data) > MAX_SECRET_FILE_BYTES:
            raise SecretError(f"{field}: {path} is over {MAX_SECRET_FILE_BYTES} bytes")
        return data.decode("utf-8", "replace").removesuffix("\n")
    if stored.startswith(_SEALED):
        try:
            return _key().decrypt(stored[len(_SEALED) :].encode()).decode()
        except InvalidToken:
            raise SecretError(
                f"{field}: cannot decrypt it with {KEY_VARIABLE} (stored with another key?)"
            ) from None
    # stored in clear (not by fleetwave: a database edited by hand); used, never shown
    return stored


def same_secret(stored: object, given: object) -> bool:
    """Whether a stored secret holds what ``given`` (stored form) holds: two seals of
    one value differ (Fernet encrypts with a fresh IV), so they are compared opened."""
    if stored == given:
        return True
    if not (is_sealed(stored) and is_sealed(given)):
        return False
    assert isinstance(stored, str) and isinstance(given, str)
    try:
        return reveal(stored, "") == reveal(given, "")
    except SecretError:
        return False
