"""`llmquota report oversubscription`: how oversubscribed each provider ceiling is.

The REST report's figures (GET /v1/ceilings/{c}/oversubscription), for every
ceiling or --ceiling's, over the last --days days up to now, judged by the
service's rule (LLMQUOTA_OVERSUBSCRIPTION_WARN_RATIO, _CRITICAL_RATIO); sql/
reports/60_oversubscription.sql defines each figure. Like every report it runs
on LLMQUOTA_REPORTING_DATABASE_URL when that is set (the reporting role may run
it), and prints a table, CSV or JSON (numerics as written, decimals as text).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from llmquota.cli.finance import run_on_database, statement_timeout_ms
from llmquota.config import Settings
from llmquota.domain.errors import InvalidRequest
from llmquota.domain.oversubscription import DEFAULT_DAYS, CeilingOversubscription, check_days
from llmquota.domain.validation import check_name

# The report that is not a (date, date, text) function of the reporting
# schema: it covers the last --days days up to now, by the service's rule.
OVERSUBSCRIPTION = "oversubscription"
OVERSUBSCRIPTION_DESCRIPTION = (
    "per provider ceiling over the last --days days: the tenant limits that can reach it "
    "against it, tenants active per minute (p50, p95, max), the effective ratio and a verdict"
)
COLUMNS = (
    "ceiling",
    "verdict",
    "tenants",
    "tenants_without_token_limit",
    "tenants_without_request_limit",
    "tokens_per_minute",
    "sum_tenant_tokens_per_minute",
    "ratio",
    "requests_per_minute",
    "sum_tenant_requests_per_minute",
    "requests_ratio",
    "active_minutes",
    "active_tenants_p50",
    "active_tenants_p95",
    "active_tenants_max",
    "effective_tokens_per_minute",
    "effective_ratio",
    "effective_requests_per_minute",
    "effective_requests_ratio",
    "period_start",
    "period_end",
)


def _row(o: CeilingOversubscription) -> tuple[Any, ...]:
    """One ceiling's figures in COLUMNS order."""
    return (
        o.ceiling,
        o.verdict,
        o.tenants,
        o.tenants_without_token_limit,
        o.tenants_without_request_limit,
        o.tokens_per_minute,
        o.sum_tenant_tokens_per_minute,
        o.ratio,
        o.requests_per_minute,
        o.sum_tenant_requests_per_minute,
        o.requests_ratio,
        o.active_minutes,
        o.active_tenants.p50,
        o.active_tenants.p95,
        o.active_tenants.max,
        o.effective_tokens_per_minute,
        o.effective_ratio,
        o.effective_requests_per_minute,
        o.effective_requests_ratio,
        o.period_start,
        o.period_end,
    )


def _refusal(args: argparse.Namespace) -> str | None:
    """What is wrong with the flags, or None."""
    if args.date_from is not None or args.date_to is not None or args.tenant is not None:
        return (
            f"the {OVERSUBSCRIPTION} report covers the last --days days (default "
            f"{DEFAULT_DAYS}) of every tenant; --from, --to and --tenant are the other reports'"
        )
    try:
        check_days(DEFAULT_DAYS if args.days is None else args.days)
        if args.ceiling is not None:
            check_name("--ceiling", args.ceiling)
    except InvalidRequest as exc:
        return str(exc)
    return None


def report_oversubscription(args: argparse.Namespace, settings: Settings) -> int:
    """Print every ceiling's (or --ceiling's) oversubscription; 2 for bad flags or an
    unknown ceiling."""
    from llmquota.admin.service import AdminService
    from llmquota.cli.tabular import render
    from llmquota.store.store import Store

    refusal = _refusal(args)
    if refusal is not None:
        print(f"llmquota: error: {refusal}", file=sys.stderr)
        return 2
    days = DEFAULT_DAYS if args.days is None else args.days
    timeout_ms = statement_timeout_ms(settings, True)

    async def report(dsn: str) -> int:
        store = await Store.connect(
            dsn,
            min_size=1,
            max_size=1,
            statement_timeout_ms=timeout_ms,
            lock_timeout_ms=settings.lock_timeout_ms,
        )
        try:
            admin = AdminService(
                store,
                deadline_seconds=timeout_ms / 1000.0,
                oversubscription_rule=settings.oversubscription_rule,
            )
            found = await admin.ceiling_oversubscription(args.ceiling, days)
        finally:
            await store.close()
        sys.stdout.write(render(COLUMNS, [_row(o) for o in found], args.format))
        return 0

    return run_on_database(settings, report, reporting=True)
