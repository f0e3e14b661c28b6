"""Keys, tenant isolation, policies and bad input: clear errors, no state change."""

from __future__ import annotations

import hashlib

import asyncpg
import httpx
import pytest

from tests.api.conftest import make_tenant


async def _state(db: asyncpg.Connection) -> tuple[object, ...]:
    """Everything a bad request must leave untouched."""
    return (
        await db.fetchval("SELECT count(*) FROM reservations"),
        await db.fetchval("SELECT count(*) FROM usage_ledger"),
        tuple(await db.fetch("SELECT layer_id, tokens, requests, in_flight FROM limit_layers")),
    )


async def test_missing_or_wrong_key_is_401_without_hint(client: httpx.AsyncClient) -> None:
    for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": "Basic abc"}):
        response = await client.post("/v1/admit", json={}, headers=headers)
        assert response.status_code == 401
        assert response.json()["error"] == {
            "type": "authentication_error",
            "message": "missing or invalid API key",
        }
        assert response.headers["www-authenticate"] == "Bearer"


async def test_keys_are_stored_hashed(
    client: httpx.AsyncClient, admin: dict[str, str], db: asyncpg.Connection
) -> None:
    headers = await make_tenant(client, admin, "acme", tokens_per_minute=1_000)
    key = headers["Authorization"].removeprefix("Bearer ")
    stored = await db.fetch("SELECT key_hash FROM api_keys WHERE tenant = 'acme'")
    assert [row["key_hash"] for row in stored] == [hashlib.sha256(key.encode()).digest()]
    assert key.encode() not in stored[0]["key_hash"]


async def test_tenant_key_is_confined_to_its_tenant(
    client: httpx.AsyncClient, admin: dict[str, str], db: asyncpg.Connection
) -> None:
    acme = await make_tenant(client, admin, "acme", tokens_per_minute=10_000)
    other = await make_tenant(client, admin, "other", tokens_per_minute=10_000)
    mine = await client.post(
        "/v1/admit",
        json={"tenant": "acme", "model": "gpt-4o", "input_tokens": 5, "max_tokens": 5},
        headers=acme,
    )
    rid = mine.json()["reservation_id"]
    before = await _state(db)
    forbidden = await client.post(
        "/v1/admit",
        json={"tenant": "acme", "model": "gpt-4o", "input_tokens": 5, "max_tokens": 5},
        headers=other,
    )
    assert forbidden.status_code == 403
    for action, body in (
        ("settle", {"input_tokens": 1, "output_tokens": 1}),
        ("release", None),
        ("heartbeat", None),
    ):
        response = await client.post(f"/v1/reservations/{rid}/{action}", json=body, headers=other)
        assert response.status_code == 404, action
    assert (await client.get("/v1/tenants/acme/status", headers=other)).status_code == 403
    assert (await client.get("/v1/tenants/acme/usage", headers=other)).status_code == 403
    assert (await client.put("/v1/policies/global", json={}, headers=acme)).status_code == 403
    assert (await client.post("/v1/tenants/acme/keys", headers=acme)).status_code == 403
    assert await _state(db) == before


async def test_policy_round_trip_and_defaults(
    client: httpx.AsyncClient, admin: dict[str, str]
) -> None:
    put = await client.put(
        "/v1/tenants/acme/policy",
        json={"tokens_per_minute": 100_000, "requests_per_minute": 400, "max_in_flight": 8},
        headers=admin,
    )
    assert put.status_code == 200
    got = await client.get("/v1/tenants/acme/policy", headers=admin)
    assert got.json() == {
        "tokens_per_minute": 100_000,
        "token_burst": 100_000,
        "requests_per_minute": 400,
        "request_burst": 400,
        "max_in_flight": 8,
        "lease_seconds": 120,
        "failure_mode": "closed",
        "policy_version": put.json()["policy_version"],
        "plan": None,
        "fallback_models": [],
        "prepaid": False,
        "output_estimate": None,
        "shards": 1,
        "request_cost": None,
        "uses_concurrency": None,
        "cache": None,
        "admission": None,
    }
    route = await client.put(
        "/v1/tenants/acme/routes/chat/policy",
        json={"token_burst": 5, "tokens_per_minute": 60},
        headers=admin,
    )
    assert route.status_code == 200
    assert route.json()["policy_version"] > put.json()["policy_version"]
    assert (await client.get("/v1/tenants/ghost/policy", headers=admin)).status_code == 404
    ghost_route = await client.put(
        "/v1/tenants/ghost/routes/chat/policy", json={"max_in_flight": 1}, headers=admin
    )
    assert ghost_route.status_code == 404


@pytest.mark.parametrize(
    "policy",
    [
        {"tokens_per_minute": -1},
        {"tokens_per_minute": 0},
        {"tokens_per_minute": 1.5},
        {"tokens_per_minute": "100"},
        {"tokens_per_minute": True},
        {"token_burst": 100},
        {"max_in_flight": 0},
        {"lease_seconds": 0},
        {"lease_seconds": 10**9},
        {"tokens_per_minute": 10**30},
        {"unknown_field": 1},
    ],
)
async def test_bad_policy_is_422_and_changes_nothing(
    client: httpx.AsyncClient,
    admin: dict[str, str],
    db: asyncpg.Connection,
    policy: dict[str, object],
) -> None:
    await make_tenant(client, admin, "acme", tokens_per_minute=1_000)
    before = await _state(db)
    response = await client.put("/v1/tenants/acme/policy", json=policy, headers=admin)
    assert response.status_code == 422, response.text
    assert response.json()["error"]["type"] == "invalid_request_error"
    assert await _state(db) == before
    stored = await client.get("/v1/tenants/acme/policy", headers=admin)
    assert stored.json()["tokens_per_minute"] == 1_000


