"""The two wire formats the proxy speaks: errors, rate-limit headers, usage.

An SDK decides what to do with an answer from its status, its error body and
its headers (OpenAI's `x-ratelimit-*`, `retry-after-ms`; Anthropic's
`anthropic-ratelimit-*`, `retry-after`). A proxy that answers a refusal in
llmquota's own shape would make the SDK raise the wrong error and retry at
the wrong time, so every answer the proxy makes itself is rendered here, in
the format of the endpoint that was called.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from datetime import UTC, datetime, timedelta
from typing import Literal

from fastapi.responses import JSONResponse

from llmquota.api.headers import rate_limit_headers
from llmquota.api.provider_errors import Kind, error_body
from llmquota.domain.records import AdmitDecision, TenantFigures
from llmquota.domain.refusals import ceil_seconds, refusal_message, seconds_until_full

__all__ = [
    "Endpoint",
    "Kind",
    "anthropic_rate_limit_headers",
    "error_body",
    "error_response",
    "kind_of",
    "limit_headers",
    "refusal",
    "usage_of",
]

# The proxied endpoints; each speaks the format of its kind.
Endpoint = Literal["chat", "completions", "embeddings", "messages"]


def kind_of(endpoint: Endpoint) -> Kind:
    """The wire format of an endpoint."""
    return "anthropic" if endpoint == "messages" else "openai"


def error_response(
    kind: Kind,
    status: int,
    message: str,
    *,
    headers: Mapping[str, str] | None = None,
    error_type: str | None = None,
    code: str | None = None,
    param: str | None = None,
) -> JSONResponse:
    """An answer the proxy makes itself, in the provider's format."""
    return JSONResponse(
        error_body(kind, status, message, error_type=error_type, code=code, param=param),
        status_code=status,
        headers=headers,
    )


def anthropic_rate_limit_headers(figures: TenantFigures, now: datetime) -> dict[str, str]:
    """`anthropic-ratelimit-{tokens,requests}-{limit,remaining,reset}` of the tenant layer."""
    headers: dict[str, str] = {}
    buckets = (
        ("tokens", figures.tokens_per_minute, figures.token_burst, figures.tokens),
        ("requests", figures.requests_per_minute, figures.request_burst, figures.requests),
    )
    for name, per_minute, burst, balance in buckets:
        if per_minute is None or burst is None or balance is None:
            continue
        until_full = seconds_until_full(balance, burst, per_minute) or 0.0
        reset = (now + timedelta(seconds=math.ceil(until_full))).replace(microsecond=0)
        headers[f"anthropic-ratelimit-{name}-limit"] = str(per_minute)
        headers[f"anthropic-ratelimit-{name}-remaining"] = str(max(0, math.floor(balance)))
        headers[f"anthropic-ratelimit-{name}-reset"] = reset.isoformat().replace("+00:00", "Z")
    return headers


def limit_headers(kind: Kind, figures: TenantFigures) -> dict[str, str]:
    """The tenant's rate-limit headers in the dialect of `kind`."""
    if kind == "anthropic":
        return anthropic_rate_limit_headers(figures, datetime.now(UTC))
    return rate_limit_headers(figures)


def refusal(kind: Kind, tenant: str, decision: AdmitDecision) -> JSONResponse | None:
    """A 429 or 413 for a refused decision, as the provider would send it; else None."""
    headers = limit_headers(kind, decision.tenant)
    message = refusal_message(tenant, decision)
    if decision.status == "rate_limited":
        retry_ms = int(decision.retry_after_ms or 1)
        headers["retry-after"] = str(ceil_seconds(retry_ms))
        headers["retry-after-ms"] = str(retry_ms)
        error_type = decision.limit_kind if kind == "openai" else None
        return error_response(kind, 429, message, headers=headers, error_type=error_type)
    if decision.status == "quota_exceeded":
        retry_ms = int(decision.retry_after_ms or 1)
        headers["retry-after"] = str(ceil_seconds(retry_ms))
        headers["retry-after-ms"] = str(retry_ms)
        quota_type = "insufficient_quota" if kind == "openai" else None
        return error_response(
            kind, 429, message, headers=headers, error_type=quota_type, code=quota_type
        )
    if decision.status == "credits_exhausted":
        headers["x-should-retry"] = "false"  # not before a top-up
        return error_response(kind, 402, message, headers=headers)
    if decision.status == "unpriced_model":
        return error_response(kind, 422, message, headers=headers)
    if decision.status == "too_large":
        headers["x-should-retry"] = "false"  # it can never fit: the SDKs must not retry
        return error_response(kind, 413, message, headers=headers)
    return None


def _whole(value: object) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def usage_of(kind: Kind, usage: object) -> tuple[int | None, int | None]:
    """(input, output) tokens of a provider's `usage` object; None where absent.

    Anthropic reports cached input apart from `input_tokens`; all of it is input.
    """
    if not isinstance(usage, Mapping):
        return None, None
    if kind == "openai":
        prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
        return (
            _whole(prompt) if prompt is not None else None,
            _whole(completion) if completion is not None else None,
        )
    fresh = usage.get("input_tokens")
    cached = _whole(usage.get("cache_creation_input_tokens")) + _whole(
        usage.get("cache_read_input_tokens")
    )
    output = usage.get("output_tokens")
    return (
        _whole(fresh) + cached if fresh is not None else None,
        _whole(output) if output is not None else None,
    )
