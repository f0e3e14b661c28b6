"""The response cache tier of proxy mode (issue 23), through the official SDKs.

A tenant whose policy caches answers is served a repeated request from the
cache (exact), or a paraphrase of its last question (semantic, embedded by
the fake provider's bag-of-words model): the provider sees nothing, the
answer is the provider's own (a stream replayed as its SSE), the ledger books
the hit with 0 tokens and what it saved, and a spent budget does not stop it.
Another tenant's identical request is never served from it.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from decimal import Decimal
from typing import Any

import asyncpg
import openai
import pytest

from llmquota.admission.limiter import Limiter
from tests.proxy.conftest import GENEROUS, Stack, settled, stack_for
from tests.proxy.fake_provider import PROMPT_TOKENS, FakeProvider, completion_tokens
from tests.proxy.test_proxy_metrics import scrape, value

QUESTION = [{"role": "user", "content": "What is the capital city of France?"}]
PARAPHRASE = [{"role": "user", "content": "what is the capital of france"}]
UNRELATED = [{"role": "user", "content": "How long should I knead bread dough?"}]
EXACT = {"mode": "exact", "ttl_seconds": 600}
SEMANTIC = {
    "mode": "semantic",
    "embedding_model": "text-embedding-3-small",
    "similarity": 0.85,
}


@pytest.fixture
async def cached(fake: tuple[FakeProvider, str], database_dsn: str) -> AsyncIterator[Stack]:
    policy = {**GENEROUS, "cache": EXACT}
    async with stack_for(fake, database_dsn, policy, proxy_heartbeat_seconds=0.2) as s:
        yield s


async def entries(db: asyncpg.Connection, count: int, within: float = 10.0) -> int:
    """The cache's entries once there are `count` (stores run in the background)."""
    deadline = asyncio.get_running_loop().time() + within
    while True:
        found = int(await db.fetchval("SELECT count(*) FROM response_cache"))
        if found >= count or asyncio.get_running_loop().time() > deadline:
            return found
        await asyncio.sleep(0.02)


async def ask_and_store(client: openai.AsyncOpenAI, db: asyncpg.Connection) -> None:
    """Ask QUESTION once (temperature 0: cacheable) and wait until its answer is stored."""
    await client.chat.completions.create(
        model="gpt-4o", messages=QUESTION, max_tokens=50, temperature=0
    )
    await entries(db, 1)


async def cache_rows(db: asyncpg.Connection) -> list[dict[str, Any]]:
    rows = await db.fetch(
        "SELECT tenant, model, input_tokens, output_tokens, saved_input_tokens,"
        " saved_output_tokens, price_usd FROM usage_ledger WHERE serving_path = 'cache'"
        " ORDER BY entry_id"
    )
    return [dict(r) for r in rows]


async def test_a_repeated_request_is_answered_from_the_cache(
    cached: Stack, db: asyncpg.Connection
) -> None:
    client = cached.openai()
    first = await client.chat.completions.with_raw_response.create(
        model="gpt-4o", messages=QUESTION, max_tokens=50, temperature=0
    )
    assert first.headers["llmquota-serving-path"] == "primary"
    assert await entries(db, 1) == 1
    second = await client.chat.completions.with_raw_response.create(
        model="gpt-4o", messages=QUESTION, max_tokens=50, temperature=0
    )
    assert second.headers["llmquota-serving-path"] == "cache"
    assert len(cached.fake.requests) == 1  # the provider saw the first only
    assert second.parse().choices[0].message.content == first.parse().choices[0].message.content
    assert second.parse().usage == first.parse().usage  # the provider's answer, as it was
    # The ledger: the provider's usage once, and the hit at 0 tokens, with what it saved.
    await settled(db, 2)
    assert await cache_rows(db) == [
        {
            "tenant": "acme",
            "model": "gpt-4o",
            "input_tokens": 0,
            "output_tokens": 0,
            "saved_input_tokens": PROMPT_TOKENS,
            "saved_output_tokens": completion_tokens(6),
            "price_usd": None,
        }
    ]
    metrics = await scrape(cached)
    assert value(metrics, "llmquota_serving_path_total", path="cache") == 1
    assert value(metrics, "llmquota_serving_path_total", path="primary") == 1


async def test_a_hit_is_served_when_the_budget_is_spent_and_priced_as_the_policy_says(
    cached: Stack, db: asyncpg.Connection
) -> None:
    policy = {
        "requests_per_minute": 1,
        "request_burst": 1,
        "cache": {**EXACT, "hit_price_usd": "0.0005"},
    }
    assert (await cached.admin.put("/v1/tenants/acme/policy", json=policy)).is_success
    client = cached.openai()
    await ask_and_store(client, db)
    # The one request a minute is spent: a new question is refused...
    refused = await cached.admin.post(
        "/v1/chat/completions",
        json={"model": "gpt-4o", "messages": UNRELATED, "max_tokens": 5, "temperature": 0},
        headers={"Authorization": f"Bearer {cached.key}"},
    )
    assert refused.status_code == 429
    # ... and the cached one is served all the same.
    hit = await client.chat.completions.with_raw_response.create(
        model="gpt-4o", messages=QUESTION, max_tokens=50, temperature=0
    )
    assert hit.status_code == 200 and hit.headers["llmquota-serving-path"] == "cache"
    assert [r["price_usd"] for r in await cache_rows(db)] == [Decimal("0.0005")]


