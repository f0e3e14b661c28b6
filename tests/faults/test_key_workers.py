"""Revocation, rotation and suspension reach every worker within a second.

Two real server processes on one database (each its own key cache), over
sockets. Their key cache refresh is an hour, so whatever reaches the other
worker in time came by the database's announcement (NOTIFY on the api_keys
or tenants row), not by the periodic refresh.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx

from tests.faults.conftest import serving_process

ADMIN_KEY = "lq_key_workers_admin_key_0123"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
ADMIT = {"tenant": "acme", "model": "gpt-4o", "input_tokens": 5, "max_tokens": 5}
# The promise: a change on one worker is refused on every other within this.
OTHER_WORKER_SECONDS = 1.0


@contextlib.asynccontextmanager
async def two_workers(
    dsn: str, tmp_path: Path
) -> AsyncIterator[tuple[httpx.AsyncClient, httpx.AsyncClient]]:
    settings = {"key_cache_refresh_seconds": "3600", "policy_cache_refresh_seconds": "3600"}
    async with (
        serving_process(dsn, ADMIN_KEY, tmp_path / "a.log", **settings) as base_a,
        serving_process(dsn, ADMIN_KEY, tmp_path / "b.log", **settings) as base_b,
        httpx.AsyncClient(base_url=base_a, timeout=30) as a,
        httpx.AsyncClient(base_url=base_b, timeout=30) as b,
    ):
        yield a, b


async def admit(client: httpx.AsyncClient, key: str) -> httpx.Response:
    return await client.post("/v1/admit", json=ADMIT, headers={"Authorization": f"Bearer {key}"})


async def seconds_until(client: httpx.AsyncClient, key: str, status: int) -> float:
    """Admit with `key` on `client` until it answers `status`; how long that took."""
    started = time.monotonic()
    while (await admit(client, key)).status_code != status:
        assert time.monotonic() - started < 5, f"never {status}"
        await asyncio.sleep(0.005)
    return time.monotonic() - started


async def tenant_key(a: httpx.AsyncClient) -> tuple[int, str]:
    policy = await a.put(
        "/v1/tenants/acme/policy", json={"tokens_per_minute": 100_000}, headers=ADMIN
    )
    assert policy.status_code == 200, policy.text
    created = await a.post("/v1/tenants/acme/keys", headers=ADMIN)
    assert created.status_code == 201, created.text
    return int(created.json()["id"]), str(created.json()["key"])


async def test_a_revoked_key_is_refused_on_the_other_worker_within_a_second(
    database_dsn: str, tmp_path: Path
) -> None:
    async with two_workers(database_dsn, tmp_path) as (a, b):
        key_id, key = await tenant_key(a)
        # Both workers know the key (cached) before it is revoked.
        assert (await admit(a, key)).status_code == 201
        assert (await admit(b, key)).status_code == 201
        revoked = await a.delete(f"/v1/tenants/acme/keys/{key_id}", headers=ADMIN)
        assert revoked.status_code == 204
        started = time.monotonic()
        # At once on the revoking worker: its very next answer.
        assert (await admit(a, key)).status_code == 401
        here = time.monotonic() - started
        there = await seconds_until(b, key, 401)
        print(
            f"revoked key refused: {here * 1000:.1f} ms on its worker, "
            f"{there * 1000:.1f} ms on the other"
        )
        assert here < OTHER_WORKER_SECONDS and there < OTHER_WORKER_SECONDS
        body = (await admit(b, key)).json()["error"]
        assert body == (await admit(b, "lq_never_issued")).json()["error"]


async def test_rotation_grace_and_end_on_the_other_worker(
    database_dsn: str, tmp_path: Path
) -> None:
    async with two_workers(database_dsn, tmp_path) as (a, b):
        key_id, key = await tenant_key(a)
        assert (await admit(b, key)).status_code == 201
        url = f"/v1/tenants/acme/keys/{key_id}/rotate"
        rotated = await a.post(url, json={"grace_seconds": 2}, headers=ADMIN)
        started = time.monotonic()
        new = rotated.json()["key"]
        assert (await admit(b, new)).status_code == 201
        assert (await admit(b, key)).status_code == 201  # within the grace
        await seconds_until(b, key, 401)
        grace = time.monotonic() - started
        print(f"old secret refused on the other worker {grace:.3f}s after a 2 s grace")
        assert 1.5 <= grace <= 2.0 + OTHER_WORKER_SECONDS
        again = await a.post(url, headers=ADMIN)  # no grace: the old secret ends at once
        there = await seconds_until(b, new, 401)
        print(f"rotated-out secret refused on the other worker after {there * 1000:.1f} ms")
        assert there < OTHER_WORKER_SECONDS
        assert (await admit(b, again.json()["key"])).status_code == 201


async def test_suspension_and_resumption_reach_the_other_worker_within_a_second(
    database_dsn: str, tmp_path: Path
) -> None:
    async with two_workers(database_dsn, tmp_path) as (a, b):
        _key_id, key = await tenant_key(a)
        held = await admit(b, key)
        assert held.status_code == 201
        assert (await admit(a, key)).status_code == 201
        assert (await a.post("/v1/tenants/acme/suspend", headers=ADMIN)).status_code == 200
        started = time.monotonic()
        assert (await admit(a, key)).status_code == 403  # at once where it was done
        here = time.monotonic() - started
        there = await seconds_until(b, key, 403)
        print(f"suspension refused: {here * 1000:.1f} ms here, {there * 1000:.1f} ms on the other")
        assert here < OTHER_WORKER_SECONDS and there < OTHER_WORKER_SECONDS
        assert (await admit(b, key)).json()["error"]["type"] == "tenant_suspended"
        rid = held.json()["reservation_id"]
        settle = {"input_tokens": 5, "output_tokens": 1}
        headers = {"Authorization": f"Bearer {key}"}
        settled = await b.post(f"/v1/reservations/{rid}/settle", json=settle, headers=headers)
        assert settled.status_code == 200, settled.text
        assert (await a.post("/v1/tenants/acme/resume", headers=ADMIN)).status_code == 200
        there = await seconds_until(b, key, 201)
        print(f"resumption admitted on the other worker after {there * 1000:.1f} ms")
        assert there < OTHER_WORKER_SECONDS


async def test_a_suspension_refuses_the_admin_keys_admissions_too_on_every_worker(
    database_dsn: str, tmp_path: Path
) -> None:
    """The suspension is the tenant's, not its keys': an admission the admin key
    asks for on the tenant's behalf is refused as well, here at once, there
    within a second (the announcement reloads the worker's suspended tenants)."""
    async with two_workers(database_dsn, tmp_path) as (a, b):
        await tenant_key(a)
        assert (await admit(b, ADMIN_KEY)).status_code == 201
        assert (await a.post("/v1/tenants/acme/suspend", headers=ADMIN)).status_code == 200
        refused = await admit(a, ADMIN_KEY)
        assert refused.status_code == 403 and refused.json()["error"]["type"] == "tenant_suspended"
        there = await seconds_until(b, ADMIN_KEY, 403)
        print(f"the admin key's admission refused on the other worker after {there * 1000:.1f} ms")
        assert there < OTHER_WORKER_SECONDS
        assert (await a.post("/v1/tenants/acme/resume", headers=ADMIN)).status_code == 200
        assert (await admit(a, ADMIN_KEY)).status_code == 201
        assert await seconds_until(b, ADMIN_KEY, 201) < OTHER_WORKER_SECONDS


async def test_a_keys_new_limits_bind_on_the_other_worker_within_a_second(
    database_dsn: str, tmp_path: Path
) -> None:
    # The key's layer is created by the PUT after both workers cached the key
    # without one: the other worker learns of it from the key's announcement.
    async with two_workers(database_dsn, tmp_path) as (a, b):
        key_id, key = await tenant_key(a)
        assert (await admit(b, key)).status_code == 201
        url = f"/v1/tenants/acme/keys/{key_id}/policy"
        put = await a.put(url, json={"models": ["claude-*"]}, headers=ADMIN)
        assert put.status_code == 200, put.text
        started = time.monotonic()
        assert (await admit(a, key)).status_code == 403  # at once on this worker
        there = await seconds_until(b, key, 403)
        print(f"a key's new model list bound on the other worker after {there * 1000:.1f} ms")
        assert there < OTHER_WORKER_SECONDS
        assert time.monotonic() - started < 2 * OTHER_WORKER_SECONDS
        refused = (await admit(b, key)).json()["error"]["message"]
        assert "'gpt-4o'" in refused and "claude-*" in refused
