"""Cells: how early a slice of in-flight permits refuses, with the rebalancer and without.

    .venv/bin/python -m bench.cells_permits                  # the embedded PostgreSQL
    .ci/with-citus .venv/bin/python -m bench.cells_permits   # a coordinator + 2 workers

The global `max_in_flight` of a database of cells is a slice per cell; a
call whose cell's slice is full is refused even when another slice has free
permits, until the rebalancer (admission/rebalancer.py) lends them. This
bench sends the same paced stream of calls (RATE a second for RUN_SECONDS,
default 40/s for 20 s), each holding its permit for HOLD_SECONDS (0.5 s:
demand for 20 calls at once against a cap of PERMITS, 16) to three
deployments side by side: one cell (the exact twin: one global layer), two
cells without rebalancing, two cells rebalanced every second (the router's
default). Two demands: every call from tenants of cell 1 ("one cell busy"),
and the demand moving from cell to cell every 5 s ("moving demand"). A call
the twin admitted beyond what the cells admitted is a false refusal:
refused while the whole layer, slices included, had a free permit. Prints
each deployment's admissions and the summary line
`permit false refusals: X of N (Y%)` for the rebalanced cells, over both
demands.
"""

from __future__ import annotations

import asyncio
import os
import sys

from tests.support import APP_ROLE, dsn_as

from bench.cells_rebalancing import RATE, RUN_SECONDS, TENANTS, compare, paced
from bench.common import fresh_cluster_database, run_against_database
from llmquota.admission.cells import CellLimiters
from llmquota.config import Settings
from llmquota.domain.errors import RateLimited
from llmquota.domain.policy import Policy
from llmquota.store.cells import build_cells

HOLD_SECONDS = float(os.environ.get("HOLD_SECONDS", "0.5"))
PERMITS = 16  # the global max_in_flight, 8 a cell
ROOMY = Policy(tokens_per_minute=10**9, token_burst=10**9)


async def _admitted(
    server_dsn: str, cells: int, rebalance: float | None, tenants: list[str]
) -> int:
    dsn = await fresh_cluster_database(server_dsn, "lq_permits_bench")
    await asyncio.to_thread(build_cells, dsn, cells)
    settings = Settings(ceiling_alerts=False, _env_file=None)  # type: ignore[call-arg]
    async with await CellLimiters.connect(dsn_as(dsn, APP_ROLE), settings, rebalance) as router:
        for tenant in TENANTS:
            await router.for_tenant(tenant).store.put_policy("tenant", tenant, None, ROOMY)
        await router.put_global_policy(
            Policy(tokens_per_minute=10**9, token_burst=10**9, max_in_flight=PERMITS)
        )

        async def one(tenant: str) -> bool:
            try:
                held = await router.for_tenant(tenant).admit(
                    tenant=tenant, model="gpt-4o", input_tokens=100, max_tokens=100
                )
            except RateLimited:
                return False
            await asyncio.sleep(HOLD_SECONDS)  # the call, holding its permit
            await held.release()
            return True

        return await paced(one, tenants)


async def run_all(server_dsn: str) -> None:
    print(
        f"{RATE:.0f} calls/s for {RUN_SECONDS:.0f} s, each holding a permit"
        f" {HOLD_SECONDS:.2f} s; global max_in_flight {PERMITS}"
    )
    await compare(server_dsn, _admitted, "permit")


def main() -> None:
    run_against_database(run_all)


if __name__ == "__main__":
    sys.exit(main())
