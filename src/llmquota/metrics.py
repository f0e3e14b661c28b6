"""Prometheus metrics for one process.

A Metrics object owns its registry (no module globals), so tests and several
limiters in one process never share counters. Policy denials (tokens and
requests), concurrency denials, fallback decisions (made by a failure mode
while the store was away), store errors and sweeper reclaims are separate
series: a limiter doing its job and a broken dependency must never look alike.

Every label is bounded. Outcomes and reasons are closed vocabularies
(`decision_reason`); models and plans are what clients and admins name, so
each process gives its first MAX_LABEL_VALUES distinct ones their own
series and counts the rest as "other"; tenants get a series only when
per-tenant utilization is enabled, and at most MAX_TENANT_UTILIZATION_SERIES.
`docs/grafana-dashboard.json` charts the series of plans, ceilings and
waiting (a unit test keeps the two in step).
"""

from __future__ import annotations

import bisect
import functools
import itertools
import math
import threading
import time
from collections.abc import Callable, Iterable
from typing import Literal

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import HistogramMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from llmquota.domain.decision_counts import DecisionTally
from llmquota.domain.records import AdmitDecision
from llmquota.domain.vocabulary import REASONS

DECISION_BUCKETS_SECONDS = (
    0.0005,
    0.001,
    0.002,
    0.005,
    0.01,
    0.02,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
)

BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
WAIT_BUCKETS_SECONDS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)

# Distinct values a free-form label (model, plan) gets per process before the
# rest are counted as OTHER_LABEL: a client inventing model names must not
# grow the exposition without end.
MAX_LABEL_VALUES = 64
OTHER_LABEL = "other"
# Tenants a utilization gauge is exported for, the most utilized first.
MAX_TENANT_UTILIZATION_SERIES = 1_000
# The reason label of a decision that nothing refused.
NO_REASON = "none"

# The reason label of llmquota_denials and llmquota_policy_denials: the store's
# status of the refusal (a rate limit that a wait ends, or a request that never fits).
DENIAL_REASONS = ("rate_limited", "too_large")
# The reason label of llmquota_auth_refusals: no key or a malformed one, a key
# nobody holds, or a client address throttled after too many such failures.
AuthRefusalReason = Literal["missing", "unknown_key", "throttled"]
AUTH_REFUSAL_REASONS: tuple[AuthRefusalReason, ...] = ("missing", "unknown_key", "throttled")

# Outcomes of the decisions series: what the caller was answered, and "queued"
# when it started waiting (a waiter also counts its final answer).
DecisionOutcome = Literal["admitted", "degraded", "queued", "refused"]


def decision_reason(d: AdmitDecision) -> str:
    """The bounded reason label of a decision: what refused it (for a degraded
    admission, what refused the requested model), or "none".

    scope_kind for tokens and requests (tenant_tokens, global_requests, ...),
    ceiling_shed or ceiling_capacity for a provider ceiling, concurrency at
    any scope, and the statuses that are their own reason (too_large,
    unknown_tenant, ...): always one of domain.vocabulary.REASONS.
    """
    if d.status in REASONS:
        return d.status
    if d.limit_kind is None or d.limit_scope is None:
        return NO_REASON
    if d.limit_scope == "ceiling":
        return f"ceiling_{d.reason or 'capacity'}"
    if d.limit_kind == "concurrency":
        return "concurrency"
    return f"{d.limit_scope}_{d.limit_kind}"


def decision_outcome(d: AdmitDecision) -> DecisionOutcome:
    """What the caller was answered: admitted (a replay too), degraded, or refused."""
    if d.status in ("admitted", "replayed"):
        return "degraded" if d.degraded else "admitted"
    return "refused"


class BoundedLabels:
    """A free-form label's values, at most `limit` of them; the rest are OTHER_LABEL."""

    def __init__(self, limit: int = MAX_LABEL_VALUES) -> None:
        self.limit = limit
        self._seen: set[str] = set()

    def __call__(self, value: str | None) -> str:
        if value is None:
            return NO_REASON
        if value in self._seen:
            return value
        if len(self._seen) < self.limit:
            self._seen.add(value)
            return value
        return OTHER_LABEL


