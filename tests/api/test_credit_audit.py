"""Issue 20: `llmquota audit` compares what credits charged with the invoice.

A prepaid request settled over REST (the app as llmquota_app) is charged
its cost at the price in force; the audit finds nothing. A price then
backdated over that usage (allowed this month, with a reason) makes the
invoice say more than the credits charged: the audit names the reservation
and both amounts, in millionths, and exits 1.
"""

from __future__ import annotations

import asyncio
from datetime import timedelta
from decimal import Decimal as D

import asyncpg
import httpx
import pytest

from llmquota.finance.ledger import LedgerStore
from tests.support import run_cli

# Also run on a Citus coordinator by CI's Citus leg (pyproject.toml's markers).
pytestmark = pytest.mark.citus


@pytest.mark.constructs_drift  # a backdated price is the drift the audit must name
async def test_audit_flags_credits_charged_against_a_backdated_invoice(
    client: httpx.AsyncClient, admin: dict[str, str], db: asyncpg.Connection, app_dsn: str
) -> None:
    # Set-up as the owner: $1 per million tokens, in and out, since 2020.
    await db.execute(
        "INSERT INTO model_prices (model, effective_from, input_usd_per_million,"
        " output_usd_per_million) VALUES ('gpt-4o', '2020-01-01', 1, 1)"
    )
    put = await client.put(
        "/v1/tenants/acme/policy",
        json={"tokens_per_minute": 1_000_000, "prepaid": True},
        headers=admin,
    )
    assert put.status_code == 200, put.text
    top_up = await client.post(
        "/v1/tenants/acme/credits", json={"amount": "1.00", "reference": "inv-1"}, headers=admin
    )
    assert top_up.status_code == 201, top_up.text
    admitted = await client.post(
        "/v1/admit",
        json={"tenant": "acme", "model": "gpt-4o", "input_tokens": 1000, "max_tokens": 2000},
        headers=admin,
    )
    assert admitted.status_code == 201, admitted.text
    rid = admitted.json()["reservation_id"]
    settled = await client.post(
        f"/v1/reservations/{rid}/settle",
        json={"input_tokens": 1000, "output_tokens": 1000},
        headers=admin,
    )
    assert settled.status_code == 200, settled.text
    assert await db.fetchval("SELECT -amount FROM credit_ledger WHERE entry_kind = 'charge'") == (
        D("0.002")
    )
    clean = await asyncio.to_thread(run_cli, "audit", dsn=app_dsn)
    assert "no drift" in clean.stdout

    # Backdated over the settlement, within this month: $2 from just before it.
    row = await db.fetchrow(
        "SELECT recorded_at,"
        " date_trunc('month', recorded_at AT TIME ZONE 'UTC') AT TIME ZONE 'UTC' AS month"
        " FROM usage_ledger"
    )
    backdate_to = max(row["month"], row["recorded_at"] - timedelta(seconds=1))
    connection = await asyncpg.connect(app_dsn)
    try:
        await LedgerStore(connection).set_price(
            model="gpt-4o", input_usd_per_million=D("2"), output_usd_per_million=D("2"),
            set_by="alice", effective_from=backdate_to,
            backdate_reason="the provider's new list price applied from the 1st",
        )  # fmt: skip
    finally:
        await connection.close()

    drift = await asyncio.to_thread(run_cli, "audit", dsn=app_dsn, check=False)
    assert drift.returncode == 1, drift.stdout + drift.stderr
    assert (
        f"DRIFT credit_charge reservation {rid} (tenant acme, millionths): "
        "expected 4000, found 2000"
    ) in drift.stdout
    assert "drift: 1" in drift.stdout
