"""Pure parts of the finance side: the statements exist, input is validated,
and rendering keeps decimals exact.
"""

from __future__ import annotations

import inspect
import re
from datetime import UTC, date, datetime, timedelta, timezone
from decimal import Decimal

import pytest

from llmquota.cli.tabular import render
from llmquota.domain.errors import InvalidRequest
from llmquota.finance import ledger, reports
from llmquota.finance.ledger import (
    MAX_ADJUSTMENT_TOKENS,
    check_adjustment_tokens,
    check_reason,
    parse_effective_from,
    parse_price,
)
from llmquota.finance.reports import MAX_REPORT_DAYS, normalize_name, parse_period
from llmquota.store.sqlfiles import named_queries, report_scripts


def _names_used() -> set[str]:
    source = inspect.getsource(ledger) + inspect.getsource(reports)
    names = set(re.findall(r'_fetch\(\s*"([a-z_]+)"', source))
    return names | set(re.findall(r'_sql\["([a-z_]+)"\]', source))


def test_every_finance_statement_exists_and_is_used() -> None:
    used = _names_used()
    assert used >= {"adjust_ledger", "export_ledger", "set_price", "list_prices", "run_report"}
    assert used == set(named_queries("finance_queries.sql"))


def test_report_scripts_define_the_listed_reports() -> None:
    text = "\n".join(report_scripts())
    assert text.startswith("-- The reporting schema")  # the base views come first
    for name in ("usage_daily", "invoice_monthly", "top_tenants", "reservation_accuracy",
                 "reconciliation_daily", "expired_reservations",
                 "usage_by_serving_path"):  # fmt: skip
        assert f"CREATE OR REPLACE FUNCTION reporting.{name}(" in text
        assert f"COMMENT ON FUNCTION reporting.{name}(date, date, text)" in text


@pytest.mark.parametrize(
    ("text", "value"),
    [("2.50", Decimal("2.50")), ("10", Decimal(10)), ("0", Decimal(0)),
     ("0.000001", Decimal("0.000001")), ("1000000", Decimal(1_000_000))],
)  # fmt: skip
def test_parse_price_accepts_plain_decimals(text: str, value: Decimal) -> None:
    assert parse_price("--x", text) == value


@pytest.mark.parametrize(
    ("text", "message"),
    [("1000000.01", "between"), ("0.0000001", "decimal places"),
     # Anything but ASCII digits and one point, though Decimal() takes it:
     ("-0.01", "decimal number"), ("+1", "decimal number"), ("NaN", "decimal number"),
     ("Infinity", "decimal number"), ("1e-7", "decimal number"), ("two", "decimal number"),
     ("", "decimal number"), (" 10 ", "decimal number"), ("1_000", "decimal number"),
     ("\u0661\u0662\u0663", "decimal number"), ("\uff11\uff12\uff13", "decimal number"),
     ("2.", "decimal number"), (".5", "decimal number")],
)  # fmt: skip
def test_parse_price_refuses(text: str, message: str) -> None:
    with pytest.raises(InvalidRequest, match=message):
        parse_price("--x", text)


def test_parse_effective_from() -> None:
    assert parse_effective_from("2026-03-01") == datetime(2026, 3, 1, tzinfo=UTC)
    assert parse_effective_from("2026-03-01T12:30:00+02:00") == datetime(
        2026, 3, 1, 12, 30, tzinfo=timezone(timedelta(hours=2))
    )
    assert parse_effective_from("2026-03-01T12:30:00Z") == datetime(2026, 3, 1, 12, 30, tzinfo=UTC)
    for bad in ("2026-02-30", "yesterday", "2026-03-01T12:00:00", " 2026-03-01",
                "\u0662\u0660\u0662\u0666-03-01", "\uff12\uff10\uff12\uff16-03-01",
                "2026-03-01T1\uff12:00Z"):  # fmt: skip
        with pytest.raises(InvalidRequest):
            parse_effective_from(bad)
    with pytest.raises(InvalidRequest, match="empty"):
        parse_effective_from("")
    # asyncpg would send 0001-01-01 as -infinity: every usage ever priced.
    with pytest.raises(InvalidRequest, match="2000-01-01 or later"):
        parse_effective_from("0001-01-01")


def test_adjustment_checks() -> None:
    assert check_adjustment_tokens(-5) == -5
    for bad in (0, MAX_ADJUSTMENT_TOKENS + 1, -MAX_ADJUSTMENT_TOKENS - 1, True, 1.5, "7"):
        with pytest.raises(InvalidRequest):
            check_adjustment_tokens(bad)
    assert check_reason("outage credit") == "outage credit"
    for bad_reason in ("", "   ", None, "x" * 1001):
        with pytest.raises(InvalidRequest):
            check_reason(bad_reason)


def test_parse_period() -> None:
    assert parse_period("2026-03-01", "2026-04-01") == (date(2026, 3, 1), date(2026, 4, 1))
    with pytest.raises(InvalidRequest, match="must be after"):
        parse_period("2026-03-01", "2026-03-01")
    with pytest.raises(InvalidRequest, match=f"at most {MAX_REPORT_DAYS}"):
        parse_period("2000-01-01", "2026-03-01")
    with pytest.raises(InvalidRequest, match="--from is required"):
        parse_period(None, "2026-03-01")
    with pytest.raises(InvalidRequest, match="--to must be a date"):
        parse_period("2026-03-01", "20260401")
    assert normalize_name(" Usage-Daily ") == "usage_daily"


def test_render_keeps_decimals_exact_in_every_format() -> None:
    columns = ("day", "route", "cost_usd", "requests")
    rows = [(date(2026, 3, 1), None, Decimal("0.0000010"), 3)]
    assert render(columns, rows, "json") == (
        '[\n  {\n    "day": "2026-03-01",\n    "route": null,\n'
        '    "cost_usd": "0.0000010",\n    "requests": 3\n  }\n]\n'
    )
    assert render(columns, rows, "csv") == "day,route,cost_usd,requests\n2026-03-01,,0.0000010,3\n"
    assert render(columns, rows, "table").splitlines() == [
        "day         route   cost_usd  requests",
        "----------  -----  ---------  --------",
        "2026-03-01         0.0000010         3",
        "(1 row)",
    ]
    assert render(columns, [], "json") == "[]\n"
    assert render(columns, [], "csv") == "day,route,cost_usd,requests\n"


def test_report_days_are_ascii_digits() -> None:
    for bad in ("\u0662\u0660\u0662\u0666-03-01", "2026-03-01\n", "\uff12\uff10\uff12\uff16-03-01"):
        with pytest.raises(InvalidRequest, match="must be a date"):
            parse_period(bad, "2026-04-01")
