"""A whole answer goes to the client first, and its settlement right behind it.

The settlement of a non-stream answer used to be on the client's path (about
1 ms of the proxy's added latency, BENCHMARKS.md); it now follows the answer
(api/proxy/settles.py). Each test holds the settlement back as long as it
likes by locking the reservation's row from a connection of its own, with a
real uvicorn server and the official openai SDK, and shows what must still
hold:
- the answer does not wait for its settlement;
- the tenant's next request waits for it, so a tenant with max_in_flight 1
  that sends its next request as soon as its answer arrives is not refused
  for its own finished request (nor is the semantic cache's embedding of
  it, which is admitted before the request itself); another tenant's
  request does not wait;
- a worker told to stop settles it before it exits.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import AsyncIterator

import asyncpg
import httpx
import openai

from tests.proxy.conftest import (
    ADMIN,
    GENEROUS,
    ledger,
    reservation_states,
    settled,
    stack_for,
)
from tests.proxy.fake_provider import FakeProvider
from tests.proxy.test_proxy_cache import PARAPHRASE, QUESTION, SEMANTIC, entries
from tests.proxy.test_proxy_shutdown import _output, server_process
from tests.support import announcements_applied

MESSAGES = [{"role": "user", "content": "Say hello."}]
ONE_AT_A_TIME = {**GENEROUS, "max_in_flight": 1}


async def chat(client: openai.AsyncOpenAI) -> str:
    """One completion; its text."""
    answer = await client.chat.completions.create(model="gpt-4o", messages=MESSAGES, max_tokens=20)
    text = answer.choices[0].message.content
    assert text
    return text


@contextlib.asynccontextmanager
async def settlement_held(dsn: str, model: str = "gpt-4o") -> AsyncIterator[None]:
    """The row of the one active reservation for `model` locked until the block
    ends: its settlement (lq_finish locks it first) waits that long."""
    holder = await asyncpg.connect(dsn)
    active = "FROM reservations WHERE state = 'active' AND model = $1"
    try:
        for _ in range(1_000):  # 10 s: the provider thinks for 2
            if await holder.fetchval(f"SELECT count(*) {active}", model):
                break
            await asyncio.sleep(0.01)
        async with holder.transaction():
            locked = await holder.fetch(f"SELECT reservation_id {active} FOR UPDATE", model)
            assert len(locked) == 1
            yield
            # the block's end rolls back: nothing changed, the lock is gone
    finally:
        await holder.close()


async def test_the_answer_goes_first_and_the_tenants_next_request_behind_its_settlement(
    fake: tuple[FakeProvider, str], *, database_dsn: str, db: asyncpg.Connection
) -> None:
    provider = fake[0]
    # Time to lock the reservation while the provider thinks (then it answers),
    # on a loaded machine too.
    provider.scenario, provider.hang_seconds = "hang", 2.0
    async with stack_for(fake, database_dsn, ONE_AT_A_TIME) as stack:
        assert (await stack.admin.put("/v1/tenants/beta/policy", json=ONE_AT_A_TIME)).is_success
        beta_key = (await stack.admin.post("/v1/tenants/beta/keys")).json()["key"]
        await announcements_applied(stack.app, database_dsn)
        beta = openai.AsyncOpenAI(base_url=f"{stack.url}/v1", api_key=beta_key, max_retries=0)
        stack.clients.append(beta)
        acme = stack.openai()
        first = asyncio.create_task(chat(acme))
        async with settlement_held(database_dsn):
            # The answer arrives while its settlement cannot be written.
            assert await asyncio.wait_for(first, 10)
            assert await reservation_states(db) == ["active"]
            assert await ledger(db) == []
            provider.scenario = "ok"
            # acme's next request waits for that settlement: with max_in_flight 1
            # it would otherwise be refused (429) for the request just answered.
            second = asyncio.create_task(chat(acme))
            # beta's does not wait for acme's.
            assert await asyncio.wait_for(chat(beta), 10)
            await asyncio.sleep(0.3)
            assert not second.done()
            assert [r["tenant"] for r in await ledger(db)] in ([], ["beta"])
        assert await asyncio.wait_for(second, 10)
    rows = await settled(db, 3)
    assert sorted(r["tenant"] for r in rows) == ["acme", "acme", "beta"]
    assert [r["outcome"] for r in rows] == ["ok"] * 3
    assert await reservation_states(db) == ["settled"] * 3


async def test_a_paraphrase_sent_at_once_is_still_served_from_the_semantic_cache(
    fake: tuple[FakeProvider, str], *, database_dsn: str, db: asyncpg.Connection
) -> None:
    provider = fake[0]
    provider.semantic_embeddings = True
    provider.scenario, provider.hang_seconds = "hang", 2.0
    async with stack_for(fake, database_dsn, {**ONE_AT_A_TIME, "cache": SEMANTIC}) as stack:
        client = stack.openai()

        async def ask(messages: list[dict[str, str]]) -> str:
            raw = await client.chat.completions.with_raw_response.create(
                model="gpt-4o", messages=messages, max_tokens=50, temperature=0
            )
            return raw.headers["llmquota-serving-path"]

        first = asyncio.create_task(ask(QUESTION))
        async with settlement_held(database_dsn):
            assert await asyncio.wait_for(first, 10) == "primary"
            provider.scenario = "ok"
            assert await entries(db, 1) == 1
            # Its lookup embeds the paraphrase, an admission of the tenant's own:
            # with max_in_flight 1 it waits for the settlement, not refused
            # (which would skip the lookup and pay the provider for the answer).
            second = asyncio.create_task(ask(PARAPHRASE))
            await asyncio.sleep(0.3)
            assert not second.done()
        assert await asyncio.wait_for(second, 10) == "cache"
    completions = [r for r in provider.requests if r.get("messages") is not None]
    assert len(completions) == 1


async def test_sequential_requests_of_a_one_at_a_time_tenant_are_never_refused(
    fake: tuple[FakeProvider, str], *, database_dsn: str, db: asyncpg.Connection
) -> None:
    async with stack_for(fake, database_dsn, ONE_AT_A_TIME) as stack:
        client = stack.openai()
        answers = [await chat(client) for _ in range(40)]
    assert len(answers) == 40  # any 429 would have raised openai.RateLimitError
    assert len(await settled(db, 40)) == 40


async def test_a_worker_told_to_stop_settles_what_it_answered_before_it_exits(
    fake: tuple[FakeProvider, str], *, database_dsn: str, db: asyncpg.Connection
) -> None:
    provider, fake_url = fake
    provider.scenario, provider.hang_seconds = "hang", 2.0
    async with server_process(database_dsn, fake_url) as (process, url):
        async with httpx.AsyncClient(base_url=url, headers=ADMIN) as admin:
            assert (await admin.put("/v1/tenants/acme/policy", json=GENEROUS)).is_success
            key = (await admin.post("/v1/tenants/acme/keys")).json()["key"]
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)
        first = asyncio.create_task(chat(client))
        async with settlement_held(database_dsn):
            assert await asyncio.wait_for(first, 10)
            await client.close()
            process.send_signal(signal.SIGTERM)
            await asyncio.sleep(0.5)
            # Still there: its shutdown waits for the settlement.
            assert process.returncode is None
            assert await reservation_states(db) == ["active"]
        exit_code = await asyncio.wait_for(process.wait(), 30)
        output = await _output(process)
        assert exit_code in (0, -signal.SIGTERM), output
        assert "Application shutdown complete" in output
    rows = await ledger(db)
    assert [(r["tenant"], r["outcome"]) for r in rows] == [("acme", "ok")]
    assert await reservation_states(db) == ["settled"]
