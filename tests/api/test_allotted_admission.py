"""`"admission": "allotted"` through the REST API (issue 25).

The policy field is stored with the tenant's (or route's) policy, shown by
GET, refused on the global policy and for values other than exact and
allotted; `/v1/admit` of an allotted tenant decides its plain requests from
slices, and `/settle` bills each exactly once, as for any admission. A
plan carries the field too: its tenants take it where they set none.
"""

from __future__ import annotations

import asyncpg
import httpx
import pytest
from fastapi import FastAPI

from llmquota.admission.allotments import WARM_REQUESTS
from tests.api.conftest import make_tenant

# Counted admissions from slices mean the count, not the warm-up's clock.
pytestmark = pytest.mark.usefixtures("slices_off_the_clock")

BODY = {"tenant": "acme", "model": "gpt-4o", "input_tokens": 100, "max_tokens": 400}


async def test_the_policy_field_is_stored_shown_and_checked(
    client: httpx.AsyncClient, admin: dict[str, str], db: asyncpg.Connection
) -> None:
    put = await client.put(
        "/v1/tenants/acme/policy",
        json={"tokens_per_minute": 1000, "admission": "allotted"},
        headers=admin,
    )
    assert put.status_code == 200, put.text
    assert put.json()["admission"] == "allotted"
    assert (await client.get("/v1/tenants/acme/policy", headers=admin)).json()[
        "admission"
    ] == "allotted"
    route = await client.put(
        "/v1/tenants/acme/routes/chat/policy",
        json={"unlimited": True, "admission": "exact"},
        headers=admin,
    )
    assert route.status_code == 200, route.text
    assert route.json()["admission"] == "exact"
    stored = dict(await db.fetch("SELECT coalesce(route, ''), admission FROM limit_layers"))
    assert stored == {"": "allotted", "chat": "exact"}

    before = await db.fetchval("SELECT max(policy_version) FROM limit_layers")
    bad = await client.put(
        "/v1/tenants/acme/policy",
        json={"tokens_per_minute": 1000, "admission": "fast"},
        headers=admin,
    )
    assert bad.status_code == 422
    assert "admission" in bad.text
    global_one = await client.put(
        "/v1/policies/global", json={"admission": "allotted"}, headers=admin
    )
    assert global_one.status_code == 422
    assert "admission" in global_one.json()["error"]["message"]
    assert await db.fetchval("SELECT max(policy_version) FROM limit_layers") == before


async def test_a_plan_carries_admission_to_the_tenants_that_set_none(
    client: httpx.AsyncClient, admin: dict[str, str], db: asyncpg.Connection
) -> None:
    plan = await client.put(
        "/v1/plans/fast", json={"tokens_per_minute": 5000, "admission": "allotted"}, headers=admin
    )
    assert plan.status_code == 200, plan.text
    assert plan.json()["admission"] == "allotted"
    for tenant, own in (("acme", {}), ("beta", {"admission": "exact"})):
        put = await client.put(
            f"/v1/tenants/{tenant}/policy", json={"plan": "fast", **own}, headers=admin
        )
        assert put.status_code == 200, put.text
    layers = dict(await db.fetch("SELECT tenant, admission FROM limit_layers"))
    assert layers == {"acme": "allotted", "beta": "exact"}
    # A plan change reaches its tenants at once; a plan's null is exact.
    patched = await client.patch(
        "/v1/plans/fast",
        json={"admission": None},
        headers={**admin, "Content-Type": "application/merge-patch+json"},
    )
    assert patched.status_code == 200, patched.text
    assert patched.json()["admission"] is None
    layers = dict(await db.fetch("SELECT tenant, admission FROM limit_layers"))
    assert layers == {"acme": None, "beta": "exact"}

    # What one call counts as is never a plan's: refused, and nothing changes.
    before = await db.fetchval("SELECT updated_at FROM plans WHERE plan = 'fast'")
    for field, value in (("request_cost", 3), ("uses_concurrency", False), ("admission", "x")):
        bad = await client.put(
            "/v1/plans/fast", json={"tokens_per_minute": 5000, field: value}, headers=admin
        )
        assert bad.status_code == 422, bad.text
        assert field in bad.text
    assert await db.fetchval("SELECT updated_at FROM plans WHERE plan = 'fast'") == before


