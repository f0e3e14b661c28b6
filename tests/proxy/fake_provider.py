"""A fake LLM provider speaking both wire formats, for the proxy tests.

OpenAI: POST /v1/chat/completions, JSON or SSE (`data: ...` events, the
usage-only chunk when `stream_options.include_usage` is true, `data: [DONE]`).
Anthropic: POST /v1/messages, JSON or SSE (`event:`/`data:` pairs:
message_start, content_block_start, ping, content_block_delta...,
content_block_stop, message_delta with usage, message_stop), and POST
/v1/messages/count_tokens (`{"input_tokens": PROMPT_TOKENS}`). Error bodies and
rate-limit headers are each provider's own. Its usage figures are its own
too, deliberately unlike tiktoken's, so a test can tell whose numbers were
settled. Tests steer it through attributes (scenario, words, delay, and
`usage`: figures to report instead of its own, absurd, a string or negative
as a broken provider would, or `MISSING` to report no usage at all).
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import struct
import sys
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

PROMPT_TOKENS = 17
PROVIDER_KEY = "sk-upstream-secret-0123456789"
# FakeProvider.usage: report no usage object at all.
MISSING = "missing"


EMBEDDING_DIMENSIONS = 512


def bag_of_words(text: str) -> list[float]:
    """A deterministic embedding: each word (lower case, letters and digits) adds
    1 to the dimension its hash picks. Texts sharing most words are close."""
    vector = [0.0] * EMBEDDING_DIMENSIONS
    for word in "".join(c if c.isalnum() else " " for c in text.lower()).split():
        digest = hashlib.sha256(word.encode()).digest()
        vector[int.from_bytes(digest[:4], "big") % EMBEDDING_DIMENSIONS] += 1.0
    return vector


def completion_tokens(words: int) -> int:
    """What the fake reports for `words` words of output (not what tiktoken counts)."""
    return 2 * words + 1


@dataclass
class FakeProvider:
    """State and knobs of the fake; the app reads them on every request."""

    # ok | 500 | 429 | 401 | die_mid_stream | hang | 400_escaped | key_mid_stream
    scenario: str = "ok"
    words: int = 6
    # More text after the words: what a provider that echoes its input says.
    echo: list[str] = field(default_factory=list)
    # Models whose OpenAI streams hang after their first word (an upstream stuck mid-stream).
    hang_models: set[str] = field(default_factory=set)
    delay: float = 0.0
    # How long `hang` waits before answering (longer than the proxy's read timeout).
    hang_seconds: float = 1.5
    # A 429's retry-after-ms, beside its retry-after of 7 s (None: not sent).
    retry_after_ms: int | None = None
    requests: list[dict[str, Any]] = field(default_factory=list)
    headers: list[dict[str, str]] = field(default_factory=list)
    streams_finished: int = 0
    streams_started: int = 0
    # Fields of the usage object replaced by these values, or MISSING.
    usage: dict[str, Any] | str | None = None
    # Called once a request arrived, before it is answered.
    before_answer: Callable[[], None] | None = None
    # Embeddings that mean something (bag_of_words): texts sharing most words
    # are close by cosine, as a real embedding model's paraphrases are.
    semantic_embeddings: bool = False

    def reported(self, usage: dict[str, Any]) -> dict[str, Any] | None:
        """The usage object to send: the fake's own, patched by `usage`, or None."""
        if self.usage == MISSING:
            return None
        if isinstance(self.usage, dict):
            return {**usage, **{k: v for k, v in self.usage.items() if k in usage}}
        return usage

    def text(self) -> list[str]:
        return [f" w{i}" for i in range(self.words)] + self.echo

    def app(self) -> Starlette:
        return Starlette(
            routes=[
                Route("/v1/chat/completions", self.openai, methods=["POST"]),
                Route("/v1/completions", self.legacy, methods=["POST"]),
                Route("/v1/embeddings", self.embeddings, methods=["POST"]),
                Route("/v1/messages", self.anthropic, methods=["POST"]),
                Route("/v1/messages/count_tokens", self.count_tokens, methods=["POST"]),
            ]
        )

    async def _record(self, request: Request) -> dict[str, Any]:
        body: dict[str, Any] = json.loads(await request.body())
        self.requests.append(body)
        self.headers.append(dict(request.headers))
        if self.scenario == "hang":
            await asyncio.sleep(self.hang_seconds)
        if self.before_answer is not None:
            self.before_answer()  # a fault test freezing the store mid-request
        return body

    def _error(self, kind: str) -> Response | None:
        if self.scenario == "500":
            message = f"internal failure; key was {PROVIDER_KEY}"
            return _error(kind, 500, "server_error" if kind == "openai" else "api_error", message)
        if self.scenario == "400_escaped":
            # What a JSON encoder that escapes every character writes.
            escaped = "".join(f"\\u{ord(c):04x}" for c in PROVIDER_KEY)
            raw = (
                '{"error": {"message": "bad request for key %s", "type": "invalid_request_error"}}'
            )
            return Response(raw % escaped, status_code=400, media_type="application/json")
        if self.scenario == "401":
            message = f"Incorrect API key provided: {PROVIDER_KEY}"
            return _error(kind, 401, "authentication_error", message)
        if self.scenario == "429":
            headers = {"retry-after": "7", "x-should-retry": "false"}
            if self.retry_after_ms is not None:
                headers["retry-after-ms"] = str(self.retry_after_ms)
            if kind == "openai":
                headers |= {
                    "x-ratelimit-remaining-requests": "0",
                    "x-ratelimit-limit-requests": "5",
                }
            else:
                headers |= {"anthropic-ratelimit-requests-remaining": "0"}
            return _error(kind, 429, "rate_limit_error", "provider says slow down", headers)
        return None

    async def openai(self, request: Request) -> Response:
        body = await self._record(request)
        if (error := self._error("openai")) is not None:
            return error
        words = self.text()
        usage = self.reported(
            {
                "prompt_tokens": PROMPT_TOKENS,
                "completion_tokens": completion_tokens(len(words)),
                "total_tokens": PROMPT_TOKENS + completion_tokens(len(words)),
            }
        )
        if not body.get("stream"):
            answer = {
                "id": "chatcmpl-fake",
                "object": "chat.completion",
                "created": 1_700_000_000,
                "model": body["model"],
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": "".join(words)},
                        "finish_reason": "stop",
                        "logprobs": None,
                    }
                ],
            }
            if usage is not None:
                answer["usage"] = usage
            return JSONResponse(answer, headers={"x-request-id": "req_fake_openai"})
        include = (body.get("stream_options") or {}).get("include_usage") is True
        return StreamingResponse(
            self._openai_events(body["model"], words, usage if include else None),
            media_type="text/event-stream",
        )

    async def _openai_events(
        self, model: str, words: list[str], usage: dict[str, Any] | None
    ) -> AsyncIterator[bytes]:
        self.streams_started += 1
        base = {
            "id": "chatcmpl-fake",
            "object": "chat.completion.chunk",
            "created": 1,
            "model": model,
        }
        extra = {"usage": None} if usage is not None else {}

        def chunk(delta: dict[str, Any], finish: str | None) -> bytes:
            choice = {"index": 0, "delta": delta, "finish_reason": finish}
            return _data({**base, "choices": [choice], **extra})

        yield chunk({"role": "assistant", "content": ""}, None)
        for i, word in enumerate(words):
            await asyncio.sleep(self.delay)
            if self.scenario == "die_mid_stream" and i == len(words) // 2:
                raise RuntimeError("the fake provider dies mid-stream")
            if self.scenario == "key_mid_stream" and i == len(words) // 2:
                message = f"upstream failure for KEY {PROVIDER_KEY.upper()}"
                yield _data({"error": {"message": message, "type": "server_error"}})
                return
            yield chunk({"content": word}, None)
            if model in self.hang_models:
                await asyncio.sleep(3_600)
        yield chunk({}, "stop")
        if usage is not None:
            yield _data({**base, "choices": [], "usage": usage})
        yield b"data: [DONE]\n\n"
        self.streams_finished += 1

    async def legacy(self, request: Request) -> Response:
        """The legacy completions endpoint: `text` in each choice, the same usage."""
        body = await self._record(request)
        if (error := self._error("openai")) is not None:
            return error
        words = self.text()
        out = completion_tokens(len(words))
        usage = {"prompt_tokens": PROMPT_TOKENS, "completion_tokens": out}
        base = {
            "id": "cmpl-fake",
            "object": "text_completion",
            "created": 1,
            "model": body["model"],
        }

        def choice(text: str, finish: str | None) -> dict[str, Any]:
            return {"text": text, "index": 0, "logprobs": None, "finish_reason": finish}

        if not body.get("stream"):
            return JSONResponse(
                {**base, "choices": [choice("".join(words), "stop")], "usage": usage}
            )
        include = (body.get("stream_options") or {}).get("include_usage") is True

        async def events() -> AsyncIterator[bytes]:
            for word in words:
                await asyncio.sleep(self.delay)
                yield _data({**base, "choices": [choice(word, None)]})
            yield _data({**base, "choices": [choice("", "stop")]})
            if include:
                yield _data({**base, "choices": [], "usage": usage})
            yield b"data: [DONE]\n\n"
            self.streams_finished += 1

        return StreamingResponse(events(), media_type="text/event-stream")

    async def embeddings(self, request: Request) -> Response:
        """Embeddings (three fixed dimensions, or bag_of_words), as floats or base64."""
        body = await self._record(request)
        if (error := self._error("openai")) is not None:
            return error
        inputs = body["input"] if isinstance(body["input"], list) else [body["input"]]
        data = []
        for i, text in enumerate(inputs):
            vector = bag_of_words(str(text)) if self.semantic_embeddings else [0.25, 0.5, 0.75]
            encoded: Any = vector
            if body.get("encoding_format") == "base64":
                encoded = base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()
            data.append({"object": "embedding", "index": i, "embedding": encoded})
        usage = {"prompt_tokens": PROMPT_TOKENS, "total_tokens": PROMPT_TOKENS}
        return JSONResponse(
            {"object": "list", "data": data, "model": body["model"], "usage": usage}
        )

    async def anthropic(self, request: Request) -> Response:
        body = await self._record(request)
        if (error := self._error("anthropic")) is not None:
            return error
        words = self.text()
        usage = self.reported(
            {"input_tokens": PROMPT_TOKENS, "output_tokens": completion_tokens(len(words))}
        )
        message = {
            "id": "msg_fake",
            "type": "message",
            "role": "assistant",
            "model": body["model"],
            "stop_reason": "end_turn",
            "stop_sequence": None,
        }
        if not body.get("stream"):
            content = [{"type": "text", "text": "".join(words)}]
            answer = {**message, "content": content}
            if usage is not None:
                answer["usage"] = usage
            return JSONResponse(answer, headers={"request-id": "req_fake_anthropic"})
        return StreamingResponse(
            self._anthropic_events(message, words, usage), media_type="text/event-stream"
        )

    async def count_tokens(self, request: Request) -> Response:
        """Anthropic's token count: its own figure (PROMPT_TOKENS), not tiktoken's."""
        await self._record(request)
        if (error := self._error("anthropic")) is not None:
            return error
        return JSONResponse(
            {"input_tokens": PROMPT_TOKENS}, headers={"request-id": "req_fake_count"}
        )

    async def _anthropic_events(
        self, message: dict[str, Any], words: list[str], usage: dict[str, Any] | None
    ) -> AsyncIterator[bytes]:
        self.streams_started += 1
        start = {**message, "content": [], "stop_reason": None}
        if usage is not None:
            start["usage"] = {"input_tokens": usage["input_tokens"], "output_tokens": 1}
        yield _event("message_start", {"type": "message_start", "message": start})
        block = {"type": "text", "text": ""}
        yield _event(
            "content_block_start",
            {"type": "content_block_start", "index": 0, "content_block": block},
        )
        yield _event("ping", {"type": "ping"})
        for i, word in enumerate(words):
            await asyncio.sleep(self.delay)
            if self.scenario == "die_mid_stream" and i == len(words) // 2:
                raise RuntimeError("the fake provider dies mid-stream")
            if self.scenario == "key_mid_stream" and i == len(words) // 2:
                encoded = "".join(f"%{ord(c):02X}" for c in PROVIDER_KEY)  # a URL's spelling
                error = {"type": "api_error", "message": f"overloaded {encoded}"}
                yield _event("error", {"type": "error", "error": error})
                return
            delta = {"type": "text_delta", "text": word}
            yield _event(
                "content_block_delta", {"type": "content_block_delta", "index": 0, "delta": delta}
            )
        yield _event("content_block_stop", {"type": "content_block_stop", "index": 0})
        delta: dict[str, Any] = {
            "type": "message_delta",
            "delta": {"stop_reason": "end_turn", "stop_sequence": None},
        }
        if usage is not None:
            delta["usage"] = {"output_tokens": usage["output_tokens"]}
        yield _event("message_delta", delta)
        yield _event("message_stop", {"type": "message_stop"})
        self.streams_finished += 1


