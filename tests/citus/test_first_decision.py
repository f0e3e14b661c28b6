"""A fresh connection decides within the deadline on a Citus coordinator.

Issue 26: with the plain schema migrated onto a coordinator, `llmquota serve`
answered every admission 503. The first statement of each new connection spent
0.5-0.8 s in asyncpg's type introspection (Citus filters every read of pg_class
to hide its shards), the 250 ms deadline cancelled it and terminated the
connection, and the next connection started cold again. The sessions now turn
that filter off (store/connection.py, CITUS_SESSION_SETTINGS).
"""

from __future__ import annotations

import httpx
import pytest

from llmquota.api.app import create_app
from llmquota.config import Settings
from tests.api.conftest import ADMIN_KEY, make_tenant
from tests.citus.nodes import CitusNodes

pytestmark = pytest.mark.citus_only

# The deadline `llmquota serve` runs with by default.
SERVE_DEADLINE_MS = 250
# Fresh apps, each with a pool of one fresh connection: each meets the cold start.
FRESH_CONNECTIONS = 3


async def test_the_first_decision_of_each_fresh_connection_meets_the_250_ms_deadline(
    app_dsn: str, cluster: CitusNodes
) -> None:
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    for attempt in range(FRESH_CONNECTIONS):
        settings = Settings(  # type: ignore[call-arg]
            admin_key=ADMIN_KEY,
            pool_min_size=1,
            pool_max_size=1,
            decision_deadline_ms=SERVE_DEADLINE_MS,
            ceiling_alerts=False,
            _env_file=None,
        )
        app = create_app(settings, dsn=app_dsn)
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://llmquota") as c:
                key = await make_tenant(c, admin, f"acme{attempt}", tokens_per_minute=100_000)
                body = {"tenant": f"acme{attempt}", "model": "gpt-4o", "input_tokens": 20}
                admitted = await c.post("/v1/admit", json={**body, "max_tokens": 100}, headers=key)
                assert admitted.status_code == 201, admitted.text
                rid = admitted.json()["reservation_id"]
                settled = await c.post(
                    f"/v1/reservations/{rid}/settle",
                    json={"input_tokens": 20, "output_tokens": 50},
                    headers=key,
                )
                assert settled.status_code == 200, settled.text
