"""A tenant whose requests are stuck cannot starve another tenant.

The noisy tenant's layer row is locked from outside, so every admission of
that tenant hangs inside PostgreSQL holding a pooled connection. With the
per-tenant fair share, at most `tenant_max_in_progress` of them hold a
connection and the rest wait in the noisy tenant's own queue (or are turned
away once it is full): the quiet tenant is admitted at once. With the fair
share turned off, the same flood takes every connection of the pool and the
quiet tenant waits until the noisy tenant is unstuck.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence

import asyncpg
import httpx
import pytest
from fastapi import FastAPI

from llmquota.api.app import create_app
from tests.faults.conftest import fault_settings

ADMIN_KEY = "lq_fair_admin_key_0123456789"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
POOL = 6
FLOOD = 12
# Long enough for an admission with a free connection; the noisy ones are
# stuck for as long as the test holds the lock.
QUIET_WAIT_SECONDS = 5.0


Served = tuple[httpx.AsyncClient, FastAPI]


async def _client(database_dsn: str, max_in_progress: int) -> AsyncIterator[Served]:
    settings = fault_settings(
        admin_key=ADMIN_KEY,
        pool_max_size=POOL,
        tenant_max_in_progress=max_in_progress,
        tenant_max_queued=8,
        decision_deadline_ms=30_000,
        lock_timeout_ms=30_000,
        # the stuck admissions wait out the whole test, longer than the 5 s default
        statement_timeout_ms=30_000,
        # Group admission shares statements between tenants: a batch that holds
        # a stuck tenant's request waits for it, and so do the others in it
        # (bounded in production by lock_timeout and the decision deadline;
        # see RELIABILITY.md). The fair share is about one statement per request.
        batching=False,
    )
    app = create_app(settings, dsn=database_dsn)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://llmquota") as c:
            yield c, app


async def _lock_waiters(database_dsn: str, expected: int) -> None:
    """Until `expected` sessions wait on the locked row (the flood holds those
    connections): a fixed sleep is too short on a busy machine, where the
    quiet tenant then finds a connection the flood had not taken yet."""
    watcher = await asyncpg.connect(database_dsn)
    try:
        for _ in range(400):
            waiting = await watcher.fetchval(
                "SELECT count(*) FROM pg_stat_activity"
                " WHERE datname = current_database() AND wait_event_type = 'Lock'"
            )
            if waiting >= expected:
                return
            await asyncio.sleep(0.05)
        rows = await watcher.fetch(
            "SELECT state, wait_event_type, wait_event, left(query, 80) AS q FROM pg_stat_activity"
            " WHERE datname = current_database()"
        )
        sessions = [tuple(r) for r in rows]
        raise AssertionError(f"{waiting} admissions wait on the lock, not {expected}: {sessions}")
    finally:
        await watcher.close()


async def _turned_away(flood: Sequence[asyncio.Future[httpx.Response]], expected: int) -> None:
    """Until `expected` of the flood have their answer while the lock is held:
    on a busy machine the last of the flood can reach the fair share's gate
    after a fixed sleep, and then after the lock is gone, when its queue has
    room again."""
    for _ in range(200):
        if sum(f.done() for f in flood) >= expected:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"{sum(f.done() for f in flood)} of the flood answered, not {expected}")


async def _known(served: Served, tenant: str, key: dict[str, str]) -> None:
    """Until the worker knows whose key it is (the fair share's lane is the tenant's).

    One request teaches it, but the announcement of the key's creation may
    arrive after that request and make the worker forget it again (it looks
    the key up at its next use): the flood would then be in the lane of keys
    not seen yet, with that lane's limits.
    """
    client, app = served
    for _ in range(200):
        assert (await client.get(f"/v1/tenants/{tenant}/status", headers=key)).is_success
        await asyncio.sleep(0.05)
        if app.state.authenticator.triage(key["Authorization"], "127.0.0.1").lane == tenant:
            return
    raise AssertionError(f"the worker does not know {tenant}'s key")


async def _flood_while_stuck(
    served: Served, database_dsn: str, stuck: int, turned_away: int
) -> tuple[bool, list[int]]:
    client = served[0]
    keys = {}
    for tenant in ("noisy", "quiet"):
        policy = {"tokens_per_minute": 60_000}
        assert (
            await client.put(f"/v1/tenants/{tenant}/policy", json=policy, headers=ADMIN)
        ).is_success
        key = (await client.post(f"/v1/tenants/{tenant}/keys", headers=ADMIN)).json()["key"]
        keys[tenant] = {"Authorization": f"Bearer {key}"}
        await _known(served, tenant, keys[tenant])
    body = {"model": "m", "input_tokens": 1, "max_tokens": 1}
    locker = await asyncpg.connect(database_dsn)
    try:
        tx = locker.transaction()
        await tx.start()
        await locker.execute("SELECT 1 FROM limit_layers WHERE tenant = 'noisy' FOR UPDATE")
        flood = [
            asyncio.ensure_future(
                client.post("/v1/admit", headers=keys["noisy"], json={"tenant": "noisy", **body})
            )
            for _ in range(FLOOD)
        ]
        await _lock_waiters(database_dsn, stuck)  # the flood holds its connections
        await _turned_away(flood, turned_away)  # the rest of it is in: queued, or turned away
        await asyncio.sleep(0.3)
        quiet = asyncio.ensure_future(
            client.post("/v1/admit", headers=keys["quiet"], json={"tenant": "quiet", **body})
        )
        # Does the quiet tenant get through while the noisy one is stuck?
        done, _ = await asyncio.wait({quiet}, timeout=QUIET_WAIT_SECONDS)
        served_while_stuck = bool(done)
        await tx.rollback()
        answers = await asyncio.gather(*flood)
        quiet_answer = await quiet
    finally:
        await locker.close()
    assert quiet_answer.status_code == 201, quiet_answer.text
    return served_while_stuck, sorted(r.status_code for r in answers)


@pytest.fixture
async def fair(database_dsn: str) -> AsyncIterator[Served]:
    async for c in _client(database_dsn, max_in_progress=2):
        yield c


@pytest.fixture
async def unfair(database_dsn: str) -> AsyncIterator[Served]:
    async for c in _client(database_dsn, max_in_progress=10_000):
        yield c


async def test_stuck_tenant_cannot_starve_another(
    fair: Served, database_dsn: str, db: asyncpg.Connection
) -> None:
    served_while_stuck, statuses = await _flood_while_stuck(
        fair, database_dsn, stuck=2, turned_away=FLOOD - 10
    )
    assert served_while_stuck
    # 2 in progress and 8 queued were served once the lock went; the rest of
    # the flood was turned away at once, its tenant's queue being full.
    assert statuses == [201] * 10 + [429] * 2
    assert await db.fetchval("SELECT count(*) FROM reservations WHERE tenant = 'noisy'") == 10


async def test_without_the_fair_share_the_flood_takes_every_connection(
    unfair: Served, database_dsn: str
) -> None:
    served_while_stuck, statuses = await _flood_while_stuck(
        unfair, database_dsn, stuck=POOL, turned_away=0
    )
    assert not served_while_stuck  # it waited for a connection the flood held
    assert statuses == [201] * FLOOD
