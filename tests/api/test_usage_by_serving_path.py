"""GET /v1/tenants/{tenant}/usage broken down by serving path (issue 23).

The totals stay as they were; `by_serving_path` says the same per path, for
the paths with rows only. A row without a path (an adjustment, a row older
than revision 0026) counts as primary, so the paths add up to the totals.
"""

from __future__ import annotations

import uuid

import asyncpg
import httpx

from tests.api.conftest import make_tenant

# A response cache hit as sql/cache.sql writes it: 0 tokens, an id of its own.
CACHE_HIT = (
    "INSERT INTO usage_ledger (reservation_id, entry_kind, tenant, model, input_tokens,"
    " output_tokens, reserved_tokens, outcome, serving_path, saved_input_tokens,"
    " saved_output_tokens, price_usd)"
    " VALUES ($1, 'usage', 'acme', 'gpt-4o', 0, 0, 0, 'ok', 'cache', 300, 400, NULL)"
)
# A row without a path: an adjustment (as `llmquota ledger adjust` writes it).
ADJUSTMENT = "SELECT * FROM lq_ledger_adjust('acme', NULL, 'gpt-4o', 5, 0, 'provider recount')"


async def test_usage_by_serving_path(
    client: httpx.AsyncClient, admin: dict[str, str], db: asyncpg.Connection
) -> None:
    # 100 tokens a second, a burst of 1,000.
    acme = await make_tenant(client, admin, "acme", tokens_per_minute=6_000, token_burst=1_000)

    async def admit(**body: object) -> str:
        payload = {"tenant": "acme", "model": "gpt-4o", **body}
        answer = await client.post("/v1/admit", json=payload, headers=acme)
        assert answer.status_code == 201, answer.text
        return str(answer.json()["reservation_id"])

    async def settle(reservation_id: str, input_tokens: int, output_tokens: int) -> None:
        body = {"input_tokens": input_tokens, "output_tokens": output_tokens}
        url = f"/v1/reservations/{reservation_id}/settle"
        assert (await client.post(url, json=body, headers=acme)).status_code == 200

    plain = await admit(input_tokens=50, max_tokens=150)
    await settle(plain, 50, 70)
    # The other 800 of the burst held: a 100-token request waits about a second.
    held = await admit(input_tokens=0, max_tokens=800)
    waited = await admit(input_tokens=10, max_tokens=90, max_wait_ms=10_000)
    await settle(waited, 10, 20)
    assert (await client.post(f"/v1/reservations/{held}/release", headers=acme)).status_code == 200
    await db.execute(CACHE_HIT, uuid.uuid4())
    await db.execute(ADJUSTMENT)

    usage = await client.get("/v1/tenants/acme/usage", headers=acme)
    assert usage.status_code == 200, usage.text
    body = usage.json()
    # requests: the two settled and the hit (an adjustment is no request).
    assert (body["requests"], body["input_tokens"], body["output_tokens"]) == (3, 65, 90)
    assert body["by_serving_path"] == {
        "primary": {
            "requests": 1,
            "input_tokens": 55,
            "output_tokens": 70,
            "saved_input_tokens": 0,
            "saved_output_tokens": 0,
        },
        "queued": {
            "requests": 1,
            "input_tokens": 10,
            "output_tokens": 20,
            "saved_input_tokens": 0,
            "saved_output_tokens": 0,
        },
        "cache": {
            "requests": 1,
            "input_tokens": 0,
            "output_tokens": 0,
            "saved_input_tokens": 300,
            "saved_output_tokens": 400,
        },
    }

    empty = await client.get(
        "/v1/tenants/acme/usage",
        params={"from": "2020-01-01T00:00:00Z", "to": "2020-02-01T00:00:00Z"},
        headers=acme,
    )
    assert empty.json()["requests"] == 0
    assert empty.json()["by_serving_path"] == {}


async def test_the_openapi_document_names_the_paths(client: httpx.AsyncClient) -> None:
    schemas = (await client.get("/openapi.json")).json()["components"]["schemas"]
    by_path = schemas["UsageResponse"]["properties"]["by_serving_path"]
    assert by_path["propertyNames"]["enum"] == [
        "primary",
        "cache",
        "fallback_model",
        "queued",
        "second_deployment",
    ]
    assert by_path["additionalProperties"]["$ref"].endswith("/PathUsageResponse")
    assert "by_serving_path" in schemas["UsageResponse"]["required"]
