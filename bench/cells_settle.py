"""An admin key's settle over cells: the cell its id names first, or each in turn.

    .venv/bin/python -m bench.cells_settle                  # the embedded PostgreSQL
    .ci/with-citus .venv/bin/python -m bench.cells_settle   # a coordinator + 2 workers

The front over 2 cells (api/cells_front.py), served by uvicorn in this
process. A settle with the admin key names only its reservation. The front
asks first the cell the id names (domain/cell_hints.py); before, it asked
the cells in order, which is what `cells_to_ask` is replaced with for the
"in order" runs. A tenant of cell 2 admits and settles SETTLES times, one
after the other, exact and allotted (a slice's id, version 7: a cell that
does not hold it looks again after the journal interval), the two orders
alternated ROUNDS times. Prints the median settle latency of each and the
summary line `cells admin settle p50: hinted X ms, in order Y ms (allotted:
hinted X ms, in order Y ms)`.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import statistics
import time
from collections.abc import AsyncIterator, Iterator

import httpx
import uvicorn

from bench.common import fresh_cluster_database, machine_load, run_against_database
from llmquota.api import cells_front
from llmquota.api.cells_front import CellsFront
from llmquota.config import Settings
from llmquota.domain.cells import cell_of
from llmquota.store.cells import build_cells

SETTLES = int(os.environ.get("SETTLES", "200"))
ROUNDS = int(os.environ.get("ROUNDS", "2"))
ADMIN_KEY = "lq_bench_cells_settle_admin_key_0123456789"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
MODES = ("exact", "allotted")


@contextlib.contextmanager
def _asking_in_order(in_order: bool) -> Iterator[None]:
    """The front as it was before ids named their cell: every cell in turn."""
    hinted = cells_front.cells_to_ask
    if in_order:
        cells_front.cells_to_ask = lambda _path, cells: list(range(cells))
    try:
        yield
    finally:
        cells_front.cells_to_ask = hinted


@contextlib.asynccontextmanager
async def _served(dsn: str) -> AsyncIterator[httpx.AsyncClient]:
    settings = Settings(admin_key=ADMIN_KEY, _env_file=None)
    config = uvicorn.Config(CellsFront(settings, dsn), port=0, log_level="warning")
    server = uvicorn.Server(config)
    task = asyncio.ensure_future(server.serve())
    while not server.started:
        assert not task.done(), "uvicorn did not start"
        await asyncio.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=60) as client:
            yield client
    finally:
        server.should_exit = True
        await task


async def _settle_latencies(client: httpx.AsyncClient, tenant: str) -> list[float]:
    """SETTLES admit-then-settle pairs; each settle's latency in ms."""
    latencies = []
    request = {"tenant": tenant, "model": "gpt-4o", "input_tokens": 10, "max_tokens": 10}
    for _ in range(SETTLES):
        admitted = await client.post("/v1/admit", json=request, headers=ADMIN)
        assert admitted.status_code == 201, admitted.text
        path = f"/v1/reservations/{admitted.json()['reservation_id']}/settle"
        started = time.perf_counter()
        settled = await client.post(
            path, json={"input_tokens": 10, "output_tokens": 5}, headers=ADMIN
        )
        latencies.append((time.perf_counter() - started) * 1000)
        assert settled.status_code == 200, settled.text
    return latencies


async def _measure(server_dsn: str) -> None:
    dsn = await fresh_cluster_database(server_dsn, "lq_cells_settle")
    await asyncio.to_thread(build_cells, dsn, 2)
    tenants = {
        m: next(t for t in (f"{m}-{i}" for i in range(99)) if cell_of(t, 2) == 2) for m in MODES
    }
    print(f"{machine_load()}; {ROUNDS} rounds of {SETTLES} settles per order and mode")
    p50: dict[tuple[str, bool], list[float]] = {}
    for _ in range(ROUNDS):
        for in_order in (True, False):
            with _asking_in_order(in_order):
                async with _served(dsn) as client:
                    for mode in MODES:
                        policy = {
                            "tokens_per_minute": 10**9,
                            "token_burst": 10**9,
                            "admission": mode,
                        }
                        put = await client.put(
                            f"/v1/tenants/{tenants[mode]}/policy", json=policy, headers=ADMIN
                        )
                        assert put.status_code == 200, put.text
                        median = statistics.median(await _settle_latencies(client, tenants[mode]))
                        p50.setdefault((mode, in_order), []).append(median)
                        order = "in order" if in_order else "hinted"
                        print(f"{mode:>8}, {order:>8}: settle p50 {median:6.2f} ms", flush=True)
    figure = {key: statistics.median(values) for key, values in p50.items()}
    print(
        f"cells admin settle p50: hinted {figure['exact', False]:.2f} ms, in order "
        f"{figure['exact', True]:.2f} ms (allotted: hinted {figure['allotted', False]:.2f} ms, "
        f"in order {figure['allotted', True]:.2f} ms)"
    )


if __name__ == "__main__":
    run_against_database(_measure)
