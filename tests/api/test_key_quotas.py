"""Calendar quotas of one API key (issue 22): `/v1/tenants/{t}/keys/{id}/quotas/{name}`.

A key's quota counts only that key's requests, is decided in the admission
statement with every other limit (a refusal says `"scope": "key"`), is
charged at settlement like a tenant's, alerts once per threshold and window
apart from a tenant quota of the same name, and is held by outage replays.
"""

from __future__ import annotations

import uuid
from typing import Any

import asyncpg
import httpx

from llmquota.admission.limiter import Limiter
from llmquota.domain.policy import Policy
from llmquota.domain.quotas import quota_spec
from llmquota.domain.records import AdmitRequest, OutageAdmissionRecord
from llmquota.store.alerts import AlertStore
from tests.api.conftest import make_tenant

SLOW = 1  # tokens per minute: refill is negligible during a test
DAILY = {"period": "day", "tokens": 1_000}


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def new_key(client: httpx.AsyncClient, admin: dict[str, str]) -> dict[str, Any]:
    response = await client.post("/v1/tenants/acme/keys", headers=admin)
    assert response.status_code == 201, response.text
    created: dict[str, Any] = response.json()
    return created


async def admit(client: httpx.AsyncClient, key: str) -> httpx.Response:
    body = {"tenant": "acme", "model": "gpt-4o", "input_tokens": 100, "max_tokens": 500}
    return await client.post("/v1/admit", json=body, headers=bearer(key))


async def test_a_key_quota_binds_that_key_only_and_is_charged_at_settlement(
    client: httpx.AsyncClient, admin: dict[str, str]
) -> None:
    await make_tenant(client, admin, "acme", tokens_per_minute=SLOW, token_burst=100_000)
    key, other = await new_key(client, admin), await new_key(client, admin)
    url = f"/v1/tenants/acme/keys/{key['id']}/quotas/daily"
    created = await client.put(url, json=DAILY, headers=admin)
    assert created.status_code == 201, created.text
    assert (created.json()["key_id"], created.json()["route"]) == (key["id"], None)
    assert (await client.put(url, json=DAILY, headers=admin)).status_code == 200

    held = await admit(client, key["key"])  # 600 of the key's 1,000
    assert held.status_code == 201, held.text
    refused = await admit(client, key["key"])
    assert refused.status_code == 429, refused.text
    error = refused.json()["error"]
    assert (error["limit"], error["scope"], error["quota"]) == ("quota", "key", "daily")
    assert error["resets_at"] is not None
    for _ in range(3):  # the tenant's other key: not counted against it
        assert (await admit(client, other["key"])).status_code == 201

    settled = await client.post(
        f"/v1/reservations/{held.json()['reservation_id']}/settle",
        json={"input_tokens": 100, "output_tokens": 50},
        headers=bearer(key["key"]),
    )
    assert settled.status_code == 200, settled.text
    window = (await client.get(url, headers=admin)).json()["window"]
    assert window["usage_tokens"] == 150  # reserved 600, charged 150
    assert (await admit(client, key["key"])).status_code == 201  # 150 + 600 <= 1,000
    listed = (await client.get(f"/v1/tenants/acme/keys/{key['id']}/quotas", headers=admin)).json()
    assert [q["name"] for q in listed["quotas"]] == ["daily"]
    everything = (await client.get("/v1/tenants/acme/quotas", headers=admin)).json()["quotas"]
    assert [(q["name"], q["key_id"]) for q in everything] == [("daily", key["id"])]
    assert (await client.get("/v1/tenants/acme/quotas/daily", headers=admin)).status_code == 404
    assert (await client.delete(url, headers=admin)).status_code == 204
    assert (await client.get(url, headers=admin)).status_code == 404


async def test_a_key_quota_and_a_tenant_quota_of_one_name_alert_apart(
    client: httpx.AsyncClient, admin: dict[str, str]
) -> None:
    await make_tenant(client, admin, "acme", tokens_per_minute=SLOW, token_burst=100_000)
    key = await new_key(client, admin)
    body = {**DAILY, "alerts": [0.5]}
    tenant_quota = await client.put(
        "/v1/tenants/acme/quotas/daily", json={**body, "enforce": "alert_only"}, headers=admin
    )
    assert tenant_quota.status_code == 201
    key_quota = await client.put(
        f"/v1/tenants/acme/keys/{key['id']}/quotas/daily",
        json={**body, "tokens": 10_000},
        headers=admin,
    )
    assert key_quota.status_code == 201
    for _ in range(9):  # 5,400 tokens: both pass 50% (the tenant's at the first)
        assert (await admit(client, key["key"])).status_code == 201
    alerts = (await client.get("/v1/tenants/acme/alerts", headers=admin)).json()["alerts"]
    fired = sorted((a["quota"], a.get("key_id", 0), a["threshold"]) for a in alerts)
    assert fired == [("daily", 0, "0.5"), ("daily", key["id"], "0.5")]  # 0: no key_id


async def test_key_quota_writes_are_refused_for_keys_the_tenant_does_not_hold(
    client: httpx.AsyncClient, admin: dict[str, str], db: asyncpg.Connection
) -> None:
    await make_tenant(client, admin, "acme", tokens_per_minute=SLOW, token_burst=100_000)
    await make_tenant(client, admin, "bolt", tokens_per_minute=SLOW, token_burst=100_000)
    key = await new_key(client, admin)
    bolts = (await client.post("/v1/tenants/bolt/keys", headers=admin)).json()
    for key_id in (999_999, bolts["id"]):
        response = await client.put(
            f"/v1/tenants/acme/keys/{key_id}/quotas/daily", json=DAILY, headers=admin
        )
        assert response.status_code == 404, response.text
    await client.delete(f"/v1/tenants/acme/keys/{key['id']}", headers=admin)
    revoked = await client.put(
        f"/v1/tenants/acme/keys/{key['id']}/quotas/daily", json=DAILY, headers=admin
    )
    assert revoked.status_code == 404
    bad = await client.put(
        f"/v1/tenants/acme/keys/{bolts['id']}/quotas/daily", json={"period": "week"}, headers=admin
    )
    assert bad.status_code == 422
    assert await db.fetchval("SELECT count(*) FROM quotas") == 0


async def test_outage_admissions_are_held_on_the_key_quota(
    limiter: Limiter, db: asyncpg.Connection
) -> None:
    await limiter.store.put_policy(
        "tenant", "acme", None, Policy(tokens_per_minute=SLOW, token_burst=100_000)
    )
    key_id = await db.fetchval(
        "INSERT INTO api_keys (key_hash, tenant) VALUES ('\\x01', 'acme') RETURNING key_id"
    )
    alerts = AlertStore(limiter.store.pool)
    spec = quota_spec(period="day", tokens=1_000)
    assert await alerts.put_quota("acme", None, "daily", spec, key_id) is not None
    version = await db.fetchval("SELECT policy_version FROM limit_layers WHERE tenant = 'acme'")
    records = [
        OutageAdmissionRecord(
            uuid.uuid4(),
            AdmitRequest("acme", None, "gpt-4o", 100, 500, False, None, None, None, key_id=k),
            int(version),
            "open",
        )
        for k in (key_id, None)
    ]
    assert await limiter.store.outage.record_admissions(records) == [True, True]
    (quota,) = await alerts.list_quotas("acme", key_id=key_id)
    assert quota.usage_tokens == 600  # the key's admission only
