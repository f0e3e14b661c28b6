"""The edges of proxy mode in the providers' own terms: refusals made before any
route runs (a body too large, a full fair-share queue) in the provider's error
format, the OpenAI stream exactly as the client asked for it, images, audio and
documents priced instead of refused, and `n` completions reserved; through the
official SDKs or raw HTTP over sockets, each test ending on the ledger."""

from __future__ import annotations

import asyncio
import base64
import json
import struct
from collections.abc import AsyncIterator
from typing import Any

import anthropic
import asyncpg
import openai
import pytest

from llmquota.domain.tokens import count_messages
from tests.proxy.conftest import GENEROUS, Stack, ledger, settled, stack_for
from tests.proxy.fake_provider import PROMPT_TOKENS, FakeProvider, completion_tokens

MESSAGES = [{"role": "user", "content": "Say something short."}]


def auth(stack: Stack) -> dict[str, str]:
    return {"authorization": f"Bearer {stack.key}"}


async def test_a_body_over_the_limit_is_the_providers_413_and_rest_keeps_its_shape(
    fake: tuple[FakeProvider, str], database_dsn: str, db: asyncpg.Connection
) -> None:
    big = [{"role": "user", "content": "x" * 4_000}]
    async with stack_for(fake, database_dsn, GENEROUS, max_body_bytes=2_048) as stack:
        with pytest.raises(openai.APIStatusError) as too_big:
            await stack.openai(max_retries=2).chat.completions.create(
                model="gpt-4o", messages=big, max_tokens=5
            )
        with pytest.raises(anthropic.APIStatusError) as too_big_claude:
            await stack.anthropic(max_retries=2).messages.create(
                model="claude-sonnet-4", messages=big, max_tokens=5
            )

        async def chunked() -> AsyncIterator[bytes]:  # no Content-Length: cut off as it streams
            for _ in range(5):
                yield b" " * 1_000

        streamed = await stack.admin.post("/v1/messages", content=chunked(), headers=auth(stack))
        rest = await stack.admin.post("/v1/admit", content=b" " * 4_000, headers=auth(stack))
    assert too_big.value.status_code == too_big_claude.value.status_code == 413
    assert too_big.value.response.headers["x-should-retry"] == "false"
    assert too_big.value.body == {
        "message": "request body exceeds 2048 bytes",
        "type": "invalid_request_error",
        "param": None,
        "code": "request_too_large",
    }
    assert too_big_claude.value.body == {
        "type": "error",
        "error": {"type": "request_too_large", "message": "request body exceeds 2048 bytes"},
    }
    assert streamed.status_code == 413 and streamed.json()["type"] == "error"
    assert streamed.json()["error"]["type"] == "request_too_large"
    assert streamed.headers["x-should-retry"] == "false"
    assert rest.status_code == 413 and rest.json()["error"]["type"] == "payload_too_large"
    assert "request_id" in rest.json()  # llmquota's own shape, unchanged
    assert stack.fake.requests == [] and await ledger(db) == []
    assert await db.fetchval("SELECT count(*) FROM reservations") == 0


async def test_a_full_fair_share_queue_is_the_providers_429_and_rest_keeps_its_shape(
    fake: tuple[FakeProvider, str], database_dsn: str, db: asyncpg.Connection
) -> None:
    lanes = {"tenant_max_in_progress": 1, "tenant_max_queued": 0}
    async with stack_for(fake, database_dsn, GENEROUS, **lanes) as stack:
        client = stack.openai()
        await client.chat.completions.create(model="gpt-4o", messages=MESSAGES, max_tokens=5)
        release = asyncio.Event()

        async def slow_body() -> AsyncIterator[bytes]:  # holds the tenant's one place
            yield b'{"model": "gpt-4o", "max_tokens": 5, '
            await release.wait()
            yield json.dumps({"messages": MESSAGES}).encode()[1:]

        held = asyncio.ensure_future(
            stack.admin.post("/v1/chat/completions", content=slow_body(), headers=auth(stack))
        )
        await asyncio.sleep(0.3)
        with pytest.raises(openai.RateLimitError) as queued:
            await client.chat.completions.create(model="gpt-4o", messages=MESSAGES, max_tokens=5)
        with pytest.raises(anthropic.RateLimitError) as queued_claude:
            await stack.anthropic().messages.create(
                model="claude-sonnet-4", messages=MESSAGES, max_tokens=5
            )
        rest = await stack.admin.get("/v1/tenants/acme/status", headers=auth(stack))
        release.set()
        assert (await held).status_code == 200
    error = queued.value.body
    assert isinstance(error, dict) and error["code"] == "rate_limit_exceeded"
    assert error["type"] == "concurrency" and "queued" in error["message"]
    assert queued.value.response.headers["retry-after-ms"] == "100"
    assert queued.value.response.headers["retry-after"] == "1"
    claude_error = queued_claude.value.body
    assert isinstance(claude_error, dict) and claude_error["type"] == "error"
    assert claude_error["error"]["type"] == "rate_limit_error"
    assert queued_claude.value.response.headers["retry-after"] == "1"
    assert rest.status_code == 429 and rest.json()["error"]["limit"] == "concurrency"
    rows = await settled(db, 2)
    assert [(r["input_tokens"], r["output_tokens"]) for r in rows] == [(PROMPT_TOKENS, 13)] * 2
    assert len(stack.fake.requests) == 2  # the refused ones never left


