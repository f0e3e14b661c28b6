"""Worker-local limits for the `local` failure mode. Pure arithmetic, no I/O.

While PostgreSQL cannot decide, a worker may admit requests for layers whose
failure mode is `local` against buckets of its own: a fraction of each limit
(capacity, refill and concurrency alike), so that several workers doing the
same stay under the real limit between them. A worker's buckets start full
(it cannot know the real balance) and refill on the worker's monotonic clock,
which is the only clock there is while the database is away.

The shape mirrors lq_admit: a request passes every layer or none, nothing is
debited unless all pass, and a refusal names the layer with the longest wait.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from llmquota.domain.policy import ONE_CALL, CallWeight, Policy
from llmquota.domain.vocabulary import LimitKind, Scope

# The wait reported for a bucket that cannot refill (about 24 days).
NEVER_MS = 2**31 - 1


@dataclass(slots=True)
class Bucket:
    """A token bucket: `balance` of `capacity`, refilled at `per_second`."""

    capacity: float
    per_second: float
    balance: float
    updated_at: float

    @classmethod
    def full(cls, capacity: float, per_minute: float, now: float) -> Bucket:
        return cls(
            capacity=capacity, per_second=per_minute / 60.0, balance=capacity, updated_at=now
        )

    def refill(self, now: float) -> None:
        """Add what accrued since the last refill, never past capacity or backwards in time."""
        elapsed = max(0.0, now - self.updated_at)
        self.balance = min(self.capacity, self.balance + elapsed * self.per_second)
        self.updated_at = max(self.updated_at, now)

    def wait_ms(self, cost: float) -> int:
        """Milliseconds until `cost` fits; 0 when it fits now."""
        deficit = cost - self.balance
        if deficit <= 0:
            return 0
        if self.per_second <= 0:
            return NEVER_MS
        return min(NEVER_MS, max(1, math.ceil(deficit / self.per_second * 1000)))

    def credit(self, amount: float) -> None:
        """Give back (or, when negative, take) tokens; never above capacity."""
        self.balance = min(self.capacity, self.balance + amount)


@dataclass(slots=True)
class LocalLayer:
    """One layer's worker-local limits: a fraction of its policy."""

    scope: Scope
    tokens: Bucket | None
    requests: Bucket | None
    max_in_flight: int | None
    in_flight: int = 0

    @classmethod
    def from_policy(cls, scope: Scope, policy: Policy, fraction: float, now: float) -> LocalLayer:
        """Full buckets holding `fraction` of the policy's limits, rounded down."""
        p = policy.resolved()
        tokens = requests = None
        if p.tokens_per_minute is not None and p.token_burst is not None:
            tokens = Bucket.full(
                math.floor(p.token_burst * fraction), p.tokens_per_minute * fraction, now
            )
        if p.requests_per_minute is not None and p.request_burst is not None:
            requests = Bucket.full(
                math.floor(p.request_burst * fraction), p.requests_per_minute * fraction, now
            )
        max_in_flight = None
        if p.max_in_flight is not None:
            max_in_flight = math.floor(p.max_in_flight * fraction)
        return cls(scope=scope, tokens=tokens, requests=requests, max_in_flight=max_in_flight)


@dataclass(frozen=True, slots=True)
class LocalRefusal:
    """Why the local limits refused: the limit and layer with the longest wait."""

    limit: LimitKind
    scope: Scope
    retry_after_ms: int


def admit_locally(
    layers: Sequence[LocalLayer],
    cost: int,
    now: float,
    concurrency_retry_ms: int,
    weight: CallWeight = ONE_CALL,
) -> LocalRefusal | None:
    """Debit `cost` tokens, the call's requests and its permit (`weight`) on every
    layer, or refuse.

    All or nothing: when any layer refuses, no layer is debited (but every
    bucket is refilled to `now`, which changes nothing observable).
    """
    best: LocalRefusal | None = None
    for layer in layers:
        waits: list[tuple[int, LimitKind]] = []
        if layer.tokens is not None:
            layer.tokens.refill(now)
            waits.append((layer.tokens.wait_ms(cost), "tokens"))
        if layer.requests is not None and weight.requests:
            layer.requests.refill(now)
            waits.append((layer.requests.wait_ms(weight.requests), "requests"))
        if (
            weight.permits
            and layer.max_in_flight is not None
            and layer.in_flight >= layer.max_in_flight
        ):
            waits.append((concurrency_retry_ms, "concurrency"))
        for wait, kind in waits:
            if wait > 0 and (best is None or wait > best.retry_after_ms):
                best = LocalRefusal(limit=kind, scope=layer.scope, retry_after_ms=wait)
    if best is not None:
        return best
    for layer in layers:
        if layer.tokens is not None:
            layer.tokens.balance -= cost
        if layer.requests is not None:
            layer.requests.balance -= weight.requests
        layer.in_flight += weight.permits
    return None


def give_back_locally(
    layers: Sequence[LocalLayer], tokens: float, requests: float, now: float, permits: int = 1
) -> None:
    """Return a local reservation: credit tokens and requests, free its permit.

    `tokens` is what to give back (reserved - charged on a settle, which is
    negative when more was used than reserved; everything on a release).
    """
    for layer in layers:
        if layer.tokens is not None:
            layer.tokens.refill(now)
            layer.tokens.credit(tokens)
        if layer.requests is not None:
            layer.requests.refill(now)
            layer.requests.credit(requests)
        layer.in_flight = max(0, layer.in_flight - permits)
