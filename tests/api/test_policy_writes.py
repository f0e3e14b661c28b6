"""Policy writes that say what they do: PATCH (JSON Merge Patch), ETags, If-Match, PUT's refusal.

Through the real app and database: the ETag is the row's policy_version, the
If-Match check is made in the write's own statement, and a PATCH keeps every
field it does not name.
"""

from __future__ import annotations

import asyncio

import httpx

from tests.api.conftest import make_tenant

MERGE = {"content-type": "application/merge-patch+json"}


def patching(admin: dict[str, str], **extra: str) -> dict[str, str]:
    return {**admin, **MERGE, **extra}


async def admit(
    client: httpx.AsyncClient, headers: dict[str, str], **body: object
) -> httpx.Response:
    payload: dict[str, object] = {"tenant": "acme", "model": "gpt-4o", "input_tokens": 10}
    payload.update(body)
    return await client.post("/v1/admit", json=payload, headers=headers)


async def test_patch_of_max_in_flight_keeps_token_limits_and_admission_obeys_both(
    client: httpx.AsyncClient, admin: dict[str, str]
) -> None:
    acme = await make_tenant(client, admin, "acme", tokens_per_minute=6_000, token_burst=1_000)
    patched = await client.patch(
        "/v1/tenants/acme/policy", json={"max_in_flight": 1}, headers=patching(admin)
    )
    assert patched.status_code == 200, patched.text
    body = patched.json()
    assert (body["tokens_per_minute"], body["token_burst"], body["max_in_flight"]) == (
        6_000,
        1_000,
        1,
    )
    # The concurrency cap binds: one in flight, the second refused as concurrency.
    first = await admit(client, acme, max_tokens=100)
    assert first.status_code == 201, first.text
    second = await admit(client, acme, max_tokens=100)
    assert second.status_code == 429
    assert second.json()["error"]["limit"] == "concurrency"
    released = await client.post(
        f"/v1/reservations/{first.json()['reservation_id']}/release", headers=acme
    )
    assert released.status_code == 200
    # The token limit still binds: 10 + 2,000 tokens never fit a 1,000 burst.
    too_large = await admit(client, acme, max_tokens=2_000)
    assert too_large.status_code == 413
    # And the balance is the token bucket's: the release gave the first 110 back (the
    # bucket is full at its 1,000 burst again), so the third leaves 1,000 - 110.
    third = await admit(client, acme, max_tokens=100)
    assert third.status_code == 201
    assert third.json()["remaining"]["tokens"] == 890


async def test_patch_null_returns_a_field_to_the_plan_value(
    client: httpx.AsyncClient, admin: dict[str, str]
) -> None:
    plan = {"tokens_per_minute": 50_000, "max_in_flight": 8}
    assert (await client.put("/v1/plans/pro", json=plan, headers=admin)).status_code == 200
    put = await client.put(
        "/v1/tenants/acme/policy", json={"plan": "pro", "max_in_flight": 2}, headers=admin
    )
    assert put.json()["max_in_flight"] == 2
    patched = await client.patch(
        "/v1/tenants/acme/policy",
        json={"max_in_flight": None, "requests_per_minute": 60},
        headers={**admin, "content-type": "application/json"},
    )
    assert patched.status_code == 200, patched.text
    body = patched.json()
    assert body["max_in_flight"] == 8  # the plan's again
    assert body["tokens_per_minute"] == 50_000
    assert body["requests_per_minute"] == 60
    assert body["plan"] == "pro"


async def test_patch_route_and_global_keep_absent_fields(
    client: httpx.AsyncClient, admin: dict[str, str]
) -> None:
    await make_tenant(client, admin, "acme", tokens_per_minute=9_000)
    route = "/v1/tenants/acme/routes/chat/policy"
    put = await client.put(
        route, json={"tokens_per_minute": 3_000, "lease_seconds": 30}, headers=admin
    )
    assert put.status_code == 200, put.text
    patched = await client.patch(route, json={"max_in_flight": 4}, headers=patching(admin))
    assert patched.status_code == 200, patched.text
    assert patched.json()["tokens_per_minute"] == 3_000
    assert patched.json()["lease_seconds"] == 30
    assert patched.json()["max_in_flight"] == 4
    reset = await client.patch(route, json={"lease_seconds": None}, headers=patching(admin))
    assert reset.json()["lease_seconds"] == 120  # the default

    glob = await client.put("/v1/policies/global", json={"requests_per_minute": 600}, headers=admin)
    assert glob.status_code == 200
    patched = await client.patch(
        "/v1/policies/global", json={"tokens_per_minute": 1_000_000}, headers=patching(admin)
    )
    assert patched.status_code == 200, patched.text
    assert patched.json()["requests_per_minute"] == 600
    assert patched.json()["tokens_per_minute"] == 1_000_000


