"""Calendar quotas and prepaid credits reserved by admission itself, over REST.

The quota's window figures and the credit balance are read back from the
database after each step: what admission reserved, what settlement charged,
what release gave back, to the token and the cent.
"""

from __future__ import annotations

import asyncio
from datetime import datetime
from decimal import Decimal
from typing import Any

import asyncpg
import httpx

from tests.api.conftest import make_tenant

# gpt-4o at $2.50 in and $10 out per million tokens.
PRICE_IN, PRICE_OUT = Decimal("2.50"), Decimal("10.00")


async def price(db: asyncpg.Connection, model: str = "gpt-4o") -> None:
    await db.execute(
        """INSERT INTO model_prices (model, effective_from, input_usd_per_million,
                                     output_usd_per_million)
           VALUES ($1, '2020-01-01', $2, $3)""",
        model,
        PRICE_IN,
        PRICE_OUT,
    )


def cost(input_tokens: int, output_tokens: int) -> Decimal:
    return (input_tokens * PRICE_IN + output_tokens * PRICE_OUT) / 1_000_000


async def admit(client: httpx.AsyncClient, headers: dict[str, str], **body: Any) -> httpx.Response:
    payload: dict[str, Any] = {"tenant": "acme", "model": "gpt-4o", "max_tokens": 100}
    payload.update(body)
    return await client.post("/v1/admit", json=payload, headers=headers)


async def window(db: asyncpg.Connection, name: str) -> dict[str, Any]:
    row = await db.fetchrow(
        """SELECT reserved_tokens, charged_tokens, reserved_cost, charged_cost
             FROM quota_windows WHERE quota_name = $1""",
        name,
    )
    return dict(row) if row else {}


async def test_a_token_quota_is_reserved_settled_and_refused_at_its_edge(
    client: httpx.AsyncClient, admin: dict[str, str], db: asyncpg.Connection
) -> None:
    acme = await make_tenant(client, admin, "acme", tokens_per_minute=1_000_000)
    put = await client.put(
        "/v1/tenants/acme/quotas/daily",
        json={"period": "day", "timezone": "Europe/Berlin", "tokens": 1_000},
        headers=admin,
    )
    assert put.status_code == 201, put.text
    first = await admit(client, acme, input_tokens=100, max_tokens=500)
    assert first.status_code == 201, first.text
    assert await window(db, "daily") == {
        "reserved_tokens": 600,
        "charged_tokens": 0,
        "reserved_cost": 0,
        "charged_cost": 0,
    }
    # 600 held: 400 left, so 100 + 350 does not fit; the 429 says when it resets.
    refused = await admit(client, acme, input_tokens=100, max_tokens=350)
    assert refused.status_code == 429
    error = refused.json()["error"]
    assert error["type"] == "insufficient_quota"
    assert (error["limit"], error["scope"], error["quota"]) == ("quota", "tenant", "daily")
    resets_at = datetime.fromisoformat(error["resets_at"])
    assert resets_at.utcoffset() is not None
    retry = int(refused.headers["Retry-After"])
    assert abs(retry - error["retry_after_ms"] / 1000) <= 1
    assert 0 < error["retry_after_ms"] <= 25 * 3_600_000  # within a Berlin day (DST: 25 h)
    # what fits now: 400 - 100 of input
    assert error["alternatives"]["max_tokens"] == 300
    # Not "used up": 400 are left, and the message says what still fits.
    assert "does not fit in what is left" in error["message"]
    assert "max_tokens up to 300 fits" in error["message"]
    settled = await client.post(
        f"/v1/reservations/{first.json()['reservation_id']}/settle",
        json={"input_tokens": 100, "output_tokens": 50},
        headers=acme,
    )
    assert settled.status_code == 200
    assert await window(db, "daily") == {
        "reserved_tokens": 0,
        "charged_tokens": 150,
        "reserved_cost": 0,
        "charged_cost": 0,
    }
    again = await admit(client, acme, input_tokens=100, max_tokens=350)
    assert again.status_code == 201
    # 150 + 450 of 1,000: 400 left, 400 of input leaves no room for any output.
    used_up = await admit(client, acme, input_tokens=400, max_tokens=1)
    assert used_up.status_code == 429
    message = used_up.json()["error"]["message"]
    assert used_up.json()["error"]["alternatives"]["max_tokens"] is None
    assert "quota 'daily' of tenant acme has no room left for this request's input" in message
    released = await client.post(
        f"/v1/reservations/{again.json()['reservation_id']}/release", headers=acme
    )
    assert released.status_code == 200
    assert (await window(db, "daily"))["reserved_tokens"] == 0


async def test_an_alert_only_quota_admits_past_its_limit_and_still_counts(
    client: httpx.AsyncClient, admin: dict[str, str], db: asyncpg.Connection
) -> None:
    acme = await make_tenant(client, admin, "acme", tokens_per_minute=1_000_000)
    await client.put(
        "/v1/tenants/acme/quotas/soft",
        json={"period": "month", "tokens": 100, "enforce": "alert_only"},
        headers=admin,
    )
    response = await admit(client, acme, input_tokens=100, max_tokens=100)
    assert response.status_code == 201
    assert (await window(db, "soft"))["reserved_tokens"] == 200
    fired = await db.fetch(
        "SELECT threshold FROM alert_outbox WHERE event_type = 'quota.threshold' ORDER BY 1"
    )
    assert [r["threshold"] for r in fired] == [Decimal("0.5"), Decimal("0.8"), Decimal("0.95"), 1]


