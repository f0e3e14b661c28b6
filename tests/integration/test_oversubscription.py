"""The oversubscription report in SQL: the reporting view and function, as the finance role.

The figures of tests/oversubscription_fixture.py were worked out by hand;
the view (the last 7 days, the default rule) and the function (any period,
any rule) must read exactly those, as llmquota_reporting, which may read
neither the layers nor the ledger themselves.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from datetime import timedelta
from decimal import Decimal as D
from typing import Any

import asyncpg
import pytest

from llmquota.admin.service import AdminService
from llmquota.admission.limiter import Limiter
from llmquota.domain.plans import Ceiling
from tests import oversubscription_fixture as fx


@pytest.fixture
async def admin(limiter: Limiter) -> AdminService:
    return AdminService(limiter.store)


@pytest.fixture
async def finance(reporting_dsn: str) -> AsyncIterator[asyncpg.Connection]:
    """A connection as the read-only reporting role."""
    connection = await asyncpg.connect(reporting_dsn)
    yield connection
    await connection.close()


def _figures(row: asyncpg.Record, expected: dict[str, Any]) -> dict[str, Any]:
    return {name: row[name] for name in expected}


async def test_the_view_reads_the_hand_computed_figures_as_the_reporting_role(
    admin: AdminService, db: asyncpg.Connection, finance: asyncpg.Connection
) -> None:
    await fx.set_up_limits(admin, db)
    await fx.seed_ledger(db)
    (row,) = await finance.fetch("SELECT * FROM reporting.ceiling_oversubscription")
    assert _figures(row, fx.EXPECTED_7_DAYS) == fx.EXPECTED_7_DAYS
    # the period: the last 7 days up to now, by the database clock
    assert row["period_end"] - row["period_start"] == timedelta(days=7)
    assert await finance.fetchval("SELECT $1::timestamptz <= now()", row["period_end"])
    # the function over 9 days takes in the minute of 45 tenants 8 days ago
    (nine,) = await finance.fetch("SELECT * FROM reporting.oversubscription(9)")
    assert _figures(nine, fx.EXPECTED_9_DAYS) == fx.EXPECTED_9_DAYS
    # what the view stands on, readable by finance too
    reach = await finance.fetch(
        "SELECT tenant, reach_tokens_per_minute, reach_requests_per_minute"
        " FROM reporting.ceiling_tenant_limits WHERE ceiling = $1 ORDER BY tenant",
        fx.CEILING,
    )
    assert [r["tenant"] for r in reach] == fx.TENANTS  # not the suspended tenant
    assert {(r[1], r[2]) for r in reach} == {(fx.TENANT_TPM, fx.TENANT_RPM)}
    per_minute = await finance.fetch(
        "SELECT minute, count(DISTINCT tenant) AS active FROM reporting.ceiling_activity"
        " WHERE recorded_at > now() - interval '7 days' GROUP BY minute ORDER BY minute"
    )
    assert [r["active"] for r in per_minute] == fx.WEEK
    # ... and nothing under them
    with pytest.raises(asyncpg.InsufficientPrivilegeError):
        await finance.fetch("SELECT * FROM limit_layers")
    with pytest.raises(asyncpg.InsufficientPrivilegeError):
        await finance.fetch("SELECT * FROM usage_ledger")


async def test_the_service_reads_the_same_figures_through_its_named_statement(
    admin: AdminService, db: asyncpg.Connection
) -> None:
    await fx.set_up_limits(admin, db)
    await fx.seed_ledger(db)
    (week,) = await admin.ceiling_oversubscription(fx.CEILING, 7)
    assert week.ratio == D("2.78") and week.verdict == "warn"
    assert (week.active_tenants.p50, week.active_tenants.p95, week.active_tenants.max) == (
        10,
        19,
        20,
    )
    assert [o.ceiling for o in await admin.ceiling_oversubscription(None, 9)] == [fx.CEILING]


async def _ceiling(admin: AdminService, **limits: int) -> None:
    await admin.put_ceiling("c", Ceiling(models=["gpt-4o"], **limits))


async def _row(db: asyncpg.Connection, *rule: float) -> asyncpg.Record:
    args = ", ".join(["7", *(f"{r}::numeric" for r in rule)])
    (row,) = await db.fetch(f"SELECT * FROM reporting.oversubscription({args})")
    return row


async def test_a_tenant_counts_at_most_the_whole_ceiling_and_an_unlimited_one_as_all_of_it(
    admin: AdminService, db: asyncpg.Connection
) -> None:
    await _ceiling(admin, tokens_per_minute=5_000)
    await admin.put_tenant_policy("small", None, {"tokens_per_minute": 1_000})
    await admin.put_tenant_policy("huge", None, {"tokens_per_minute": 1_000_000})
    await admin.put_tenant_policy("open", None, {"max_in_flight": 4})
    row = await _row(db)
    # 1,000 + min(1,000,000, 5,000) + 5,000 (no token limit) = 11,000; 11,000 / 5,000
    assert row["sum_tenant_tokens_per_minute"] == 11_000
    assert row["ratio"] == D("2.20")
    assert (row["tenants"], row["tenants_without_token_limit"]) == (3, 1)
    # the ceiling has no request rate: no request figures, and they cannot vote
    assert row["requests_per_minute"] is None
    assert row["sum_tenant_requests_per_minute"] is None
    assert row["requests_ratio"] is None
    assert row["tenants_without_request_limit"] is None
    assert row["verdict"] == "warn"
    # no activity at all: 0 tenants active, an effective load of nothing
    assert (row["active_minutes"], row["active_tenants_p95"], row["active_tenants_max"]) == (
        0,
        0,
        0,
    )
    assert (row["effective_tokens_per_minute"], row["effective_ratio"]) == (0, D("0.00"))


@pytest.mark.parametrize(
    ("tenants", "verdict"), [(2, "ok"), (3, "warn"), (4, "critical")], ids=["2x", "3x", "4x"]
)
async def test_the_verdict_is_above_the_rule_not_at_it(
    admin: AdminService, db: asyncpg.Connection, tenants: int, verdict: str
) -> None:
    await _ceiling(admin, tokens_per_minute=5_000)
    for i in range(tenants):
        await admin.put_tenant_policy(f"t{i}", None, {"tokens_per_minute": 5_000})
    row = await _row(db)
    assert row["ratio"] == D(tenants)
    assert row["verdict"] == verdict


async def test_the_verdict_is_the_worse_of_tokens_and_requests_by_the_rule_given(
    admin: AdminService, db: asyncpg.Connection
) -> None:
    await _ceiling(admin, tokens_per_minute=10_000, requests_per_minute=100)
    for i in range(2):
        await admin.put_tenant_policy(
            f"t{i}", None, {"tokens_per_minute": 1_000, "requests_per_minute": 100}
        )
    row = await _row(db)
    assert (row["ratio"], row["requests_ratio"]) == (D("0.20"), D("2.00"))
    assert row["verdict"] == "ok"  # 2.00 is not above 2
    assert (await _row(db, 1.5, 1.9))["verdict"] == "critical"  # 200 > 1.9 x 100
    assert (await _row(db, 1.5, 2))["verdict"] == "warn"


async def test_a_ceiling_of_concurrency_alone_has_no_ratios_and_is_ok(
    admin: AdminService, db: asyncpg.Connection
) -> None:
    await _ceiling(admin, max_in_flight=10)
    await admin.put_tenant_policy("t", None, {"tokens_per_minute": 1_000})
    row = await _row(db)
    assert row["tenants"] == 1
    assert row["ratio"] is None and row["requests_ratio"] is None
    assert row["effective_ratio"] is None
    assert row["verdict"] == "ok"


async def test_the_report_reads_only_the_ledger_partitions_of_its_period(
    admin: AdminService, db: asyncpg.Connection
) -> None:
    await _ceiling(admin, tokens_per_minute=1_000)
    for months_back in (2, 3):  # partitions wholly before the period
        await db.fetchval(
            "SELECT lq_create_ledger_partition("
            " (date_trunc('month', now() AT TIME ZONE 'UTC') - make_interval(months => $1))::date)",
            months_back,
        )
    plan = "\n".join(
        r[0]
        for r in await db.fetch(
            "EXPLAIN (ANALYZE, COSTS OFF, TIMING OFF, SUMMARY OFF)"
            " SELECT * FROM reporting.oversubscription(7)"
        )
    )
    scanned = set(re.findall(r" on (usage_ledger_[0-9_a-z]+)", plan))
    in_period = {
        f"usage_ledger_{r[0]}"
        for r in await db.fetch(
            "SELECT to_char(m, 'YYYY_MM') FROM generate_series("
            " date_trunc('month', (now() - interval '7 days') AT TIME ZONE 'UTC'),"
            " date_trunc('month', now() AT TIME ZONE 'UTC'), interval '1 month') AS m"
        )
    } | {"usage_ledger_default"}
    every = {
        r[0]
        for r in await db.fetch(
            "SELECT c.relname FROM pg_inherits AS i JOIN pg_class AS c ON c.oid = i.inhrelid"
            " WHERE i.inhparent = 'usage_ledger'::regclass"
        )
    }
    assert len(every - in_period) >= 5  # two months before, three ahead
    assert scanned and scanned <= in_period, plan


async def test_a_response_cache_hit_is_no_activity_at_the_ceiling(
    admin: AdminService, db: asyncpg.Connection
) -> None:
    """A hit never reached the provider: ceiling_activity counts only the rows
    that did, so a tenant served from the cache is not an active tenant there."""
    await _ceiling(admin, tokens_per_minute=5_000)
    await db.executemany(
        "INSERT INTO usage_ledger (reservation_id, entry_kind, tenant, model, input_tokens,"
        " output_tokens, reserved_tokens, outcome, serving_path)"
        " VALUES (gen_random_uuid(), 'usage', $1, 'gpt-4o', $2, $3, $4, 'ok', $5)",
        [("served", 100, 20, 200, "primary"), ("cached", 0, 0, 0, "cache")],
    )
    rows = await db.fetch("SELECT ceiling, tenant FROM reporting.ceiling_activity")
    assert [(r["ceiling"], r["tenant"]) for r in rows] == [("c", "served")]
