"""The response cache policy field (`cache`) over the REST API, and in the policy cache.

PUT, GET and PATCH of tenant, route and plan policies; a plan's cache reaching
its tenants; the refusals, each leaving the stored policy as it was; and what
the proxy reads: `Limiter.cache_policy`, the route's over the tenant's over
the plan's, from the worker's policy cache.
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from llmquota.admission.limiter import Limiter
from llmquota.domain.response_cache import CachePolicy
from tests.api.conftest import ADMIN_KEY

ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
MERGE = {**ADMIN, "content-type": "application/merge-patch+json"}
TENANT = "/v1/tenants/acme/policy"
ROUTE = "/v1/tenants/acme/routes/chat/policy"
PLAN = "/v1/plans/pro"
# Every member set, the price spelt with a trailing zero (GET answers "0.0001").
SEMANTIC = {
    "mode": "semantic",
    "ttl_seconds": 600,
    "max_entries": 500,
    "similarity": 0.95,
    "embedding_model": "text-embedding-3-small",
    "sampled": True,
    "serve_when_exhausted": False,
    "hit_price_usd": "0.00010",
}
# As every answer shows it: defaults written out, the price without trailing zeros.
SEMANTIC_SHOWN = {**SEMANTIC, "hit_price_usd": "0.0001"}
EXACT = {"mode": "exact"}
EXACT_SHOWN = {
    "mode": "exact",
    "ttl_seconds": 3600,
    "max_entries": 1000,
    "similarity": 0.92,
    "embedding_model": None,
    "sampled": False,
    "serve_when_exhausted": True,
    "hit_price_usd": None,
}


async def _put(client: httpx.AsyncClient, path: str, body: dict[str, Any]) -> httpx.Response:
    response = await client.put(path, json=body, headers=ADMIN)
    assert response.status_code == 200, response.text
    return response


async def _get(client: httpx.AsyncClient, path: str) -> dict[str, Any]:
    response = await client.get(path, headers=ADMIN)
    assert response.status_code == 200, response.text
    body: dict[str, Any] = response.json()
    return body


@pytest.mark.parametrize(
    ("path", "extra"),
    [(TENANT, {"tokens_per_minute": 9_000}), (ROUTE, {"unlimited": True}), (PLAN, {})],
    ids=["tenant", "route", "plan"],
)
async def test_put_get_put_round_trip(
    client: httpx.AsyncClient, path: str, extra: dict[str, Any]
) -> None:
    if path == ROUTE:
        await _put(client, TENANT, {"unlimited": True})
    put = await _put(client, path, {**extra, "cache": SEMANTIC})
    assert put.json()["cache"] == SEMANTIC_SHOWN
    got = await _get(client, path)
    assert got["cache"] == SEMANTIC_SHOWN
    # The answer's cache, PUT again, stores the same and answers the same.
    again = await _put(client, path, {**extra, "cache": got["cache"]})
    assert again.json()["cache"] == SEMANTIC_SHOWN
    assert await _get(client, path) == {**got, **_versions(again.json())}
    # The defaults are written out; null clears it.
    assert (await _put(client, path, {**extra, "cache": EXACT})).json()["cache"] == EXACT_SHOWN
    cleared = await _put(client, path, {**extra, "cache": None})
    assert cleared.json()["cache"] is None
    assert (await _get(client, path))["cache"] is None


def _versions(body: dict[str, Any]) -> dict[str, Any]:
    """What a write changes besides the fields: a policy's version (plans have none)."""
    return {k: body[k] for k in ("policy_version",) if k in body}


async def test_prices_are_answered_in_one_form(client: httpx.AsyncClient) -> None:
    for sent, shown in (("2.0", "2"), ("1000", "1000"), ("0", "0"), ("0.000001", "0.000001")):
        body = {"unlimited": True, "cache": {**EXACT, "hit_price_usd": sent}}
        answer = await _put(client, TENANT, body)
        assert answer.json()["cache"]["hit_price_usd"] == shown, sent


