"""Seed 001's oversubscribed account, with a ledger whose figures were worked out by hand.

Limits: 50 tenants at 5,000 tokens and 100 requests a minute (t01..t30 from
the plan `free`, t31..t50 from their own policies) under the provider
ceiling `openai-gpt4o` (gpt-4o and gpt-4o-2024-*) of 90,000 tokens and
5,000 requests a minute. A suspended tenant with the same limits cannot
reach it, and t01's route policy of 100,000 tokens a minute only narrows
t01's traffic on that route: neither changes a sum.

  tokens:   50 x 5,000 = 250,000; 250,000 / 90,000 = 2.777... -> 2.78
            (two decimals, half away from zero); warn: above 2 x 90,000 =
            180,000, not above 3 x 90,000 = 270,000
  requests: 50 x 100 = 5,000;     5,000 / 5,000 = 1.00

Ledger ('usage' rows unless said), minutes counted from BASE, three hours
ago rounded down to the minute:
  minute k = 1..20   t01..tk each settle a gpt-4o (even tenants: gpt-4o-2024-08-06):
                     k tenants active
  minute 1           t01 twice more: still 1 tenant
  minute 3           t30..t49 on claude-3-5-sonnet: not the ceiling's, still 3
  minute 40          claude-3-5-sonnet only: not an active minute of the ceiling
  minute 41          t47 on gpt-4o-mini: matches neither pattern
  minute 42          an adjustment and a late row of gpt-4o: not traffic
  8 days ago         t01..t45 on gpt-4o: 45 tenants, outside the last 7 days

Last 7 days: 20 active minutes counting 1, 2, ..., 20 tenants. Nearest rank
(the ceil(q * n)-th smallest): p50 = 10th = 10, p95 = 19th = 19, max 20.
Effective: the 19 largest limits, 19 x 5,000 = 95,000 / 90,000 = 1.0555... ->
1.06 and 19 x 100 = 1,900 / 5,000 = 0.38.
Last 9 days: 21 minutes, 1..20 and 45: p50 = 11th = 11, p95 = 20th = 20, max
45; effective 20 x 5,000 = 100,000 -> 1.11, 20 x 100 = 2,000 -> 0.40.
"""

from __future__ import annotations

import math
import uuid
from datetime import timedelta
from decimal import Decimal as D
from typing import Any

import asyncpg

from llmquota.admin.service import AdminService
from llmquota.domain.plans import Ceiling, Plan
from llmquota.domain.policy import Policy

CEILING = "openai-gpt4o"
MODELS = ["gpt-4o", "gpt-4o-2024-*"]
CEILING_TPM = 90_000
CEILING_RPM = 5_000
PLAN = "free"
TENANT_TPM = 5_000
TENANT_RPM = 100
TENANTS = [f"t{i:02d}" for i in range(1, 51)]
PLAN_TENANTS = TENANTS[:30]
SUSPENDED = "zz-suspended"
ROUTE = "bulk"
ROUTE_TPM = 100_000
ACTIVE_MINUTES = 20  # minute k has k tenants
OLD_ACTIVE = 45  # tenants active in the one minute 8 days ago


def nearest_rank(counts: list[int], share: float) -> int:
    """The ceil(share * n)-th smallest count: a percentile that really happened."""
    ordered = sorted(counts)
    return ordered[math.ceil(share * len(ordered)) - 1]


WEEK = list(range(1, ACTIVE_MINUTES + 1))
NINE_DAYS = [*WEEK, OLD_ACTIVE]
assert (nearest_rank(WEEK, 0.5), nearest_rank(WEEK, 0.95), max(WEEK)) == (10, 19, 20)
assert (nearest_rank(NINE_DAYS, 0.5), nearest_rank(NINE_DAYS, 0.95)) == (11, 20)

