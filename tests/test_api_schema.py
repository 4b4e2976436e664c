"""schemathesis against the API's own OpenAPI document: for each role's token and for
none, generated requests (valid and not) never get a 5xx, and every answer matches
its documented status, content type and schema. (The check that valid-looking data is
accepted is left out: the schema cannot say that a cursor must be one the server gave,
or that a name must follow the name rule; those are refused with 422, as documented.)"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import positive_data_acceptance

from fleetwave.api.app import make_app
from fleetwave.api.service import Service
from fleetwave.domain.models import StrategyOptions, Target
from fleetwave.domain.registry import get_workflow
from fleetwave.store import admin
from fleetwave.store.db import open_store
from fleetwave.store.tokens import Role, create_token

#: the app, and a token of each role
App = tuple[Any, dict[str, str]]


def _app_and_tokens() -> App:
    """The app on a small fleet (targets, a strategy), with a token per role. Made when
    the module is collected: schemathesis reads the schema then (its fixture-based
    loader does not work with this pytest)."""
    db = Path(tempfile.mkdtemp(prefix="fw-schema-")) / "fleet.db"
    store = open_store(str(db))
    admin.add_targets(store, [Target(name=f"t{i}") for i in range(3)])
    wf = get_workflow("patch")
    assert wf is not None
    admin.create_strategy(store, wf, StrategyOptions(), all_targets=True)
    tokens = {role.value: create_token(store, f"st-{role.value}", role, None) for role in Role}
    store.dispose()
    return make_app(Service(open_store(str(db)))), tokens


APP = _app_and_tokens()
schema = schemathesis.openapi.from_asgi("/openapi.json", APP[0])


@pytest.fixture
def app_and_tokens() -> App:
    return APP


def _check_as(case: Any, app_and_tokens: App, role: str | None) -> None:
    token = None if role is None else app_and_tokens[1][role]
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    case.call_and_validate(headers=headers, excluded_checks=[positive_data_acceptance])


SETTINGS = settings(
    max_examples=20,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@schema.parametrize()
@SETTINGS
def test_without_a_token(case: Any, app_and_tokens: App) -> None:
    _check_as(case, app_and_tokens, None)


@schema.parametrize()
@SETTINGS
def test_as_a_reader(case: Any, app_and_tokens: App) -> None:
    _check_as(case, app_and_tokens, "reader")


@schema.parametrize()
@SETTINGS
def test_as_an_operator(case: Any, app_and_tokens: App) -> None:
    _check_as(case, app_and_tokens, "operator")


@schema.parametrize()
@SETTINGS
def test_as_an_admin(case: Any, app_and_tokens: App) -> None:
    _check_as(case, app_and_tokens, "admin")


def test_the_schema_names_every_route(app_and_tokens: App) -> None:
    paths = set(app_and_tokens[0].openapi()["paths"])
    assert {
        "/v1/targets",
        "/v1/strategies/{strategy_id}/history",
        "/v1/steps/{step_id}/callbacks",
        "/v1/tokens",
        "/metrics",
        "/readyz",
    } <= paths
