"""Several deployments of one model (LLMQUOTA_UPSTREAMS_FILE): the routing rule
picks the first, the answer names it in llmquota-upstream, and a deployment
answering 429 or 5xx hands the same reservation to the next one before the
client sees an error; through the official openai SDK against two fake
providers, each test ending on the ledger."""

from __future__ import annotations

from pathlib import Path

import asyncpg
import openai
import pytest

from tests.proxy.conftest import GENEROUS, ledger, settled, stack_for
from tests.proxy.fake_provider import PROMPT_TOKENS, FakeProvider, completion_tokens
from tests.proxy.test_proxy_metrics import scrape, value

MESSAGES = [{"role": "user", "content": "Say something short."}]
MAIN_KEY = "sk-main-deployment-secret-42"


def two_deployments(
    tmp_path: Path,
    main_url: str,
    azure_url: str,
    monkeypatch: pytest.MonkeyPatch,
    routing: str = "",
) -> dict[str, object]:
    """Settings with gpt-4o served by `main` then `azure` (cheaper), from the file alone."""
    monkeypatch.setenv("LQ_PROXY_TEST_MAIN_KEY", MAIN_KEY)
    path = tmp_path / "upstreams.toml"
    path.write_text(
        f"""
[[upstream]]
name = "main"
format = "openai"
base_url = "{main_url}/v1"
api_key_env = "LQ_PROXY_TEST_MAIN_KEY"
models = ["gpt-4o"]

[[upstream]]
name = "azure"
format = "openai"
base_url = "{azure_url}/v1"
api_key_env = "LQ_PROXY_TEST_MAIN_KEY"
price_factor = 0.5
models = ["gpt-4o*"]
{routing}"""
    )
    unset = {"openai_base_url": None, "openai_api_key": None}
    unset |= {"anthropic_base_url": None, "anthropic_api_key": None}
    return {"upstreams_file": str(path), "proxy_ceiling_cooldown_seconds": 30, **unset}


@pytest.mark.parametrize("failure", ["429", "500"])
@pytest.mark.parametrize("stream", [False, True])
async def test_a_deployment_answering_429_or_5xx_hands_the_request_to_the_next(
    fake: tuple[FakeProvider, str],
    *,
    second_fake: tuple[FakeProvider, str],
    database_dsn: str,
    db: asyncpg.Connection,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    failure: str,
    stream: bool,
) -> None:
    main, azure = fake[0], second_fake[0]
    main.scenario = failure
    settings = two_deployments(tmp_path, fake[1], second_fake[1], monkeypatch)
    async with stack_for(fake, database_dsn, GENEROUS, **settings) as stack:
        raw = await stack.openai().chat.completions.with_raw_response.create(
            model="gpt-4o", messages=MESSAGES, max_tokens=20, stream=stream
        )
        if stream:
            text = "".join(
                [c.choices[0].delta.content or "" async for c in raw.parse() if c.choices]
            )
        else:
            text = raw.parse().choices[0].message.content or ""
        samples = await scrape(stack)
    assert raw.status_code == 200 and raw.headers["llmquota-upstream"] == "azure"
    assert text == " w0 w1 w2"  # the second fake's words
    assert [r["model"] for r in main.requests] == ["gpt-4o"]
    assert [r["model"] for r in azure.requests] == ["gpt-4o"]
    assert value(samples, "llmquota_serving_path_total", path="second_deployment") == 1
    assert value(samples, "llmquota_serving_path_total", path="primary") == 0
    # One admission, one usage row: the first attempt was charged nothing.
    rows = await settled(db, 1)
    assert [(r["model"], r["input_tokens"], r["output_tokens"]) for r in rows] == [
        ("gpt-4o", PROMPT_TOKENS, completion_tokens(3))
    ]
    assert await db.fetchval("SELECT count(*) FROM reservations") == 1
    assert len(await ledger(db)) == 1
    # The ledger row says how it was served, as the metric does.
    assert await serving_paths(db) == ["second_deployment"]


