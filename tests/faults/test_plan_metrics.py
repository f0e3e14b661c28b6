"""The series of plans, ceilings and degradation, after real requests to a real server.

Each assertion reads GET /metrics as Prometheus would and checks the value
the requests must have produced: decisions by outcome and reason, tokens
reserved and charged by model and plan, degradations by kind, and the
utilization gauges the lifespan's background task reads from the database.
"""

from __future__ import annotations

import httpx
import pytest

from tests.faults.conftest import fault_settings, metric_value, serving, wait_for

ADMIN_KEY = "lq_test_admin_key_metrics_0123456789"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}


async def _setup(client: httpx.AsyncClient) -> dict[str, str]:
    """Tenant acme on plan business; a 1,000-token ceiling on gpt-4o, nearly empty."""
    plan = {"priority": "high", "tokens_per_minute": 60_000, "fallback_models": ["gpt-4o-mini"]}
    assert (await client.put("/v1/plans/business", json=plan, headers=ADMIN)).status_code == 200
    policy = {"plan": "business"}
    put = await client.put("/v1/tenants/acme/policy", json=policy, headers=ADMIN)
    assert put.status_code == 200, put.text
    # One token a second of refill: the utilization the test reads cannot drift far.
    ceiling = {"models": ["gpt-4o"], "tokens_per_minute": 60, "token_burst": 1_000}
    put = await client.put("/v1/ceilings/org-4o", json=ceiling, headers=ADMIN)
    assert put.status_code == 200, put.text
    made = await client.post("/v1/tenants/acme/keys", headers=ADMIN)
    return {"Authorization": f"Bearer {made.json()['key']}"}


def _admit(model: str, tokens: int, **extra: object) -> dict[str, object]:
    return {
        "tenant": "acme",
        "model": model,
        "input_tokens": 0,
        "max_tokens": tokens,
        **extra,
    }


async def test_series_of_decisions_tokens_degradation_and_utilization(database_dsn: str) -> None:
    settings = fault_settings(
        admin_key=ADMIN_KEY, ceiling_metrics_refresh_seconds=0.1, tenant_utilization_metrics=True
    )
    async with (
        serving(settings, database_dsn) as (url, _app),
        httpx.AsyncClient(base_url=url, timeout=60) as client,
    ):
        key = await _setup(client)
        post = client.post
        # 600 of the ceiling's 1,000 tokens, on gpt-4o.
        first = await post("/v1/admit", json=_admit("gpt-4o", 600), headers=key)
        assert first.status_code == 201, first.text
        # 600 more do not fit the ceiling: degraded to gpt-4o-mini (no ceiling).
        second = await post("/v1/admit", json=_admit("gpt-4o", 600), headers=key)
        assert second.status_code == 201, second.text
        assert second.json()["model"] == "gpt-4o-mini"
        # Not allowed to degrade: refused by the ceiling.
        third = await post("/v1/admit", json=_admit("gpt-4o", 600, degrade=False), headers=key)
        assert third.status_code == 429
        # Larger than the ceiling can ever hold.
        fourth = await post("/v1/admit", json=_admit("gpt-4o", 5_000, degrade=False), headers=key)
        assert fourth.status_code == 413
        settled = await post(
            f"/v1/reservations/{second.json()['reservation_id']}/settle",
            json={"input_tokens": 0, "output_tokens": 250},
            headers=key,
        )
        assert settled.status_code == 200, settled.text

        async def gauges_read() -> bool:
            text = (await client.get("/metrics")).text
            return metric_value(text, "llmquota_ceiling_utilization", ceiling="org-4o") > 0

        await wait_for(gauges_read, 10)
        text = (await client.get("/metrics")).text

    def value(name: str, **labels: str) -> float:
        return metric_value(text, name, **labels)

    decisions = "llmquota_decisions_total"
    assert value(decisions, outcome="admitted", reason="none") == 1
    assert value(decisions, outcome="degraded", reason="ceiling_capacity") == 1
    assert value(decisions, outcome="refused", reason="ceiling_capacity") == 1
    assert value(decisions, outcome="refused", reason="too_large") == 1
    assert value("llmquota_degradations_total", kind="ceiling_capacity") == 1
    reserved = "llmquota_reserved_tokens_total"
    assert value(reserved, model="gpt-4o", plan="business") == 600
    assert value(reserved, model="gpt-4o-mini", plan="business") == 600
    charged = "llmquota_charged_tokens_total"
    assert value(charged, model="gpt-4o-mini", plan="business") == 250
    assert value(charged, model="gpt-4o", plan="business") == 0
    # 600 of 1,000 in use, less the refill of a few seconds at one token a second.
    assert value("llmquota_ceiling_utilization", ceiling="org-4o") == pytest.approx(0.6, abs=0.03)
    # acme's own 60,000-token burst: at most the 1,200 reserved were in use when
    # the gauge was read (it refills 1,000 tokens a second: it may be back to full).
    assert 'llmquota_tenant_utilization{tenant="acme"}' in text
    assert 0 <= value("llmquota_tenant_utilization", tenant="acme") <= 1_200 / 60_000
    assert value("llmquota_decision_seconds_count") == 4
