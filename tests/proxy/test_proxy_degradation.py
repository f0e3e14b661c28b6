"""Degradation and waiting in proxy mode (issue 23), through the official SDKs.

A request whose model its budget refuses is admitted as the first fallback
that fits (the policy's default list, or the client's
`llmquota-fallback-models`), and the body the provider sees names that
model; the answer says `llmquota-degraded-from`, the ledger bills the model
called. `llmquota-max-wait-ms` waits for room as /v1/admit's max_wait_ms.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import anthropic
import asyncpg
import openai
import pytest

from llmquota.domain.output_estimates import bucket_of, bucket_top
from llmquota.domain.vocabulary import SERVING_PATHS
from tests.proxy.conftest import GENEROUS, Stack, settled, stack_for
from tests.proxy.fake_provider import FakeProvider
from tests.proxy.test_proxy_metrics import scrape, value
from tests.proxy.test_proxy_routing import upstreams_file_only

MESSAGES = [{"role": "user", "content": "hello"}]


async def starve_gpt4o(stack: Stack) -> None:
    """A provider ceiling on gpt-4o too small for any request: it is always refused."""
    ceiling = await stack.admin.put(
        "/v1/ceilings/gpt4o",
        json={"models": ["gpt-4o"], "tokens_per_minute": 1, "token_burst": 5, "shed": []},
    )
    assert ceiling.status_code == 200, ceiling.text


async def test_the_policys_fallback_serves_a_refused_model(
    stack: Stack, db: asyncpg.Connection
) -> None:
    await starve_gpt4o(stack)
    policy = {
        "tokens_per_minute": 600_000,
        "token_burst": 200_000,
        "fallback_models": ["gpt-4o-mini"],
    }
    assert (await stack.admin.put("/v1/tenants/acme/policy", json=policy)).is_success
    raw = await stack.openai().chat.completions.with_raw_response.create(
        model="gpt-4o", messages=MESSAGES, max_tokens=20
    )
    assert raw.status_code == 200
    assert raw.headers["llmquota-degraded-from"] == "gpt-4o"
    assert raw.parse().choices[0].message.content
    assert stack.fake.requests[-1]["model"] == "gpt-4o-mini"  # what the provider saw
    rows = await settled(db, 1)
    assert [r["model"] for r in rows] == ["gpt-4o-mini"]  # billed as the model called
    # A stream degrades the same way.
    stream = await stack.openai().chat.completions.create(
        model="gpt-4o", messages=MESSAGES, max_tokens=20, stream=True
    )
    text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
    assert text
    assert stack.fake.requests[-1]["model"] == "gpt-4o-mini"
    assert [r["model"] for r in await settled(db, 2)] == ["gpt-4o-mini", "gpt-4o-mini"]
    samples = await scrape(stack)
    assert value(samples, "llmquota_serving_path_total", path="fallback_model") == 2
    assert value(samples, "llmquota_serving_path_total", path="primary") == 0
    assert value(samples, "llmquota_serving_path_seconds_count", path="fallback_model") == 2
    # The ledger says the same of each row (the path the admission journaled).
    paths = await db.fetch("SELECT serving_path FROM usage_ledger ORDER BY entry_id")
    assert [r["serving_path"] for r in paths] == ["fallback_model", "fallback_model"]


async def test_the_clients_fallbacks_and_opting_out(stack: Stack, db: asyncpg.Connection) -> None:
    await starve_gpt4o(stack)
    client = stack.openai()
    raw = await client.chat.completions.with_raw_response.create(
        model="gpt-4o",
        messages=MESSAGES,
        max_tokens=20,
        extra_headers={"llmquota-fallback-models": "gpt-4o-2024-08-06, gpt-4.1-mini"},
    )
    # gpt-4o-2024-08-06 does not match the ceiling's "gpt-4o": it fits first
    assert raw.headers["llmquota-degraded-from"] == "gpt-4o"
    assert stack.fake.requests[-1]["model"] == "gpt-4o-2024-08-06"
    calls = len(stack.fake.requests)
    with pytest.raises(openai.APIStatusError) as refused:
        await client.chat.completions.create(
            model="gpt-4o",
            messages=MESSAGES,
            max_tokens=20,
            extra_headers={
                "llmquota-fallback-models": "gpt-4o-mini",
                "llmquota-degrade": "false",
            },
        )
    # the model as written: too large for the ceiling's 5 tokens, never to be retried
    assert refused.value.status_code == 413 and "ceiling" in refused.value.message
    assert len(stack.fake.requests) == calls  # it never went upstream
    assert await db.fetchval("SELECT count(*) FROM reservations WHERE state = 'active'") == 0


async def test_a_degraded_proxy_request_reserves_the_admitted_models_estimate(
    stack: Stack, db: asyncpg.Connection
) -> None:
    """Issue 23's leftover, in proxy mode: under a learned policy the fallback
    admitted reserves its own quantile of output, not the refused model's."""
    await starve_gpt4o(stack)
    learned = {"strategy": "learned", "quantile": 0.95, "min_samples": 10}
    policy = {"tokens_per_minute": 600_000, "token_burst": 200_000, "output_estimate": learned}
    assert (await stack.admin.put("/v1/tenants/acme/policy", json=policy)).is_success
    rows = [("gpt-4o", 1000)] * 10 + [("gpt-4o-mini", 100)] * 10
    await db.execute(
        "SELECT lq_record_output_samples($1::text[], $2::text[], $3::text[], $4::bigint[])",
        ["acme"] * len(rows),
        [None] * len(rows),
        [model for model, _ in rows],
        [output for _, output in rows],
    )
    limiter = stack.app.state.limiter
    await limiter.refresh_policies()
    await limiter.estimates.refresh()
    raw = await stack.openai().chat.completions.with_raw_response.create(
        model="gpt-4o",
        messages=MESSAGES,
        max_tokens=4000,
        extra_headers={"llmquota-fallback-models": "gpt-4o-mini"},
    )
    assert raw.headers["llmquota-degraded-from"] == "gpt-4o"
    assert stack.fake.requests[-1]["model"] == "gpt-4o-mini"
    await settled(db, 1)
    row = await db.fetchrow(
        "SELECT model, input_tokens, max_tokens, reserved_tokens FROM reservations"
    )
    assert row is not None
    assert (row["model"], row["max_tokens"]) == ("gpt-4o-mini", 4000)
    # What every layer was debited at admission: the input and gpt-4o-mini's
    # quantile (gpt-4o's would have been 1,023).
    assert row["reserved_tokens"] - row["input_tokens"] == bucket_top(bucket_of(100))


