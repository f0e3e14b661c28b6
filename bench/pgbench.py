"""Comparison 3: the SQL ceiling, pgbench running the project's own admit statement.

pgbench (C, no Python in the way) calls lq_admit exactly as the store does:
one request per statement, then 64 requests per statement (what group
admission sends). Its decisions per second bound what any client of this
database can get, so the report can say how close the service comes.
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import asyncpg

from bench.servers import Postgres

PGBENCH = shutil.which("pgbench") or "/usr/bin/pgbench"
BATCH = 64

# One request per statement: the tenant is :t.
SINGLE = """\\set t random(0, {last})
SELECT * FROM lq_admit(ARRAY['t' || {tenant}], ARRAY[NULL]::text[], ARRAY['gpt-4o'],
    ARRAY[300]::bigint[], ARRAY[2000]::bigint[], ARRAY[false], ARRAY[NULL]::integer[],
    ARRAY[NULL]::text[], ARRAY[NULL]::text[], 1000);
"""

# BATCH requests per statement, each for a random tenant (or all the hot one).
BATCHED = """SELECT * FROM lq_admit(
    ARRAY(SELECT 't' || {tenant} FROM generate_series(1, {batch})),
    array_fill(NULL::text, ARRAY[{batch}]), array_fill('gpt-4o'::text, ARRAY[{batch}]),
    array_fill(300::bigint, ARRAY[{batch}]), array_fill(2000::bigint, ARRAY[{batch}]),
    array_fill(false, ARRAY[{batch}]), array_fill(NULL::integer, ARRAY[{batch}]),
    array_fill(NULL::text, ARRAY[{batch}]), array_fill(NULL::text, ARRAY[{batch}]), 1000);
"""

# "The limit of this design": BATCH requests per statement as one plain
# batched bucket update over the same rows lq_admit locks (each request's
# tenant layer and the global layer): locked in layer_id order as lq_admit
# locks them (so concurrent statements cannot deadlock), refilled with the
# same lq_refilled and debited 2,300 tokens per request, in one UPDATE ...
# FROM unnest(...). No per-request decision, no reservation row, no answer
# per request: what is left is the locks, the row versions and the WAL.
PLAIN_UPDATE = """WITH demand AS (
    SELECT u.tenant, count(*)::bigint AS n
      FROM unnest(ARRAY(SELECT 't' || {tenant} FROM generate_series(1, {batch}))) AS u(tenant)
     GROUP BY u.tenant),
targets AS (
    SELECT l.layer_id, d.n FROM demand AS d
      JOIN limit_layers AS l ON l.scope = 'tenant' AND l.tenant = d.tenant AND l.route IS NULL
    UNION ALL
    SELECT l.layer_id, {batch} FROM limit_layers AS l
     WHERE l.scope = 'global' AND l.tenant IS NULL AND l.route IS NULL),
locked AS (
    SELECT l.layer_id, t.n FROM limit_layers AS l JOIN targets AS t USING (layer_id)
     ORDER BY l.layer_id FOR UPDATE OF l)
UPDATE limit_layers AS l
   SET tokens = lq_refilled(l.tokens, l.tokens_per_minute, l.token_burst, l.refilled_at,
                            clock_timestamp()) - locked.n * 2300,
       refilled_at = clock_timestamp()
  FROM locked
 WHERE l.layer_id = locked.layer_id;
"""

# BATCH requests admitted and then settled in one statement (each with 250
# input and 900 output tokens, the outcome given): its CPU less BATCHED's is
# what lq_finish costs for a batch. An 'ok' settlement also feeds the learned
# output estimates (estimates.sql); an 'error' one does not.
ADMITTED_AND_SETTLED = """SELECT count(*) FROM lq_finish(
    ARRAY(SELECT a.reservation_id FROM ({admit}) AS a WHERE a.reservation_id IS NOT NULL),
    array_fill('settle'::text, ARRAY[{batch}]), array_fill(NULL::text, ARRAY[{batch}]),
    array_fill(250::bigint, ARRAY[{batch}]), array_fill(900::bigint, ARRAY[{batch}]),
    array_fill('{outcome}'::text, ARRAY[{batch}]));
