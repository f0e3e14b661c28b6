"""REST: quotas, credits, webhooks and alerts; bad input is a 422 naming the field."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest

from tests.api.conftest import make_tenant

# Also run on a Citus coordinator by CI's Citus leg (pyproject.toml's markers).
pytestmark = pytest.mark.citus

SECRET = "whsec_0123456789abcdef"


@pytest.fixture
async def acme(client: httpx.AsyncClient, admin: dict[str, str]) -> dict[str, str]:
    return await make_tenant(client, admin, "acme", tokens_per_minute=1000)


def _error(response: httpx.Response, status: int) -> str:
    assert response.status_code == status, response.text
    body = response.json()
    assert body["type"] == "error"
    message: str = body["error"]["message"]
    return message


async def test_quota_put_get_list_delete(
    client: httpx.AsyncClient, admin: dict[str, str], acme: dict[str, str]
) -> None:
    body = {"period": "month", "timezone": "Europe/Berlin", "tokens": 1_000_000, "cost": "250.50"}
    created = await client.put("/v1/tenants/acme/quotas/monthly", json=body, headers=admin)
    assert created.status_code == 201, created.text
    quota = created.json()
    assert quota["alerts"] == [0.5, 0.8, 0.95, 1.0]
    assert quota["enforce"] == "block"
    assert quota["cost"] == "250.50"
    assert quota["window"]["usage_tokens"] == 0
    assert quota["window"]["start"].endswith(("+00:00", "Z")) or "T" in quota["window"]["start"]
    replaced = await client.put(
        "/v1/tenants/acme/quotas/monthly",
        json={**body, "models": ["gpt-4o*"], "alerts": [0.9], "enforce": "alert_only"},
        headers=admin,
    )
    assert replaced.status_code == 200
    route = await client.put(
        "/v1/tenants/acme/routes/chat/quotas/daily",
        json={"period": "day", "tokens": 5},
        headers=admin,
    )
    assert route.status_code == 201
    got = await client.get("/v1/tenants/acme/quotas/monthly", headers=admin)
    assert got.json()["models"] == ["gpt-4o*"]
    listed = await client.get("/v1/tenants/acme/quotas", headers=admin)
    assert [(q["route"], q["name"]) for q in listed.json()["quotas"]] == [
        (None, "monthly"),
        ("chat", "daily"),
    ]
    # The route quota is not the tenant's quota of that name.
    _error(await client.get("/v1/tenants/acme/quotas/daily", headers=admin), 404)
    ok = await client.get("/v1/tenants/acme/routes/chat/quotas/daily", headers=admin)
    assert ok.status_code == 200
    deleted = await client.delete("/v1/tenants/acme/quotas/monthly", headers=admin)
    assert deleted.status_code == 204
    _error(await client.delete("/v1/tenants/acme/quotas/monthly", headers=admin), 404)
    _error(await client.put("/v1/tenants/nobody/quotas/q", json=body, headers=admin), 404)


async def test_only_the_admin_manages_quotas_credits_and_webhooks(
    client: httpx.AsyncClient, acme: dict[str, str]
) -> None:
    for method, path, body in [
        ("PUT", "/v1/tenants/acme/quotas/q", {"period": "day", "tokens": 1}),
        ("POST", "/v1/tenants/acme/credits", {"amount": "1", "reference": "r"}),
        ("GET", "/v1/tenants/acme/credits", None),
        ("GET", "/v1/tenants/acme/alerts", None),
        ("PUT", "/v1/webhooks/w", {"url": "http://127.0.0.1:9/", "secret": SECRET}),
    ]:
        response = await client.request(method, path, json=body, headers=acme)
        assert response.status_code == 403, (path, response.text)


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"period": "week", "tokens": 1}, "period"),
        ({"period": "day", "tokens": 1, "timezone": "Mars/Base"}, "timezone"),
        ({"period": "day", "tokens": 1, "timezone": "../etc/passwd"}, "timezone"),
        ({"period": "day", "cost": "-5"}, "cost"),
        ({"period": "day", "cost": "ten"}, "cost"),
        ({"period": "day", "cost": 10.5}, "cost"),
        ({"period": "day", "tokens": 0}, "tokens"),
        ({"period": "day"}, "tokens or cost"),
        ({"period": "day", "tokens": 1, "alerts": [0, 0.5]}, "alerts"),
        ({"period": "day", "tokens": 1, "alerts": [0.5, 1.5]}, "alerts"),
        ({"period": "day", "tokens": 1, "enforce": "maybe"}, "enforce"),
        ({"period": "day", "tokens": 1, "models": [""]}, "models"),
        ({"period": "day", "tokens": 1, "colour": "red"}, "colour"),
    ],
)
async def test_bad_quotas_are_422_naming_the_field(
    client: httpx.AsyncClient,
    admin: dict[str, str],
    acme: dict[str, str],
    body: dict[str, Any],
    field: str,
) -> None:
    response = await client.put("/v1/tenants/acme/quotas/q", json=body, headers=admin)
    assert field in _error(response, 422)


async def test_credits_add_once_per_reference(
    client: httpx.AsyncClient, admin: dict[str, str], acme: dict[str, str]
) -> None:
    topup = {"amount": "25.10", "reference": "invoice-7"}
    answers = await asyncio.gather(
        *(client.post("/v1/tenants/acme/credits", json=topup, headers=admin) for _ in range(10))
    )
    assert sorted(a.status_code for a in answers) == [200] * 9 + [201]
    first = next(a.json() for a in answers if a.status_code == 201)
    again = next(a.json() for a in answers if a.status_code == 200)
    assert first["applied"] is True and again["applied"] is False
    assert again["entry_id"] == first["entry_id"]
    credits = (await client.get("/v1/tenants/acme/credits", headers=admin)).json()
    assert credits["balance"] == "25.1"
    assert credits["available"] == "25.1"
    assert [t["reference"] for t in credits["topups"]] == ["invoice-7"]
    conflict = await client.post(
        "/v1/tenants/acme/credits", json={**topup, "amount": "30"}, headers=admin
    )
    assert "invoice-7" in _error(conflict, 422)


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"amount": "-1", "reference": "r"}, "amount"),
        ({"amount": "0", "reference": "r"}, "amount"),
        ({"amount": "1e3", "reference": "r"}, "amount"),
        ({"amount": 5, "reference": "r"}, "amount"),
        ({"amount": "1.0000000000001", "reference": "r"}, "amount"),
        ({"amount": "1", "reference": ""}, "reference"),
        ({"amount": "1"}, "reference"),
    ],
)
async def test_bad_top_ups_are_422_naming_the_field(
    client: httpx.AsyncClient,
    admin: dict[str, str],
    acme: dict[str, str],
    body: dict[str, Any],
    field: str,
) -> None:
    response = await client.post("/v1/tenants/acme/credits", json=body, headers=admin)
    assert field in _error(response, 422)


async def test_webhooks_put_get_list_delete_without_showing_the_secret(
    client: httpx.AsyncClient, admin: dict[str, str], acme: dict[str, str]
) -> None:
    for name, url, tenant in [
        ("public", "http://93.184.216.34:9000/hook", None),
        ("private", "https://1.1.1.1/hook", "acme"),
        ("ipv6", "http://[2606:2800:220:1::1]:9000/hook", None),
    ]:
        body = {"url": url, "secret": SECRET, "tenant": tenant}
        response = await client.put(f"/v1/webhooks/{name}", json=body, headers=admin)
        assert response.status_code == 201, response.text
        assert "secret" not in response.json()
    listed = (await client.get("/v1/webhooks", headers=admin)).json()["webhooks"]
    assert [w["name"] for w in listed] == ["ipv6", "private", "public"]
    assert all("secret" not in w for w in listed)
    one = await client.get("/v1/webhooks/private", headers=admin)
    assert one.json()["tenant"] == "acme"
    assert (await client.delete("/v1/webhooks/private", headers=admin)).status_code == 204
    _error(await client.get("/v1/webhooks/private", headers=admin), 404)
    unknown = {"url": "http://93.184.216.34:9/", "secret": SECRET, "tenant": "nobody"}
    _error(await client.put("/v1/webhooks/w", json=unknown, headers=admin), 404)


@pytest.mark.parametrize(
    ("url", "secret", "field"),
    [
        ("ftp://example.com/hook", SECRET, "url"),
        ("file:///etc/passwd", SECRET, "url"),
        ("not a url", SECRET, "url"),
        ("http://169.254.169.254/latest/meta-data/", SECRET, "link-local"),
        ("http://[fe80::1]/hook", SECRET, "link-local"),
        ("http://[::ffff:169.254.169.254]/hook", SECRET, "link-local"),
        # The service's own listening address (the test transport's host).
        ("http://llmquota/v1/admit", SECRET, "own listening address"),
        ("http://127.0.0.1:9/", SECRET, "loopback"),
        ("http://93.184.216.34:9/", "short", "secret"),
        ("http://93.184.216.34:9/", "fifteen-bytes!!", "secret"),
    ],
)
async def test_bad_webhooks_are_422_naming_the_field_and_ssrf_targets_are_refused(
    client: httpx.AsyncClient, admin: dict[str, str], url: str, secret: str, field: str
) -> None:
    response = await client.put(
        "/v1/webhooks/w", json={"url": url, "secret": secret}, headers=admin
    )
    assert field in _error(response, 422)


async def test_alerts_of_a_tenant_are_listed(
    client: httpx.AsyncClient, admin: dict[str, str], acme: dict[str, str]
) -> None:
    empty = await client.get("/v1/tenants/acme/alerts", headers=admin)
    assert empty.json() == {"tenant": "acme", "alerts": []}
    _error(await client.get("/v1/tenants/nobody/alerts", headers=admin), 404)
