"""Bodies of the plan and provider-ceiling endpoints.

The request bodies are the domain's own models (llmquota.domain.plans), so
the rules a plan or a ladder must follow are written once; these are the
answers, with every default written out.
"""

from __future__ import annotations

from datetime import datetime

from pydantic import BaseModel, Field

from llmquota.domain.output_estimates import OutputEstimate
from llmquota.domain.plans import ShedStep
from llmquota.domain.policy import AdmissionMode
from llmquota.domain.response_cache import CachePolicy
from llmquota.domain.vocabulary import FailureMode, OversubscriptionVerdict, Priority


class PlanResponse(BaseModel):
    """A plan with its defaults written out, and how many tenants are on it."""

    plan: str
    priority: Priority
    tokens_per_minute: int | None
    token_burst: int | None
    requests_per_minute: int | None
    request_burst: int | None
    max_in_flight: int | None
    lease_seconds: int
    failure_mode: FailureMode
    fallback_models: list[str]
    prepaid: bool = Field(description="its tenants pay from a prepaid credit balance")
    output_estimate: OutputEstimate | None = None
    cache: CachePolicy | None = Field(
        default=None, description="the response cache its tenants take where they set none"
    )
    admission: AdmissionMode | None = Field(
        default=None,
        description="how its tenants' requests are decided where they set none: exact "
        "(null too) or allotted",
    )
    tenants: int = Field(description="tenants on this plan")


class PlanList(BaseModel):
    """GET /v1/plans."""

    plans: list[PlanResponse]


class CeilingResponse(BaseModel):
    """A provider ceiling, with its balances and utilization now."""

    ceiling: str
    models: list[str]
    tokens_per_minute: int | None
    token_burst: int | None
    requests_per_minute: int | None
    request_burst: int | None
    max_in_flight: int | None
    shed: list[ShedStep]
    upstream: str | None = Field(
        default=None,
        description="the deployment this ceiling is scoped to (null: every deployment)",
    )
    policy_version: int
    remaining_tokens: int | None
    remaining_requests: int | None
    in_flight: int
    utilization: float | None = Field(
        description="the share of the token burst in use now: 1 - balance / token_burst"
    )
    alert_at: list[float] | None = Field(
        default=None, description="the alert thresholds set (null: each step of `shed`)"
    )
    alert_thresholds: list[float] = Field(
        default_factory=list,
        description="the utilizations that alert, once per episode, on each of tokens and "
        "requests: alert_at, else each step of `shed`",
    )
    alert_hysteresis: float | None = Field(
        default=None, description="null: LLMQUOTA_CEILING_ALERT_HYSTERESIS"
    )
    alert_quiet_seconds: float | None = Field(
        default=None, description="null: LLMQUOTA_CEILING_ALERT_QUIET_SECONDS"
    )


class CeilingList(BaseModel):
    """GET /v1/ceilings."""

    ceilings: list[CeilingResponse]


class ActiveTenantsResponse(BaseModel):
    """Tenants active on the ceiling per minute, over the period's minutes with any activity."""

    p50: int = Field(description="nearest-rank median of the per-minute counts")
    p95: int = Field(description="nearest-rank 95th percentile of the per-minute counts")
    max: int


class OversubscriptionRuleResponse(BaseModel):
    """The verdict's thresholds (LLMQUOTA_OVERSUBSCRIPTION_WARN_RATIO, _CRITICAL_RATIO)."""

    warn_above: float
    critical_above: float


class OversubscriptionResponse(BaseModel):
    """GET /v1/ceilings/{ceiling}/oversubscription.

    Every tenant that is not suspended can reach the ceiling (a request names
    its model); each counts with its own effective limit (its policy's, else
    its plan's), at most the ceiling's, and one without a limit of that kind
    as the whole ceiling. Ratios are rounded to two decimals; the verdict
    compares the exact sums. Token (request) fields are null for a ceiling
    without a token (request) rate.
    """

    ceiling: str
    days: int = Field(description="the period: the last `days` days up to now")
    period_start: datetime
    period_end: datetime
    tenants: int = Field(description="tenants that can reach the ceiling")
    tenants_without_token_limit: int | None = Field(
        description="of them, those without a token limit: each counts as the whole ceiling"
    )
    tenants_without_request_limit: int | None = Field(
        description="of them, those without a request limit: each counts as the whole ceiling"
    )
    tokens_per_minute: int | None = Field(description="the ceiling's")
    sum_tenant_tokens_per_minute: int | None = Field(
        description="the tokens per minute of every tenant that can reach the ceiling, summed"
    )
    ratio: float | None = Field(description="sum_tenant_tokens_per_minute / tokens_per_minute")
    requests_per_minute: int | None = Field(description="the ceiling's")
    sum_tenant_requests_per_minute: int | None
    requests_ratio: float | None = Field(
        description="sum_tenant_requests_per_minute / requests_per_minute"
    )
    active_minutes: int = Field(description="minutes of the period with activity on the ceiling")
    active_tenants: ActiveTenantsResponse
    effective_tokens_per_minute: int | None = Field(
        description="the tokens per minute of the active_tenants.p95 tenants with the largest "
        "limits, summed: what the usual busy minute's tenants could ask at once"
    )
    effective_ratio: float | None = Field(
        description="effective_tokens_per_minute / tokens_per_minute"
    )
    effective_requests_per_minute: int | None
    effective_requests_ratio: float | None
    verdict: OversubscriptionVerdict = Field(
        description="critical above rule.critical_above, warn above rule.warn_above (the "
        "worse of tokens and requests), else ok"
    )
    rule: OversubscriptionRuleResponse