async def test_a_plans_cache_reaches_its_tenants_and_a_tenants_own_wins(
    client: httpx.AsyncClient,
) -> None:
    await _put(client, PLAN, {"tokens_per_minute": 50_000, "cache": EXACT})
    await _put(client, TENANT, {"plan": "pro"})
    await _put(client, "/v1/tenants/beta/policy", {"plan": "pro", "cache": SEMANTIC})
    assert (await _get(client, TENANT))["cache"] == EXACT_SHOWN  # the plan's
    assert (await _get(client, "/v1/tenants/beta/policy"))["cache"] == SEMANTIC_SHOWN
    # A plan change reaches the tenant that sets none, not the one that sets its own.
    await _put(client, PLAN, {"tokens_per_minute": 50_000, "cache": {**EXACT, "ttl_seconds": 60}})
    assert (await _get(client, TENANT))["cache"]["ttl_seconds"] == 60
    assert (await _get(client, "/v1/tenants/beta/policy"))["cache"] == SEMANTIC_SHOWN
    # A tenant's own null (or none) is back to the plan's.
    await _put(client, "/v1/tenants/beta/policy", {"plan": "pro", "cache": None})
    assert (await _get(client, "/v1/tenants/beta/policy"))["cache"]["ttl_seconds"] == 60
    await _put(client, PLAN, {"tokens_per_minute": 50_000})
    assert (await _get(client, TENANT))["cache"] is None


@pytest.mark.parametrize("path", [TENANT, ROUTE, PLAN], ids=["tenant", "route", "plan"])
async def test_patch_merges_one_member_of_the_cache(client: httpx.AsyncClient, path: str) -> None:
    if path == ROUTE:
        await _put(client, TENANT, {"unlimited": True})
    extra = {"unlimited": True} if path != PLAN else {}
    await _put(client, path, {**extra, "cache": SEMANTIC})
    patched = await client.patch(path, json={"cache": {"ttl_seconds": 120}}, headers=MERGE)
    assert patched.status_code == 200, patched.text
    assert patched.json()["cache"] == {**SEMANTIC_SHOWN, "ttl_seconds": 120}
    # A member set to null goes back to its default; the others stay.
    reset = await client.patch(path, json={"cache": {"hit_price_usd": None}}, headers=MERGE)
    assert reset.json()["cache"] == {**SEMANTIC_SHOWN, "ttl_seconds": 120, "hit_price_usd": None}
    # What the merge makes must be valid: exact mode with the embedding model left over.
    before = await _get(client, path)
    invalid = await client.patch(path, json={"cache": {"mode": "exact"}}, headers=MERGE)
    assert invalid.status_code == 422, invalid.text
    assert "embedding_model" in invalid.json()["error"]["message"]
    switched = await client.patch(
        path, json={"cache": {"mode": "exact", "embedding_model": None}}, headers=MERGE
    )
    assert switched.json()["cache"]["mode"] == "exact", switched.text
    assert before["cache"]["mode"] == "semantic"
    gone = await client.patch(path, json={"cache": None}, headers=MERGE)
    assert gone.json()["cache"] is None


# (member values that are wrong, a word the 422 names)
BAD_CACHES: list[tuple[dict[str, Any], str]] = [
    ({**EXACT, "ttl_secs": 60}, "ttl_secs"),
    ({"mode": "semantic"}, "embedding_model"),
    ({**SEMANTIC, "similarity": 0}, "similarity"),
    ({**SEMANTIC, "similarity": 1.5}, "similarity"),
    ({**EXACT, "ttl_seconds": 0}, "ttl_seconds"),
    ({**EXACT, "ttl_seconds": 30 * 86_400 + 1}, "ttl_seconds"),
    ({**EXACT, "max_entries": 100_001}, "max_entries"),
    ({**EXACT, "hit_price_usd": 0.5}, "hit_price_usd"),
    ({**EXACT, "hit_price_usd": "1000.5"}, "hit_price_usd"),
    ({**EXACT, "hit_price_usd": "0.0000001"}, "hit_price_usd"),
    ({**EXACT, "embedding_model": "text-embedding-3-small"}, "embedding_model"),
    ({**SEMANTIC, "embedding_model": "a model"}, "embedding_model"),
    ({"mode": "fuzzy"}, "mode"),
    ({**EXACT, "sampled": "yes"}, "sampled"),
]


@pytest.mark.parametrize("path", [TENANT, ROUTE, PLAN], ids=["tenant", "route", "plan"])
async def test_a_bad_cache_is_a_422_naming_it_and_changes_nothing(
    client: httpx.AsyncClient, path: str
) -> None:
    if path == ROUTE:
        await _put(client, TENANT, {"unlimited": True})
    extra = {"unlimited": True} if path != PLAN else {}
    stored = await _put(client, path, {**extra, "cache": SEMANTIC})
    etag = stored.headers["etag"]
    for bad, named in BAD_CACHES:
        answer = await client.put(path, json={**extra, "cache": bad}, headers=ADMIN)
        assert answer.status_code == 422, (bad, answer.text)
        message = answer.json()["error"]["message"]
        assert "cache" in message and named in message, (bad, message)
        # Merged over the stored semantic cache, {"mode": "semantic"} would be valid.
        patch = {"embedding_model": None} if bad == {"mode": "semantic"} else bad
        patched = await client.patch(path, json={"cache": patch}, headers=MERGE)
        assert patched.status_code == 422, (bad, patched.text)
    after = await client.get(path, headers=ADMIN)
    assert after.headers["etag"] == etag
    assert after.json()["cache"] == SEMANTIC_SHOWN


