"""Provider ceilings scoped to one deployment (a ceiling's `upstream`), through the
official openai SDK against two fake providers (`main` then `azure`, from
LLMQUOTA_UPSTREAMS_FILE):

- under 200 concurrent requests, exactly as many as each deployment's scoped
  ceiling holds are served there, `main` first and the spillover by `azure`
  (journaled `second_deployment`), and the rest are refused by llmquota
  before any provider sees them;
- `least_utilized` sends each request to the deployment whose scoped ceiling
  has the most room, so equal requests alternate, every one `primary`;
- a deployment's 429 hands the request to the next by a decision of its own:
  the first reservation released, the next deployment's ceiling charged once,
  only the refusing deployment's ceiling cooled;
- a ceiling with no `upstream` bounds every deployment of its models.

Ceilings refill at 1 token a minute (but the 429 test's `main`, whose cool-down
is measured in its refill), so nothing refills during a test: every balance
asserted is what admissions and settlements left."""

from __future__ import annotations

import asyncio
from collections import Counter
from pathlib import Path
from typing import Any

import asyncpg
import openai
import pytest
from openai._legacy_response import LegacyAPIResponse
from openai.types.chat import ChatCompletion, ChatCompletionMessageParam

from tests.proxy.conftest import GENEROUS, Stack, ledger, settled, stack_for
from tests.proxy.fake_provider import PROMPT_TOKENS, FakeProvider, completion_tokens
from tests.proxy.test_proxy_deployments import serving_paths, two_deployments
from tests.proxy.test_proxy_metrics import scrape, value

# The tenant's own limits never bind: 200 requests at once may be in flight.
POLICY = {**GENEROUS, "max_in_flight": 1_000}
MAX_TOKENS = 20
MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Say something short."}]
LEAST_UTILIZED = '\n[[routing]]\nmodels = ["gpt-4o*"]\nrule = "least_utilized"\n'


async def put_ceiling(stack: Stack, name: str, burst: int, upstream: str | None) -> None:
    """A ceiling on gpt-4o of `burst` tokens refilling 1 a minute, scoped to `upstream`."""
    ceiling: dict[str, Any] = {"models": ["gpt-4o"], "tokens_per_minute": 1, "token_burst": burst}
    if upstream is not None:
        ceiling["upstream"] = upstream
    put = await stack.admin.put(f"/v1/ceilings/{name}", json=ceiling)
    assert put.is_success, put.text


async def ceiling_tokens(db: asyncpg.Connection, name: str) -> float:
    tokens = await db.fetchval(
        "SELECT tokens FROM limit_layers WHERE scope = 'ceiling' AND ceiling = $1", name
    )
    return float(tokens)


async def ask(stack: Stack) -> LegacyAPIResponse[ChatCompletion]:
    """One chat completion of gpt-4o; the raw answer (headers and status)."""
    return await stack.openai().chat.completions.with_raw_response.create(
        model="gpt-4o", messages=MESSAGES, max_tokens=MAX_TOKENS
    )


async def probe(stack: Stack, db: asyncpg.Connection, *fakes: FakeProvider) -> asyncpg.Record:
    """One request before any ceiling exists: its reservation (id, input, reserved).
    From then on the fakes report exactly what was reserved, so a settlement gives
    nothing back to a ceiling and each request costs a ceiling `reserved_tokens`."""
    await ask(stack)
    (row,) = await db.fetch(
        "SELECT reservation_id, input_tokens, reserved_tokens FROM reservations"
    )
    assert len(await settled(db, 1)) == 1
    output = row["reserved_tokens"] - row["input_tokens"]
    for provider in fakes:
        provider.usage = {"prompt_tokens": row["input_tokens"], "completion_tokens": output}
    return row


def refused_by_llmquota(outcome: object) -> bool:
    """A 429 of llmquota's own: a refusal names no deployment that answered."""
    return (
        isinstance(outcome, openai.RateLimitError)
        and outcome.status_code == 429
        and "llmquota-upstream" not in outcome.response.headers
        and "ceiling" in outcome.message
    )


