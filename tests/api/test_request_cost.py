"""Weighted request cost (issue 24, seed 002): what one call counts as.

A tenant or route policy's `request_cost` is how many requests one call
counts as on every request-rate limit it meets (0: none), and
`uses_concurrency` whether it takes an in-flight permit; a route's wins over
its tenant's, and without either a call is one request and one permit. Both
are decided in lq_admit's statement and journaled with the reservation, so a
release, settlement, expiry or outage replay gives back exactly what was
taken. Refill is kept negligible with a rate of one request a minute and
bursts far above what a test uses.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import asyncpg
import httpx
import pytest

from llmquota.admission.limiter import Limiter
from llmquota.domain.policy import Policy
from llmquota.domain.records import AdmitRequest, FinishRequest, OutageAdmissionRecord
from tests.api.conftest import make_tenant
from tests.conftest import audit_findings

SLOW = 1  # requests per minute: a test never sees a whole request refill


async def admit(
    client: httpx.AsyncClient, key: dict[str, str], route: str | None = None, **body: Any
) -> httpx.Response:
    payload: dict[str, Any] = {"tenant": "acme", "model": "m", "input_tokens": 1}
    payload["max_tokens"] = 1
    if route is not None:
        payload["route"] = route
    payload.update(body)
    return await client.post("/v1/admit", json=payload, headers=key)


async def put_route(
    client: httpx.AsyncClient, admin: dict[str, str], route: str, **policy: Any
) -> httpx.Response:
    return await client.put(f"/v1/tenants/acme/routes/{route}/policy", json=policy, headers=admin)


async def tenant_row(db: asyncpg.Connection) -> asyncpg.Record:
    row = await db.fetchrow(
        "SELECT requests, in_flight FROM limit_layers WHERE scope = 'tenant' AND tenant = 'acme'"
    )
    assert row is not None
    return row


async def test_an_export_counts_as_its_request_cost_and_a_lookup_as_nothing(
    client: httpx.AsyncClient, admin: dict[str, str], db: asyncpg.Connection
) -> None:
    key = await make_tenant(client, admin, "acme", requests_per_minute=SLOW, request_burst=20)
    assert (await put_route(client, admin, "export", request_cost=5, unlimited=True)).is_success
    assert (await put_route(client, admin, "lookup", request_cost=0, unlimited=True)).is_success
    statuses = [(await admit(client, key, "export")).status_code for _ in range(5)]
    assert statuses == [201, 201, 201, 201, 429]  # 4 x 5 = the burst of 20
    refused = (await admit(client, key, "export")).json()["error"]
    assert (refused["limit"], refused["scope"]) == ("requests", "tenant")
    assert float((await tenant_row(db))["requests"]) == pytest.approx(0, abs=0.05)
    # A lookup spends no request: admitted while the tenant has none left,
    # and the balance does not move.
    lookups = [(await admit(client, key, "lookup")).status_code for _ in range(10)]
    assert lookups == [201] * 10
    assert float((await tenant_row(db))["requests"]) == pytest.approx(0, abs=0.05)
    # An ordinary call (no route) is one request: none left.
    assert (await admit(client, key)).status_code == 429
    assert await db.fetchval(
        "SELECT array_agg(DISTINCT request_cost ORDER BY request_cost) FROM reservations"
    ) == [0, 5]


async def test_a_call_without_concurrency_takes_no_permit(
    client: httpx.AsyncClient, admin: dict[str, str], db: asyncpg.Connection
) -> None:
    key = await make_tenant(client, admin, "acme", max_in_flight=1)
    response = await put_route(client, admin, "meta", uses_concurrency=False, unlimited=True)
    assert response.is_success
    assert response.json()["uses_concurrency"] is False
    export = await admit(client, key)
    assert export.status_code == 201
    assert (await admit(client, key)).status_code == 429  # the one permit is held
    metas = [await admit(client, key, "meta") for _ in range(5)]
    assert [m.status_code for m in metas] == [201] * 5
    assert (await tenant_row(db))["in_flight"] == 1
    # Finishing them frees nothing they did not take.
    for m in metas[:3]:
        rid = m.json()["reservation_id"]
        done = await client.post(
            f"/v1/reservations/{rid}/settle",
            json={"input_tokens": 1, "output_tokens": 1},
            headers=key,
        )
        assert done.is_success, done.text
    for m in metas[3:]:
        rid = m.json()["reservation_id"]
        assert (await client.post(f"/v1/reservations/{rid}/release", headers=key)).is_success
    assert (await tenant_row(db))["in_flight"] == 1
    assert (await admit(client, key)).status_code == 429
    rid = export.json()["reservation_id"]
    assert (await client.post(f"/v1/reservations/{rid}/release", headers=key)).is_success
    assert (await tenant_row(db))["in_flight"] == 0
    assert (await admit(client, key)).status_code == 201


async def test_a_release_gives_back_the_requests_a_settle_keeps_them(
    client: httpx.AsyncClient, admin: dict[str, str], db: asyncpg.Connection
) -> None:
    key = await make_tenant(client, admin, "acme", requests_per_minute=SLOW, request_burst=100)
    assert (await put_route(client, admin, "export", request_cost=7, unlimited=True)).is_success
    first, second = [await admit(client, key, "export") for _ in range(2)]
    assert float((await tenant_row(db))["requests"]) == pytest.approx(86, abs=0.05)
    released = await client.post(
        f"/v1/reservations/{first.json()['reservation_id']}/release", headers=key
    )
    assert released.is_success
    assert float((await tenant_row(db))["requests"]) == pytest.approx(93, abs=0.05)
    settled = await client.post(
        f"/v1/reservations/{second.json()['reservation_id']}/settle",
        json={"input_tokens": 1, "output_tokens": 1},
        headers=key,
    )
    assert settled.is_success
    assert float((await tenant_row(db))["requests"]) == pytest.approx(93, abs=0.05)


async def test_a_route_inherits_its_tenants_weight_and_may_override_it(
    client: httpx.AsyncClient, admin: dict[str, str], db: asyncpg.Connection
) -> None:
    await make_tenant(client, admin, "acme", requests_per_minute=SLOW, request_burst=100)
    policy = await client.put(
        "/v1/tenants/acme/policy",
        json={
            "requests_per_minute": SLOW,
            "request_burst": 100,
            "request_cost": 3,
            "uses_concurrency": False,
        },
        headers=admin,
    )
    assert policy.status_code == 200, policy.text
    assert (policy.json()["request_cost"], policy.json()["uses_concurrency"]) == (3, False)
    key = {
        "Authorization": "Bearer "
        + (await client.post("/v1/tenants/acme/keys", headers=admin)).json()["key"]
    }
    assert (await put_route(client, admin, "plain", unlimited=True)).is_success
    assert (await put_route(client, admin, "heavy", request_cost=10, unlimited=True)).is_success
    for route in (None, "plain", "heavy"):
        assert (await admit(client, key, route)).status_code == 201
    rows = await db.fetch("SELECT route, request_cost, permits FROM reservations ORDER BY route")
    assert [tuple(r) for r in rows] == [("heavy", 10, 0), ("plain", 3, 0), (None, 3, 0)]
    assert float((await tenant_row(db))["requests"]) == pytest.approx(100 - 16, abs=0.05)
    assert (await tenant_row(db))["in_flight"] == 0
    shown = (await client.get("/v1/tenants/acme/routes/heavy/policy", headers=admin)).json()
    assert (shown["request_cost"], shown["uses_concurrency"]) == (10, None)


@pytest.mark.parametrize(
    "body",
    [
        {"request_cost": -1},
        {"request_cost": 10_001},
        {"request_cost": 1.5},
        {"request_cost": True},
        {"request_cost": "2"},
        {"uses_concurrency": "no"},
        {"uses_concurrency": 0},
    ],
)
async def test_a_bad_weight_is_refused_and_changes_nothing(
    client: httpx.AsyncClient, admin: dict[str, str], body: dict[str, Any]
) -> None:
    await make_tenant(client, admin, "acme", requests_per_minute=10)
    before = (await client.get("/v1/tenants/acme/policy", headers=admin)).json()
    response = await client.put(
        "/v1/tenants/acme/policy", json={"requests_per_minute": 10, **body}, headers=admin
    )
    assert response.status_code == 422, response.text
    assert (await client.get("/v1/tenants/acme/policy", headers=admin)).json() == before


async def test_the_global_policy_refuses_a_weight(
    client: httpx.AsyncClient, admin: dict[str, str]
) -> None:
    for body in ({"request_cost": 2}, {"uses_concurrency": False}):
        response = await client.put(
            "/v1/policies/global", json={"requests_per_minute": 10, **body}, headers=admin
        )
        assert response.status_code == 422
        assert "set them on a tenant or a route" in response.json()["error"]["message"]


async def test_a_cost_above_every_request_burst_is_too_large(
    client: httpx.AsyncClient, admin: dict[str, str], db: asyncpg.Connection
) -> None:
    key = await make_tenant(client, admin, "acme", requests_per_minute=SLOW, request_burst=4)
    assert (await put_route(client, admin, "export", request_cost=5, unlimited=True)).is_success
    response = await admit(client, key, "export")
    assert response.status_code == 413
    error = response.json()["error"]
    assert (error["limit"], error["scope"], error["capacity"]) == ("requests", "tenant", 4)
    assert "request_cost" in error["message"]
    assert await db.fetchval("SELECT count(*) FROM reservations") == 0
    assert float((await tenant_row(db))["requests"]) == pytest.approx(4, abs=0.05)


async def test_concurrent_weighted_calls_are_admitted_exactly(
    client: httpx.AsyncClient, admin: dict[str, str], owner_dsn: str, db: asyncpg.Connection
) -> None:
    # 30 calls of cost 3 against a burst of 60 (and 20 free ones beside them,
    # against max_in_flight 25): exactly 20 fit, however they are batched.
    key = await make_tenant(
        client, admin, "acme", requests_per_minute=SLOW, request_burst=60, max_in_flight=25
    )
    assert (await put_route(client, admin, "export", request_cost=3, unlimited=True)).is_success
    # a weight alone is a policy: no "unlimited": true needed
    meta = await put_route(client, admin, "meta", request_cost=0, uses_concurrency=False)
    assert meta.status_code == 200, meta.text
    # the worker knows the key (a key not seen yet waits in a queue of its own)
    assert (await client.get("/v1/tenants/acme/status", headers=key)).is_success
    answers = await asyncio.gather(
        *[admit(client, key, "export") for _ in range(30)],
        *[admit(client, key, "meta") for _ in range(20)],
    )
    exports = [a.status_code for a in answers[:30]]
    metas = [a.status_code for a in answers[30:]]
    assert exports.count(201) == 20 and exports.count(429) == 10
    assert metas == [201] * 20
    row = await tenant_row(db)
    assert float(row["requests"]) == pytest.approx(0, abs=0.1)
    assert row["in_flight"] == 20
    assert await audit_findings(owner_dsn) == []


async def test_the_sweeper_frees_only_the_permits_taken(
    limiter: Limiter, db: asyncpg.Connection, owner_dsn: str
) -> None:
    await limiter.store.put_policy(
        "tenant", "acme", None, Policy(max_in_flight=10, requests_per_minute=SLOW, request_burst=50)
    )
    await limiter.store.put_policy(
        "route", "acme", "meta", Policy(request_cost=2, uses_concurrency=False)
    )
    decisions = await limiter.store.admit(
        [
            AdmitRequest("acme", None, "m", 1, 1, False, 1, None, None),
            AdmitRequest("acme", "meta", "m", 1, 1, False, 1, None, None),
        ],
        deadline_seconds=None,
    )
    assert [d.status for d in decisions] == ["admitted", "admitted"]
    row = await tenant_row(db)
    assert (float(row["requests"]), row["in_flight"]) == (pytest.approx(47, abs=0.05), 1)
    await db.execute("UPDATE reservations SET lease_expires_at = now() - interval '1 second'")
    assert (await limiter.store.sweep(100))[0] == 2
    row = await tenant_row(db)
    # an expiry keeps the requests (the provider may have been called) and
    # frees each permit that was taken, once
    assert (float(row["requests"]), row["in_flight"]) == (pytest.approx(47, abs=0.05), 0)
    assert await audit_findings(owner_dsn) == []


async def test_outage_admissions_are_recorded_at_their_weight(
    limiter: Limiter, db: asyncpg.Connection, owner_dsn: str
) -> None:
    # The sibling of admission: work a worker admitted on its own during an
    # outage is recorded with the requests and permit lq_admit would have taken.
    await limiter.store.put_policy(
        "tenant", "acme", None, Policy(max_in_flight=10, requests_per_minute=SLOW, request_burst=50)
    )
    await limiter.store.put_policy(
        "route", "acme", "export", Policy(request_cost=4, uses_concurrency=False)
    )
    version = await db.fetchval("SELECT max(policy_version) FROM limit_layers")
    ids = [uuid.uuid4(), uuid.uuid4(), uuid.uuid4()]
    export = AdmitRequest("acme", "export", "m", 1, 1, False, None, None, None)
    plain = AdmitRequest("acme", None, "m", 1, 1, False, None, None, None)
    records = [
        OutageAdmissionRecord(ids[0], export, int(version), "open"),
        OutageAdmissionRecord(ids[1], export, int(version), "open"),
        OutageAdmissionRecord(ids[2], plain, int(version), "open"),
    ]
    assert await limiter.store.outage.record_admissions(records) == [True, True, True]
    assert await limiter.store.outage.record_admissions(records) == [False, False, False]
    row = await tenant_row(db)
    assert (float(row["requests"]), row["in_flight"]) == (pytest.approx(41, abs=0.05), 1)
    await limiter.store.finish(
        [
            FinishRequest(ids[0], "release", None, None, None, None),
            FinishRequest(ids[1], "settle", None, 1, 1, "ok"),
            FinishRequest(ids[2], "settle", None, 1, 1, "ok"),
        ],
        deadline_seconds=None,
    )
    row = await tenant_row(db)
    assert (float(row["requests"]), row["in_flight"]) == (pytest.approx(45, abs=0.05), 0)
    assert await audit_findings(owner_dsn) == []


async def test_a_weight_counts_on_the_provider_ceiling_and_the_keys_layer(
    client: httpx.AsyncClient, admin: dict[str, str], db: asyncpg.Connection
) -> None:
    # Every request-rate limit a call meets takes its weight: a provider
    # ceiling (decided in the exact path) and the key's own layer alike.
    await make_tenant(client, admin, "acme", requests_per_minute=SLOW, request_burst=1_000)
    ceiling = await client.put(
        "/v1/ceilings/provider",
        json={"models": ["m"], "requests_per_minute": SLOW, "request_burst": 12, "shed": []},
        headers=admin,
    )
    assert ceiling.status_code == 200, ceiling.text
    created = await client.post(
        "/v1/tenants/acme/keys",
        json={"requests_per_minute": SLOW, "request_burst": 100},
        headers=admin,
    )
    assert created.status_code == 201, created.text
    key = {"Authorization": f"Bearer {created.json()['key']}"}
    assert (await put_route(client, admin, "export", request_cost=5)).is_success
    statuses = [(await admit(client, key, "export")).status_code for _ in range(3)]
    assert statuses == [201, 201, 429]  # 2 x 5 of the ceiling's 12
    refused = (await admit(client, key, "export")).json()["error"]
    assert (refused["limit"], refused["scope"]) == ("requests", "ceiling")
    rows = {
        r["scope"]: float(r["requests"])
        for r in await db.fetch("SELECT scope, requests FROM limit_layers WHERE scope <> 'route'")
    }
    assert rows["ceiling"] == pytest.approx(2, abs=0.05)
    assert rows["key"] == pytest.approx(90, abs=0.05)
    assert rows["tenant"] == pytest.approx(990, abs=0.05)
    # another model, past the ceiling: the key's layer is what is left to meet
    other = await admit(client, key, "export", model="other")
    assert other.status_code == 201
    assert float(
        await db.fetchval("SELECT requests FROM limit_layers WHERE scope = 'key'")
    ) == pytest.approx(85, abs=0.05)


async def test_a_sharded_global_layer_takes_each_calls_weight(
    client: httpx.AsyncClient, admin: dict[str, str], db: asyncpg.Connection
) -> None:
    # Two shards of 30 requests each: a shard that lacks room for what its
    # requests would take is decided pooled, and the pool counts the weight.
    response = await client.put(
        "/v1/policies/global",
        json={"requests_per_minute": 2, "request_burst": 60, "shards": 2},
        headers=admin,
    )
    assert response.status_code == 200, response.text
    key = await make_tenant(client, admin, "acme", requests_per_minute=SLOW, request_burst=1_000)
    assert (await put_route(client, admin, "export", request_cost=7)).is_success
    statuses = [(await admit(client, key, "export")).status_code for _ in range(9)]
    assert statuses == [201] * 8 + [429]  # 8 x 7 = 56 of 60, pooled past one shard's 30
    total = await db.fetchval("SELECT sum(requests) FROM limit_layers WHERE scope = 'global'")
    assert float(total) == pytest.approx(4, abs=0.1)


async def test_a_patch_changes_the_weight_alone(
    client: httpx.AsyncClient, admin: dict[str, str]
) -> None:
    await make_tenant(client, admin, "acme", requests_per_minute=10)
    assert (await put_route(client, admin, "export", max_in_flight=3)).is_success
    merge = {**admin, "content-type": "application/merge-patch+json"}
    patched = await client.patch(
        "/v1/tenants/acme/routes/export/policy", json={"request_cost": 4}, headers=merge
    )
    assert patched.status_code == 200, patched.text
    body = patched.json()
    assert (body["request_cost"], body["uses_concurrency"], body["max_in_flight"]) == (4, None, 3)
    back = await client.patch(
        "/v1/tenants/acme/routes/export/policy", json={"request_cost": None}, headers=merge
    )
    assert back.json()["request_cost"] is None and back.json()["max_in_flight"] == 3