async def test_anthropic_degrades_within_its_own_upstream(
    stack: Stack, db: asyncpg.Connection
) -> None:
    ceiling = await stack.admin.put(
        "/v1/ceilings/sonnet",
        json={"models": ["claude-3-5-sonnet*"], "tokens_per_minute": 1, "token_burst": 5},
    )
    assert ceiling.status_code == 200, ceiling.text
    raw = await stack.anthropic().messages.with_raw_response.create(
        model="claude-3-5-sonnet-latest",
        messages=MESSAGES,
        max_tokens=20,
        extra_headers={"llmquota-fallback-models": "claude-3-5-haiku-latest"},
    )
    assert raw.headers["llmquota-degraded-from"] == "claude-3-5-sonnet-latest"
    assert (await raw.parse()).content[0].type == "text"
    assert stack.fake.requests[-1]["model"] == "claude-3-5-haiku-latest"
    assert [r["model"] for r in await settled(db, 1)] == ["claude-3-5-haiku-latest"]
    with pytest.raises(anthropic.APIStatusError) as refused:  # no fallback: as refused
        await stack.anthropic().messages.create(
            model="claude-3-5-sonnet-latest", messages=MESSAGES, max_tokens=20
        )
    assert refused.value.status_code == 413


async def test_a_proxy_request_waits_for_a_permit(stack: Stack, db: asyncpg.Connection) -> None:
    policy = {"tokens_per_minute": 600_000, "token_burst": 200_000, "max_in_flight": 1}
    assert (await stack.admin.put("/v1/tenants/acme/policy", json=policy)).is_success
    stack.fake.delay = 0.1  # each of the stream's words: the permit is held ~0.7 s
    client = stack.openai()
    stream = await client.chat.completions.create(
        model="gpt-4o", messages=MESSAGES, max_tokens=20, stream=True
    )
    with pytest.raises(openai.RateLimitError):  # no wait asked: refused at once
        await client.chat.completions.create(model="gpt-4o", messages=MESSAGES, max_tokens=20)
    waiting = asyncio.ensure_future(
        client.chat.completions.with_raw_response.create(
            model="gpt-4o",
            messages=MESSAGES,
            max_tokens=20,
            extra_headers={"llmquota-max-wait-ms": "10000"},
        )
    )
    text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
    assert text
    raw = await waiting
    assert raw.status_code == 200
    assert int(raw.headers["llmquota-waited-ms"]) > 0
    rows = await settled(db, 2)
    assert len(rows) == 2
    samples = await scrape(stack)
    paths = {p: value(samples, "llmquota_serving_path_total", path=p) for p in SERVING_PATHS}
    assert paths == {
        "primary": 1,
        "cache": 0,
        "fallback_model": 0,
        "queued": 1,
        "second_deployment": 0,
        "rejected": 1,
    }
    # The ledger says the same of each row (the path the admission journaled).
    rows_paths = await db.fetch("SELECT serving_path FROM usage_ledger ORDER BY serving_path")
    assert [r["serving_path"] for r in rows_paths] == ["primary", "queued"]
    with pytest.raises(openai.BadRequestError):
        await client.chat.completions.create(
            model="gpt-4o",
            messages=MESSAGES,
            max_tokens=20,
            extra_headers={"llmquota-max-wait-ms": "soon"},
        )