async def test_spillover_is_exact_under_200_concurrent_requests(
    fake: tuple[FakeProvider, str],
    *,
    second_fake: tuple[FakeProvider, str],
    database_dsn: str,
    db: asyncpg.Connection,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    main, azure = fake[0], second_fake[0]
    fits_main, fits_azure, asked = 23, 37, 200
    settings = two_deployments(tmp_path, fake[1], second_fake[1], monkeypatch)
    async with stack_for(fake, database_dsn, POLICY, **settings) as stack:
        first = await probe(stack, db, main, azure)
        cost = first["reserved_tokens"]
        await put_ceiling(stack, "main-gpt4o", fits_main * cost, "main")
        await put_ceiling(stack, "azure-gpt4o", fits_azure * cost, "azure")
        client = stack.openai()
        outcomes = await asyncio.gather(
            *(
                client.chat.completions.with_raw_response.create(
                    model="gpt-4o", messages=MESSAGES, max_tokens=MAX_TOKENS
                )
                for _ in range(asked)
            ),
            return_exceptions=True,
        )
        rows = await settled(db, 1 + fits_main + fits_azure)
        samples = await scrape(stack)
    served = Counter(
        o.headers["llmquota-upstream"] for o in outcomes if not isinstance(o, BaseException)
    )
    assert served == {"main": fits_main, "azure": fits_azure}
    refused = [o for o in outcomes if isinstance(o, BaseException)]
    assert len(refused) == asked - fits_main - fits_azure
    assert all(refused_by_llmquota(o) for o in refused), repr(refused[:3])
    # No provider saw a request beyond its ceiling (main also served the probe).
    assert (len(main.requests), len(azure.requests)) == (1 + fits_main, fits_azure)
    journaled = await db.fetch(
        "SELECT upstream, state, serving_path, count(*) AS n FROM reservations"
        " WHERE reservation_id <> $1 GROUP BY 1, 2, 3",
        first["reservation_id"],
    )
    assert {(r["upstream"], r["state"], r["serving_path"]): r["n"] for r in journaled} == {
        ("main", "settled", None): fits_main,
        ("azure", "settled", "second_deployment"): fits_azure,
    }
    assert len(rows) == 1 + fits_main + fits_azure
    # Each settled exactly what it reserved (the probe, first, its own usage).
    assert all(r["input_tokens"] + r["output_tokens"] == cost for r in rows[1:])
    assert Counter(await serving_paths(db)) == {
        "primary": 1 + fits_main,
        "second_deployment": fits_azure,
    }
    assert value(samples, "llmquota_serving_path_total", path="primary") == 1 + fits_main
    assert value(samples, "llmquota_serving_path_total", path="second_deployment") == fits_azure
    assert value(samples, "llmquota_serving_path_total", path="rejected") == len(refused)
    # Both ceilings are spent to less than one request, and no further.
    for name in ("main-gpt4o", "azure-gpt4o"):
        assert 0 <= await ceiling_tokens(db, name) < 1, name


async def test_least_utilized_alternates_between_equal_scoped_ceilings(
    fake: tuple[FakeProvider, str],
    *,
    second_fake: tuple[FakeProvider, str],
    database_dsn: str,
    db: asyncpg.Connection,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    main, azure = fake[0], second_fake[0]
    azure.words = main.words  # each request costs either deployment the same
    cost = PROMPT_TOKENS + completion_tokens(main.words)
    settings = two_deployments(tmp_path, fake[1], second_fake[1], monkeypatch, LEAST_UTILIZED)
    chosen: list[str] = []
    async with stack_for(fake, database_dsn, GENEROUS, **settings) as stack:
        await put_ceiling(stack, "main-gpt4o", 10_000, "main")
        await put_ceiling(stack, "azure-gpt4o", 10_000, "azure")
        for n in range(1, 11):
            chosen.append((await ask(stack)).headers["llmquota-upstream"])
            assert len(await settled(db, n)) == n
            counts = Counter(chosen)
            assert abs(counts["main"] - counts["azure"]) <= 1, chosen
        samples = await scrape(stack)
    # Ties go to the file's first: main, then the one with more room, in turn.
    assert chosen == ["main", "azure"] * 5
    assert (len(main.requests), len(azure.requests)) == (5, 5)
    for name in ("main-gpt4o", "azure-gpt4o"):
        assert await ceiling_tokens(db, name) == pytest.approx(10_000 - 5 * cost, abs=1)
    # Balancing is the rule's choice, not a spill: every request is primary.
    assert await serving_paths(db) == ["primary"] * 10
    assert value(samples, "llmquota_serving_path_total", path="primary") == 10
    assert value(samples, "llmquota_serving_path_total", path="second_deployment") == 0


async def test_a_429_hands_over_to_the_next_scoped_ceiling_charging_it_once(
    fake: tuple[FakeProvider, str],
    *,
    second_fake: tuple[FakeProvider, str],
    database_dsn: str,
    db: asyncpg.Connection,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    main, azure = fake[0], second_fake[0]
    main.scenario = "429"  # retry-after: 7
    settings = two_deployments(tmp_path, fake[1], second_fake[1], monkeypatch)
    async with stack_for(fake, database_dsn, GENEROUS, **settings) as stack:
        # main's refills 100 tokens a second: its cool-down debits 7 s of it.
        ceiling = {"models": ["gpt-4o"], "tokens_per_minute": 6_000, "token_burst": 10_000}
        put = await stack.admin.put("/v1/ceilings/main-gpt4o", json={**ceiling, "upstream": "main"})
        assert put.is_success, put.text
        await put_ceiling(stack, "azure-gpt4o", 10_000, "azure")
        raw = await ask(stack)
        text = raw.parse().choices[0].message.content
        rows = await settled(db, 1)
        samples = await scrape(stack)
    assert raw.status_code == 200 and raw.headers["llmquota-upstream"] == "azure"
    assert text == " w0 w1 w2"
    assert (len(main.requests), len(azure.requests)) == (1, 1)
    journal = await db.fetch(
        "SELECT upstream, state, reserved_tokens, charged_tokens FROM reservations"
        " ORDER BY created_at"
    )
    assert [(r["upstream"], r["state"]) for r in journal] == [
        ("main", "released"),
        ("azure", "settled"),
    ]
    used = PROMPT_TOKENS + completion_tokens(3)
    assert journal[1]["charged_tokens"] == used
    # One usage row, from the deployment that answered.
    assert [(r["input_tokens"], r["output_tokens"]) for r in rows] == [
        (PROMPT_TOKENS, completion_tokens(3))
    ]
    assert len(await ledger(db)) == 1
    assert await serving_paths(db) == ["second_deployment"]
    assert value(samples, "llmquota_serving_path_total", path="second_deployment") == 1
    # azure's ceiling is debited by what was used, once, and not cooled.
    assert await ceiling_tokens(db, "azure-gpt4o") == pytest.approx(10_000 - used, abs=0.5)
    # main's is cooled: emptied and 7 s of refill (700) debited, after its
    # reservation was released (a give-back after it would refill it).
    assert await ceiling_tokens(db, "main-gpt4o") == pytest.approx(-700, abs=1)


async def test_a_ceiling_without_upstream_bounds_every_deployment(
    fake: tuple[FakeProvider, str],
    *,
    second_fake: tuple[FakeProvider, str],
    database_dsn: str,
    db: asyncpg.Connection,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    main, azure = fake[0], second_fake[0]
    settings = two_deployments(tmp_path, fake[1], second_fake[1], monkeypatch)
    async with stack_for(fake, database_dsn, GENEROUS, **settings) as stack:
        cost = (await probe(stack, db, main, azure))["reserved_tokens"]
        await put_ceiling(stack, "main-gpt4o", cost, "main")  # one request
        await put_ceiling(stack, "azure-gpt4o", 100 * cost, "azure")
        await put_ceiling(stack, "gpt4o-account", 2 * cost, None)  # two, anywhere
        first, second = await ask(stack), await ask(stack)
        with pytest.raises(openai.RateLimitError) as third:
            await ask(stack)
        await settled(db, 3)
    assert [first.headers["llmquota-upstream"], second.headers["llmquota-upstream"]] == [
        "main",
        "azure",
    ]
    # azure's own ceiling has room for 99 more, but the account's is spent.
    assert refused_by_llmquota(third.value)
    assert (len(main.requests), len(azure.requests)) == (2, 1)  # main also served the probe
    assert await ceiling_tokens(db, "azure-gpt4o") == pytest.approx(99 * cost, abs=0.5)
    assert 0 <= await ceiling_tokens(db, "gpt4o-account") < 1
