"""Comparison 6: cost growth. Does admission slow down as the tables grow, and
how long does the sweeper take for a large backlog of expired leases?

Admission is measured on a small database, then again after adding tenants
(10^5 in the full run), finished reservations and ledger rows (10^6 each);
the ledger and reservation rows are bulk-inserted (what a month of traffic
leaves behind), the tenants are real layers. Then 10^5 admissions with a
one-second lease are left to expire and one sweeper run reclaims them.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass

import asyncpg

from bench.common import BENCH_DECISION_DEADLINE_MS, LoadResult, closed_loop, seed_tenants
from llmquota import Limiter, Settings
from llmquota.domain.records import AdmitRequest

LEASE_S = 1
ADMIT_CHUNK = 1_000
SWEEP_BATCH = 1_000


@dataclass(frozen=True)
class Sizes:
    tenants: int
    ledger_rows: int
    leases: int


FULL = Sizes(tenants=100_000, ledger_rows=1_000_000, leases=100_000)
QUICK = Sizes(tenants=10_000, ledger_rows=100_000, leases=10_000)


@dataclass(frozen=True)
class Snapshot:
    label: str
    tenants: int
    ledger_rows: int
    database_mb: float
    one_caller: LoadResult
    callers_64: LoadResult


@dataclass(frozen=True)
class SweepResult:
    leases: int
    expired: int
    seconds: float
    batches: int


def settings() -> Settings:
    return Settings(
        pool_max_size=10,
        decision_deadline_ms=BENCH_DECISION_DEADLINE_MS,
        sweep_batch_size=SWEEP_BATCH,
        sweep_max_batches=100_000,
        _env_file=None,  # type: ignore[call-arg]
    )


async def database_mb(dsn: str) -> float:
    connection = await asyncpg.connect(dsn)
    try:
        size = await connection.fetchval("SELECT pg_database_size(current_database())")
    finally:
        await connection.close()
    return float(size) / 1_048_576


async def snapshot(
    dsn: str, label: str, tenants: list[str], ledger_rows: int, seconds: float
) -> Snapshot:
    """Admission latency at 1 and 64 callers (random tenants) and the database size."""
    limiter = await Limiter.connect(dsn, settings())
    rng = random.Random(6)

    async def call(_index: int) -> bool:
        await limiter.admit(
            tenant=rng.choice(tenants), model="gpt-4o", input_tokens=300, max_tokens=2_000
        )
        return True

    try:
        one = await closed_loop(call, 1, seconds, warmup_s=0.5)
        many = await closed_loop(call, 64, seconds, warmup_s=0.5)
    finally:
        await limiter.close()
    return Snapshot(label, len(tenants), ledger_rows, await database_mb(dsn), one, many)


async def grow(dsn: str, sizes: Sizes) -> list[str]:
    """Add tenants, then finished reservations with one ledger row each."""
    tenants = await seed_tenants(dsn, sizes.tenants)
    connection = await asyncpg.connect(dsn)
    try:
        await connection.execute(
            """INSERT INTO reservations (reservation_id, tenant, model, layer_ids, input_tokens,
                                         input_estimated, max_tokens, reserved_tokens,
                                         policy_version, state, lease_seconds, created_at,
                                         lease_expires_at, finished_at, settled_input_tokens,
                                         settled_output_tokens, outcome, charged_tokens,
                                         refunded_tokens)
               SELECT gen_random_uuid(), 't' || (g % $2::integer), 'gpt-4o', '{1}', 300, false,
                      2000, 2300, 1, 'settled', 120,
                      now() - make_interval(secs => g % 86400), now(), now(),
                      300, 1500, 'ok', 1800, 500
                 FROM generate_series(1, $1::integer) AS g""",
            sizes.ledger_rows,
            sizes.tenants,
        )
        await connection.execute(
            """INSERT INTO usage_ledger (reservation_id, entry_kind, tenant, model, input_tokens,
                                         output_tokens, reserved_tokens, outcome,
                                         policy_version, recorded_at)
               SELECT reservation_id, 'usage', tenant, model, 300, 1500, 2300, 'ok', 1,
                      created_at
                 FROM reservations WHERE state = 'settled'"""
        )
        await connection.execute("VACUUM ANALYZE")
    finally:
        await connection.close()
    return tenants


async def sweep_backlog(dsn: str, tenants: list[str], leases: int) -> SweepResult:
    """Leave `leases` admissions to expire, then time one sweeper run."""
    limiter = await Limiter.connect(dsn, settings())
    try:
        for start in range(0, leases, ADMIT_CHUNK):
            chunk = [
                AdmitRequest(
                    tenant=tenants[(start + i) % len(tenants)],
                    route=None,
                    model="gpt-4o",
                    input_tokens=10,
                    max_tokens=10,
                    input_estimated=False,
                    lease_seconds=LEASE_S,
                    idempotency_key=None,
                    request_hash=None,
                )
                for i in range(min(ADMIT_CHUNK, leases - start))
            ]
            await limiter.store.admit(chunk)
        await asyncio.sleep(LEASE_S + 0.5)
        started = time.perf_counter()
        report = await limiter.sweep()
        seconds = time.perf_counter() - started
    finally:
        await limiter.close()
    return SweepResult(leases, report.expired, seconds, report.batches)
