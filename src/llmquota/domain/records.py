"""The records that cross the layers: requests, decisions, results, figures.

Pure data, frozen. The store builds them from rows, the admission service
and the admin service pass them on, the adapters render them. Nothing here
knows PostgreSQL, HTTP or the clock.

The records built once or more per admission (AdmitRequest, TenantFigures,
AdmitDecision) are NamedTuples, the rest frozen dataclasses. Both are
immutable; a frozen dataclass sets each field through object.__setattr__,
which for AdmitDecision's 31 fields cost about 9 us per admission on the
bench machine, a NamedTuple is one tuple (BENCHMARKS.md, Python CPU per
admission). Change one with `_replace`, not dataclasses.replace.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal
from typing import NamedTuple

from llmquota.domain.output_estimates import OutputStrategy
from llmquota.domain.policy import Policy
from llmquota.domain.response_cache import CachePolicy
from llmquota.domain.vocabulary import (
    AdmitStatus,
    FailureMode,
    FinishAction,
    FinishStatus,
    LimitKind,
    Priority,
    RefusalReason,
    Scope,
    UsageSource,
)


class AdmitRequest(NamedTuple):
    """One admission, already counted and validated."""

    tenant: str
    route: str | None
    model: str
    input_tokens: int
    max_tokens: int
    input_estimated: bool
    lease_seconds: int | None
    idempotency_key: str | None
    request_hash: str | None
    # The priority asked for (None: the plan's); only an admin may raise it.
    priority: Priority | None = None
    priority_any: bool = False
    # False: never degrade; None or True: degrade when fallbacks exist.
    degrade: bool | None = None
    # Explicit fallback models, in order, each with its own input count.
    fallbacks: tuple[tuple[str, int], ...] = ()
    # What to reserve for output (admission/estimates.py); None: max_tokens.
    output_reserve: int | None = None
    output_strategy: OutputStrategy = "max_tokens"
    # False: the caller gave no max_tokens, which is then the model's maximum output.
    max_tokens_given: bool = True
    # The tenant's API key that asked (its own limits and quotas), None: none.
    key_id: int | None = None

    @property
    def reserved_tokens(self) -> int:
        """What admitting the requested model reserves on each layer: its input and
        the output to reserve (lq_admit's cost, sql/admission.sql)."""
        output = self.max_tokens if self.output_reserve is None else self.output_reserve
        return self.input_tokens + output


class TenantFigures(NamedTuple):
    """The tenant layer after a decision, for rate-limit headers."""

    tokens_per_minute: int | None
    token_burst: int | None
    tokens: float | None
    requests_per_minute: int | None
    request_burst: int | None
    requests: float | None


class TokenLayerFigures(NamedTuple):
    """The binding token layer after a decision, for the X-TokenLimit-* headers: the
    token layer that refused, else the one with the least left (sql/admission.sql)."""

    tokens_per_minute: int | None
    token_burst: int | None
    tokens: float | None


class AdmitDecision(NamedTuple):
    """What lq_admit decided for one request."""

    status: AdmitStatus
    reservation_id: uuid.UUID | None
    reserved_tokens: int | None
    lease_expires_at: datetime | None
    lease_generation: int | None
    limit_kind: LimitKind | None
    limit_scope: Scope | None
    retry_after_ms: int | None
    capacity: int | None
    remaining_tokens: int | None
    remaining_requests: int | None
    remaining_in_flight: int | None
    tenant: TenantFigures
    # The model admitted (a fallback when degraded) and its input count; for a
    # refusal, the requested model.
    model: str | None = None
    input_tokens: int | None = None
    degraded: bool = False
    # Of the requested model's refusal (also when degraded): why, and which
    # provider ceiling, with its utilization after the request.
    reason: RefusalReason | None = None
    ceiling: str | None = None
    utilization: float | None = None
    priority: Priority | None = None
    plan: str | None = None
    # What the caller could do instead, now: a smaller max_tokens, other models.
    alt_max_tokens: int | None = None
    alt_models: tuple[str, ...] = ()
    # A calendar quota's refusal: its name and when its window resets; a
    # prepaid refusal: the balance available (in the price currency).
    quota: str | None = None
    resets_at: datetime | None = None
    credit_balance: Decimal | None = None
    # The binding token layer; None where it is not known (no token layer,
    # or a failure mode's decision: balances are unknown offline).
    binding: TokenLayerFigures | None = None


@dataclass(frozen=True, slots=True)
class FinishRequest:
    """One settle, release or expire."""

    reservation_id: uuid.UUID
    action: FinishAction
    caller: str | None = None
    input_tokens: int | None = None
    output_tokens: int | None = None
    outcome: str | None = None
    # Settle only, for the ledger row: where the figures came from (None:
    # reported), and an upstream's own figures where they differ from them
    # (domain/upstream_usage.py).
    usage_source: UsageSource | None = None
    reported_input_tokens: int | None = None
    reported_output_tokens: int | None = None


@dataclass(frozen=True, slots=True)
class FinishResult:
    """What lq_finish did to one reservation."""

    status: FinishStatus
    state: str | None
    tenant: str | None
    charged_tokens: int | None
    refunded_tokens: int | None
    late: bool | None
    # Usage settled above the request's possible maximum: charged in full to
    # the tenant's own layers, at most the maximum to shared ones.
    excess_tokens: int | None = None
    # Usage the global layer, and the provider ceilings (summed), were not
    # debited because they stood at minus their burst (lq_shared_forgiven).
    forgiven_global_tokens: int | None = None
    forgiven_ceiling_tokens: int | None = None


@dataclass(frozen=True, slots=True)
class HeartbeatResult:
    """A heartbeat's answer: the new expiry, or the state that refused it."""

    state: str
    lease_expires_at: datetime | None
    lease_generation: int | None
    lease_live: bool = False
    current_generation: int | None = None


@dataclass(frozen=True, slots=True)
class CachedLayer:
    """One layer's policy as the policy snapshot returns it."""

    scope: Scope
    tenant: str | None
    route: str | None
    policy: Policy
    policy_version: int

    @property
    def cache(self) -> CachePolicy | None:
        """The layer's response cache policy: a route's own, a tenant's effective one
        (its own, else its plan's), None for the global layer or none set. Part of
        the policy, so it is loaded, versioned and replaced with it."""
        return self.policy.cache


@dataclass(frozen=True, slots=True)
class PolicySnapshotRows:
    """The snapshot version, and the layers when it changed (None: unchanged)."""

    version: tuple[int, int]
    layers: list[CachedLayer] | None


@dataclass(frozen=True, slots=True)
class OutageAdmissionRecord:
    """A reservation a worker admitted during an outage, to record exactly once."""

    reservation_id: uuid.UUID
    request: AdmitRequest
    policy_version: int
    mode: FailureMode
    # When the worker admitted it, by its own clock (the only one there was);
    # None for a journal written before the time was kept: the store's now.
    admitted_at: datetime | None = None


@dataclass(frozen=True, slots=True)
class AuditFinding:
    """One discrepancy lq_audit found between a counter and the journal."""

    check_name: str
    subject: str
    expected: int | None
    actual: int | None


@dataclass(frozen=True, slots=True)
class AuditSummary:
    """What the journal holds."""

    active: int
    reserved_tokens: int
    finished: int
    outage_admissions: int
    ledger_rows: int


@dataclass(frozen=True, slots=True)
class StoredPolicy:
    """A layer's effective policy as stored, with its version, plan and fallback list."""

    policy: Policy
    policy_version: int
    plan: str | None = None
    fallback_models: tuple[str, ...] = ()
    prepaid: bool = False
    shards: int = 1  # the global layer's: how many rows its budget is split over


@dataclass(frozen=True, slots=True)
class LayerStatus:
    """One layer's policy and balances, refilled to now."""

    scope: Scope
    tenant: str | None
    route: str | None
    policy: Policy
    policy_version: int
    tokens: float | None
    requests: float | None
    in_flight: int
    plan: str | None = None
    fallback_models: tuple[str, ...] = ()  # the layer's own, else its plan's
    prepaid: bool = False
    shards: int = 1


@dataclass(frozen=True, slots=True)
class UsageTotals:
    """Ledger totals for a tenant over a period."""

    requests: int
    input_tokens: int
    output_tokens: int
