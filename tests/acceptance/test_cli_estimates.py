"""`llmquota estimates` as a subprocess: the learned distributions as settled."""

from __future__ import annotations

import asyncio
import json

from llmquota.admission.limiter import Limiter
from llmquota.domain.output_estimates import bucket_of, bucket_top
from tests.support import run_cli


async def test_estimates_prints_each_learned_distribution(
    limiter: Limiter, database_dsn: str
) -> None:
    await limiter.store.catalog.put_tenant_policy("acme", None, {})
    await limiter.store.catalog.put_tenant_policy("beta", None, {})
    outputs = [*([100] * 60), *([400] * 37), *([2000] * 3)]
    for tenant, model, route in (("acme", "gpt-4o", None), ("acme", "o3", "chat")):
        for output in outputs:
            r = await limiter.admit(
                tenant=tenant, route=route, model=model, input_tokens=1, max_tokens=4000
            )
            await r.settle(input_tokens=1, output_tokens=output)
    other = await limiter.admit(tenant="beta", model="gpt-4o", input_tokens=1, max_tokens=10)
    await other.settle(input_tokens=1, output_tokens=7)

    result = await asyncio.to_thread(
        run_cli, "estimates", "--tenant", "acme", "--format", "json", dsn=database_dsn
    )
    rows = json.loads(result.stdout)
    assert [(r["tenant"], r["route"], r["model"]) for r in rows] == [
        ("acme", None, "gpt-4o"),  # no route sorts first ('')
        ("acme", "chat", "o3"),
    ]
    for row in rows:
        assert row["samples"] == 100
        assert 99.0 < row["weight"] <= 100.0
        assert row["p50"] == bucket_top(bucket_of(100))
        assert row["p95"] == bucket_top(bucket_of(400))
        assert row["p99"] == bucket_top(bucket_of(2000))
        assert row["as_of"].startswith("20")

    table = await asyncio.to_thread(run_cli, "estimates", "--model", "gpt-4o", dsn=database_dsn)
    lines = table.stdout.splitlines()
    assert lines[0].split() == [
        "tenant",
        "route",
        "model",
        "samples",
        "weight",
        "p50",
        "p95",
        "p99",
        "as_of",
    ]
    assert lines[-1] == "(2 rows)"  # acme's and beta's gpt-4o
    assert lines[3].split()[:7] == ["beta", "gpt-4o", "1", "1.0", "7", "7", "7"]
