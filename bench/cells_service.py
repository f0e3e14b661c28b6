"""The service over cells against one database's service: what the front costs.

    .venv/bin/python -m bench.cells_service                  # the embedded PostgreSQL
    .ci/with-citus .venv/bin/python -m bench.cells_service   # a coordinator + 2 workers

Two `llmquota serve` (2 uvicorn workers each), run one after the other on
the same server: at a database without cells (the baseline: one service, one
schema), and at the `public` DSN of a database of CELLS cells (default 2; 1 puts every
tenant behind the front in one cell: the front's own cost), where the front
(api/cells_front.py) reads each admit's body for its tenant and hands it to
that cell's service. wrk drives both with the same admissions over 64
tenants with the admin key, 32 connections, SECONDS each (default 10),
alternated ROUNDS times (default 2) so that the machine's drift falls on
both. Prints each run and the summary line
`cells front: X admits/s vs Y one database (ratio R)`.
"""

from __future__ import annotations

import asyncio
import os
import statistics

from bench.common import fresh_cluster_database, machine_load, run_against_database, seed_tenants
from bench.http_admission import HttpResult, measure, start_llmquota
from llmquota.store import migrate
from llmquota.store.cells import build_cells, cell_name, in_cell

SECONDS = float(os.environ.get("SECONDS", "10"))
ROUNDS = int(os.environ.get("ROUNDS", "2"))
TENANTS = 64
CONNECTIONS = 32
CELLS = int(os.environ.get("CELLS", "2"))


async def _databases(server_dsn: str) -> tuple[str, str]:
    """(a database without cells, a database of CELLS cells), both with the
    bench's tenants (in every cell: a tenant is only ever sent to its own)."""
    plain = await fresh_cluster_database(server_dsn, "lq_front_plain")
    await asyncio.to_thread(migrate.upgrade, plain)
    await seed_tenants(plain, TENANTS)
    cells = await fresh_cluster_database(server_dsn, "lq_front_cells")
    await asyncio.to_thread(build_cells, cells, CELLS)
    for k in range(1, CELLS + 1):
        await seed_tenants(in_cell(cells, cell_name(k)), TENANTS)
    return plain, cells


def _run(system: str, dsn: str) -> HttpResult:
    (result,) = measure(
        start_llmquota(dsn),
        system=system,
        workloads={f"{TENANTS} tenants": TENANTS},
        connections=CONNECTIONS,
        seconds=SECONDS,
    )
    print(
        f"{system:>13}: {result.per_second:8.0f} admits/s  p50 {result.p50_ms:6.2f} ms"
        f"  p99 {result.p99_ms:6.2f} ms  non-2xx {result.non_2xx}",
        flush=True,
    )
    return result


async def _measure(server_dsn: str) -> None:
    plain, cells = await _databases(server_dsn)
    print(f"{machine_load()}; {ROUNDS} rounds of {SECONDS:.0f} s, {CONNECTIONS} connections")
    runs: dict[str, list[HttpResult]] = {"one database": [], "cells front": []}
    for _ in range(ROUNDS):
        runs["one database"].append(await asyncio.to_thread(_run, "one database", plain))
        runs["cells front"].append(await asyncio.to_thread(_run, "cells front", cells))
    one = statistics.median(r.per_second for r in runs["one database"])
    front = statistics.median(r.per_second for r in runs["cells front"])
    p50 = [statistics.median(r.p50_ms for r in runs[s]) for s in ("cells front", "one database")]
    print(
        f"cells front: {front:.0f} admits/s vs {one:.0f} one database (ratio {front / one:.2f});"
        f" p50 {p50[0]:.2f} vs {p50[1]:.2f} ms"
    )


if __name__ == "__main__":
    run_against_database(_measure)
