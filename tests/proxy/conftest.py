"""Fixtures for proxy mode: a fake provider and llmquota, each a real uvicorn
server on a loopback port, the official SDKs pointed at llmquota, and the
ledger read straight from the test database."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import anthropic
import asyncpg
import httpx
import openai
import pytest
import uvicorn
from fastapi import FastAPI
from starlette.types import ASGIApp

from llmquota.api.app import create_app
from llmquota.config import Settings
from tests.proxy.fake_provider import PROVIDER_KEY, FakeProvider
from tests.support import announcements_applied

ADMIN_KEY = "lq_proxy_admin_key_0123456789"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}


@contextlib.asynccontextmanager
async def serving(app: ASGIApp) -> AsyncIterator[str]:
    """Serve `app` with uvicorn on a free loopback port; yields its base URL."""
    config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="on")
    server = uvicorn.Server(config)
    task = asyncio.ensure_future(server.serve())
    while not server.started:
        assert not task.done(), "uvicorn did not start"
        await asyncio.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await task


@pytest.fixture
async def fake() -> AsyncIterator[tuple[FakeProvider, str]]:
    provider = FakeProvider()
    async with serving(provider.app()) as url:
        yield provider, url


@pytest.fixture
async def second_fake() -> AsyncIterator[tuple[FakeProvider, str]]:
    """Another fake provider, for a second upstream (UPSTREAMS_FILE)."""
    provider = FakeProvider(words=3)
    async with serving(provider.app()) as url:
        yield provider, url


def proxy_settings(fake_url: str, **overrides: Any) -> Settings:
    values: dict[str, Any] = {
        "admin_key": ADMIN_KEY,
        "pool_min_size": 1,
        "pool_max_size": 10,
        "decision_deadline_ms": 30_000,
        "openai_base_url": f"{fake_url}/v1",
        "openai_api_key": PROVIDER_KEY,
        "anthropic_base_url": fake_url,
        "anthropic_api_key": PROVIDER_KEY,
    }
    values.update(overrides)
    return Settings(_env_file=None, **values)  # type: ignore[call-arg]


@dataclass
class Stack:
    """llmquota in proxy mode in front of the fake provider, with one tenant's key."""

    fake: FakeProvider
    url: str
    key: str
    admin: httpx.AsyncClient
    app: FastAPI
    clients: list[openai.AsyncOpenAI | anthropic.AsyncAnthropic] = field(default_factory=list)

    def openai(self, **options: Any) -> openai.AsyncOpenAI:
        """An SDK client with the tenant's key, not retrying unless told to."""
        options = {"api_key": self.key, "max_retries": 0, **options}
        client = openai.AsyncOpenAI(base_url=f"{self.url}/v1", **options)
        self.clients.append(client)
        return client

    def anthropic(self, **options: Any) -> anthropic.AsyncAnthropic:
        options = {"api_key": self.key, "max_retries": 0, **options}
        client = anthropic.AsyncAnthropic(base_url=self.url, **options)
        self.clients.append(client)
        return client

    async def close(self) -> None:
        for client in self.clients:
            await client.close()


@contextlib.asynccontextmanager
async def stack_for(
    fake: tuple[FakeProvider, str], database_dsn: str, policy: dict[str, int], **settings: Any
) -> AsyncIterator[Stack]:
    provider, fake_url = fake
    app = create_app(proxy_settings(fake_url, **settings), dsn=database_dsn)
    async with serving(app) as url, httpx.AsyncClient(base_url=url, headers=ADMIN) as admin:
        assert (await admin.put("/v1/tenants/acme/policy", json=policy)).is_success
        key = (await admin.post("/v1/tenants/acme/keys")).json()["key"]
        # The key's creation is announced before its first use, as it would be
        # for a key handed to a client: a late announcement costs a lookup.
        await announcements_applied(app, database_dsn)
        stack = Stack(provider, url, key, admin, app)
        try:
            yield stack
        finally:
            await stack.close()


GENEROUS = {"tokens_per_minute": 600_000, "token_burst": 200_000, "max_in_flight": 10}


@pytest.fixture
async def stack(fake: tuple[FakeProvider, str], database_dsn: str) -> AsyncIterator[Stack]:
    async with stack_for(fake, database_dsn, GENEROUS, proxy_heartbeat_seconds=0.2) as s:
        yield s


async def ledger(db: asyncpg.Connection) -> list[asyncpg.Record]:
    """Every usage row, oldest first."""
    return list(
        await db.fetch(
            "SELECT reservation_id, tenant, route, model, input_tokens, output_tokens, outcome"
            " FROM usage_ledger WHERE entry_kind = 'usage' ORDER BY entry_id"
        )
    )


async def reservation_states(db: asyncpg.Connection) -> list[str]:
    return [r["state"] for r in await db.fetch("SELECT state FROM reservations ORDER BY 1")]


async def settled(db: asyncpg.Connection, rows: int, within: float = 15.0) -> list[asyncpg.Record]:
    """The ledger once it holds `rows` rows and no reservation is active (waits for pumps)."""
    deadline = asyncio.get_running_loop().time() + within
    while True:
        found = await ledger(db)
        active = "active" in await reservation_states(db)
        if (len(found) >= rows and not active) or asyncio.get_running_loop().time() > deadline:
            return found
        await asyncio.sleep(0.05)
