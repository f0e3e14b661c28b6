"""How oversubscribed each provider ceiling is: the report's record, its period and its rule.

Pure. The figures are computed in SQL (sql/reports/60_oversubscription.sql,
whose header defines each one), so that the REST answer, `llmquota report
oversubscription` and the reporting view a BI tool reads are the same
numbers; this module holds what they travel in and the bounds of what a
caller may ask.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal

from llmquota.domain.errors import InvalidRequest
from llmquota.domain.vocabulary import OVERSUBSCRIPTION_VERDICTS, OversubscriptionVerdict

# The period when the caller names none: seed 001's "p95 concurrent tenant
# count" over a week, so that a weekday peak and a weekend are both in it.
DEFAULT_DAYS = 7
# The longest period: the report reads every ledger row of the period once
# (a year of monthly partitions at most), within the report's statement timeout.
MAX_DAYS = 366
# The rule's defaults, from seed 001: the sum of the per-tenant limits should
# not exceed 2-3x the ceiling.
DEFAULT_WARN_RATIO = 2.0
DEFAULT_CRITICAL_RATIO = 3.0
# A ratio above this is a typo, not a rule.
MAX_RATIO = 1_000.0


def check_days(days: int) -> int:
    """A period in whole days, 1 .. MAX_DAYS, else InvalidRequest naming `days`."""
    if isinstance(days, bool) or not isinstance(days, int) or not 1 <= days <= MAX_DAYS:
        raise InvalidRequest(f"days: a whole number of days from 1 to {MAX_DAYS}, not {days!r}")
    return days


def verdict_of(text: str) -> OversubscriptionVerdict:
    """The verdict a report row names; ValueError for a word the vocabulary lacks (the
    SQL and this code out of step), never a wrong verdict passed on."""
    for verdict in OVERSUBSCRIPTION_VERDICTS:
        if verdict == text:
            return verdict
    raise ValueError(f"the oversubscription report gave an unknown verdict {text!r}")


@dataclass(frozen=True, slots=True)
class OversubscriptionRule:
    """A sum of tenant limits above `warn_above` times its ceiling warns, above
    `critical_above` times it is critical."""

    warn_above: float = DEFAULT_WARN_RATIO
    critical_above: float = DEFAULT_CRITICAL_RATIO

    def __post_init__(self) -> None:
        if not 0 < self.warn_above <= self.critical_above <= MAX_RATIO:
            raise ValueError(
                f"oversubscription rule: 0 < warn ({self.warn_above}) <= critical "
                f"({self.critical_above}) <= {MAX_RATIO}"
            )


@dataclass(frozen=True, slots=True)
class ActiveTenants:
    """Tenants active on a ceiling per minute, over the minutes with any activity."""

    p50: int
    p95: int
    max: int


@dataclass(frozen=True, slots=True)
class CeilingOversubscription:
    """One ceiling's report over [period_start, period_end).

    Token (request) figures are None for a ceiling without a token (request)
    rate. Ratios are rounded to two decimals; the verdict compares the exact
    sums.
    """

    ceiling: str
    period_start: datetime
    period_end: datetime
    tenants: int
    # Of them, those without a limit of that kind (each counts as the whole ceiling).
    tenants_without_token_limit: int | None
    tenants_without_request_limit: int | None
    tokens_per_minute: int | None
    sum_tenant_tokens_per_minute: int | None
    ratio: Decimal | None
    requests_per_minute: int | None
    sum_tenant_requests_per_minute: int | None
    requests_ratio: Decimal | None
    active_minutes: int
    active_tenants: ActiveTenants
    effective_tokens_per_minute: int | None
    effective_ratio: Decimal | None
    effective_requests_per_minute: int | None
    effective_requests_ratio: Decimal | None
    verdict: OversubscriptionVerdict
