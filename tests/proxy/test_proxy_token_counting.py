"""Proxy mode: X-TokenLimit-* beside the provider's rate-limit headers, and Anthropic's
POST /v1/messages/count_tokens through the official anthropic SDK
(`client.messages.count_tokens`), answered here or by the upstream.
"""

from __future__ import annotations

import math
import time

import anthropic
import asyncpg
import pytest

from tests.proxy.conftest import GENEROUS, Stack, reservation_states, settled, stack_for
from tests.proxy.fake_provider import PROMPT_TOKENS, PROVIDER_KEY, FakeProvider

MESSAGES: list[anthropic.types.MessageParam] = [
    {"role": "user", "content": "Count the words of this sentence, then say them back."}
]
MODEL = "claude-sonnet-4-5"
TOOLS: list[anthropic.types.ToolParam] = [
    {
        "name": "lookup",
        "description": "Look a word up in the dictionary.",
        "input_schema": {"type": "object", "properties": {"word": {"type": "string"}}},
    }
]


async def _reservations(db: asyncpg.Connection) -> list[asyncpg.Record]:
    return list(
        await db.fetch(
            "SELECT input_tokens, input_estimated, reserved_tokens FROM reservations"
            " ORDER BY created_at"
        )
    )


async def test_admitted_answers_carry_the_binding_layers_token_headers(
    stack: Stack, db: asyncpg.Connection
) -> None:
    burst, per_minute = GENEROUS["token_burst"], GENEROUS["tokens_per_minute"]
    raw = await stack.anthropic().messages.with_raw_response.create(
        model=MODEL, messages=MESSAGES, max_tokens=64
    )
    await raw.parse()
    [held] = await _reservations(db)
    # A full bucket less the reservation, at the moment of the decision.
    reserved = held["reserved_tokens"]
    assert raw.headers["x-tokenlimit-limit"] == str(burst)
    assert raw.headers["x-tokenlimit-remaining"] == str(burst - reserved)
    assert raw.headers["x-tokenlimit-reset"] == str(math.ceil(reserved * 60 / per_minute))
    assert raw.headers["anthropic-ratelimit-tokens-limit"] == str(per_minute)  # still there
    await settled(db, 1)

    chat = await stack.openai().chat.completions.with_raw_response.create(
        model="gpt-4o", messages=[{"role": "user", "content": "Hello"}], max_tokens=32
    )
    chat.parse()
    assert chat.headers["x-tokenlimit-limit"] == str(burst)
    assert int(chat.headers["x-tokenlimit-remaining"]) <= burst - 32
    assert chat.headers["x-ratelimit-limit-tokens"] == str(per_minute)
    await settled(db, 2)


async def test_a_refusal_carries_them_with_the_refusing_layers_figures(
    fake: tuple[FakeProvider, str], database_dsn: str, db: asyncpg.Connection
) -> None:
    # One token a second, burst 1,000; the first answer reports 597 tokens used,
    # so the second request (about 600) does not fit in what is left.
    policy = {"tokens_per_minute": 60, "token_burst": 1_000}
    async with stack_for(fake, database_dsn, policy) as stack:
        stack.fake.usage = {"output_tokens": 580}
        client = stack.anthropic()
        started = time.monotonic()
        await client.messages.create(model=MODEL, messages=MESSAGES, max_tokens=580)
        await settled(db, 1)
        left = await db.fetchval(
            "SELECT tokens FROM limit_layers WHERE scope = 'tenant' AND tenant = 'acme'"
        )
        with pytest.raises(anthropic.RateLimitError) as refused:
            await client.messages.create(model=MODEL, messages=MESSAGES, max_tokens=580)
        elapsed = time.monotonic() - started
        # The balance the refusal saw: what the settlement left, refilled at one
        # token a second for at most the time the test took.
        assert 0 <= 1_000 - PROMPT_TOKENS - 580 <= left  # charged, and a little refill
        headers = refused.value.response.headers
        assert headers["x-tokenlimit-limit"] == "1000"
        remaining = int(headers["x-tokenlimit-remaining"])
        assert math.floor(left) <= remaining <= math.floor(left + elapsed)
        reset = int(headers["x-tokenlimit-reset"])
        assert math.ceil(1_000 - left - elapsed) <= reset <= math.ceil(1_000 - left)
        assert int(headers["retry-after"]) >= 1
        assert headers["anthropic-ratelimit-tokens-limit"] == "60"
        assert len(stack.fake.requests) == 1


