"""Cells: how early a dry slice refuses, with the rebalancer and without.

    .venv/bin/python -m bench.cells_rebalancing                  # the embedded PostgreSQL
    .ci/with-citus .venv/bin/python -m bench.cells_rebalancing   # a coordinator + 2 workers

The global layer of a database of cells is a slice per cell; a request whose
cell's slice is dry is refused even when another slice has room, until the
rebalancer (admission/rebalancer.py) moves it. This bench sends the same
paced stream of requests (RATE a second for RUN_SECONDS, default 40/s for
20 s: four times the global refill) to three deployments side by side: one
cell (the exact twin: one global layer), two cells without rebalancing, two
cells rebalanced every second (the router's default). Two demands: every
request from tenants of cell 1 ("one cell busy"), and the demand moving
from cell to cell every 5 s ("moving demand"). A request the twin admitted
beyond what the cells admitted is a false refusal: refused while the whole
layer, slices included, had room. Prints each deployment's admissions and
the summary line `slice false refusals: X of N (Y%)` for the rebalanced
cells, over both demands.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from collections.abc import Awaitable, Callable

from tests.support import APP_ROLE, dsn_as

from bench.common import admits, fresh_cluster_database, run_against_database
from llmquota.admission.cells import CellLimiters
from llmquota.config import Settings
from llmquota.domain.cells import cell_of
from llmquota.domain.policy import Policy
from llmquota.store.cells import build_cells

RATE = float(os.environ.get("RATE", "40"))
RUN_SECONDS = float(os.environ.get("RUN_SECONDS", "20"))
COST = 1_000  # tokens a request reserves: 100 in, 900 out at most
BURST = 100  # requests the global burst holds
PER_SECOND = 10  # requests the global layer refills a second
TENANTS = [f"tenant-{i:02d}" for i in range(40)]


def stream(moving: bool) -> list[str]:
    """The tenant of each request: cell 1's tenants, or each cell's in turn for 5 s."""
    by_cell = {k: [t for t in TENANTS if cell_of(t, 2) == k] for k in (1, 2)}
    count = int(RATE * RUN_SECONDS)
    tenants = []
    for i in range(count):
        cell = 1 + (int(i / RATE / 5) % 2 if moving else 0)
        tenants.append(by_cell[cell][i % len(by_cell[cell])])
    return tenants


async def _admitted(
    server_dsn: str, cells: int, rebalance: float | None, tenants: list[str]
) -> int:
    dsn = await fresh_cluster_database(server_dsn, "lq_rebalance_bench")
    await asyncio.to_thread(build_cells, dsn, cells)
    settings = Settings(ceiling_alerts=False, _env_file=None)  # type: ignore[call-arg]
    async with await CellLimiters.connect(dsn_as(dsn, APP_ROLE), settings, rebalance) as router:
        for tenant in TENANTS:
            await router.for_tenant(tenant).store.put_policy(
                "tenant", tenant, None, Policy(tokens_per_minute=10**9, token_burst=10**9)
            )
        await router.put_global_policy(
            Policy(tokens_per_minute=PER_SECOND * 60 * COST, token_burst=BURST * COST)
        )

        async def one(tenant: str) -> bool:
            return await admits(router.for_tenant(tenant), tenant, 100, 900)

        return await paced(one, tenants)


async def paced(one: Callable[[str], Awaitable[bool]], tenants: list[str]) -> int:
    """Send `one` for each tenant at RATE a second; how many it admitted."""
    started = time.monotonic()
    calls = []
    for i, tenant in enumerate(tenants):
        await asyncio.sleep(max(0.0, started + i / RATE - time.monotonic()))
        calls.append(asyncio.create_task(one(tenant)))
    return sum(await asyncio.gather(*calls))


async def run_all(server_dsn: str) -> None:
    print(
        f"{RATE:.0f} requests/s for {RUN_SECONDS:.0f} s; global burst {BURST} requests,"
        f" refill {PER_SECOND}/s"
    )
    await compare(server_dsn, _admitted, "slice")


Admitted = Callable[[str, int, float | None, list[str]], Awaitable[int]]


async def compare(server_dsn: str, admitted: Admitted, what: str) -> None:
    """Both demands to the twin, two cells alone and two rebalanced; the
    summary line `{what} false refusals: X of N (Y%)`."""
    false_refusals = sent = 0
    for name, moving in (("one cell busy", False), ("moving demand", True)):
        tenants = stream(moving)
        twin = await admitted(server_dsn, 1, None, tenants)
        alone = await admitted(server_dsn, 2, None, tenants)
        rebalanced = await admitted(server_dsn, 2, 1.0, tenants)
        print(
            f"{name}: one layer admitted {twin}; 2 cells, no rebalancer {alone};"
            f" 2 cells, rebalanced every 1 s {rebalanced} (of {len(tenants)} sent)",
            flush=True,
        )
        false_refusals += max(0, twin - rebalanced)
        sent += len(tenants)
    print(f"{what} false refusals: {false_refusals} of {sent} ({100 * false_refusals / sent:.1f}%)")


def main() -> None:
    run_against_database(run_all)


if __name__ == "__main__":
    sys.exit(main())
