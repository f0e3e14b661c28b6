"""A suspended tenant gets no admission from the library either.

The suspension lives in PostgreSQL (tenants.suspended_at); every worker keeps
the list of suspended tenants with its policies and reloads it when the
database announces a change, so a library caller, who has no API key, is
refused like a key of the tenant (llmquota.TenantSuspended), while what the
tenant holds still settles.
"""

from __future__ import annotations

import asyncio
import time

import asyncpg
import pytest

from llmquota import TenantSuspended
from llmquota.admission.limiter import Limiter
from tests.integration.support import put

REQUEST = {"tenant": "acme", "model": "gpt-4o", "input_tokens": 5, "max_tokens": 5}


async def seconds_until_refused(limiter: Limiter, refused: bool) -> float:
    """Admit (releasing what is admitted) until the answer is refused or not."""
    started = time.monotonic()
    while True:
        try:
            held = await limiter.admit(**REQUEST)  # type: ignore[arg-type]
        except TenantSuspended:
            if refused:
                return time.monotonic() - started
        else:
            await limiter.release(held.reservation_id)
            if not refused:
                return time.monotonic() - started
        assert time.monotonic() - started < 5, "the suspension never reached the limiter"
        await asyncio.sleep(0.01)


async def test_a_suspension_announced_by_the_database_refuses_library_admissions(
    limiter: Limiter, db: asyncpg.Connection
) -> None:
    await put(limiter, "tenant", "acme", tokens_per_minute=100_000)
    held = await limiter.admit(**REQUEST)  # type: ignore[arg-type]
    await db.execute("UPDATE tenants SET suspended_at = now() WHERE tenant = 'acme'")
    waited = await seconds_until_refused(limiter, refused=True)
    print(f"suspension reached the library's limiter after {waited * 1000:.1f} ms")
    assert waited < 1.0
    with pytest.raises(TenantSuspended, match="'acme' is suspended"):
        await limiter.admit(**REQUEST)  # type: ignore[arg-type]
    settled = await held.settle(input_tokens=5, output_tokens=3)
    assert settled.charged_tokens == 8 and not settled.journaled
    assert await db.fetchval("SELECT count(*) FROM usage_ledger WHERE tenant = 'acme'") == 1
    await db.execute("UPDATE tenants SET suspended_at = NULL WHERE tenant = 'acme'")
    assert await seconds_until_refused(limiter, refused=False) < 1.0