class LatencyHistogram(Collector):
    """A histogram without labels whose observation takes one lock, not two.

    prometheus_client's Histogram.observe checks itself and locks the sum and
    then the bucket on every call: about 1.3 us on the bench machine, and the
    decision latency is observed once per admission. This one counts per
    bucket under one lock, and the registry reads it as the same series
    (`_bucket` by `le`, `_count`, `_sum`, `_created`).
    """

    def __init__(
        self, name: str, documentation: str, buckets: Iterable[float], registry: CollectorRegistry
    ) -> None:
        self.name = name
        self.documentation = documentation
        self._bounds = (*buckets, math.inf)
        # The `le` labels as prometheus_client writes them (its helper is untyped).
        self._les = [floatToGoString(b) for b in self._bounds]  # type: ignore[no-untyped-call]
        self._counts = [0] * len(self._bounds)
        self._sum = 0.0
        self._created = time.time()
        self._lock = threading.Lock()
        registry.register(self)

    def observe(self, amount: float) -> None:
        """Count one observation in the first bucket whose bound is >= amount."""
        index = bisect.bisect_left(self._bounds, amount)
        with self._lock:
            self._counts[index] += 1
            self._sum += amount

    def describe(self) -> list[HistogramMetricFamily]:
        """The name this collector claims in the registry (no samples)."""
        return [HistogramMetricFamily(self.name, self.documentation)]

    def collect(self) -> list[HistogramMetricFamily]:
        with self._lock:
            counts, total = list(self._counts), self._sum
        family = HistogramMetricFamily(self.name, self.documentation)
        cumulative = itertools.accumulate(counts)
        family.add_metric([], list(zip(self._les, cumulative, strict=True)), sum_value=total)
        family.add_sample(f"{self.name}_created", {}, self._created)
        return [family]