def _data(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


def _event(name: str, payload: dict[str, Any]) -> bytes:
    return f"event: {name}\n".encode() + _data(payload)


def _error(
    kind: str, status: int, error_type: str, message: str, headers: dict[str, str] | None = None
) -> Response:
    if kind == "openai":
        body: dict[str, Any] = {
            "error": {"message": message, "type": error_type, "param": None, "code": None}
        }
    else:
        body = {"type": "error", "error": {"type": error_type, "message": message}}
    return JSONResponse(body, status_code=status, headers=headers)


async def _serve_forever(hang_models: set[str]) -> None:
    """Serve a fake provider on a free loopback port; print the port first."""
    provider = FakeProvider(hang_models=hang_models)
    config = uvicorn.Config(provider.app(), host="127.0.0.1", port=0, log_level="warning")
    server = uvicorn.Server(config)
    task = asyncio.ensure_future(server.serve())
    while not server.started:
        assert not task.done(), "uvicorn did not start"
        await asyncio.sleep(0.02)
    print(server.servers[0].sockets[0].getsockname()[1], flush=True)
    await task


if __name__ == "__main__":
    # python -m tests.proxy.fake_provider [MODEL_THAT_HANGS ...]: the fake as its own process.
    asyncio.run(_serve_forever(set(sys.argv[1:])))
