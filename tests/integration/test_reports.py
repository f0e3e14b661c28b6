"""The finance reports, as plain SQL, on a hand-computed ledger, run as the
read-only reporting role; and what that role may not do.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from datetime import date
from decimal import Decimal
from typing import Any

import asyncpg
import pytest

from tests import finance_fixture as fx
from tests.support import REPORTING_ROLE, dsn_as

# Also run on a Citus coordinator by CI's Citus leg (pyproject.toml's markers).
pytestmark = pytest.mark.citus


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
        "usage_by_serving_path",
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


# Rows of revision 0026 on top of the fixture's (whose rows have no path:
# primary), as lq_finish and the response cache write them. gpt-4o costs
# 2.50 / 10.00 per million before 03-15 and 2.00 / 8.00 from then on.
# (reservation, tenant, model, in, out, reserved, path, saved in/out, price, day)
SERVED: list[tuple[Any, ...]] = [
    # a hit priced 0.001; it saved 2000/1000 at 2.50/10.00: 0.005 + 0.01 = 0.015
    (101, "acme", "gpt-4o", 0, 0, 0, "cache", 2000, 1000, Decimal("0.001"), 12),
    # a hit without a price; it saved 1000/500 at 2.00/8.00: 0.002 + 0.004 = 0.006
    (102, "acme", "gpt-4o", 0, 0, 0, "cache", 1000, 500, None, 16),
    # claude-3 at 3.00/15.00: 0.0012 + 0.009 = 0.0102
    (103, "acme", "claude-3", 400, 600, 1000, "fallback_model", None, None, None, 12),
    # a hit of an unpriced model at 0.5: its price alone, nothing saved that has a price
    (104, "beta", "mystery", 0, 0, 0, "cache", 10, 20, Decimal("0.5"), 12),
    (105, "beta", "gpt-4o", 1000, 100, 2000, "queued", None, None, None, 13),  # 0.0035
    (106, "beta", "gpt-4o", 100, 100, 200, "second_deployment", None, None, None, 14),  # 0.00125
]


async def test_usage_by_serving_path(finance: asyncpg.Connection, db: asyncpg.Connection) -> None:
    await db.executemany(
        "INSERT INTO usage_ledger (reservation_id, entry_kind, tenant, model, input_tokens,"
        " output_tokens, reserved_tokens, outcome, serving_path, saved_input_tokens,"
        " saved_output_tokens, price_usd, recorded_at)"
        " VALUES ($1, 'usage', $2, $3, $4, $5, $6, 'ok', $7, $8, $9, $10,"
        "         make_timestamptz(2025, 3, $11, 12, 0, 0, 'UTC'))",
        [(fx_id(n), *rest) for n, *rest in SERVED],
    )
    # (tenant, path, requests, in, out, saved in, saved out, cost, saved cost)
    assert await _report(finance, "usage_by_serving_path", fx.MARCH) == [
        ("acme", "cache", 2, 0, 0, 3000, 1500, Decimal("0.001"), Decimal("0.021")),
        ("acme", "fallback_model", 1, 400, 600, 0, 0, Decimal("0.0102"), Decimal("0")),
        # the fixture's rows, adjustment included: top_tenants' 20700 tokens, 0.0956
        ("acme", "primary", 5, 15700, 5000, 0, 0, Decimal("0.0956"), Decimal("0")),
        ("beta", "cache", 1, 0, 0, 10, 20, Decimal("0.5"), Decimal("0")),
        ("beta", "primary", 4, 100450, 20150, 0, 0, Decimal("0.6016"), Decimal("0")),
        ("beta", "queued", 1, 1000, 100, 0, 0, Decimal("0.0035"), Decimal("0")),
        ("beta", "second_deployment", 1, 100, 100, 0, 0, Decimal("0.00125"), Decimal("0")),
    ]
    beta = await _report(finance, "usage_by_serving_path", fx.MARCH, "beta")
    assert [row[:3] for row in beta] == [
        ("beta", "cache", 1),
        ("beta", "primary", 4),
        ("beta", "queued", 1),
        ("beta", "second_deployment", 1),
    ]
    # A hit's price is the tenant's cost (top_tenants), but neither provider usage
    # (reconciliation_daily: 03-12 holds the fallback's claude-3 alone) nor a
    # reservation (reservation_outcomes).
    top = await _report(finance, "top_tenants", fx.MARCH)
    assert [(r[1], r[4]) for r in top] == [
        ("beta", Decimal("1.10635")),
        ("acme", Decimal("0.1068")),
    ]
    reconciled = await _report(
        finance, "reconciliation_daily", (date(2025, 3, 12), date(2025, 3, 13))
    )
    assert [(r[1], r[2]) for r in reconciled] == [("claude-3", 1)]
    hits = [fx_id(n) for n, _, _, _, _, _, path, *_ in SERVED if path == "cache"]
    assert (
        await finance.fetchval(
            "SELECT count(*) FROM reporting.reservation_outcomes WHERE reservation_id = ANY ($1)",
            hits,
        )
        == 0
    )


def fx_id(n: int) -> Any:
    return uuid.UUID(int=n)
