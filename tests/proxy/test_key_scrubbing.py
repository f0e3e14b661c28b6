"""The provider key never reaches a client, whatever the upstream echoes.

The fake provider echoes the key it was called with: plain in a 200's text
(whole and streamed, both wire formats), every character \\u-escaped in a
400's JSON, upper-cased in an OpenAI mid-stream error event, percent-encoded
in an Anthropic one. What the client receives, byte for byte, holds none of
these spellings; the official SDKs see the marker instead.
"""

from __future__ import annotations

import json
from urllib.parse import quote

import anthropic
import openai
import pytest

from tests.proxy.conftest import Stack
from tests.proxy.fake_provider import PROVIDER_KEY

MESSAGES = [{"role": "user", "content": "repeat after me"}]
SPELLINGS = [
    PROVIDER_KEY.encode(),
    PROVIDER_KEY.upper().encode(),
    "".join(f"\\u{ord(c):04x}" for c in PROVIDER_KEY).encode(),
    "".join(f"%{ord(c):02X}" for c in PROVIDER_KEY).encode(),
    quote(PROVIDER_KEY, safe="").encode(),
    json.dumps(PROVIDER_KEY).encode(),
]


def assert_no_key(raw: bytes) -> None:
    for spelling in SPELLINGS:
        assert spelling.lower() not in raw.lower(), spelling
    assert b"[provider key]" in raw


@pytest.mark.parametrize("stream", [False, True])
async def test_an_echoed_key_in_a_200_is_scrubbed_for_openai(stack: Stack, stream: bool) -> None:
    stack.fake.echo = [f" your key is {PROVIDER_KEY}"]
    client = stack.openai()
    raw = await client.chat.completions.with_raw_response.create(
        model="gpt-4o-mini",
        messages=MESSAGES,
        max_tokens=50,
        stream=stream,
    )
    body = await raw.http_response.aread()
    assert_no_key(body)
    assert stack.fake.headers[-1]["authorization"] == f"Bearer {PROVIDER_KEY}"


@pytest.mark.parametrize("stream", [False, True])
async def test_an_echoed_key_in_a_200_is_scrubbed_for_anthropic(stack: Stack, stream: bool) -> None:
    stack.fake.echo = [f" your key is {PROVIDER_KEY}"]
    client = stack.anthropic()
    raw = await client.messages.with_raw_response.create(
        model="claude-3-5-haiku-latest",
        messages=MESSAGES,
        max_tokens=50,
        stream=stream,
    )
    body = await raw.http_response.aread()
    assert_no_key(body)


async def test_a_fully_escaped_key_in_an_error_body_is_scrubbed(stack: Stack) -> None:
    stack.fake.scenario = "400_escaped"
    with pytest.raises(openai.BadRequestError) as raised:
        await stack.openai().chat.completions.create(
            model="gpt-4o-mini",
            messages=MESSAGES,
            max_tokens=50,
        )
    assert_no_key(raised.value.response.content)
    assert PROVIDER_KEY not in str(raised.value)


async def test_an_upper_cased_key_in_an_openai_mid_stream_error_is_scrubbed(stack: Stack) -> None:
    stack.fake.scenario = "key_mid_stream"
    async with stack.openai().chat.completions.with_streaming_response.create(
        model="gpt-4o-mini",
        messages=MESSAGES,
        max_tokens=50,
        stream=True,
    ) as response:
        body = b"".join([chunk async for chunk in response.http_response.aiter_bytes()])
    assert b"upstream failure for KEY" in body
    assert_no_key(body)


async def test_a_url_encoded_key_in_an_anthropic_mid_stream_error_is_scrubbed(
    stack: Stack,
) -> None:
    stack.fake.scenario = "key_mid_stream"
    with pytest.raises(anthropic.APIStatusError) as raised:
        stream = await stack.anthropic().messages.create(
            model="claude-3-5-haiku-latest",
            messages=MESSAGES,
            max_tokens=50,
            stream=True,
        )
        async for _event in stream:
            pass
    assert "overloaded [provider key]" in str(raised.value)
    for spelling in SPELLINGS:
        assert spelling.decode().lower() not in str(raised.value).lower()
