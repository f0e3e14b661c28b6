"""Hostile input and isolation: oversized and chunked bodies through a real
uvicorn server, token counts that are not honest integers, other tenants'
keys, wrong keys, and idempotency keys across tenants and time."""

from __future__ import annotations

import asyncio
import hashlib
import json
import uuid
from collections.abc import AsyncIterator

import asyncpg
import httpx
import pydantic
import pytest
import uvicorn

from llmquota.admission.limiter import Limiter
from llmquota.api.app import create_app
from llmquota.config import Settings
from tests.faults.conftest import count, fault_settings, layer

ADMIN_KEY = "lq_hostile_admin_key_0123456789"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
MIB = 1_048_576


@pytest.fixture
async def client(database_dsn: str) -> AsyncIterator[httpx.AsyncClient]:
    app = create_app(
        fault_settings(admin_key=ADMIN_KEY, decision_deadline_ms=30_000), dsn=database_dsn
    )
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://llmquota") as c:
            yield c


@pytest.fixture
async def server(database_dsn: str) -> AsyncIterator[int]:
    """A real uvicorn server on a free loopback port; yields the port."""
    app = create_app(
        fault_settings(admin_key=ADMIN_KEY, decision_deadline_ms=30_000), dsn=database_dsn
    )
    config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="on")
    srv = uvicorn.Server(config)
    task = asyncio.ensure_future(srv.serve())
    while not srv.started:
        assert not task.done(), "uvicorn did not start"
        await asyncio.sleep(0.02)
    port = srv.servers[0].sockets[0].getsockname()[1]
    yield port
    srv.should_exit = True
    await task


async def tenant(client: httpx.AsyncClient, name: str) -> dict[str, str]:
    policy = {"tokens_per_minute": 60_000, "token_burst": 100_000, "max_in_flight": 10}
    assert (await client.put(f"/v1/tenants/{name}/policy", json=policy, headers=ADMIN)).is_success
    key = (await client.post(f"/v1/tenants/{name}/keys", headers=ADMIN)).json()["key"]
    return {"Authorization": f"Bearer {key}"}


