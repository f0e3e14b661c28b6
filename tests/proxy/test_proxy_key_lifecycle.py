"""The proxy honours the key lifecycle: a suspended tenant gets a provider-format
403 `tenant_suspended`, a key without `admit` a 403, a revoked key a 401;
none reaches the provider. Resuming lets the tenant through again."""

from __future__ import annotations

import asyncio
import time
from collections import Counter

import httpx
import openai

from llmquota.domain.keys import key_digest
from tests.proxy.conftest import Stack

MESSAGES = [{"role": "user", "content": "hello"}]


async def chat(stack: Stack, key: str) -> httpx.Response:
    async with httpx.AsyncClient(base_url=stack.url) as client:
        return await client.post(
            "/v1/chat/completions",
            json={"model": "gpt-4o", "messages": MESSAGES, "max_tokens": 5},
            headers={"Authorization": f"Bearer {key}"},
        )


async def until(stack: Stack, key: str, status: int) -> httpx.Response:
    started = time.monotonic()
    while (response := await chat(stack, key)).status_code != status:
        assert time.monotonic() - started < 1.0, (status, response.text)
        await asyncio.sleep(0.01)
    return response


async def test_suspension_scopes_and_revocation_on_the_proxy(stack: Stack) -> None:
    assert (await chat(stack, stack.key)).status_code == 200
    calls = len(stack.fake.requests)
    assert (await stack.admin.post("/v1/tenants/acme/suspend")).status_code == 200
    refused = await until(stack, stack.key, 403)
    assert refused.json()["error"]["type"] == "tenant_suspended"
    assert "suspended" in refused.json()["error"]["message"]
    assert len(stack.fake.requests) == calls
    assert (await stack.admin.post("/v1/tenants/acme/resume")).status_code == 200
    await until(stack, stack.key, 200)
    reader = (await stack.admin.post("/v1/tenants/acme/keys", json={"scopes": ["read"]})).json()
    no_scope = await chat(stack, reader["key"])
    assert no_scope.status_code == 403
    assert "'admit' scope" in no_scope.json()["error"]["message"]
    listed = (await stack.admin.get("/v1/tenants/acme/keys")).json()
    assert (await stack.admin.delete(f"/v1/tenants/acme/keys/{listed[0]['id']}")).status_code == 204
    await until(stack, stack.key, 401)
    assert len(stack.fake.requests) == calls + 1


async def test_a_burst_after_the_keys_row_changed_is_proxied_in_its_tenants_lane(
    stack: Stack,
) -> None:
    """The proxy's sibling of tests/api/test_key_lane.py: a key the worker knew,
    whose row changed (the database announced it), is looked up again in its
    tenant's fair-share lane (32 in progress, 256 queued), not in the unknown
    keys' lane (4 and 64), so a burst of 90 completions is served whole, with one
    lookup. (90: the lane's bound is 68; the tenant's share of the upstream's
    connections is 100.)"""
    policy = {"tokens_per_minute": 10_000_000, "token_burst": 5_000_000}
    assert (await stack.admin.put("/v1/tenants/acme/policy", json=policy)).is_success
    client = stack.openai()
    await client.chat.completions.create(model="gpt-4o", messages=MESSAGES, max_tokens=5)
    stack.app.state.authenticator.key_changed(key_digest(stack.key))
    statuses, lookups = await burst(stack, 90)
    assert statuses == {200: 90}, statuses
    assert lookups == 1  # one lookup for the whole burst


async def test_a_new_keys_first_burst_on_a_cold_worker_is_proxied_whole(stack: Stack) -> None:
    """The proxy's sibling of tests/api/test_key_lane.py's cold worker: the
    stack's worker has never seen its tenant's key, and 150 completions sent
    at once with it are all answered, with one lookup (the lane of unknown
    keys, 4 served and 64 queued, once refused the rest of such a burst)."""
    policy = {"tokens_per_minute": 10_000_000, "token_burst": 5_000_000}
    assert (await stack.admin.put("/v1/tenants/acme/policy", json=policy)).is_success
    statuses, lookups = await burst(stack, 150)
    assert statuses == {200: 150}, statuses
    assert lookups == 1


async def burst(stack: Stack, completions: int) -> tuple[Counter[int], float]:
    """`completions` chat completions at once with the stack's key: the status of
    each answer, and the key lookups the worker made meanwhile."""
    client = stack.openai()
    registry = stack.app.state.limiter.metrics.registry
    found = {"purpose": "first", "result": "found"}
    before = registry.get_sample_value("llmquota_key_lookups_total", found) or 0.0

    async def status() -> int:
        try:
            await client.chat.completions.create(model="gpt-4o", messages=MESSAGES, max_tokens=5)
        except openai.APIStatusError as refused:
            return refused.status_code
        return 200

    statuses = Counter(await asyncio.gather(*(status() for _ in range(completions))))
    after = registry.get_sample_value("llmquota_key_lookups_total", found) or 0.0
    return statuses, after - before
