"""Weighted request cost on the proxy, through the official SDK: a route's
`request_cost` and `uses_concurrency` bind the proxy's admissions as they do
`/v1/admit`'s (issue 24), and a call refused for them never reaches the provider."""

from __future__ import annotations

import asyncio

import asyncpg
import openai
import pytest

from tests.proxy.conftest import Stack

MESSAGES = [{"role": "user", "content": "hello"}]


async def test_a_routes_weight_binds_the_proxy(stack: Stack, db: asyncpg.Connection) -> None:
    policy = {"tokens_per_minute": 1_000_000, "requests_per_minute": 1, "request_burst": 10}
    assert (await stack.admin.put("/v1/tenants/acme/policy", json=policy)).is_success
    export = await stack.admin.put(
        "/v1/tenants/acme/routes/export/policy", json={"request_cost": 4}
    )
    assert export.is_success, export.text
    lookup = await stack.admin.put(
        "/v1/tenants/acme/routes/lookup/policy",
        json={"request_cost": 0, "uses_concurrency": False},
    )
    assert lookup.is_success, lookup.text
    client = stack.openai()
    calls = len(stack.fake.requests)
    for _ in range(2):  # 2 x 4 of the tenant's 10
        done = await client.chat.completions.create(
            model="gpt-4o",
            messages=MESSAGES,
            max_tokens=5,
            extra_headers={"llmquota-route": "export"},
        )
        assert done.choices[0].message.content
    with pytest.raises(openai.RateLimitError) as refused:
        await client.chat.completions.create(
            model="gpt-4o",
            messages=MESSAGES,
            max_tokens=5,
            extra_headers={"llmquota-route": "export"},
        )
    assert refused.value.status_code == 429
    assert len(stack.fake.requests) == calls + 2  # the refused one never went upstream
    # lookups spend no request: they pass with 2 of the 10 left, concurrently
    answers = await asyncio.gather(
        *[
            client.chat.completions.create(
                model="gpt-4o",
                messages=MESSAGES,
                max_tokens=5,
                extra_headers={"llmquota-route": "lookup"},
            )
            for _ in range(5)
        ]
    )
    assert all(a.choices[0].message.content for a in answers)
    row = await db.fetchrow(
        "SELECT requests, in_flight FROM limit_layers WHERE scope = 'tenant' AND tenant = 'acme'"
    )
    assert float(row["requests"]) == pytest.approx(2, abs=0.05)
    assert row["in_flight"] == 0
    weights = await db.fetch(
        "SELECT route, request_cost, permits, count(*) AS n FROM reservations"
        " GROUP BY 1, 2, 3 ORDER BY 1"
    )
    assert [tuple(r) for r in weights] == [("export", 4, 1, 2), ("lookup", 0, 0, 5)]