# The report's figures, as computed above.
EXPECTED_7_DAYS: dict[str, Any] = {
    "ceiling": CEILING,
    "tenants": 50,
    "tenants_without_token_limit": 0,
    "tenants_without_request_limit": 0,
    "tokens_per_minute": 90_000,
    "sum_tenant_tokens_per_minute": 250_000,
    "ratio": D("2.78"),
    "requests_per_minute": 5_000,
    "sum_tenant_requests_per_minute": 5_000,
    "requests_ratio": D("1.00"),
    "active_minutes": 20,
    "active_tenants_p50": 10,
    "active_tenants_p95": 19,
    "active_tenants_max": 20,
    "effective_tokens_per_minute": 95_000,
    "effective_ratio": D("1.06"),
    "effective_requests_per_minute": 1_900,
    "effective_requests_ratio": D("0.38"),
    "verdict": "warn",
}
EXPECTED_9_DAYS: dict[str, Any] = {
    **EXPECTED_7_DAYS,
    "active_minutes": 21,
    "active_tenants_p50": 11,
    "active_tenants_p95": 20,
    "active_tenants_max": 45,
    "effective_tokens_per_minute": 100_000,
    "effective_ratio": D("1.11"),
    "effective_requests_per_minute": 2_000,
    "effective_requests_ratio": D("0.40"),
}


async def set_up_limits(admin: AdminService, db: asyncpg.Connection) -> None:
    """The plan, the 50 tenants, the suspended one, t01's route and the ceiling."""
    await admin.put_plan(
        PLAN, Plan(priority="low", tokens_per_minute=TENANT_TPM, requests_per_minute=TENANT_RPM)
    )
    own = {"tokens_per_minute": TENANT_TPM, "requests_per_minute": TENANT_RPM}
    for tenant in TENANTS:
        if tenant in PLAN_TENANTS:
            await admin.put_tenant_policy(tenant, PLAN, {})
        else:
            await admin.put_tenant_policy(tenant, None, own)
    await admin.put_tenant_policy(SUSPENDED, None, own)
    await db.execute("UPDATE tenants SET suspended_at = now() WHERE tenant = $1", SUSPENDED)
    # a route's limit above its tenant's narrows that route's traffic, raises nothing
    await admin.put_policy("route", TENANTS[0], ROUTE, Policy(tokens_per_minute=ROUTE_TPM))
    await admin.put_ceiling(
        CEILING,
        Ceiling(models=MODELS, tokens_per_minute=CEILING_TPM, requests_per_minute=CEILING_RPM),
    )


# (tenant, model, entry_kind, minute from BASE, second) of every ledger row;
# a minute below zero is counted back from 8 days ago instead.
def ledger_rows() -> list[tuple[str, str, str, int, int]]:
    rows: list[tuple[str, str, str, int, int]] = []
    for k in range(1, ACTIVE_MINUTES + 1):
        for i, tenant in enumerate(TENANTS[:k], start=1):
            model = "gpt-4o-2024-08-06" if i % 2 == 0 else "gpt-4o"
            rows.append((tenant, model, "usage", k, 10 + i))
    rows += [("t01", "gpt-4o", "usage", 1, 50), ("t01", "gpt-4o", "usage", 1, 59)]
    rows += [(t, "claude-3-5-sonnet", "usage", 3, 30) for t in TENANTS[29:49]]
    rows += [(t, "claude-3-5-sonnet", "usage", 40, 5) for t in TENANTS[:10]]
    rows += [("t47", "gpt-4o-mini", "usage", 41, 5)]
    rows += [("t48", "gpt-4o", "adjustment", 42, 5), ("t49", "gpt-4o", "late", 42, 6)]
    rows += [(t, "gpt-4o", "usage", -1, 20) for t in TENANTS[:OLD_ACTIVE]]
    return rows


async def seed_ledger(db: asyncpg.Connection) -> None:
    """Write ledger_rows() as the table owner, at their minutes by the database clock."""
    base = await db.fetchval(
        "SELECT date_bin('1 minute', now() - interval '3 hours', timestamptz 'epoch')"
    )
    old = await db.fetchval(
        "SELECT date_bin('1 minute', now() - interval '8 days', timestamptz 'epoch')"
    )
    await db.executemany(
        "INSERT INTO usage_ledger (reservation_id, entry_kind, tenant, model, input_tokens,"
        " output_tokens, reserved_tokens, outcome, reason, recorded_at)"
        " VALUES ($1, $2, $3, $4, 100, 20, 200, $5, $6, $7)",
        [
            (
                None if kind == "adjustment" else uuid.uuid4(),
                kind,
                tenant,
                model,
                {"usage": "ok", "late": "late", "adjustment": "adjustment"}[kind],
                "billing correction" if kind == "adjustment" else None,
                (old if minute < 0 else base) + timedelta(minutes=max(minute, 0), seconds=second),
            )
            for tenant, model, kind, minute, second in ledger_rows()
        ],
    )