async def test_the_global_policy_takes_no_cache(client: httpx.AsyncClient) -> None:
    stored = await _put(client, "/v1/policies/global", {"tokens_per_minute": 100_000})
    for send in (
        lambda: client.put(
            "/v1/policies/global",
            json={"tokens_per_minute": 100_000, "cache": EXACT},
            headers=ADMIN,
        ),
        lambda: client.patch("/v1/policies/global", json={"cache": EXACT}, headers=MERGE),
    ):
        answer = await send()
        assert answer.status_code == 422, answer.text
        assert "cache: set it on a plan, a tenant or a route" in answer.json()["error"]["message"]
    after = await client.get("/v1/policies/global", headers=ADMIN)
    assert after.headers["etag"] == stored.headers["etag"]
    assert after.json()["cache"] is None


async def test_the_openapi_document_shows_the_cache_and_its_rules(
    client: httpx.AsyncClient,
) -> None:
    schemas = (await client.get("/openapi.json")).json()["components"]["schemas"]
    assert schemas["GlobalPolicyBody"]["properties"]["cache"]["type"] == "null"
    cache = schemas["CachePolicy"]
    assert cache["properties"]["hit_price_usd"]["anyOf"][0]["type"] == "string"
    assert cache["allOf"]  # semantic needs embedding_model, exact takes none
    patch = schemas["TenantPolicyBodyPatch"]["properties"]["cache"]["anyOf"][0]
    assert set(patch["properties"]) == set(CachePolicy.model_fields)


async def test_the_limiter_answers_the_routes_over_the_tenants_over_the_plans(
    served: tuple[httpx.AsyncClient, FastAPI],
) -> None:
    client, app = served
    limiter: Limiter = app.state.limiter
    await _put(client, PLAN, {"tokens_per_minute": 50_000, "cache": {**EXACT, "ttl_seconds": 7}})
    await _put(client, TENANT, {"plan": "pro", "cache": {**EXACT, "ttl_seconds": 8}})
    await _put(client, ROUTE, {"unlimited": True, "cache": SEMANTIC})
    await _put(client, "/v1/tenants/acme/routes/plain/policy", {"max_in_flight": 4})
    await _put(client, "/v1/tenants/beta/policy", {"plan": "pro"})
    await _put(client, "/v1/tenants/gamma/policy", {"unlimited": True})
    # The writes reloaded this worker's policy cache before answering: no refresh here.

    def ttl(found: CachePolicy | None) -> int | None:
        return None if found is None else found.ttl_seconds

    route = await limiter.cache_policy("acme", "chat")
    assert route is not None and route.mode == "semantic"
    assert route == CachePolicy.model_validate(SEMANTIC)
    assert ttl(await limiter.cache_policy("acme", "plain")) == 8  # a route without one
    assert ttl(await limiter.cache_policy("acme", "unknown")) == 8  # no such route layer
    assert ttl(await limiter.cache_policy("acme", None)) == 8
    assert ttl(await limiter.cache_policy("beta", None)) == 7  # the plan's
    assert ttl(await limiter.cache_policy("beta", "chat")) == 7
    assert await limiter.cache_policy("gamma", None) is None
    assert await limiter.cache_policy("nobody", "chat") is None
    assert limiter.policies.cache_policy("acme", "chat") == route  # the same copy
    # The tenant's own goes: the plan's is its effective cache.
    await _put(client, TENANT, {"plan": "pro"})
    assert ttl(await limiter.cache_policy("acme", None)) == 7


async def test_the_status_shows_each_layers_effective_cache(client: httpx.AsyncClient) -> None:
    await _put(client, PLAN, {"tokens_per_minute": 50_000, "cache": EXACT})
    await _put(client, TENANT, {"plan": "pro"})
    await _put(client, ROUTE, {"unlimited": True, "cache": SEMANTIC})
    await _put(client, "/v1/policies/global", {"tokens_per_minute": 100_000})
    layers = (await _get(client, "/v1/tenants/acme/status"))["layers"]
    shown = {(layer["scope"], layer["route"]): layer["limits"]["cache"] for layer in layers}
    assert shown == {
        ("global", None): None,
        ("tenant", None): EXACT_SHOWN,
        ("route", "chat"): SEMANTIC_SHOWN,
    }