class Metrics:
    """The counters and histograms the limiter and API update."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        # The same answers per minute and tenant, for the console's chart, while
        # a flush loop drains them into PostgreSQL (admin/decision_flush.py sets
        # it); None, so nothing accumulates, in a process that runs no such loop.
        self.tally: DecisionTally | None = None
        counter = functools.partial(Counter, registry=self.registry)
        histogram = functools.partial(Histogram, registry=self.registry)
        self._declare_decisions(counter)
        self._declare_settlements(counter)
        self._declare_plans_and_ceilings(counter, histogram)
        self.outage_journal_pending = Gauge(
            "llmquota_outage_journal_pending",
            "Outage admissions this worker holds that the store has not recorded yet",
            registry=self.registry,
        )
        self.outage_recorded = counter(
            "llmquota_outage_recorded",
            "Outage admissions and their settlements written to the store on recovery",
            ["what"],
        )
        self.refusals_from_memory = counter(
            "llmquota_refusals_from_memory",
            "Rate-limit refusals answered from this worker's memory of a refusal that "
            "still holds, without a statement (admission/refusals.py)",
        )
        self.abandoned_released = counter(
            "llmquota_abandoned_admissions_released",
            "Reservations made by admission statements this worker stopped waiting for "
            "(it answered by the failure mode), released when the store answered again",
        )
        self._declare_maintenance(counter)
        self.store_errors = counter(
            "llmquota_store_errors",
            "Calls that failed because the database did not answer (timeout) or refused "
            "the connection (unavailable)",
            ["operation", "kind"],
        )
        self.key_lookups, self.auth_refusals = self._authentication_series()
        self.decision_seconds = LatencyHistogram(
            "llmquota_decision_seconds",
            "Admission decision latency",
            DECISION_BUCKETS_SECONDS,
            self.registry,
        )
        self.batch_size = histogram(
            "llmquota_batch_size",
            "Requests decided by one batch statement",
            ["operation"],
            buckets=BATCH_SIZE_BUCKETS,
        )

    def _declare_maintenance(self, counter: Callable[..., Counter]) -> None:
        """The maintenance leader's series (admin/maintenance.py)."""
        self.alerts = counter(
            "llmquota_alerts",
            "Alert deliveries attempted, by alert type (quota.threshold, credits.threshold, "
            "ceiling.utilization) and result (delivered, retry, gave_up)",
            ["type", "result"],
        )
        self.sweeper_reclaims = counter(
            "llmquota_sweeper_reclaims",
            "Reservations expired by the sweeper",
        )
        self.sweeps = counter(
            "llmquota_sweeps",
            "Sweeper runs of this process as the maintenance leader, by result (ok, failed)",
            ["result"],
        )
        self.maintenance_leader = Gauge(
            "llmquota_maintenance_leader",
            "1 while this process holds the maintenance lock and runs the sweeper, else 0",
            registry=self.registry,
        )

    def _declare_decisions(self, counter: Callable[..., Counter]) -> None:
        """How admissions were decided: granted, refused by which limit, by a failure mode."""
        self.admits = counter("llmquota_admits", "Admissions granted")
        self.denials = counter(
            "llmquota_denials",
            "Every admission refused by the store, by the limit and scope that bound",
            ["limit", "scope", "reason"],
        )
        self.policy_denials = counter(
            "llmquota_policy_denials",
            "Admissions the store refused for tokens or requests, by limit and scope",
            ["limit", "scope", "reason"],
        )
        self.concurrency_denials = counter(
            "llmquota_concurrency_denials",
            "Admissions the store refused for want of a concurrency permit, by scope",
            ["scope"],
        )
        self.fallback_decisions = counter(
            "llmquota_fallback_decisions",
            "Decisions made by a failure mode because the store did not answer in time",
            ["mode", "decision"],
        )

    def _declare_plans_and_ceilings(
        self, counter: Callable[..., Counter], histogram: Callable[..., Histogram]
    ) -> None:
        """Answers by outcome and reason, tokens by model and plan, degradations,
        ceiling (and tenant) utilization, waiting admissions."""
        self.decisions = counter(
            "llmquota_decisions",
            "Admissions answered, by outcome (admitted, degraded, refused) and the reason "
            "that refused them (or the requested model); queued: started waiting",
            ["outcome", "reason"],
        )
        # Bound children of `decisions` by (outcome, reason): a labels() lookup
        # per answer costs more than the increment.
        self._answer_children: dict[tuple[str, str], Counter] = {}
        self.degradations = counter(
            "llmquota_degradations",
            "Admissions degraded to a fallback model, by what refused the requested one",
            ["kind"],
        )
        self.reserved_tokens = counter(
            "llmquota_reserved_tokens",
            "Tokens reserved by admissions, by the model admitted and the tenant's plan",
            ["model", "plan"],
        )
        self.charged_tokens = counter(
            "llmquota_charged_tokens",
            "Tokens charged at settlement, by model and plan (unknown: settled during an outage)",
            ["model", "plan"],
        )
        self.model_labels = BoundedLabels()
        self.plan_labels = BoundedLabels()
        self.ceiling_utilization = Gauge(
            "llmquota_ceiling_utilization",
            "Share of each provider ceiling's token burst in use, read from the database "
            "every CEILING_METRICS_REFRESH_SECONDS",
            ["ceiling"],
            registry=self.registry,
        )
        self.tenant_utilization = Gauge(
            "llmquota_tenant_utilization",
            "Share of each tenant's token burst in use (only with TENANT_UTILIZATION_METRICS)",
            ["tenant"],
            registry=self.registry,
        )
        self.waiting = Gauge(
            "llmquota_waiting_admissions",
            "Admissions of this worker waiting for room (max_wait_ms)",
            registry=self.registry,
        )
        self.wait_seconds = histogram(
            "llmquota_wait_seconds",
            "Time admissions spent waiting for room, by how the wait ended (admitted, "
            "refused, left: the caller went away, error: the store could not decide)",
            ["outcome"],
            buckets=WAIT_BUCKETS_SECONDS,
        )

    def count_answer(self, decision: AdmitDecision, tenant: str) -> None:
        """Count what a caller was answered (once per admission, after any wait)."""
        reason = decision_reason(decision)
        outcome = decision_outcome(decision)
        if self.tally is not None:
            self.tally.add(time.time(), tenant, outcome, reason)
        key = (outcome, reason)
        child = self._answer_children.get(key)
        if child is None:
            # Both labels are closed vocabularies: the cache stays small.
            child = self._answer_children[key] = self.decisions.labels(outcome, reason)
        child.inc()
        if outcome == "degraded":
            self.degradations.labels(reason).inc()

    def count_queued(self, refusal: AdmitDecision) -> None:
        """Count an admission that started waiting, by the refusal it waits out."""
        self.decisions.labels("queued", decision_reason(refusal)).inc()

    def set_ceiling_utilization(self, utilization: Iterable[tuple[str, float]]) -> None:
        """Replace every ceiling's gauge (a deleted ceiling's series goes away)."""
        self.ceiling_utilization.clear()
        for ceiling, value in utilization:
            self.ceiling_utilization.labels(ceiling).set(value)

    def set_tenant_utilization(self, utilization: Iterable[tuple[str, float]]) -> None:
        """Replace every tenant's gauge, for at most MAX_TENANT_UTILIZATION_SERIES tenants."""
        self.tenant_utilization.clear()
        for tenant, value in itertools.islice(utilization, MAX_TENANT_UTILIZATION_SERIES):
            self.tenant_utilization.labels(tenant).set(value)

    def _declare_settlements(self, counter: Callable[..., Counter]) -> None:
        """What settlements and releases gave back, and what they reported beyond reason."""
        self.settlements = counter("llmquota_settlements", "Reservations settled", ["late"])
        self.excess_settlements = counter(
            "llmquota_excess_settlements",
            "Settlements that reported more than the request could have used "
            "(counted input with tolerance plus max_tokens)",
        )
        self.excess_tokens = counter(
            "llmquota_excess_tokens",
            "Tokens settled above the request's possible maximum, kept off shared layers",
        )
        self.shared_debt_forgiven_tokens = counter(
            "llmquota_shared_debt_forgiven_tokens",
            "Settled tokens a shared layer (global, ceiling) was not debited because its "
            "balance stood at minus its burst: recorded in the ledger, charged to the tenant",
            ["scope"],
        )
        self.releases = counter("llmquota_releases", "Reservations released unused")
        self.refunded_tokens = counter("llmquota_refunded_tokens", "Tokens refunded at settlement")

    def count_decision(self, decision: AdmitDecision) -> None:
        """Count one decision of the store under the series that describes it."""
        if decision.status == "admitted":
            self.admits.inc()
        elif decision.status in DENIAL_REASONS:
            self.denials.labels(decision.limit_kind, decision.limit_scope, decision.status).inc()
            if decision.limit_kind == "concurrency":
                self.concurrency_denials.labels(decision.limit_scope).inc()
            else:
                self.policy_denials.labels(
                    decision.limit_kind, decision.limit_scope, decision.status
                ).inc()

    def _authentication_series(self) -> tuple[Counter, Counter]:
        """Key lookups in the database, and requests refused at authentication."""
        lookups = Counter(
            "llmquota_key_lookups",
            "API key lookups in the database: first sight of a key or a background refresh "
            "of a known one; found, absent, or unavailable (the store did not answer)",
            ["purpose", "result"],
            registry=self.registry,
        )
        refusals = Counter(
            "llmquota_auth_refusals",
            "Requests refused at authentication: missing or malformed key, unknown key, "
            "or throttled (too many failed authentications from one client address)",
            ["reason"],
            registry=self.registry,
        )
        return lookups, refusals

    def count_auth_refusal(self, reason: AuthRefusalReason) -> None:
        """Count a request refused at authentication, by a reason mypy checks."""
        self.auth_refusals.labels(reason).inc()

    def render(self) -> bytes:
        """The registry in Prometheus text format."""
        return generate_latest(self.registry)
