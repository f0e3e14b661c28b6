"""Plans (tiers) and provider ceilings, validated before anything is stored.

Pure code. A plan is a policy with a priority and a default fallback list:
tenants on it take every field their own policy leaves out from it. A
provider ceiling is the provider's own limit on the whole account for some
models, shared by every tenant, with a shedding ladder that keeps the last
of it for the higher priorities.

The ladder, read as floors: a step `{"above": a, "admit": [...]}` lets a
priority it does not admit take the ceiling's utilization up to `a` at most,
that is leave at least (1 - a) x token_burst of it. Each priority's floor is
the highest its steps impose; a request whose reserved tokens are under a
step's `small_request_tokens` is exempt from that step.
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass
from datetime import datetime
from typing import Annotated, Self

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    model_validator,
)
from pydantic.config import JsonDict

from llmquota.domain.json_numbers import WholeNumber
from llmquota.domain.json_schemas import BURST_RULES, BURSTS_NEED_RATES, DISTINCT, present
from llmquota.domain.names import ModelGlob, ModelName, UpstreamName
from llmquota.domain.policy import MAX_IN_FLIGHT, Policy, RequestRate, TokenRate
from llmquota.domain.vocabulary import DEFAULT_PRIORITY, PRIORITIES, Priority, priority_rank

MAX_FALLBACK_MODELS = 8
MAX_CEILING_MODELS = 64
MAX_SHED_STEPS = 8
# A ladder step's wait for room: at most ten minutes, as a decision deadline
# allows; a worker waits at most its own cap (LLMQUOTA_MAX_WAIT_MS_CAP).
MAX_QUEUE_MS = 600_000
# A ceiling's alert thresholds: at most as many as a quota's (MAX_ALERTS).
MAX_CEILING_ALERTS = 20
# An episode ends when utilization stays below threshold - hysteresis: at
# most half the bucket, and at most a day of quiet.
MAX_ALERT_HYSTERESIS = 0.5
MAX_ALERT_QUIET_SECONDS = 86_400.0


def check_model_list(field: str, models: list[str], *, requested: str | None = None) -> None:
    """A list of model names (each already matching its pattern): no duplicates, not
    the requested model."""
    seen: set[str] = set()
    for model in models:
        if model in seen:
            raise ValueError(f"{field} names {model!r} twice")
        if requested is not None and model == requested:
            raise ValueError(f"{field} must not name the requested model {model!r}")
        seen.add(model)


# What one call counts as: a tenant's or a route's, never a plan's
# (lq_materialize_layers reads it from the tenant's own policy only).
CALL_WEIGHTS = ("request_cost", "uses_concurrency")


def _plan_schema(schema: JsonDict) -> None:
    """A plan's JSON Schema: a policy's, without the call weights it refuses."""
    schema.update(BURSTS_NEED_RATES)
    properties = schema.get("properties")
    if isinstance(properties, dict):
        for name in CALL_WEIGHTS:
            properties.pop(name, None)


class Plan(Policy):
    """A tier: limits, a priority, and the fallback models its tenants degrade to."""

    model_config = ConfigDict(extra="forbid", frozen=True, json_schema_extra=_plan_schema)

    priority: Priority = DEFAULT_PRIORITY
    # Tenants on it pay from a prepaid balance: admission reserves a request's
    # maximum cost against it (402 when it cannot cover it).
    prepaid: StrictBool = False
    fallback_models: Annotated[
        list[ModelName],
        Field(max_length=MAX_FALLBACK_MODELS, default_factory=list, json_schema_extra=DISTINCT),
    ]

    @model_validator(mode="after")
    def _models_are_distinct(self) -> Self:
        check_model_list("fallback_models", self.fallback_models)
        return self

    @model_validator(mode="after")
    def _no_call_weights(self) -> Self:
        # Refused, not silently dropped (the schema leaves them out: _plan_schema).
        if any(getattr(self, name) is not None for name in CALL_WEIGHTS):
            raise ValueError(
                f"{', '.join(CALL_WEIGHTS)}: set them on a tenant or a route, not a plan"
            )
        return self


class ShedStep(BaseModel):
    """One step of a ceiling's ladder: above `above`, only `admit` (or small requests) pass.

    With `queue_ms`, a request the step sheds waits up to that long for room
    (in priority order, then arrival) instead of an immediate 429: the seed's
    80-95% band, where a large request is better late than refused.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    above: Annotated[StrictFloat, Field(gt=0, le=1)]
    admit: Annotated[list[Priority], Field(min_length=1, max_length=len(PRIORITIES))]
    small_request_tokens: Annotated[int, WholeNumber(ge=1)] | None = None
    queue_ms: (
        Annotated[
            int,
            WholeNumber(ge=1, le=MAX_QUEUE_MS),
            Field(
                description="milliseconds a request this step sheds waits for room before "
                "its 429 (at most LLMQUOTA_MAX_WAIT_MS_CAP is waited; default: no wait)"
            ),
        ]
        | None
    ) = None

    @property
    def admit_mask(self) -> int:
        """The admitted priorities as a bit mask of their ranks (what SQL stores)."""
        return sum(1 << priority_rank(p) for p in set(self.admit))


# A ceiling's rules between fields, as JSON Schema: the bursts' rates, and a
# shedding ladder (it sheds by tokens) needs tokens_per_minute.
_CEILING_RULES: JsonDict = {
    "allOf": [
        *BURST_RULES,
        {
            "if": {"required": ["shed"], "properties": {"shed": {"minItems": 1}}},
            "then": present("tokens_per_minute", "integer"),
        },
    ]
}


