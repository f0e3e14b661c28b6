"""Alerts fire once per threshold per window, credits add once per reference.

On real PostgreSQL, under real concurrency: many connections calling the
SQL helpers admission and settlement will call (lq_fire_alert,
lq_quota_apply, lq_quota_settle, lq_credit_topup, lq_credit_apply), each in
its own transaction, as they will run inside lq_admit and lq_finish.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from decimal import Decimal

import asyncpg
import pytest

from llmquota.admin.alerts import AlertService
from llmquota.admission.limiter import Limiter
from llmquota.domain.errors import IdempotencyConflict
from llmquota.domain.quotas import quota_spec
from tests.integration.support import count

AT = datetime(2026, 3, 29, 12, 0, tzinfo=UTC)


@pytest.fixture
async def service(limiter: Limiter, db: asyncpg.Connection) -> AlertService:
    await db.execute("INSERT INTO tenants (tenant) VALUES ('acme'), ('other')")
    return AlertService(limiter.store)


@pytest.fixture
async def pool(app_dsn: str) -> AsyncIterator[asyncpg.Pool]:
    created = await asyncpg.create_pool(app_dsn, min_size=20, max_size=20)
    assert created is not None
    yield created
    await created.close()


async def _in_transaction(pool: asyncpg.Pool, sql: str, *args: object) -> object:
    """Run one statement in a transaction held open a moment, so callers overlap."""
    async with pool.acquire() as connection, connection.transaction():
        value = await connection.fetchval(sql, *args)
        await asyncio.sleep(0.005)
        return value


async def test_an_alert_fires_once_under_100_concurrent_callers_with_one_delivery_per_webhook(
    service: AlertService, pool: asyncpg.Pool, db: asyncpg.Connection
) -> None:
    await service.put_webhook("all", "http://127.0.0.1:9/a", "s" * 16, None)
    await service.put_webhook("acme-only", "http://127.0.0.1:9/b", "s" * 16, "acme")
    await service.put_webhook("other-only", "http://127.0.0.1:9/c", "s" * 16, "other")
    fire = (
        "SELECT lq_fire_alert('quota.threshold', 'acme', 'quota:acme:*:monthly:tokens', 0.8,"
        ' $1, $2, 800, 1000, NULL, \'{"quota": "monthly"}\')'
    )
    start, end = datetime(2026, 3, 1, tzinfo=UTC), datetime(2026, 4, 1, tzinfo=UTC)
    results = await asyncio.gather(*(_in_transaction(pool, fire, start, end) for _ in range(100)))
    assert sum(r is not None for r in results) == 1
    assert await count(db, "alert_outbox") == 1
    webhooks = await db.fetch("SELECT webhook FROM alert_deliveries ORDER BY webhook")
    assert [r["webhook"] for r in webhooks] == ["acme-only", "all"]
    # Another window, or another threshold, is another alert.
    assert await db.fetchval(fire.replace("0.8", "0.95"), start, end) is not None
    assert await db.fetchval(fire, end, datetime(2026, 5, 1, tzinfo=UTC)) is not None
    assert await count(db, "alert_outbox") == 3


async def test_an_alert_of_a_rolled_back_change_never_fired(
    service: AlertService, db: asyncpg.Connection
) -> None:
    fire = (
        "SELECT lq_fire_alert('credits.threshold', 'acme', 'credits:acme', 0.5,"
        " $1, NULL, 5, 10, NULL)"
    )
    transaction = db.transaction()
    await transaction.start()
    assert await db.fetchval(fire, AT) is not None
    await transaction.rollback()
    assert await count(db, "alert_outbox") == 0
    assert await db.fetchval(fire, AT) is not None


async def test_100_concurrent_settlements_crossing_the_thresholds_give_one_alert_each(
    service: AlertService, pool: asyncpg.Pool, db: asyncpg.Connection
) -> None:
    quota, _ = await service.put_quota(
        "acme", None, "daily", quota_spec(period="day", tokens=1000, timezone="Europe/Berlin")
    )
    # 100 reservations of 10 at once, then their 100 settlements of 10 at once.
    reserve = "SELECT (lq_quota_apply($1, $2, 10, 0, 0, 0)).window_id"
    await asyncio.gather(*(_in_transaction(pool, reserve, quota.quota_id, AT) for _ in range(100)))
    alerts = await db.fetch("SELECT threshold, usage FROM alert_outbox ORDER BY threshold")
    assert [(r["threshold"], r["usage"]) for r in alerts] == [
        (Decimal("0.5"), 500),
        (Decimal("0.8"), 800),
        (Decimal("0.95"), 950),
        (Decimal("1.0"), 1000),
    ]
    settle = "SELECT lq_quota_settle($1, $2, 10, 0, $2, 10, 0)"
    await asyncio.gather(*(_in_transaction(pool, settle, quota.quota_id, AT) for _ in range(100)))
    assert await count(db, "alert_outbox") == 4  # settling moved usage, crossed nothing new
    row = await db.fetchrow("SELECT reserved_tokens, charged_tokens FROM quota_windows")
    assert tuple(row) == (0, 1000)
    body = await db.fetchrow("SELECT payload, window_start FROM alert_outbox LIMIT 1")
    assert '"quota": "daily"' in body["payload"]
    assert body["window_start"] == datetime(2026, 3, 28, 23, 0, tzinfo=UTC)


async def test_a_settlement_after_the_window_boundary_charges_the_new_window(
    service: AlertService, db: asyncpg.Connection
) -> None:
    quota, _ = await service.put_quota(
        "acme", None, "daily", quota_spec(period="day", tokens=1000, cost="5")
    )
    before = datetime(2026, 3, 29, 23, 59, tzinfo=UTC)
    after = datetime(2026, 3, 30, 0, 1, tzinfo=UTC)
    await db.execute("SELECT lq_quota_apply($1, $2, 300, 0, 1.5, 0)", quota.quota_id, before)
    await db.execute(
        "SELECT lq_quota_settle($1, $2, 300, 1.5, $3, 120, 0.6)", quota.quota_id, before, after
    )
    rows = await db.fetch(
        "SELECT window_start, reserved_tokens, charged_tokens, reserved_cost, charged_cost"
        " FROM quota_windows ORDER BY window_start"
    )
    assert [tuple(r)[1:] for r in rows] == [(0, 0, 0, 0), (0, 120, 0, Decimal("0.6"))]
    assert rows[1]["window_start"] == datetime(2026, 3, 30, tzinfo=UTC)


async def test_matching_quotas_by_route_and_model_glob(
    service: AlertService, db: asyncpg.Connection
) -> None:
    await service.put_quota("acme", None, "all", quota_spec(period="day", tokens=1))
    await service.put_quota(
        "acme", None, "gpt", quota_spec(period="day", tokens=1, models=["gpt-4o*", "o1_x"])
    )
    await service.put_quota("acme", "chat", "chat", quota_spec(period="month", tokens=1))
    names = "SELECT array_agg(name ORDER BY quota_id) FROM lq_matching_quotas('acme', $1, $2, NULL)"
    assert await db.fetchval(names, None, "gpt-4o-mini") == ["all", "gpt"]
    assert await db.fetchval(names, "chat", "claude") == ["all", "chat"]
    # `_` is no LIKE wildcard in a model name: o1_x matches itself only.
    assert await db.fetchval(names, None, "o1yx") == ["all"]
    assert await db.fetchval(names, None, "o1_x") == ["all", "gpt"]


async def test_a_top_up_adds_once_per_reference_under_concurrency(
    limiter: Limiter, service: AlertService, db: asyncpg.Connection
) -> None:
    results = await asyncio.gather(
        *(service.top_up("acme", Decimal("12.50"), "invoice-1") for _ in range(50)),
        *(service.top_up("acme", Decimal("1"), f"small-{i}") for i in range(20)),
    )
    first = [r for r in results[:50] if r.applied]
    assert len(first) == 1
    assert {r.entry_id for r in results[:50]} == {first[0].entry_id}
    account = await service.credits("acme")
    assert account.balance == Decimal("32.50")
    assert await count(db, "credit_ledger") == 21
    with pytest.raises(IdempotencyConflict, match="invoice-1"):
        await service.top_up("acme", Decimal("13"), "invoice-1")
    assert await limiter.store.audit() == []


@pytest.mark.constructs_drift  # ends with a forged balance, which the audit must report
async def test_credits_reserve_charge_once_alert_and_the_audit_checks_the_balance(
    limiter: Limiter, service: AlertService, db: asyncpg.Connection
) -> None:
    await service.top_up("acme", Decimal("10"), "t1")
    reservation = uuid.uuid4()
    await db.execute("SELECT lq_credit_apply('acme', NULL, 6, NULL)")
    assert await count(db, "alert_outbox", "event_type = 'credits.threshold'") == 1  # 50%
    for _ in range(2):  # a repeated settlement charges once
        await db.execute("SELECT lq_credit_apply('acme', $1, -6, 8.5)", reservation)
    account = await service.credits("acme")
    assert (account.balance, account.reserved) == (Decimal("1.5"), Decimal(0))
    thresholds = await db.fetch(
        "SELECT threshold FROM alert_outbox WHERE event_type = 'credits.threshold'"
        " ORDER BY threshold"
    )
    assert [r["threshold"] for r in thresholds] == [Decimal("0.5"), Decimal("0.8")]
    # The balance is the ledger's sum; the charge, made up here for a
    # reservation with no usage row, is what the invoice does not have
    # (lq_audit_credit_charges: 8.5 charged, 0 invoiced, in millionths).
    charge_drift = ("credit_charge", 0, 8_500_000)
    findings = await limiter.store.audit()
    assert [(f.check_name, f.expected, f.actual) for f in findings] == [charge_drift]

    with pytest.raises(asyncpg.InsufficientPrivilegeError, match="append-only"):
        await db.execute("UPDATE credit_ledger SET amount = 100")
    await db.execute("UPDATE credit_accounts SET balance = 100 WHERE tenant = 'acme'")
    findings = await limiter.store.audit()
    assert [(f.check_name, f.expected, f.actual) for f in findings] == [
        ("credit_balance", 1_500_000, 100_000_000),
        charge_drift,
    ]


async def test_the_reporting_role_reads_quota_windows_and_credit_balances(
    service: AlertService, app_dsn: str, db: asyncpg.Connection
) -> None:
    quota, _ = await service.put_quota("acme", None, "daily", quota_spec(period="day", tokens=10))
    await db.execute("SELECT lq_quota_apply($1, $2, 0, 7, 0, 0)", quota.quota_id, AT)
    await service.top_up("acme", Decimal("3.25"), "r")
    await db.execute("SET ROLE llmquota_reporting")
    try:
        windows = await db.fetch("SELECT quota_name, usage_tokens FROM reporting.quota_windows")
        assert [tuple(r) for r in windows] == [("daily", 7)]
        usage = await db.fetch(
            "SELECT quota_name, usage_tokens FROM reporting.quota_usage('2026-03-29', '2026-03-30')"
        )
        assert [tuple(r) for r in usage] == [("daily", 7)]
        balances = await db.fetchrow(
            "SELECT balance, ledger_balance, topped_up FROM reporting.credit_balances"
        )
        assert tuple(balances) == (Decimal("3.25"), Decimal("3.25"), Decimal("3.25"))
        with pytest.raises(asyncpg.InsufficientPrivilegeError):
            await db.fetch("SELECT * FROM public.credit_ledger")
    finally:
        await db.execute("RESET ROLE")


async def test_a_deleted_quota_keeps_its_windows(
    service: AlertService, db: asyncpg.Connection
) -> None:
    quota, _ = await service.put_quota("acme", None, "daily", quota_spec(period="day", tokens=10))
    await db.execute("SELECT lq_quota_apply($1, $2, 0, 7, 0, 0)", quota.quota_id, AT)
    await service.delete_quota("acme", None, "daily")
    row = await db.fetchrow("SELECT quota_id, quota_name, charged_tokens FROM quota_windows")
    assert tuple(row) == (None, "daily", 7)
