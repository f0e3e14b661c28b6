"""Comparison 1: library admissions per second, llmquota vs the Redis + Lua bucket.

Both are driven from this one Python process by the same closed-loop callers:
`await limiter.admit(...)` (validation, one batched statement, a Reservation)
against `await bucket.reserve(...)` (one EVALSHA). One hot tenant, or a
random tenant out of 10,000 per call; the global layer is on in both. Each
is measured in a settled process (`settle_after_startup` once it has
connected, as README advises a latency-sensitive host: start-up's objects
frozen out of the garbage collector), the Redis side as much as ours.
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass

from bench import redis_lua
from bench.common import (
    BENCH_DECISION_DEADLINE_MS,
    UNLIMITED_TOKENS_PER_MINUTE,
    LoadResult,
    closed_loop,
    reset_state,
)
from llmquota import Limiter, RateLimited, Settings, settle_after_startup

INPUT_TOKENS = 300
MAX_TOKENS = 2_000
# Pool sizes: the batched limiter needs few connections; one statement per
# request needs one per caller to be at its best.
BATCHED_POOL_SIZE = 10
UNBATCHED_POOL_SIZE = 64


@dataclass(frozen=True)
class Point:
    system: str
    workload: str
    callers: int
    result: LoadResult


@dataclass(frozen=True)
class Variant:
    """One configuration of llmquota."""

    name: str
    batching: bool = True
    synchronous_commit: bool = True
    # Every tenant's policy says "admission": "allotted" (admission/allotments.py).
    allotted: bool = False

    def settings(self) -> Settings:
        return Settings(
            batching=self.batching,
            admission_synchronous_commit=self.synchronous_commit,
            pool_min_size=2,
            decision_deadline_ms=BENCH_DECISION_DEADLINE_MS,
            pool_max_size=BATCHED_POOL_SIZE if self.batching else UNBATCHED_POOL_SIZE,
            _env_file=None,  # type: ignore[call-arg]
        )


LLMQUOTA = Variant("llmquota")
ALLOTTED = Variant("llmquota, allotted", allotted=True)
VARIANTS_AT_64 = (
    ALLOTTED,
    Variant("llmquota, one statement per request", batching=False),
    Variant("llmquota, synchronous_commit off for admission", synchronous_commit=False),
    Variant(
        "llmquota, one statement per request, synchronous_commit off",
        batching=False,
        synchronous_commit=False,
    ),
)


def tenant_picker(workload: str, tenants: list[str], seed: int) -> list[str]:
    """Per-caller sequence source: the hot tenant, or uniform over all tenants."""
    if workload == "hot":
        return [tenants[0]]
    rng = random.Random(seed)
    return [rng.choice(tenants) for _ in range(4_096)]


async def llmquota_point(
    dsn: str, variant: Variant, *, workload: str, tenants: list[str], callers: int, seconds: float
) -> Point:
    await reset_state(dsn, admission="allotted" if variant.allotted else None)
    limiter = await Limiter.connect(dsn, variant.settings())
    settle_after_startup()
    picks = [tenant_picker(workload, tenants, seed) for seed in range(callers)]
    counters = [0] * callers

    async def call(index: int) -> bool:
        sequence = picks[index]
        counters[index] += 1
        tenant = sequence[counters[index] % len(sequence)]
        try:
            await limiter.admit(
                tenant=tenant, model="gpt-4o", input_tokens=INPUT_TOKENS, max_tokens=MAX_TOKENS
            )
        except RateLimited:
            return False
        if variant.allotted:
            # A decision from a slice completes without yielding to the event
            # loop: yield once per call, as a server's task per request does,
            # so that the other callers (and the journal) run between calls.
            await asyncio.sleep(0)
        return True

    try:
        result = await closed_loop(call, callers, seconds, warmup_s=min(1.0, seconds / 3))
    finally:
        await limiter.close()
    return Point(variant.name, workload, callers, result)


async def unlimited_bucket(client: redis_lua.Client, host: str, port: int) -> redis_lua.TokenBucket:
    """The Redis + Lua bucket on `client`, emptied, with limits nothing reaches."""
    limits = redis_lua.Limits(
        tenant_capacity=UNLIMITED_TOKENS_PER_MINUTE,
        tenant_tokens_per_minute=UNLIMITED_TOKENS_PER_MINUTE,
        global_capacity=UNLIMITED_TOKENS_PER_MINUTE,
        global_tokens_per_minute=UNLIMITED_TOKENS_PER_MINUTE,
    )
    bucket = await redis_lua.connect(client, host, port, limits)
    await bucket.flush()
    return bucket


async def redis_point(
    host: str,
    port: int,
    client: redis_lua.Client,
    *,
    workload: str,
    tenants: list[str],
    callers: int,
    seconds: float,
) -> Point:
    bucket = await unlimited_bucket(client, host, port)
    settle_after_startup()
    picks = [tenant_picker(workload, tenants, seed) for seed in range(callers)]
    counters = [0] * callers

    async def call(index: int) -> bool:
        sequence = picks[index]
        counters[index] += 1
        allowed, _ = await bucket.reserve(
            sequence[counters[index] % len(sequence)], INPUT_TOKENS + MAX_TOKENS
        )
        return allowed

    try:
        result = await closed_loop(call, callers, seconds, warmup_s=min(1.0, seconds / 3))
    finally:
        await bucket.close()
    return Point(f"redis-lua, {client.name}", workload, callers, result)
