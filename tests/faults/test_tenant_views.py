"""A tenant sees only its own figures: the shared layer says whether it binds, nothing more.

The global layer is shared by every tenant, so its balances and in-flight
count are other customers' traffic. Through a real uvicorn server: another
tenant's admission empties the global layer, and the tenant's status says
the layer binds it and when to retry (which the store's own refusal then
confirms), without a figure of the layer; the admin key sees every figure.
"""

from __future__ import annotations

from typing import Any

import httpx

from llmquota.config import Settings
from tests.faults.conftest import fault_settings, serving

ADMIN_KEY = "lq_views_admin_key_0123456789"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
# The global layer refills one request every 10 s and holds one.
GLOBAL = {"requests_per_minute": 6, "request_burst": 1}
REFILL_MS = 10_000
CONCURRENCY_RETRY_MS = 1_000
FIGURES = (
    "limits",
    "remaining_tokens",
    "remaining_requests",
    "allotted_tokens",
    "allotted_requests",
    "in_flight",
    "tokens_full_in_seconds",
    "requests_full_in_seconds",
)


async def key_of(client: httpx.AsyncClient, tenant: str) -> dict[str, str]:
    policy = {"tokens_per_minute": 60_000, "token_burst": 10_000}
    r = await client.put(f"/v1/tenants/{tenant}/policy", json=policy, headers=ADMIN)
    assert r.status_code == 200, r.text
    r = await client.post(f"/v1/tenants/{tenant}/keys", headers=ADMIN)
    return {"Authorization": f"Bearer {r.json()['key']}"}


async def layers(client: httpx.AsyncClient, headers: dict[str, str]) -> dict[str, dict[str, Any]]:
    r = await client.get("/v1/tenants/acme/status", headers=headers)
    assert r.status_code == 200, r.text
    return {layer["scope"]: layer for layer in r.json()["layers"]}


async def put_global(client: httpx.AsyncClient, policy: dict[str, int]) -> None:
    r = await client.put("/v1/policies/global", json=policy, headers=ADMIN)
    assert r.status_code == 200, r.text


def admit_body(tenant: str) -> dict[str, Any]:
    return {"tenant": tenant, "model": "gpt-4o", "input_tokens": 10, "max_tokens": 10}


def view_settings() -> Settings:
    return fault_settings(
        admin_key=ADMIN_KEY, decision_deadline_ms=5_000, concurrency_retry_ms=CONCURRENCY_RETRY_MS
    )


async def test_a_tenant_sees_whether_the_global_layer_binds_and_not_its_figures(
    database_dsn: str,
) -> None:
    async with (
        serving(view_settings(), database_dsn) as (base, _app),
        httpx.AsyncClient(base_url=base, timeout=10) as client,
    ):
        await put_global(client, GLOBAL)
        acme, other = await key_of(client, "acme"), await key_of(client, "other")

        seen = await layers(client, acme)
        assert seen["global"] == {
            "scope": "global",
            "route": None,
            **dict.fromkeys(FIGURES),
            "binding": False,
            "retry_after_ms": None,
        }

        # Another tenant takes the global layer's only request.
        r = await client.post("/v1/admit", json=admit_body("other"), headers=other)
        assert r.status_code == 201, r.text

        seen = await layers(client, acme)
        shared = seen["global"]
        visible = {name for name, value in shared.items() if value is not None}
        assert visible == {"scope", "binding", "retry_after_ms"}
        assert shared["binding"] is True
        assert 0.8 * REFILL_MS < shared["retry_after_ms"] <= REFILL_MS
        # The tenant's own layer: every figure, and it does not bind.
        own = seen["tenant"]
        assert own["limits"]["tokens_per_minute"] == 60_000
        assert (own["remaining_tokens"], own["in_flight"]) == (10_000, 0)
        assert (own["binding"], own["retry_after_ms"]) == (False, None)

        # The store agrees: acme's admission is refused by that layer, with about that wait.
        refused = await client.post("/v1/admit", json=admit_body("acme"), headers=acme)
        assert refused.status_code == 429
        error = refused.json()["error"]
        assert (error["scope"], error["limit"]) == ("global", "requests")
        assert abs(error["retry_after_ms"] - shared["retry_after_ms"]) < 1_000

        # The admin sees every figure of the same layer.
        full = (await layers(client, ADMIN))["global"]
        assert full["limits"]["requests_per_minute"] == 6
        assert (full["remaining_requests"], full["in_flight"]) == (0, 1)
        assert full["requests_full_in_seconds"] is not None
        assert full["binding"] is True
        assert 0.8 * REFILL_MS < full["retry_after_ms"] <= REFILL_MS

    print(
        "FIGURE tenant view: global layer emptied by another tenant: binding true, "
        f"retry_after_ms {shared['retry_after_ms']} (the store's 429 said "
        f"{error['retry_after_ms']}); no figure of the layer shown to the tenant"
    )


async def test_a_shared_layer_with_every_permit_taken_binds_for_the_concurrency_hint(
    database_dsn: str,
) -> None:
    async with (
        serving(view_settings(), database_dsn) as (base, _app),
        httpx.AsyncClient(base_url=base, timeout=10) as client,
    ):
        await put_global(client, {"max_in_flight": 1})
        acme, other = await key_of(client, "acme"), await key_of(client, "other")
        r = await client.post("/v1/admit", json=admit_body("other"), headers=other)
        assert r.status_code == 201, r.text

        shared = (await layers(client, acme))["global"]
        assert (shared["binding"], shared["retry_after_ms"]) == (True, CONCURRENCY_RETRY_MS)
        assert shared["in_flight"] is None and shared["limits"] is None
        assert (await layers(client, ADMIN))["global"]["in_flight"] == 1
        # One more permit: the layer has room again, and says so.
        await put_global(client, {"max_in_flight": 2})
        shared = (await layers(client, acme))["global"]
        assert (shared["binding"], shared["retry_after_ms"]) == (False, None)


async def test_the_schema_declares_the_shared_layer_figures_optional(database_dsn: str) -> None:
    settings = fault_settings(admin_key=ADMIN_KEY)
    async with (
        serving(settings, database_dsn) as (base, _app),
        httpx.AsyncClient(base_url=base, timeout=10) as client,
    ):
        schema = (await client.get("/openapi.json")).json()
    layer = schema["components"]["schemas"]["LayerStatusResponse"]
    for name in FIGURES:
        assert {"type": "null"} in layer["properties"][name]["anyOf"], name
    assert layer["properties"]["binding"]["type"] == "boolean"
    assert {"type": "null"} in layer["properties"]["retry_after_ms"]["anyOf"]
    assert {"binding", "retry_after_ms", "in_flight", "limits"} <= set(layer["required"])