async def test_a_cost_quota_refuses_an_unpriced_model_and_counts_money_to_the_cent(
    client: httpx.AsyncClient, admin: dict[str, str], db: asyncpg.Connection
) -> None:
    acme = await make_tenant(client, admin, "acme", tokens_per_minute=1_000_000)
    await client.put(
        "/v1/tenants/acme/quotas/budget",
        json={"period": "month", "cost": "0.05"},
        headers=admin,
    )
    unpriced = await admit(client, acme, input_tokens=1_000, max_tokens=1_000)
    assert unpriced.status_code == 422
    assert "gpt-4o" in unpriced.json()["error"]["message"]
    assert await db.fetchval("SELECT count(*) FROM reservations") == 0
    await price(db)
    held = await admit(client, acme, input_tokens=1_000, max_tokens=2_000)
    assert held.status_code == 201, held.text
    assert (await window(db, "budget"))["reserved_cost"] == cost(1_000, 2_000)  # $0.0225
    # $0.0275 left: 1,000 in + 3,000 out would be $0.0325.
    over = await admit(client, acme, input_tokens=1_000, max_tokens=3_000)
    assert over.status_code == 429 and over.json()["error"]["quota"] == "budget"
    await client.post(
        f"/v1/reservations/{held.json()['reservation_id']}/settle",
        json={"input_tokens": 1_000, "output_tokens": 400},
        headers=acme,
    )
    assert await window(db, "budget") == {
        "reserved_tokens": 0,
        "charged_tokens": 1_400,
        "reserved_cost": 0,
        "charged_cost": cost(1_000, 400),
    }


async def test_prepaid_credits_are_reserved_charged_once_and_402_when_exhausted(
    client: httpx.AsyncClient, admin: dict[str, str], db: asyncpg.Connection
) -> None:
    await price(db)
    put = await client.put(
        "/v1/tenants/acme/policy",
        json={"tokens_per_minute": 1_000_000, "prepaid": True},
        headers=admin,
    )
    assert put.status_code == 200 and put.json()["prepaid"] is True
    key = (await client.post("/v1/tenants/acme/keys", headers=admin)).json()["key"]
    acme = {"Authorization": f"Bearer {key}"}
    empty = await admit(client, acme, input_tokens=1_000, max_tokens=1_000)
    assert empty.status_code == 402
    assert empty.json()["error"]["type"] == "credits_exhausted"
    assert Decimal(empty.json()["error"]["balance"]) == 0
    top_up = await client.post(
        "/v1/tenants/acme/credits", json={"amount": "0.05", "reference": "inv-1"}, headers=admin
    )
    assert top_up.status_code == 201, top_up.text
    held = await admit(client, acme, input_tokens=1_000, max_tokens=2_000)
    assert held.status_code == 201, held.text
    account = await db.fetchrow("SELECT balance, reserved FROM credit_accounts")
    assert (account["balance"], account["reserved"]) == (Decimal("0.05"), cost(1_000, 2_000))
    # $0.0275 available: a request of at most $0.0325 does not fit.
    short = await admit(client, acme, input_tokens=1_000, max_tokens=3_000)
    assert short.status_code == 402
    assert Decimal(short.json()["error"]["balance"]) == Decimal("0.05") - cost(1_000, 2_000)
    settle = {"input_tokens": 1_000, "output_tokens": 400}
    url = f"/v1/reservations/{held.json()['reservation_id']}/settle"
    assert (await client.post(url, json=settle, headers=acme)).status_code == 200
    assert (await client.post(url, json=settle, headers=acme)).status_code == 200  # replay
    account = await db.fetchrow("SELECT balance, reserved FROM credit_accounts")
    assert (account["balance"], account["reserved"]) == (Decimal("0.05") - cost(1_000, 400), 0)
    charges = await db.fetchval("SELECT count(*) FROM credit_ledger WHERE entry_kind = 'charge'")
    assert charges == 1
    audit = await db.fetch("SELECT * FROM lq_audit()")
    assert audit == []


async def test_concurrent_admissions_at_the_edge_of_a_quota_never_overshoot_it(
    client: httpx.AsyncClient, admin: dict[str, str], db: asyncpg.Connection
) -> None:
    acme = await make_tenant(client, admin, "acme", tokens_per_minute=10_000_000)
    await client.put(
        "/v1/tenants/acme/quotas/daily", json={"period": "day", "tokens": 10_000}, headers=admin
    )
    answers = await asyncio.gather(
        *(admit(client, acme, input_tokens=50, max_tokens=150) for _ in range(80))
    )
    statuses = [a.status_code for a in answers]
    # 10,000 / 200 per request: exactly 50 fit, whatever the batching.
    assert statuses.count(201) == 50 and statuses.count(429) == 30
    assert (await window(db, "daily"))["reserved_tokens"] == 10_000
    held = await db.fetchval("SELECT sum(reserved_tokens) FROM reservations WHERE state = 'active'")
    assert held == 10_000
