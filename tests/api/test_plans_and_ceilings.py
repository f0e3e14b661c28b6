"""Plans, provider ceilings with a shedding ladder, degradation: over the REST API.

Every figure below is exact: token rates are one per minute, so refill in
the few milliseconds a test takes is far below one token.
"""

from __future__ import annotations

import uuid
from decimal import Decimal
from typing import Any

import asyncpg
import httpx
import pytest

from llmquota.admin.ceiling_alerts import CeilingAlertDetector
from llmquota.store.alerts import AlertStore
from llmquota.store.store import Store
from tests.api.conftest import make_tenant

# Also run on a Citus coordinator by CI's Citus leg (pyproject.toml's markers).
pytestmark = pytest.mark.citus

SLOW = 1  # tokens per minute: refill is negligible during a test


async def admit(client: httpx.AsyncClient, headers: dict[str, str], **body: Any) -> httpx.Response:
    payload: dict[str, Any] = {"model": "gpt-4o", "max_tokens": 100}
    payload.update(body)
    return await client.post("/v1/admit", json=payload, headers=headers)


async def put(client: httpx.AsyncClient, admin: dict[str, str], path: str, body: Any) -> Any:
    response = await client.put(path, json=body, headers=admin)
    assert response.status_code == 200, response.text
    return response.json()


async def tenant_on(
    client: httpx.AsyncClient, admin: dict[str, str], tenant: str, plan: str, **own: Any
) -> dict[str, str]:
    await put(client, admin, f"/v1/tenants/{tenant}/policy", {"plan": plan, **own})
    response = await client.post(f"/v1/tenants/{tenant}/keys", headers=admin)
    return {"Authorization": f"Bearer {response.json()['key']}"}


async def test_a_tenant_takes_what_its_policy_leaves_out_from_its_plan(
    client: httpx.AsyncClient, admin: dict[str, str]
) -> None:
    plan = await put(
        client,
        admin,
        "/v1/plans/business",
        {"priority": "high", "tokens_per_minute": 50_000, "max_in_flight": 4},
    )
    assert plan["priority"] == "high" and plan["token_burst"] == 50_000
    assert plan["tenants"] == 0
    await tenant_on(client, admin, "acme", "business", max_in_flight=9)
    got = (await client.get("/v1/tenants/acme/policy", headers=admin)).json()
    assert got["plan"] == "business"
    assert (got["tokens_per_minute"], got["token_burst"], got["max_in_flight"]) == (
        50_000,
        50_000,
        9,
    )
    status = (await client.get("/v1/tenants/acme/status", headers=admin)).json()
    assert status["plan"] == "business"
    assert (await client.get("/v1/plans/business", headers=admin)).json()["tenants"] == 1


async def test_status_shows_the_fallback_models_admission_uses_the_plans_unless_own(
    client: httpx.AsyncClient, admin: dict[str, str]
) -> None:
    plan = {"tokens_per_minute": 50_000, "fallback_models": ["gpt-4o-mini", "gpt-3.5-turbo"]}
    await put(client, admin, "/v1/plans/business", plan)
    await tenant_on(client, admin, "acme", "business")
    await tenant_on(client, admin, "bolt", "business", fallback_models=["gpt-4o-mini"])
    for tenant, expected in (("acme", plan["fallback_models"]), ("bolt", ["gpt-4o-mini"])):
        status = (await client.get(f"/v1/tenants/{tenant}/status", headers=admin)).json()
        (layer,) = [layer for layer in status["layers"] if layer["scope"] == "tenant"]
        assert layer["limits"]["fallback_models"] == expected, (tenant, layer)
        policy = (await client.get(f"/v1/tenants/{tenant}/policy", headers=admin)).json()
        assert policy["fallback_models"] == expected