async def _response_head(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    status = int(head.split(b" ", 2)[1])
    length = next(
        int(line.split(b":", 1)[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length:")
    )
    return status, await asyncio.wait_for(reader.readexactly(length), 10)


async def test_declared_oversized_body_gets_413_before_it_is_sent(
    server: int, db: asyncpg.Connection
) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", server)
    writer.write(
        b"POST /v1/admit HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
        + f"Authorization: Bearer {ADMIN_KEY}\r\ncontent-length: {2 * MIB}\r\n\r\n".encode()
        + b'{"tenant": "acme", '
    )
    await writer.drain()
    # Not another byte of the 2 MiB is sent, and the answer comes anyway.
    status, body = await _response_head(reader)
    writer.close()
    assert status == 413
    assert json.loads(body)["error"]["type"] == "payload_too_large"
    assert await count(db, "reservations") == 0


async def test_chunked_body_without_length_is_cut_off_at_the_limit(
    server: int, db: asyncpg.Connection
) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", server)
    writer.write(
        b"POST /v1/admit HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
        + f"Authorization: Bearer {ADMIN_KEY}\r\ntransfer-encoding: chunked\r\n\r\n".encode()
    )
    chunk = b" " * 65_536
    sent = 0
    answered = asyncio.ensure_future(_response_head(reader))
    # Keep streaming (never sending the final chunk) until the server answers.
    while not answered.done() and sent < 4 * MIB:
        try:
            writer.write(f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n")
            await writer.drain()
        except ConnectionError:
            break
        sent += len(chunk)
        await asyncio.sleep(0.005)
    status, body = await answered
    writer.close()
    assert status == 413
    assert json.loads(body)["error"]["type"] == "payload_too_large"
    assert MIB < sent < 4 * MIB  # refused once past 1 MiB, long before the end
    assert await count(db, "reservations") == 0


async def test_valid_json_just_over_the_limit_is_refused_unparsed(
    server: int, db: asyncpg.Connection
) -> None:
    await db.execute("INSERT INTO tenants (tenant) VALUES ('acme')")
    await db.execute("INSERT INTO limit_layers (scope, tenant) VALUES ('tenant', 'acme')")
    body = json.dumps({"tenant": "acme", "model": "m", "input_tokens": 1, "max_tokens": 1})
    padded = body[:-1] + " " * (MIB + 1 - len(body)) + "}"
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server}") as c:
        too_big = await c.post(
            "/v1/admit", content=padded, headers={**ADMIN, "content-type": "application/json"}
        )
        fits = await c.post(
            "/v1/admit", content=body, headers={**ADMIN, "content-type": "application/json"}
        )
    assert too_big.status_code == 413
    assert fits.status_code == 201  # the same request, small enough, is admitted
    assert await count(db, "reservations") == 1


DISHONEST_COUNTS = [
    "-1",
    "1.5",
    "NaN",
    "Infinity",
    "-Infinity",
    "1e400",
    "10000001",
    '"100"',
    "true",
    "null",
    "[]",
    "99999999999999999999999",
]


@pytest.mark.parametrize("value", DISHONEST_COUNTS)
async def test_token_counts_must_be_honest_integers(
    client: httpx.AsyncClient, db: asyncpg.Connection, value: str
) -> None:
    acme = await tenant(client, "acme")
    held = (
        await client.post(
            "/v1/admit",
            headers=acme,
            json={"tenant": "acme", "model": "m", "input_tokens": 10, "max_tokens": 10},
        )
    ).json()
    before = await layer(db, "acme")
    ledger_before = await count(db, "usage_ledger")
    headers = {**acme, "content-type": "application/json"}
    attempts = [
        (
            "/v1/admit",
            f'{{"tenant": "acme", "model": "m", "input_tokens": 1, "max_tokens": {value}}}',
        ),
        (
            "/v1/admit",
            f'{{"tenant": "acme", "model": "m", "input_tokens": {value}, "max_tokens": 1}}',
        ),
        (
            f"/v1/reservations/{held['reservation_id']}/settle",
            f'{{"input_tokens": {value}, "output_tokens": 1}}',
        ),
        (
            f"/v1/reservations/{held['reservation_id']}/settle",
            f'{{"input_tokens": 1, "output_tokens": {value}}}',
        ),
    ]
    for path, raw in attempts:
        response = await client.post(path, content=raw, headers=headers)
        assert response.status_code == 422, (path, raw, response.text)
        assert response.json()["error"]["type"] == "invalid_request_error"
    # A policy's ceiling is higher (10 billion tokens a minute): go past that
    # one; and null there means "no limit", which is not dishonest: use -5.
    policy_value = {"10000001": "10000000001", "null": "-5"}.get(value, value)
    policy = await client.put(
        "/v1/tenants/acme/policy",
        content=f'{{"tokens_per_minute": {policy_value}}}',
        headers={**ADMIN, "content-type": "application/json"},
    )
    assert policy.status_code == 422, policy.text
    # Nothing was stored: one reservation, still active; balances untouched.
    assert await count(db, "reservations") == 1
    assert await count(db, "reservations", "state = 'active'") == 1
    assert await count(db, "usage_ledger") == ledger_before
    after = await layer(db, "acme")
    assert after["in_flight"] == before["in_flight"] == 1
    assert after["tokens"] >= before["tokens"]  # refill only
    stored = await client.get("/v1/tenants/acme/policy", headers=ADMIN)
    assert stored.json()["tokens_per_minute"] == 60_000


async def test_another_tenants_key_gets_404_and_changes_nothing(
    client: httpx.AsyncClient, db: asyncpg.Connection
) -> None:
    acme, rival = await tenant(client, "acme"), await tenant(client, "rival")
    held = (
        await client.post(
            "/v1/admit",
            headers=acme,
            json={"tenant": "acme", "model": "m", "input_tokens": 10, "max_tokens": 10},
        )
    ).json()
    rid = held["reservation_id"]
    before = await db.fetchrow("SELECT * FROM reservations")
    unknown = str(uuid.uuid4())
    for action, body in (
        ("settle", {"input_tokens": 1, "output_tokens": 1}),
        ("release", None),
        ("heartbeat", {}),
    ):
        theirs = await client.post(f"/v1/reservations/{rid}/{action}", json=body, headers=rival)
        nobodys = await client.post(
            f"/v1/reservations/{unknown}/{action}", json=body, headers=rival
        )
        assert theirs.status_code == nobodys.status_code == 404, action
        # Indistinguishable from a reservation that does not exist.
        assert theirs.json()["error"]["type"] == nobodys.json()["error"]["type"]
        assert theirs.json()["error"]["message"].replace(rid, "X") == (
            nobodys.json()["error"]["message"].replace(unknown, "X")
        )
    assert dict(await db.fetchrow("SELECT * FROM reservations")) == dict(before)
    assert await count(db, "usage_ledger") == 0
    assert (await layer(db, "acme"))["in_flight"] == 1
    for path in ("/v1/tenants/acme/status", "/v1/tenants/acme/usage"):
        assert (await client.get(path, headers=rival)).status_code == 403
    refused = await client.post(
        "/v1/admit",
        headers=rival,
        json={"tenant": "acme", "model": "m", "input_tokens": 1, "max_tokens": 1},
    )
    assert refused.status_code == 403
    assert await count(db, "reservations") == 1
    ok = await client.post(
        f"/v1/reservations/{rid}/settle", headers=acme, json={"input_tokens": 1, "output_tokens": 1}
    )
    assert ok.status_code == 200


async def test_keys_are_stored_hashed_and_a_wrong_key_gets_no_hint(
    client: httpx.AsyncClient, db: asyncpg.Connection
) -> None:
    acme = await tenant(client, "acme")
    key = acme["Authorization"].removeprefix("Bearer ")
    stored = await db.fetch("SELECT key_hash, tenant FROM api_keys")
    assert [bytes(r["key_hash"]) for r in stored] == [hashlib.sha256(key.encode()).digest()]
    dump = await db.fetchval("SELECT string_agg(t::text, ' ') FROM api_keys AS t")
    assert key not in dump and key[3:] not in dump
    wrong = [
        {"Authorization": f"Bearer {key[:-1]}{'A' if key[-1] != 'A' else 'B'}"},
        {"Authorization": f"Bearer {ADMIN_KEY[:-1]}X"},
        {"Authorization": "Bearer lq_"},
        {"Authorization": "Bearer"},
        {"Authorization": f"Basic {key}"},
        {},
    ]
    bodies = set()
    for headers in wrong:
        response = await client.get("/v1/tenants/acme/status", headers=headers)
        assert response.status_code == 401
        assert response.headers["www-authenticate"] == "Bearer"
        answer = response.json()
        # Each answer names its own request; all the rest must be identical.
        assert answer.pop("request_id") == response.headers["x-request-id"]
        bodies.add(json.dumps(answer, sort_keys=True))
    assert len(bodies) == 1  # the same answer whatever was wrong
    assert json.loads(bodies.pop())["error"] == {
        "type": "authentication_error",
        "message": "missing or invalid API key",
    }


async def test_idempotency_keys_are_per_tenant_refuse_another_body_and_live_24h(
    client: httpx.AsyncClient, db: asyncpg.Connection, database_dsn: str
) -> None:
    acme, rival = await tenant(client, "acme"), await tenant(client, "rival")
    body = {"model": "m", "input_tokens": 5, "max_tokens": 5, "idempotency_key": "order-42"}
    first = await client.post("/v1/admit", headers=acme, json={"tenant": "acme", **body})
    again = await client.post("/v1/admit", headers=acme, json={"tenant": "acme", **body})
    other = await client.post("/v1/admit", headers=rival, json={"tenant": "rival", **body})
    assert first.status_code == again.status_code == other.status_code == 201
    assert first.json()["reservation_id"] == again.json()["reservation_id"]
    assert other.json()["reservation_id"] != first.json()["reservation_id"]
    changed = await client.post(
        "/v1/admit", headers=acme, json={"tenant": "acme", **body, "max_tokens": 6}
    )
    assert changed.status_code == 422
    assert changed.json()["error"]["type"] == "idempotency_conflict"
    assert await count(db, "reservations") == 2

    rid = first.json()["reservation_id"]
    await client.post(
        f"/v1/reservations/{rid}/settle", headers=acme, json={"input_tokens": 5, "output_tokens": 1}
    )
    with pytest.raises(pydantic.ValidationError):
        Settings(retention_seconds=86_399, _env_file=None)  # type: ignore[call-arg]
    limiter = await Limiter.connect(database_dsn, fault_settings(retention_seconds=86_400))
    try:
        # 23 h 59 min after it finished, the key still answers with its reservation.
        await db.execute(
            "UPDATE reservations SET finished_at = clock_timestamp() "
            "- interval '23 hours 59 minutes' WHERE reservation_id = $1",
            uuid.UUID(rid),
        )
        assert (await limiter.sweep()).purged == 0
        replay = await client.post("/v1/admit", headers=acme, json={"tenant": "acme", **body})
        assert replay.json()["reservation_id"] == rid
        # Past 24 h it may go (its ledger row stays).
        await db.execute(
            "UPDATE reservations SET finished_at = clock_timestamp() "
            "- interval '24 hours 1 minute' WHERE reservation_id = $1",
            uuid.UUID(rid),
        )
        assert (await limiter.sweep()).purged == 1
        assert await count(db, "usage_ledger", "reservation_id = $1", uuid.UUID(rid)) == 1
    finally:
        await limiter.close()