"""


def settle_script(tenants: int, batch: int, *, outcome: str) -> str:
    """BATCHED for random tenants, settled in the same statement with `outcome`."""
    admit = statement(tenants, batch).strip().removeprefix("SELECT * FROM ").rstrip(";")
    return ADMITTED_AND_SETTLED.format(admit=f"SELECT * FROM {admit}", batch=batch, outcome=outcome)


@dataclass(frozen=True)
class PgbenchResult:
    workload: str
    requests_per_statement: int
    clients: int
    statements_per_second: float
    latency_ms: float

    @property
    def decisions_per_second(self) -> float:
        return self.statements_per_second * self.requests_per_statement


def pgbench_available() -> bool:
    return Path(PGBENCH).exists()


def script(tenants: int, batch: int, *, plain_update: bool = False) -> str:
    """pgbench's script: lq_admit of one request as SINGLE (literal arrays; its
    tenant a pgbench variable when there are several), else `statement`."""
    if batch == 1 and not plain_update:
        tenant = ":t" if tenants > 1 else "0"
        return SINGLE.format(last=max(0, tenants - 1), tenant=tenant)
    return statement(tenants, batch, plain_update=plain_update)


def statement(tenants: int, batch: int, *, plain_update: bool = False) -> str:
    """`batch` requests (random tenants of `tenants`) as one plain SQL statement,
    of any size: what statement_cpu_ms runs (for one request too, in the batched
    form, arrays built by sub-selects, not SINGLE's literals)."""
    tenant = f"floor(random() * {tenants})::int" if tenants > 1 else "0"
    return (PLAIN_UPDATE if plain_update else BATCHED).format(tenant=tenant, batch=batch)


def run(
    pg: Postgres,
    database: str,
    *,
    workload: str,
    tenants: int,
    batch: int,
    clients: int,
    seconds: float,
    plain_update: bool = False,
) -> PgbenchResult:
    with tempfile.NamedTemporaryFile("w", suffix=".sql", delete=False) as f:
        f.write(script(tenants, batch, plain_update=plain_update))
    try:
        command = [
            PGBENCH,
            *("-n", "-M", "prepared", "-f", f.name, "-c", str(clients)),
            *("-j", "2", "-T", str(max(1, round(seconds))), "-U", "postgres"),
        ]
        if pg.host:
            command += ["-h", pg.host, "-p", str(pg.port)]
        command.append(database)
        out = subprocess.run(
            command, capture_output=True, text=True, check=True, timeout=seconds + 120
        ).stdout
    finally:
        Path(f.name).unlink()
    tps = float(re.search(r"tps = ([\d.]+)", out).group(1))  # type: ignore[union-attr]
    latency = float(re.search(r"latency average = ([\d.]+) ms", out).group(1))  # type: ignore[union-attr]
    name = f"{workload}, plain update" if plain_update else workload
    return PgbenchResult(name, batch, clients, tps, latency)


def statement_cpu_ms(dsn: str, sql: str, *, statements: int, rounds: int) -> float:
    """The fewest backend CPU milliseconds per statement over `rounds` runs of `statements`.

    Read from /proc for the server process of one connection (PostgreSQL on
    this machine), so other work on the machine inflates it far less than
    wall time; `synchronous_commit` off, so it counts the statement's own
    work and not the WAL flush. Used for lq_admit against the plain update.
    """
    return asyncio.run(_statement_cpu_ms(dsn, sql, statements=statements, rounds=rounds))


async def _statement_cpu_ms(dsn: str, sql: str, *, statements: int, rounds: int) -> float:
    connection = await asyncpg.connect(dsn)
    try:
        await connection.execute("SET synchronous_commit = off")
        pid = await connection.fetchval("SELECT pg_backend_pid()")
        for _ in range(10):  # plans cached, pages warm
            await connection.fetch(sql)
        best = float("inf")
        for _ in range(rounds):
            before = _process_cpu_seconds(pid)
            for _ in range(statements):
                await connection.fetch(sql)
            best = min(best, (_process_cpu_seconds(pid) - before) / statements * 1000)
        return best
    finally:
        await connection.close()


def _process_cpu_seconds(pid: int) -> float:
    """The process's CPU time: from schedstat in nanoseconds where the kernel
    keeps it (/proc/PID/stat counts 10 ms ticks: 0.1 ms per statement over
    100 statements, as coarse as the differences measured), else from stat."""
    schedstat = Path(f"/proc/{pid}/schedstat")
    if schedstat.exists() and (nanoseconds := int(schedstat.read_text().split()[0])):
        return nanoseconds / 1e9
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