class Ceiling(BaseModel):
    """A provider's limit on the whole account for the models it names."""

    model_config = ConfigDict(extra="forbid", frozen=True, json_schema_extra=_CEILING_RULES)

    models: Annotated[
        list[ModelGlob],
        Field(min_length=1, max_length=MAX_CEILING_MODELS, json_schema_extra=DISTINCT),
    ]
    tokens_per_minute: TokenRate | None = None
    token_burst: TokenRate | None = None
    requests_per_minute: RequestRate | None = None
    request_burst: RequestRate | None = None
    max_in_flight: Annotated[int, WholeNumber(ge=1, le=MAX_IN_FLIGHT)] | None = None
    shed: Annotated[list[ShedStep], Field(max_length=MAX_SHED_STEPS, default_factory=list)]
    # The one deployment whose own limit this ceiling mirrors (an upstream's
    # name in LLMQUOTA_UPSTREAMS_FILE); None: every deployment of its models.
    upstream: UpstreamName | None = Field(
        default=None,
        description="the deployment (an upstream's name in LLMQUOTA_UPSTREAMS_FILE) whose own "
        "limit this ceiling mirrors: it counts only requests sent there (default: every "
        "deployment of its models)",
    )
    # Ceiling alerts (llmquota.admin.ceiling_alerts): utilization fractions, as
    # a quota's `alerts` are spelled; None: each step of the ladder.
    alert_at: (
        Annotated[
            list[Annotated[StrictFloat, Field(gt=0, le=1)]],
            Field(
                max_length=MAX_CEILING_ALERTS,
                json_schema_extra=DISTINCT,
                description="utilization fractions in (0, 1], increasing, each alerting once "
                "per episode (default: each step of `shed`; []: none)",
            ),
        ]
        | None
    ) = None
    alert_hysteresis: (
        Annotated[
            StrictFloat,
            Field(
                ge=0,
                le=MAX_ALERT_HYSTERESIS,
                description="an episode ends once utilization stays below its threshold minus "
                "this for alert_quiet_seconds (default: LLMQUOTA_CEILING_ALERT_HYSTERESIS)",
            ),
        ]
        | None
    ) = None
    alert_quiet_seconds: (
        Annotated[
            StrictFloat,
            Field(
                ge=0,
                le=MAX_ALERT_QUIET_SECONDS,
                description="how long utilization must stay below threshold minus "
                "alert_hysteresis to end an episode (default: "
                "LLMQUOTA_CEILING_ALERT_QUIET_SECONDS)",
            ),
        ]
        | None
    ) = None

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        check_model_list("models", self.models)
        for model in self.models:
            if re.search(r"\*\*", model):
                raise ValueError(f"models: {model!r} has an empty run of '*'")
        if self.token_burst is not None and self.tokens_per_minute is None:
            raise ValueError("token_burst needs tokens_per_minute (the refill rate)")
        if self.request_burst is not None and self.requests_per_minute is None:
            raise ValueError("request_burst needs requests_per_minute (the refill rate)")
        if self.shed and self.tokens_per_minute is None:
            raise ValueError("shed: a ladder needs tokens_per_minute (it sheds by tokens)")
        aboves = [float(step.above) for step in self.shed]
        if any(b <= a for a, b in itertools.pairwise(aboves)):
            raise ValueError("shed: steps must be in increasing order of 'above'")
        if self.alert_at is not None and any(b <= a for a, b in itertools.pairwise(self.alert_at)):
            raise ValueError("alert_at: thresholds must be in increasing order, each once")
        return self

    @property
    def alert_thresholds(self) -> tuple[float, ...]:
        """The utilizations that alert: `alert_at`, else each step of the ladder."""
        if self.alert_at is not None:
            return tuple(float(t) for t in self.alert_at)
        return tuple(float(step.above) for step in self.shed)

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

    def floor_tokens(self, priority: Priority, reserved_tokens: int) -> float:
        """The balance a request of this priority and size may not take the ceiling below."""
        burst = self.effective_token_burst
        if burst is None:
            return 0.0
        floors = [
            (1 - float(step.above)) * burst
            for step in self.shed
            if priority not in step.admit
            and (step.small_request_tokens is None or reserved_tokens >= step.small_request_tokens)
        ]
        return max(floors, default=0.0)


@dataclass(frozen=True, slots=True)
class StoredPlan:
    """A plan and how many tenants are on it."""

    name: str
    plan: Plan
    tenants: int
    version: int = 0  # its ETag: updated_at in microseconds (lq_plan_version)


@dataclass(frozen=True, slots=True)
class StoredCeiling:
    """A provider ceiling with its balances refilled to now."""

    name: str
    ceiling: Ceiling
    policy_version: int
    tokens: float | None
    requests: float | None
    in_flight: int
    # The database clock the balances are of (get_ceilings' read_at).
    read_at: datetime | None = None
    # Over cells: a cell holding a slice of it did not answer, so that slice
    # counts as full (domain/cells.py, at_capacity), or, if the cell's last
    # read lacked it, the balances are unknown (None). The utilization is then
    # at most the truth.
    estimated: bool = False

    @property
    def utilization(self) -> float | None:
        """The share of the token burst in use now (1 - balance / burst)."""
        return _utilization(self.tokens, self.ceiling.effective_token_burst)

    @property
    def request_utilization(self) -> float | None:
        """The share of the request burst in use now (1 - balance / burst)."""
        return _utilization(self.requests, self.ceiling.effective_request_burst)


def _utilization(balance: float | None, capacity: int | None) -> float | None:
    """1 - balance / capacity, never below 0 (above 1 while a debt is owed)."""
    if capacity is None or balance is None:
        return None
    return max(0.0, 1.0 - balance / capacity)
