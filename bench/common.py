"""What every comparison shares: databases, seeding, closed-loop load, percentiles."""

from __future__ import annotations

import asyncio
import math
import os
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol
from urllib.parse import urlsplit, urlunsplit

import asyncpg
from tests.citus.nodes import citus_nodes_of

from llmquota.admission.limiter import Limiter
from llmquota.domain.errors import RateLimited
from llmquota.store import migrate
from llmquota.store.database import open_database

# Policies large enough that a throughput run never runs dry: the bench
# measures the cost of deciding, and refusals are measured by comparisons 4-5.
UNLIMITED_TOKENS_PER_MINUTE = 10_000_000_000
# The library runs measure throughput, not outage behaviour: a decision that
# queues for longer than the product's 250 ms default must still be counted,
# not turned into a failure-mode 503 (one statement per request queues ~1 s).
BENCH_DECISION_DEADLINE_MS = 60_000


class Report(Protocol):
    """What bench/run.py's Report offers a section kept in a module of its own."""

    sections: list[str]

    def line(self, text: str, *, summary: bool = False) -> None: ...

    def chart(self, name: str) -> tuple[Path, str]: ...


def with_database(dsn: str, database: str) -> str:
    """The same server, another database."""
    parts = urlsplit(dsn)
    return urlunsplit(parts._replace(path="/" + database))


async def fresh_database(server_dsn: str, name: str) -> str:
    """Create and migrate a database; returns its DSN."""
    connection = await asyncpg.connect(server_dsn)
    try:
        await connection.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        await connection.execute(f'CREATE DATABASE "{name}"')
    finally:
        await connection.close()
    dsn = with_database(server_dsn, name)
    await asyncio.to_thread(migrate.upgrade, dsn)
    return dsn


async def seed_tenants(
    dsn: str,
    count: int,
    *,
    prefix: str = "t",
    tokens_per_minute: int = UNLIMITED_TOKENS_PER_MINUTE,
    global_tokens_per_minute: int | None = UNLIMITED_TOKENS_PER_MINUTE,
) -> list[str]:
    """Register `count` tenants with a token policy, and the global layer, in bulk.

    Bench set-up only: one INSERT ... SELECT instead of `count` policy calls,
    writing the same rows `put_policy` would (tenant row, tenant layer, full bucket).
    """
    connection = await asyncpg.connect(dsn)
    try:
        if global_tokens_per_minute is not None:
            await connection.execute(
                """INSERT INTO limit_layers (scope, tokens_per_minute, token_burst, tokens)
                   VALUES ('global', $1::bigint, $1::bigint, $1::bigint)
                   ON CONFLICT (scope, tenant, route, ceiling, shard, api_key_id) DO NOTHING""",
                global_tokens_per_minute,
            )
        await connection.execute(
            """INSERT INTO tenants (tenant)
               SELECT $1::text || g FROM generate_series(0, $2::integer - 1) AS g
               ON CONFLICT DO NOTHING""",
            prefix,
            count,
        )
        await connection.execute(
            """INSERT INTO limit_layers (scope, tenant, tokens_per_minute, token_burst, tokens)
               SELECT 'tenant', $1::text || g, $3::bigint, $3::bigint, $3::bigint
                 FROM generate_series(0, $2::integer - 1) AS g
               ON CONFLICT (scope, tenant, route, ceiling, shard, api_key_id) DO NOTHING""",
            prefix,
            count,
            tokens_per_minute,
        )
        await connection.execute("ANALYZE")
    finally:
        await connection.close()
    return [f"{prefix}{i}" for i in range(count)]


async def reset_state(dsn: str, *, admission: str | None = None) -> None:
    """Forget reservations and slices and refill every bucket, so each point
    starts alike; every tenant's admission is `admission` (None: exact).

    The ledger is append-only and keeps its rows.
    """
    connection = await asyncpg.connect(dsn)
    try:
        await connection.execute("TRUNCATE reservations, allotments")
        await connection.execute(
            "UPDATE limit_layers SET tokens = token_burst, requests = request_burst, in_flight = 0,"
            " admission = CASE WHEN scope = 'tenant' THEN $1::text END,"
            " policy_version = nextval('policy_version_seq')",
            admission,
        )
        await connection.execute("VACUUM ANALYZE limit_layers")
    finally:
        await connection.close()


