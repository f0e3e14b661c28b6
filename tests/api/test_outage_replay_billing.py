"""Outage usage replayed into the books: every layer, quota and credit it touched.

What a worker admitted while PostgreSQL was away is journaled and, once the
database answers, recorded (lq_record_outage_admissions) and settled: the
prepaid balance is charged its cost, the calendar quota its tokens, the
provider ceiling and the tenant's layer their debits, and the ledger holds
the usage once. Here the replay runs against a real database with a
tenant on prepaid credits, a daily quota and a provider ceiling; on CI's
Citus leg it runs in public and inside a cell (the recording reads the
request's quotas, prices and layers in statements of their own there:
Citus runs no table-reading function inside a statement on a cell's
tables). The audit then finds nothing.
"""

from __future__ import annotations

import asyncio
import uuid
from decimal import Decimal as D

import asyncpg
import httpx
import pytest

from llmquota.admission.limiter import Limiter
from llmquota.domain.records import AdmitRequest, FinishRequest, OutageAdmissionRecord
from tests.support import run_cli

pytestmark = pytest.mark.citus


async def _ok(response: httpx.Response, status: int = 200) -> None:
    assert response.status_code == status, response.text


async def test_replayed_outage_usage_is_charged_to_credits_quota_ceiling_and_ledger_once(
    client: httpx.AsyncClient,
    admin: dict[str, str],
    db: asyncpg.Connection,
    limiter: Limiter,
    app_dsn: str,
) -> None:
    # $1 per million tokens, in and out; a prepaid tenant with $1, a daily
    # quota of 100,000 tokens, a provider ceiling over gpt-*.
    await db.execute(
        "INSERT INTO model_prices (model, effective_from, input_usd_per_million,"
        " output_usd_per_million) VALUES ('gpt-4o', '2020-01-01', 1, 1)"
    )
    await _ok(await client.put(
        "/v1/tenants/acme/policy", json={"tokens_per_minute": 1_000_000, "prepaid": True},
        headers=admin,
    ))  # fmt: skip
    await _ok(await client.post(
        "/v1/tenants/acme/credits", json={"amount": "1.00", "reference": "inv-1"}, headers=admin
    ), 201)  # fmt: skip
    await _ok(await client.put(
        "/v1/tenants/acme/quotas/daily", json={"period": "day", "tokens": 100_000}, headers=admin
    ), 201)  # fmt: skip
    await _ok(await client.put(
        "/v1/ceilings/openai", json={"models": ["gpt-*"], "tokens_per_minute": 1_000_000},
        headers=admin,
    ))  # fmt: skip
    version = await db.fetchval(
        "SELECT policy_version FROM limit_layers WHERE scope = 'tenant' AND tenant = 'acme'"
    )
    before = await db.fetchval(
        "SELECT tokens FROM limit_layers WHERE scope = 'ceiling' AND ceiling = 'openai'"
    )

    # Two requests admitted during the outage (1,000 in, up to 2,000 out).
    ids = [uuid.uuid4(), uuid.uuid4()]
    request = AdmitRequest("acme", None, "gpt-4o", 1_000, 2_000, False, None, None, None)
    records = [OutageAdmissionRecord(i, request, int(version), "open") for i in ids]
    assert await limiter.store.outage.record_admissions(records) == [True, True]
    # Replayed again (another worker's copy of the journal): recorded once.
    assert await limiter.store.outage.record_admissions(records) == [False, False]
    held = await db.fetchrow(
        "SELECT sum(reserved_tokens) AS tokens, sum(credit_reserved) AS credit"
        " FROM reservations WHERE reservation_id = ANY ($1)",
        ids,
    )
    assert (held["tokens"], held["credit"]) == (6_000, D("0.006"))
    ceiling = await db.fetchval(
        "SELECT tokens FROM limit_layers WHERE scope = 'ceiling' AND ceiling = 'openai'"
    )
    assert before - ceiling == pytest.approx(6_000, abs=100)  # less what refilled meanwhile

    # One settles (1,000 in, 1,000 out), the other is released.
    finished = await limiter.store.outage.finish(
        [
            FinishRequest(ids[0], "settle", None, 1_000, 1_000, "ok"),
            FinishRequest(ids[1], "release", None, 0, 0, "ok"),
        ],
        [None, None],
    )
    assert [r.status for r in finished] == ["settled", "released"]
    charges = await db.fetch(
        "SELECT -amount AS amount FROM credit_ledger WHERE entry_kind = 'charge'"
    )
    assert [r["amount"] for r in charges] == [D("0.002")]
    assert await db.fetchval("SELECT balance FROM credit_accounts WHERE tenant = 'acme'") == D(
        "0.998"
    )
    window = await db.fetchrow("SELECT reserved_tokens, charged_tokens FROM quota_windows")
    assert (window["reserved_tokens"], window["charged_tokens"]) == (0, 2_000)
    usage = await db.fetch(
        "SELECT reservation_id, input_tokens, output_tokens FROM usage_ledger"
        " WHERE entry_kind = 'usage'"
    )
    assert [tuple(r) for r in usage] == [(ids[0], 1_000, 1_000)]
    audited = await asyncio.to_thread(run_cli, "audit", dsn=app_dsn)
    assert audited.stdout.endswith("no drift\n"), audited.stdout
