"""A bearer token found valid is taken as valid for at most TOKEN_CACHE_S without being
read again: a token revoked elsewhere (a command) is refused within that time, one
revoked through the API at once, an expired one at its expiry, and a token made
elsewhere is valid at once (a refusal is never kept)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from fastapi.testclient import TestClient

from fleetwave.api.app import make_app
from fleetwave.api.service import TOKEN_CACHE_S, Service
from fleetwave.store import tokens
from fleetwave.store.db import Store, open_store
from fleetwave.store.tokens import Role


@contextmanager
def _client(store: Store) -> Iterator[TestClient]:
    with TestClient(make_app(Service(store))) as client:
        yield client


def _status(http: TestClient, token: str) -> int:
    return http.get("/v1/targets", headers={"Authorization": f"Bearer {token}"}).status_code


def test_a_token_revoked_by_a_command_is_refused_within_the_cache_time(tmp_path: Path) -> None:
    store = open_store(str(tmp_path / "fleet.db"))
    with _client(store) as http:
        # made elsewhere, after the server started: valid at once; a refusal is not kept
        assert _status(http, "fwa_nosuchtoken") == 401
        reader = tokens.create_token(store, "dash", Role.READER, None)
        assert _status(http, reader) == 200
        revoked_at = time.monotonic()
        assert tokens.revoke_token(store, "dash")
        while _status(http, reader) == 200:
            assert time.monotonic() - revoked_at < TOKEN_CACHE_S + 1.0, "still valid"
            time.sleep(0.05)
        assert time.monotonic() - revoked_at <= TOKEN_CACHE_S + 0.5


def test_a_token_revoked_through_the_api_is_refused_at_once(tmp_path: Path) -> None:
    store = open_store(str(tmp_path / "fleet.db"))
    admin_token = tokens.create_token(store, "ops", Role.ADMIN, None)
    reader = tokens.create_token(store, "dash", Role.READER, None)
    with _client(store) as http:
        assert _status(http, reader) == 200
        revoked = http.post(
            "/v1/tokens/dash/revoke", headers={"Authorization": f"Bearer {admin_token}"}
        )
        assert revoked.status_code == 200, revoked.text
        assert _status(http, reader) == 401


def test_a_token_is_refused_from_its_expiry_on_however_recently_it_was_found(
    tmp_path: Path,
) -> None:
    store = open_store(str(tmp_path / "fleet.db"))
    expires = time.time() + 0.4
    brief = tokens.create_token(store, "brief", Role.READER, expires)
    with _client(store) as http:
        assert _status(http, brief) == 200
        time.sleep(max(0.0, expires - time.time()) + 0.05)
        assert _status(http, brief) == 401
