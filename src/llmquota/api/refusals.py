"""How a refused admission answers over HTTP: 429 or 413, body and headers.

A refusal is an answer of the limiter, not an exception of the route, and
clients branch on its fields (`limit`, `scope`, `retry_after_ms`, ...) and its
retry headers; rendering it here, once, keeps those exact. The sentence comes
from llmquota.domain.refusals, like the library's exceptions.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fastapi.responses import JSONResponse

from llmquota.api.errors import error_response
from llmquota.domain.records import AdmitDecision
from llmquota.domain.refusals import ceil_seconds, refusal_message

RATE_LIMITED = 429
TOO_LARGE = 413
PAYMENT_REQUIRED = 402
UNPROCESSABLE = 422


def refusal_response(
    tenant: str, decision: AdmitDecision, headers: Mapping[str, str]
) -> JSONResponse | None:
    """The answer to a refused decision (429, 413, 402, 422); None for any other.

    `headers` (the rate-limit headers) are sent with it, a retryable
    refusal's retry hints after them.
    """
    d = decision
    answer = _answers(d).get(d.status)
    if answer is None:
        return None
    status, error_type, fields = answer
    sent = dict(headers)
    if status == RATE_LIMITED:
        retry_ms = int(d.retry_after_ms or 1)
        sent |= {"Retry-After": str(ceil_seconds(retry_ms)), "retry-after-ms": str(retry_ms)}
        fields["retry_after_ms"] = retry_ms
    return error_response(
        status, error_type, headers=sent, message=refusal_message(tenant, d), **fields
    )


def _answers(d: AdmitDecision) -> dict[str, tuple[int, str, dict[str, Any]]]:
    """(status, error type, body fields) of each refusal, by decision status."""
    return {
        "rate_limited": (
            RATE_LIMITED,
            "rate_limit_error",
            {"limit": d.limit_kind, "scope": d.limit_scope, **refusal_details(d)},
        ),
        "quota_exceeded": (
            RATE_LIMITED,
            "insufficient_quota",
            {
                "limit": "quota",
                "scope": d.limit_scope,
                "quota": d.quota,
                "resets_at": d.resets_at.isoformat() if d.resets_at else None,
                **refusal_details(d),
            },
        ),
        "credits_exhausted": (
            PAYMENT_REQUIRED,
            "credits_exhausted",
            {
                "limit": "credits",
                "balance": str(d.credit_balance if d.credit_balance is not None else 0),
            },
        ),
        "unpriced_model": (UNPROCESSABLE, "invalid_request_error", {"model": d.model}),
        "too_large": (
            TOO_LARGE,
            "request_too_large",
            {
                "limit": "tokens",
                "scope": d.limit_scope,
                "requested": d.reserved_tokens,
                "capacity": d.capacity,
                **refusal_details(d),
            },
        ),
    }


def refusal_cause(d: AdmitDecision) -> dict[str, Any]:
    """What refused the requested model: limit, scope, reason, and the ceiling if one."""
    cause: dict[str, Any] = {"limit": d.limit_kind, "scope": d.limit_scope, "reason": d.reason}
    if d.ceiling is not None:
        cause["ceiling"] = d.ceiling
    return cause


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