def percentile(sorted_values: Sequence[float], fraction: float) -> float:
    """Nearest-rank percentile of sorted values."""
    if not sorted_values:
        return math.nan
    index = min(len(sorted_values) - 1, max(0, math.ceil(fraction * len(sorted_values)) - 1))
    return sorted_values[index]


@dataclass(frozen=True)
class LoadResult:
    """Completed calls per second over the measured window, and their latency."""

    calls: int
    seconds: float
    p50_ms: float
    p99_ms: float
    failures: int
    # This process's CPU time (every thread: a client's own I/O threads count)
    # over the measured window.
    cpu_seconds: float = math.nan

    @property
    def per_second(self) -> float:
        return self.calls / self.seconds if self.seconds else 0.0

    @property
    def cpu_us_per_call(self) -> float:
        """Process CPU microseconds per completed call in the window."""
        return self.cpu_seconds / self.calls * 1e6 if self.calls else math.nan


async def closed_loop(
    call: Callable[[int], Awaitable[bool]],
    callers: int,
    seconds: float,
    warmup_s: float,
) -> LoadResult:
    """`callers` tasks calling back to back; only calls inside the window are counted.

    `call(caller_index)` returns False for a refusal (counted as a failure,
    still a decision).
    """
    loop = asyncio.get_running_loop()
    start = loop.time() + warmup_s
    end = start + seconds
    latencies: list[float] = []
    failures = 0

    async def caller(index: int) -> None:
        nonlocal failures
        while True:
            t0 = time.perf_counter()
            began = loop.time()
            ok = await call(index)
            finished = loop.time()
            if finished > end:
                return
            if began >= start:
                latencies.append(time.perf_counter() - t0)
                failures += not ok

    cpu: list[float] = []

    async def cpu_clock() -> None:
        await asyncio.sleep(max(0.0, start - loop.time()))
        cpu.append(time.process_time())
        await asyncio.sleep(max(0.0, end - loop.time()))
        cpu.append(time.process_time())

    await asyncio.gather(cpu_clock(), *(caller(i) for i in range(callers)))
    latencies.sort()
    return LoadResult(
        calls=len(latencies),
        seconds=seconds,
        p50_ms=percentile(latencies, 0.50) * 1_000,
        p99_ms=percentile(latencies, 0.99) * 1_000,
        failures=failures,
        cpu_seconds=cpu[1] - cpu[0],
    )


def machine_load() -> str:
    """The load average when a measurement starts: the machine is shared."""
    one, five, _ = os.getloadavg()
    return f"load average {one:.2f} (1 min), {five:.2f} (5 min) on {os.cpu_count()} cores"


async def fresh_cluster_database(server_dsn: str, prefix: str) -> str:
    """A new database `prefix_<random>` at `server_dsn`'s server; on a Citus
    coordinator made on every node and joined to the cluster (Citus reaches a
    worker's database of the coordinator's database's name)."""
    name = f"{prefix}_{uuid.uuid4().hex[:8]}"
    nodes = await citus_nodes_of(server_dsn)
    for node_dsn in (*(nodes.worker_dsns if nodes else ()), server_dsn):
        connection = await asyncpg.connect(node_dsn)
        try:
            await connection.execute(f'CREATE DATABASE "{name}"')
        finally:
            await connection.close()
    dsn = urlunsplit(urlsplit(server_dsn)._replace(path=f"/{name}"))
    if nodes:
        await nodes.join(dsn)
    return dsn


def run_against_database(measure: Callable[[str], Awaitable[None]]) -> None:
    """`measure(server_dsn)` against LLMQUOTA_DATABASE_URL's server (e.g. a
    Citus coordinator of .ci/with-citus), or a fresh embedded PostgreSQL."""
    url = os.environ.get("LLMQUOTA_DATABASE_URL")
    if url:
        asyncio.run(measure(url))
        return
    with (
        tempfile.TemporaryDirectory(prefix="lq-bench-", ignore_cleanup_errors=True) as root,
        open_database(data_dir=Path(root) / "data") as handle,
    ):
        asyncio.run(measure(handle.dsn))


async def admits(limiter: Limiter, tenant: str, input_tokens: int, max_tokens: int) -> bool:
    """One admission of gpt-4o for `tenant`: True admitted, False rate limited."""
    try:
        await limiter.admit(
            tenant=tenant, model="gpt-4o", input_tokens=input_tokens, max_tokens=max_tokens
        )
    except RateLimited:
        return False
    return True