async def test_count_tokens_is_answered_here_as_the_messages_admission_counts(
    stack: Stack, db: asyncpg.Connection
) -> None:
    client = stack.anthropic()
    counted = await client.messages.count_tokens(
        model=MODEL, messages=MESSAGES, system="Be brief.", tools=TOOLS
    )
    assert isinstance(counted, anthropic.types.MessageTokensCount)
    assert counted.input_tokens > 0
    assert counted.input_tokens != PROMPT_TOKENS  # ours, not the provider's
    # Nothing reserved, nothing sent upstream.
    assert await reservation_states(db) == []
    assert stack.fake.requests == []

    await client.messages.create(
        model=MODEL, messages=MESSAGES, system="Be brief.", tools=TOOLS, max_tokens=64
    )
    [held] = await _reservations(db)
    assert held["input_tokens"] == counted.input_tokens
    assert held["reserved_tokens"] == counted.input_tokens + 64
    assert len(stack.fake.requests) == 1
    await settled(db, 1)


async def test_count_tokens_refuses_as_messages_does(stack: Stack) -> None:
    client = stack.anthropic()
    with pytest.raises(anthropic.BadRequestError) as bad:
        await client.messages.count_tokens(model=MODEL, messages="not a list")  # type: ignore[arg-type]
    assert "'messages'" in str(bad.value)
    with pytest.raises(anthropic.AuthenticationError):
        await stack.anthropic(api_key="lq_not_a_key").messages.count_tokens(
            model=MODEL, messages=MESSAGES
        )
    assert stack.fake.requests == []


async def test_count_tokens_goes_upstream_when_configured_so(
    fake: tuple[FakeProvider, str], database_dsn: str, db: asyncpg.Connection
) -> None:
    async with stack_for(fake, database_dsn, GENEROUS, proxy_count_tokens="upstream") as stack:
        raw = await stack.anthropic().messages.with_raw_response.count_tokens(
            model=MODEL, messages=MESSAGES, system="Be brief."
        )
        counted = await raw.parse()
        assert counted.input_tokens == PROMPT_TOKENS  # the provider's own figure
        assert raw.headers["request-id"] == "req_fake_count"
        [body] = stack.fake.requests
        assert body["model"] == MODEL and body["system"] == "Be brief."
        upstream = stack.fake.headers[0]
        assert upstream["x-api-key"] == PROVIDER_KEY
        assert stack.key not in str(upstream)
        assert await reservation_states(db) == []

        stack.fake.scenario = "500"
        with pytest.raises(anthropic.InternalServerError) as failed:
            await stack.anthropic().messages.count_tokens(model=MODEL, messages=MESSAGES)
        assert PROVIDER_KEY not in failed.value.response.text
        assert await reservation_states(db) == []


async def test_a_count_past_the_body_limit_is_anthropics_413(
    fake: tuple[FakeProvider, str], database_dsn: str
) -> None:
    big: list[anthropic.types.MessageParam] = [{"role": "user", "content": "x" * 4_000}]
    async with stack_for(fake, database_dsn, GENEROUS, max_body_bytes=2_048) as stack:
        with pytest.raises(anthropic.APIStatusError) as too_big:
            await stack.anthropic(max_retries=2).messages.count_tokens(model=MODEL, messages=big)
        assert too_big.value.status_code == 413
        assert too_big.value.body == {
            "type": "error",
            "error": {"type": "request_too_large", "message": "request body exceeds 2048 bytes"},
        }
        assert stack.fake.requests == []