BAD_ADMIT_BODIES = [
    '{"tenant": "acme", "model": "gpt-4o", "input_tokens": -1, "max_tokens": 5}',
    '{"tenant": "acme", "model": "gpt-4o", "input_tokens": 10000001, "max_tokens": 5}',
    '{"tenant": "acme", "model": "gpt-4o", "input_tokens": 1.5, "max_tokens": 5}',
    '{"tenant": "acme", "model": "gpt-4o", "input_tokens": NaN, "max_tokens": 5}',
    '{"tenant": "acme", "model": "gpt-4o", "input_tokens": Infinity, "max_tokens": 5}',
    '{"tenant": "acme", "model": "gpt-4o", "input_tokens": 1e400, "max_tokens": 5}',
    '{"tenant": "acme", "model": "gpt-4o", "input_tokens": "5", "max_tokens": 5}',
    '{"tenant": "acme", "model": "gpt-4o", "input_tokens": 5, "max_tokens": -5}',
    '{"tenant": "acme", "model": "gpt-4o", "input_tokens": 5}',
    '{"tenant": "acme", "model": "gpt-4o", "max_tokens": 5}',
    '{"tenant": "acme", "model": "gpt-4o", "input_tokens": 5, "messages": [], "max_tokens": 5}',
    '{"tenant": "acme", "model": "gpt-4o", "messages": "hi", "max_tokens": 5}',
    '{"tenant": "acme", "model": "gpt-4o", "messages": [{"role": 5}], "max_tokens": 5}',
    '{"tenant": "ac me", "model": "gpt-4o", "input_tokens": 5, "max_tokens": 5}',
    '{"tenant": "acme", "route": "a/b", "model": "gpt-4o", "input_tokens": 5, "max_tokens": 5}',
    '{"tenant": "acme", "model": "", "input_tokens": 5, "max_tokens": 5}',
    '{"tenant": "acme", "model": "gpt-4o", "input_tokens": 5, "max_tokens": 5, "lease_seconds": 0}',
    '{"tenant": "acme", "model": "gpt-4o", "input_tokens": 5, "max_tokens": 5, "extra": 1}',
    '{"tenant": "acme", "model": "gpt-4o", "input_tokens": 5, "max_tokens": 5',
    "[]",
    "",
    "not json",
]


@pytest.mark.parametrize("raw", BAD_ADMIT_BODIES)
async def test_bad_admit_body_is_refused_clearly_and_changes_nothing(
    client: httpx.AsyncClient, admin: dict[str, str], db: asyncpg.Connection, raw: str
) -> None:
    acme = await make_tenant(client, admin, "acme", tokens_per_minute=100_000)
    before = await _state(db)
    response = await client.post(
        "/v1/admit", content=raw, headers={**acme, "content-type": "application/json"}
    )
    assert response.status_code in (400, 422), response.text
    assert response.json()["type"] == "error"
    assert response.json()["error"]["message"]
    assert await _state(db) == before


@pytest.mark.parametrize(
    "body",
    [
        {"input_tokens": -1, "output_tokens": 1},
        {"input_tokens": 1, "output_tokens": 10_000_001},
        {"input_tokens": 1.5, "output_tokens": 1},
        {"input_tokens": 1, "output_tokens": 1, "outcome": "maybe"},
        {"input_tokens": 1},
    ],
)
async def test_bad_settle_body_is_422_and_changes_nothing(
    client: httpx.AsyncClient,
    admin: dict[str, str],
    db: asyncpg.Connection,
    body: dict[str, object],
) -> None:
    acme = await make_tenant(client, admin, "acme", tokens_per_minute=100_000)
    rid = (
        await client.post(
            "/v1/admit",
            json={"tenant": "acme", "model": "gpt-4o", "input_tokens": 5, "max_tokens": 5},
            headers=acme,
        )
    ).json()["reservation_id"]
    before = await _state(db)
    response = await client.post(f"/v1/reservations/{rid}/settle", json=body, headers=acme)
    assert response.status_code == 422
    assert await _state(db) == before


async def test_malformed_reservation_id_is_422(
    client: httpx.AsyncClient, admin: dict[str, str]
) -> None:
    response = await client.post("/v1/reservations/not-a-uuid/release", headers=admin)
    assert response.status_code == 422


async def test_oversized_body_is_413_before_parsing(
    client: httpx.AsyncClient, admin: dict[str, str], db: asyncpg.Connection
) -> None:
    acme = await make_tenant(client, admin, "acme", tokens_per_minute=100_000)
    before = await _state(db)
    huge = (
        '{"tenant": "acme", "model": "gpt-4o", "max_tokens": 5, "messages": ['
        + ('{"role": "user", "content": "' + "x" * 1_000 + '"},') * 1_100
        + "]}"
    )
    response = await client.post(
        "/v1/admit", content=huge, headers={**acme, "content-type": "application/json"}
    )
    assert response.status_code == 413
    assert response.json()["error"]["type"] == "payload_too_large"

    async def chunks() -> object:
        for _ in range(1_200):
            yield b"x" * 1_000

    chunked = await client.post(
        "/v1/admit", content=chunks(), headers={**acme, "content-type": "application/json"}
    )
    assert chunked.status_code == 413
    assert await _state(db) == before
