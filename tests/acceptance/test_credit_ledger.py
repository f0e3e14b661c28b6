"""Prepaid credits under concurrency: the balance is the credit ledger's sum.

200 prepaid admissions at once through the REST app on a pool of 20
connections, with top-ups (each reference sent twice) racing them; each
admitted request is then settled below its reservation, settled above it
(the provider counted more output than max_tokens), released, or left to
expire (swept by `llmquota sweep`, a subprocess) and settled late. Then:

- `llmquota audit` (a subprocess) finds nothing: every account's balance is
  its ledger's sum, and nothing is held once every reservation is finished;
- the balance is exactly the distinct top-ups minus each settlement's
  actual cost, charged once, in full, also above what was held;
- the balance goes below zero only through what settlements charged beyond
  what they held (a late settle held nothing: its expiry gave the hold
  back), never further: after every ledger entry, balance_after >= minus the
  sum of those excesses so far. Admission itself never overdraws: it admits
  only while available (balance - held) covers the request's maximum cost.
"""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from collections.abc import AsyncIterator
from decimal import Decimal
from typing import Any

import asyncpg
import httpx
import pytest

from llmquota.api.app import create_app
from llmquota.config import Settings
from tests.support import run_cli

ADMIN_KEY = "lq_test_admin_key_0123456789"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
PRICE_IN, PRICE_OUT = Decimal("2.50"), Decimal("10.00")  # gpt-4o, per million
REQUESTS, CONNECTIONS, TOP_UPS = 200, 20, 10
SEED = 10


def cost(input_tokens: int, output_tokens: int) -> Decimal:
    return (input_tokens * PRICE_IN + output_tokens * PRICE_OUT) / 1_000_000


@pytest.fixture
async def client(database_dsn: str) -> AsyncIterator[httpx.AsyncClient]:
    settings = Settings(  # type: ignore[call-arg]
        admin_key=ADMIN_KEY,
        pool_min_size=CONNECTIONS,
        pool_max_size=CONNECTIONS,
        decision_deadline_ms=60_000,
        _env_file=None,
    )
    app = create_app(settings, dsn=database_dsn)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://llmquota") as c:
            yield c


async def _prepaid_tenant(client: httpx.AsyncClient, db: asyncpg.Connection) -> dict[str, str]:
    await db.execute(
        "INSERT INTO model_prices VALUES ('gpt-4o', '2020-01-01', $1, $2)", PRICE_IN, PRICE_OUT
    )
    put = await client.put(
        "/v1/tenants/acme/policy",
        json={"tokens_per_minute": 100_000_000, "prepaid": True},
        headers=ADMIN,
    )
    assert put.status_code == 200, put.text
    key = (await client.post("/v1/tenants/acme/keys", headers=ADMIN)).json()["key"]
    first = await _top_up(client, "opening", "1.00")
    assert first == 201
    headers = {"Authorization": f"Bearer {key}"}
    # Known to the worker before the flood (unknown keys share one narrow lane).
    assert (await client.get("/v1/tenants/acme/status", headers=headers)).status_code == 200
    return headers


async def _top_up(client: httpx.AsyncClient, reference: str, amount: str) -> int:
    answer = await client.post(
        "/v1/tenants/acme/credits", json={"amount": amount, "reference": reference}, headers=ADMIN
    )
    return answer.status_code


async def _request(
    client: httpx.AsyncClient, key: dict[str, str], plan: tuple[int, int, int, int]
) -> tuple[str, dict[str, Any]]:
    """Admit one request and do one of the four things with it; (what, its figures)."""
    i, input_tokens, max_tokens, output = plan
    fate = ("settle", "settle", "settle", "over", "release", "expire")[i % 6]
    admitted = await client.post(
        "/v1/admit",
        json={"tenant": "acme", "model": "gpt-4o", "input_tokens": input_tokens,
              "max_tokens": max_tokens, "lease_seconds": 1 if fate == "expire" else 600},
        headers=key,
    )  # fmt: skip
    if admitted.status_code == 402:
        assert admitted.json()["error"]["type"] == "credits_exhausted"
        return "402", {}
    assert admitted.status_code == 201, admitted.text
    rid = admitted.json()["reservation_id"]
    if fate == "expire":
        return "expire", {"id": rid, "input": input_tokens, "max": max_tokens}
    if fate == "release":
        answer = await client.post(f"/v1/reservations/{rid}/release", headers=key)
        assert answer.status_code == 200, answer.text
        return "release", {}
    output = output % (max_tokens + 1) if fate == "settle" else max_tokens + 1 + output % 900
    answer = await client.post(
        f"/v1/reservations/{rid}/settle",
        json={"input_tokens": input_tokens, "output_tokens": output},
        headers=key,
    )
    assert answer.status_code == 200, answer.text
    return fate, {}


