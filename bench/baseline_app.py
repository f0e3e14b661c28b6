"""The HTTP baseline: FastAPI with a Redis + Lua rate-limit middleware, built the
way the seeds build it (seed 001, "The Middleware That Ties It Together").

An HTTP middleware parses the JSON body, estimates the tokens (counted input
plus max_tokens), reserves them with one Lua script call and answers 429 with
X-TokenLimit-* headers, or lets the request through to the endpoint. Two
changes from the seed, both in the baseline's favour: the fastest asyncio
client the library comparison found (BENCH_REDIS_CLIENT, a name from
bench/redis_lua.py: valkey-glide or redis-py with hiredis on a sized pool)
instead of a blocking client inside async code, and the token bucket script of
token_bucket.lua (tenant and global layer, one round trip) instead of a
sliding window. Token counting uses the same local tiktoken files as
llmquota (nothing may be downloaded at run time).

Run by bench/http.py as `uvicorn bench.baseline_app:app --workers 2`, with
BENCH_REDIS_HOST, BENCH_REDIS_PORT, BENCH_REDIS_CLIENT and BENCH_ADMIN_KEY in
the environment.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncIterator, Awaitable, Callable

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse

from bench import redis_lua
from bench.common import UNLIMITED_TOKENS_PER_MINUTE
from llmquota.domain.tokens import count_messages

LIMITS = redis_lua.Limits(
    tenant_capacity=UNLIMITED_TOKENS_PER_MINUTE,
    tenant_tokens_per_minute=UNLIMITED_TOKENS_PER_MINUTE,
    global_capacity=UNLIMITED_TOKENS_PER_MINUTE,
    global_tokens_per_minute=UNLIMITED_TOKENS_PER_MINUTE,
)
ADMIN_KEY = os.environ.get("BENCH_ADMIN_KEY", "")


@contextlib.asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    """One client per worker, connected before the first request (glide connects async)."""
    client = redis_lua.CLIENTS_BY_NAME[os.environ.get("BENCH_REDIS_CLIENT", "valkey-glide")]
    app.state.bucket = await redis_lua.connect(
        client,
        os.environ.get("BENCH_REDIS_HOST", "127.0.0.1"),
        int(os.environ.get("BENCH_REDIS_PORT", "6379")),
        LIMITS,
    )
    try:
        yield
    finally:
        await app.state.bucket.close()


app = FastAPI(title="FastAPI + Redis-Lua baseline", lifespan=lifespan)


@app.middleware("http")
async def rate_limit_middleware(
    request: Request, call_next: Callable[[Request], Awaitable[Response]]
) -> Response:
    if request.url.path != "/v1/admit":
        return await call_next(request)
    if request.headers.get("authorization") != f"Bearer {ADMIN_KEY}":
        return JSONResponse({"error": "unauthorized"}, status_code=401)

    # Parse the body to estimate tokens
    body = await request.json()
    tenant_id = body["tenant"]
    messages = body.get("messages", [])
    max_output = body.get("max_tokens", 1024)
    estimated = count_messages(messages, body.get("model", "gpt-4o")).tokens + max_output

    # Check budget
    allowed, value = await request.app.state.bucket.reserve(tenant_id, estimated)
    if not allowed:
        return JSONResponse(
            status_code=429,
            content={
                "error": "token_budget_exceeded",
                "message": f"Token budget exhausted. Resets in {value}s",
            },
            headers={"Retry-After": str(value), "X-TokenLimit-Remaining": "0"},
        )

    request.state.reserved_tokens = estimated
    response = await call_next(request)
    response.headers["X-TokenLimit-Remaining"] = str(value)
    return response


@app.post("/v1/admit", status_code=201)
async def admit(request: Request) -> dict[str, object]:
    """What the gateway would do next (call the provider) is out of the measurement."""
    return {"admitted": True, "reserved_tokens": request.state.reserved_tokens}
