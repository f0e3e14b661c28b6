"""The binding token layer's X-TokenLimit-* headers, and POST /v1/tokens/count.

Through the real app and database. The headers' numbers are checked against
the layer rows themselves: an admission writes its layers at the moment it
decides (tokens and refilled_at), so after a 201 the binding layer's balance
is read back exactly; a refusal writes nothing, so after a 429 its balance is
bounded by the refill of the time the test took.
"""

from __future__ import annotations

import math
import time
from typing import Any

import asyncpg
import httpx
import pytest
from fastapi import FastAPI

from llmquota.api.app import create_app
from llmquota.config import Settings
from llmquota.domain.output_estimates import bucket_of, bucket_top
from tests.api.conftest import ADMIN_KEY, make_tenant, settle_samples
from tests.api.test_admission_api import admit

ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
MESSAGES = [{"role": "user", "content": "Summarise the attached contract, clause by clause."}]
LEARNED = {"strategy": "learned", "quantile": 0.9, "min_samples": 10}


async def count(
    client: httpx.AsyncClient, headers: dict[str, str], **body: object
) -> httpx.Response:
    payload: dict[str, object] = {"tenant": "acme", "model": "gpt-4o", "max_tokens": 100}
    payload.update(body)
    return await client.post("/v1/tokens/count", json=payload, headers=headers)


async def layer(db: asyncpg.Connection, scope: str, route: str | None = None) -> asyncpg.Record:
    """A layer's row as stored: its policy, balance and when it was last written."""
    row = await db.fetchrow(
        "SELECT tokens_per_minute, token_burst, tokens, refilled_at FROM limit_layers"
        " WHERE scope = $1 AND tenant = 'acme' AND route IS NOT DISTINCT FROM $2",
        scope,
        route,
    )
    assert row is not None
    return row


def token_limit(response: httpx.Response) -> tuple[int, int, int]:
    h = response.headers
    return (
        int(h["x-tokenlimit-limit"]),
        int(h["x-tokenlimit-remaining"]),
        int(h["x-tokenlimit-reset"]),
    )


def until_full(balance: float, burst: int, per_minute: int) -> int:
    """Whole seconds until a bucket at `balance` is full at its refill rate."""
    return math.ceil(max(0.0, burst - balance) * 60 / per_minute)


async def test_an_admission_names_the_layer_with_the_least_left(
    client: httpx.AsyncClient, admin: dict[str, str], db: asyncpg.Connection
) -> None:
    # The tenant layer: 600 a minute, burst 10,000. Its route "chat": 60 a
    # minute, burst 2,000: after 1,000 tokens the route has less left.
    acme = await make_tenant(
        client, admin, "acme", tokens_per_minute=600, token_burst=10_000, requests_per_minute=600
    )
    route = await client.put(
        "/v1/tenants/acme/routes/chat/policy",
        json={"tokens_per_minute": 60, "token_burst": 2_000},
        headers=admin,
    )
    assert route.status_code == 200, route.text

    on_tenant = await admit(client, acme, input_tokens=200, max_tokens=300)
    assert on_tenant.status_code == 201, on_tenant.text
    tenant = await layer(db, "tenant")
    assert token_limit(on_tenant) == (
        10_000,
        math.floor(tenant["tokens"]),
        until_full(tenant["tokens"], 10_000, 600),
    )
    assert token_limit(on_tenant)[1] == 10_000 - 500  # a full bucket, less the reservation

    on_route = await admit(client, acme, route="chat", input_tokens=200, max_tokens=800)
    assert on_route.status_code == 201, on_route.text
    tenant, chat = await layer(db, "tenant"), await layer(db, "route", "chat")
    assert tenant["tokens"] > chat["tokens"]  # 8,500 and a little refill against 1,000
    limit, remaining, reset = token_limit(on_route)
    assert (limit, remaining, reset) == (
        2_000,
        math.floor(chat["tokens"]),
        until_full(chat["tokens"], 2_000, 60),
    )
    assert remaining == 1_000 == on_route.json()["remaining"]["tokens"]
    assert reset == 1_000  # 1,000 tokens at one a second
    # The OpenAI and IETF headers still describe the tenant layer.
    assert on_route.headers["x-ratelimit-limit-tokens"] == "600"
    assert on_route.headers["x-ratelimit-remaining-tokens"] == str(math.floor(tenant["tokens"]))


