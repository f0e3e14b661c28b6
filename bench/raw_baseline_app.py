"""The fastest HTTP baseline a careful user would deploy: a raw ASGI app over Redis + Lua.

bench/baseline_app.py is the common form (FastAPI with an `@app.middleware`
that calls Redis, as the seeds build it), and it pays for Starlette's
middleware machinery and FastAPI's routing on every request. llmquota
answers admit from a raw ASGI fast path, so the fair comparison is with the
same care on the other side: this app does what baseline_app.py does (the
bearer key, the JSON body, the same tiktoken count, one EVALSHA of
token_bucket.lua on the fastest client, 429 with its headers or 201) with no
framework at all, and runs on the same uvicorn, httptools and uvloop as
`llmquota serve`.

Run by bench/http_admission.py as `uvicorn bench.raw_baseline_app:app --workers 2`,
with the same environment as baseline_app.py.
"""

from __future__ import annotations

import json
import os
from typing import Any

from starlette.types import Receive, Scope, Send

from bench import redis_lua
from bench.baseline_app import ADMIN_KEY, LIMITS
from llmquota.domain.tokens import count_messages

AUTHORIZATION = f"Bearer {ADMIN_KEY}".encode()
JSON = (b"content-type", b"application/json")
# The worker's one Redis client, connected by the lifespan.
_clients: dict[str, Any] = {}


async def app(scope: Scope, receive: Receive, send: Send) -> None:
    if scope["type"] == "lifespan":
        await _lifespan(receive, send)
        return
    if scope["type"] != "http" or scope["path"] != "/v1/admit" or scope["method"] != "POST":
        await _answer(send, 404, {"error": "not found"})
        return
    if dict(scope["headers"]).get(b"authorization") != AUTHORIZATION:
        await _answer(send, 401, {"error": "unauthorized"})
        return
    chunks, more = [], True
    while more:
        message = await receive()
        chunks.append(message.get("body", b""))
        more = message.get("more_body", False)
    body = json.loads(b"".join(chunks))
    estimated = count_messages(body.get("messages", []), body.get("model", "gpt-4o")).tokens
    estimated += body.get("max_tokens", 1024)
    allowed, value = await _clients["bucket"].reserve(body["tenant"], estimated)
    if not allowed:
        refusal = {
            "error": "token_budget_exceeded",
            "message": f"Token budget exhausted. Resets in {value}s",
        }
        headers = ((b"retry-after", str(value).encode()), (b"x-tokenlimit-remaining", b"0"))
        await _answer(send, 429, refusal, headers)
        return
    admitted = {"admitted": True, "reserved_tokens": estimated}
    await _answer(send, 201, admitted, ((b"x-tokenlimit-remaining", str(value).encode()),))


async def _answer(
    send: Send,
    status: int,
    document: dict[str, Any],
    headers: tuple[tuple[bytes, bytes], ...] = (),
) -> None:
    payload = json.dumps(document).encode()
    head = [JSON, (b"content-length", str(len(payload)).encode()), *headers]
    await send({"type": "http.response.start", "status": status, "headers": head})
    await send({"type": "http.response.body", "body": payload})


async def _lifespan(receive: Receive, send: Send) -> None:
    """One client per worker, connected before the first request."""
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            client = redis_lua.CLIENTS_BY_NAME[os.environ.get("BENCH_REDIS_CLIENT", "valkey-glide")]
            _clients["bucket"] = await redis_lua.connect(
                client,
                os.environ.get("BENCH_REDIS_HOST", "127.0.0.1"),
                int(os.environ.get("BENCH_REDIS_PORT", "6379")),
                LIMITS,
            )
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await _clients["bucket"].close()
            await send({"type": "lifespan.shutdown.complete"})
            return