async def test_changing_a_plan_changes_every_tenant_on_it_at_once(
    client: httpx.AsyncClient, admin: dict[str, str]
) -> None:
    await put(client, admin, "/v1/plans/free", {"priority": "low", "tokens_per_minute": 1_000})
    for tenant in ("a", "b", "c"):
        await tenant_on(client, admin, tenant, "free")
    before = {
        t: (await client.get(f"/v1/tenants/{t}/policy", headers=admin)).json()
        for t in ("a", "b", "c")
    }
    await put(client, admin, "/v1/plans/free", {"priority": "low", "tokens_per_minute": 2_000})
    for tenant, old in before.items():
        now = (await client.get(f"/v1/tenants/{tenant}/policy", headers=admin)).json()
        assert now["tokens_per_minute"] == 2_000
        assert now["policy_version"] > old["policy_version"]
    listed = (await client.get("/v1/plans", headers=admin)).json()["plans"]
    assert [(p["plan"], p["tenants"]) for p in listed] == [("free", 3)]


async def test_a_plan_in_use_cannot_be_deleted_and_an_unused_one_can(
    client: httpx.AsyncClient, admin: dict[str, str]
) -> None:
    await put(client, admin, "/v1/plans/free", {"priority": "low"})
    await tenant_on(client, admin, "acme", "free")
    refused = await client.delete("/v1/plans/free", headers=admin)
    assert refused.status_code == 409
    assert refused.json()["error"]["type"] == "conflict_error"
    await put(client, admin, "/v1/tenants/acme/policy", {"tokens_per_minute": 10})
    assert (await client.delete("/v1/plans/free", headers=admin)).status_code == 204
    assert (await client.get("/v1/plans/free", headers=admin)).status_code == 404
    assert (await client.delete("/v1/plans/free", headers=admin)).status_code == 404


async def test_bad_plans_and_ceilings_are_422_naming_the_field(
    client: httpx.AsyncClient, admin: dict[str, str]
) -> None:
    cases: list[tuple[str, Any, str]] = [
        ("/v1/tenants/acme/policy", {"plan": "nope"}, "plan"),
        ("/v1/plans/x", {"priority": "urgent"}, "priority"),
        ("/v1/plans/x", {"fallback_models": ["a", "a"]}, "fallback_models"),
        ("/v1/ceilings/c", {"models": [], "tokens_per_minute": 10}, "models"),
        (
            "/v1/ceilings/c",
            {
                "models": ["gpt-4o"],
                "tokens_per_minute": 10,
                "shed": [{"above": 0.9, "admit": ["high"]}, {"above": 0.8, "admit": ["critical"]}],
            },
            "shed",
        ),
        (
            "/v1/ceilings/c",
            {
                "models": ["gpt-4o"],
                "tokens_per_minute": 10,
                "shed": [{"above": 1.5, "admit": ["high"]}],
            },
            "above",
        ),
        (
            "/v1/ceilings/c",
            {"models": ["gpt-4o"], "tokens_per_minute": 10, "shed": [{"above": 0.5, "admit": []}]},
            "admit",
        ),
        (
            "/v1/ceilings/c",
            {"models": ["gpt-4o"], "shed": [{"above": 0.5, "admit": ["high"]}]},
            "tokens_per_minute",
        ),
    ]
    for path, body, field in cases:
        response = await client.put(path, json=body, headers=admin)
        assert response.status_code == 422, (path, body, response.text)
        assert field in response.json()["error"]["message"], (field, response.text)
    assert (await client.get("/v1/ceilings", headers=admin)).json() == {"ceilings": []}
    assert (await client.get("/v1/plans", headers=admin)).json() == {"plans": []}


async def test_admit_fields_are_checked_before_anything_is_reserved(
    client: httpx.AsyncClient, admin: dict[str, str], db: asyncpg.Connection
) -> None:
    acme = await make_tenant(client, admin, "acme", tokens_per_minute=1_000)
    for body, field in [
        ({"priority": "urgent"}, "priority"),
        ({"fallback_models": ["gpt-4o"]}, "fallback_models"),
        ({"fallback_models": ["gpt-4o-mini", "gpt-4o-mini"]}, "fallback_models"),
        ({"degrade": "yes"}, "degrade"),
    ]:
        response = await admit(client, acme, tenant="acme", input_tokens=1, **body)
        assert response.status_code == 422, (body, response.text)
        assert field in response.json()["error"]["message"]
    assert await db.fetchval("SELECT count(*) FROM reservations") == 0


