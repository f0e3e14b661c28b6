"""POST /v1/admit and the reservation endpoints, through the real app and database."""

from __future__ import annotations

import time
import uuid

import asyncpg
import httpx
import pytest

from tests.api.conftest import make_tenant

# Also run on a Citus coordinator by CI's Citus leg (pyproject.toml's markers).
pytestmark = pytest.mark.citus

MESSAGES = [{"role": "user", "content": "Summarise the attached contract."}]


async def admit(
    client: httpx.AsyncClient, headers: dict[str, str], **body: object
) -> httpx.Response:
    payload: dict[str, object] = {"tenant": "acme", "model": "gpt-4o", "max_tokens": 100}
    payload.update(body)
    return await client.post("/v1/admit", json=payload, headers=headers)


async def test_admit_returns_reservation_with_counted_input_and_headers(
    client: httpx.AsyncClient, admin: dict[str, str]
) -> None:
    acme = await make_tenant(
        client,
        admin,
        "acme",
        tokens_per_minute=60_000,
        token_burst=10_000,
        requests_per_minute=600,
    )
    response = await admit(client, acme, messages=MESSAGES, max_tokens=500)
    assert response.status_code == 201, response.text
    body = response.json()
    # 3 priming + 3 framing + "user" (1) + the content counted with o200k_base.
    assert body["input_tokens"] > 7
    assert body["input_estimated"] is False
    assert body["reserved_tokens"] == body["input_tokens"] + 500
    assert body["remaining"]["tokens"] == 10_000 - body["reserved_tokens"]
    assert body["remaining"]["requests"] == 599
    assert body["remaining"]["permits"] is None
    assert body["remaining"]["in_flight"] is None  # its deprecated alias
    uuid.UUID(body["reservation_id"])
    h = response.headers
    assert h["x-ratelimit-limit-tokens"] == "60000"
    assert h["x-ratelimit-remaining-tokens"] == str(10_000 - body["reserved_tokens"])
    assert h["x-ratelimit-limit-requests"] == "600"
    assert h["x-ratelimit-remaining-requests"] == "599"
    assert h["ratelimit-policy"] == '"tokens";q=60000;w=60, "requests";q=600;w=60'
    assert h["ratelimit"].startswith(f'"tokens";r={10_000 - body["reserved_tokens"]};t=')
    assert h["x-ratelimit-reset-tokens"].endswith("s")


async def test_claude_input_is_an_estimate(
    client: httpx.AsyncClient, admin: dict[str, str]
) -> None:
    acme = await make_tenant(client, admin, "acme", tokens_per_minute=60_000)
    response = await admit(client, acme, model="claude-sonnet-4", messages=MESSAGES)
    assert response.status_code == 201
    assert response.json()["input_estimated"] is True


async def test_refusal_names_limit_scope_and_retry(
    client: httpx.AsyncClient, admin: dict[str, str]
) -> None:
    # 6,000 tokens a minute = 100 a second; capacity 1,000.
    acme = await make_tenant(client, admin, "acme", tokens_per_minute=6_000, token_burst=1_000)
    first = await admit(client, acme, input_tokens=100, max_tokens=700)
    assert first.status_code == 201
    refused = await admit(client, acme, input_tokens=100, max_tokens=700)
    assert refused.status_code == 429
    error = refused.json()["error"]
    assert refused.json()["type"] == "error"
    assert error["type"] == "rate_limit_error"
    assert error["limit"] == "tokens"
    assert error["scope"] == "tenant"
    # Deficit 600 tokens at 100/s: about 6 s (a little less: refill since the first admit).
    assert 5_000 < error["retry_after_ms"] <= 6_000
    assert refused.headers["retry-after"] == "6"
    assert refused.headers["retry-after-ms"] == str(error["retry_after_ms"])
    assert "x-ratelimit-remaining-tokens" in refused.headers


async def test_route_and_concurrency_refusals(
    client: httpx.AsyncClient, admin: dict[str, str]
) -> None:
    acme = await make_tenant(client, admin, "acme", tokens_per_minute=100_000, max_in_flight=5)
    response = await client.put(
        "/v1/tenants/acme/routes/export/policy", json={"max_in_flight": 1}, headers=admin
    )
    assert response.status_code == 200
    assert (await admit(client, acme, route="export", input_tokens=1)).status_code == 201
    refused = await admit(client, acme, route="export", input_tokens=1)
    assert refused.status_code == 429
    assert refused.json()["error"]["limit"] == "concurrency"
    assert refused.json()["error"]["scope"] == "route"
    # Another route of the same tenant is not bound by the export route's cap.
    assert (await admit(client, acme, route="chat", input_tokens=1)).status_code == 201


