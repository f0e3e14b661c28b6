"""finance/cell_reports.py: one report over every cell from each cell's answer."""

from __future__ import annotations

from datetime import date
from decimal import Decimal

import pytest

from llmquota.domain.errors import InvalidRequest
from llmquota.finance.cell_reports import merge_cell_reports
from llmquota.finance.reports import ReportResult

DAY = date(2026, 12, 6)


def test_totals_of_the_same_key_add_up_and_null_keys_sort_first() -> None:
    columns = ("day", "model", "requests", "cost_usd", "late_tokens")
    one = ReportResult(
        "reconciliation_daily",
        columns,
        [(DAY, None, 1, Decimal(0), None), (DAY, "b", 2, Decimal("0.5"), 3)],
    )
    two = ReportResult(
        "reconciliation_daily",
        columns,
        [(DAY, "a", 4, Decimal(1), None), (DAY, "b", 1, Decimal("0.25"), None)],
    )
    merged = merge_cell_reports("reconciliation_daily", [one, two])
    assert merged.rows == [
        (DAY, None, 1, Decimal(0), None),
        (DAY, "a", 4, Decimal(1), None),
        (DAY, "b", 3, Decimal("0.75"), 3),
    ]


def test_top_tenants_are_ranked_again_with_ties_sharing_a_rank() -> None:
    columns = ("rank", "tenant", "requests", "total_tokens", "cost_usd", "unpriced_tokens")
    one = ReportResult(
        "top_tenants", columns, [(1, "b", 1, 10, Decimal(5), 0), (2, "d", 1, 10, Decimal(1), 0)]
    )
    two = ReportResult(
        "top_tenants", columns, [(1, "a", 1, 10, Decimal(5), 0), (2, "c", 1, 10, Decimal(3), 0)]
    )
    ranked = merge_cell_reports("top_tenants", [one, two]).rows
    assert [(r[0], r[1]) for r in ranked] == [(1, "a"), (1, "b"), (3, "c"), (4, "d")]


def test_rows_of_tenants_keep_each_cells_order_within_a_tenant() -> None:
    columns = ("day", "tenant", "route", "model")
    one = ReportResult("usage_daily", columns, [(DAY, "b", None, "x"), (DAY, "b", "r", "a")])
    two = ReportResult("usage_daily", columns, [(DAY, "a", None, "z")])
    assert merge_cell_reports("usage_daily", [one, two]).rows == [
        (DAY, "a", None, "z"),
        (DAY, "b", None, "x"),
        (DAY, "b", "r", "a"),
    ]


def test_a_report_that_does_not_add_up_is_refused_with_where_to_run_it() -> None:
    result = ReportResult("reservation_accuracy", ("route",), [])
    with pytest.raises(InvalidRequest, match=r"run it for one tenant \(--tenant\)"):
        merge_cell_reports("reservation_accuracy", [result, result])
