"""The official openai SDK, unmodified, through llmquota's proxy to a fake provider.

Every test ends on the ledger: one usage row per admitted request, with the
figures the fake provider reported, and no row for a released one.
"""

from __future__ import annotations

import asyncio

import asyncpg
import openai
import pytest

from llmquota.domain.tokens import count_messages, count_text
from tests.proxy.conftest import Stack, ledger, reservation_states, settled, stack_for
from tests.proxy.fake_provider import PROMPT_TOKENS, PROVIDER_KEY, FakeProvider, completion_tokens

MESSAGES = [{"role": "user", "content": "Say something short."}]


async def test_completion_passes_the_body_through_and_settles_the_provider_usage(
    stack: Stack, db: asyncpg.Connection
) -> None:
    client = stack.openai()
    raw = await client.chat.completions.with_raw_response.create(
        model="gpt-4o", messages=MESSAGES, max_tokens=50
    )
    completion = raw.parse()
    assert completion.choices[0].message.content == " w0 w1 w2 w3 w4 w5"
    assert completion.usage is not None and completion.usage.completion_tokens == 13
    assert raw.headers["x-ratelimit-limit-tokens"] == "600000"
    assert int(raw.headers["x-ratelimit-remaining-tokens"]) < 200_000
    assert raw.headers["x-request-id"] == "req_fake_openai"
    # Upstream saw the provider key, never the tenant's; the body as the client sent it.
    assert stack.fake.headers[0]["authorization"] == f"Bearer {PROVIDER_KEY}"
    assert stack.key not in str(stack.fake.headers[0])
    assert stack.fake.requests[0]["max_tokens"] == 50
    rows = await settled(db, 1)
    assert [(r["input_tokens"], r["output_tokens"], r["outcome"]) for r in rows] == [
        (PROMPT_TOKENS, completion_tokens(6), "ok")
    ]
    assert rows[0]["model"] == "gpt-4o" and rows[0]["tenant"] == "acme"


async def test_stream_without_include_usage_hides_the_usage_chunk_it_asked_for(
    stack: Stack, db: asyncpg.Connection
) -> None:
    stream = await stack.openai().chat.completions.create(
        model="gpt-4o", messages=MESSAGES, max_tokens=50, stream=True
    )
    chunks = [chunk async for chunk in stream]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == " w0 w1 w2 w3 w4 w5"
    assert all(c.choices for c in chunks)  # no usage-only chunk reached the client
    assert all(c.usage is None for c in chunks)
    assert stack.fake.requests[0]["stream_options"] == {"include_usage": True}
    rows = await settled(db, 1)
    assert [(r["input_tokens"], r["output_tokens"]) for r in rows] == [(PROMPT_TOKENS, 13)]


