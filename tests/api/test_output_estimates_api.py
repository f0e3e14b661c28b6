"""Learned output reservations over the REST API: the policy field and the 201."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import asyncpg
import httpx
import pytest
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


async def _seed(db: asyncpg.Connection, outputs: dict[str, list[int]]) -> None:
    """acme's samples of each model, as settlements record them (lq_finish's call)."""
    rows = [(model, output) for model, samples in outputs.items() for output in samples]
    await db.execute(
        "SELECT lq_record_output_samples($1::text[], $2::text[], $3::text[], $4::bigint[])",
        ["acme"] * len(rows),
        [None] * len(rows),
        [model for model, _ in rows],
        [output for _, output in rows],
    )


async def _tenant_tokens(db: asyncpg.Connection) -> float:
    return float(await db.fetchval("SELECT tokens FROM limit_layers WHERE scope = 'tenant'"))


async def test_a_degraded_201_reserves_and_reports_the_admitted_models_estimate(
    served: tuple[httpx.AsyncClient, FastAPI], db: asyncpg.Connection
) -> None:
    """Issue 23's leftover: the fallback admitted reserves its own learned quantile
    (here smaller: the requested model's could not be afforded at all)."""
    client, app = served
    policy = {"tokens_per_minute": 1, "token_burst": 600, "output_estimate": LEARNED}
    await _put(client, "/v1/tenants/acme/policy", policy)
    created = await client.post("/v1/tenants/acme/keys", headers=ADMIN)
    key = {"Authorization": f"Bearer {created.json()['key']}"}
    await _seed(db, {"gpt-4o": [1000] * 10, "gpt-4o-mini": [100] * 10})
    await app.state.limiter.refresh_policies()
    await app.state.limiter.estimates.refresh()
    big, small = bucket_top(bucket_of(1000)), bucket_top(bucket_of(100))
    body = {"max_tokens": 4000, "fallback_models": ["gpt-4o-mini"]}

    # What it would reserve now: the requested model's own figures.
    counted = await client.post(
        "/v1/tokens/count",
        json={"tenant": "acme", "model": "gpt-4o", "input_tokens": 20, **body},
        headers=key,
    )
    assert counted.status_code == 200, counted.text
    assert counted.json()["output_estimate"] == {"strategy": "learned", "tokens": big}
    assert counted.json()["reserved_tokens"] == 20 + big  # more than the tenant's 600

    admitted = await _admit(client, key, **body)
    assert (admitted["model"], admitted["degraded"], admitted["degraded_from"]) == (
        "gpt-4o-mini",
        True,
        "gpt-4o",
    )
    assert admitted["degraded_because"]["limit"] == "tokens"
    assert admitted["output_estimate"] == {"strategy": "learned", "tokens": small}
    assert admitted["reserved_tokens"] == 20 + small
    assert admitted["remaining"]["tokens"] == 600 - 20 - small
    assert await _tenant_tokens(db) == pytest.approx(600 - 20 - small, abs=0.5)


async def test_a_degraded_201_reserves_a_fallbacks_larger_estimate(
    served: tuple[httpx.AsyncClient, FastAPI], db: asyncpg.Connection
) -> None:
    """The reverse: the refused model's output is small, the fallback's large."""
    client, app = served
    ceiling = {"models": ["gpt-4o-mini"], "tokens_per_minute": 1, "token_burst": 5, "shed": []}
    await _put(client, "/v1/ceilings/mini", ceiling)  # gpt-4o-mini never fits
    policy = {"tokens_per_minute": 1, "token_burst": 20_000, "output_estimate": LEARNED}
    await _put(client, "/v1/tenants/acme/policy", policy)
    created = await client.post("/v1/tenants/acme/keys", headers=ADMIN)
    key = {"Authorization": f"Bearer {created.json()['key']}"}
    await _seed(db, {"gpt-4o": [1000] * 10, "gpt-4o-mini": [100] * 10})
    await app.state.limiter.refresh_policies()
    await app.state.limiter.estimates.refresh()
    big = bucket_top(bucket_of(1000))

    admitted = await _admit(
        client, key, model="gpt-4o-mini", max_tokens=4000, fallback_models=["gpt-4o"]
    )
    assert (admitted["model"], admitted["degraded"]) == ("gpt-4o", True)
    assert admitted["degraded_because"]["scope"] == "ceiling"
    assert admitted["output_estimate"] == {"strategy": "learned", "tokens": big}
    assert admitted["reserved_tokens"] == 20 + big
    assert await _tenant_tokens(db) == pytest.approx(20_000 - 20 - big, abs=0.5)
