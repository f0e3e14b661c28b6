"""Learned output reservations over the REST API: the policy field and the 201."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
from fastapi import FastAPI

from llmquota.domain.output_estimates import bucket_of, bucket_top
from tests.api.conftest import ADMIN_KEY, settle_samples

ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
LEARNED = {"strategy": "learned", "quantile": 0.9, "min_samples": 10}


async def _put(client: httpx.AsyncClient, path: str, body: Any) -> Any:
    response = await client.put(path, json=body, headers=ADMIN)
    assert response.status_code == 200, response.text
    return response.json()


async def _admit(client: httpx.AsyncClient, key: dict[str, str], **body: Any) -> Any:
    payload: dict[str, Any] = {"tenant": "acme", "model": "gpt-4o", "input_tokens": 20}
    payload.update(body)
    response = await client.post("/v1/admit", json=payload, headers=key)
    assert response.status_code == 201, response.text
    return response.json()


async def test_the_201_says_what_was_reserved_for_output_and_how(
    served: tuple[httpx.AsyncClient, FastAPI],
) -> None:
    client, app = served
    plan = await _put(
        client, "/v1/plans/pro", {"tokens_per_minute": 90_000, "output_estimate": LEARNED}
    )
    assert plan["output_estimate"] == LEARNED
    policy = await _put(client, "/v1/tenants/acme/policy", {"plan": "pro"})
    assert policy["output_estimate"] == LEARNED  # the plan's, where the tenant sets none
    route = await _put(
        client,
        "/v1/tenants/acme/routes/tiny/policy",
        # No limit of its own (the tenant's apply): a PUT says so.
        {"output_estimate": {"strategy": "fixed", "tokens": 32}, "unlimited": True},
    )
    assert route["output_estimate"] == {"strategy": "fixed", "tokens": 32}
    created = await client.post("/v1/tenants/acme/keys", headers=ADMIN)
    key = {"Authorization": f"Bearer {created.json()['key']}"}
    await app.state.limiter.refresh_policies()

    cold = await _admit(client, key, max_tokens=1000)
    assert cold["output_estimate"] == {"strategy": "max_tokens", "tokens": 1000}
    assert cold["reserved_tokens"] == 1020
    await settle_samples(client, key, 10)
    await app.state.limiter.estimates.refresh()

    warm = await _admit(client, key, max_tokens=1000)
    learned = bucket_top(bucket_of(250))
    assert warm["output_estimate"] == {"strategy": "learned", "tokens": learned}
    assert warm["reserved_tokens"] == 20 + learned
    fixed = await _admit(client, key, route="tiny", max_tokens=1000)
    assert fixed["output_estimate"] == {"strategy": "fixed", "tokens": 32}
    assert fixed["reserved_tokens"] == 52


async def test_the_policy_field_is_checked_and_not_for_the_global_layer(
    served: tuple[httpx.AsyncClient, FastAPI],
) -> None:
    client, _ = served
    for bad in (
        {"strategy": "guess"},
        {"strategy": "fixed"},
        {"strategy": "learned", "quantile": 0},
        {"strategy": "max_tokens", "tokens": 5},
    ):
        response = await client.put(
            "/v1/tenants/acme/policy", json={"output_estimate": bad}, headers=ADMIN
        )
        assert response.status_code == 422, (bad, response.text)
    response = await client.put(
        "/v1/policies/global", json={"output_estimate": {"strategy": "max_tokens"}}, headers=ADMIN
    )
    assert response.status_code == 422, response.text
    assert "output_estimate" in response.json()["error"]["message"]


async def test_a_learned_estimate_is_used_within_the_refresh_period_of_its_last_sample(
    served: tuple[httpx.AsyncClient, FastAPI],
) -> None:
    """As README says: within ESTIMATE_REFRESH_SECONDS (5) of the settlement that
    completes min_samples, without anyone refreshing by hand."""
    client, app = served
    learned = {"strategy": "learned", "quantile": 0.9, "min_samples": 3}
    await _put(
        client, "/v1/tenants/acme/policy", {"tokens_per_minute": 90_000, "output_estimate": learned}
    )
    created = await client.post("/v1/tenants/acme/keys", headers=ADMIN)
    key = {"Authorization": f"Bearer {created.json()['key']}"}
    await settle_samples(client, key, 3)
    last_sample = time.monotonic()
    refresh = app.state.limiter.estimates.refresh_seconds
    assert refresh == 5.0  # the default README states
    while (answer := await _admit(client, key, max_tokens=1000))["output_estimate"][
        "strategy"
    ] != "learned":
        assert time.monotonic() - last_sample < refresh + 3.0, answer
        await asyncio.sleep(0.2)
    waited = time.monotonic() - last_sample
    print(f"learned estimate used {waited:.1f} s after its last sample")
    assert answer["output_estimate"]["tokens"] == bucket_top(bucket_of(250))