async def _run(client: httpx.AsyncClient, key: dict[str, str], dsn: str) -> Counter[str]:
    """The concurrent workload, the sweep and the late settles; what happened, counted."""
    rng = random.Random(SEED)
    plans = [
        (i, rng.randint(200, 2_000), rng.randint(500, 3_000), rng.randint(0, 10**6))
        for i in range(REQUESTS)
    ]
    top_ups = [_top_up(client, f"topup-{i % TOP_UPS}", "0.25") for i in range(2 * TOP_UPS)]
    work = [_request(client, key, plan) for plan in plans]
    half = REQUESTS // 2
    results = await asyncio.gather(*work[:half], *top_ups, *work[half:])
    outcomes = [r for r in results if isinstance(r, tuple)]
    counts = Counter(what for what, _ in outcomes)
    counts.update(f"top-up {status}" for status in results if isinstance(status, int))
    expiring = [figures for what, figures in outcomes if what == "expire"]
    await asyncio.sleep(1.2)  # one-second leases run out on the database clock
    await asyncio.to_thread(run_cli, "sweep", dsn=dsn)
    for figures in expiring[::2]:  # the provider answers after the sweep: a late settle
        answer = await client.post(
            f"/v1/reservations/{figures['id']}/settle",
            json={"input_tokens": figures["input"], "output_tokens": figures["max"]},
            headers=key,
        )
        assert answer.status_code == 200 and answer.json()["late"] is True, answer.text
        counts["late"] += 1
    return counts


async def _overdraw(client: httpx.AsyncClient, key: dict[str, str]) -> Counter[str]:
    """Hold the whole balance, then settle every hold above it, concurrently.

    The balance ends below zero by what the settlements used beyond their
    holds (less what was left unheld); the next admission is a 402 naming the
    negative balance until a top-up pays it back.
    """
    plans = [(6 * i + 3, 1_000, 2_000, 899) for i in range(REQUESTS)]  # all 900 over
    outcomes = await asyncio.gather(*(_request(client, key, plan) for plan in plans))
    counts = Counter(f"overdraw {what}" for what, _ in outcomes)
    refused = await client.post(
        "/v1/admit",
        json={"tenant": "acme", "model": "gpt-4o", "input_tokens": 1, "max_tokens": 1},
        headers=key,
    )
    assert refused.status_code == 402, refused.text
    assert Decimal(refused.json()["error"]["balance"]) < 0
    assert await _top_up(client, "after-overdraft", "1.00") == 201
    again = await client.post(
        "/v1/admit",
        json={"tenant": "acme", "model": "gpt-4o", "input_tokens": 1, "max_tokens": 1},
        headers=key,
    )
    assert again.status_code == 201, again.text
    rid = again.json()["reservation_id"]
    assert (await client.post(f"/v1/reservations/{rid}/release", headers=key)).status_code == 200
    return counts


async def test_the_credit_balance_is_the_ledger_sum_after_a_concurrent_prepaid_workload(
    client: httpx.AsyncClient, db: asyncpg.Connection, database_dsn: str
) -> None:
    key = await _prepaid_tenant(client, db)
    counts = await _run(client, key, database_dsn)
    counts.update(await _overdraw(client, key))
    assert (counts["top-up 201"], counts["top-up 200"]) == (TOP_UPS, TOP_UPS)
    assert counts["402"] > 0 and counts["over"] > 0 and counts["late"] > 0

    audit = await asyncio.to_thread(run_cli, "audit", dsn=database_dsn)
    assert audit.returncode == 0, audit.stdout

    account = await db.fetchrow("SELECT balance, reserved FROM credit_accounts")
    ledger = await db.fetch(
        "SELECT l.entry_kind, l.amount, l.balance_after, r.credit_reserved, r.late,"
        "       r.settled_input_tokens, r.settled_output_tokens"
        "  FROM credit_ledger AS l LEFT JOIN reservations AS r USING (reservation_id)"
        " ORDER BY l.entry_id"
    )
    assert account["reserved"] == 0  # every reservation is finished
    assert account["balance"] == sum(e["amount"] for e in ledger)
    charges = [e for e in ledger if e["entry_kind"] == "charge"]
    settled = await db.fetchval(
        "SELECT count(*) FROM reservations WHERE charged_tokens IS NOT NULL"
    )
    assert (
        len(charges)
        == settled
        == (counts["settle"] + counts["over"] + counts["late"] + counts["overdraw over"])
    )
    # Each charge is the actual cost, in full: above the hold too.
    for e in charges:
        assert -e["amount"] == cost(e["settled_input_tokens"], e["settled_output_tokens"])
    topped_up = Decimal("2.00") + TOP_UPS * Decimal("0.25")
    assert account["balance"] == topped_up + sum(e["amount"] for e in charges)

    # The overdraft bound, after every entry in the order the ledger took them.
    excess, lowest, overdrawn = Decimal(0), Decimal(0), 0
    for e in ledger:
        if e["entry_kind"] == "charge":
            held = Decimal(0) if e["late"] else e["credit_reserved"]
            excess += max(Decimal(0), -e["amount"] - held)
        assert e["balance_after"] >= -excess, (e, excess)
        lowest = min(lowest, e["balance_after"])
        overdrawn += e["balance_after"] < 0
    assert lowest < 0 and overdrawn > 0  # the bound was reached for, not vacuous
    print(
        f"FIGURE credits: {dict(counts)}; {len(ledger)} ledger entries, final balance "
        f"{account['balance']} = {topped_up} topped up - {-sum(e['amount'] for e in charges)}"
        f" charged; lowest balance {lowest} (bound -{excess}), {overdrawn} entries below zero"
    )
