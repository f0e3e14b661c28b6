"""Request and response bodies of the REST API.

Token counts are strict integers with a ceiling: a float, NaN, Infinity,
1e400, a string or a boolean is refused before anything touches the
database. Names and models follow the patterns of llmquota.domain.names,
declared here as `pattern` and `maxLength` so the OpenAPI schema shows them.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal, TypeAlias

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictStr,
)

from llmquota.domain.admit_request import MAX_UPSTREAMS
from llmquota.domain.json_numbers import WholeNumber
from llmquota.domain.json_schemas import BURSTS_NEED_RATES, DISTINCT, present
from llmquota.domain.json_text import storable_text_pattern
from llmquota.domain.names import ModelName, Name, UpstreamName
from llmquota.domain.output_estimates import OutputEstimate, OutputStrategy
from llmquota.domain.plans import MAX_FALLBACK_MODELS
from llmquota.domain.policy import (
    MAX_GLOBAL_SHARDS,
    MAX_IN_FLIGHT,
    MAX_LEASE_SECONDS,
    MAX_REQUEST_COST,
    AdmissionMode,
    RequestRate,
    TokenRate,
)
from llmquota.domain.response_cache import (
    MAX_ENTRIES,
    MAX_HIT_PRICE_USD,
    MAX_TTL_SECONDS,
    CachePolicy,
)
from llmquota.domain.validation import (
    MAX_IDEMPOTENCY_KEY_CHARS,
    MAX_TOKEN_COUNT,
    storable_text_problem,
)
from llmquota.domain.vocabulary import (
    DeploymentRule,
    FailureMode,
    LedgerServingPath,
    Priority,
    Scope,
)

TokenCount = Annotated[int, WholeNumber(ge=0, le=MAX_TOKEN_COUNT)]
LeaseSeconds = Annotated[int, WholeNumber(ge=1, le=MAX_LEASE_SECONDS)]


def _storable(value: str) -> str:
    """Refuse text PostgreSQL cannot store (422 naming the field), before any batch."""
    problem = storable_text_problem(value)
    if problem is not None:
        raise ValueError(problem)
    return value


# A free-form string that reaches the database: bounded, and storable as text.
IdempotencyKey: TypeAlias = Annotated[
    StrictStr,
    Field(
        min_length=1,
        max_length=MAX_IDEMPOTENCY_KEY_CHARS,
        json_schema_extra={"pattern": storable_text_pattern(MAX_IDEMPOTENCY_KEY_CHARS)},
    ),
    AfterValidator(_storable),
]
MAX_MESSAGES = 10_000


class AdmitBody(BaseModel):
    """POST /v1/admit. Give `messages` to have them counted, or `input_tokens`."""

    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={
            "oneOf": [present("messages", "array"), present("input_tokens", "integer")]
        },
    )

    tenant: Name
    route: Name | None = None
    model: ModelName
    messages: Annotated[list[dict[str, Any]], Field(max_length=MAX_MESSAGES)] | None = None
    input_tokens: TokenCount | None = None
    max_tokens: TokenCount
    lease_seconds: LeaseSeconds | None = None
    idempotency_key: IdempotencyKey | None = None
    priority: Priority | None = Field(
        default=None,
        description="lower this request below its plan's priority (a background job); only "
        "an admin key may raise it",
    )
    fallback_models: (
        Annotated[
            list[ModelName], Field(max_length=MAX_FALLBACK_MODELS, json_schema_extra=DISTINCT)
        ]
        | None
    ) = Field(
        default=None,
        description="models to degrade to, in order, when the requested one is refused; "
        "default: the route's or the plan's list",
    )
    degrade: StrictBool | None = Field(
        default=None, description="false: never degrade; the 429 lists the fallbacks that fit"
    )
    max_wait_ms: Annotated[int, WholeNumber(ge=0)] | None = Field(
        default=None,
        description="wait up to this long for room instead of a 429 (bounded by the server's cap)",
    )
    upstreams: (
        Annotated[
            list[UpstreamName],
            Field(min_length=1, max_length=MAX_UPSTREAMS, json_schema_extra=DISTINCT),
        ]
        | None
    ) = Field(
        default=None,
        description="the deployments that may serve the model, in order: admission chooses "
        "one whose ceilings (a ceiling's `upstream`) have room, and the 201 names it in "
        "`upstream`; default: none named, every ceiling of the model applies",
    )
    upstream_rule: DeploymentRule | None = Field(
        default=None,
        description="how the deployment is chosen: the first with room (order, the default), "
        "or the one whose own ceilings have the most room left (least_utilized)",
    )


class Remaining(BaseModel):
    """What is left at the tightest layer of each kind; null where unlimited.

    `in_flight` elsewhere (a layer's status) counts held permits; here the
    free ones are `permits`, and `in_flight` is its deprecated old name (the
    same number), kept for one release.
    """

    tokens: int | None
    requests: int | None
    permits: int | None = Field(
        description="free concurrency permits at the tightest max_in_flight layer"
    )
    in_flight: int | None = Field(
        deprecated=True, description="deprecated alias of `permits` (free permits, not held)"
    )


class OutputEstimateUsed(BaseModel):
    """What an admission reserved for output, and by which strategy."""

    strategy: OutputStrategy
    tokens: int


class AdmitResponse(BaseModel):
    """201 from POST /v1/admit."""

    reservation_id: str
    reserved_tokens: int
    input_tokens: int
    input_estimated: bool
    lease_expires_at: datetime
    lease_generation: int
    remaining: Remaining
    model: str = Field(description="the model admitted: a fallback when degraded")
    degraded: bool
    degraded_from: str | None = Field(default=None, description="the requested model")
    degraded_because: dict[str, Any] | None = Field(
        default=None,
        description="the refusal the requested model got: limit, scope, reason, ceiling",
    )
    priority: Priority | None = Field(default=None, description="the priority admitted at")
    priority_lowered_from: Priority | None = Field(
        default=None,
        description="the priority asked for, when it was above the plan's and only an admin "
        "key may raise it: the request was admitted at `priority` instead",
    )
    output_estimate: OutputEstimateUsed = Field(
        description="what was reserved for output and how, for the model admitted (a "
        "fallback's own estimate when degraded): reserved_tokens is input_tokens plus tokens; "
        "strategy max_tokens, learned or fixed"
    )
    upstream: str | None = Field(
        default=None,
        description="the deployment chosen among the request's `upstreams` (null: none named)",
    )


class CountResponse(BaseModel):
    """200 from POST /v1/tokens/count: what POST /v1/admit would count and reserve now."""

    input_tokens: int
    input_estimated: bool
    reserved_tokens: int = Field(
        description="what an admission of the requested model would reserve on each layer "
        "now: input_tokens plus output_estimate.tokens"
    )
    output_estimate: OutputEstimateUsed = Field(
        description="what would be reserved for output and how: strategy max_tokens, "
        "learned or fixed, under the tenant's policies and learned estimates now"
    )


class SettleBody(BaseModel):
    """POST /v1/reservations/{id}/settle: the provider's reported usage."""

    model_config = ConfigDict(extra="forbid")

    input_tokens: TokenCount
    output_tokens: TokenCount
    outcome: Literal["ok", "error", "cancelled"] = "ok"


class SettleResponse(BaseModel):
    """200 from settle."""

    charged_tokens: int
    refunded_tokens: int
    late: bool


class HeartbeatBody(BaseModel):
    """POST /v1/reservations/{id}/heartbeat.

    `lease_generation`, optional, is the fencing token the caller holds (from
    the admission or its last heartbeat); a stale one gets 409.
    """

    model_config = ConfigDict(extra="forbid")

    lease_seconds: LeaseSeconds | None = None
    lease_generation: Annotated[int, WholeNumber(ge=1, le=2_147_483_647)] | None = None


class HeartbeatResponse(BaseModel):
    """200 from heartbeat."""

    lease_expires_at: datetime
    lease_generation: int


class ReleaseResponse(BaseModel):
    """200 from release."""

    released: bool


class PolicyBody(BaseModel):
    """A layer's policy; a field left out is no limit of that kind.

    One model for the three scopes; the OpenAPI document shows each scope's
    own fields and rules (llmquota.api.openapi).
    """

    model_config = ConfigDict(extra="forbid", json_schema_extra=BURSTS_NEED_RATES)

    tokens_per_minute: TokenRate | None = None
    token_burst: TokenRate | None = None
    requests_per_minute: RequestRate | None = None
    request_burst: RequestRate | None = None
    max_in_flight: Annotated[int, WholeNumber(ge=1, le=MAX_IN_FLIGHT)] | None = None
    lease_seconds: LeaseSeconds | None = None
    failure_mode: FailureMode | None = Field(
        default=None,
        description="when the store cannot answer in time: closed (503, the default), "
        "open (admit and record later) or local (admit against a worker-local fraction)",
    )
    plan: Name | None = Field(
        default=None,
        description="tenant policies only: the plan whose fields apply where this policy sets none",
    )
    fallback_models: Annotated[list[ModelName], Field(max_length=MAX_FALLBACK_MODELS)] | None = (
        Field(
            default=None,
            description="tenant and route policies: the default models to degrade to, in order",
        )
    )
    prepaid: StrictBool | None = Field(
        default=None,
        description="tenant policies only: pay from the prepaid credit balance (default: "
        "the plan's, else false)",
    )
    output_estimate: OutputEstimate | None = Field(
        default=None,
        description="tenant and route policies: what to reserve for output: "
        '{"strategy": "max_tokens"} (the default), {"strategy": "learned", "quantile": 0.95, '
        '"min_samples": 50} or {"strategy": "fixed", "tokens": N}',
    )
    request_cost: Annotated[int, WholeNumber(ge=0, le=MAX_REQUEST_COST)] | None = Field(
        default=None,
        description="tenant and route policies: how many requests one call counts as on "
        "every request-rate limit it meets (global, tenant, route, key, ceilings); 0: none "
        "(default: the tenant's for a route, else 1)",
    )
    uses_concurrency: StrictBool | None = Field(
        default=None,
        description="tenant and route policies: whether a call takes an in-flight permit "
        "(max_in_flight) on its layers (default: the tenant's for a route, else true)",
    )
    cache: CachePolicy | None = Field(
        default=None,
        description="tenant and route policies: proxy answers served again from the "
        'response cache: {"mode": "exact"} (the same request) or {"mode": "semantic", '
        '"embedding_model": M} (a close enough last user turn, `similarity` in (0, 1], '
        f"default 0.92); ttl_seconds 1 to {MAX_TTL_SECONDS} (3600), max_entries 1 to "
        f"{MAX_ENTRIES} (1000), sampled (false), serve_when_exhausted (true), "
        f"hit_price_usd (a decimal string, 0 to {MAX_HIT_PRICE_USD}; default: free). A "
        "route's wins over its tenant's, a tenant's over its plan's; null: none",
    )
    admission: AdmissionMode | None = Field(
        default=None,
        description="tenant and route policies: how requests are admitted: exact (the "
        "default: one statement decides each batch) or allotted (a worker decides from a "
        "slice of the layers' room it holds, exact again near the limits; requests of "
        "layers with max_in_flight, weighted calls, prepaid credit, quotas or a provider "
        "ceiling are always decided exactly). A route's wins over its tenant's",
    )
    unlimited: StrictBool | None = Field(
        default=None,
        description="tenant and route policies: true to store a policy with no limit and "
        "no plan (without it such a PUT is refused with 422)",
    )
    shards: Annotated[int, WholeNumber(ge=1, le=MAX_GLOBAL_SHARDS)] | None = Field(
        default=None,
        description="the global policy only: how many rows its budget is split over, so "
        "that admissions of different tenants lock different rows (default: as many as now, "
        "1 at first); every limit it sets must be at least this",
    )


class PolicyResponse(BaseModel):
    """A stored policy with its defaults written out."""

    tokens_per_minute: int | None
    token_burst: int | None
    requests_per_minute: int | None
    request_burst: int | None
    max_in_flight: int | None
    lease_seconds: int
    failure_mode: FailureMode
    policy_version: int
    plan: str | None = None
    fallback_models: list[str] = Field(default_factory=list)
    prepaid: bool = False
    output_estimate: OutputEstimate | None = None
    shards: int = 1
    request_cost: int | None = None
    uses_concurrency: bool | None = None
    cache: CachePolicy | None = None
    admission: AdmissionMode | None = None


class LayerStatusResponse(BaseModel):
    """One layer in GET /v1/tenants/{tenant}/status.

    A tenant key sees its own layers in full; of a layer it shares with other
    tenants (global) only whether it binds now and the retry hint: its limits,
    balances and in-flight count (other customers' traffic) are null. The
    admin key sees every figure. The remaining figures count the room workers
    hold in live slices of the layer (allotted admission); `allotted_*` say how much.
    """

    scope: Scope
    route: str | None
    limits: PolicyResponse | None = Field(
        description="null for a shared layer seen with a tenant key"
    )
    remaining_tokens: int | None
    remaining_requests: int | None
    allotted_tokens: int | None = None
    allotted_requests: int | None = None
    in_flight: int | None = Field(description="null for a shared layer seen with a tenant key")
    tokens_full_in_seconds: float | None
    requests_full_in_seconds: float | None
    binding: bool = Field(
        description="whether this layer would refuse a minimal request (one token, one "
        "request, one permit) now"
    )
    retry_after_ms: int | None = Field(
        description="when binding, the wait until it would admit one; else null"
    )


class StatusResponse(BaseModel):
    """GET /v1/tenants/{tenant}/status."""

    tenant: str
    plan: str | None = Field(default=None, description="the plan the tenant is on")
    layers: list[LayerStatusResponse]


class PathUsageResponse(BaseModel):
    """The usage of one serving path."""

    requests: int
    input_tokens: int
    output_tokens: int
    saved_input_tokens: int = Field(
        description="cache hits: the input tokens the provider would have billed (0 elsewhere)"
    )
    saved_output_tokens: int = Field(
        description="cache hits: the output tokens the provider would have billed (0 elsewhere)"
    )


class UsageResponse(BaseModel):
    """GET /v1/tenants/{tenant}/usage: ledger totals over [from, to)."""

    tenant: str
    from_: datetime = Field(serialization_alias="from")
    to: datetime
    requests: int
    input_tokens: int
    output_tokens: int
    by_serving_path: dict[LedgerServingPath, PathUsageResponse] = Field(
        description="the same totals by how the requests were served, only paths with rows: "
        "primary, cache, fallback_model, queued, second_deployment (a row recorded "
        "without a path, an adjustment or one older than the path, counts as primary)"
    )


class ErrorDetail(BaseModel):
    """What went wrong; refusals add the limit that bound and when to retry."""

    model_config = ConfigDict(extra="allow")

    type: str
    message: str


class ErrorResponse(BaseModel):
    """Every error of the API has this shape."""

    type: Literal["error"]
    error: ErrorDetail
    request_id: str | None = Field(
        default=None, description="the request's id, also its x-request-id header"
    )
