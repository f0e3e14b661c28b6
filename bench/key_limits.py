"""Comparison 11: what a key's own limits cost an admission (issue 22).

A key with limits is one more row the admission statement locks, refills,
decides and debits. Side by side on one database, the same closed loop of
library admissions (admit, then release) over 1,000 tenants, each with one
key that has token, request and concurrency limits far above the load:
without `key_id` (the tenant's layers only, the baseline) and with it (the
key's layer too), alternating rounds so that drift on a noisy machine hits
both alike. The summary line is the ratio of decisions per second.

    python -m bench.key_limits            # embedded PostgreSQL, ~1 minute
"""

from __future__ import annotations

import asyncio
import random
import statistics
import tempfile

import asyncpg

from bench import common
from llmquota import Limiter, Settings
from llmquota.store.database import open_database

TENANTS = 1_000
CALLERS = 32
ROUNDS = 3
SECONDS = 5.0
WARMUP_SECONDS = 1.0
GENEROUS = 10**9


async def seed_keys(dsn: str) -> dict[str, int]:
    """One key per tenant, each with a layer of limits far above the load."""
    connection = await asyncpg.connect(dsn)
    try:
        rows = await connection.fetch(
            """WITH k AS (
                   INSERT INTO api_keys (key_hash, tenant)
                   SELECT sha256(tenant::bytea), tenant FROM tenants
                   RETURNING key_id, tenant)
               INSERT INTO limit_layers (scope, tenant, api_key_id, tokens_per_minute,
                                         token_burst, tokens, requests_per_minute,
                                         request_burst, requests, max_in_flight)
               SELECT 'key', k.tenant, k.key_id, $1::bigint, $1::bigint, $1::bigint, $1::bigint,
                      $1::bigint, $1::bigint, 1000000
                 FROM k
               RETURNING tenant, api_key_id""",
            GENEROUS,
        )
        await connection.execute("ANALYZE")
    finally:
        await connection.close()
    return {row["tenant"]: int(row["api_key_id"]) for row in rows}


async def rate(limiter: Limiter, keys: dict[str, int] | None, tenants: list[str]) -> float:
    """Decisions per second of the closed loop, with the tenants' keys or without."""
    rng = random.Random(7)

    async def call(_: int) -> bool:
        tenant = rng.choice(tenants)
        key_id = None if keys is None else keys[tenant]
        held = await limiter.admit(
            tenant=tenant, model="gpt-4o", input_tokens=300, max_tokens=2_000, key_id=key_id
        )
        await held.release()
        return True

    result = await common.closed_loop(call, CALLERS, SECONDS, WARMUP_SECONDS)
    return result.calls / result.seconds


async def measure(server_dsn: str) -> tuple[list[float], list[float]]:
    dsn = await common.fresh_database(server_dsn, "bench_key_limits")
    tenants = await common.seed_tenants(dsn, TENANTS)
    keys = await seed_keys(dsn)
    settings = Settings(
        pool_min_size=2, pool_max_size=10, decision_deadline_ms=30_000, _env_file=None
    )  # type: ignore[call-arg]
    limiter = await Limiter.connect(dsn, settings)
    without: list[float] = []
    with_keys: list[float] = []
    try:
        for _ in range(ROUNDS):
            without.append(await rate(limiter, None, tenants))
            with_keys.append(await rate(limiter, keys, tenants))
    finally:
        await limiter.close()
    return without, with_keys


def main() -> None:
    with (
        tempfile.TemporaryDirectory(prefix="llmquota-bench-keys-") as root,
        open_database(None, f"{root}/data") as database,
    ):
        without, with_keys = asyncio.run(measure(database.dsn))
    base, keyed = statistics.median(without), statistics.median(with_keys)
    print(f"without key_id: {[round(r) for r in without]} decisions/s")
    print(f"with key_id:    {[round(r) for r in with_keys]} decisions/s")
    print(
        f"key limits: {keyed / base:.2f}x the decisions per second of the tenant's layers alone "
        f"({keyed:.0f} vs {base:.0f}/s, median of {ROUNDS}, {CALLERS} callers, "
        f"{common.machine_load()})"
    )


if __name__ == "__main__":
    main()