async def test_patch_validates_the_result_like_a_put_and_changes_nothing(
    client: httpx.AsyncClient, admin: dict[str, str]
) -> None:
    await make_tenant(client, admin, "acme", tokens_per_minute=6_000)
    before = await client.get("/v1/tenants/acme/policy", headers=admin)
    bad = await client.patch(
        "/v1/tenants/acme/policy", json={"max_in_flight": 0}, headers=patching(admin)
    )
    assert bad.status_code == 422
    assert "max_in_flight" in bad.json()["error"]["message"]
    unknown = await client.patch(
        "/v1/tenants/acme/policy", json={"max_inflight": 3}, headers=patching(admin)
    )
    assert unknown.status_code == 422
    assert "max_inflight" in unknown.json()["error"]["message"]
    # Removing the only limit leaves none: refused unless "unlimited" is said.
    limitless = await client.patch(
        "/v1/tenants/acme/policy", json={"tokens_per_minute": None}, headers=patching(admin)
    )
    assert limitless.status_code == 422
    assert "unlimited" in limitless.json()["error"]["message"]
    text = await client.patch(
        "/v1/tenants/acme/policy",
        content=b'{"max_in_flight": 3}',
        headers={**admin, "content-type": "text/plain"},
    )
    assert text.status_code == 415
    assert text.json()["error"]["type"] == "unsupported_media_type"
    after = await client.get("/v1/tenants/acme/policy", headers=admin)
    assert after.json() == before.json()
    assert after.headers["etag"] == before.headers["etag"]


async def test_patch_of_a_missing_policy_is_404(
    client: httpx.AsyncClient, admin: dict[str, str]
) -> None:
    missing = await client.patch(
        "/v1/tenants/ghost/policy", json={"max_in_flight": 1}, headers=patching(admin)
    )
    assert missing.status_code == 404
    await make_tenant(client, admin, "acme", tokens_per_minute=6_000)
    route = await client.patch(
        "/v1/tenants/acme/routes/none/policy", json={"max_in_flight": 1}, headers=patching(admin)
    )
    assert route.status_code == 404
    glob = await client.patch(
        "/v1/policies/global", json={"max_in_flight": 1}, headers=patching(admin)
    )
    assert glob.status_code == 404
    # Nothing was created by the refused PATCH.
    assert (await client.get("/v1/tenants/ghost/policy", headers=admin)).status_code == 404


async def test_put_refuses_a_limitless_tenant_or_route_unless_unlimited(
    client: httpx.AsyncClient, admin: dict[str, str]
) -> None:
    empty = await client.put("/v1/tenants/acme/policy", json={}, headers=admin)
    assert empty.status_code == 422
    assert "unlimited" in empty.json()["error"]["message"]
    lease_only = await client.put(
        "/v1/tenants/acme/policy", json={"lease_seconds": 30}, headers=admin
    )
    assert lease_only.status_code == 422
    assert (await client.get("/v1/tenants/acme/policy", headers=admin)).status_code == 404
    unlimited = await client.put("/v1/tenants/acme/policy", json={"unlimited": True}, headers=admin)
    assert unlimited.status_code == 200, unlimited.text
    assert unlimited.json()["tokens_per_minute"] is None
    route = await client.put("/v1/tenants/acme/routes/chat/policy", json={}, headers=admin)
    assert route.status_code == 422
    # A PATCH of an unlimited tenant need not say "unlimited" again.
    patched = await client.patch(
        "/v1/tenants/acme/policy", json={"lease_seconds": 60}, headers=patching(admin)
    )
    assert patched.status_code == 200, patched.text
    assert patched.json()["lease_seconds"] == 60
    # The global policy's {} still means no global limit.
    glob = await client.put("/v1/policies/global", json={}, headers=admin)
    assert glob.status_code == 200
    assert glob.json()["tokens_per_minute"] is None


