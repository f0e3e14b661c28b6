"""`llmquota report` as a subprocess, on the hand-computed ledger, as the
read-only reporting role: the same numbers as the SQL, to the cent.
"""

from __future__ import annotations

import asyncio
import csv
import io
import json
from datetime import date, datetime
from decimal import Decimal
from typing import Any

import asyncpg

from tests import finance_fixture as fx
from tests.support import REPORTING_ROLE, dsn_as, run_cli


def _expected(value: Any) -> Any:
    """A fixture value as the CLI's JSON writes it."""
    if isinstance(value, datetime | date):
        return value.isoformat()
    if isinstance(value, Decimal):
        return str(value)
    if value is not None and not isinstance(value, int | str):
        return str(value)  # UUID
    return value


def _same(actual: list[dict[str, Any]], expected: list[tuple[Any, ...]]) -> bool:
    """Rows equal, decimals compared as numbers (0.6 == 0.60), everything else exactly."""
    if len(actual) != len(expected):
        return False
    for got, want in zip(actual, expected, strict=True):
        for value, wanted in zip(got.values(), want, strict=True):
            if isinstance(wanted, Decimal):
                if value is None or Decimal(value) != wanted:
                    return False
            elif value != _expected(wanted):
                return False
    return True


async def _report(dsn: str, *args: str) -> list[dict[str, Any]]:
    env = {"LLMQUOTA_REPORTING_DATABASE_URL": dsn_as(dsn, REPORTING_ROLE)}
    result = await asyncio.to_thread(run_cli, "report", *args, "--format", "json", dsn=dsn, env=env)
    rows: list[dict[str, Any]] = json.loads(result.stdout)
    return rows


def _period(period: tuple[date, date]) -> tuple[str, ...]:
    return ("--from", period[0].isoformat(), "--to", period[1].isoformat())


async def test_every_report_through_the_cli_matches_the_hand_computed_figures(
    database_dsn: str, db: asyncpg.Connection
) -> None:
    await fx.load(db)
    march, both = _period(fx.MARCH), _period(fx.MARCH_APRIL)

    daily = await _report(database_dsn, "usage_daily", *march)
    assert tuple(daily[0]) == fx.USAGE_DAILY_COLUMNS
    assert _same(daily, fx.USAGE_DAILY_MARCH)
    invoice = await _report(database_dsn, "invoice-monthly", *both)
    assert _same(invoice, fx.INVOICE_MONTHLY_MARCH_APRIL)
    # The amounts are cents, printed as such.
    assert [line["amount_usd"] for line in invoice] == [
        "-0.01", "0.03", "0.04", "0.04", "0.60", "0.00", None, "10.00",
    ]  # fmt: skip
    assert _same(await _report(database_dsn, "top_tenants", *march), fx.TOP_TENANTS_MARCH)
    accuracy = await _report(database_dsn, "reservation_accuracy", *march)
    assert _same(accuracy, fx.ACCURACY_MARCH)
    reconciliation = await _report(database_dsn, "reconciliation_daily", *march)
    assert _same(reconciliation, fx.RECONCILIATION_MARCH)
    expired = await _report(database_dsn, "expired_reservations", *march)
    assert _same(expired, fx.EXPIRED_MARCH)
    acme = await _report(database_dsn, "usage_daily", *march, "--tenant", "acme")
    assert _same(acme, [r for r in fx.USAGE_DAILY_MARCH if r[1] == "acme"])


async def test_table_and_csv_formats_list_and_empty_period(
    database_dsn: str, db: asyncpg.Connection
) -> None:
    await fx.load(db)
    march = _period(fx.MARCH)

    table = await asyncio.to_thread(run_cli, "report", "top_tenants", *march, dsn=database_dsn)
    assert table.stdout.splitlines() == [
        "rank  tenant  requests  total_tokens  cost_usd  unpriced_tokens",
        "----  ------  --------  ------------  --------  ---------------",
        "   1  beta           4        120600    0.6016              100",
        "   2  acme           5         20700    0.0956                0",
        "(2 rows)",
    ]
    text = await asyncio.to_thread(
        run_cli, "report", "usage_daily", *march, "--format", "csv", dsn=database_dsn
    )
    rows = list(csv.reader(io.StringIO(text.stdout)))
    assert rows[0] == list(fx.USAGE_DAILY_COLUMNS)
    assert rows[1] == ["2025-03-10", "acme", "chat", "gpt-4o", "2", "4000", "1500", "5500",
                       "0.025", "0"]  # fmt: skip
    assert rows[3][2] == ""  # no route: an empty cell
    assert len(rows) == 1 + len(fx.USAGE_DAILY_MARCH)

    listing = await asyncio.to_thread(run_cli, "report", "--list", dsn=database_dsn)
    names = [line.split()[0] for line in listing.stdout.splitlines()[2:-1]]
    assert names == [
        "expired_reservations", "invoice_monthly", "oversubscription", "quota_usage",
        "reconciliation_daily", "reservation_accuracy", "top_tenants", "usage_by_serving_path",
        "usage_daily",
    ]  # fmt: skip

    empty = _period(fx.EMPTY)
    assert await _report(database_dsn, "usage_daily", *empty) == []
    empty_table = await asyncio.to_thread(
        run_cli, "report", "invoice_monthly", *empty, dsn=database_dsn
    )
    assert empty_table.stdout.splitlines()[-1] == "(0 rows)"
    assert empty_table.stdout.splitlines()[0].startswith("month  tenant  route  model")


async def test_bad_report_arguments_are_refused_with_a_message(database_dsn: str) -> None:
    cases = {
        ("report", "usage_daily", "--from", "2025-02-30", "--to", "2025-03-01"): "--from must be",
        ("report", "usage_daily", "--from", "2025-03-01", "--to", "03/04/2025"): "--to must be",
        ("report", "usage_daily", "--from", "2025-03-01", "--to", "2025-03-01"): "must be after",
        ("report", "usage_daily", "--from", "2000-01-01", "--to", "2025-03-01"): "at most 3660",
        ("report", "usage_daily", "--to", "2025-03-01"): "--from is required",
        ("report", "no_such", "--from", "2025-03-01", "--to", "2025-04-01"): "no report",
        ("report", "usage_daily", "--from", "2025-03-01", "--to", "2025-04-01",
         "--tenant", "bad tenant"): "tenant must be ASCII letters",
        ("report", "--from", "2025-03-01", "--to", "2025-04-01"): "name a report",
    }  # fmt: skip
    for args, message in cases.items():
        result = await asyncio.to_thread(run_cli, *args, dsn=database_dsn, check=False)
        assert result.returncode == 2, (args, result.stderr)
        assert message in result.stderr, (args, result.stderr)
        assert result.stdout == ""
