"""Helpers for the admission, settlement and sweeper tests: policies, balances
read back from PostgreSQL, and time shifted in the database itself."""

from __future__ import annotations

import asyncio
import time
import uuid
from datetime import datetime, timedelta
from typing import Any

import asyncpg

from llmquota.admission.limiter import Limiter, Reservation
from llmquota.admission.refusals import MEMORY_SECONDS
from llmquota.domain.errors import LimiterError
from llmquota.domain.policy import Policy
from llmquota.domain.records import LayerStatus
from llmquota.domain.vocabulary import Scope


async def put(
    limiter: Limiter,
    scope: Scope,
    tenant: str | None = None,
    route: str | None = None,
    **policy: Any,
) -> None:
    """Create or replace one layer's policy."""
    await limiter.store.put_policy(scope, tenant, route, Policy(**policy))


async def status(
    limiter: Limiter, tenant: str, scope: Scope = "tenant", route: str | None = None
) -> LayerStatus:
    """One layer as layer_status reports it, refilled to now."""
    for layer in await limiter.store.layer_status(tenant):
        if layer.scope == scope and layer.route == route:
            return layer
    raise LookupError(f"no {scope} layer for {tenant}/{route}")


async def tokens(
    limiter: Limiter, tenant: str, scope: Scope = "tenant", route: str | None = None
) -> float:
    layer = await status(limiter, tenant, scope, route)
    assert layer.tokens is not None
    return layer.tokens


async def raw_layer(
    db: asyncpg.Connection, scope: str, tenant: str | None = None, route: str | None = None
) -> asyncpg.Record:
    """The stored row, without refill: tokens, requests, in_flight, refilled_at."""
    row = await db.fetchrow(
        """SELECT tokens, requests, in_flight, refilled_at, token_burst
             FROM limit_layers
            WHERE scope = $1 AND tenant IS NOT DISTINCT FROM $2
              AND route IS NOT DISTINCT FROM $3""",
        scope,
        tenant,
        route,
    )
    assert row is not None
    return row


def seconds_before(moment: str, seconds: str) -> str:
    """SQL for `moment` minus `seconds` seconds that Citus takes in an UPDATE
    of a cell's table: timestamptz - interval is a stable function, which Citus
    refuses there over a column, and the same sum on UTC wall time is immutable."""
    return f"timezone('UTC', timezone('UTC', {moment}) - make_interval(secs => {seconds}))"


async def database_now(db: asyncpg.Connection) -> datetime:
    """The database's clock, read before an UPDATE that needs it (Citus refuses
    a volatile function in an UPDATE of a distributed table)."""
    now: datetime = await db.fetchval("SELECT clock_timestamp()")
    return now


async def shift_refill(db: asyncpg.Connection, seconds: float, tenant: str | None = None) -> None:
    """Pretend `seconds` passed since the last refill of every layer (of a tenant).

    Real time passes too, as long as a worker remembers a refusal
    (admission/refusals.py): the time shifted here is the database's alone.
    """
    await asyncio.sleep(MEMORY_SECONDS)
    await db.execute(
        f"""UPDATE limit_layers
              SET refilled_at = {seconds_before("refilled_at", "$1")}
            WHERE $2::text IS NULL OR tenant = $2""",
        seconds,
        tenant,
    )


async def expire_leases(db: asyncpg.Connection, ids: list[uuid.UUID] | None = None) -> int:
    """Move active leases 1 s into the past (all of them, or the given ones)."""
    result: str = await db.execute(
        """UPDATE reservations
              SET lease_expires_at = $2
            WHERE state = 'active' AND ($1::uuid[] IS NULL OR reservation_id = ANY ($1))""",
        ids,
        await database_now(db) - timedelta(seconds=1),
    )
    return int(result.rsplit(maxsplit=1)[-1])


async def count(db: asyncpg.Connection, table: str, where: str = "true", *args: Any) -> int:
    value = await db.fetchval(f"SELECT count(*) FROM {table} WHERE {where}", *args)
    return int(value)


async def attempt(limiter: Limiter, **request: Any) -> Reservation | LimiterError:
    """Admit, returning the refusal instead of raising it."""
    try:
        return await limiter.admit(**request)
    except LimiterError as exc:
        return exc


class Clock:
    """Wall time since creation, to bound refill drift in assertions."""

    def __init__(self) -> None:
        self.started = time.monotonic()

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def refill(self, per_minute: float) -> float:
        """The most a bucket can have refilled since the clock started (plus slack)."""
        return (self.elapsed() + 0.05) * per_minute / 60.0
