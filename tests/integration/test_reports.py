"""The finance reports, as plain SQL, on a hand-computed ledger, run as the
read-only reporting role; and what that role may not do.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import date
from decimal import Decimal
from typing import Any

import asyncpg
import pytest

from tests import finance_fixture as fx
from tests.support import REPORTING_ROLE, dsn_as


@pytest.fixture
async def finance(database_dsn: str, db: asyncpg.Connection) -> AsyncIterator[asyncpg.Connection]:
    """A connection as llmquota_reporting to a database holding the fixture."""
    await fx.load(db)
    connection = await asyncpg.connect(dsn_as(database_dsn, REPORTING_ROLE))
    yield connection
    await connection.close()


async def _report(
    connection: asyncpg.Connection, name: str, period: tuple[date, date], tenant: str | None = None
) -> list[tuple[Any, ...]]:
    rows = await connection.fetch(
        f"SELECT * FROM reporting.{name}($1, $2, $3)", period[0], period[1], tenant
    )
    return [tuple(row.values()) for row in rows]


async def test_usage_daily(finance: asyncpg.Connection) -> None:
    rows = await finance.fetch("SELECT * FROM reporting.usage_daily('2025-03-01', '2025-04-01')")
    assert tuple(rows[0].keys()) == fx.USAGE_DAILY_COLUMNS
    assert [tuple(r.values()) for r in rows] == fx.USAGE_DAILY_MARCH
    acme = await _report(finance, "usage_daily", fx.MARCH, "acme")
    assert acme == [r for r in fx.USAGE_DAILY_MARCH if r[1] == "acme"]
    # 2025-02-28 23:59:59.999999 is February's; March starts at midnight UTC.
    february = await _report(finance, "usage_daily", (date(2025, 2, 28), date(2025, 3, 1)))
    assert [(r[0], r[1], r[8]) for r in february] == [(date(2025, 2, 28), "gamma", Decimal("2.5"))]


async def test_invoice_monthly(finance: asyncpg.Connection) -> None:
    rows = await _report(finance, "invoice_monthly", fx.MARCH_APRIL)
    assert rows == fx.INVOICE_MONTHLY_MARCH_APRIL
    # Lines add up to the month's total cost, to the cent.
    march = sum(r[10] for r in rows if r[0] == date(2025, 3, 1) and r[10] is not None)
    assert round(march, 2) == round(fx.TOP_TENANTS_MARCH[0][4] + fx.TOP_TENANTS_MARCH[1][4], 2)


async def test_top_tenants(finance: asyncpg.Connection) -> None:
    assert await _report(finance, "top_tenants", fx.MARCH) == fx.TOP_TENANTS_MARCH
    assert await _report(finance, "top_tenants", fx.MARCH_APRIL) == fx.TOP_TENANTS_MARCH_APRIL
    top1 = await finance.fetch(
        "SELECT tenant FROM reporting.top_tenants('2025-03-01', '2025-05-01') LIMIT 1"
    )
    assert [r["tenant"] for r in top1] == ["beta"]


async def test_reservation_accuracy(finance: asyncpg.Connection) -> None:
    assert await _report(finance, "reservation_accuracy", fx.MARCH) == fx.ACCURACY_MARCH


async def test_reconciliation_daily(finance: asyncpg.Connection) -> None:
    assert await _report(finance, "reconciliation_daily", fx.MARCH) == fx.RECONCILIATION_MARCH


async def test_expired_reservations(finance: asyncpg.Connection) -> None:
    assert await _report(finance, "expired_reservations", fx.MARCH) == fx.EXPIRED_MARCH


async def test_an_empty_period_gives_empty_reports(finance: asyncpg.Connection) -> None:
    for name in (
        "usage_daily",
        "invoice_monthly",
        "top_tenants",
        "reservation_accuracy",
        "reconciliation_daily",
        "expired_reservations",
        "quota_usage",
    ):
        assert await _report(finance, name, fx.EMPTY) == []


async def test_the_reporting_role_reads_reports_and_nothing_else(
    finance: asyncpg.Connection,
) -> None:
    assert await finance.fetchval("SELECT count(*) FROM reporting.ledger_entries") == len(fx.ROWS)
    assert await finance.fetchval("SELECT count(*) FROM reporting.model_prices") == 3
    for statement in (
        "SELECT * FROM usage_ledger",
        "SELECT * FROM usage_ledger_default",
        "SELECT * FROM reservations",
        "SELECT * FROM limit_layers",
        "SELECT * FROM tenants",
        "SELECT * FROM api_keys",
        "SELECT * FROM ledger_receipts",
        "SELECT * FROM model_prices",
        "INSERT INTO usage_ledger (entry_kind, tenant, input_tokens, output_tokens,"
        " reserved_tokens, outcome, reason) VALUES ('adjustment', 'acme', 1, 1, 0,"
        " 'adjustment', 'x')",
        "SELECT * FROM lq_sweep(10)",
        "SELECT * FROM lq_ensure_ledger_partitions(3)",
        "SELECT * FROM lq_export_ledger(0, 10, 10)",
        "DELETE FROM reporting.model_prices",
        "CREATE TABLE reporting.mine (x int)",
    ):
        with pytest.raises(asyncpg.InsufficientPrivilegeError):
            await finance.execute(statement)
