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
import time

from tests.support import APP_ROLE, dsn_as

from bench.common import fresh_cluster_database, run_against_database
from llmquota.admission.cells import CellLimiters
from llmquota.config import Settings
from llmquota.domain.cells import cell_of
from llmquota.domain.errors import RateLimited
from llmquota.domain.policy import Policy
from llmquota.store.cells import build_cells

RATE = float(os.environ.get("RATE", "40"))
RUN_SECONDS = float(os.environ.get("RUN_SECONDS", "20"))
HOLD_SECONDS = float(os.environ.get("HOLD_SECONDS", "0.5"))
PERMITS = 16  # the global max_in_flight, 8 a cell
TENANTS = [f"tenant-{i:02d}" for i in range(40)]
ROOMY = Policy(tokens_per_minute=10**9, token_burst=10**9)


def _stream(moving: bool) -> list[str]:
    """The tenant of each call: cell 1's tenants, or each cell's in turn for 5 s."""
    by_cell = {k: [t for t in TENANTS if cell_of(t, 2) == k] for k in (1, 2)}
    count = int(RATE * RUN_SECONDS)
    tenants = []
    for i in range(count):
        cell = 1 + (int(i / RATE / 5) % 2 if moving else 0)
        tenants.append(by_cell[cell][i % len(by_cell[cell])])
    return tenants


async def _admitted(server_dsn: str, cells: int, rebalance: float | None, stream: list[str]) -> int:
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

        started = time.monotonic()
        calls = []
        for i, tenant in enumerate(stream):
            await asyncio.sleep(max(0.0, started + i / RATE - time.monotonic()))
            calls.append(asyncio.create_task(one(tenant)))
        return sum(await asyncio.gather(*calls))


async def run_all(server_dsn: str) -> None:
    print(
        f"{RATE:.0f} calls/s for {RUN_SECONDS:.0f} s, each holding a permit"
        f" {HOLD_SECONDS:.2f} s; global max_in_flight {PERMITS}"
    )
    false_refusals = sent = 0
    for name, moving in (("one cell busy", False), ("moving demand", True)):
        stream = _stream(moving)
        twin = await _admitted(server_dsn, 1, None, stream)
        alone = await _admitted(server_dsn, 2, None, stream)
        rebalanced = await _admitted(server_dsn, 2, 1.0, stream)
        print(
            f"{name}: one layer admitted {twin}; 2 cells, no rebalancer {alone};"
            f" 2 cells, rebalanced every 1 s {rebalanced} (of {len(stream)} sent)",
            flush=True,
        )
        false_refusals += max(0, twin - rebalanced)
        sent += len(stream)
    print(f"permit false refusals: {false_refusals} of {sent} ({100 * false_refusals / sent:.1f}%)")


def main() -> None:
    run_against_database(run_all)


if __name__ == "__main__":
    sys.exit(main())
