"""The baseline a user would otherwise pick: the seeds' Redis + Lua token bucket.

`token_bucket.lua` (beside this file) is seed 000's script over a list of
layer keys; this is the thin asyncio client a gateway would wrap around it.
"""

from __future__ import annotations

import time
from pathlib import Path

import redis.asyncio as aioredis

SCRIPT_PATH = Path(__file__).with_name("token_bucket.lua")
GLOBAL_KEY = "bucket:global"


class RedisTokenBucket:
    """Reserve tokens on a tenant's bucket and the global bucket in one EVALSHA."""

    def __init__(
        self,
        client: aioredis.Redis,
        *,
        tenant_capacity: int,
        tenant_tokens_per_minute: int,
        global_capacity: int | None,
        global_tokens_per_minute: int | None,
    ) -> None:
        self._client = client
        self._script = client.register_script(SCRIPT_PATH.read_text())
        self._tenant = (tenant_capacity, tenant_tokens_per_minute / 60.0)
        self._global = (
            None
            if global_capacity is None or global_tokens_per_minute is None
            else (global_capacity, global_tokens_per_minute / 60.0)
        )

    @classmethod
    def connect(cls, host: str, port: int, **limits: int | None) -> RedisTokenBucket:
        client = aioredis.Redis(host=host, port=port, max_connections=1_000)
        return cls(client, **limits)  # type: ignore[arg-type]

    async def reserve(self, tenant: str, tokens: int) -> tuple[bool, int]:
        """(admitted, tokens left or seconds to wait), decided atomically by the script."""
        keys = [f"bucket:{tenant}"]
        args: list[float] = [tokens, int(time.time() * 1_000), *self._tenant]
        if self._global is not None:
            keys.append(GLOBAL_KEY)
            args.extend(self._global)
        allowed, value = await self._script(keys=keys, args=args)
        return bool(allowed), int(value)

    async def flush(self) -> None:
        await self._client.flushall()

    async def close(self) -> None:
        await self._client.aclose()
