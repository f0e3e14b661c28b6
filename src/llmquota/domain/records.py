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
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from decimal import Decimal
from typing import NamedTuple

from llmquota.domain.output_estimates import OutputStrategy
from llmquota.domain.policy import Policy
from llmquota.domain.response_cache import CachePolicy
from llmquota.domain.vocabulary import (
    AdmitStatus,
    AdmittedPath,
    DeploymentRule,
    FailureMode,
    FinishAction,
    FinishStatus,
    LedgerServingPath,
    LimitKind,
    Priority,
    RefusalReason,
    Scope,
    SettledPath,
    UsageSource,
)


class FallbackCandidate(NamedTuple):
    """An explicit fallback model of a request, as admission tries it: its own
    input count (its tokenizer's) and its own output reserve (its own learned
    histogram under the request's policy, admission/estimates.py), so that a
    degraded admission reserves what the model admitted is expected to use."""

    model: str
    input_tokens: int
    # What to reserve for its output, and how chosen; None: max_tokens.
    output_reserve: int | None = None
    output_strategy: OutputStrategy = "max_tokens"


class Deployment(NamedTuple):
    """One deployment a candidate model may be served by (an upstream of
    UPSTREAMS_FILE), as admission tries it: a provider ceiling scoped to it
    (its `upstream`) counts only for requests sent there. lq_admit tries a
    candidate model's deployments in the order given, or with the rule
    `least_utilized` the one whose own ceilings have the most room first."""

    model: str
    upstream: str
    rule: DeploymentRule = "order"


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
    # Explicit fallback models, in order, each with its own input count and
    # output reserve.
    fallbacks: tuple[FallbackCandidate, ...] = ()
    # What to reserve for output (admission/estimates.py); None: max_tokens.
    output_reserve: int | None = None
    output_strategy: OutputStrategy = "max_tokens"
    # False: the caller gave no max_tokens, which is then the model's maximum output.
    max_tokens_given: bool = True
    # The tenant's API key that asked (its own limits and quotas), None: none.
    key_id: int | None = None
    # How it came to be decided, journaled with the reservation for its
    # settlement's ledger row: `queued` when it waited for room first
    # (admission/waiting.py). None: as asked (lq_admit writes fallback_model
    # itself when it admits a fallback).
    serving_path: AdmittedPath | None = None
    # The deployments of the requested model and of its explicit fallbacks,
    # each model's in its order (the proxy's UPSTREAMS_FILE); () : none named,
    # and every ceiling of a model bounds it, scoped or not.
    deployments: tuple[Deployment, ...] = ()

    @property
    def reserved_tokens(self) -> int:
        """What admitting the requested model reserves on each layer: its input and
        the output to reserve (lq_admit's cost, sql/admission.sql)."""
        output = self.max_tokens if self.output_reserve is None else self.output_reserve
        return self.input_tokens + output

    def output_strategy_of(self, model: str | None) -> OutputStrategy:
        """How the output reserved for `model` was chosen: the requested model's
        strategy, or the fallback's that a degraded admission names (a default
        list's too, passed as fallbacks once estimated: admission/estimates.py).
        A default the worker did not know yet (the statement read it) reserved
        the requested model's output, and says so."""
        if model != self.model:
            for candidate in self.fallbacks:
                if candidate.model == model:
                    return candidate.output_strategy
        return self.output_strategy


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
    # The deployment admitted (one the request named), None: none named.
    upstream: str | None = None


@dataclass(frozen=True, slots=True)
class FinishRequest:
    """One settle, release or expire."""

    reservation_id: uuid.UUID
    action: FinishAction
    caller: str | None = None
    input_tokens: int | None = None
    output_tokens: int | None = None
    outcome: str | None = None
    # Settle only: how the request was served, when the settler knows better
    # than the admission did (the proxy's second deployment). None: the
    # reservation's journaled path, else primary.
    serving_path: SettledPath | None = None
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
    # The reservation's model (the one admitted) and its tenant's plan, as
    # the store holds them: the settling worker labels its metrics with
    # them whichever worker admitted it. None: not known (an answer of the
    # worker's own, during an outage).
    model: str | None = None
    plan: str | None = None


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
    # Its default fallback models (a tenant's effective list: its own, else its
    # plan's), in order; () none.
    fallback_models: tuple[str, ...] = ()

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
    # Room left, counting what workers hold in live slices of the layer
    # (allotted admission), which `allotted_*` says; None: no such limit.
    tokens: float | None
    requests: float | None
    in_flight: int
    plan: str | None = None
    fallback_models: tuple[str, ...] = ()  # the layer's own, else its plan's
    prepaid: bool = False
    shards: int = 1
    allotted_tokens: int = 0
    allotted_requests: int = 0


@dataclass(frozen=True, slots=True)
class PathUsage:
    """Ledger totals of one serving path: what was charged, and what a cache hit
    saved (the tokens the provider would have billed; 0 on other paths)."""

    requests: int
    input_tokens: int
    output_tokens: int
    saved_input_tokens: int = 0
    saved_output_tokens: int = 0


@dataclass(frozen=True, slots=True)
class UsageTotals:
    """Ledger totals for a tenant over a period."""

    requests: int
    input_tokens: int
    output_tokens: int
    # The same by how the requests were served, for the paths with rows only
    # (a row without a path, an adjustment or one older than revision 0026,
    # counts as primary).
    by_serving_path: Mapping[LedgerServingPath, PathUsage] = field(default_factory=dict)
