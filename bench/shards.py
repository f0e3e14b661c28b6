"""Comparison 10: the sharded global layer, K = 1, 2, 4 rows, under 2, 4 and 8 batch statements.

Every admission statement locks the global layer's row(s) and holds them to
its commit, so statements queue behind it whatever the cores. With the
budget split over K rows (migration 0012, `shards` on the global policy) a
statement locks only the shards of its tenants. pgbench (C, prepared
statements) runs lq_admit with 64 requests per statement over 10,000
tenants, each statement's tenants drawn from one shard (what a batcher that
groups requests by shard would send), and once more with tenants from
anywhere (each batch then touches every shard). The global budget is large,
so no shard runs short: this measures the locking, not the borrowing.
Throughput is decisions per second; p99 is per statement, from pgbench's
per-transaction log.
"""

from __future__ import annotations

import re
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import asyncpg

from bench import common, pgbench
from bench.servers import Postgres

SHARDS = (1, 2, 4)
CLIENTS = (2, 4, 8)
BATCH = pgbench.BATCH
HUGE = 10**12

# 64 requests for tenants of shard :s (tenant i of that shard, uniformly at
# random; the reference to g makes the draw per element).
ALIGNED = """\\set s random(0, {last_shard})
SELECT * FROM lq_admit(
    ARRAY(SELECT b.tenant
            FROM generate_series(1, {batch}) AS g
            CROSS JOIN LATERAL (SELECT floor(random() * {per_shard})::int + 0 * g AS i) AS r
            JOIN bench_shard_tenants AS b ON b.shard = :s AND b.i = r.i),
    array_fill(NULL::text, ARRAY[{batch}]), array_fill('gpt-4o'::text, ARRAY[{batch}]),
    array_fill(300::bigint, ARRAY[{batch}]), array_fill(2000::bigint, ARRAY[{batch}]),
    array_fill(false, ARRAY[{batch}]), array_fill(NULL::integer, ARRAY[{batch}]),
    array_fill(NULL::text, ARRAY[{batch}]), array_fill(NULL::text, ARRAY[{batch}]), 1000);
"""


@dataclass(frozen=True)
class ShardsResult:
    shards: int
    clients: int
    aligned: bool
    decisions_per_second: float
    p99_ms: float


async def prepare(dsn: str, tenants: int) -> None:
    """10,000 tenants with a token policy; the global layer comes per K."""
    await common.seed_tenants(dsn, tenants, global_tokens_per_minute=None)


async def set_shards(dsn: str, shards: int) -> int:
    """Split the global layer over `shards` rows; the fewest tenants any shard has."""
    connection = await asyncpg.connect(dsn)
    try:
        await connection.execute(
            "SELECT lq_put_global($1::bigint, $1::bigint, NULL, NULL, NULL, 120, 'closed', "
            "$2::smallint)",
            HUGE,
            shards,
        )
        await connection.execute(
            """DROP TABLE IF EXISTS bench_shard_tenants;
               CREATE TABLE bench_shard_tenants AS
               SELECT lq_tenant_shard(tenant, $SHARDS$::smallint) AS shard,
                      (row_number() OVER (PARTITION BY lq_tenant_shard(tenant, $SHARDS$::smallint)
                                          ORDER BY tenant) - 1)::int AS i,
                      tenant
                 FROM tenants;
               CREATE UNIQUE INDEX ON bench_shard_tenants (shard, i);
               ANALYZE bench_shard_tenants;""".replace("$SHARDS$", str(shards))
        )
        fewest: int = await connection.fetchval(
            "SELECT min(n) FROM (SELECT count(*) AS n FROM bench_shard_tenants GROUP BY shard) s"
        )
        return fewest
    finally:
        await connection.close()


def script(shards: int, per_shard: int, *, aligned: bool, tenants: int) -> str:
    if not aligned:
        return pgbench.script(tenants, BATCH)
    return ALIGNED.format(last_shard=shards - 1, per_shard=per_shard, batch=BATCH)


def run(
    pg: Postgres,
    database: str,
    *,
    shards: int,
    per_shard: int,
    clients: int,
    aligned: bool,
    tenants: int,
    seconds: float,
) -> ShardsResult:
    """One pgbench run with a per-transaction log; throughput and p99."""
    with tempfile.TemporaryDirectory() as logs:
        script_path = Path(logs) / "admit.sql"
        script_path.write_text(script(shards, per_shard, aligned=aligned, tenants=tenants))
        command = [
            pgbench.PGBENCH,
            *("-n", "-M", "prepared", "-f", str(script_path), "-c", str(clients)),
            *("-j", "2", "-T", str(max(1, round(seconds))), "-U", "postgres"),
            *("-l", "--log-prefix", str(Path(logs) / "tx")),
        ]
        if pg.host:
            command += ["-h", pg.host, "-p", str(pg.port)]
        command.append(database)
        done = subprocess.run(
            command, check=False, capture_output=True, text=True, timeout=seconds + 120, cwd=logs
        )
        if done.returncode != 0:
            raise RuntimeError(f"pgbench failed: {done.stderr.strip()[-2000:]}")
        out = done.stdout
        latencies = sorted(
            int(line.split()[2])
            for log in Path(logs).glob("tx*")
            for line in log.read_text().splitlines()
        )
    tps = float(re.search(r"tps = ([\d.]+)", out).group(1))  # type: ignore[union-attr]
    p99_us = latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))] if latencies else 0
    return ShardsResult(shards, clients, aligned, tps * BATCH, p99_us / 1000)