async def test_a_fallback_served_by_another_upstream_goes_there(
    fake: tuple[FakeProvider, str],
    *,
    second_fake: tuple[FakeProvider, str],
    database_dsn: str,
    db: asyncpg.Connection,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # gpt-4o is served by "main", llama-* by "local" (UPSTREAMS_FILE): the
    # fallback's body goes to the upstream that serves it. A fallback nobody
    # serves is the client's 400; a policy default nobody serves is not used.
    settings = upstreams_file_only(tmp_path, fake[1], second_fake[1], monkeypatch)
    async with stack_for(fake, database_dsn, GENEROUS, **settings) as stack:
        ceiling = await stack.admin.put(
            "/v1/ceilings/gpt4o",
            json={"models": ["gpt-4o"], "tokens_per_minute": 1, "token_burst": 5},
        )
        assert ceiling.status_code == 200, ceiling.text
        client = stack.openai()
        raw = await client.chat.completions.with_raw_response.create(
            model="gpt-4o",
            messages=MESSAGES,
            max_tokens=20,
            extra_headers={"llmquota-fallback-models": "llama-3-8b"},
        )
        assert raw.headers["llmquota-degraded-from"] == "gpt-4o"
        assert second_fake[0].requests[-1]["model"] == "llama-3-8b"
        assert fake[0].requests == []
        with pytest.raises(openai.BadRequestError) as bad:
            await client.chat.completions.create(
                model="gpt-4o",
                messages=MESSAGES,
                max_tokens=20,
                extra_headers={"llmquota-fallback-models": "mistral-large"},
            )
        assert "llmquota-fallback-models" in bad.value.message
        policy = {**GENEROUS, "fallback_models": ["mistral-large"]}
        assert (await stack.admin.put("/v1/tenants/acme/policy", json=policy)).is_success
        with pytest.raises(openai.APIStatusError) as refused:
            await client.chat.completions.create(model="gpt-4o", messages=MESSAGES, max_tokens=20)
        assert refused.value.status_code == 429  # the requested model's refusal, as a 429
        assert len(second_fake[0].requests) == 1 and fake[0].requests == []
        assert [r["model"] for r in await settled(db, 1)] == ["llama-3-8b"]
        assert await db.fetchval("SELECT count(*) FROM reservations WHERE state = 'active'") == 0
