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

from llmquota.api.headers import rate_limit_headers, token_limit_headers
from llmquota.api.provider_errors import Kind, error_body
from llmquota.domain.records import AdmitDecision, TenantFigures
from llmquota.domain.refusal_table import REFUSALS
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

# The proxied endpoints; each speaks the format of its kind. count_tokens is
# Anthropic's POST /v1/messages/count_tokens (no admission: nothing is generated).
Endpoint = Literal["chat", "completions", "embeddings", "messages", "count_tokens"]


def kind_of(endpoint: Endpoint) -> Kind:
    """The wire format of an endpoint."""
    return "anthropic" if endpoint in ("messages", "count_tokens") else "openai"


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


def limit_headers(kind: Kind, decision: AdmitDecision) -> dict[str, str]:
    """The tenant's rate-limit headers in the dialect of `kind`, and the binding
    token layer's X-TokenLimit-* (llmquota.api.headers) beside them."""
    if kind == "anthropic":
        headers = anthropic_rate_limit_headers(decision.tenant, datetime.now(UTC))
    else:
        headers = rate_limit_headers(decision.tenant)
    return headers | token_limit_headers(decision.binding)


def refusal(kind: Kind, tenant: str, decision: AdmitDecision) -> JSONResponse | None:
    """The answer to a refused decision, as the provider would send it; else None.

    Status and retry headers are the refusal table's; the error type is the
    provider's dialect (OpenAI names the limit, and a quota `insufficient_quota`).
    """
    rule = REFUSALS.get(decision.status)
    if rule is None:
        return None
    headers = limit_headers(kind, decision)
    if rule.retry:
        retry_ms = int(decision.retry_after_ms or 1)
        headers["retry-after"] = str(ceil_seconds(retry_ms))
        headers["retry-after-ms"] = str(retry_ms)
    if rule.never_retry:
        headers["x-should-retry"] = "false"
    error_type: str | None = None
    code: str | None = None
    if kind == "openai" and decision.status == "rate_limited":
        error_type = decision.limit_kind
    if kind == "openai" and decision.status == "quota_exceeded":
        error_type = code = "insufficient_quota"
    message = refusal_message(tenant, decision)
    return error_response(
        kind, rule.http_status, message, headers=headers, error_type=error_type, code=code
    )


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def usage_of(kind: Kind, usage: object) -> tuple[object, object]:
    """(input, output) tokens of a provider's `usage` object, as reported; None where absent.

    Not judged here: a figure may be a string, negative or absurd, and
    domain/upstream_usage.py decides what to settle instead. Anthropic
    reports cached input apart from `input_tokens`; all of it is input,
    summed when every part is a count (else the first part that is not).
    """
    if not isinstance(usage, Mapping):
        return None, None
    if kind == "openai":
        return usage.get("prompt_tokens"), usage.get("completion_tokens")
    fresh = usage.get("input_tokens")
    cached = [
        usage[field]
        for field in ("cache_creation_input_tokens", "cache_read_input_tokens")
        if usage.get(field) is not None
    ]
    if fresh is not None and cached:
        parts = [fresh, *cached]
        bad = [part for part in parts if not _is_count(part)]
        fresh = bad[0] if bad else sum(parts)
    return fresh, usage.get("output_tokens")