async def sse_data(stack: Stack, body: dict[str, Any]) -> list[bytes]:
    """The `data:` payloads of a streamed answer, as they came over the socket."""
    payloads: list[bytes] = []
    async with stack.admin.stream(
        "POST", "/v1/chat/completions", json=body, headers=auth(stack)
    ) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                payloads.append(line[6:].encode())
    return payloads


async def test_an_openai_stream_is_what_the_client_asked_for(
    stack: Stack, db: asyncpg.Connection
) -> None:
    body = {"model": "gpt-4o", "messages": MESSAGES, "max_tokens": 50, "stream": True}
    # Not asked: no usage chunk, and no `"usage": null` on the chunks either.
    hidden = await sse_data(stack, body)
    assert hidden[-1] == b"[DONE]"
    chunks = [json.loads(p) for p in hidden[:-1]]
    assert len(chunks) == 8 and all("usage" not in c for c in chunks)
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == (
        " w0 w1 w2 w3 w4 w5"
    )
    # Asked: every byte as the provider sent it, `"usage": null` and the usage chunk included.
    asked = await sse_data(stack, {**body, "stream_options": {"include_usage": True}})
    assert all(b'"usage": null' in p for p in asked[:-2])
    assert json.loads(asked[-2])["usage"]["completion_tokens"] == 13
    assert json.loads(asked[-2])["choices"] == []
    assert stack.fake.requests[0]["stream_options"] == {"include_usage": True}
    rows = await settled(db, 2)
    assert [(r["input_tokens"], r["output_tokens"]) for r in rows] == [(PROMPT_TOKENS, 13)] * 2


def png(width: int, height: int) -> str:
    header = struct.pack(">II", width, height) + b"\x08\x02\x00\x00\x00"
    raw = b"\x89PNG\r\n\x1a\n" + struct.pack(">I", 13) + b"IHDR" + header + b"\x00" * 64
    return base64.b64encode(raw).decode()


def wav(seconds: float, rate: int = 8_000) -> str:
    data = b"\x00\x00" * int(rate * seconds)
    fmt = struct.pack("<HHIIHH", 1, 1, rate, rate * 2, 2, 16)
    riff = b"RIFF" + struct.pack("<I", 36 + len(data)) + b"WAVE" + b"fmt " + struct.pack("<I", 16)
    return base64.b64encode(riff + fmt + b"data" + struct.pack("<I", len(data)) + data).decode()


PDF = base64.b64encode(b"%PDF-1.7\n1 0 obj <</Type /Page>>\n2 0 obj <</Type /Page>>").decode()


