"""Admin keys in the database (listed, created, revoked, rotated; never the last
usable one revoked) and tenant suspension over the API."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta

import asyncpg
import httpx
import pytest

from llmquota.api.app import create_app
from llmquota.config import Settings
from tests.api.conftest import make_tenant

ADMIT = {"tenant": "acme", "model": "gpt-4o", "input_tokens": 5, "max_tokens": 5}


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture
async def bare(app_dsn: str) -> AsyncIterator[tuple[httpx.AsyncClient, str]]:
    """An app without LLMQUOTA_ADMIN_KEY, and the admin key `serve` generates at first start."""
    settings = Settings(admin_key=None, decision_deadline_ms=60_000, _env_file=None)  # type: ignore[call-arg]
    app = create_app(settings, dsn=app_dsn)
    async with app.router.lifespan_context(app):
        generated = await app.state.admin.ensure_first_admin_key()
        assert generated is not None
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://llmquota") as client:
            yield client, generated


async def test_the_last_usable_admin_key_cannot_be_revoked(
    bare: tuple[httpx.AsyncClient, str], db: asyncpg.Connection
) -> None:
    client, first = bare
    listed = (await client.get("/v1/admin/keys", headers=bearer(first))).json()
    assert [(k["tenant"], k["prefix"]) for k in listed] == [(None, first[:11])]
    first_id = listed[0]["id"]
    refused = await client.delete(f"/v1/admin/keys/{first_id}", headers=bearer(first))
    assert refused.status_code == 409, refused.text
    assert refused.json()["error"]["type"] == "conflict_error"
    # An expiring admin key does not count as one that stays usable.
    soon = (datetime.now(UTC) + timedelta(hours=1)).isoformat()
    expiring = await client.post("/v1/admin/keys", json={"expires_at": soon}, headers=bearer(first))
    assert expiring.status_code == 201 and expiring.json()["scopes"] == ["admit", "read"]
    again = await client.delete(f"/v1/admin/keys/{first_id}", headers=bearer(first))
    assert again.status_code == 409
    second = await client.post("/v1/admin/keys", json={"label": "ops"}, headers=bearer(first))
    assert second.status_code == 201
    new = second.json()
    assert (
        await client.delete(f"/v1/admin/keys/{first_id}", headers=bearer(new["key"]))
    ).status_code == 204
    assert (await client.get("/v1/admin/keys", headers=bearer(first))).status_code == 401
    assert (
        await client.delete(f"/v1/admin/keys/{new['id']}", headers=bearer(new["key"]))
    ).status_code == 409
    assert (
        await client.delete(f"/v1/admin/keys/{first_id}", headers=bearer(new["key"]))
    ).status_code == 204
    assert (
        await client.delete("/v1/admin/keys/999999", headers=bearer(new["key"]))
    ).status_code == 404
    assert await db.fetchval("SELECT count(*) FROM api_keys WHERE revoked_at IS NULL") == 2
    assert (
        await client.post("/v1/admin/keys", json={"scopes": ["read"]}, headers=bearer(new["key"]))
    ).status_code == 422


async def test_admin_keys_rotate_with_a_grace(bare: tuple[httpx.AsyncClient, str]) -> None:
    client, first = bare
    first_id = (await client.get("/v1/admin/keys", headers=bearer(first))).json()[0]["id"]
    url = f"/v1/admin/keys/{first_id}/rotate"
    rotated = await client.post(url, json={"grace_seconds": 1}, headers=bearer(first))
    assert rotated.status_code == 200, rotated.text
    new = rotated.json()
    assert new["id"] == first_id and new["key"] != first
    assert (await client.get("/v1/admin/keys", headers=bearer(first))).status_code == 200
    started = time.monotonic()
    while (await client.get("/v1/admin/keys", headers=bearer(first))).status_code == 200:
        assert time.monotonic() - started < 5, "the old secret was never refused"
        await asyncio.sleep(0.05)
    assert 0.7 <= time.monotonic() - started <= 2.0
    assert (await client.get("/v1/admin/keys", headers=bearer(new["key"]))).status_code == 200


async def test_a_tenant_key_is_no_admin_key(
    client: httpx.AsyncClient, admin: dict[str, str]
) -> None:
    tenant = await make_tenant(client, admin, "acme", tokens_per_minute=10_000)
    for method, path in (("GET", "/v1/admin/keys"), ("POST", "/v1/admin/keys")):
        assert (await client.request(method, path, headers=tenant)).status_code == 403
    # With LLMQUOTA_ADMIN_KEY set, every stored admin key may go: that one stays.
    created = (await client.post("/v1/admin/keys", headers=admin)).json()
    assert (await client.get("/v1/admin/keys", headers=bearer(created["key"]))).status_code == 200
    assert (
        await client.delete(f"/v1/admin/keys/{created['id']}", headers=admin)
    ).status_code == 204
    assert (await client.get("/v1/admin/keys", headers=bearer(created["key"]))).status_code == 401
    assert (await client.get("/v1/admin/keys", headers=admin)).status_code == 200


async def test_a_suspended_tenant_cannot_admit_but_settles(
    client: httpx.AsyncClient, admin: dict[str, str], db: asyncpg.Connection
) -> None:
    tenant = await make_tenant(client, admin, "acme", tokens_per_minute=10_000)
    held = await client.post("/v1/admit", json=ADMIT, headers=tenant)
    assert held.status_code == 201
    rid = held.json()["reservation_id"]
    suspended = await client.post("/v1/tenants/acme/suspend", headers=admin)
    assert suspended.status_code == 200
    assert suspended.json()["suspended"] is True and suspended.json()["suspended_at"]
    refused = await client.post("/v1/admit", json=ADMIT, headers=tenant)
    assert refused.status_code == 403
    assert refused.json()["error"]["type"] == "tenant_suspended"
    count = await db.fetchval("SELECT count(*) FROM reservations")
    beat = await client.post(f"/v1/reservations/{rid}/heartbeat", headers=tenant)
    assert beat.status_code == 200
    settle = {"input_tokens": 5, "output_tokens": 2}
    settled = await client.post(f"/v1/reservations/{rid}/settle", json=settle, headers=tenant)
    assert settled.status_code == 200
    assert await db.fetchval("SELECT count(*) FROM reservations") == count
    assert await db.fetchval("SELECT count(*) FROM usage_ledger WHERE tenant = 'acme'") == 1
    assert (await client.post("/v1/tenants/acme/suspend", headers=admin)).json()[
        "suspended_at"
    ] == suspended.json()["suspended_at"]
    assert (await client.post("/v1/tenants/acme/suspend", headers=tenant)).status_code == 403
    # The tenant is suspended, not only its keys: the admin key's admission for it too.
    by_admin = await client.post("/v1/admit", json=ADMIT, headers=admin)
    assert by_admin.status_code == 403, by_admin.text
    assert by_admin.json()["error"]["type"] == "tenant_suspended"
    assert await db.fetchval("SELECT count(*) FROM reservations") == count
    resumed = await client.post("/v1/tenants/acme/resume", headers=admin)
    assert resumed.json() == {"tenant": "acme", "suspended": False, "suspended_at": None}
    assert (await client.post("/v1/admit", json=ADMIT, headers=tenant)).status_code == 201
    assert (await client.post("/v1/admit", json=ADMIT, headers=admin)).status_code == 201
    assert (await client.post("/v1/tenants/nobody/suspend", headers=admin)).status_code == 404