async def ceiling_setup(client: httpx.AsyncClient, admin: dict[str, str]) -> dict[str, Any]:
    """A 10,000-token ceiling on gpt-4o*: low may take it to 50%, high to 80%."""
    ceiling = await put(
        client,
        admin,
        "/v1/ceilings/openai-gpt4o",
        {
            "models": ["gpt-4o", "gpt-4o-2024-*"],
            "tokens_per_minute": SLOW,
            "token_burst": 10_000,
            "shed": [
                {"above": 0.5, "admit": ["high", "critical"], "small_request_tokens": 50},
                {"above": 0.8, "admit": ["critical"]},
            ],
        },
    )
    for plan, priority in (("free", "low"), ("business", "high"), ("enterprise", "critical")):
        await put(client, admin, f"/v1/plans/{plan}", {"priority": priority})
    return {
        "ceiling": ceiling,
        "free": await tenant_on(client, admin, "free-co", "free"),
        "business": await tenant_on(client, admin, "biz-co", "business"),
        "enterprise": await tenant_on(client, admin, "ent-co", "enterprise"),
    }


async def test_the_ladder_sheds_low_priorities_first_at_their_floors(
    client: httpx.AsyncClient, admin: dict[str, str]
) -> None:
    s = await ceiling_setup(client, admin)
    assert s["ceiling"]["utilization"] == 0.0
    # free (low) may take the ceiling to 50%: 5,000 tokens of 10,000.
    ok = await admit(client, s["free"], tenant="free-co", input_tokens=900, max_tokens=4_100)
    assert ok.status_code == 201, ok.text
    assert ok.json()["priority"] == "low"
    shed = await admit(client, s["free"], tenant="free-co", input_tokens=100, max_tokens=100)
    assert shed.status_code == 429
    error = shed.json()["error"]
    assert {k: error[k] for k in ("limit", "scope", "ceiling", "reason", "priority")} == {
        "limit": "tokens",
        "scope": "ceiling",
        "ceiling": "openai-gpt4o",
        "reason": "shed",
        "priority": "low",
    }
    assert error["utilization"] == 0.52  # 1 - (5,000 - 200) / 10,000
    # The refill needed to bring the balance above the floor plus this request:
    # 5,000 + 200 - 5,000 = 200 tokens at one per minute.
    # (Less the few milliseconds of refill since: well under a second of it.)
    assert 200 * 60_000 - 1_000 < error["retry_after_ms"] <= 200 * 60_000
    # Nothing fits a low request now with the same input: the floor is reached.
    assert error["alternatives"] == {"max_tokens": None, "models": []}
    # A small request (under 50 tokens) is exempt from the 50% step.
    small = await admit(client, s["free"], tenant="free-co", input_tokens=10, max_tokens=30)
    assert small.status_code == 201, small.text
    # business (high) may go on to 80%: 2,960 more tokens (4,960 left of 10,000 less 2,000).
    biz = await admit(client, s["business"], tenant="biz-co", input_tokens=960, max_tokens=2_000)
    assert biz.status_code == 201, biz.text
    over = await admit(client, s["business"], tenant="biz-co", input_tokens=10, max_tokens=20)
    assert over.status_code == 429
    assert over.json()["error"]["reason"] == "shed"
    # The message names the rule, not a shortage of tokens.
    message = over.json()["error"]["message"]
    assert message.startswith("The provider ceiling 'openai-gpt4o' at 80% utilization is shedding")
    assert "of a priority above high now" in message and "too few tokens" not in message
    # enterprise (critical) takes what is left, to the last token.
    ent = await admit(client, s["enterprise"], tenant="ent-co", input_tokens=0, max_tokens=2_000)
    assert ent.status_code == 201, ent.text
    empty = await admit(client, s["enterprise"], tenant="ent-co", input_tokens=0, max_tokens=1)
    assert empty.status_code == 429
    assert empty.json()["error"]["reason"] == "capacity"
    got = (await client.get("/v1/ceilings/openai-gpt4o", headers=admin)).json()
    # Full, less the refill since the last admission: at SLOW (1 token a minute)
    # a slow second refills 0.017 tokens, utilization 0.999998 of 10,000.
    assert got["remaining_tokens"] == 0 and 0.99999 <= got["utilization"] <= 1.0
    assert got["in_flight"] == 4


