"""GET /v1/ceilings/{ceiling}/oversubscription through the real app and database.

Seed 001's account: 50 tenants at 5,000 tokens a minute under a 90,000-token
ceiling, set up through the API (30 from their plan, 20 from their own
policies), with the ledger of tests/oversubscription_fixture.py, whose
percentiles are worked out there by hand: 250,000 / 90,000 = 2.777... reads
2.78 (two decimals, half away from zero), which is above 2x and not above
3x: `warn`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import asyncpg
import httpx
import pytest

from llmquota.api.app import create_app
from llmquota.config import Settings
from tests import oversubscription_fixture as fx
from tests.api.conftest import ADMIN_KEY, make_tenant

PATH = f"/v1/ceilings/{fx.CEILING}/oversubscription"


async def _set_up(client: httpx.AsyncClient, admin: dict[str, str]) -> None:
    """The fixture's limits, written through the API."""
    limits = {"tokens_per_minute": fx.TENANT_TPM, "requests_per_minute": fx.TENANT_RPM}
    response = await client.put(f"/v1/plans/{fx.PLAN}", json=limits, headers=admin)
    assert response.status_code == 200, response.text
    for tenant in fx.TENANTS:
        body = {"plan": fx.PLAN} if tenant in fx.PLAN_TENANTS else limits
        response = await client.put(f"/v1/tenants/{tenant}/policy", json=body, headers=admin)
        assert response.status_code == 200, response.text
    response = await client.put(
        f"/v1/tenants/{fx.TENANTS[0]}/routes/{fx.ROUTE}/policy",
        json={"tokens_per_minute": fx.ROUTE_TPM},
        headers=admin,
    )
    assert response.status_code == 200, response.text
    await make_tenant(client, admin, fx.SUSPENDED, **limits)
    response = await client.post(f"/v1/tenants/{fx.SUSPENDED}/suspend", headers=admin)
    assert response.status_code == 200, response.text
    ceiling = {
        "models": fx.MODELS,
        "tokens_per_minute": fx.CEILING_TPM,
        "requests_per_minute": fx.CEILING_RPM,
    }
    response = await client.put(f"/v1/ceilings/{fx.CEILING}", json=ceiling, headers=admin)
    assert response.status_code == 200, response.text


def _as_json(expected: dict[str, object]) -> dict[str, object]:
    """The fixture's figures as the answer nests and types them."""
    body = {k: v for k, v in expected.items() if not k.startswith("active_tenants_")}
    body["active_tenants"] = {
        "p50": expected["active_tenants_p50"],
        "p95": expected["active_tenants_p95"],
        "max": expected["active_tenants_max"],
    }
    for name in ("ratio", "requests_ratio", "effective_ratio", "effective_requests_ratio"):
        body[name] = float(str(expected[name]))
    return body


async def test_fifty_tenants_at_5000_under_90000_read_2_78_and_warn(
    client: httpx.AsyncClient, admin: dict[str, str], db: asyncpg.Connection
) -> None:
    await _set_up(client, admin)
    await fx.seed_ledger(db)
    response = await client.get(PATH, headers=admin)
    assert response.status_code == 200, response.text
    body = response.json()
    # the fields clients rely on, exactly
    assert body["ceiling"] == "openai-gpt4o"
    assert body["tokens_per_minute"] == 90_000
    assert body["sum_tenant_tokens_per_minute"] == 250_000
    assert body["ratio"] == 2.78
    assert body["active_tenants"] == {"p50": 10, "p95": 19, "max": 20}
    assert body["effective_ratio"] == 1.06
    assert body["verdict"] == "warn"
    # and every other figure the fixture worked out
    assert {k: body[k] for k in _as_json(fx.EXPECTED_7_DAYS)} == _as_json(fx.EXPECTED_7_DAYS)
    assert body["days"] == 7
    assert body["rule"] == {"warn_above": 2.0, "critical_above": 3.0}

    nine = (await client.get(PATH, params={"days": 9}, headers=admin)).json()
    assert {k: nine[k] for k in _as_json(fx.EXPECTED_9_DAYS)} == _as_json(fx.EXPECTED_9_DAYS)
    assert nine["days"] == 9


