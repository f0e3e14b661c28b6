"""What turning synchronous_commit off for admission costs: admissions a crash loses.

A throwaway PostgreSQL 15 cluster takes admissions from 64 callers. While
they run, `pg_ctl stop -m immediate` kills every server process without
writing anything further (for the WAL, a crash); the cluster then restarts
and recovers. An admission the caller was told about that is missing after
recovery is lost. With synchronous_commit on, none may be; off, the ones
whose commit record was still in PostgreSQL's WAL buffers are. Settlement and
the ledger always commit synchronously, so only admissions are at stake.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from dataclasses import dataclass

import asyncpg

from bench.common import BENCH_DECISION_DEADLINE_MS, fresh_database, seed_tenants
from bench.servers import Pg15Cluster
from llmquota import Limiter, LimiterError, Settings

CALLERS = 64
TENANTS = 1_000
CLOSE_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class CrashResult:
    synchronous_commit: bool
    acknowledged: int
    lost: int
    load_s: float

    @property
    def per_second(self) -> float:
        return self.acknowledged / self.load_s if self.load_s else 0.0


async def measure(synchronous_commit: bool, load_s: float) -> CrashResult:
    cluster = Pg15Cluster()
    # The pool narrates its reconnection attempts while the server is down.
    pool_logger = logging.getLogger("asyncpg.pool")
    pool_logger.disabled = True
    try:
        cluster.start()
        dsn = await fresh_database(cluster.postgres.dsn, "bench_crash")
        tenants = await seed_tenants(dsn, TENANTS)
        settings = Settings(
            admission_synchronous_commit=synchronous_commit,
            pool_max_size=10,
            statement_timeout_ms=5_000,
            decision_deadline_ms=BENCH_DECISION_DEADLINE_MS,
            _env_file=None,  # type: ignore[call-arg]
        )
        limiter = await Limiter.connect(dsn, settings)
        acknowledged: list[uuid.UUID] = []
        crashed = asyncio.Event()

        async def caller(index: int) -> None:
            n = index
            while not crashed.is_set():
                n += CALLERS
                try:
                    held = await limiter.admit(
                        tenant=tenants[n % TENANTS], model="m", input_tokens=1, max_tokens=1
                    )
                except (LimiterError, OSError, asyncpg.PostgresError):
                    return  # the server is gone
                if not crashed.is_set():
                    acknowledged.append(held.reservation_id)

        tasks = [asyncio.create_task(caller(i)) for i in range(CALLERS)]
        await asyncio.sleep(load_s)
        # Answers that arrive while the server is being killed may be lost or
        # kept: only those acknowledged before the kill began are counted.
        crashed.set()
        await asyncio.to_thread(cluster.stop, "immediate")
        await asyncio.gather(*tasks, return_exceptions=True)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(limiter.close(), CLOSE_TIMEOUT_S)
        await asyncio.to_thread(cluster.start)
        connection = await asyncpg.connect(dsn)
        try:
            kept = await connection.fetchval(
                "SELECT count(*) FROM reservations WHERE reservation_id = ANY ($1::uuid[])",
                acknowledged,
            )
        finally:
            await connection.close()
        return CrashResult(synchronous_commit, len(acknowledged), len(acknowledged) - kept, load_s)
    finally:
        pool_logger.disabled = False
        cluster.stop()
        cluster.remove()
