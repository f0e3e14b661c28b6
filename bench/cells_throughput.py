"""Cells: library decisions per second with the tenants in 1 cell and in 2.

    .ci/with-citus .venv/bin/python -m bench.cells_throughput   # a coordinator + 2 workers
    .venv/bin/python -m bench.cells_throughput                  # the embedded PostgreSQL

For each cell count K (CELL_COUNTS, default "1 2"): a fresh database (on
Citus, joined to the cluster, so K cells sit on K workers), `llmquota migrate
--cells K`, then the library's router (admission/cells.py, CellLimiters) in
this one process: CALLERS closed-loop callers (default 64) admit for RUN_SECONDS
(default 10, after 2 of warm-up), each call a random tenant of TENANTS
(default 1,000), every tenant and the global layer with room to spare, so
each call is a decision that admits. Prints decisions per second, p50 and
p99 for each K. Issue 26 asks for this figure honestly: on a 2-core machine
the coordinator, both workers and this process share the same two cores, so
a second worker cannot add throughput here; the point of the cells is that
each statement runs whole on one node (tests/citus/test_cells.py), and what
a cluster of real machines gains is docs/scaling.md's to say.
"""

from __future__ import annotations

import asyncio
import os
import random
import sys

from tests.citus.nodes import citus_nodes_of
from tests.support import APP_ROLE, dsn_as

from bench.common import admits, closed_loop, fresh_cluster_database, run_against_database
from llmquota.admission.cells import CellLimiters
from llmquota.config import Settings
from llmquota.domain.policy import Policy
from llmquota.store.cells import build_cells

CALLERS = int(os.environ.get("CALLERS", "64"))
RUN_SECONDS = float(os.environ.get("RUN_SECONDS", "10"))
TENANTS = int(os.environ.get("TENANTS", "1000"))
CELL_COUNTS = [int(k) for k in os.environ.get("CELL_COUNTS", "1 2").split()]
ROOM = 10**10  # the largest a policy takes: room to spare for the run


async def measure(server_dsn: str, cells: int) -> str:
    dsn = await fresh_cluster_database(server_dsn, "lq_cells_bench")
    await asyncio.to_thread(build_cells, dsn, cells)
    settings = Settings(ceiling_alerts=False, _env_file=None)  # type: ignore[call-arg]
    tenants = [f"tenant-{i:05d}" for i in range(TENANTS)]
    async with await CellLimiters.connect(dsn_as(dsn, APP_ROLE), settings) as router:
        await router.put_global_policy(Policy(tokens_per_minute=ROOM, token_burst=ROOM))
        for tenant in tenants:
            await router.for_tenant(tenant).store.put_policy(
                "tenant", tenant, None, Policy(tokens_per_minute=ROOM, token_burst=ROOM)
            )

        async def call(_caller: int) -> bool:
            tenant = random.choice(tenants)
            return await admits(router.for_tenant(tenant), tenant, 300, 2_000)

        result = await closed_loop(call, CALLERS, RUN_SECONDS, warmup_s=2.0)
    return (
        f"cells {cells}: {result.per_second:,.0f} decisions/s, p50 {result.p50_ms:.1f} ms,"
        f" p99 {result.p99_ms:.1f} ms, refused {result.failures}"
    )


async def run_all(server_dsn: str) -> None:
    nodes = await citus_nodes_of(server_dsn)
    kind = f"Citus coordinator + {len(nodes.workers)} workers" if nodes else "plain PostgreSQL"
    print(f"{kind}; {CALLERS} callers, {TENANTS:,} tenants, {RUN_SECONDS:.0f} s each")
    for cells in CELL_COUNTS:
        print(await measure(server_dsn, cells), flush=True)


def main() -> None:
    run_against_database(run_all)


if __name__ == "__main__":
    sys.exit(main())