async def test_too_large_is_413_and_debits_nothing(
    client: httpx.AsyncClient, admin: dict[str, str], db: asyncpg.Connection
) -> None:
    acme = await make_tenant(client, admin, "acme", tokens_per_minute=6_000, token_burst=1_000)
    response = await admit(client, acme, input_tokens=400, max_tokens=5_000)
    assert response.status_code == 413
    error = response.json()["error"]
    assert error == {
        "type": "request_too_large",
        "limit": "tokens",
        "scope": "tenant",
        "requested": 5_400,
        "capacity": 1_000,
        "message": error["message"],
        "reason": "capacity",
        "priority": "normal",
        # what fits now: the burst less the same input
        "alternatives": {"max_tokens": 600, "models": []},
    }
    assert "5400" in error["message"] and "1000" in error["message"]
    assert await db.fetchval("SELECT count(*) FROM reservations") == 0
    assert await db.fetchval("SELECT tokens FROM limit_layers WHERE tenant = 'acme'") == 1_000


async def test_settle_refunds_and_is_idempotent(
    client: httpx.AsyncClient, admin: dict[str, str], db: asyncpg.Connection
) -> None:
    acme = await make_tenant(client, admin, "acme", tokens_per_minute=60, token_burst=10_000)
    reservation = (await admit(client, acme, input_tokens=200, max_tokens=800)).json()
    url = f"/v1/reservations/{reservation['reservation_id']}/settle"
    body = {"input_tokens": 200, "output_tokens": 100, "outcome": "ok"}
    first = await client.post(url, json=body, headers=acme)
    assert first.status_code == 200
    assert first.json() == {"charged_tokens": 300, "refunded_tokens": 700, "late": False}
    again = await client.post(url, json=body, headers=acme)
    assert again.status_code == 200
    assert again.json() == first.json()
    different = await client.post(url, json={**body, "output_tokens": 101}, headers=acme)
    assert different.status_code == 409
    assert different.json()["error"]["type"] == "conflict_error"
    assert await db.fetchval("SELECT count(*) FROM usage_ledger") == 1
    balance = await db.fetchval("SELECT tokens FROM limit_layers WHERE tenant = 'acme'")
    assert 9_700 <= balance <= 9_701  # 10,000 - 300 charged, plus at most a second of refill


async def test_release_and_heartbeat(client: httpx.AsyncClient, admin: dict[str, str]) -> None:
    acme = await make_tenant(client, admin, "acme", tokens_per_minute=60_000, max_in_flight=1)
    reservation = (await admit(client, acme, input_tokens=10, lease_seconds=30)).json()
    rid = reservation["reservation_id"]
    beat = await client.post(
        f"/v1/reservations/{rid}/heartbeat", json={"lease_seconds": 300}, headers=acme
    )
    assert beat.status_code == 200
    assert beat.json()["lease_generation"] == 2
    assert beat.json()["lease_expires_at"] > reservation["lease_expires_at"]
    assert (await client.post(f"/v1/reservations/{rid}/release", headers=acme)).status_code == 200
    # The permit is free again.
    assert (await admit(client, acme, input_tokens=10)).status_code == 201
    late_beat = await client.post(f"/v1/reservations/{rid}/heartbeat", headers=acme)
    assert late_beat.status_code == 409
    settle = await client.post(
        f"/v1/reservations/{rid}/settle",
        json={"input_tokens": 1, "output_tokens": 1},
        headers=acme,
    )
    assert settle.status_code == 409


async def test_unknown_reservation_is_404(client: httpx.AsyncClient, admin: dict[str, str]) -> None:
    acme = await make_tenant(client, admin, "acme", tokens_per_minute=60_000)
    rid = uuid.uuid4()
    for action, body in (
        ("settle", {"input_tokens": 1, "output_tokens": 1}),
        ("release", None),
        ("heartbeat", None),
    ):
        response = await client.post(f"/v1/reservations/{rid}/{action}", json=body, headers=acme)
        assert response.status_code == 404, (action, response.text)
        assert response.json()["error"]["type"] == "not_found_error"


async def test_idempotency_key_replays_and_conflicts(
    client: httpx.AsyncClient, admin: dict[str, str], db: asyncpg.Connection
) -> None:
    acme = await make_tenant(client, admin, "acme", tokens_per_minute=60, token_burst=10_000)
    first = await admit(client, acme, input_tokens=10, idempotency_key="job-7")
    replay = await admit(client, acme, input_tokens=10, idempotency_key="job-7")
    assert first.status_code == replay.status_code == 201
    assert replay.json()["reservation_id"] == first.json()["reservation_id"]
    conflict = await admit(client, acme, input_tokens=11, idempotency_key="job-7")
    assert conflict.status_code == 422
    assert conflict.json()["error"]["type"] == "idempotency_conflict"
    assert await db.fetchval("SELECT count(*) FROM reservations") == 1
    balance = await db.fetchval("SELECT tokens FROM limit_layers WHERE tenant = 'acme'")
    assert 9_890 <= balance <= 9_891