async def test_stream_with_include_usage_gets_the_usage_chunk(
    stack: Stack, db: asyncpg.Connection
) -> None:
    stream = await stack.openai().chat.completions.create(
        model="gpt-4o",
        messages=MESSAGES,
        max_tokens=50,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = [chunk async for chunk in stream]
    assert chunks[-1].choices == []
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 13
    rows = await settled(db, 1)
    assert [(r["input_tokens"], r["output_tokens"]) for r in rows] == [(PROMPT_TOKENS, 13)]


async def test_a_refusal_is_the_sdks_rate_limit_error_with_openai_headers(
    fake: tuple[FakeProvider, str], database_dsn: str, db: asyncpg.Connection
) -> None:
    policy = {"requests_per_minute": 1, "request_burst": 1}
    async with stack_for(fake, database_dsn, policy) as stack:
        client = stack.openai()
        await client.chat.completions.create(model="gpt-4o", messages=MESSAGES, max_tokens=5)
        with pytest.raises(openai.RateLimitError) as refused:
            await client.chat.completions.create(model="gpt-4o", messages=MESSAGES, max_tokens=5)
        headers = refused.value.response.headers
        assert 1_000 <= int(headers["retry-after-ms"]) <= 60_000
        assert int(headers["retry-after"]) >= 1
        assert headers["x-ratelimit-remaining-requests"] == "0"
        error = refused.value.body
        assert isinstance(error, dict) and error["code"] == "rate_limit_exceeded"
        assert error["type"] == "requests"
        assert len(stack.fake.requests) == 1  # the refused one never left
        rows = await settled(db, 1)
        assert [(r["input_tokens"], r["output_tokens"]) for r in rows] == [(PROMPT_TOKENS, 13)]
        assert await db.fetchval("SELECT count(*) FROM reservations") == 1


async def test_the_sdk_retries_after_retry_after_ms(
    fake: tuple[FakeProvider, str], database_dsn: str, db: asyncpg.Connection
) -> None:
    # 120 requests a minute: the second waits ~500 ms, which the SDK reads from retry-after-ms.
    policy = {"requests_per_minute": 120, "request_burst": 1}
    async with stack_for(fake, database_dsn, policy) as stack:
        client = stack.openai(max_retries=2)
        await client.chat.completions.create(model="gpt-4o", messages=MESSAGES, max_tokens=5)
        started = asyncio.get_running_loop().time()
        await client.chat.completions.create(model="gpt-4o", messages=MESSAGES, max_tokens=5)
        assert asyncio.get_running_loop().time() - started >= 0.3
        rows = await settled(db, 2)
        assert [r["output_tokens"] for r in rows] == [13, 13]
        assert len(stack.fake.requests) == 2


async def test_a_client_that_stops_reading_is_drained_to_the_providers_usage(
    stack: Stack, db: asyncpg.Connection
) -> None:
    stack.fake.words, stack.fake.delay = 30, 0.03
    stream = await stack.openai().chat.completions.create(
        model="gpt-4o", messages=MESSAGES, max_tokens=100, stream=True
    )
    seen = 0
    async for _chunk in stream:
        seen += 1
        if seen == 3:
            break
    await stream.close()
    rows = await settled(db, 1)
    assert stack.fake.streams_finished == 1
    assert [(r["input_tokens"], r["output_tokens"], r["outcome"]) for r in rows] == [
        (PROMPT_TOKENS, completion_tokens(30), "ok")
    ]


async def test_a_long_stream_renews_its_lease(stack: Stack, db: asyncpg.Connection) -> None:
    stack.fake.words, stack.fake.delay = 10, 0.1  # a second; heartbeats every 0.2 s
    stream = await stack.openai().chat.completions.create(
        model="gpt-4o", messages=MESSAGES, max_tokens=100, stream=True
    )
    assert len([chunk async for chunk in stream]) == 12
    rows = await settled(db, 1)
    assert await db.fetchval("SELECT lease_generation FROM reservations") >= 3
    assert [r["output_tokens"] for r in rows] == [completion_tokens(10)]


async def test_upstream_500_charges_nothing_and_shows_no_provider_key(
    stack: Stack, db: asyncpg.Connection
) -> None:
    stack.fake.scenario = "500"
    with pytest.raises(openai.InternalServerError) as failed:
        await stack.openai().chat.completions.create(
            model="gpt-4o", messages=MESSAGES, max_tokens=5
        )
    assert PROVIDER_KEY not in failed.value.response.text
    assert await ledger(db) == []
    assert await reservation_states(db) == ["released"]


async def test_upstream_429_passes_through_with_its_headers(
    stack: Stack, db: asyncpg.Connection
) -> None:
    stack.fake.scenario = "429"
    with pytest.raises(openai.RateLimitError) as limited:
        await stack.openai().chat.completions.create(
            model="gpt-4o", messages=MESSAGES, max_tokens=5, stream=True
        )
    headers = limited.value.response.headers
    assert headers["retry-after"] == "7"
    assert headers["x-ratelimit-remaining-requests"] == "0"
    assert limited.value.message.endswith("provider says slow down")
    assert await ledger(db) == []
    assert await reservation_states(db) == ["released"]


async def test_upstream_refusing_our_key_is_a_gateway_error_without_the_key(
    stack: Stack, db: asyncpg.Connection
) -> None:
    stack.fake.scenario = "401"
    with pytest.raises(openai.APIStatusError) as failed:
        await stack.openai().chat.completions.create(
            model="gpt-4o", messages=MESSAGES, max_tokens=5
        )
    assert failed.value.status_code == 502
    assert PROVIDER_KEY not in failed.value.response.text
    assert await ledger(db) == []


async def test_an_error_mid_stream_settles_what_was_produced(
    stack: Stack, db: asyncpg.Connection
) -> None:
    stack.fake.scenario, stack.fake.words = "die_mid_stream", 10
    stream = await stack.openai().chat.completions.create(
        model="gpt-4o", messages=MESSAGES, max_tokens=100, stream=True
    )
    with pytest.raises(openai.APIError):  # the SDK sees the stream cut short
        async for _chunk in stream:
            pass
    rows = await settled(db, 1)
    assert len(rows) == 1 and rows[0]["outcome"] == "error"
    # Five words came out (" w0".." w4"), counted by tiktoken; the input is llmquota's count.
    assert rows[0]["output_tokens"] == count_text(" w0 w1 w2 w3 w4", "gpt-4o").tokens


async def test_legacy_completions_and_their_stream(stack: Stack, db: asyncpg.Connection) -> None:
    client = stack.openai()
    completion = await client.completions.create(model="gpt-3.5-turbo-instruct", prompt="Hi")
    assert completion.choices[0].text == " w0 w1 w2 w3 w4 w5"
    stream = await client.completions.create(
        model="gpt-3.5-turbo-instruct", prompt=["Hi", "there"], max_tokens=30, stream=True
    )
    chunks = [chunk async for chunk in stream]
    assert "".join(c.choices[0].text for c in chunks) == " w0 w1 w2 w3 w4 w5"
    rows = await settled(db, 2)
    assert [(r["input_tokens"], r["output_tokens"]) for r in rows] == [(PROMPT_TOKENS, 13)] * 2
    # Without max_tokens the provider writes at most 16 tokens, so 16 were reserved.
    reserved = await db.fetchval(
        "SELECT reserved_tokens FROM usage_ledger ORDER BY entry_id LIMIT 1"
    )
    hi = [{"role": "user", "content": "Hi"}]
    assert reserved == 16 + count_messages(hi, "gpt-3.5-turbo-instruct").tokens


async def test_embeddings_reserve_input_only_and_settle_the_providers_count(
    stack: Stack, db: asyncpg.Connection
) -> None:
    client = stack.openai()
    embedded = await client.embeddings.create(
        model="text-embedding-3-small", input=["one text", "another"]
    )
    assert [d.embedding for d in embedded.data] == [[0.25, 0.5, 0.75]] * 2
    by_ids = await client.embeddings.create(model="text-embedding-3-small", input=[1, 2, 3, 4])
    assert by_ids.usage.prompt_tokens == PROMPT_TOKENS
    rows = await settled(db, 2)
    assert [(r["input_tokens"], r["output_tokens"]) for r in rows] == [(PROMPT_TOKENS, 0)] * 2
    reserved = await db.fetch("SELECT reserved_tokens FROM usage_ledger ORDER BY entry_id")
    assert reserved[1]["reserved_tokens"] == 4  # four token ids, nothing for output


async def test_a_lease_shorter_than_the_heartbeat_setting_is_renewed_in_time(
    fake: tuple[FakeProvider, str], database_dsn: str, db: asyncpg.Connection
) -> None:
    policy = {"max_in_flight": 2, "lease_seconds": 1}
    async with stack_for(fake, database_dsn, policy, proxy_heartbeat_seconds=20) as stack:
        stack.fake.words, stack.fake.delay = 25, 0.1  # 2.5 s of a 1 s lease
        stream = await stack.openai().chat.completions.create(
            model="gpt-4o", messages=MESSAGES, max_tokens=100, stream=True
        )
        assert len([chunk async for chunk in stream]) == 27
        rows = await settled(db, 1)
        assert [(r["output_tokens"], r["outcome"]) for r in rows] == [(completion_tokens(25), "ok")]
        assert await db.fetchval("SELECT count(*) FROM usage_ledger") == 1  # no expired/late
        assert await reservation_states(db) == ["settled"]
