"""One tenant's megabyte prompts do not make another tenant's healthy database
look down.

A real server (uvicorn in its own process, over sockets, the 250 ms default
decision deadline) while a flooding tenant posts 1 MB prompts on several
connections. Counting them used to take the event loop for half a second
each, so other tenants' decisions missed the deadline and their failure
modes decided: an `open` tenant with max_in_flight 3 ended with 50 in
flight. Now big prompts are counted off the loop, and the deadline measures
the store: the open tenant stays at 3, admitted by the store itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator

import asyncpg
import httpx
import pytest

from tests.faults.conftest import worker_env
from tests.ports import reserved_port

ADMIN_KEY = "lq_big_prompt_admin_key_0123456789"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
MEGABYTE_PROMPT = "word " * 200_000  # 1,000,000 characters, ~200k tokens
FLOOD_CONNECTIONS = 3
FLOOD_SECONDS = 8.0
OPEN_ATTEMPTS = 50
# Of OPEN_ATTEMPTS decisions, how many may miss the 250 ms deadline (see below).
MISSED_DEADLINES_TOLERATED = 2


def _free_port() -> int:
    return reserved_port()


@pytest.fixture
def server(database_dsn: str) -> Iterator[str]:
    """`uvicorn llmquota.api.app:create_app_from_env` in its own process; its URL."""
    port = _free_port()
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "uvicorn",
            "llmquota.api.app:create_app_from_env",
            "--factory",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--log-level",
            "warning",
        ],
        env=worker_env(
            LLMQUOTA_DATABASE_URL=database_dsn,
            LLMQUOTA_ADMIN_KEY=ADMIN_KEY,
            LLMQUOTA_DECISION_DEADLINE_MS="250",
            LLMQUOTA_MAX_BODY_BYTES=str(2 * 1_048_576),
        ),
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert process.poll() is None, "the server exited"
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{base}/healthz", timeout=1).status_code == 200:
                    break
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.1)
        yield base
    finally:
        process.terminate()
        process.wait(timeout=30)


@pytest.fixture
async def client(server: str) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=server, timeout=60) as c:
        yield c


async def _tenant(client: httpx.AsyncClient, name: str, **policy: object) -> dict[str, str]:
    assert (await client.put(f"/v1/tenants/{name}/policy", json=policy, headers=ADMIN)).is_success
    key = (await client.post(f"/v1/tenants/{name}/keys", headers=ADMIN)).json()["key"]
    return {"Authorization": f"Bearer {key}"}


async def _flood(client: httpx.AsyncClient, key: dict[str, str], stop_at: float) -> list[int]:
    statuses: list[int] = []
    body = {
        "tenant": "flood",
        "model": "gpt-4o",
        "max_tokens": 1,
        "messages": [{"role": "user", "content": MEGABYTE_PROMPT}],
    }
    while time.monotonic() < stop_at:
        response = await client.post("/v1/admit", json=body, headers=key)
        statuses.append(response.status_code)
        if response.status_code == 201:
            reservation = response.json()["reservation_id"]
            await client.post(f"/v1/reservations/{reservation}/release", headers=key)
    return statuses


async def test_an_open_tenant_stays_within_max_in_flight_while_another_floods_big_prompts(
    client: httpx.AsyncClient, database_dsn: str
) -> None:
    flood_key = await _tenant(client, "flood", tokens_per_minute=100_000_000)
    open_key = await _tenant(client, "open-t", max_in_flight=3, failure_mode="open")
    closed_key = await _tenant(client, "closed-t", max_in_flight=10_000)

    async def open_tenant() -> list[httpx.Response]:
        answers = []
        for _ in range(OPEN_ATTEMPTS):
            body = {"tenant": "open-t", "model": "gpt-4o", "input_tokens": 1, "max_tokens": 1}
            answers.append(await client.post("/v1/admit", json=body, headers=open_key))
            await asyncio.sleep(FLOOD_SECONDS / OPEN_ATTEMPTS)
        return answers

    async def closed_tenant() -> list[int]:
        statuses = []
        for _ in range(OPEN_ATTEMPTS):
            body = {"tenant": "closed-t", "model": "gpt-4o", "input_tokens": 1, "max_tokens": 1}
            response = await client.post("/v1/admit", json=body, headers=closed_key)
            statuses.append(response.status_code)
            await asyncio.sleep(FLOOD_SECONDS / OPEN_ATTEMPTS)
        return statuses

    started = time.monotonic()
    stop_at = started + FLOOD_SECONDS
    await asyncio.sleep(0)
    floods = [_flood(client, flood_key, stop_at) for _ in range(FLOOD_CONNECTIONS)]
    open_answers, closed_statuses, *flooded = await asyncio.gather(
        open_tenant(), closed_tenant(), *floods
    )

    big_prompts = sum(len(statuses) for statuses in flooded)
    assert big_prompts >= FLOOD_CONNECTIONS  # the flood really ran
    admitted = [a for a in open_answers if a.status_code == 201]
    assert len(admitted) == 3, [a.status_code for a in open_answers]
    assert all(a.status_code == 429 for a in open_answers if a.status_code != 201)
    # Decided by the failure mode: the deadline missed. Blocking the loop made
    # nearly every decision of the flood's seconds miss it; on a loaded 2-core
    # machine the store itself may miss the odd one (PG15 leg of CI: 1 of 50).
    by_fallback = [a for a in open_answers if "llmquota-fallback" in a.headers]
    closed_unavailable = closed_statuses.count(503)
    print(f"deadline missed: {len(by_fallback)} open, {closed_unavailable} closed of 50 each")
    assert len(by_fallback) <= MISSED_DEADLINES_TOLERATED
    assert closed_unavailable <= MISSED_DEADLINES_TOLERATED
    assert set(closed_statuses) <= {201, 503} and closed_statuses.count(201) >= 48
    connection = await asyncpg.connect(database_dsn)
    try:
        in_flight = await connection.fetchval(
            "SELECT in_flight FROM limit_layers WHERE tenant = 'open-t' AND route IS NULL"
        )
    finally:
        await connection.close()
    assert in_flight == 3
    print(f"{big_prompts} megabyte prompts in {FLOOD_SECONDS:.0f} s; open tenant: 3 admitted")
