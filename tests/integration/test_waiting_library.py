"""`Limiter.admit(..., max_wait_ms=...)`: the library waits for room as the API does.

The tenant refills 100 tokens a second, so a 100-token request refused on an
empty bucket has a hint of about a second; a waiter is admitted at its hint,
late by at most its wake-up timer and a decision or two on a loaded machine.
"""

from __future__ import annotations

import time

import pytest

from llmquota.admission.limiter import Limiter
from llmquota.domain.errors import RateLimited

from .support import put

REQUEST = {"tenant": "acme", "model": "gpt-4o", "input_tokens": 0, "max_tokens": 100}
WAKE_SLACK_SECONDS = 0.5


async def test_a_library_caller_waits_for_room_instead_of_raising(limiter: Limiter) -> None:
    await put(limiter, "tenant", "acme", tokens_per_minute=6_000, token_burst=100)
    first = await limiter.admit(**REQUEST)
    with pytest.raises(RateLimited) as refused:
        await limiter.admit(**REQUEST)
    hint_seconds = refused.value.retry_after

    started = time.perf_counter()
    async with limiter.reservation(max_wait_ms=10_000, **REQUEST) as waited:
        seconds = time.perf_counter() - started
        await waited.settle(input_tokens=0, output_tokens=10)

    assert waited.reserved_tokens == 100
    assert 0.8 * hint_seconds <= seconds <= hint_seconds + WAKE_SLACK_SECONDS, (
        seconds,
        hint_seconds,
    )
    await first.release()


async def test_a_wait_shorter_than_the_hint_raises_at_once(limiter: Limiter) -> None:
    await put(limiter, "tenant", "acme", tokens_per_minute=6_000, token_burst=100)
    await limiter.admit(**REQUEST)

    with pytest.raises(RateLimited) as refused:
        await limiter.admit(max_wait_ms=200, **REQUEST)

    assert refused.value.retry_after_ms > 200
    assert limiter.waiting.waiting() == 0
