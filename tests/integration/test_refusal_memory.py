"""A flood of refusals is cheap: a refusal writes nothing, and a worker answers a
tenant's repeat requests from memory while its refusal holds (admission/refusals.py).

The memory's one cost is named and measured here: a settlement in another
worker makes room this worker does not hear of, and its requests in the next
moments are refused although they would fit. The bound is 100 ms.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import asyncpg
import pytest

from llmquota.admission.limiter import Limiter
from llmquota.config import Settings
from llmquota.domain.errors import RateLimited
from tests.integration.support import put

BOUND_SECONDS = 0.1


@pytest.fixture
async def other_worker(app_dsn: str, settings: Settings) -> AsyncIterator[Limiter]:
    """A second worker (its own pool and memory) on the same database."""
    worker = await Limiter.connect(app_dsn, settings)
    yield worker
    await worker.close()


def answered_from_memory(limiter: Limiter) -> float:
    return limiter.metrics.refusals_from_memory._value.get()  # type: ignore[attr-defined, no-any-return]


async def row_version(db: asyncpg.Connection, tenant: str) -> str:
    version: str = await db.fetchval(
        "SELECT xmin::text FROM limit_layers WHERE scope = 'tenant' AND tenant = $1", tenant
    )
    return version


async def test_a_flood_of_refusals_is_one_statement_and_writes_nothing(
    limiter: Limiter, db: asyncpg.Connection
) -> None:
    await put(limiter, "tenant", "acme", tokens_per_minute=60, token_burst=1_000)
    await limiter.admit(tenant="acme", model="gpt-4o", input_tokens=900, max_tokens=0)
    version = await row_version(db, "acme")

    hints = []
    for _ in range(200):
        with pytest.raises(RateLimited) as refused:
            await limiter.admit(tenant="acme", model="gpt-4o", input_tokens=500, max_tokens=0)
        hints.append(refused.value.retry_after_ms)

    # The first was decided by the store; the rest, within its 100 ms, from
    # memory (a slow moment may let the store decide once or twice more).
    statements = 200 - answered_from_memory(limiter)
    print(f"200 refusals: {statements:.0f} decided by the store, the rest from memory")
    assert 1 <= statements <= 3, statements
    # 400 tokens short at 1 a second: the hint, counted down, never below 1 ms.
    assert 395_000 <= min(hints) <= max(hints) <= 400_000, (min(hints), max(hints))
    # Nothing was written: the tenant's row is the version the admission left.
    assert await row_version(db, "acme") == version


async def test_a_settlement_in_this_worker_ends_the_memory_at_once(limiter: Limiter) -> None:
    await put(limiter, "tenant", "acme", tokens_per_minute=60, token_burst=1_000)
    held = await limiter.admit(tenant="acme", model="gpt-4o", input_tokens=900, max_tokens=0)
    with pytest.raises(RateLimited):
        await limiter.admit(tenant="acme", model="gpt-4o", input_tokens=500, max_tokens=0)
    await held.settle(input_tokens=100, output_tokens=0)  # 800 come back
    # No wrongly refused request: the next one is decided by the store.
    await limiter.admit(tenant="acme", model="gpt-4o", input_tokens=500, max_tokens=0)


async def test_a_smaller_request_or_an_idempotent_retry_is_decided_by_the_store(
    limiter: Limiter,
) -> None:
    await put(limiter, "tenant", "acme", tokens_per_minute=60, token_burst=1_000)
    first = await limiter.admit(
        tenant="acme", model="gpt-4o", input_tokens=900, max_tokens=0, idempotency_key="k"
    )
    with pytest.raises(RateLimited):
        await limiter.admit(tenant="acme", model="gpt-4o", input_tokens=500, max_tokens=0)
    # 100 left: a request of 50 fits and is admitted although 500 was just refused.
    await limiter.admit(tenant="acme", model="gpt-4o", input_tokens=50, max_tokens=0)
    # A retry of the admitted key gets its admission back, not the refusal.
    again = await limiter.admit(
        tenant="acme", model="gpt-4o", input_tokens=900, max_tokens=0, idempotency_key="k"
    )
    assert again.reservation_id == first.reservation_id


def _from_memory(worker: Limiter) -> float:
    """How many refusals `worker` has answered from its memory so far."""
    return worker.metrics.refusals_from_memory._value.get()


@pytest.mark.parametrize("memory_ms", [100, 0])
async def test_room_made_by_another_worker_is_seen_within_100_ms(
    app_dsn: str, settings: Settings, other_worker: Limiter, memory_ms: int
) -> None:
    """The one cost of the memory, measured: requests wrongly refused after another
    worker released what this one's refusal lacked. With the memory off, none."""
    worker = await Limiter.connect(
        app_dsn, settings.model_copy(update={"refusal_memory_ms": memory_ms})
    )
    try:
        await put(worker, "tenant", "acme", tokens_per_minute=60, token_burst=1_000)
        worst = 0.0
        wrongly_refused = []
        for _ in range(10):
            held = await other_worker.admit(
                tenant="acme", model="gpt-4o", input_tokens=1_000, max_tokens=0
            )
            with pytest.raises(RateLimited):
                await worker.admit(tenant="acme", model="gpt-4o", input_tokens=500, max_tokens=0)
            await held.release()  # the other worker makes room; this one is not told
            released = time.monotonic()
            refused = 0
            # When the last refusal answered from memory was asked: the memory's
            # promise. The store's own answer after it (one round trip, which a
            # busy disk can stall for a few hundred ms) is not the memory's time.
            last_from_memory = released
            while True:
                from_memory = _from_memory(worker)
                asked = time.monotonic()
                try:
                    admitted = await worker.admit(
                        tenant="acme", model="gpt-4o", input_tokens=500, max_tokens=0
                    )
                except RateLimited:
                    refused += 1
                    if _from_memory(worker) > from_memory:
                        last_from_memory = asked
                    await asyncio.sleep(0.001)  # a client retrying every millisecond
                    continue
                break
            worst = max(worst, last_from_memory - released)
            wrongly_refused.append(refused)
            await admitted.release()
        print(
            f"memory {memory_ms} ms: wrongly refused per release {wrongly_refused} "
            f"(max {max(wrongly_refused)}), the last refusal from memory at most "
            f"{worst * 1000:.1f} ms after the release"
        )
        if memory_ms == 0:
            assert wrongly_refused == [0] * 10
        else:
            # Each refused retry was answered from memory, within the bound.
            assert worst <= BOUND_SECONDS + 0.05, worst
    finally:
        await worker.close()
