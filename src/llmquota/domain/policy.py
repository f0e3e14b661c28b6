"""Limit policies: what a layer allows, validated before anything is stored.

Pure code. A policy field left out means no limit of that kind at that layer.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Literal, NamedTuple, Self

from pydantic import BaseModel, ConfigDict, StrictBool, model_validator

from llmquota.domain.json_numbers import WholeNumber
from llmquota.domain.json_schemas import BURSTS_NEED_RATES
from llmquota.domain.output_estimates import OutputEstimate
from llmquota.domain.response_cache import CachePolicy
from llmquota.domain.vocabulary import DEFAULT_FAILURE_MODE, FailureMode

# Ceilings on every configurable number, so a typo cannot store a value the
# arithmetic downstream was never meant to see.
MAX_TOKENS_PER_MINUTE = 10_000_000_000
MAX_REQUESTS_PER_MINUTE = 100_000_000
MAX_IN_FLIGHT = 1_000_000
MAX_LEASE_SECONDS = 86_400
# The most requests one call may count as (request_cost).
MAX_REQUEST_COST = 10_000
# The most rows the global layer's budget may be split over (limit_layers_shard_check).
MAX_GLOBAL_SHARDS = 64
DEFAULT_LEASE_SECONDS = 120

AdmissionMode = Literal["exact", "allotted"]

TokenRate = Annotated[int, WholeNumber(ge=1, le=MAX_TOKENS_PER_MINUTE)]
RequestRate = Annotated[int, WholeNumber(ge=1, le=MAX_REQUESTS_PER_MINUTE)]


class Policy(BaseModel):
    """One layer's limits. Capacity (burst) and refill (per minute) are separate dials."""

    model_config = ConfigDict(extra="forbid", frozen=True, json_schema_extra=BURSTS_NEED_RATES)

    tokens_per_minute: TokenRate | None = None
    token_burst: TokenRate | None = None
    requests_per_minute: RequestRate | None = None
    request_burst: RequestRate | None = None
    max_in_flight: Annotated[int, WholeNumber(ge=1, le=MAX_IN_FLIGHT)] | None = None
    lease_seconds: Annotated[int, WholeNumber(ge=1, le=MAX_LEASE_SECONDS)] = DEFAULT_LEASE_SECONDS
    failure_mode: FailureMode = DEFAULT_FAILURE_MODE
    # What admission reserves for output (tenant, route and plan policies);
    # None: the whole max_tokens.
    output_estimate: OutputEstimate | None = None
    # What one call counts as (tenant and route policies; seed 002's weighted
    # cost): requests on every request-rate limit it meets (0: none), and
    # whether it takes an in-flight permit. None: the tenant's (for a route),
    # else 1 and true.
    request_cost: Annotated[int, WholeNumber(ge=0, le=MAX_REQUEST_COST)] | None = None
    uses_concurrency: StrictBool | None = None
    # Whether proxy mode answers a request again from the response cache
    # (tenant, route and plan policies; domain/response_cache.py says how):
    # a route's own wins over its tenant's, a tenant's own over its plan's.
    # None: nothing is cached. Nothing in admission reads it: the proxy asks
    # the policy cache for it (PolicyCache.cache_policy) before admitting.
    cache: CachePolicy | None = None
    # How this tenant's (route's) requests are decided (tenant and route
    # policies; a route's own wins): "allotted" from slices of the layers'
    # room a worker holds (admission/allotments.py, sql/allotments.sql),
    # "exact" or None by lq_admit, one statement per batch.
    admission: AdmissionMode | None = None

    @property
    def has_limits(self) -> bool:
        """Whether this layer limits anything at all (an empty layer never refuses)."""
        return (
            self.tokens_per_minute is not None
            or self.requests_per_minute is not None
            or self.max_in_flight is not None
        )

    @model_validator(mode="after")
    def _bursts_need_rates(self) -> Self:
        if self.token_burst is not None and self.tokens_per_minute is None:
            raise ValueError("token_burst needs tokens_per_minute (the refill rate)")
        if self.request_burst is not None and self.requests_per_minute is None:
            raise ValueError("request_burst needs requests_per_minute (the refill rate)")
        return self

    @property
    def effective_token_burst(self) -> int | None:
        """Capacity of the token bucket; defaults to one minute of refill."""
        return self.token_burst if self.token_burst is not None else self.tokens_per_minute

    @property
    def effective_request_burst(self) -> int | None:
        """Capacity of the request bucket; defaults to one minute of refill."""
        if self.request_burst is not None:
            return self.request_burst
        return self.requests_per_minute

    def resolved(self) -> Policy:
        """The same policy with default bursts written out, as stored."""
        return self.model_copy(
            update={
                "token_burst": self.effective_token_burst,
                "request_burst": self.effective_request_burst,
            }
        )


class CallWeight(NamedTuple):
    """What one call counts as: requests on every request-rate limit, permits (1 or 0)."""

    requests: int
    permits: int


ONE_CALL = CallWeight(1, 1)


def call_weight(by_scope: Mapping[str, Policy]) -> CallWeight:
    """A call's weight as lq_admit decides it, from its layers' policies by scope:
    the route policy's, else the tenant's, else one request and one permit."""
    chain = [by_scope[scope] for scope in ("route", "tenant") if scope in by_scope]
    cost = next((p.request_cost for p in chain if p.request_cost is not None), 1)
    uses = next((p.uses_concurrency for p in chain if p.uses_concurrency is not None), True)
    return CallWeight(cost, 1 if uses else 0)
