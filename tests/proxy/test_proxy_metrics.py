"""Proxy metrics, read over HTTP from /metrics after the official SDKs drove traffic.

Each series is read before and after, and must have moved by exactly what was
driven: a completion, a stream, an upstream 500, an upstream 429 (a refusal,
not an error), an upstream timeout, and a stream whose client hung up (a
drain, in progress while the provider is still read).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import asyncpg
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.proxy.conftest import GENEROUS, Stack, settled, stack_for
from tests.proxy.fake_provider import FakeProvider, completion_tokens

MESSAGES = [{"role": "user", "content": "Say something short."}]
CHAT = {"provider": "openai", "endpoint": "chat"}
Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


async def scrape(stack: Stack) -> Samples:
    """Every sample /metrics shows, by name and labels."""
    response = await stack.admin.get("/metrics")
    assert response.status_code == 200
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(response.text)
        for sample in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def moved(before: Samples, after: Samples, name: str, **labels: str) -> float:
    return value(after, name, **labels) - value(before, name, **labels)


@pytest.fixture
async def quick_timeout_stack(
    fake: tuple[FakeProvider, str], database_dsn: str
) -> AsyncIterator[Stack]:
    async with stack_for(fake, database_dsn, GENEROUS, proxy_read_timeout_seconds=0.5) as s:
        yield s


async def drive(stack: Stack) -> None:
    """A completion, a stream, a 500, a 429 and a timeout, through the openai SDK."""
    client = stack.openai()
    await client.chat.completions.create(model="gpt-4o", messages=MESSAGES, max_tokens=50)
    stack.fake.delay = 0.02
    stream = await client.chat.completions.create(
        model="gpt-4o", messages=MESSAGES, max_tokens=50, stream=True
    )
    assert len([chunk async for chunk in stream]) == 8
    for scenario, error in (
        ("500", openai.InternalServerError),
        ("429", openai.RateLimitError),
        ("hang", openai.APIStatusError),
    ):
        stack.fake.scenario = scenario
        with pytest.raises(error) as failed:
            await client.chat.completions.create(model="gpt-4o", messages=MESSAGES, max_tokens=5)
        if scenario == "429":
            assert failed.value.response.headers["retry-after"] == "7"
        if scenario == "hang":
            assert failed.value.status_code == 504


async def test_each_proxy_series_moves_by_what_was_driven(
    quick_timeout_stack: Stack, db: asyncpg.Connection
) -> None:
    stack = quick_timeout_stack
    before = await scrape(stack)
    await drive(stack)
    await settled(db, 2)
    after = await scrape(stack)

    def delta(name: str, **labels: str) -> float:
        return moved(before, after, name, **labels)

    # The completion, the stream, the 500 and the 429 got a head; the timeout did not.
    assert delta("llmquota_proxy_upstream_seconds_count", **CHAT) == 4
    assert delta("llmquota_proxy_upstream_seconds_sum", **CHAT) > 0
    assert delta("llmquota_proxy_time_to_first_token_seconds_count", **CHAT) == 1
    assert 0.02 <= delta("llmquota_proxy_time_to_first_token_seconds_sum", **CHAT) < 5
    assert delta("llmquota_proxy_output_tokens_per_second_count", **CHAT) == 1
    # 13 tokens reported, after at least five 20 ms pauses between the six words.
    speed = delta("llmquota_proxy_output_tokens_per_second_sum", **CHAT)
    assert 1 < speed <= completion_tokens(6) / (5 * 0.02)
    errors = "llmquota_proxy_provider_errors_total"
    assert delta(errors, provider="openai", status="500") == 1
    assert delta(errors, provider="openai", status="timeout") == 1
    assert delta(errors, provider="openai", status="429") == 0  # a refusal, not an error
    assert delta("llmquota_proxy_provider_refusals_total", provider="openai") == 1
    assert value(after, "llmquota_proxy_drains_in_progress") == 0


async def test_a_drain_is_in_progress_until_the_provider_is_read_to_its_end(
    stack: Stack, db: asyncpg.Connection
) -> None:
    stack.fake.words, stack.fake.delay = 20, 0.05  # a second of stream after the client leaves
    stream = await stack.openai().chat.completions.create(
        model="gpt-4o", messages=MESSAGES, max_tokens=100, stream=True
    )
    async for _chunk in stream:
        break
    await stream.close()
    gauge = "llmquota_proxy_drains_in_progress"
    deadline = asyncio.get_running_loop().time() + 2
    while value(await scrape(stack), gauge) != 1:
        assert asyncio.get_running_loop().time() < deadline, "no drain was counted"
        await asyncio.sleep(0.02)
    rows = await settled(db, 1)
    assert [r["output_tokens"] for r in rows] == [completion_tokens(20)]
    assert value(await scrape(stack), gauge) == 0
    after = await scrape(stack)
    # The drained stream still reports its speed: the provider's usage was read.
    assert value(after, "llmquota_proxy_output_tokens_per_second_count", **CHAT) == 1