async def serving_paths(db: asyncpg.Connection) -> list[str]:
    """The serving path of every usage row, oldest first."""
    rows = await db.fetch(
        "SELECT serving_path FROM usage_ledger WHERE entry_kind = 'usage' ORDER BY entry_id"
    )
    return [r["serving_path"] for r in rows]


async def test_the_last_deployments_429_reaches_the_client_and_cools_the_ceilings(
    fake: tuple[FakeProvider, str],
    *,
    second_fake: tuple[FakeProvider, str],
    database_dsn: str,
    db: asyncpg.Connection,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fake[0].scenario = second_fake[0].scenario = "429"
    settings = two_deployments(tmp_path, fake[1], second_fake[1], monkeypatch)
    async with stack_for(fake, database_dsn, GENEROUS, **settings) as stack:
        ceiling = {"models": ["gpt-4o"], "tokens_per_minute": 100_000}
        put = await stack.admin.put("/v1/ceilings/openai-gpt4o", json=ceiling)
        assert put.is_success, put.text
        with pytest.raises(openai.RateLimitError) as refused:
            await stack.openai().chat.completions.create(
                model="gpt-4o", messages=MESSAGES, max_tokens=20
            )
    assert refused.value.response.headers["llmquota-upstream"] == "azure"
    assert refused.value.response.headers["retry-after"] == "7"  # the provider's own
    assert len(fake[0].requests) == len(second_fake[0].requests) == 1
    # The cooldown came once, from the last deployment: the ceiling is emptied.
    tokens = await db.fetchval(
        "SELECT tokens FROM limit_layers WHERE scope = 'ceiling' AND ceiling = 'openai-gpt4o'"
    )
    assert tokens <= 0
    # Nothing was produced: the reservation released, no usage row.
    assert await settled(db, 0) == []
    assert await db.fetchval("SELECT count(*) FROM reservations") == 1


async def test_cheapest_sends_to_the_lowest_price_factor_and_order_to_the_first(
    fake: tuple[FakeProvider, str],
    *,
    second_fake: tuple[FakeProvider, str],
    database_dsn: str,
    db: asyncpg.Connection,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    main, azure = fake[0], second_fake[0]
    cheapest = '\n[[routing]]\nmodels = ["gpt-4o"]\nrule = "cheapest"\n'
    settings = two_deployments(tmp_path, fake[1], second_fake[1], monkeypatch, cheapest)
    async with stack_for(fake, database_dsn, GENEROUS, **settings) as stack:
        client = stack.openai()
        to_cheapest = await client.chat.completions.with_raw_response.create(
            model="gpt-4o", messages=MESSAGES, max_tokens=20
        )
        # No rule names gpt-4o-mini: `order`, and only azure serves it anyway.
        to_only = await client.chat.completions.with_raw_response.create(
            model="gpt-4o-mini", messages=MESSAGES, max_tokens=20
        )
    assert to_cheapest.headers["llmquota-upstream"] == "azure"
    assert to_only.headers["llmquota-upstream"] == "azure"
    assert main.requests == []
    assert [r["model"] for r in azure.requests] == ["gpt-4o", "gpt-4o-mini"]
    assert len(await settled(db, 2)) == 2
    # Without the rule, file order: main serves gpt-4o.
    settings = two_deployments(tmp_path, fake[1], second_fake[1], monkeypatch)
    async with stack_for(fake, database_dsn, GENEROUS, **settings) as stack:
        in_order = await stack.openai().chat.completions.with_raw_response.create(
            model="gpt-4o", messages=MESSAGES, max_tokens=20
        )
    assert in_order.headers["llmquota-upstream"] == "main"
    assert [r["model"] for r in main.requests] == ["gpt-4o"]
    # Each served by the first deployment its rule picked: primary.
    assert len(await settled(db, 3)) == 3
    assert await serving_paths(db) == ["primary"] * 3
