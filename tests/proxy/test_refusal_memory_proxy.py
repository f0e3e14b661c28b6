"""The proxy under a tenant's flood past its limit: every refusal is the
provider-format 429 the store would give, answered from the worker's memory
after the first (admission/refusals.py), and nothing reaches the provider."""

from __future__ import annotations

import time

import openai
import pytest

from tests.faults.conftest import metric_value
from tests.proxy.conftest import stack_for
from tests.proxy.fake_provider import FakeProvider

TIGHT = {"tokens_per_minute": 60, "token_burst": 1_000}


async def test_a_proxy_flood_past_the_limit_is_refused_from_memory(
    fake: tuple[FakeProvider, str], database_dsn: str
) -> None:
    async with stack_for(fake, database_dsn, TIGHT) as stack:
        # A held reservation leaves the tenant 100 tokens, refilling one a second.
        held = await stack.admin.post(
            "/v1/admit",
            json={"tenant": "acme", "model": "gpt-4o", "input_tokens": 900, "max_tokens": 0},
            headers={"Authorization": f"Bearer {stack.key}"},
        )
        assert held.status_code == 201, held.text
        sdk = stack.openai()
        messages = [{"role": "user", "content": "hello " * 50}]
        calls_before = len(stack.fake.requests)
        statuses = []
        started = time.monotonic()
        for _ in range(30):
            with pytest.raises(openai.RateLimitError) as refused:
                await sdk.chat.completions.create(
                    model="gpt-4o",
                    messages=messages,
                    max_tokens=500,  # type: ignore[arg-type]
                )
            statuses.append(refused.value.status_code)
            assert int(refused.value.response.headers["retry-after-ms"]) > 0
        elapsed = time.monotonic() - started
        exposition = (await stack.admin.get("/metrics")).text
    assert statuses == [429] * 30
    assert len(stack.fake.requests) == calls_before  # the provider saw none of them
    from_memory = metric_value(exposition, "llmquota_refusals_from_memory_total")
    # The first went to the store, then one at most per 100 ms memory window.
    to_store = 30 - from_memory
    assert 1 <= to_store <= 1 + elapsed / 0.1, (from_memory, elapsed)
    assert from_memory > 0, (from_memory, elapsed)
