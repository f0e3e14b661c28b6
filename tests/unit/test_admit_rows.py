"""lq_admit's rows are read by position: every column lands in the field of its name."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any
from zoneinfo import ZoneInfo

import pytest

from llmquota.domain.records import AdmitDecision, TenantFigures, TokenLayerFigures
from llmquota.store.decisions import ADMIT_COLUMNS, admit_decision, admit_decisions

RESETS_AT = datetime(2026, 3, 1, 5, tzinfo=UTC)
ZONE = "America/New_York"
# Columns whose value the decision converts rather than copies.
CONVERTED = {
    "priority": 2,
    "alt_models": ["gpt-4o-mini", "gpt-3.5-turbo"],
    "resets_at": RESETS_AT,
    "quota_timezone": ZONE,
    "degraded": 1,
}


class FakeRecord(tuple[Any, ...]):
    """A row as asyncpg gives it: positions, and the column names."""

    names: tuple[str, ...] = ADMIT_COLUMNS

    def keys(self) -> tuple[str, ...]:
        return self.names


def distinct_row() -> dict[str, Any]:
    """Every column a value no other column has."""
    return {name: CONVERTED.get(name, f"value of {name}") for name in ADMIT_COLUMNS}


def test_each_column_lands_in_the_field_of_its_name() -> None:
    row = distinct_row()
    decision = admit_decision(tuple(row.values()))
    tenant_fields = {f"tenant_{name}": name for name in TenantFigures._fields}
    expected_tenant = TenantFigures(**{f: row[c] for c, f in tenant_fields.items()})
    binding_fields = {f"binding_{name}": name for name in TokenLayerFigures._fields}
    expected_binding = TokenLayerFigures(**{f: row[c] for c, f in binding_fields.items()})
    converted = {
        "tenant": expected_tenant,
        "binding": expected_binding,
        "priority": "high",
        "alt_models": ("gpt-4o-mini", "gpt-3.5-turbo"),
        "resets_at": RESETS_AT.astimezone(ZoneInfo(ZONE)),
        "degraded": True,
    }
    for field in AdmitDecision._fields:
        expected = converted[field] if field in converted else row[field]
        assert getattr(decision, field) == expected, field
    assert str(decision.resets_at.tzinfo if decision.resets_at else None) == ZONE


def test_an_admitted_row_without_refusal_figures_keeps_the_defaults() -> None:
    row = dict.fromkeys(ADMIT_COLUMNS)
    row.update(status="admitted", degraded=False)
    decision = admit_decision(tuple(row.values()))
    assert decision.alt_models == ()
    assert decision.priority is None
    assert decision.resets_at is None
    assert decision.degraded is False
    assert decision.binding is None  # no token layer: no X-TokenLimit-* headers


def test_a_batch_whose_columns_moved_is_refused() -> None:
    row = FakeRecord(distinct_row().values())
    assert admit_decisions([row])[0].status == "value of status"
    moved = FakeRecord(row)
    moved.names = (ADMIT_COLUMNS[0], ADMIT_COLUMNS[2], ADMIT_COLUMNS[1], *ADMIT_COLUMNS[3:])
    with pytest.raises(RuntimeError, match="columns"):
        admit_decisions([moved])