async def test_a_policy_can_keep_hits_within_the_budget(
    cached: Stack, db: asyncpg.Connection
) -> None:
    policy = {
        "requests_per_minute": 1,
        "request_burst": 1,
        "cache": {**EXACT, "serve_when_exhausted": False},
    }
    assert (await cached.admin.put("/v1/tenants/acme/policy", json=policy)).is_success
    client = cached.openai()
    await ask_and_store(client, db)
    again = await cached.admin.post(
        "/v1/chat/completions",
        json={"model": "gpt-4o", "messages": QUESTION, "max_tokens": 50, "temperature": 0},
        headers={"Authorization": f"Bearer {cached.key}"},
    )
    assert again.status_code == 429
    assert await cache_rows(db) == []


async def test_a_hit_within_the_budget_gives_back_what_admission_reserved(
    cached: Stack, db: asyncpg.Connection
) -> None:
    policy = {**GENEROUS, "cache": {**EXACT, "serve_when_exhausted": False}}
    assert (await cached.admin.put("/v1/tenants/acme/policy", json=policy)).is_success
    client = cached.openai()
    for _ in range(2):
        await client.chat.completions.create(
            model="gpt-4o", messages=QUESTION, max_tokens=50, temperature=0
        )
        await entries(db, 1)
    assert len(cached.fake.requests) == 1
    states = [r["state"] for r in await db.fetch("SELECT state FROM reservations ORDER BY 1")]
    assert sorted(states) == ["released", "settled"]
    assert len(await cache_rows(db)) == 1


async def test_another_tenants_identical_request_is_not_served_from_the_cache(
    cached: Stack, db: asyncpg.Connection
) -> None:
    await ask_and_store(cached.openai(), db)
    policy = {**GENEROUS, "cache": EXACT}
    assert (await cached.admin.put("/v1/tenants/globex/policy", json=policy)).is_success
    other_key = (await cached.admin.post("/v1/tenants/globex/keys")).json()["key"]
    other = cached.openai(api_key=other_key)
    answer = await other.chat.completions.with_raw_response.create(
        model="gpt-4o", messages=QUESTION, max_tokens=50, temperature=0
    )
    assert answer.headers["llmquota-serving-path"] == "primary"
    assert len(cached.fake.requests) == 2
    assert await cache_rows(db) == []


async def test_a_sampled_request_is_not_cached_unless_the_policy_says_so(
    cached: Stack, db: asyncpg.Connection
) -> None:
    client = cached.openai()
    for _ in range(2):  # no temperature: the provider samples at 1
        await client.chat.completions.create(model="gpt-4o", messages=QUESTION, max_tokens=50)
    assert len(cached.fake.requests) == 2
    policy = {**GENEROUS, "cache": {**EXACT, "sampled": True}}
    assert (await cached.admin.put("/v1/tenants/acme/policy", json=policy)).is_success
    for _ in range(2):
        await client.chat.completions.create(model="gpt-4o", messages=QUESTION, max_tokens=50)
        await entries(db, 1)
    assert len(cached.fake.requests) == 3


async def test_a_stream_is_replayed_as_the_providers_events(
    cached: Stack, db: asyncpg.Connection
) -> None:
    client = cached.openai()

    async def text(**options: Any) -> tuple[str, Any, int]:
        stream = await client.chat.completions.create(
            model="gpt-4o",
            messages=QUESTION,
            max_tokens=50,
            temperature=0,
            stream=True,
            **options,
        )
        parts, usage, chunks = [], None, 0
        async for chunk in stream:
            chunks += 1
            usage = chunk.usage or usage
            parts.extend(c.delta.content or "" for c in chunk.choices)
        return "".join(parts), usage, chunks

    first, first_usage, first_chunks = await text()
    assert await entries(db, 1) == 1
    again, usage, chunks = await text()
    assert (again, usage, chunks) == (first, None, first_chunks)  # no usage chunk: not asked
    with_usage, usage, _ = await text(stream_options={"include_usage": True})
    assert with_usage == first and first_usage is None
    assert usage is not None and usage.completion_tokens == completion_tokens(6)
    assert len(cached.fake.requests) == 1
    assert len(await cache_rows(db)) == 2