async def test_every_read_and_write_carries_the_etag_and_if_match_guards_writes(
    client: httpx.AsyncClient, admin: dict[str, str]
) -> None:
    put = await client.put(
        "/v1/tenants/acme/policy", json={"tokens_per_minute": 6_000}, headers=admin
    )
    etag = put.headers["etag"]
    assert etag == f'"{put.json()["policy_version"]}"'
    get = await client.get("/v1/tenants/acme/policy", headers=admin)
    assert get.headers["etag"] == etag
    # A write with the current ETag succeeds and answers the new one.
    ok = await client.patch(
        "/v1/tenants/acme/policy",
        json={"max_in_flight": 3},
        headers=patching(admin, **{"if-match": etag}),
    )
    assert ok.status_code == 200, ok.text
    assert ok.headers["etag"] != etag
    # The old ETag no longer matches: 412 on PATCH and PUT, nothing written.
    stale = await client.patch(
        "/v1/tenants/acme/policy",
        json={"max_in_flight": 9},
        headers=patching(admin, **{"if-match": etag}),
    )
    assert stale.status_code == 412
    assert stale.json()["error"]["type"] == "precondition_failed"
    stale_put = await client.put(
        "/v1/tenants/acme/policy",
        json={"tokens_per_minute": 1},
        headers={**admin, "if-match": etag},
    )
    assert stale_put.status_code == 412
    now = await client.get("/v1/tenants/acme/policy", headers=admin)
    assert now.json()["max_in_flight"] == 3
    assert now.json()["tokens_per_minute"] == 6_000
    # "*" means "exists": it writes over any version, and refuses a missing one.
    star = await client.put(
        "/v1/tenants/acme/policy",
        json={"tokens_per_minute": 7_000},
        headers={**admin, "if-match": "*"},
    )
    assert star.status_code == 200
    missing = await client.put(
        "/v1/tenants/ghost/policy",
        json={"tokens_per_minute": 1},
        headers={**admin, "if-match": "*"},
    )
    assert missing.status_code == 412
    assert (await client.get("/v1/tenants/ghost/policy", headers=admin)).status_code == 404


async def test_route_and_global_etags_guard_their_writes(
    client: httpx.AsyncClient, admin: dict[str, str]
) -> None:
    await make_tenant(client, admin, "acme", tokens_per_minute=6_000)
    for path in ("/v1/tenants/acme/routes/chat/policy", "/v1/policies/global"):
        put = await client.put(path, json={"max_in_flight": 5}, headers=admin)
        assert put.status_code == 200, put.text
        etag = put.headers["etag"]
        assert (await client.get(path, headers=admin)).headers["etag"] == etag
        await client.put(path, json={"max_in_flight": 6}, headers=admin)
        stale = await client.put(
            path, json={"max_in_flight": 7}, headers={**admin, "if-match": etag}
        )
        assert stale.status_code == 412, path
        assert (await client.get(path, headers=admin)).json()["max_in_flight"] == 6


async def test_two_concurrent_patches_with_the_same_etag_one_wins(
    client: httpx.AsyncClient, admin: dict[str, str]
) -> None:
    put = await client.put(
        "/v1/tenants/acme/policy", json={"tokens_per_minute": 6_000}, headers=admin
    )
    etag = put.headers["etag"]
    for round_ in range(5):
        answers = await asyncio.gather(
            *(
                client.patch(
                    "/v1/tenants/acme/policy",
                    json={"max_in_flight": 10 * round_ + n + 1},
                    headers=patching(admin, **{"if-match": etag}),
                )
                for n in range(2)
            )
        )
        statuses = sorted(a.status_code for a in answers)
        assert statuses == [200, 412], [a.text for a in answers]
        winner = next(a for a in answers if a.status_code == 200)
        now = await client.get("/v1/tenants/acme/policy", headers=admin)
        assert now.json()["max_in_flight"] == winner.json()["max_in_flight"]
        etag = now.headers["etag"]
