"""The official anthropic SDK, unmodified, through llmquota's proxy to a fake provider.

Every test ends on the ledger: one usage row per admitted request, with the
figures the fake provider reported, and no row for a released one.
"""

from __future__ import annotations

import anthropic
import asyncpg
import pytest

from llmquota.domain.tokens import count_text
from tests.proxy.conftest import Stack, ledger, reservation_states, settled, stack_for
from tests.proxy.fake_provider import PROMPT_TOKENS, PROVIDER_KEY, FakeProvider, completion_tokens

MESSAGES: list[anthropic.types.MessageParam] = [{"role": "user", "content": "Say something."}]
MODEL = "claude-sonnet-4-5"


async def test_message_passes_through_and_settles_the_provider_usage(
    stack: Stack, db: asyncpg.Connection
) -> None:
    raw = await stack.anthropic().messages.with_raw_response.create(
        model=MODEL, messages=MESSAGES, max_tokens=64, system="Be brief."
    )
    message = await raw.parse()
    assert message.content[0].type == "text"
    assert message.content[0].text == " w0 w1 w2 w3 w4 w5"
    assert message.usage.output_tokens == 13
    assert raw.headers["anthropic-ratelimit-tokens-limit"] == "600000"
    assert raw.headers["anthropic-ratelimit-tokens-reset"].endswith("Z")
    assert raw.headers["request-id"] == "req_fake_anthropic"
    upstream = stack.fake.headers[0]
    assert upstream["x-api-key"] == PROVIDER_KEY
    assert upstream["anthropic-version"]  # the SDK's own, forwarded
    assert stack.key not in str(upstream)
    rows = await settled(db, 1)
    assert [(r["input_tokens"], r["output_tokens"], r["outcome"]) for r in rows] == [
        (PROMPT_TOKENS, completion_tokens(6), "ok")
    ]


async def test_stream_relays_every_event_and_settles_message_delta_usage(
    stack: Stack, db: asyncpg.Connection
) -> None:
    async with stack.anthropic().messages.stream(
        model=MODEL, messages=MESSAGES, max_tokens=64
    ) as stream:
        text = "".join([piece async for piece in stream.text_stream])
        final = await stream.get_final_message()
    assert text == " w0 w1 w2 w3 w4 w5"
    assert final.usage.input_tokens == PROMPT_TOKENS and final.usage.output_tokens == 13
    rows = await settled(db, 1)
    assert [(r["input_tokens"], r["output_tokens"]) for r in rows] == [(PROMPT_TOKENS, 13)]


async def test_a_refusal_is_the_sdks_rate_limit_error_with_anthropic_headers(
    fake: tuple[FakeProvider, str], database_dsn: str, db: asyncpg.Connection
) -> None:
    policy = {"requests_per_minute": 1, "request_burst": 1}
    async with stack_for(fake, database_dsn, policy) as stack:
        client = stack.anthropic()
        await client.messages.create(model=MODEL, messages=MESSAGES, max_tokens=8)
        with pytest.raises(anthropic.RateLimitError) as refused:
            await client.messages.create(model=MODEL, messages=MESSAGES, max_tokens=8)
        headers = refused.value.response.headers
        assert int(headers["retry-after"]) >= 1
        assert headers["anthropic-ratelimit-requests-remaining"] == "0"
        assert refused.value.body == {
            "type": "error",
            "error": {
                "type": "rate_limit_error",
                "message": refused.value.body["error"]["message"],
            },  # type: ignore[index]
        }
        assert len(stack.fake.requests) == 1
        rows = await settled(db, 1)
        assert [(r["input_tokens"], r["output_tokens"]) for r in rows] == [(PROMPT_TOKENS, 13)]


async def test_a_client_that_stops_reading_is_drained_to_the_providers_usage(
    stack: Stack, db: asyncpg.Connection
) -> None:
    stack.fake.words, stack.fake.delay = 30, 0.03
    stream = await stack.anthropic().messages.create(
        model=MODEL, messages=MESSAGES, max_tokens=200, stream=True
    )
    seen = 0
    async for _event in stream:
        seen += 1
        if seen == 4:
            break
    await stream.close()
    rows = await settled(db, 1)
    assert stack.fake.streams_finished == 1
    assert [(r["input_tokens"], r["output_tokens"], r["outcome"]) for r in rows] == [
        (PROMPT_TOKENS, completion_tokens(30), "ok")
    ]


async def test_upstream_500_charges_nothing(stack: Stack, db: asyncpg.Connection) -> None:
    stack.fake.scenario = "500"
    with pytest.raises(anthropic.InternalServerError) as failed:
        await stack.anthropic().messages.create(
            model=MODEL, messages=MESSAGES, max_tokens=8, stream=True
        )
    assert PROVIDER_KEY not in failed.value.response.text
    assert await ledger(db) == []
    assert await reservation_states(db) == ["released"]


async def test_upstream_429_passes_through_with_its_headers(
    stack: Stack, db: asyncpg.Connection
) -> None:
    stack.fake.scenario = "429"
    with pytest.raises(anthropic.RateLimitError) as limited:
        await stack.anthropic().messages.create(model=MODEL, messages=MESSAGES, max_tokens=8)
    assert limited.value.response.headers["retry-after"] == "7"
    assert limited.value.response.headers["anthropic-ratelimit-requests-remaining"] == "0"
    assert await ledger(db) == []
    assert await reservation_states(db) == ["released"]


async def test_an_error_mid_stream_settles_what_was_produced(
    stack: Stack, db: asyncpg.Connection
) -> None:
    stack.fake.scenario, stack.fake.words = "die_mid_stream", 10
    stream = await stack.anthropic().messages.create(
        model=MODEL, messages=MESSAGES, max_tokens=100, stream=True
    )
    with pytest.raises(anthropic.APIStatusError):  # the SDK raises on the error event
        async for _event in stream:
            pass
    rows = await settled(db, 1)
    assert len(rows) == 1 and rows[0]["outcome"] == "error"
    assert rows[0]["input_tokens"] == PROMPT_TOKENS  # message_start's figure
    # The five words that came out (" w0".." w4"), counted as admission counts a claude model.
    assert rows[0]["output_tokens"] == count_text(" w0 w1 w2 w3 w4", MODEL).tokens


async def test_an_upstream_timeout_releases_and_is_a_504_in_anthropic_format(
    fake: tuple[FakeProvider, str], database_dsn: str, db: asyncpg.Connection
) -> None:
    policy = {"max_in_flight": 2}
    async with stack_for(fake, database_dsn, policy, proxy_read_timeout_seconds=0.3) as stack:
        stack.fake.scenario = "hang"
        for stream in (False, True):
            with pytest.raises(anthropic.APIStatusError) as failed:
                await stack.anthropic().messages.create(
                    model=MODEL, messages=MESSAGES, max_tokens=8, stream=stream
                )
            assert failed.value.status_code == 504
            assert failed.value.body["error"]["type"] == "api_error"  # type: ignore[index]
        assert await ledger(db) == []
        assert await reservation_states(db) == ["released", "released"]