async def test_anthropic_answers_whole_and_streamed_come_from_the_cache(
    cached: Stack, db: asyncpg.Connection
) -> None:
    # This SDK sends no temperature (Anthropic's current API has none): its
    # answers are sampled, so the policy must say so to cache them.
    policy = {**GENEROUS, "cache": {**EXACT, "sampled": True}}
    assert (await cached.admin.put("/v1/tenants/acme/policy", json=policy)).is_success
    client = cached.anthropic()
    whole = await client.messages.create(
        model="claude-sonnet-4-5", messages=QUESTION, max_tokens=50
    )
    await entries(db, 1)
    again = await client.messages.with_raw_response.create(
        model="claude-sonnet-4-5", messages=QUESTION, max_tokens=50
    )
    assert again.headers["llmquota-serving-path"] == "cache"
    assert (await again.parse()).content == whole.content
    async with client.messages.stream(
        model="claude-sonnet-4-5", messages=QUESTION, max_tokens=50
    ) as stream:
        streamed = await stream.get_final_message()
    await entries(db, 2)
    async with client.messages.stream(
        model="claude-sonnet-4-5", messages=QUESTION, max_tokens=50
    ) as stream:
        replayed = await stream.get_final_message()
    assert replayed.content == streamed.content
    assert replayed.usage.output_tokens == streamed.usage.output_tokens
    assert len(cached.fake.requests) == 2
    assert len(await cache_rows(db)) == 2


async def test_a_paraphrase_is_served_from_the_semantic_cache(
    fake: tuple[FakeProvider, str], database_dsn: str, db: asyncpg.Connection
) -> None:
    fake[0].semantic_embeddings = True
    policy = {**GENEROUS, "cache": SEMANTIC}
    async with stack_for(fake, database_dsn, policy) as stack:
        client = stack.openai()
        first = await client.chat.completions.with_raw_response.create(
            model="gpt-4o", messages=QUESTION, max_tokens=50, temperature=0
        )
        assert first.headers["llmquota-serving-path"] == "primary"
        await entries(db, 1)
        hit = await client.chat.completions.with_raw_response.create(
            model="gpt-4o", messages=PARAPHRASE, max_tokens=50, temperature=0
        )
        assert hit.headers["llmquota-serving-path"] == "cache"
        assert 0.85 <= float(hit.headers["llmquota-cache-similarity"]) < 1.0
        miss = await client.chat.completions.with_raw_response.create(
            model="gpt-4o", messages=UNRELATED, max_tokens=50, temperature=0
        )
        assert miss.headers["llmquota-serving-path"] == "primary"
        # The provider: 2 completions and 3 embeddings (each lookup's last turn).
        called = [r.get("messages") is not None for r in stack.fake.requests]
        assert called.count(True) == 2 and called.count(False) == 3
        # Each embedding is the tenant's own request, admitted and settled.
        embeddings = await db.fetch(
            "SELECT input_tokens FROM usage_ledger"
            " WHERE model = 'text-embedding-3-small' AND tenant = 'acme'"
        )
        assert [r["input_tokens"] for r in embeddings] == [PROMPT_TOKENS] * 3
        assert len(await cache_rows(db)) == 1


async def test_a_bad_cache_policy_is_refused_before_anything_is_stored(cached: Stack) -> None:
    for bad in ({"mode": "semantic"}, {"mode": "exact", "similarity": 2}, {"mode": "nope"}):
        answer = await cached.admin.put("/v1/tenants/acme/policy", json={**GENEROUS, "cache": bad})
        assert answer.status_code == 422, answer.text
    stored = await cached.admin.get("/v1/tenants/acme/policy")
    assert stored.json()["cache"]["mode"] == "exact"


async def test_the_sweeper_deletes_expired_entries(
    cached: Stack, db: asyncpg.Connection, app_dsn: str
) -> None:
    await ask_and_store(cached.openai(), db)
    await db.execute("UPDATE response_cache SET expires_at = clock_timestamp()")
    limiter = await Limiter.connect(app_dsn)
    try:
        report = await limiter.sweep()
    finally:
        await limiter.close()
    assert report.cache_entries_expired == 1
    assert await db.fetchval("SELECT count(*) FROM response_cache") == 0


async def test_a_key_never_gets_a_cached_answer_of_a_model_it_may_not_use(
    cached: Stack, db: asyncpg.Connection
) -> None:
    await ask_and_store(cached.openai(), db)
    created = await cached.admin.post("/v1/tenants/acme/keys", json={"models": ["gpt-4o-mini"]})
    assert created.status_code == 201, created.text
    limited = cached.openai(api_key=created.json()["key"])
    with pytest.raises(openai.PermissionDeniedError) as denied:
        await limited.chat.completions.create(
            model="gpt-4o", messages=QUESTION, max_tokens=50, temperature=0
        )
    assert denied.value.status_code == 403
    assert await cache_rows(db) == []
