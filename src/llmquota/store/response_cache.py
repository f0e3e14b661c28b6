"""The response cache's statements (sql/cache.sql): serve, store, sweep.

Each is one round trip. Serving a hit writes its ledger row in the same
statement, so a request answered from the cache is on the books exactly
once whatever happens to the connection after.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from decimal import Decimal

from llmquota.domain.response_cache import SIGNATURE_MAX_DISTANCE
from llmquota.store.pool import DeadlinePool
from llmquota.store.sqlfiles import named_queries

# How much longer than its budget the worker waits for a lookup's answer: the
# statement's own check (book nothing past the budget) answers first. Only a
# server that freezes between that check and its commit for longer than this
# can book a hit the worker gave up on (the window admission closes with
# abandoned.py; for a hit, a row at 0 tokens and the policy's price).
BUDGET_GRACE_SECONDS = 1.0


@dataclass(frozen=True, slots=True)
class CacheKey:
    """Where an answer lives: the namespace and the request's keys."""

    tenant: str
    route: str | None
    endpoint: str
    model: str
    exact_key: bytes
    # semantic only: the context, the last user turn's embedding (length 1)
    # and its SimHash
    context_key: bytes | None = None
    embedding: Sequence[float] | None = None
    signature: int | None = None


@dataclass(frozen=True, slots=True)
class CacheHit:
    """An answer served from the cache, and the ledger row that recorded it."""

    hit_id: uuid.UUID
    entry_id: int
    answer: bytes
    input_tokens: int
    output_tokens: int
    similarity: float


def _key_arguments(key: CacheKey) -> tuple[object, ...]:
    """A key as the first eight arguments of lq_cache_serve and lq_cache_store."""
    embedding = None if key.embedding is None else list(key.embedding)
    return (
        key.tenant,
        key.route or "",
        key.endpoint,
        key.model,
        key.exact_key,
        key.context_key,
        embedding,
        key.signature,
    )


class ResponseCacheStore:
    """Typed access to the response cache."""

    def __init__(self, pool: DeadlinePool) -> None:
        self._pool = pool
        self._sql = named_queries("cache_queries.sql")

    async def serve(
        self,
        key: CacheKey,
        *,
        similarity: float,
        price_usd: Decimal | None,
        budget_seconds: float,
        key_id: int | None = None,
        reservation_id: uuid.UUID | None = None,
    ) -> CacheHit | None:
        """The cached answer for `key` (exact, else the nearest of its context at
        or above `similarity` when the key has an embedding), recorded in the
        ledger as a hit; None on a miss.

        A statement that finds a hit past `budget_seconds` books nothing and
        answers a miss; this worker waits BUDGET_GRACE_SECONDS longer before
        it gives up on the statement, so that the database's own answer comes
        first and a hit is never booked for a request that went on without it.
        A priced hit is charged to the cost quotas it matches (the tenant's, its
        route's and API key `key_id`'s) and a prepaid tenant's credits, and is a
        miss when they lack room for it, counting what the request's own
        `reservation_id` holds (a lookup once admitted) as room (sql/cache.sql).
        """
        rows = await self._pool.fetch(
            self._sql["cache_serve"],
            (
                *_key_arguments(key),
                SIGNATURE_MAX_DISTANCE,
                similarity,
                price_usd,
                max(1, round(budget_seconds * 1000)),
                key_id,
                reservation_id,
            ),
            deadline_seconds=budget_seconds + BUDGET_GRACE_SECONDS,
        )
        if not rows:
            return None
        row = rows[0]
        return CacheHit(
            hit_id=row["hit_id"],
            entry_id=int(row["entry_id"]),
            answer=bytes(row["answer"]),
            input_tokens=int(row["input_tokens"]),
            output_tokens=int(row["output_tokens"]),
            similarity=float(row["similarity"]),
        )

    async def store(
        self,
        key: CacheKey,
        answer: bytes,
        *,
        input_tokens: int,
        output_tokens: int,
        ttl_seconds: int,
        max_entries: int,
        deadline_seconds: float | None = None,
    ) -> int:
        """Keep `answer` under `key` for `ttl_seconds`; how many older entries of the
        tenant the `max_entries` bound removed."""
        rows = await self._pool.fetch(
            self._sql["cache_store"],
            (
                *_key_arguments(key),
                answer,
                input_tokens,
                output_tokens,
                ttl_seconds,
                max_entries,
            ),
            deadline_seconds=deadline_seconds,
        )
        return int(rows[0]["removed"])

    async def sweep(self, limit: int, *, deadline_seconds: float | None = None) -> int:
        """Delete up to `limit` expired entries; how many."""
        rows = await self._pool.fetch(
            self._sql["cache_sweep"], (limit,), deadline_seconds=deadline_seconds
        )
        return int(rows[0]["removed"])
