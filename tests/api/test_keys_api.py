"""The key lifecycle over the API: list, create with label/expiry/scopes, revoke,
rotate with a grace, and the 401/403/404/422 each case answers.

One worker here (the ASGI app); tests/faults/test_key_workers.py proves the
same refusals on a second server process.
"""

from __future__ import annotations

import asyncio
import time
from datetime import UTC, datetime, timedelta
from typing import Any

import asyncpg
import httpx

from tests.api.conftest import make_tenant

ADMIT = {"tenant": "acme", "model": "gpt-4o", "input_tokens": 5, "max_tokens": 5}
FIELDS = {"id", "tenant", "prefix", "label", "created_at", "last_used_at", "expires_at"}
FIELDS |= {"revoked_at", "scopes"}
# The key's own limits (tests/api/test_key_limits.py), null when not set.
FIELDS |= {"tokens_per_minute", "token_burst", "requests_per_minute", "request_burst"}
FIELDS |= {"max_in_flight", "models"}


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def new_key(
    client: httpx.AsyncClient, admin: dict[str, str], tenant: str = "acme", **body: Any
) -> dict[str, Any]:
    response = await client.post(f"/v1/tenants/{tenant}/keys", json=body, headers=admin)
    assert response.status_code == 201, response.text
    created: dict[str, Any] = response.json()
    return created


async def admit(client: httpx.AsyncClient, key: str) -> httpx.Response:
    return await client.post("/v1/admit", json=ADMIT, headers=bearer(key))


async def test_list_shows_every_field_and_never_the_secret(
    client: httpx.AsyncClient, admin: dict[str, str], db: asyncpg.Connection
) -> None:
    await make_tenant(client, admin, "acme", tokens_per_minute=10_000)
    created = await new_key(client, admin, label="ci runner", scopes=["read"])
    assert set(created) == FIELDS | {"key"}
    assert created["prefix"] == created["key"][:11] and created["prefix"].startswith("lq_")
    assert created["label"] == "ci runner" and created["scopes"] == ["read"]
    assert created["expires_at"] is None and created["revoked_at"] is None
    listed = await client.get("/v1/tenants/acme/keys", headers=admin)
    assert listed.status_code == 200
    rows = listed.json()
    assert len(rows) == 2  # make_tenant's key and this one, oldest first
    assert rows[1] == {name: created[name] for name in FIELDS}
    assert rows[0]["scopes"] == ["admit", "read"]
    text = listed.text
    digest = await db.fetchval("SELECT key_hash FROM api_keys WHERE key_id = $1", created["id"])
    assert created["key"] not in text and digest.hex() not in text
    # A tenant's read key lists its own tenant's keys, not another's.
    own = await client.get("/v1/tenants/acme/keys", headers=bearer(created["key"]))
    assert [row["id"] for row in own.json()] == [row["id"] for row in rows]
    await make_tenant(client, admin, "other", tokens_per_minute=10_000)
    theirs = await client.get("/v1/tenants/other/keys", headers=bearer(created["key"]))
    assert theirs.status_code == 403
    assert (await client.get("/v1/tenants/nobody/keys", headers=admin)).status_code == 404


async def test_last_used_at_is_noted_once_a_minute_per_worker(
    client: httpx.AsyncClient, admin: dict[str, str], db: asyncpg.Connection
) -> None:
    await make_tenant(client, admin, "acme", tokens_per_minute=10_000)
    created = await new_key(client, admin)
    assert (await admit(client, created["key"])).status_code == 201
    deadline = time.monotonic() + 5
    while (first := await db.fetchval("SELECT last_used_at FROM api_key_uses")) is None:
        assert time.monotonic() < deadline, "the use was never noted"
        await asyncio.sleep(0.02)
    for _ in range(5):
        assert (await admit(client, created["key"])).status_code == 201
    await asyncio.sleep(0.3)
    # Five more uses within the minute wrote nothing.
    assert await db.fetchval("SELECT last_used_at FROM api_key_uses") == first
    listed = (await client.get("/v1/tenants/acme/keys", headers=admin)).json()
    assert datetime.fromisoformat(listed[-1]["last_used_at"]) == first