async def test_a_429_names_the_layer_that_refused(
    client: httpx.AsyncClient, admin: dict[str, str], db: asyncpg.Connection
) -> None:
    # One token a second, burst 1,000.
    acme = await make_tenant(client, admin, "acme", tokens_per_minute=60, token_burst=1_000)
    started = time.monotonic()
    first = await admit(client, acme, input_tokens=100, max_tokens=700)
    assert first.status_code == 201, first.text
    after_first = (await layer(db, "tenant"))["tokens"]
    refused = await admit(client, acme, input_tokens=100, max_tokens=700)
    elapsed = time.monotonic() - started
    assert refused.status_code == 429, refused.text
    assert refused.json()["error"]["scope"] == "tenant"
    # Refused, not debited: the balance then was the first one's, refilled at
    # one token a second for at most the time this test took.
    assert (await layer(db, "tenant"))["tokens"] == after_first  # a refusal writes nothing
    highest = after_first + elapsed * 60 / 60
    limit, remaining, reset = token_limit(refused)
    assert limit == 1_000
    assert math.floor(after_first) == 200
    assert math.floor(after_first) <= remaining <= math.floor(highest)
    assert until_full(highest, 1_000, 60) <= reset <= until_full(after_first, 1_000, 60)
    assert reset <= until_full(remaining, 1_000, 60)
    assert 799 <= reset <= 800 or elapsed > 1
    # Beside the retry hints and the tenant layer's headers, as before.
    assert int(refused.headers["retry-after"]) >= 1
    assert refused.headers["x-ratelimit-limit-tokens"] == "60"


async def test_a_413_names_the_layer_too_small_not_the_one_with_least_left(
    client: httpx.AsyncClient, admin: dict[str, str], db: asyncpg.Connection
) -> None:
    acme = await make_tenant(client, admin, "acme", tokens_per_minute=60, token_burst=10_000)
    route = await client.put(
        "/v1/tenants/acme/routes/small/policy",
        json={"tokens_per_minute": 60, "token_burst": 500},
        headers=admin,
    )
    assert route.status_code == 200, route.text
    drained = await admit(client, acme, input_tokens=9_000, max_tokens=700)
    assert drained.status_code == 201, drained.text
    assert token_limit(drained)[:2] == (10_000, 300)
    # 600 tokens: more than the route's whole burst (it can never fit there),
    # although the tenant layer, with 300 left, has less.
    refused = await admit(client, acme, route="small", input_tokens=100, max_tokens=500)
    assert refused.status_code == 413, refused.text
    assert refused.json()["error"]["scope"] == "route"
    assert token_limit(refused) == (500, 500, 0)


async def _put(client: httpx.AsyncClient, path: str, body: Any) -> None:
    response = await client.put(path, json=body, headers=ADMIN)
    assert response.status_code == 200, response.text


async def _nothing_held(db: asyncpg.Connection) -> tuple[int, int]:
    reservations = await db.fetchval("SELECT count(*) FROM reservations")
    ledger = await db.fetchval("SELECT count(*) FROM usage_ledger")
    return reservations, ledger


def refilled(row: asyncpg.Record, at: Any) -> float:
    """A layer's balance at `at`, refilled since it was written (lq_refilled)."""
    seconds = max(0.0, (at - row["refilled_at"]).total_seconds())
    return float(min(row["token_burst"], row["tokens"] + seconds * row["tokens_per_minute"] / 60))


async def _layers(db: asyncpg.Connection, route: str | None) -> list[asyncpg.Record]:
    return [await layer(db, "tenant")] + ([await layer(db, "route", route)] if route else [])


async def _count_then_admit(
    client: httpx.AsyncClient, key: dict[str, str], db: asyncpg.Connection, **body: Any
) -> dict[str, Any]:
    """Count `body`, check nothing moved, admit it, and check the admission reserved
    and debited exactly the count; returns the count."""
    before = await _layers(db, body.get("route"))
    held = await _nothing_held(db)
    counted = await count(client, key, **body)
    assert counted.status_code == 200, counted.text
    answer: dict[str, Any] = counted.json()
    # Nothing reserved, nothing written: no bucket row touched (not even its
    # refill stamp), no reservation, no ledger row.
    assert await _layers(db, body.get("route")) == before
    assert await _nothing_held(db) == held

    admitted = await admit(client, key, **body)
    assert admitted.status_code == 201, admitted.text
    reservation = admitted.json()
    for field in ("input_tokens", "input_estimated", "reserved_tokens", "output_estimate"):
        assert answer[field] == reservation[field], field
    stored = await db.fetchval(
        "SELECT reserved_tokens FROM reservations WHERE reservation_id = $1::uuid",
        reservation["reservation_id"],
    )
    assert stored == answer["reserved_tokens"]
    # Each layer's debit: its balance refilled to the admission's moment, less what it holds now.
    for was, now in zip(before, await _layers(db, body.get("route")), strict=True):
        debit = refilled(was, now["refilled_at"]) - now["tokens"]
        assert debit == pytest.approx(answer["reserved_tokens"], abs=1e-6)
    released = await client.post(
        f"/v1/reservations/{reservation['reservation_id']}/release", headers=key
    )
    assert released.status_code == 200, released.text
    return answer


