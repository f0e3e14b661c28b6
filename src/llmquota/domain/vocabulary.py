"""The words of the domain, as typed literals: one name per concept.

Pure. Every layer of the code speaks these, so a limit kind or a scope is
checked by mypy wherever it travels, from the SQL row to the JSON body.
"""

from __future__ import annotations

from typing import Literal, get_args

# What a refusal names as the limit that bound.
# quota: a calendar quota; credits: a prepaid balance.
LimitKind = Literal["tokens", "requests", "concurrency", "quota", "credits"]
# The two buckets of a layer: a provider ceiling's alert says which one crossed.
Dimension = Literal["tokens", "requests"]
DIMENSIONS: tuple[Dimension, ...] = ("tokens", "requests")
# Which layer of the stack a limit belongs to.
# key: the limits of the API key that asked (domain/key_limits.py).
Scope = Literal["global", "tenant", "route", "ceiling", "key"]
SCOPES: tuple[Scope, ...] = ("global", "tenant", "route", "ceiling", "key")

# Why a layer refused: it lacks what the request needs (capacity), or a
# provider ceiling's shedding ladder keeps what is left for higher priorities.
RefusalReason = Literal["capacity", "shed"]
# The values of a refusal body's `reason` field (null where neither applies:
# a quota, a prepaid balance, an unpriced model).
REFUSAL_REASONS: tuple[RefusalReason, ...] = ("capacity", "shed")

# What refused an admission, as operators see it: the `reason` label of
# llmquota_decisions_total, the `kind` of llmquota_degradations_total and the
# console's refusals. A closed vocabulary, so a label stays bounded and
# docs/operations.md can list it (tests/unit/test_metrics_reference.py):
# "none" for an answer nothing refused; scope_kind for a bucket of tokens or
# requests; concurrency at any scope; ceiling_ plus the refusal reason for a
# provider ceiling; and the statuses that are their own reason.
REASONS: tuple[str, ...] = (
    "none",
    "global_tokens",
    "global_requests",
    "tenant_tokens",
    "tenant_requests",
    "route_tokens",
    "route_requests",
    "key_tokens",
    "key_requests",
    "concurrency",
    "ceiling_capacity",
    "ceiling_shed",
    "too_large",
    "unknown_tenant",
    "idempotency_conflict",
    "quota_exceeded",
    "credits_exhausted",
    "unpriced_model",
)

# How oversubscribed a provider ceiling is: the sum of the tenant limits that
# can reach it against the rule (LLMQUOTA_OVERSUBSCRIPTION_WARN_RATIO and
# _CRITICAL_RATIO; sql/reports/60_oversubscription.sql decides).
OversubscriptionVerdict = Literal["ok", "warn", "critical"]
OVERSUBSCRIPTION_VERDICTS: tuple[OversubscriptionVerdict, ...] = ("ok", "warn", "critical")

# A request's priority, from its tenant's plan: who keeps working when a
# provider ceiling gets tight. Stored as its rank (0 .. 3).
Priority = Literal["low", "normal", "high", "critical"]
PRIORITIES: tuple[Priority, ...] = ("low", "normal", "high", "critical")
DEFAULT_PRIORITY: Priority = "normal"


def priority_rank(priority: Priority) -> int:
    """The rank the database stores: low 0, normal 1, high 2, critical 3."""
    return PRIORITIES.index(priority)


def lowered_from(requested: Priority | None, granted: Priority | None) -> Priority | None:
    """The priority asked for when the decision was made at a lower one (only an
    admin may raise a request above its plan's), else None: the answer says so."""
    if requested is None or granted is None:
        return None
    return requested if priority_rank(requested) > priority_rank(granted) else None


def priority_of(rank: int) -> Priority:
    """The priority of a stored rank."""
    return PRIORITIES[rank]


# What a layer does when the store cannot decide within the deadline:
#   closed  refuse (503 limiter_unavailable, never a 429);
#   open    admit, and record the admission when the store is back;
#   local   admit against a worker-local fraction of this layer's limits.
FailureMode = Literal["closed", "open", "local"]
FAILURE_MODES: tuple[FailureMode, ...] = ("closed", "open", "local")
DEFAULT_FAILURE_MODE: FailureMode = "closed"

AdmitStatus = Literal[
    "admitted",
    "replayed",
    "rate_limited",
    "too_large",
    "unknown_tenant",
    "idempotency_conflict",
    # a calendar quota is used up until its window resets
    "quota_exceeded",
    # a prepaid tenant's balance cannot cover the request's maximum cost
    "credits_exhausted",
    # a cost quota or a prepaid balance applies and the model has no price
    "unpriced_model",
]
FinishAction = Literal["settle", "release", "expire"]
# journaled: the store did not answer a settle; the worker's outage journal
# holds it and records it when the store is back (never a store answer).
FinishStatus = Literal[
    "settled", "released", "expired", "replayed", "conflict", "not_found", "not_due", "journaled"
]
# How the provider call ended, as the caller reports it when settling.
Outcome = Literal["ok", "error", "cancelled"]
OUTCOMES: tuple[Outcome, ...] = ("ok", "error", "cancelled")

# Where a settlement's figures came from (usage_ledger.usage_source):
#   reported  as the caller or the upstream reported them;
#   clamped   an upstream reported more than MAX_TOKEN_COUNT: settled at that
#             maximum, its own figure kept in the ledger (reported_*_tokens);
#   counted   an upstream reported nothing usable (missing, not an integer,
#             negative): the relayed text counted with tiktoken instead.
UsageSource = Literal["reported", "counted", "clamped"]
USAGE_SOURCES: tuple[UsageSource, ...] = ("reported", "counted", "clamped")

# How a request was served (usage_ledger.serving_path, issue 23): as asked
# (primary), from the response cache (cache), as a fallback model
# (fallback_model), after waiting for room (queued), or by a model's next
# deployment: its first lacked room under its own ceiling (lq_admit chose the
# next) or answered 429 or 5xx (second_deployment). The
# cache writes its own rows (sql/cache.sql); lq_finish writes the rest.
LedgerServingPath = Literal["primary", "cache", "fallback_model", "queued", "second_deployment"]
# The proxy's serving-path metric counts one more: refused by a limit (rejected).
ServingPath = Literal[LedgerServingPath, "rejected"]
SERVING_PATHS: tuple[ServingPath, ...] = get_args(ServingPath)
# The path a settler may name for its ledger row (every one but the cache's),
# and the path an admission journals (reservations.serving_path; NULL: primary):
# `queued` when the request waited for room, `fallback_model` and
# `second_deployment` written by lq_admit itself when it admitted a fallback,
# or the requested model on a deployment after its first.
SettledPath = Literal["primary", "fallback_model", "queued", "second_deployment"]
AdmittedPath = Literal["fallback_model", "queued", "second_deployment"]

# How lq_admit chooses among a model's deployments (UPSTREAMS_FILE's
# [[routing]]): in the order given (`order`; `cheapest` is that order, ranked
# by price before the statement), or the one whose own ceilings have the most
# room first (`least_utilized`, decided in the statement).
DeploymentRule = Literal["order", "least_utilized"]
DEPLOYMENT_RULES: tuple[DeploymentRule, ...] = get_args(DeploymentRule)