async def test_bad_key_bodies_are_422_naming_the_field(
    client: httpx.AsyncClient, admin: dict[str, str], db: asyncpg.Connection
) -> None:
    await make_tenant(client, admin, "acme", tokens_per_minute=10_000)
    past = (datetime.now(UTC) - timedelta(seconds=5)).isoformat()
    cases = [
        ({"expires_at": past}, "expires_at"),
        ({"expires_at": past.removesuffix("+00:00")}, "expires_at"),  # naive: UTC, past
        ({"expires_at": "tomorrow"}, "expires_at"),
        ({"scopes": ["admit", "write"]}, "scopes"),
        ({"scopes": []}, "scopes"),
        ({"label": ""}, "label"),
        ({"secret": "x"}, "secret"),
    ]
    for body, field in cases:
        response = await client.post("/v1/tenants/acme/keys", json=body, headers=admin)
        assert response.status_code == 422, (body, response.text)
        assert field in response.text, (body, response.text)
    assert await db.fetchval("SELECT count(*) FROM api_keys") == 1
    # A new tenant with a bad key body is not registered either.
    response = await client.post("/v1/tenants/newco/keys", json={"expires_at": past}, headers=admin)
    assert response.status_code == 422
    assert await db.fetchval("SELECT count(*) FROM tenants WHERE tenant = 'newco'") == 0
    fresh = await client.post("/v1/tenants/newco/keys", headers=admin)
    assert fresh.status_code == 201
    layers = "SELECT count(*) FROM limit_layers WHERE tenant = 'newco' AND scope = 'tenant'"
    assert await db.fetchval(layers) == 1
    created = await new_key(client, admin)
    for grace in (-1, 7 * 24 * 3600 + 1, "10"):
        url = f"/v1/tenants/acme/keys/{created['id']}/rotate"
        response = await client.post(url, json={"grace_seconds": grace}, headers=admin)
        assert response.status_code == 422 and "grace_seconds" in response.text


async def test_revoked_key_is_refused_at_once_and_revoking_is_idempotent(
    client: httpx.AsyncClient, admin: dict[str, str]
) -> None:
    await make_tenant(client, admin, "acme", tokens_per_minute=10_000)
    created = await new_key(client, admin)
    wrong = await client.post("/v1/admit", json=ADMIT, headers=bearer("lq_wrong"))
    assert (await admit(client, created["key"])).status_code == 201  # cached now
    url = f"/v1/tenants/acme/keys/{created['id']}"
    for _ in range(2):
        response = await client.delete(url, headers=admin)
        assert response.status_code == 204 and response.content == b""
    # Refused at once on this worker: the route dropped it from the key cache.
    refused = await admit(client, created["key"])
    assert refused.status_code == 401
    assert refused.json()["error"] == wrong.json()["error"]  # no hint
    listed = (await client.get("/v1/tenants/acme/keys", headers=admin)).json()
    assert listed[-1]["revoked_at"] is not None
    assert (await client.delete("/v1/tenants/acme/keys/999999", headers=admin)).status_code == 404
    await make_tenant(client, admin, "other", tokens_per_minute=10_000)
    other_key = await new_key(client, admin, "other")
    # Another tenant's key id is unknown under this tenant.
    assert (
        await client.delete(f"/v1/tenants/acme/keys/{other_key['id']}", headers=admin)
    ).status_code == 404
    assert (await admit(client, other_key["key"])).status_code != 401
    tenant_says = await client.delete(url, headers=bearer(other_key["key"]))
    assert tenant_says.status_code == 403


