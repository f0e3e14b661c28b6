"""Prometheus metrics for one process.

A Metrics object owns its registry (no module globals), so tests and several
limiters in one process never share counters. Policy denials (tokens and
requests), concurrency denials, fallback decisions (made by a failure mode
while the store was away), store errors and sweeper reclaims are separate
series: a limiter doing its job and a broken dependency must never look alike.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from llmquota.domain.records import AdmitDecision

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


class Metrics:
    """The counters and histograms the limiter and API update."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        counter = functools.partial(Counter, registry=self.registry)
        histogram = functools.partial(Histogram, registry=self.registry)
        self._declare_decisions(counter)
        self._declare_settlements(counter)
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
        self.store_errors = counter(
            "llmquota_store_errors",
            "Calls that failed because the database did not answer (timeout) or refused "
            "the connection (unavailable)",
            ["operation", "kind"],
        )
        self.key_lookups, self.auth_refusals = self._authentication_series()
        self.decision_seconds = histogram(
            "llmquota_decision_seconds",
            "Admission decision latency",
            buckets=DECISION_BUCKETS_SECONDS,
        )
        self.batch_size = histogram(
            "llmquota_batch_size",
            "Requests decided by one batch statement",
            ["operation"],
            buckets=BATCH_SIZE_BUCKETS,
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
        self.releases = counter("llmquota_releases", "Reservations released unused")
        self.refunded_tokens = counter("llmquota_refunded_tokens", "Tokens refunded at settlement")

    def count_decision(self, decision: AdmitDecision) -> None:
        """Count one decision of the store under the series that describes it."""
        if decision.status == "admitted":
            self.admits.inc()
        elif decision.status in ("rate_limited", "too_large"):
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

    def render(self) -> bytes:
        """The registry in Prometheus text format."""
        return generate_latest(self.registry)
