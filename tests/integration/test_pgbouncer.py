"""The API's core path through PgBouncer in transaction pooling (Debian's 1.18).

Everything the service does must hold with a session lent for one
transaction at a time: no startup parameters but application_name, no named
prepared statement reused across transactions, no session-level SET, advisory
locks only transaction-scoped. PgBouncer serves two server connections to an
application pool of ten, so a connection's consecutive statements really run
on different server sessions.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import asyncpg
import httpx
import pytest

from llmquota.api.app import create_app
from llmquota.config import Settings
from tests.api.conftest import ADMIN_KEY
from tests.pgbouncer import Bouncer, pgbouncer
from tests.support import run_cli

# Needs Debian's PgBouncer, which a machine with only Python lacks: the
# README's `pytest` deselects these (pyproject's addopts), and CI runs them
# as a leg of their own (`pytest -m pgbouncer`, after installing it).
pytestmark = pytest.mark.pgbouncer

ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
# What the role carries behind a pooler (docs/operations.md): the service
# cannot send these as startup parameters through PgBouncer.
ROLE_TIMEOUTS = {"statement_timeout": "5s", "lock_timeout": "2s"}
CONCURRENT_ADMISSIONS = 40


@pytest.fixture
def bouncer(database_dsn: str) -> Iterator[Bouncer]:
    asyncio.run(_set_database_timeouts(database_dsn))
    with pgbouncer(database_dsn) as running:
        yield running


async def _set_database_timeouts(dsn: str) -> None:
    connection = await asyncpg.connect(dsn)
    try:
        database = await connection.fetchval("SELECT current_database()")
        for name, value in ROLE_TIMEOUTS.items():
            await connection.execute(f"ALTER DATABASE \"{database}\" SET {name} = '{value}'")
    finally:
        await connection.close()


@pytest.fixture
async def client(bouncer: Bouncer) -> AsyncIterator[httpx.AsyncClient]:
    settings = Settings(  # type: ignore[call-arg]
        admin_key=ADMIN_KEY,
        transaction_pooler=True,
        pool_min_size=2,
        pool_max_size=10,
        decision_deadline_ms=60_000,
        _env_file=None,
    )
    app = create_app(settings, dsn=bouncer.dsn)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://llmquota") as c:
            yield c


async def test_pgbouncer_refuses_what_a_direct_session_carries(bouncer: Bouncer) -> None:
    """Why LLMQUOTA_TRANSACTION_POOLER exists: timeouts as startup parameters are refused."""
    assert "PgBouncer 1.18" in bouncer.version
    with pytest.raises(asyncpg.PostgresError, match="unsupported startup parameter"):
        await asyncpg.connect(bouncer.dsn, server_settings={"statement_timeout": "5000"})
    connection = await asyncpg.connect(bouncer.dsn, statement_cache_size=0)
    try:
        for name, value in ROLE_TIMEOUTS.items():
            assert await connection.fetchval(f"SHOW {name}") == value
    finally:
        await connection.close()


async def _admit(
    client: httpx.AsyncClient, headers: dict[str, str], **body: object
) -> dict[str, Any]:
    payload: dict[str, object] = {"tenant": "acme", "model": "gpt-4o", "max_tokens": 100}
    payload.update(body)
    response = await client.post("/v1/admit", json=payload, headers=headers)
    assert response.status_code == 201, response.text
    answer: dict[str, Any] = response.json()
    return answer


async def test_core_path_through_pgbouncer(
    client: httpx.AsyncClient, bouncer: Bouncer, database_dsn: str
) -> None:
    put = await client.put(
        "/v1/tenants/acme/policy",
        json={"tokens_per_minute": 6_000, "token_burst": 100_000, "max_in_flight": 50},
        headers=ADMIN,
    )
    assert put.status_code == 200, put.text
    glob = await client.put(
        "/v1/policies/global", json={"requests_per_minute": 10_000}, headers=ADMIN
    )
    assert glob.status_code == 200, glob.text
    key = await client.post("/v1/tenants/acme/keys", headers=ADMIN)
    assert key.status_code == 201, key.text
    acme = {"Authorization": f"Bearer {key.json()['key']}"}

    # Concurrent admissions: batches and the pool's ten connections over two
    # server sessions; the idempotency key takes its advisory lock inside the
    # statement's transaction.
    admitted = await asyncio.gather(
        *(
            _admit(client, acme, input_tokens=50, idempotency_key=f"job-{i}")
            for i in range(CONCURRENT_ADMISSIONS)
        )
    )
    replay = await _admit(client, acme, input_tokens=50, idempotency_key="job-0")
    assert replay["reservation_id"] == admitted[0]["reservation_id"]

    to_settle, to_release, to_beat = (a["reservation_id"] for a in admitted[:3])
    settled = await client.post(
        f"/v1/reservations/{to_settle}/settle",
        json={"input_tokens": 50, "output_tokens": 30, "outcome": "ok"},
        headers=acme,
    )
    assert settled.json() == {"charged_tokens": 80, "refunded_tokens": 70, "late": False}
    released = await client.post(f"/v1/reservations/{to_release}/release", headers=acme)
    assert released.status_code == 200, released.text
    beat = await client.post(
        f"/v1/reservations/{to_beat}/heartbeat", json={"lease_seconds": 300}, headers=acme
    )
    assert beat.status_code == 200, beat.text
    assert beat.json()["lease_generation"] == 2
    settled_all = await asyncio.gather(
        *(
            client.post(
                f"/v1/reservations/{a['reservation_id']}/settle",
                json={"input_tokens": 50, "output_tokens": 10},
                headers=acme,
            )
            for a in admitted[3:]
        )
    )
    assert {r.status_code for r in settled_all} == {200}

    # A lease that runs out, reclaimed by the real `llmquota sweep` through PgBouncer.
    await _admit(client, acme, input_tokens=10, max_tokens=90, lease_seconds=1)
    await asyncio.sleep(1.2)
    started = time.monotonic()
    swept = await asyncio.to_thread(
        run_cli, "sweep", dsn=bouncer.dsn, env={"LLMQUOTA_TRANSACTION_POOLER": "true"}
    )
    assert "expired=1 tokens_returned=100" in swept.stdout, swept.stdout
    assert time.monotonic() - started < 60

    status = await client.get("/v1/tenants/acme/status", headers=acme)
    assert status.status_code == 200, status.text
    tenant = {layer["scope"]: layer for layer in status.json()["layers"]}["tenant"]
    assert tenant["in_flight"] == 1  # the heartbeat's reservation, still live
    usage = await client.get("/v1/tenants/acme/usage", headers=acme)
    assert usage.status_code == 200, usage.text
    # 1 settled by hand + 37 settled together + 1 expired by the sweeper.
    assert usage.json()["requests"] == 39
    assert usage.json()["output_tokens"] == 30 + 37 * 10 + 0

    # What PostgreSQL holds agrees, read directly.
    direct = await asyncpg.connect(database_dsn)
    try:
        states = dict(await direct.fetch("SELECT state, count(*) FROM reservations GROUP BY state"))
    finally:
        await direct.close()
    assert sum(states.values()) == CONCURRENT_ADMISSIONS + 1
    assert states.get("active") == 1