async def test_a_request_may_lower_its_priority_but_only_an_admin_may_raise_it(
    client: httpx.AsyncClient, admin: dict[str, str]
) -> None:
    s = await ceiling_setup(client, admin)
    # Below every floor, a free tenant asking for high is admitted at its plan's low,
    # and the answer says so.
    early = await admit(
        client, s["free"], tenant="free-co", input_tokens=0, max_tokens=100, priority="high"
    )
    assert early.status_code == 201, early.text
    assert early.json()["priority"] == "low" and early.json()["priority_lowered_from"] == "high"
    # Take the ceiling past the low floor with a critical request.
    first = await admit(client, s["enterprise"], tenant="ent-co", input_tokens=0, max_tokens=6_000)
    assert first.status_code == 201
    lowered = await admit(
        client, s["enterprise"], tenant="ent-co", input_tokens=0, max_tokens=100, priority="low"
    )
    assert lowered.status_code == 429 and lowered.json()["error"]["priority"] == "low"
    raised = await admit(
        client, s["free"], tenant="free-co", input_tokens=0, max_tokens=100, priority="critical"
    )
    assert raised.status_code == 429 and raised.json()["error"]["priority"] == "low"
    # Lowered, and the answer says so: the free plan's priority is low.
    assert raised.json()["error"]["priority_lowered_from"] == "critical"
    assert "priority_lowered_from" not in lowered.json()["error"]  # asked low, got low
    by_admin = await admit(
        client, admin, tenant="free-co", input_tokens=0, max_tokens=100, priority="critical"
    )
    assert by_admin.status_code == 201 and by_admin.json()["priority"] == "critical"
    assert by_admin.json()["priority_lowered_from"] is None


async def test_a_refused_model_degrades_to_the_first_fallback_that_fits_and_bills_it(
    client: httpx.AsyncClient, admin: dict[str, str], db: asyncpg.Connection
) -> None:
    s = await ceiling_setup(client, admin)
    ent = s["enterprise"]
    drain = await admit(client, ent, tenant="ent-co", input_tokens=0, max_tokens=10_000)
    assert drain.status_code == 201
    response = await admit(
        client,
        ent,
        tenant="ent-co",
        input_tokens=100,
        max_tokens=200,
        fallback_models=["gpt-4o-2024-08-06", "gpt-4o-mini"],
    )
    assert response.status_code == 201, response.text
    body = response.json()
    # gpt-4o-2024-08-06 matches the same ceiling; gpt-4o-mini matches none.
    assert (body["model"], body["degraded"], body["degraded_from"]) == (
        "gpt-4o-mini",
        True,
        "gpt-4o",
    )
    assert body["degraded_because"] == {
        "limit": "tokens",
        "scope": "ceiling",
        "reason": "capacity",
        "ceiling": "openai-gpt4o",
    }
    settled = await client.post(
        f"/v1/reservations/{body['reservation_id']}/settle",
        json={"input_tokens": 100, "output_tokens": 50},
        headers=ent,
    )
    assert settled.status_code == 200
    row = await db.fetchrow(
        "SELECT model, input_tokens, output_tokens FROM usage_ledger WHERE reservation_id = $1",
        uuid.UUID(body["reservation_id"]),
    )
    assert dict(row) == {"model": "gpt-4o-mini", "input_tokens": 100, "output_tokens": 50}


async def test_degrade_false_refuses_and_lists_the_fallbacks_that_would_fit(
    client: httpx.AsyncClient, admin: dict[str, str], db: asyncpg.Connection
) -> None:
    s = await ceiling_setup(client, admin)
    ent = s["enterprise"]
    await admit(client, ent, tenant="ent-co", input_tokens=0, max_tokens=9_700)
    response = await admit(
        client,
        ent,
        tenant="ent-co",
        input_tokens=100,
        max_tokens=500,
        degrade=False,
        fallback_models=["gpt-4o-2024-08-06", "gpt-4o-mini"],
    )
    assert response.status_code == 429
    error = response.json()["error"]
    # 300 left: the same input (100) leaves room for 200 output tokens.
    assert error["alternatives"] == {"max_tokens": 200, "models": ["gpt-4o-mini"]}
    reserved = await db.fetchval("SELECT count(*) FROM reservations WHERE model = 'gpt-4o-mini'")
    assert reserved == 0


