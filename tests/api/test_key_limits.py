"""Limits of one API key (issue 22): a layer of scope `key`, decided with the others.

A key's `tokens_per_minute`, `requests_per_minute`, `max_in_flight` and
`models` are set at the top level of `POST /v1/tenants/{t}/keys` and replaced
with `PUT /v1/tenants/{t}/keys/{id}/policy`. Every rate below is exact: the
refill during a test (a token rate of 1,000 a minute gives ~17 a second) is
kept below what any assertion could notice by bursts far above the rate, or
the assertions allow for it explicitly.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import asyncpg
import httpx
import pytest

from llmquota.admission.limiter import Limiter
from llmquota.domain.errors import InvalidRequest, RateLimited
from llmquota.domain.key_limits import KeyLimits
from llmquota.domain.keys import key_digest, new_key
from llmquota.domain.policy import Policy
from llmquota.domain.records import AdmitRequest, FinishRequest, OutageAdmissionRecord
from tests.api.conftest import make_tenant
from tests.conftest import audit_findings

SLOW = 1  # tokens per minute: refill is negligible during a test


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def key_with(
    client: httpx.AsyncClient, admin: dict[str, str], tenant: str = "acme", **body: Any
) -> dict[str, Any]:
    response = await client.post(f"/v1/tenants/{tenant}/keys", json=body, headers=admin)
    assert response.status_code == 201, response.text
    created: dict[str, Any] = response.json()
    return created


async def admit(
    client: httpx.AsyncClient, key: str, *, tenant: str = "acme", **body: Any
) -> httpx.Response:
    payload: dict[str, Any] = {"tenant": tenant, "model": "gpt-4o", "input_tokens": 100}
    payload["max_tokens"] = 500
    payload.update(body)
    return await client.post("/v1/admit", json=payload, headers=bearer(key))


async def key_layer(db: asyncpg.Connection, key_id: int) -> asyncpg.Record:
    row = await db.fetchrow(
        "SELECT layer_id, tokens, requests, in_flight, allowed_models FROM limit_layers"
        " WHERE scope = 'key' AND api_key_id = $1",
        key_id,
    )
    assert row is not None
    return row


async def tenant_tokens(db: asyncpg.Connection, tenant: str = "acme") -> float:
    value = await db.fetchval(
        "SELECT tokens FROM limit_layers WHERE scope = 'tenant' AND tenant = $1", tenant
    )
    return float(value)


async def test_a_key_token_limit_refuses_with_scope_key_and_spares_the_other_keys(
    client: httpx.AsyncClient, admin: dict[str, str], db: asyncpg.Connection
) -> None:
    await make_tenant(client, admin, "acme", tokens_per_minute=SLOW, token_burst=100_000)
    capped = await key_with(client, admin, tokens_per_minute=SLOW, token_burst=1_000)
    assert (capped["tokens_per_minute"], capped["token_burst"]) == (SLOW, 1_000)
    other = await key_with(client, admin)
    assert other["tokens_per_minute"] is None and other["models"] is None

    first = await admit(client, capped["key"])  # 600 of the key's 1,000
    assert first.status_code == 201, first.text
    before = await tenant_tokens(db)
    refused = await admit(client, capped["key"])
    assert refused.status_code == 429, refused.text
    error = refused.json()["error"]
    assert (error["limit"], error["scope"], error["reason"]) == ("tokens", "key", "capacity")
    # All or nothing: the tenant layer, which had room, was not debited.
    assert await tenant_tokens(db) == pytest.approx(before, abs=0.01)
    layer = await key_layer(db, capped["id"])
    assert layer["tokens"] == pytest.approx(400, abs=0.05)
    assert layer["in_flight"] == 1
    # The tenant's other key is limited by the tenant only.
    for _ in range(3):
        assert (await admit(client, other["key"])).status_code == 201
    assert await tenant_tokens(db) == pytest.approx(100_000 - 4 * 600, abs=0.05)


async def test_a_tenant_refusal_debits_nothing_from_the_key(
    client: httpx.AsyncClient, admin: dict[str, str], db: asyncpg.Connection
) -> None:
    await make_tenant(client, admin, "acme", tokens_per_minute=SLOW, token_burst=1_000)
    capped = await key_with(client, admin, tokens_per_minute=SLOW, token_burst=50_000)
    assert (await admit(client, capped["key"])).status_code == 201
    refused = await admit(client, capped["key"])
    assert refused.status_code == 429
    assert refused.json()["error"]["scope"] == "tenant"
    layer = await key_layer(db, capped["id"])
    assert layer["tokens"] == pytest.approx(50_000 - 600, abs=0.05)
    assert layer["in_flight"] == 1


async def test_request_and_concurrency_limits_of_a_key(
    client: httpx.AsyncClient, admin: dict[str, str], db: asyncpg.Connection
) -> None:
    await make_tenant(client, admin, "acme", tokens_per_minute=SLOW, token_burst=100_000)
    per_minute = await key_with(client, admin, requests_per_minute=SLOW, request_burst=2)
    for _ in range(2):
        assert (await admit(client, per_minute["key"])).status_code == 201
    refused = await admit(client, per_minute["key"])
    assert refused.status_code == 429
    assert (refused.json()["error"]["limit"], refused.json()["error"]["scope"]) == (
        "requests",
        "key",
    )

    one_at_a_time = await key_with(client, admin, max_in_flight=1)
    held = await admit(client, one_at_a_time["key"])
    assert held.status_code == 201
    second = await admit(client, one_at_a_time["key"])
    assert second.status_code == 429
    assert (second.json()["error"]["limit"], second.json()["error"]["scope"]) == (
        "concurrency",
        "key",
    )
    released = await client.post(
        f"/v1/reservations/{held.json()['reservation_id']}/release",
        headers=bearer(one_at_a_time["key"]),
    )
    assert released.status_code in (200, 204), released.text
    assert (await key_layer(db, one_at_a_time["id"]))["in_flight"] == 0
    assert (await admit(client, one_at_a_time["key"])).status_code == 201


async def test_settling_refunds_the_key_layer_like_every_other(
    client: httpx.AsyncClient, admin: dict[str, str], db: asyncpg.Connection
) -> None:
    await make_tenant(client, admin, "acme", tokens_per_minute=SLOW, token_burst=100_000)
    capped = await key_with(client, admin, tokens_per_minute=SLOW, token_burst=1_000)
    held = await admit(client, capped["key"])
    settled = await client.post(
        f"/v1/reservations/{held.json()['reservation_id']}/settle",
        json={"input_tokens": 100, "output_tokens": 50},
        headers=bearer(capped["key"]),
    )
    assert settled.status_code == 200, settled.text
    layer = await key_layer(db, capped["id"])
    assert layer["tokens"] == pytest.approx(1_000 - 150, abs=0.05)
    assert layer["in_flight"] == 0
    assert await tenant_tokens(db) == pytest.approx(100_000 - 150, abs=0.05)


async def test_the_exact_path_decides_the_key_layer_too(
    client: httpx.AsyncClient, admin: dict[str, str], db: asyncpg.Connection
) -> None:
    # An idempotency key sends a request past the one-statement fast path to
    # the exact loop: the key layer binds there as well.
    await make_tenant(client, admin, "acme", tokens_per_minute=SLOW, token_burst=100_000)
    capped = await key_with(client, admin, tokens_per_minute=SLOW, token_burst=1_000)
    first = await admit(client, capped["key"], idempotency_key="one")
    assert first.status_code == 201
    again = await admit(client, capped["key"], idempotency_key="one")
    assert again.json()["reservation_id"] == first.json()["reservation_id"]
    refused = await admit(client, capped["key"], idempotency_key="two")
    assert refused.status_code == 429
    assert refused.json()["error"]["scope"] == "key"
    assert (await key_layer(db, capped["id"]))["tokens"] == pytest.approx(400, abs=0.05)


async def test_concurrent_admissions_never_exceed_the_key_limit(
    client: httpx.AsyncClient, admin: dict[str, str], db: asyncpg.Connection
) -> None:
    await make_tenant(client, admin, "acme", tokens_per_minute=SLOW, token_burst=1_000_000)
    capped = await key_with(client, admin, tokens_per_minute=SLOW, token_burst=6_000)
    answers = await asyncio.gather(*(admit(client, capped["key"]) for _ in range(40)))
    codes = sorted(a.status_code for a in answers)
    assert codes.count(201) == 10 and codes.count(429) == 30  # 10 x 600 = 6,000
    assert all(a.json()["error"]["scope"] == "key" for a in answers if a.status_code == 429)
    layer = await key_layer(db, capped["id"])
    assert layer["tokens"] == pytest.approx(0, abs=0.05) and layer["in_flight"] == 10


async def test_models_a_key_may_not_use_are_403_naming_the_model(
    client: httpx.AsyncClient, admin: dict[str, str], db: asyncpg.Connection
) -> None:
    await make_tenant(client, admin, "acme", tokens_per_minute=SLOW, token_burst=100_000)
    narrow = await key_with(client, admin, models=["gpt-4o-mini", "claude-*"])
    assert narrow["models"] == ["gpt-4o-mini", "claude-*"]
    before = await tenant_tokens(db)
    refused = await admit(client, narrow["key"], model="gpt-4o")
    assert refused.status_code == 403, refused.text
    assert "'gpt-4o'" in refused.json()["error"]["message"]
    fallback = await admit(
        client, narrow["key"], model="gpt-4o-mini", fallback_models=["gpt-3.5-turbo"]
    )
    assert fallback.status_code == 403
    assert "'gpt-3.5-turbo'" in fallback.json()["error"]["message"]
    assert await tenant_tokens(db) == before  # nothing reserved
    for model in ("gpt-4o-mini", "claude-3-5-sonnet-latest"):
        assert (await admit(client, narrow["key"], model=model)).status_code == 201, model
    # The globs' LIKE patterns are on the key's layer, for the fallbacks admission picks.
    assert (await key_layer(db, narrow["id"]))["allowed_models"] == ["gpt-4o-mini", "claude-%"]


async def test_a_default_fallback_the_key_may_not_use_is_never_picked(
    client: httpx.AsyncClient, admin: dict[str, str]
) -> None:
    # A 1,000-token ceiling on gpt-4o; the tenant's default fallbacks are
    # gpt-4o-mini, then gpt-4.1-mini. The key may not use gpt-4o-mini: the
    # statement skips it and degrades to gpt-4.1-mini.
    ceiling = {"models": ["gpt-4o"], "tokens_per_minute": SLOW, "token_burst": 1_000}
    response = await client.put("/v1/ceilings/openai-gpt4o", json=ceiling, headers=admin)
    assert response.status_code == 200, response.text
    policy = {
        "tokens_per_minute": SLOW,
        "token_burst": 100_000,
        "fallback_models": ["gpt-4o-mini", "gpt-4.1-mini"],
    }
    response = await client.put("/v1/tenants/acme/policy", json=policy, headers=admin)
    assert response.status_code == 200, response.text
    narrow = await key_with(client, admin, models=["gpt-4o", "gpt-4.1-*"])
    wide = await key_with(client, admin)
    assert (await admit(client, narrow["key"], input_tokens=0, max_tokens=1_000)).status_code == 201
    degraded = await admit(client, narrow["key"])
    assert degraded.status_code == 201, degraded.text
    assert (degraded.json()["model"], degraded.json()["degraded"]) == ("gpt-4.1-mini", True)
    unrestricted = await admit(client, wide["key"])
    assert unrestricted.json()["model"] == "gpt-4o-mini"


async def test_put_policy_replaces_the_key_limits_at_once(
    client: httpx.AsyncClient, admin: dict[str, str], db: asyncpg.Connection
) -> None:
    await make_tenant(client, admin, "acme", tokens_per_minute=SLOW, token_burst=100_000)
    created = await key_with(client, admin)
    assert (await admit(client, created["key"])).status_code == 201  # cached, no layer yet
    url = f"/v1/tenants/acme/keys/{created['id']}/policy"
    put = await client.put(url, json={"tokens_per_minute": SLOW, "token_burst": 700}, headers=admin)
    assert put.status_code == 200, put.text
    assert (put.json()["tokens_per_minute"], put.json()["token_burst"]) == (SLOW, 700)
    assert (await admit(client, created["key"])).status_code == 201  # 600 of 700
    refused = await admit(client, created["key"])
    assert refused.status_code == 429 and refused.json()["error"]["scope"] == "key"
    # A smaller burst clamps the balance; `{}` lifts every limit.
    put = await client.put(url, json={"tokens_per_minute": SLOW, "token_burst": 50}, headers=admin)
    assert (await key_layer(db, created["id"]))["tokens"] == pytest.approx(50, abs=0.05)
    lifted = await client.put(url, json={}, headers=admin)
    assert lifted.status_code == 200 and lifted.json()["token_burst"] is None
    assert (await admit(client, created["key"])).status_code == 201
    listed = (await client.get("/v1/tenants/acme/keys", headers=admin)).json()
    assert [k["token_burst"] for k in listed] == [None, None]  # make_tenant's key, this one


async def test_bad_key_limits_are_refused_and_change_nothing(
    client: httpx.AsyncClient, admin: dict[str, str], db: asyncpg.Connection
) -> None:
    await make_tenant(client, admin, "acme", tokens_per_minute=SLOW, token_burst=100_000)
    created = await key_with(client, admin, tokens_per_minute=SLOW, token_burst=1_000)
    url = f"/v1/tenants/acme/keys/{created['id']}/policy"
    for body, field in (
        ({"token_burst": 10}, "token_burst"),
        ({"tokens_per_minute": 0}, "tokens_per_minute"),
        ({"max_in_flight": -1}, "max_in_flight"),
        ({"models": []}, "models"),
        ({"models": ["bad model"]}, "models"),
        ({"tokens_per_minute": "many"}, "tokens_per_minute"),
        ({"priority": "high"}, "priority"),
    ):
        response = await client.put(url, json=body, headers=admin)
        assert response.status_code == 422, (body, response.text)
        assert field in response.text, (body, response.text)
        created_bad = await client.post("/v1/tenants/acme/keys", json=body, headers=admin)
        assert created_bad.status_code == 422, (body, created_bad.text)
    layer = await key_layer(db, created["id"])
    assert layer["tokens"] == pytest.approx(1_000, abs=0.05)
    assert await db.fetchval("SELECT count(*) FROM api_keys WHERE tenant = 'acme'") == 2
    unknown = await client.put("/v1/tenants/acme/keys/999999/policy", json={}, headers=admin)
    assert unknown.status_code == 404
    await client.delete(f"/v1/tenants/acme/keys/{created['id']}", headers=admin)
    revoked = await client.put(url, json={}, headers=admin)
    assert revoked.status_code == 404
    tenant_key = await key_with(client, admin)
    by_tenant = await client.put(url, json={}, headers=bearer(tenant_key["key"]))
    assert by_tenant.status_code == 403
    admin_limited = await client.post(
        "/v1/admin/keys", json={"tokens_per_minute": 5}, headers=admin
    )
    assert admin_limited.status_code == 422


async def test_outage_admissions_of_a_key_are_recorded_on_its_layer(
    limiter: Limiter, db: asyncpg.Connection
) -> None:
    # The sibling of admission: work a worker admitted on its own during an
    # outage is held on the key's layer when recorded, and settles from it.
    await limiter.store.put_policy(
        "tenant", "acme", None, Policy(tokens_per_minute=SLOW, token_burst=100_000)
    )
    record = await limiter.store.keys.insert(
        key_digest(new_key()),
        "acme",
        "lq_test",
        label=None,
        scopes=("admit", "read"),
        expires_at=None,
        limits=KeyLimits(tokens_per_minute=SLOW, token_burst=1_000),
    )
    assert record is not None
    layer = await key_layer(db, record.key_id)
    version = await db.fetchval("SELECT policy_version FROM limit_layers WHERE tenant = 'acme'")
    ids = [uuid.uuid4(), uuid.uuid4()]
    request = AdmitRequest(
        "acme", None, "gpt-4o", 100, 500, False, None, None, None, key_id=record.key_id
    )
    records = [OutageAdmissionRecord(i, request, int(version), "open") for i in ids]
    assert await limiter.store.outage.record_admissions(records) == [True, True]
    assert await limiter.store.outage.record_admissions(records) == [False, False]  # once
    held = await key_layer(db, record.key_id)
    assert held["tokens"] == pytest.approx(1_000 - 1_200, abs=0.05)  # no check: admitted
    assert held["in_flight"] == 2
    stored = await db.fetchval(
        "SELECT layer_ids FROM reservations WHERE reservation_id = $1", ids[0]
    )
    assert layer["layer_id"] in stored
    await limiter.store.finish(
        [FinishRequest(i, "settle", None, 100, 50, "ok") for i in ids], deadline_seconds=None
    )
    settled = await key_layer(db, record.key_id)
    assert settled["tokens"] == pytest.approx(1_000 - 300, abs=0.05)
    assert settled["in_flight"] == 0


async def test_the_books_balance_after_key_limited_traffic(
    client: httpx.AsyncClient, admin: dict[str, str], owner_dsn: str
) -> None:
    await make_tenant(client, admin, "acme", tokens_per_minute=SLOW, token_burst=100_000)
    capped = await key_with(
        client, admin, tokens_per_minute=SLOW, token_burst=3_000, max_in_flight=3
    )
    answers = await asyncio.gather(*(admit(client, capped["key"]) for _ in range(8)))
    admitted = [a.json()["reservation_id"] for a in answers if a.status_code == 201]
    assert len(admitted) == 3  # the permits bind before the tokens (3 x 600 < 3,000)
    for reservation_id in admitted:
        await client.post(
            f"/v1/reservations/{reservation_id}/settle",
            json={"input_tokens": 100, "output_tokens": 10},
            headers=bearer(capped["key"]),
        )
    assert await audit_findings(owner_dsn) == []


async def test_the_library_applies_a_keys_limits_when_told_the_key(
    limiter: Limiter, db: asyncpg.Connection
) -> None:
    await limiter.store.put_policy(
        "tenant", "acme", None, Policy(tokens_per_minute=SLOW, token_burst=100_000)
    )
    record = await limiter.store.keys.insert(
        key_digest(new_key()),
        "acme",
        "lq_test",
        label=None,
        scopes=("admit", "read"),
        expires_at=None,
        limits=KeyLimits(tokens_per_minute=SLOW, token_burst=1_000),
    )
    assert record is not None
    request = {"tenant": "acme", "model": "gpt-4o", "input_tokens": 100, "max_tokens": 500}
    held = await limiter.admit(**request, key_id=record.key_id)
    with pytest.raises(RateLimited) as refused:
        await limiter.admit(**request, key_id=record.key_id)
    assert (refused.value.limit, refused.value.scope) == ("tokens", "key")
    await limiter.admit(**request)  # without the key: the tenant's limits only
    await held.settle(input_tokens=100, output_tokens=0)
    assert (await key_layer(db, record.key_id))["tokens"] == pytest.approx(900, abs=0.05)
    with pytest.raises(InvalidRequest, match="key_id"):
        await limiter.admit(**request, key_id=0)
