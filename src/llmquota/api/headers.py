"""Rate-limit response headers, computed from the tenant layer's figures.

Two dialects: the IETF httpapi ratelimit-headers draft (`RateLimit-Policy`,
`RateLimit`, structured fields) and the OpenAI-style `x-ratelimit-*` headers
client SDKs already read. Pure functions.
"""

from __future__ import annotations

import math

from llmquota.domain.records import TenantFigures
from llmquota.domain.refusals import seconds_until_full

WINDOW_SECONDS = 60


def format_duration(seconds: float) -> str:
    """OpenAI's reset format: '20ms', '1.5s', '6m0s'."""
    if seconds < 1:
        return f"{math.ceil(seconds * 1000)}ms"
    minutes, rest = divmod(seconds, 60)
    rest_text = f"{rest:.3f}".rstrip("0").rstrip(".") + "s"
    return f"{int(minutes)}m{rest_text}" if minutes else rest_text


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