async def test_rest_admissions_come_from_slices_and_settle_once_each(
    served: tuple[httpx.AsyncClient, FastAPI], admin: dict[str, str], db: asyncpg.Connection
) -> None:
    client, app = served
    allotments = app.state.limiter.allotments
    key = await make_tenant(client, admin, "acme", tokens_per_minute=1_000_000)
    put = await client.put(
        "/v1/tenants/acme/policy",
        json={"tokens_per_minute": 1_000_000, "admission": "allotted"},
        headers=admin,
    )
    assert put.status_code == 200, put.text
    ids = []
    for _ in range(WARM_REQUESTS + 20):
        held = await client.post("/v1/admit", json=BODY, headers=key)
        assert held.status_code == 201, held.text
        ids.append(held.json()["reservation_id"])
        # A slice is taken and topped up in the background: letting that land
        # before the next request keeps the count off the clock.
        await allotments.background_done()
    # An answer from a slice has the headers an exact one has: the tenant's
    # limit and what is left of it (the layer as the slice's last top-up
    # left it, plus what the slice still holds), and the binding layer's.
    assert held.headers["x-ratelimit-limit-tokens"] == "1000000"
    assert 0 < int(held.headers["x-ratelimit-remaining-tokens"]) < 1_000_000
    assert held.headers["X-TokenLimit-Limit"] == "1000000"
    assert "RateLimit" in held.headers
    for reservation_id in ids:
        settled = await client.post(
            f"/v1/reservations/{reservation_id}/settle",
            json={"input_tokens": 100, "output_tokens": 50},
            headers=key,
        )
        assert settled.status_code == 200, settled.text
        assert settled.json()["charged_tokens"] == 150
    from_slices = await db.fetchval(
        "SELECT count(*) FROM reservations WHERE allotment_id IS NOT NULL"
    )
    assert from_slices == 20, f"{from_slices} of {len(ids)} admissions from slices"
    ledger = await db.fetch(
        "SELECT reservation_id::text AS id, input_tokens + output_tokens AS tokens"
        " FROM usage_ledger"
    )
    assert sorted(r["id"] for r in ledger) == sorted(ids)
    assert {r["tokens"] for r in ledger} == {150}


async def test_status_counts_the_room_workers_hold_in_slices_as_room_left(
    served: tuple[httpx.AsyncClient, FastAPI], admin: dict[str, str], db: asyncpg.Connection
) -> None:
    """A slice is debited from its layers: without it in the figures, an allotted
    tenant's status showed a balance short by all its slices held, and could say
    `binding` while its requests were being admitted from them."""
    client, app = served
    # One token a second of refill: the figures stand still while the test reads them.
    policy = {"tokens_per_minute": 60, "token_burst": 1_000_000, "admission": "allotted"}
    key = await make_tenant(client, admin, "acme", **policy)
    shared = {"tokens_per_minute": 60, "token_burst": 5_000_000}
    assert (await client.put("/v1/policies/global", json=shared, headers=admin)).is_success
    admitted = WARM_REQUESTS + 20
    for _ in range(admitted):
        held = await client.post("/v1/admit", json=BODY, headers=key)
        assert held.status_code == 201, held.text
    # What the slice admitted is journaled every 20 ms; a top-up may be under way.
    await app.state.limiter.allotments.background_done()
    await app.state.limiter.allotments.write_journal()
    reserved = await db.fetchval(
        "SELECT sum(reserved_tokens) FROM reservations WHERE state = 'active'"
    )
    in_slices = await db.fetchval("SELECT sum(tokens) FROM allotments WHERE tenant = 'acme'")
    assert reserved == admitted * 500 and in_slices > 0

    for who in (admin, key):
        status = await client.get("/v1/tenants/acme/status", headers=who)
        assert status.status_code == 200, status.text
        shared_layer, layer = status.json()["layers"]
        assert layer["allotted_tokens"] == in_slices
        assert layer["allotted_requests"] > 0
        # All of the burst but what the admitted requests reserved (and a few
        # seconds of refill, capped at the burst).
        left = 1_000_000 - reserved
        assert left <= layer["remaining_tokens"] <= left + 10, (layer, in_slices)
        assert layer["binding"] is False
        if who is admin:
            # The global layer's slices are the same ones (a slice debits every layer).
            assert shared_layer["allotted_tokens"] == in_slices
            left = 5_000_000 - reserved
            assert left <= shared_layer["remaining_tokens"] <= left + 10, shared_layer
        else:
            assert shared_layer["allotted_tokens"] is None  # other tenants' traffic
    # The console's page reads the same store call.
    console = await app.state.admin.tenant_status("acme")
    assert [layer.allotted_tokens for layer in console] == [in_slices, in_slices]