async def test_a_route_or_plan_default_list_degrades_without_the_caller_naming_it(
    client: httpx.AsyncClient, admin: dict[str, str]
) -> None:
    s = await ceiling_setup(client, admin)
    await put(
        client,
        admin,
        "/v1/plans/enterprise",
        {"priority": "critical", "fallback_models": ["gpt-4o-mini"]},
    )
    ent = s["enterprise"]
    await admit(client, ent, tenant="ent-co", input_tokens=0, max_tokens=10_000)
    response = await admit(client, ent, tenant="ent-co", input_tokens=10, max_tokens=10)
    assert response.status_code == 201, response.text
    assert response.json()["model"] == "gpt-4o-mini"
    plain = await admit(client, ent, tenant="ent-co", input_tokens=10, max_tokens=10, degrade=False)
    assert plain.status_code == 429
    assert plain.json()["error"]["alternatives"]["models"] == ["gpt-4o-mini"]


async def test_settling_above_the_reservation_debits_the_ceiling_too(
    client: httpx.AsyncClient, admin: dict[str, str]
) -> None:
    s = await ceiling_setup(client, admin)
    ent = s["enterprise"]
    held = (await admit(client, ent, tenant="ent-co", input_tokens=100, max_tokens=100)).json()
    await client.post(
        f"/v1/reservations/{held['reservation_id']}/settle",
        json={"input_tokens": 100, "output_tokens": 300},
        headers=ent,
    )
    got = (await client.get("/v1/ceilings/openai-gpt4o", headers=admin)).json()
    assert got["remaining_tokens"] == 10_000 - 400
    assert got["in_flight"] == 0


async def test_a_deleted_ceiling_stops_applying_and_its_reservations_still_settle(
    client: httpx.AsyncClient, admin: dict[str, str]
) -> None:
    s = await ceiling_setup(client, admin)
    ent = s["enterprise"]
    held = (await admit(client, ent, tenant="ent-co", input_tokens=0, max_tokens=10_000)).json()
    assert (await client.delete("/v1/ceilings/openai-gpt4o", headers=admin)).status_code == 204
    again = await admit(client, ent, tenant="ent-co", input_tokens=0, max_tokens=10_000)
    assert again.status_code == 201
    settled = await client.post(
        f"/v1/reservations/{held['reservation_id']}/settle",
        json={"input_tokens": 0, "output_tokens": 10},
        headers=ent,
    )
    assert settled.status_code == 200
    assert (await client.get("/v1/ceilings/openai-gpt4o", headers=admin)).status_code == 404


async def test_a_ceiling_alerts_once_per_ladder_step_it_crosses(
    client: httpx.AsyncClient, admin: dict[str, str], db: asyncpg.Connection, app_dsn: str
) -> None:
    s = await ceiling_setup(client, admin)
    ent = s["enterprise"]
    for _ in range(3):  # 4,000, 8,000, then 9,000 of 10,000: past 0.5 and 0.8, each once
        await admit(client, ent, tenant="ent-co", input_tokens=0, max_tokens=3_000)
    # Admission itself writes no ceiling alert (it did, once per step and clock
    # hour, before the detector of migration 0023): every worker's detector does.
    assert await db.fetchval("SELECT count(*) FROM alert_outbox") == 0
    store = await Store.connect(app_dsn, min_size=1, max_size=1)
    try:
        detector = CeilingAlertDetector(store.catalog, AlertStore(store.pool))
        assert len(await detector.run_once()) == 2
        assert await detector.run_once() == []
    finally:
        await store.close()
    alerts = await db.fetch(
        """SELECT tenant, subject, threshold, usage, limit_value FROM alert_outbox
            WHERE event_type = 'ceiling.utilization' ORDER BY threshold"""
    )
    assert [dict(a) for a in alerts] == [
        {
            "tenant": None,
            "subject": "ceiling:openai-gpt4o:tokens",
            "threshold": threshold,
            "usage": 9_000,
            "limit_value": 10_000,
        }
        for threshold in (Decimal("0.5"), Decimal("0.8"))
    ]