async def test_images_audio_and_documents_are_priced_not_refused(
    stack: Stack, db: asyncpg.Connection
) -> None:
    question = {"type": "text", "text": "What is in these?"}
    big_image = {"url": f"data:image/png;base64,{png(1024, 1024)}"}
    low_image = {"url": "https://example.com/a.png", "detail": "low"}
    openai_messages: Any = [
        {
            "role": "user",
            "content": [
                question,
                {"type": "image_url", "image_url": big_image},
                {"type": "image_url", "image_url": low_image},
                {"type": "input_audio", "input_audio": {"data": wav(3.0), "format": "wav"}},
            ],
        }
    ]
    completion = await stack.openai().chat.completions.create(
        model="gpt-4o", messages=openai_messages, max_tokens=40
    )
    assert completion.choices[0].message.content == " w0 w1 w2 w3 w4 w5"
    image = {"type": "base64", "media_type": "image/png", "data": png(200, 200)}
    document = {"type": "base64", "media_type": "application/pdf", "data": PDF}
    claude_messages: Any = [
        {
            "role": "user",
            "content": [
                {"type": "image", "source": image},
                {"type": "document", "source": document},
                question,
            ],
        }
    ]
    message = await stack.anthropic().messages.create(
        model="claude-sonnet-4", messages=claude_messages, max_tokens=40
    )
    assert message.usage.output_tokens == 13
    # Through the REST API too: an image is no longer a 422.
    admitted = await stack.admin.post(
        "/v1/admit",
        json={"tenant": "acme", "model": "gpt-4o", "messages": openai_messages, "max_tokens": 1},
    )
    assert admitted.status_code == 201, admitted.text
    released = await stack.admin.post(
        f"/v1/reservations/{admitted.json()['reservation_id']}/release"
    )
    assert released.is_success
    rows = await settled(db, 2)
    assert [(r["input_tokens"], r["output_tokens"]) for r in rows] == [(PROMPT_TOKENS, 13)] * 2
    reserved = await db.fetch(
        "SELECT input_tokens, input_estimated, state FROM reservations ORDER BY created_at"
    )
    text = count_messages([{"role": "user", "content": "What is in these?"}], "gpt-4o").tokens
    # 765 for the 1024-px image (4 tiles), 85 at low detail, 30 for three seconds of audio.
    assert reserved[0]["input_tokens"] == text + 765 + 85 + 30
    claude_text = count_messages(
        [{"role": "user", "content": ["What is in these?"]}], "claude-sonnet-4"
    )
    # 54 for 200x200 px; a two-page PDF, each page 3,000 text and 1,600 image tokens.
    assert reserved[1]["input_tokens"] == claude_text.tokens + 54 + 2 * 4_600
    assert [r["input_estimated"] for r in reserved] == [True, True, True]
    assert [r["state"] for r in reserved] == ["settled", "settled", "released"]


async def test_n_completions_are_reserved_n_times(stack: Stack, db: asyncpg.Connection) -> None:
    client = stack.openai()
    await client.chat.completions.create(model="gpt-4o", messages=MESSAGES, max_tokens=10, n=3)
    await client.chat.completions.create(
        model="gpt-4o", messages=MESSAGES, max_completion_tokens=10, n=2, stream=True
    )
    with pytest.raises(openai.BadRequestError) as refused:
        await client.chat.completions.create(
            model="gpt-4o",
            messages=MESSAGES,
            max_tokens=10,
            stream="yes",  # type: ignore[call-overload]
        )
    assert isinstance(refused.value.body, dict) and refused.value.body["param"] == "stream"
    rows = await settled(db, 2)
    counted = count_messages(MESSAGES, "gpt-4o").tokens
    reserved = [r["reserved_tokens"] for r in await db.fetch(
        "SELECT reserved_tokens FROM usage_ledger ORDER BY entry_id"
    )]  # fmt: skip
    assert reserved == [counted + 30, counted + 20]
    assert [(r["input_tokens"], r["output_tokens"]) for r in rows] == [
        (PROMPT_TOKENS, completion_tokens(6))
    ] * 2
    assert len(stack.fake.requests) == 2


async def test_a_wrong_key_is_refused_in_the_providers_format_also_when_remembered(
    stack: Stack, db: asyncpg.Connection
) -> None:
    wrong = "lq_not_a_key_of_anyone_0123456789"
    # The first answer comes from the route's lookup, the repeats from the middleware's
    # memory of the wrong key (the negative cache), before the body is read: alike.
    for _ in range(3):
        with pytest.raises(openai.AuthenticationError) as refused:
            await stack.openai(api_key=wrong).chat.completions.create(
                model="gpt-4o", messages=MESSAGES, max_tokens=5
            )
        assert isinstance(refused.value.body, dict)
        assert refused.value.body["code"] == "invalid_api_key"
        with pytest.raises(anthropic.AuthenticationError) as refused_claude:
            await stack.anthropic(api_key=wrong).messages.create(
                model="claude-sonnet-4", messages=MESSAGES, max_tokens=5
            )
        assert isinstance(refused_claude.value.body, dict)
        assert refused_claude.value.body["error"]["type"] == "authentication_error"
    rest = await stack.admin.get(
        "/v1/tenants/acme/status", headers={"authorization": f"Bearer {wrong}"}
    )
    assert rest.status_code == 401 and "request_id" in rest.json()
    assert stack.fake.requests == [] and await ledger(db) == []
    assert await db.fetchval("SELECT count(*) FROM reservations") == 0
