"""Rate-limit response headers, computed from a decision's figures.

Two dialects of the tenant layer: the IETF httpapi ratelimit-headers draft
(`RateLimit-Policy`, `RateLimit`, structured fields) and the OpenAI-style
`x-ratelimit-*` headers client SDKs already read. And the binding token
layer's (the one that refused, else the one with the least left, which may
be a route, the global layer or a provider ceiling): `X-TokenLimit-Limit`
(its token_burst), `X-TokenLimit-Remaining` and `X-TokenLimit-Reset`
(seconds until it is full again at its refill rate), the names token-budget
clients read. Pure functions.
"""

from __future__ import annotations

import math

from llmquota.domain.records import AdmitDecision, TenantFigures, TokenLayerFigures
from llmquota.domain.refusals import seconds_until_full

WINDOW_SECONDS = 60


def format_duration(seconds: float) -> str:
    """OpenAI's reset format: '20ms', '1.5s', '6m0s'."""
    if seconds < 1:
        return f"{math.ceil(seconds * 1000)}ms"
    minutes, rest = divmod(seconds, 60)
    rest_text = f"{rest:.3f}".rstrip("0").rstrip(".") + "s"
    return f"{int(minutes)}m{rest_text}" if minutes else rest_text


def decision_headers(decision: AdmitDecision) -> dict[str, str]:
    """Every rate-limit header of a decision: the tenant layer's and the binding layer's."""
    return rate_limit_headers(decision.tenant) | token_limit_headers(decision.binding)


def token_limit_headers(binding: TokenLayerFigures | None) -> dict[str, str]:
    """`X-TokenLimit-*` of the binding token layer; empty when it is not known."""
    if binding is None:
        return {}
    per_minute, burst, balance = binding
    if per_minute is None or burst is None or balance is None:
        return {}
    until_full = seconds_until_full(balance, burst, per_minute) or 0.0
    return {
        "X-TokenLimit-Limit": str(burst),
        "X-TokenLimit-Remaining": str(max(0, math.floor(balance))),
        "X-TokenLimit-Reset": str(math.ceil(until_full)),
    }


def rate_limit_headers(figures: TenantFigures) -> dict[str, str]:
    """Headers describing the tenant layer after a decision; empty if it has no limits."""
    headers: dict[str, str] = {}
    policies: list[str] = []
    states: list[str] = []
    buckets = (
        ("tokens", figures.tokens_per_minute, figures.token_burst, figures.tokens),
        ("requests", figures.requests_per_minute, figures.request_burst, figures.requests),
    )
    for name, per_minute, burst, balance in buckets:
        if per_minute is None or burst is None or balance is None:
            continue
        remaining = max(0, math.floor(balance))
        until_full = seconds_until_full(balance, burst, per_minute) or 0.0
        policies.append(f'"{name}";q={per_minute};w={WINDOW_SECONDS}')
        states.append(f'"{name}";r={remaining};t={math.ceil(until_full)}')
        headers[f"x-ratelimit-limit-{name}"] = str(per_minute)
        headers[f"x-ratelimit-remaining-{name}"] = str(remaining)
        headers[f"x-ratelimit-reset-{name}"] = format_duration(until_full)
    if policies:
        headers["RateLimit-Policy"] = ", ".join(policies)
        headers["RateLimit"] = ", ".join(states)
    return headers
