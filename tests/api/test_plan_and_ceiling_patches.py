"""PATCH, ETags and If-Match on plans and provider ceilings, through the real app."""

from __future__ import annotations

import asyncio

import httpx

MERGE = {"content-type": "application/merge-patch+json"}


async def test_plan_patch_keeps_absent_fields_and_reaches_its_tenants(
    client: httpx.AsyncClient, admin: dict[str, str]
) -> None:
    put = await client.put(
        "/v1/plans/pro",
        json={"priority": "high", "tokens_per_minute": 50_000, "max_in_flight": 8},
        headers=admin,
    )
    assert put.status_code == 200, put.text
    etag = put.headers["etag"]
    assert (await client.get("/v1/plans/pro", headers=admin)).headers["etag"] == etag
    await client.put("/v1/tenants/acme/policy", json={"plan": "pro"}, headers=admin)
    patched = await client.patch(
        "/v1/plans/pro", json={"max_in_flight": 3}, headers={**admin, **MERGE, "if-match": etag}
    )
    assert patched.status_code == 200, patched.text
    body = patched.json()
    assert (body["priority"], body["tokens_per_minute"], body["max_in_flight"]) == (
        "high",
        50_000,
        3,
    )
    assert patched.headers["etag"] != etag
    tenant = (await client.get("/v1/tenants/acme/policy", headers=admin)).json()
    assert (tenant["tokens_per_minute"], tenant["max_in_flight"]) == (50_000, 3)
    # The old ETag is stale now: PATCH and PUT are 412 and change nothing.
    stale = await client.patch(
        "/v1/plans/pro", json={"max_in_flight": 9}, headers={**admin, **MERGE, "if-match": etag}
    )
    assert stale.status_code == 412
    assert stale.json()["error"]["type"] == "precondition_failed"
    stale_put = await client.put(
        "/v1/plans/pro", json={"tokens_per_minute": 1}, headers={**admin, "if-match": etag}
    )
    assert stale_put.status_code == 412
    assert (await client.get("/v1/plans/pro", headers=admin)).json()["max_in_flight"] == 3
    reset = await client.patch(
        "/v1/plans/pro", json={"max_in_flight": None}, headers={**admin, **MERGE}
    )
    assert reset.json()["max_in_flight"] is None
    bad = await client.patch(
        "/v1/plans/pro", json={"priority": "urgent"}, headers={**admin, **MERGE}
    )
    assert bad.status_code == 422
    assert "priority" in bad.json()["error"]["message"]
    missing = await client.patch(
        "/v1/plans/none", json={"max_in_flight": 1}, headers={**admin, **MERGE}
    )
    assert missing.status_code == 404


async def test_ceiling_patch_and_if_match(client: httpx.AsyncClient, admin: dict[str, str]) -> None:
    put = await client.put(
        "/v1/ceilings/openai",
        json={"models": ["gpt-4o"], "tokens_per_minute": 90_000, "requests_per_minute": 5_000},
        headers=admin,
    )
    assert put.status_code == 200, put.text
    etag = put.headers["etag"]
    assert etag == f'"{put.json()["policy_version"]}"'
    answers = await asyncio.gather(
        *(
            client.patch(
                "/v1/ceilings/openai",
                json={"max_in_flight": n},
                headers={**admin, **MERGE, "if-match": etag},
            )
            for n in (10, 20)
        )
    )
    assert sorted(a.status_code for a in answers) == [200, 412]
    winner = next(a for a in answers if a.status_code == 200).json()
    now = (await client.get("/v1/ceilings/openai", headers=admin)).json()
    assert now["max_in_flight"] == winner["max_in_flight"]
    assert (now["models"], now["tokens_per_minute"], now["requests_per_minute"]) == (
        ["gpt-4o"],
        90_000,
        5_000,
    )
    missing = await client.patch(
        "/v1/ceilings/none", json={"max_in_flight": 1}, headers={**admin, **MERGE}
    )
    assert missing.status_code == 404


async def test_a_patch_member_no_resource_has_is_refused_even_as_null(
    client: httpx.AsyncClient, admin: dict[str, str]
) -> None:
    """Merging a null member drops it, so a misspelt reset would answer 200 and do
    nothing: every PATCH refuses a member its resource does not have, and changes nothing."""
    await client.put("/v1/plans/pro", json={"tokens_per_minute": 5_000}, headers=admin)
    await client.put("/v1/tenants/acme/policy", json={"tokens_per_minute": 7_000}, headers=admin)
    await client.put("/v1/policies/global", json={"tokens_per_minute": 9_000}, headers=admin)
    resources = ["/v1/plans/pro", "/v1/tenants/acme/policy", "/v1/policies/global"]
    before = [(await client.get(url, headers=admin)).json() for url in resources]
    for url in resources:
        for body in ({"tokens_per_mintue": None}, {"": None}, {"max_in_flight": 2, "x": None}):
            answer = await client.patch(url, json=body, headers={**admin, **MERGE})
            assert answer.status_code == 422, (url, body, answer.text)
            assert "no such field" in answer.json()["error"]["message"]
    nested = await client.patch(
        "/v1/tenants/acme/policy",
        json={"output_estimate": {"strategy": "fixed", "misspelt": None}},
        headers={**admin, **MERGE},
    )
    assert nested.status_code == 422, nested.text
    assert "output_estimate.'misspelt': no such field" in nested.json()["error"]["message"]
    after = [(await client.get(url, headers=admin)).json() for url in resources]
    assert after == before
    fixed = await client.patch(
        "/v1/tenants/acme/policy",
        json={"output_estimate": {"strategy": "fixed", "tokens": 300}},
        headers={**admin, **MERGE},
    )
    assert fixed.status_code == 200, fixed.text
    assert fixed.json()["output_estimate"] == {"strategy": "fixed", "tokens": 300}
