"""Where a decision's time goes on a Citus coordinator, against a plain PostgreSQL.

    .ci/with-citus .venv/bin/python -m bench.citus_first_decision   # a coordinator + 2 workers
    .venv/bin/python -m bench.citus_first_decision                  # the embedded PostgreSQL

Makes a fresh database (on every node of a coordinator, its workers added),
migrates it, and times ADMITS admissions each settled at once over HTTP (the
ASGI app in this process, one tenant), printing the first and the median of
each: issue 26's 503s were the first statements of every fresh connection
(docs/scaling.md, "Citus today"). DEADLINE_MS: the decision deadline (default
60 s, so nothing is cancelled; 250 to see what `llmquota serve` answers).
"""

from __future__ import annotations

import asyncio
import os
import statistics
import sys
import time

import httpx
from tests.api.conftest import ADMIN_KEY, make_tenant
from tests.citus.nodes import citus_nodes_of
from tests.support import APP_ROLE, dsn_as

from bench.common import fresh_cluster_database, run_against_database
from llmquota.api.app import create_app
from llmquota.config import Settings
from llmquota.store import migrate

ADMITS = int(os.environ.get("ADMITS", "20"))
DEADLINE_MS = int(os.environ.get("DEADLINE_MS", "60000"))


def _summary(times_ms: list[float]) -> str:
    if not times_ms:
        return "none"
    return f"first {times_ms[0]:.1f} ms, median {statistics.median(times_ms):.1f} ms"


async def measure(server_dsn: str) -> None:
    nodes = await citus_nodes_of(server_dsn)
    dsn = await fresh_cluster_database(server_dsn, "lq_bench")
    await asyncio.to_thread(migrate.upgrade, dsn)
    settings = Settings(  # type: ignore[call-arg]
        admin_key=ADMIN_KEY,
        pool_min_size=1,
        pool_max_size=1,
        decision_deadline_ms=DEADLINE_MS,
        ceiling_alerts=False,
        _env_file=None,
    )
    app = create_app(settings, dsn=dsn_as(dsn, APP_ROLE))
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    admits: list[float] = []
    settles: list[float] = []
    codes: dict[int, int] = {}
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://bench") as client:
            key = await make_tenant(client, admin, "acme", tokens_per_minute=10**9)
            body = {"tenant": "acme", "model": "gpt-4o", "input_tokens": 20, "max_tokens": 100}
            for _ in range(ADMITS):
                started = time.perf_counter()
                admitted = await client.post("/v1/admit", json=body, headers=key)
                admits.append((time.perf_counter() - started) * 1000)
                codes[admitted.status_code] = codes.get(admitted.status_code, 0) + 1
                if admitted.status_code != 201:
                    continue
                started = time.perf_counter()
                await client.post(
                    f"/v1/reservations/{admitted.json()['reservation_id']}/settle",
                    json={"input_tokens": 20, "output_tokens": 50},
                    headers=key,
                )
                settles.append((time.perf_counter() - started) * 1000)
    kind = f"Citus coordinator + {len(nodes.workers)} workers" if nodes else "plain PostgreSQL"
    print(f"{kind}, deadline {DEADLINE_MS} ms, admit answers {codes}")
    print(f"admit: {_summary(admits)}; settle: {_summary(settles)}")


def main() -> None:
    run_against_database(measure)


if __name__ == "__main__":
    sys.exit(main())
