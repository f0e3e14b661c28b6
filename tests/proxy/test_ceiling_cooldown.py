"""An upstream 429 cools the model's provider ceilings down (PROXY_CEILING_COOLDOWN_SECONDS).

The provider's own limit is the truth: when it says 429 with a retry-after,
llmquota stops sending that model's requests itself for that long, instead of
forwarding requests the provider will refuse. Exercised with the official
openai SDK against the fake provider.
"""

from __future__ import annotations

import asyncpg
import openai
import pytest

from tests.proxy.conftest import GENEROUS, stack_for
from tests.proxy.fake_provider import FakeProvider

MESSAGES = [{"role": "user", "content": "hello"}]
CEILING = {
    "models": ["gpt-4o*"],
    "tokens_per_minute": 60_000,  # 1,000 tokens a second
    "token_burst": 50_000,
}


async def test_an_upstream_429_empties_the_ceiling_for_the_providers_retry_after(
    fake: tuple[FakeProvider, str], database_dsn: str, db: asyncpg.Connection
) -> None:
    async with stack_for(fake, database_dsn, GENEROUS, proxy_ceiling_cooldown_seconds=3.0) as stack:
        put = await stack.admin.put("/v1/ceilings/openai", json=CEILING)
        assert put.status_code == 200, put.text
        stack.fake.scenario = "429"  # with retry-after: 7
        with pytest.raises(openai.RateLimitError):
            await stack.openai(max_retries=0).chat.completions.create(
                model="gpt-4o", messages=MESSAGES, max_tokens=5
            )
        tokens = await db.fetchval("SELECT tokens FROM limit_layers WHERE ceiling = 'openai'")
        # The refused request's reservation is released, its tokens given back
        # to the ceiling: before the cool-down (nothing left of them) or after
        # it (on top of the emptied ceiling), whichever commits first.
        given_back = await db.fetchval("SELECT max(reserved_tokens) FROM reservations")
        # Emptied, then debited 7 s of refill (the provider's hint beats the setting's 3 s).
        assert -7_000 - 1 <= tokens <= -7_000 + given_back + 50, (tokens, given_back)
        calls_before = len(stack.fake.requests)
        stack.fake.scenario = "ok"
        with pytest.raises(openai.RateLimitError) as ours:
            await stack.openai(max_retries=0).chat.completions.create(
                model="gpt-4o-mini", messages=MESSAGES, max_tokens=5
            )
        # Refused by llmquota itself, naming the ceiling: the provider was not called.
        assert len(stack.fake.requests) == calls_before
        assert "ceiling" in ours.value.message
        retry_ms = int(ours.value.response.headers["retry-after-ms"])
        assert 6_000 < retry_ms <= 8_000
        # Another model is not cooled down.
        other = await stack.openai(max_retries=0).chat.completions.create(
            model="gpt-3.5-turbo", messages=MESSAGES, max_tokens=5
        )
        assert other.choices


async def test_without_the_setting_an_upstream_429_changes_no_ceiling(
    fake: tuple[FakeProvider, str], database_dsn: str, db: asyncpg.Connection
) -> None:
    async with stack_for(fake, database_dsn, GENEROUS) as stack:
        await stack.admin.put("/v1/ceilings/openai", json=CEILING)
        stack.fake.scenario = "429"
        with pytest.raises(openai.RateLimitError):
            await stack.openai(max_retries=0).chat.completions.create(
                model="gpt-4o", messages=MESSAGES, max_tokens=5
            )
        tokens = await db.fetchval("SELECT tokens FROM limit_layers WHERE ceiling = 'openai'")
        assert tokens == pytest.approx(50_000, abs=100)