async def test_rotation_keeps_the_key_and_ends_the_old_secret_after_the_grace(
    client: httpx.AsyncClient, admin: dict[str, str]
) -> None:
    await make_tenant(client, admin, "acme", tokens_per_minute=10_000)
    created = await new_key(client, admin, label="svc", scopes=["admit"])
    assert (await admit(client, created["key"])).status_code == 201
    url = f"/v1/tenants/acme/keys/{created['id']}/rotate"
    rotated = await client.post(url, json={"grace_seconds": 2}, headers=admin)
    assert rotated.status_code == 200, rotated.text
    body = rotated.json()
    assert body["id"] == created["id"] and body["label"] == "svc" and body["scopes"] == ["admit"]
    assert body["key"] != created["key"] and body["prefix"] == body["key"][:11]
    started = time.monotonic()
    assert (await admit(client, body["key"])).status_code == 201
    while (await admit(client, created["key"])).status_code == 201:
        assert time.monotonic() - started < 5, "the old secret was never refused"
        await asyncio.sleep(0.05)
    grace = time.monotonic() - started
    print(f"old secret refused {grace:.3f}s after a 2 s grace")
    assert 1.5 <= grace <= 3.0, grace
    assert (await admit(client, created["key"])).status_code == 401
    assert (await admit(client, body["key"])).status_code == 201
    # Without a grace the old secret is refused at once.
    again = (await client.post(url, headers=admin)).json()
    assert (await admit(client, body["key"])).status_code == 401
    assert (await admit(client, again["key"])).status_code == 201
    # A revoked key is not rotated; an unknown one is not found.
    await client.delete(f"/v1/tenants/acme/keys/{created['id']}", headers=admin)
    assert (await client.post(url, headers=admin)).status_code == 409
    missing = await client.post("/v1/tenants/acme/keys/999999/rotate", headers=admin)
    assert missing.status_code == 404


async def test_an_expired_key_is_refused(client: httpx.AsyncClient, admin: dict[str, str]) -> None:
    await make_tenant(client, admin, "acme", tokens_per_minute=10_000)
    expires = datetime.now(UTC) + timedelta(seconds=1.5)
    created = await new_key(client, admin, expires_at=expires.isoformat())
    assert datetime.fromisoformat(created["expires_at"]) == expires
    # RFC 3339 (the schema's format: date-time): without an offset it names no moment.
    naive = await client.post(
        "/v1/tenants/acme/keys", json={"expires_at": "2031-01-01T00:00:00"}, headers=admin
    )
    assert naive.status_code == 422, naive.text
    assert (await admit(client, created["key"])).status_code == 201
    # When each request was sent: the last one admitted and the first refused
    # bound the moment the key stopped working, however long each took.
    admitted_at = sent_at = datetime.now(UTC)
    while (await admit(client, created["key"])).status_code == 201:
        admitted_at = sent_at
        assert datetime.now(UTC) < expires + timedelta(seconds=5), "never refused"
        await asyncio.sleep(0.05)
        sent_at = datetime.now(UTC)
    refused_at = datetime.now(UTC)  # its answer came by now
    late = (admitted_at - expires).total_seconds()
    early = (expires - refused_at).total_seconds()
    print(f"expired key last admitted {late:.3f}s after its expires_at, refused from then")
    assert late <= 0.5, late  # admitted after its expiry: within the cache's tolerance
    assert early <= 0.2, early  # never refused before it expired (clock tolerance)
    assert (await admit(client, created["key"])).status_code == 401
    # Expired keys are not rotated back to life.
    url = f"/v1/tenants/acme/keys/{created['id']}/rotate"
    assert (await client.post(url, headers=admin)).status_code == 409


async def test_scopes_decide_what_a_key_may_do(
    client: httpx.AsyncClient, admin: dict[str, str]
) -> None:
    await make_tenant(client, admin, "acme", tokens_per_minute=10_000)
    reader = (await new_key(client, admin, scopes=["read"]))["key"]
    admitter = (await new_key(client, admin, scopes=["admit"]))["key"]
    refused = await admit(client, reader)
    assert refused.status_code == 403
    assert refused.json()["error"]["message"] == "this key lacks the 'admit' scope"
    assert (await client.get("/v1/tenants/acme/status", headers=bearer(reader))).status_code == 200
    assert (await client.get("/v1/tenants/acme/usage", headers=bearer(reader))).status_code == 200
    admitted = await admit(client, admitter)
    assert admitted.status_code == 201
    rid = admitted.json()["reservation_id"]
    for path in ("status", "usage", "keys"):
        response = await client.get(f"/v1/tenants/acme/{path}", headers=bearer(admitter))
        assert response.status_code == 403, path
        assert "'read' scope" in response.json()["error"]["message"]
    heartbeat = await client.post(f"/v1/reservations/{rid}/heartbeat", headers=bearer(reader))
    assert heartbeat.status_code == 403
    settle = {"input_tokens": 5, "output_tokens": 1}
    url = f"/v1/reservations/{rid}/settle"
    assert (await client.post(url, json=settle, headers=bearer(reader))).status_code == 403
    assert (await client.post(url, json=settle, headers=bearer(admitter))).status_code == 200
