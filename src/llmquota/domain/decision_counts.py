"""Decisions counted per minute, in a worker's memory, for the console's chart.

Every answer an admission gets is counted here (Metrics.count_answer, the one
place all outcomes pass: REST admit, the proxy, the library, waiters' final
answers) by its UTC minute, tenant, outcome and reason. Every few seconds a
worker drains the tally and adds it to the database in one statement
(admin/decision_flush.py), so the chart is the sum over every worker while no
request pays a round trip for it.

The tally is bounded: past MAX_KEYS distinct keys between two flushes, new
tenants are counted under OTHER_TENANTS (no tenant name can be "*"), so a
flood of made-up tenant names cannot grow a worker's memory or the flush.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from decimal import Decimal

# Distinct (minute, tenant, outcome, reason) keys a worker holds between two
# flushes; past it, further tenants are folded into OTHER_TENANTS.
MAX_KEYS = 10_000
# The tenant of counts past MAX_KEYS: not a valid tenant name (domain.names).
OTHER_TENANTS = "*"
SECONDS_PER_MINUTE = 60

# (minute as UTC epoch seconds, tenant, outcome, reason)
CountKey = tuple[int, str, str, str]


def minute_of(epoch_seconds: float) -> int:
    """The start of the UTC minute holding `epoch_seconds`, in epoch seconds."""
    return int(epoch_seconds // SECONDS_PER_MINUTE) * SECONDS_PER_MINUTE


def minute_datetime(minute: int) -> datetime:
    """A minute key as an aware UTC datetime (what the database stores)."""
    return datetime.fromtimestamp(minute, UTC)


class DecisionTally:
    """Counts of one worker's decisions since its last flush."""

    def __init__(self, max_keys: int = MAX_KEYS) -> None:
        if max_keys < 1:
            raise ValueError("max_keys must be at least 1")
        self.max_keys = max_keys
        self._counts: dict[CountKey, int] = {}

    def __len__(self) -> int:
        return len(self._counts)

    def add(self, epoch_seconds: float, tenant: str, outcome: str, reason: str) -> None:
        """Count one decision made at `epoch_seconds` (wall clock, UTC)."""
        key = (minute_of(epoch_seconds), tenant, outcome, reason)
        if key not in self._counts and len(self._counts) >= self.max_keys:
            key = (key[0], OTHER_TENANTS, outcome, reason)
        self._counts[key] = self._counts.get(key, 0) + 1

    def drain(self) -> list[tuple[CountKey, int]]:
        """Every count since the last drain, sorted by key (the order the upsert
        locks rows in), and forget them."""
        counts, self._counts = self._counts, {}
        return sorted(counts.items())

    def restore(self, counts: list[tuple[CountKey, int]]) -> None:
        """Put back counts a flush could not write, added to those counted since."""
        for key, decisions in counts:
            self._counts[key] = self._counts.get(key, 0) + decisions


@dataclass(frozen=True, slots=True)
class MinuteCount:
    """All workers' decisions of one minute, outcome and reason."""

    minute: datetime
    outcome: str
    reason: str
    decisions: int


@dataclass(frozen=True, slots=True)
class TenantDay:
    """A tenant's usage today (UTC), as the finance report counts it."""

    tenant: str
    requests: int
    total_tokens: int
    cost_usd: Decimal
    unpriced_tokens: int