async def test_status_and_usage(client: httpx.AsyncClient, admin: dict[str, str]) -> None:
    # One token a second of refill: slow enough that the status shows the settlement.
    acme = await make_tenant(client, admin, "acme", tokens_per_minute=60, token_burst=1_000)
    await client.put("/v1/policies/global", json={"requests_per_minute": 1_000}, headers=admin)
    started = time.monotonic()
    reservation = (await admit(client, acme, input_tokens=50, max_tokens=150)).json()
    await client.post(
        f"/v1/reservations/{reservation['reservation_id']}/settle",
        json={"input_tokens": 50, "output_tokens": 70},
        headers=acme,
    )
    status = await client.get("/v1/tenants/acme/status", headers=acme)
    elapsed = time.monotonic() - started
    assert status.status_code == 200
    layers = {layer["scope"]: layer for layer in status.json()["layers"]}
    assert set(layers) == {"global", "tenant"}
    tenant = layers["tenant"]
    assert tenant["limits"]["token_burst"] == 1_000
    # 200 reserved, 120 used, 80 refunded: 880 left, plus what refilled since the admit.
    remaining = tenant["remaining_tokens"]
    assert 880 <= remaining <= 880 + elapsed, (remaining, elapsed)
    assert tenant["in_flight"] == 0
    # The rest of the burst at one token a second (remaining is rounded down).
    assert 1_000 - remaining - 1 <= tenant["tokens_full_in_seconds"] <= 1_000 - remaining
    # The global layer is shared: the tenant sees only whether it binds.
    shared = layers["global"]
    assert (shared["remaining_requests"], shared["in_flight"], shared["limits"]) == (None,) * 3
    assert (shared["binding"], shared["retry_after_ms"]) == (False, None)
    as_admin = await client.get("/v1/tenants/acme/status", headers=admin)
    full = {layer["scope"]: layer for layer in as_admin.json()["layers"]}["global"]
    # One request taken of 1,000; at 16.7 a second it may have refilled already.
    assert full["remaining_requests"] in (999, 1_000)
    assert full["binding"] is False
    usage = await client.get("/v1/tenants/acme/usage", headers=acme)
    assert usage.status_code == 200
    assert usage.json()["requests"] == 1
    assert usage.json()["input_tokens"] == 50
    assert usage.json()["output_tokens"] == 70
    empty = await client.get(
        "/v1/tenants/acme/usage",
        params={"from": "2020-01-01T00:00:00Z", "to": "2020-02-01T00:00:00Z"},
        headers=acme,
    )
    assert empty.json()["requests"] == 0


async def test_unknown_tenant_is_404(client: httpx.AsyncClient, admin: dict[str, str]) -> None:
    response = await admit(client, admin, tenant="ghost", input_tokens=1)
    assert response.status_code == 404
    assert "ghost" in response.json()["error"]["message"]


async def test_health_metrics_and_docs(client: httpx.AsyncClient, admin: dict[str, str]) -> None:
    acme = await make_tenant(client, admin, "acme", tokens_per_minute=6_000, token_burst=100)
    await admit(client, acme, input_tokens=10, max_tokens=10)
    await admit(client, acme, input_tokens=100, max_tokens=10)
    assert (await client.get("/healthz")).json() == {"status": "ok"}
    metrics = (await client.get("/metrics")).text
    assert "llmquota_admits_total 1.0" in metrics
    assert 'llmquota_denials_total{limit="tokens",reason="too_large",scope="tenant"} 1.0' in metrics
    assert "llmquota_decision_seconds_bucket" in metrics
    assert (await client.get("/docs")).status_code == 200
    assert "/v1/admit" in (await client.get("/openapi.json")).json()["paths"]


async def test_usage_up_to_a_moment_near_year_one_is_answered(
    client: httpx.AsyncClient, admin: dict[str, str]
) -> None:
    """The default 30-day window before `to` stops at year 1 instead of overflowing."""
    await make_tenant(client, admin, "acme", tokens_per_minute=6_000)
    usage = await client.get(
        "/v1/tenants/acme/usage", params={"to": "0001-01-05T00:00:00Z"}, headers=admin
    )
    assert usage.status_code == 200, usage.text
    assert usage.json()["requests"] == 0
    assert usage.json()["from"].startswith("0001-01-01")


