"""Bodies of the plan and provider-ceiling endpoints.

The request bodies are the domain's own models (llmquota.domain.plans), so
the rules a plan or a ladder must follow are written once; these are the
answers, with every default written out.
"""

from __future__ import annotations

from pydantic import BaseModel, Field

from llmquota.domain.output_estimates import OutputEstimate
from llmquota.domain.plans import ShedStep
from llmquota.domain.vocabulary import FailureMode, Priority


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
