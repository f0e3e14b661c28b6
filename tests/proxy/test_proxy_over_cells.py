"""The proxy through the service over cells (api/cells_front.py), with the
official SDKs: each request goes to its key's cell, streams pass through
whole, and each settles into its own cell's ledger."""

from __future__ import annotations

import asyncio

import anthropic
import asyncpg
import httpx
import openai
import pytest

from llmquota.api.cells_front import CellsFront
from llmquota.domain.cells import cell_of
from llmquota.store.cells import build_cells
from tests.proxy.conftest import ADMIN, proxy_settings, serving
from tests.proxy.fake_provider import FakeProvider
from tests.support import APP_ROLE, dsn_as

pytestmark = pytest.mark.citus

TENANTS = [f"tenant-{i:02d}" for i in range(40)]
ONE = next(t for t in TENANTS if cell_of(t, 2) == 1)
TWO = next(t for t in TENANTS if cell_of(t, 2) == 2)
MESSAGES = [{"role": "user", "content": "Say something."}]


async def cell_ledgers(db: asyncpg.Connection, rows: int) -> dict[int, list[str]]:
    """Each cell's ledger tenants once the two hold `rows` rows (the streams'
    settlements land after their last event)."""
    deadline = asyncio.get_running_loop().time() + 15
    while True:
        found = {
            k: [r["tenant"] for r in await db.fetch(f"SELECT tenant FROM cell_{k}.usage_ledger")]
            for k in (1, 2)
        }
        done = sum(len(v) for v in found.values()) >= rows
        if done or asyncio.get_running_loop().time() > deadline:
            return found
        await asyncio.sleep(0.05)


async def test_sdk_calls_through_the_front_are_decided_and_billed_in_their_tenants_cell(
    fake: tuple[FakeProvider, str], empty_database_dsn: str
) -> None:
    provider, fake_url = fake
    await asyncio.to_thread(build_cells, empty_database_dsn, 2)
    front = CellsFront(proxy_settings(fake_url), dsn_as(empty_database_dsn, APP_ROLE))
    async with serving(front) as url, httpx.AsyncClient(base_url=url, headers=ADMIN) as admin:
        keys = {}
        for tenant in (ONE, TWO):
            put = await admin.put(f"/v1/tenants/{tenant}/policy", json={"tokens_per_minute": 10**6})
            assert put.status_code == 200, put.text
            keys[tenant] = (await admin.post(f"/v1/tenants/{tenant}/keys")).json()["key"]
        for tenant in (ONE, TWO):
            client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=keys[tenant], max_retries=0)
            answer = await client.chat.completions.create(
                model="gpt-4o",
                messages=MESSAGES,  # type: ignore[arg-type]
                max_tokens=20,
            )
            assert answer.choices[0].message.content
            await client.close()
        claude = anthropic.AsyncAnthropic(base_url=url, api_key=keys[TWO], max_retries=0)
        stream = await claude.messages.create(
            model="claude-sonnet-4-5",
            messages=MESSAGES,  # type: ignore[arg-type]
            max_tokens=50,
            stream=True,
        )
        events = [event.type async for event in stream]
        assert events[0] == "message_start" and events[-1] == "message_stop"
        await claude.close()
        # The admin key cannot call providers, over cells as on one database.
        admin_sdk = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        admin_sdk.api_key = ADMIN["Authorization"].removeprefix("Bearer ")
        with pytest.raises(openai.PermissionDeniedError):
            await admin_sdk.chat.completions.create(
                model="gpt-4o",
                messages=MESSAGES,  # type: ignore[arg-type]
                max_tokens=5,
            )
        await admin_sdk.close()
        db = await asyncpg.connect(empty_database_dsn)
        try:
            ledgers = await cell_ledgers(db, 3)
        finally:
            await db.close()
    assert ledgers == {1: [ONE], 2: [TWO, TWO]}
    assert len(provider.requests) == 3