async def test_more_tenants_make_it_critical_and_a_bigger_ceiling_ok(
    client: httpx.AsyncClient, admin: dict[str, str]
) -> None:
    await _set_up(client, admin)
    for i in range(5):  # 55 x 5,000 = 275,000 > 3 x 90,000
        await make_tenant(
            client, admin, f"late{i}", tokens_per_minute=fx.TENANT_TPM, requests_per_minute=100
        )
    body = (await client.get(PATH, headers=admin)).json()
    assert (body["sum_tenant_tokens_per_minute"], body["ratio"]) == (275_000, 3.06)
    assert (body["sum_tenant_requests_per_minute"], body["requests_ratio"]) == (5_500, 1.1)
    assert body["verdict"] == "critical"
    # 275,000 / 137,500 = 2.00 exactly, which is not above 2
    patch = {"tokens_per_minute": 137_500}
    response = await client.patch(f"/v1/ceilings/{fx.CEILING}", json=patch, headers=admin)
    assert response.status_code == 200, response.text
    body = (await client.get(PATH, headers=admin)).json()
    assert (body["ratio"], body["verdict"]) == (2.0, "ok")
    # a tenant without a request limit can send the whole ceiling's 5,000 requests
    await make_tenant(client, admin, "open", tokens_per_minute=1)
    body = (await client.get(PATH, headers=admin)).json()
    assert body["tenants_without_request_limit"] == 1
    assert (body["sum_tenant_requests_per_minute"], body["requests_ratio"]) == (10_500, 2.1)
    assert body["verdict"] == "warn"


async def test_the_rule_comes_from_the_settings(app_dsn: str, db: asyncpg.Connection) -> None:
    settings = Settings(  # type: ignore[call-arg]
        admin_key=ADMIN_KEY,
        oversubscription_warn_ratio=1.5,
        oversubscription_critical_ratio=2.5,
        _env_file=None,
    )
    app = create_app(settings, dsn=app_dsn)
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://llmquota") as client:
            await _set_up(client, admin)
            body = (await client.get(PATH, headers=admin)).json()
    assert (body["ratio"], body["verdict"]) == (2.78, "critical")
    assert body["rule"] == {"warn_above": 1.5, "critical_above": 2.5}


@pytest.fixture
async def ceiling(client: httpx.AsyncClient, admin: dict[str, str]) -> AsyncIterator[None]:
    response = await client.put(
        f"/v1/ceilings/{fx.CEILING}",
        json={"models": ["gpt-4o"], "tokens_per_minute": 1_000},
        headers=admin,
    )
    assert response.status_code == 200, response.text
    yield


@pytest.mark.parametrize("days", ["0", "-1", "367", "seven", "1.5", ""])
async def test_days_out_of_range_is_a_422_naming_days(
    client: httpx.AsyncClient, admin: dict[str, str], ceiling: None, days: str
) -> None:
    response = await client.get(PATH, params={"days": days}, headers=admin)
    assert response.status_code == 422, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert "days" in error["message"]


async def test_the_longest_period_is_accepted(
    client: httpx.AsyncClient, admin: dict[str, str], ceiling: None
) -> None:
    response = await client.get(PATH, params={"days": 366}, headers=admin)
    assert response.status_code == 200, response.text
    assert response.json()["days"] == 366


async def test_an_unknown_ceiling_is_404(
    client: httpx.AsyncClient, admin: dict[str, str], ceiling: None
) -> None:
    response = await client.get("/v1/ceilings/no-such/oversubscription", headers=admin)
    assert response.status_code == 404, response.text
    assert response.json()["error"]["type"] == "not_found_error"


async def test_only_the_admin_reads_it(
    client: httpx.AsyncClient, admin: dict[str, str], ceiling: None
) -> None:
    acme = await make_tenant(client, admin, "acme", tokens_per_minute=1_000)
    assert (await client.get(PATH, headers=acme)).status_code == 403
    assert (await client.get(PATH)).status_code == 401
