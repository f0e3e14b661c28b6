"""Finance reports over a database of cells: each cell's report, merged.

A database of cells (`llmquota migrate --cells K`) keeps each tenant, with
its ledger, in one cell, and each cell has its own report functions (in
`cell_k_reporting`, reading only that cell). A report over the whole
database runs in every cell and merges the answers by the report's rule:

- rows: a report whose rows each belong to one tenant is the cells' rows
  together, in the report's order (a stable sort by the leading columns
  that order it: a tenant's rows all come from one cell, in that cell's
  order);
- sums: a report of totals (per day and model) adds the cells' rows of the
  same key;
- rank: top tenants are ranked again over every cell's tenants.

Text keys are ordered by code point, as the C collation orders them; a
database with a linguistic collation orders mixed-case names otherwise.

A report for one tenant runs in that tenant's cell alone, so any report,
however it aggregates, is exact for a tenant. A report that is neither
(percentiles over every tenant: reservation_accuracy) is refused over the
whole database with how to run it instead.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from decimal import Decimal
from typing import Any, Literal

from llmquota.domain.errors import InvalidRequest
from llmquota.finance.reports import ReportResult

__all__ = ["merge_cell_reports"]


@dataclass(frozen=True, slots=True)
class _Merge:
    rule: Literal["rows", "sums", "rank"]
    # rows: the leading columns of the report's ORDER BY; sums: the key
    # (NULLs first, as the reports order them); rank: the column ranked by.
    columns: tuple[str, ...]


_MERGES = {
    "usage_daily": _Merge("rows", ("day", "tenant")),
    "invoice_monthly": _Merge("rows", ("month", "tenant")),
    "expired_reservations": _Merge("rows", ("expired_at", "reservation_id")),
    "quota_usage": _Merge("rows", ("tenant",)),
    "usage_by_serving_path": _Merge("rows", ("tenant",)),
    "reconciliation_daily": _Merge("sums", ("day", "model")),
    "top_tenants": _Merge("rank", ("cost_usd",)),
}


def _key(columns: Sequence[str], names: tuple[str, ...]) -> Callable[[tuple[Any, ...]], Any]:
    at = [columns.index(name) for name in names]
    # (value is not None, value): NULL sorts first, as NULLS FIRST does.
    return lambda row: tuple((row[i] is not None, row[i]) for i in at)


def _sums(
    columns: Sequence[str], key: tuple[str, ...], rows: list[tuple[Any, ...]]
) -> list[tuple[Any, ...]]:
    at = {columns.index(name) for name in key}
    totals: dict[tuple[Any, ...], list[Any]] = {}
    for row in rows:
        ident = tuple(row[i] for i in sorted(at))
        if ident not in totals:
            totals[ident] = list(row)
            continue
        total = totals[ident]
        for i, value in enumerate(row):
            if i not in at and value is not None:
                total[i] = value if total[i] is None else _trimmed(total[i] + value)
    return sorted((tuple(t) for t in totals.values()), key=_key(columns, key))


def _trimmed(value: Any) -> Any:
    """A sum as the report's trim_scale() prints it: 0.5 + 0.5 is 1, not 1.0."""
    if not isinstance(value, Decimal) or value == value.to_integral_value():
        return value.to_integral_value() if isinstance(value, Decimal) else value
    return value.normalize()


def _ranked(columns: Sequence[str], by: str, rows: list[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
    """rank() OVER (ORDER BY `by` DESC), then by tenant, as top_tenants orders."""
    value, rank_at, tenant = columns.index(by), columns.index("rank"), columns.index("tenant")
    ordered = sorted(rows, key=lambda row: row[tenant])
    ordered.sort(key=lambda row: row[value], reverse=True)
    ranked: list[tuple[Any, ...]] = []
    for place, row in enumerate(ordered, start=1):
        # equal values share the rank of the first of them, as rank() gives
        tied = ranked and ordered[place - 2][value] == row[value]
        rank = ranked[-1][rank_at] if tied else place
        ranked.append((*row[:rank_at], rank, *row[rank_at + 1 :]))
    return ranked


def merge_cell_reports(name: str, results: Sequence[ReportResult]) -> ReportResult:
    """One report over every cell from each cell's answer (InvalidRequest for a
    report that does not add up over cells)."""
    merge = _MERGES.get(name)
    if merge is None:
        raise InvalidRequest(
            f"report {name} does not add up over cells: run it for one tenant (--tenant), "
            "or for one cell at its DSN (search_path=cell_k)"
        )
    columns = results[0].columns
    rows = [row for result in results for row in result.rows]
    if merge.rule == "rows":
        rows.sort(key=_key(columns, merge.columns))
    elif merge.rule == "sums":
        rows = _sums(columns, merge.columns, rows)
    else:
        rows = _ranked(columns, merge.columns[0], rows)
    return ReportResult(name=name, columns=columns, rows=rows)