async def test_max_wait_ms_over_the_cap_is_422_naming_the_field(
    client: httpx.AsyncClient, admin: dict[str, str]
) -> None:
    acme = await make_tenant(client, admin, "acme", tokens_per_minute=60_000)
    body = {"tenant": "acme", "model": "gpt-4o", "input_tokens": 1, "max_tokens": 1}

    over = await client.post("/v1/admit", json={**body, "max_wait_ms": 30_001}, headers=acme)
    at_cap = await client.post("/v1/admit", json={**body, "max_wait_ms": 30_000}, headers=acme)

    assert over.status_code == 422
    assert over.json()["error"]["message"].startswith("max_wait_ms: at most 30000")
    # Room now: a request that may wait is admitted at once, without waiting.
    assert at_cap.status_code == 201
    assert "llmquota-waited-ms" not in at_cap.headers


async def test_a_sharded_global_policy_reads_whole_and_refuses_what_it_cannot_split(
    client: httpx.AsyncClient, admin: dict[str, str], db: asyncpg.Connection
) -> None:
    # 60 tokens a minute: one a second of refill while the test runs.
    body = {
        "tokens_per_minute": 60,
        "token_burst": 1_001,
        "requests_per_minute": 60,
        "request_burst": 9,
        "shards": 4,
    }
    put = await client.put("/v1/policies/global", json=body, headers=admin)
    assert put.status_code == 200, put.text
    assert (put.json()["token_burst"], put.json()["request_burst"], put.json()["shards"]) == (
        1_001,
        9,
        4,
    )
    shares = await db.fetch(
        "SELECT token_burst, request_burst FROM limit_layers WHERE scope = 'global' ORDER BY shard"
    )
    assert [tuple(r) for r in shares] == [(251, 3), (250, 2), (250, 2), (250, 2)]

    too_many = {"token_burst": 3, "tokens_per_minute": 60, "shards": 4}
    refused = await client.put("/v1/policies/global", json=too_many, headers=admin)
    assert refused.status_code == 422
    assert "token_burst 3 cannot be split over 4 shards" in refused.json()["error"]["message"]
    capped = await client.put(
        "/v1/policies/global", json={"max_in_flight": 8, "shards": 2}, headers=admin
    )
    assert capped.status_code == 422
    assert "no max_in_flight" in capped.json()["error"]["message"]
    on_a_tenant = await client.put("/v1/tenants/acme/policy", json={"shards": 2}, headers=admin)
    assert on_a_tenant.status_code == 422
    assert "only the global policy" in on_a_tenant.json()["error"]["message"]
    assert (await client.get("/v1/policies/global", headers=admin)).json()["shards"] == 4
    # A body without shards keeps the count, and is checked against it.
    kept = await client.put("/v1/policies/global", json={"max_in_flight": 8}, headers=admin)
    assert kept.status_code == 422
    assert "no max_in_flight" in kept.json()["error"]["message"]
    assert (await client.get("/v1/policies/global", headers=admin)).json()["token_burst"] == 1_001

    acme = await make_tenant(client, admin, "acme")
    started = time.monotonic()
    admitted = await admit(client, acme, input_tokens=600, max_tokens=0)  # more than a shard
    assert admitted.status_code == 201, admitted.text
    status = await client.get("/v1/tenants/acme/status", headers=admin)
    elapsed = time.monotonic() - started
    layers = {layer["scope"]: layer for layer in status.json()["layers"]}
    assert layers["global"]["limits"]["token_burst"] == 1_001
    # The whole layer, pooled over its shards: 1,001 - 600, plus a token a second since.
    remaining = layers["global"]["remaining_tokens"]
    assert 401 <= remaining <= 401 + elapsed, (remaining, elapsed)


async def test_remaining_permits_count_free_permits_and_status_in_flight_counts_held(
    client: httpx.AsyncClient, admin: dict[str, str]
) -> None:
    acme = await make_tenant(client, admin, "acme", tokens_per_minute=60_000, max_in_flight=3)
    for held in (1, 2):
        response = await admit(client, acme, input_tokens=10)
        assert response.status_code == 201, response.text
        body = response.json()
        assert body["remaining"]["permits"] == 3 - held
        assert body["remaining"]["in_flight"] == 3 - held  # the deprecated alias: the same
    status = (await client.get("/v1/tenants/acme/status", headers=admin)).json()
    (tenant,) = [layer for layer in status["layers"] if layer["scope"] == "tenant"]
    assert tenant["in_flight"] == 2  # held, as everywhere but `remaining`
    schema = (await client.get("/openapi.json")).json()["components"]["schemas"]["Remaining"]
    assert schema["properties"]["in_flight"]["deprecated"] is True
