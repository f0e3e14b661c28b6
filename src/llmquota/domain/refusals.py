"""How a refusal reads: the sentence, the retry hint, the time to a full bucket.

Pure. The library's exceptions, the REST bodies and the rate-limit headers
all say the same thing in the same words, because they all come from here.
"""

from __future__ import annotations

import math
from decimal import Decimal

from llmquota.domain.money import money_text
from llmquota.domain.records import AdmitDecision, LayerStatus


def refusal_message(tenant: str, d: AdmitDecision) -> str:
    """A sentence a developer can act on: what bound, and what to do."""
    if d.status == "quota_exceeded":
        until = d.resets_at.isoformat() if d.resets_at else "its window resets"
        if d.alt_max_tokens:
            # Room is left, only not this much: say what still fits.
            return (
                f"This request's reservation does not fit in what is left of the "
                f"{d.limit_scope} quota {d.quota!r} of tenant {tenant} until {until}; "
                f"with the same input, max_tokens up to {d.alt_max_tokens} fits."
            )
        return (
            f"The {d.limit_scope} quota {d.quota!r} of tenant {tenant} has no room left for "
            f"this request's input until {until}."
        )
    if d.status == "credits_exhausted":
        balance = money_text(d.credit_balance or Decimal(0))
        return (
            f"The prepaid balance of tenant {tenant} ({balance}) cannot cover this "
            f"request's maximum cost; top up the credits or lower max_tokens."
        )
    if d.status == "unpriced_model":
        return (
            f"Model {d.model!r} has no price, and a cost quota or a prepaid balance of tenant "
            f"{tenant} applies to it; set its price (llmquota prices set) first."
        )
    if d.status == "too_large" and d.limit_kind == "requests":
        return (
            f"Each request of tenant {tenant} here counts as more requests (its policy's "
            f"request_cost) than the {d.limit_scope} request capacity, {d.capacity}; it can "
            f"never fit. Lower request_cost or raise request_burst."
        )
    if d.status == "too_large":
        return (
            f"Request reserves {d.reserved_tokens} tokens but the {d.limit_scope} token "
            f"capacity for tenant {tenant} is {d.capacity}; it can never fit. Lower "
            f"max_tokens or split the input."
        )
    retry_s = (d.retry_after_ms or 0) / 1000.0
    if d.reason == "shed" and d.ceiling:
        # Not short of tokens: the ceiling keeps its last room for higher priorities.
        used = f" at {d.utilization:.0%} utilization" if d.utilization is not None else ""
        return (
            f"The provider ceiling {d.ceiling!r}{used} is shedding: it admits only requests "
            f"of a priority above {d.priority or 'this one'} now (tenant {tenant}); retry in "
            f"{retry_s:.3f}s."
        )
    what = {
        "tokens": f"has too few tokens for {d.reserved_tokens}",
        "requests": "is out of requests",
        "concurrency": "has no free concurrency permit",
    }.get(d.limit_kind or "", "refused")
    return (
        f"The {d.limit_scope} {d.limit_kind} limit for tenant {tenant} {what}; "
        f"retry in {retry_s:.3f}s."
    )


def seconds_until_full(
    balance: float | None, burst: int | None, per_minute: int | None
) -> float | None:
    """How long a bucket takes to refill completely; None where there is no limit."""
    if balance is None or burst is None or not per_minute:
        return None
    return max(0.0, (burst - balance) * 60.0 / per_minute)


def binding_retry_ms(layer: LayerStatus, concurrency_retry_ms: int) -> int | None:
    """The wait until a layer admits a minimal request (one token, one request); None
    when it would admit one now.

    A bucket short of one unit binds for its deficit over its refill rate; a
    layer with every permit taken binds for the concurrency retry hint (when a
    permit frees depends on its holder, not on a clock). The longest wait wins:
    a request needs all of them.
    """
    policy = layer.policy
    waits: list[float] = []
    for balance, per_minute in (
        (layer.tokens, policy.tokens_per_minute),
        (layer.requests, policy.requests_per_minute),
    ):
        if balance is not None and per_minute and balance < 1.0:
            waits.append((1.0 - balance) * 60_000.0 / per_minute)
    if policy.max_in_flight is not None and layer.in_flight >= policy.max_in_flight:
        waits.append(float(concurrency_retry_ms))
    return max(1, math.ceil(max(waits))) if waits else None


def ceil_seconds(milliseconds: int) -> int:
    """Whole seconds, rounded up, for a Retry-After header."""
    return max(1, math.ceil(milliseconds / 1000))