async def test_a_count_is_what_the_next_admission_reserves_and_holds_nothing(
    served: tuple[httpx.AsyncClient, FastAPI], db: asyncpg.Connection
) -> None:
    client, app = served
    # A plan's learned estimate, a route's fixed one: the policies admission reads.
    await _put(client, "/v1/plans/pro", {"tokens_per_minute": 90_000, "output_estimate": LEARNED})
    await _put(client, "/v1/tenants/acme/policy", {"plan": "pro"})
    await _put(
        client,
        "/v1/tenants/acme/routes/tiny/policy",
        {"tokens_per_minute": 60_000, "output_estimate": {"strategy": "fixed", "tokens": 32}},
    )
    created = await client.post("/v1/tenants/acme/keys", headers=ADMIN)
    key = {"Authorization": f"Bearer {created.json()['key']}"}
    await app.state.limiter.refresh_policies()

    cold = await _count_then_admit(client, key, db, input_tokens=20, max_tokens=1_000)
    assert cold["output_estimate"] == {"strategy": "max_tokens", "tokens": 1_000}
    assert cold["reserved_tokens"] == 1_020
    counted = await _count_then_admit(client, key, db, messages=MESSAGES, max_tokens=300)
    assert counted["input_tokens"] > 7 and counted["input_estimated"] is False
    assert counted["reserved_tokens"] == counted["input_tokens"] + 300
    claude = await _count_then_admit(
        client, key, db, model="claude-sonnet-4", messages=MESSAGES, max_tokens=300
    )
    assert claude["input_estimated"] is True

    await settle_samples(client, key, 10)
    await app.state.limiter.estimates.refresh()
    learned = bucket_top(bucket_of(250))
    warm = await _count_then_admit(client, key, db, input_tokens=20, max_tokens=1_000)
    assert warm["output_estimate"] == {"strategy": "learned", "tokens": learned}
    assert warm["reserved_tokens"] == 20 + learned
    capped = await _count_then_admit(client, key, db, input_tokens=20, max_tokens=100)
    assert capped["output_estimate"] == {"strategy": "learned", "tokens": 100}
    fixed = await _count_then_admit(client, key, db, route="tiny", input_tokens=20)
    assert fixed["output_estimate"] == {"strategy": "fixed", "tokens": 32}
    assert fixed["reserved_tokens"] == 52


async def test_a_count_refuses_what_admit_refuses_with_the_same_error(
    client: httpx.AsyncClient, admin: dict[str, str]
) -> None:
    acme = await make_tenant(client, admin, "acme", tokens_per_minute=6_000)
    other = await make_tenant(client, admin, "other", tokens_per_minute=6_000)
    base: dict[str, Any] = {"tenant": "acme", "model": "gpt-4o", "max_tokens": 10}
    cases: list[tuple[dict[str, str], dict[str, Any], int]] = [
        (admin, {**base, "tenant": "ghost", "input_tokens": 5}, 404),  # unknown tenant
        (other, {**base, "input_tokens": 5}, 403),  # another tenant's key
        ({}, {**base, "input_tokens": 5}, 401),
        (acme, {"tenant": "acme", "model": "gpt-4o", "input_tokens": 5}, 422),  # no max_tokens
        (acme, {**base, "input_tokens": 5, "messages": MESSAGES}, 422),  # both inputs
        (acme, base, 422),  # neither
        (acme, {**base, "messages": [{"role": 5, "content": "x"}]}, 422),
        (acme, {**base, "input_tokens": 5, "max_wait_ms": 10**9}, 422),  # past the cap
        (acme, {**base, "input_tokens": -1}, 422),
        (acme, {**base, "input_tokens": 5, "unknown": 1}, 422),
    ]
    for headers, body, status in cases:
        admitted = await client.post("/v1/admit", json=body, headers=headers)
        counted = await client.post("/v1/tokens/count", json=body, headers=headers)
        assert (admitted.status_code, counted.status_code) == (status, status), (body, counted.text)
        assert counted.json()["error"] == admitted.json()["error"], body
    suspended = await client.post("/v1/tenants/acme/suspend", headers=admin)
    assert suspended.status_code == 200, suspended.text
    body = {**base, "input_tokens": 5}
    admitted = await client.post("/v1/admit", json=body, headers=admin)
    counted = await client.post("/v1/tokens/count", json=body, headers=admin)
    assert admitted.status_code == counted.status_code == 403, counted.text
    assert counted.json()["error"] == admitted.json()["error"]


def test_the_count_endpoint_is_in_the_openapi_document(app_dsn: str) -> None:
    settings = Settings(admin_key=ADMIN_KEY, _env_file=None)  # type: ignore[call-arg]
    document = create_app(settings, dsn=app_dsn).openapi()
    operation = document["paths"]["/v1/tokens/count"]["post"]
    body = operation["requestBody"]["content"]["application/json"]["schema"]
    assert body == {"$ref": "#/components/schemas/AdmitBody"}
    answer = operation["responses"]["200"]["content"]["application/json"]["schema"]
    assert answer == {"$ref": "#/components/schemas/CountResponse"}
    fields = document["components"]["schemas"]["CountResponse"]["required"]
    assert set(fields) == {"input_tokens", "input_estimated", "reserved_tokens", "output_estimate"}
    assert {"401", "403", "404", "422", "503"} <= set(operation["responses"])
