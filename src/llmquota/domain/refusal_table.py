"""Every kind of refused admission, in one table: what it is on each path.

A refusal is decided once, in the admission statement, and answered on three
paths: the library raises it, the REST API renders it in the error shape,
and proxy mode renders it as the provider would. Each of them used to map a
decision's status on its own; here one row says, for each status, the
library's exception, the HTTP status, the REST error type, whether the
answer carries retry hints (a wait makes room) or tells SDKs never to retry
as is (nothing but a change of the request or a top-up does), and the body
fields clients branch on. The sentence itself is refusal_message's.

Pure: the adapters turn a row into headers and bodies.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from llmquota.domain.errors import (
    CreditsExhausted,
    LimiterError,
    QuotaExceeded,
    RateLimited,
    RequestTooLarge,
    UnpricedModel,
)
from llmquota.domain.money import money_text
from llmquota.domain.records import AdmitDecision
from llmquota.domain.refusals import refusal_message


@dataclass(frozen=True, slots=True)
class RefusalRule:
    """One kind of refusal on every path."""

    http_status: int
    error_type: str  # the REST API's `error.type`
    # The library's exception (None when the decision lacks what it needs:
    # a broken contract, raised as such by the caller).
    error: Callable[[str, AdmitDecision], LimiterError | None]
    fields: Callable[[AdmitDecision], dict[str, Any]]  # the REST body's own fields
    retry: bool = False  # waiting makes room: Retry-After, retry-after-ms, retry_after_ms
    never_retry: bool = False  # as is it never fits: x-should-retry: false (proxy)


def refusal_details(d: AdmitDecision) -> dict[str, Any]:
    """The fields a refusal adds to limit and scope: why, whose priority, what to do now.

    `alternatives` is what the caller can act on at once: the largest
    max_tokens that would fit with the same input and priority (null if
    none), and which of its fallback models would fit (when it asked not to
    degrade; empty otherwise).
    """
    details: dict[str, Any] = {
        "reason": d.reason,
        "alternatives": {"max_tokens": d.alt_max_tokens, "models": list(d.alt_models)},
    }
    if d.priority is not None:
        details["priority"] = d.priority
    if d.ceiling is not None:
        details["ceiling"] = d.ceiling
    if d.utilization is not None:
        details["utilization"] = round(d.utilization, 6)
    return details


def _rate_limited(tenant: str, d: AdmitDecision) -> LimiterError | None:
    if not (d.limit_kind and d.limit_scope):
        return None
    return RateLimited(
        limit=d.limit_kind,
        scope=d.limit_scope,
        retry_after_ms=int(d.retry_after_ms or 0),
        message=refusal_message(tenant, d),
    )


def _quota_exceeded(tenant: str, d: AdmitDecision) -> LimiterError | None:
    if not (d.quota and d.resets_at and d.limit_scope):
        return None
    return QuotaExceeded(
        quota=d.quota,
        scope=d.limit_scope,
        resets_at=d.resets_at,
        retry_after_ms=int(d.retry_after_ms or 0),
        message=refusal_message(tenant, d),
    )


def _too_large(tenant: str, d: AdmitDecision) -> LimiterError | None:
    if not d.limit_scope:
        return None
    requests = d.limit_kind == "requests"  # its request_cost, not its tokens
    return RequestTooLarge(
        scope=d.limit_scope,
        requested=0 if requests else int(d.reserved_tokens or 0),
        capacity=int(d.capacity or 0),
        message=refusal_message(tenant, d),
        limit="requests" if requests else "tokens",
    )


REFUSALS: dict[str, RefusalRule] = {
    "rate_limited": RefusalRule(
        429,
        "rate_limit_error",
        _rate_limited,
        lambda d: {"limit": d.limit_kind, "scope": d.limit_scope, **refusal_details(d)},
        retry=True,
    ),
    "quota_exceeded": RefusalRule(
        429,
        "insufficient_quota",
        _quota_exceeded,
        lambda d: {
            "limit": "quota",
            "scope": d.limit_scope,
            "quota": d.quota,
            "resets_at": d.resets_at.isoformat() if d.resets_at else None,
            **refusal_details(d),
        },
        retry=True,
    ),
    "credits_exhausted": RefusalRule(
        402,
        "credits_exhausted",
        lambda tenant, d: CreditsExhausted(
            balance=d.credit_balance or Decimal(0), message=refusal_message(tenant, d)
        ),
        lambda d: {"limit": "credits", "balance": money_text(d.credit_balance or Decimal(0))},
        never_retry=True,  # not before a top-up
    ),
    "unpriced_model": RefusalRule(
        422,
        "invalid_request_error",
        lambda tenant, d: UnpricedModel(refusal_message(tenant, d)),
        lambda d: {"model": d.model},
    ),
    "too_large": RefusalRule(
        413,
        "request_too_large",
        _too_large,
        lambda d: {
            "limit": d.limit_kind or "tokens",
            "scope": d.limit_scope,
            # a weighted request's cost is its policy's request_cost: not in the answer
            "requested": None if d.limit_kind == "requests" else d.reserved_tokens,
            "capacity": d.capacity,
            **refusal_details(d),
        },
        never_retry=True,  # it can never fit: the SDKs must not retry
    ),
}
