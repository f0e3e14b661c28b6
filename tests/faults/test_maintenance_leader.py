"""`llmquota serve` runs the sweeper itself, on exactly one leader per database.

Two servers (uvicorn, each a process of its own, as in production) share one
database. No cron runs `llmquota sweep`: a reservation whose lease lapses is
expired by whichever server holds the maintenance lock. Killing that server
with -9 drops its session, PostgreSQL frees the lock, and the other server
leads and sweeps within the bound below. With LLMQUOTA_SERVE_SWEEPER=false
nothing sweeps at all.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import asyncpg
import httpx

from tests.faults.conftest import metric_value, served_process

ADMIN_KEY = "lq_maintenance_leader_admin_0123"
ADMIN = {"authorization": f"Bearer {ADMIN_KEY}"}
# The settings under test: the leader sweeps every second, the others try the
# lock every second (the default).
SWEEPING = {"LLMQUOTA_SERVE_SWEEPER": "true", "LLMQUOTA_SWEEP_INTERVAL_SECONDS": "1"}
# What the promise allows from kill -9 of the leader until a reservation that
# lapsed after the kill is expired by the other server: a 1 s lease, one
# retry of the lock (1 s), one sweep; the rest is slack for a busy machine.
TAKEOVER_BOUND_SECONDS = 6.0


async def leader_of(client: httpx.AsyncClient) -> float:
    """The server's llmquota_maintenance_leader gauge."""
    return metric_value((await client.get("/metrics")).text, "llmquota_maintenance_leader")


async def lapsing_reservation(client: httpx.AsyncClient, tenant: str) -> uuid.UUID:
    """A reservation of `tenant` with a 1 s lease, never heartbeaten nor settled."""
    answer = await client.post(
        "/v1/admit",
        headers=ADMIN,
        json={
            "tenant": tenant,
            "model": "gpt-4o",
            "input_tokens": 10,
            "max_tokens": 90,
            "lease_seconds": 1,
        },
    )
    assert answer.status_code == 201, answer.text
    return uuid.UUID(answer.json()["reservation_id"])


async def advisory_locks(db: asyncpg.Connection) -> int:
    """Advisory locks held on this test's database (the maintenance lock is the only one
    a quiet server holds)."""
    return int(
        await db.fetchval(
            """SELECT count(*) FROM pg_locks
                WHERE locktype = 'advisory' AND granted
                  AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"""
        )
    )


async def state_of(db: asyncpg.Connection, reservation: uuid.UUID) -> str:
    return str(
        await db.fetchval("SELECT state FROM reservations WHERE reservation_id = $1", reservation)
    )


async def wait_expired(db: asyncpg.Connection, reservation: uuid.UUID, within: float) -> float:
    """Seconds until `reservation` is expired; fails after `within`."""
    started = time.monotonic()
    while await state_of(db, reservation) != "expired":
        assert time.monotonic() - started < within, f"{reservation} not expired in {within} s"
        await asyncio.sleep(0.05)
    return time.monotonic() - started


@contextlib.asynccontextmanager
async def two_servers(
    dsn: str, tmp_path: Path, **settings: str
) -> AsyncIterator[list[tuple[httpx.AsyncClient, int]]]:
    """Two `serve` processes on one database: [(client, pid), ...]."""
    async with (
        served_process(dsn, ADMIN_KEY, tmp_path / "a.log", **settings) as (base_a, pid_a),
        served_process(dsn, ADMIN_KEY, tmp_path / "b.log", **settings) as (base_b, pid_b),
        httpx.AsyncClient(base_url=base_a, timeout=10) as a,
        httpx.AsyncClient(base_url=base_b, timeout=10) as b,
    ):
        tenant = await a.put(
            "/v1/tenants/acme/policy", headers=ADMIN, json={"tokens_per_minute": 1_000_000}
        )
        assert tenant.status_code in (200, 201), tenant.text
        yield [(a, pid_a), (b, pid_b)]


async def test_one_server_leads_sweeps_without_cron_and_the_other_takes_over_after_kill_9(
    app_dsn: str, db: asyncpg.Connection, tmp_path: Path
) -> None:
    async with two_servers(app_dsn, tmp_path, **SWEEPING) as servers:
        # Exactly one leads (the second may still be starting its first try).
        deadline = time.monotonic() + 10
        while True:
            gauges = [await leader_of(client) for client, _ in servers]
            if sorted(gauges) == [0.0, 1.0]:
                break
            assert time.monotonic() < deadline, f"leader gauges {gauges}"
            await asyncio.sleep(0.1)
        leader, follower = servers if gauges[0] == 1.0 else servers[::-1]
        assert await advisory_locks(db) == 1

        # A lapsed reservation is expired by the leader: no cron, no `sweep`.
        first = await lapsing_reservation(follower[0], "acme")
        await wait_expired(db, first, within=1 + 1 + 3.0)
        sweeps = metric_value(
            (await leader[0].get("/metrics")).text, "llmquota_sweeps_total", result="ok"
        )
        assert sweeps >= 1
        follower_sweeps = metric_value(
            (await follower[0].get("/metrics")).text, "llmquota_sweeps_total", result="ok"
        )
        assert follower_sweeps == 0

        # kill -9 the leader (and its uvicorn); a new lapsing reservation is
        # expired by the other within the bound.
        os.kill(leader[1], signal.SIGKILL)
        killed = time.monotonic()
        second = await lapsing_reservation(follower[0], "acme")
        await wait_expired(db, second, within=TAKEOVER_BOUND_SECONDS)
        takeover = time.monotonic() - killed
        assert await leader_of(follower[0]) == 1.0
        print(
            f"\nkill -9 of the leader to a lapsed reservation expired by the other: "
            f"{takeover:.2f} s (bound {TAKEOVER_BOUND_SECONDS} s)"
        )
        assert takeover < TAKEOVER_BOUND_SECONDS


async def test_with_the_setting_off_nothing_is_swept(
    app_dsn: str, db: asyncpg.Connection, tmp_path: Path
) -> None:
    off = {"LLMQUOTA_SERVE_SWEEPER": "false", "LLMQUOTA_SWEEP_INTERVAL_SECONDS": "1"}
    async with two_servers(app_dsn, tmp_path, **off) as servers:
        reservation = await lapsing_reservation(servers[0][0], "acme")
        # Five sweep intervals past the lease: still active, nobody leads.
        await asyncio.sleep(1 + 5.0)
        assert await state_of(db, reservation) == "active"
        for client, _ in servers:
            assert await leader_of(client) == 0.0
            exposition = (await client.get("/metrics")).text
            assert metric_value(exposition, "llmquota_sweeps_total", result="ok") == 0
        assert await advisory_locks(db) == 0
