"""The baseline a user would otherwise pick: the seeds' Redis + Lua token bucket.

`token_bucket.lua` (beside this file) is seed 000's script over a list of
layer keys; this is the thin asyncio client a gateway would wrap around it,
on the clients a careful user would pick:

- redis-py with `hiredis` (what `pip install "redis[hiredis]"` gives: the C
  reply parser), on a `BlockingConnectionPool` whose size is swept, since a
  pool as large as the callers pays for its connections in Python;
- valkey-glide: a Rust core behind one multiplexed connection.

The bench runs every one of them and compares llmquota with the fastest.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import redis.asyncio as aioredis
from glide import GlideClient, GlideClientConfiguration, NodeAddress, Script
from redis.utils import HIREDIS_AVAILABLE

SCRIPT_PATH = Path(__file__).with_name("token_bucket.lua")
GLOBAL_KEY = "bucket:global"


@dataclass(frozen=True)
class Limits:
    """The tenant's bucket and, optionally, the global one: capacity and tokens a minute."""

    tenant_capacity: int
    tenant_tokens_per_minute: int
    global_capacity: int | None = None
    global_tokens_per_minute: int | None = None

    def script_args(self, tokens: int, now_ms: int) -> tuple[list[str], list[float]]:
        keys_tail = [] if self.global_capacity is None else [GLOBAL_KEY]
        args: list[float] = [
            tokens,
            now_ms,
            self.tenant_capacity,
            self.tenant_tokens_per_minute / 60,
        ]
        if self.global_capacity is not None and self.global_tokens_per_minute is not None:
            args += [self.global_capacity, self.global_tokens_per_minute / 60]
        return keys_tail, args


@dataclass(frozen=True)
class Client:
    """One way to reach Redis: its name in the report, and how it connects."""

    name: str
    kind: str  # "redis-py" or "glide"
    pool_size: int = 0


# redis-py's pool sizes swept: 16 and 64 connections (the callers are 64).
CLIENTS = (
    Client("redis-py+hiredis pool 16", "redis-py", 16),
    Client("redis-py+hiredis pool 64", "redis-py", 64),
    Client("valkey-glide", "glide"),
)
CLIENTS_BY_NAME = {c.name: c for c in CLIENTS}


class TokenBucket(Protocol):
    async def reserve(self, tenant: str, tokens: int) -> tuple[bool, int]: ...

    async def flush(self) -> None: ...

    async def close(self) -> None: ...


class RedisPyBucket:
    """Reserve on a tenant's bucket and the global bucket in one EVALSHA (redis-py)."""

    def __init__(self, client: aioredis.Redis, limits: Limits) -> None:
        if not HIREDIS_AVAILABLE:
            raise RuntimeError("hiredis is not installed: pip install -e '.[bench]'")
        self._client = client
        self._script = client.register_script(SCRIPT_PATH.read_text())
        self._limits = limits

    async def reserve(self, tenant: str, tokens: int) -> tuple[bool, int]:
        """(admitted, tokens left or seconds to wait), decided atomically by the script."""
        tail, args = self._limits.script_args(tokens, int(time.time() * 1_000))
        allowed, value = await self._script(keys=[f"bucket:{tenant}", *tail], args=args)
        return bool(allowed), int(value)

    async def flush(self) -> None:
        await self._client.flushall()

    async def close(self) -> None:
        await self._client.aclose()


class GlideBucket:
    """The same script through valkey-glide (invoke_script: EVALSHA, loading it once)."""

    def __init__(self, client: GlideClient, limits: Limits) -> None:
        self._client = client
        self._script = Script(SCRIPT_PATH.read_text())
        self._limits = limits

    async def reserve(self, tenant: str, tokens: int) -> tuple[bool, int]:
        tail, args = self._limits.script_args(tokens, int(time.time() * 1_000))
        result = await self._client.invoke_script(
            self._script, keys=[f"bucket:{tenant}", *tail], args=[str(a) for a in args]
        )
        allowed, value = result  # type: ignore[misc]
        return bool(allowed), int(value)

    async def flush(self) -> None:
        await self._client.flushall()

    async def close(self) -> None:
        await self._client.close()


async def connect(client: Client, host: str, port: int, limits: Limits) -> TokenBucket:
    """A bucket over `client`, connected to the Redis at host:port."""
    if client.kind == "glide":
        config = GlideClientConfiguration([NodeAddress(host, port)], request_timeout=60_000)
        return GlideBucket(await GlideClient.create(config), limits)
    pool = aioredis.BlockingConnectionPool(
        host=host, port=port, max_connections=client.pool_size, timeout=60
    )
    return RedisPyBucket(aioredis.Redis(connection_pool=pool), limits)
