"""What the proxy refuses before anything is reserved or forwarded, how it
authenticates, what it reserves, and the `cancel` hang-up mode; over the raw
wire where an SDK would refuse the input itself."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import asyncpg
import httpx
import pytest

from llmquota.domain.errors import StoreUnavailable
from tests.proxy.conftest import ADMIN_KEY, Stack, ledger, settled, stack_for
from tests.proxy.fake_provider import PROMPT_TOKENS, PROVIDER_KEY, FakeProvider, completion_tokens

MESSAGES = [{"role": "user", "content": "Say something short."}]


async def post(stack: Stack, path: str, body: Any, **headers: str) -> httpx.Response:
    auth = {"authorization": f"Bearer {stack.key}"}
    content = body if isinstance(body, bytes) else None
    return await stack.admin.post(
        path,
        content=content,
        json=None if content is not None else body,
        headers={**auth, **headers},
    )


async def nothing_happened(stack: Stack, db: asyncpg.Connection) -> None:
    assert stack.fake.requests == []
    assert await db.fetchval("SELECT count(*) FROM reservations") == 0
    assert await ledger(db) == []


@pytest.mark.parametrize(
    ("body", "status", "says"),
    [
        (b'{"model": "gpt-4o", "messages": [', 400, "not valid JSON"),
        (b"[1, 2]", 400, "JSON object"),
        ({"messages": MESSAGES}, 400, "'model'"),
        ({"model": "gpt-4o", "messages": MESSAGES, "stream": "yes"}, 400, "'stream'"),
        ({"model": "gpt-4o", "messages": MESSAGES, "stream": 1}, 400, "'stream'"),
        ({"model": "gpt-4o", "messages": MESSAGES, "n": 0}, 400, "'n'"),
        ({"model": "gpt-4o", "messages": MESSAGES, "n": "2"}, 400, "'n'"),
        ({"model": "gpt-4o", "messages": MESSAGES, "n": 129}, 400, "'n'"),
        ({"model": "gpt-4o", "messages": MESSAGES, "max_tokens": -1}, 400, "'max_tokens'"),
        ({"model": "my-own-model", "messages": MESSAGES}, 400, "LLMQUOTA_PROXY_DEFAULT"),
        ({"model": "gpt-4o", "messages": "hi"}, 400, "'messages'"),
        # Model names follow llmquota.domain.names: 400 before any upstream lookup.
        ({"model": "gpt 4o", "messages": MESSAGES}, 400, "'model' must be"),
        ({"model": "gpt-4o\nforged", "messages": MESSAGES}, 400, "'model' must be"),
        ({"model": "gpt-4o\u001b[2J", "messages": MESSAGES}, 400, "'model' must be"),
        ({"model": "=HYPERLINK(1)", "messages": MESSAGES}, 400, "'model' must be"),
        ({"model": "m" * 201, "messages": MESSAGES}, 400, "'model' must be"),
    ],
)
async def test_bad_input_is_refused_in_openai_format_with_nothing_reserved(
    stack: Stack, db: asyncpg.Connection, body: Any, status: int, says: str
) -> None:
    response = await post(stack, "/v1/chat/completions", body)
    assert response.status_code == status
    error = response.json()["error"]
    assert says in error["message"] and error["type"] == "invalid_request_error"
    assert error["param"] is None or error["param"] in error["message"]  # names the field
    await nothing_happened(stack, db)


@pytest.mark.parametrize(
    ("override", "says"),
    [
        ({"stream": 1}, "'stream'"),
        ({"model": "claude\tsonnet"}, "'model' must be"),
        ({"model": "claude-sonnet-4\u0007"}, "'model' must be"),
    ],
)
async def test_bad_input_is_refused_in_anthropic_format(
    stack: Stack, db: asyncpg.Connection, override: dict[str, Any], says: str
) -> None:
    body = {"model": "claude-sonnet-4", "messages": MESSAGES, "max_tokens": 5, **override}
    response = await post(stack, "/v1/messages", body)
    assert response.status_code == 400
    assert response.json()["type"] == "error"
    assert response.json()["error"]["type"] == "invalid_request_error"
    assert says in response.json()["error"]["message"]
    await nothing_happened(stack, db)


async def test_keys_as_each_sdk_sends_them_and_wrong_ones(
    stack: Stack, db: asyncpg.Connection
) -> None:
    body = {"model": "gpt-4o", "messages": MESSAGES, "max_tokens": 5}
    as_api_key = await stack.admin.post(
        "/v1/chat/completions", json=body, headers={"authorization": "", "x-api-key": stack.key}
    )
    assert as_api_key.status_code == 200, as_api_key.text
    wrong = await stack.admin.post(
        "/v1/messages", json=body, headers={"authorization": "", "x-api-key": "lq_wrong"}
    )
    assert wrong.status_code == 401
    assert wrong.json()["error"]["type"] == "authentication_error"
    admin = await stack.admin.post(
        "/v1/chat/completions", json=body, headers={"authorization": f"Bearer {ADMIN_KEY}"}
    )
    assert admin.status_code == 403
    assert admin.json()["error"]["code"] == "permission_denied"
    rows = await settled(db, 1)
    assert [(r["input_tokens"], r["output_tokens"]) for r in rows] == [(PROMPT_TOKENS, 13)]
    assert len(stack.fake.requests) == 1


async def test_route_header_and_n_completions_are_reserved(
    stack: Stack, db: asyncpg.Connection
) -> None:
    await stack.admin.put("/v1/tenants/acme/routes/batch/policy", json={"max_in_flight": 4})
    body = {"model": "gpt-4o", "messages": MESSAGES, "max_tokens": 10}
    one = await post(stack, "/v1/chat/completions", body, **{"llmquota-route": "batch"})
    three = await post(stack, "/v1/chat/completions", {**body, "n": 3})
    assert one.status_code == three.status_code == 200
    rows = await settled(db, 2)
    reserved = await db.fetch("SELECT route, reserved_tokens FROM usage_ledger ORDER BY entry_id")
    assert [r["route"] for r in reserved] == ["batch", None]
    assert reserved[1]["reserved_tokens"] - reserved[0]["reserved_tokens"] == 20
    assert [r["output_tokens"] for r in rows] == [13, 13]


async def test_without_max_tokens_the_models_maximum_or_the_setting_is_reserved(
    fake: tuple[FakeProvider, str], database_dsn: str, db: asyncpg.Connection
) -> None:
    policy = {"tokens_per_minute": 600_000, "token_burst": 200_000}
    body = {"model": "gpt-4o", "messages": MESSAGES}
    async with stack_for(fake, database_dsn, policy) as stack:
        assert (await post(stack, "/v1/chat/completions", body)).status_code == 200
    async with stack_for(fake, database_dsn, policy, proxy_default_max_tokens=500) as stack:
        assert (await post(stack, "/v1/chat/completions", body)).status_code == 200
    rows = await db.fetch("SELECT reserved_tokens, output_tokens FROM usage_ledger")
    assert rows[0]["reserved_tokens"] - rows[1]["reserved_tokens"] == 16_384 - 500
    assert [r["output_tokens"] for r in rows] == [13, 13]


async def test_too_large_is_413_that_the_sdks_do_not_retry(
    fake: tuple[FakeProvider, str], database_dsn: str, db: asyncpg.Connection
) -> None:
    policy = {"tokens_per_minute": 1_000, "token_burst": 100}
    async with stack_for(fake, database_dsn, policy) as stack:
        body = {"model": "claude-sonnet-4", "messages": MESSAGES, "max_tokens": 500}
        response = await post(stack, "/v1/messages", body)
        assert response.status_code == 413
        assert response.headers["x-should-retry"] == "false"
        assert response.json()["error"]["type"] == "request_too_large"
        await nothing_happened(stack, db)


async def test_an_unconfigured_upstream_is_404_naming_the_variables(
    fake: tuple[FakeProvider, str], database_dsn: str, db: asyncpg.Connection
) -> None:
    unset = {"anthropic_base_url": None, "anthropic_api_key": None}
    async with stack_for(fake, database_dsn, {"max_in_flight": 2}, **unset) as stack:
        body = {"model": "claude-sonnet-4", "messages": MESSAGES, "max_tokens": 5}
        response = await post(stack, "/v1/messages", body)
        assert response.status_code == 404
        message = response.json()["error"]["message"]
        assert "LLMQUOTA_ANTHROPIC_BASE_URL" in message
        assert "LLMQUOTA_ANTHROPIC_API_KEY" in message
        assert response.json()["error"]["type"] == "not_found_error"
        proxy = stack.app.state.proxy  # as if only Anthropic were configured
        proxy.configs = tuple(c for c in proxy.configs if c.format != "openai")
        openai_answer = await post(stack, "/v1/embeddings", {"model": "x", "input": "a"})
        assert openai_answer.status_code == 404
        assert openai_answer.json()["error"]["code"] == "not_configured"
        assert "LLMQUOTA_OPENAI_BASE_URL" in openai_answer.json()["error"]["message"]
        paths = (await stack.admin.get("/openapi.json")).json()["paths"]
        assert "/v1/chat/completions" in paths and "/v1/messages" not in paths
        await nothing_happened(stack, db)


async def test_cancel_mode_closes_upstream_and_settles_the_output_counted_so_far(
    fake: tuple[FakeProvider, str], database_dsn: str, db: asyncpg.Connection
) -> None:
    policy = {"max_in_flight": 2}
    async with stack_for(fake, database_dsn, policy, proxy_disconnect="cancel") as stack:
        stack.fake.words, stack.fake.delay = 40, 0.03
        stream = await stack.openai().chat.completions.create(
            model="gpt-4o", messages=MESSAGES, max_tokens=100, stream=True
        )
        seen = 0
        async for _chunk in stream:
            seen += 1
            if seen == 3:
                break
        await stream.close()
        rows = await settled(db, 1)
        assert stack.fake.streams_finished == 0
        assert len(rows) == 1 and rows[0]["outcome"] == "cancelled"
        assert 0 < rows[0]["output_tokens"] < completion_tokens(40)
        assert rows[0]["input_tokens"] > 0  # llmquota's own count: the provider never said


async def test_the_provider_key_reaches_no_client_and_no_log(
    stack: Stack, db: asyncpg.Connection, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    answers: list[str] = []
    for scenario, stream in [("ok", False), ("ok", True), ("500", False), ("401", True)]:
        stack.fake.scenario = scenario
        body = {"model": "gpt-4o", "messages": MESSAGES, "max_tokens": 5, "stream": stream}
        response = await post(stack, "/v1/chat/completions", body)
        answers.append(str(response.headers) + response.text)
    stack.fake.scenario = "die_mid_stream"
    body = {"model": "claude-sonnet-4", "messages": MESSAGES, "max_tokens": 50, "stream": True}
    response = await post(stack, "/v1/messages", body)
    answers.append(response.text)
    assert "event: error" in answers[-1]
    rows = await settled(db, 3)
    assert [r["outcome"] for r in rows] == ["ok", "ok", "error"]
    assert all(PROVIDER_KEY not in answer for answer in answers)
    assert PROVIDER_KEY not in caplog.text


async def test_a_drain_is_cut_short_at_its_bound_and_settles_what_was_counted(
    fake: tuple[FakeProvider, str], database_dsn: str, db: asyncpg.Connection
) -> None:
    async with stack_for(fake, database_dsn, {"max_in_flight": 2}, proxy_drain_seconds=0.2) as s:
        s.fake.words, s.fake.delay = 60, 0.05  # three seconds: far past the bound
        stream = await s.anthropic().messages.create(
            model="claude-sonnet-4", messages=MESSAGES, max_tokens=500, stream=True
        )
        seen = 0
        async for _event in stream:
            seen += 1
            if seen == 4:
                break
        await stream.close()
        rows = await settled(db, 1)
        assert s.fake.streams_finished == 0
        assert len(rows) == 1 and rows[0]["outcome"] == "cancelled"
        assert rows[0]["input_tokens"] == PROMPT_TOKENS  # message_start said so
        assert 0 < rows[0]["output_tokens"] < completion_tokens(60)


async def test_concurrent_calls_of_both_sdks_settle_once_each(
    stack: Stack, db: asyncpg.Connection
) -> None:
    stack.fake.delay = 0.01
    openai_client, anthropic_client = stack.openai(), stack.anthropic()

    async def streamed() -> str:
        stream = await openai_client.chat.completions.create(
            model="gpt-4o", messages=MESSAGES, max_tokens=20, stream=True
        )
        return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

    async def whole() -> str:
        message = await anthropic_client.messages.create(
            model="claude-sonnet-4", messages=MESSAGES, max_tokens=20
        )
        block = message.content[0]
        return block.text if block.type == "text" else ""

    # Ten at once: the tenant's max_in_flight.
    texts = await asyncio.gather(*[streamed() for _ in range(5)], *[whole() for _ in range(5)])
    assert set(texts) == {" w0 w1 w2 w3 w4 w5"}
    rows = await settled(db, 10)
    assert len(rows) == 10
    assert len({r["reservation_id"] for r in rows}) == 10
    assert {(r["input_tokens"], r["output_tokens"], r["outcome"]) for r in rows} == {
        (PROMPT_TOKENS, 13, "ok")
    }


async def test_a_limiter_outage_is_a_503_in_the_providers_format(
    stack: Stack, db: asyncpg.Connection, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def down(*_args: object, **_kwargs: object) -> None:
        raise StoreUnavailable("database gave no decision within 250 ms")

    # What the proxy calls for a request that does not ask to wait.
    monkeypatch.setattr(stack.app.state.limiter.waiting, "decide_at_once", down)
    body = {"model": "gpt-4o", "messages": MESSAGES, "max_tokens": 5}
    openai_answer = await post(stack, "/v1/chat/completions", body)
    anthropic_answer = await post(stack, "/v1/messages", body)
    assert openai_answer.status_code == anthropic_answer.status_code == 503
    assert openai_answer.json()["error"]["type"] == "server_error"
    assert anthropic_answer.json()["error"]["type"] == "api_error"
    assert openai_answer.headers["retry-after"] == "1"
    await nothing_happened(stack, db)


async def test_a_running_stream_holds_its_in_flight_permit_not_the_workers_fair_share(
    fake: tuple[FakeProvider, str], database_dsn: str, db: asyncpg.Connection
) -> None:
    # Two requests of a tenant at a time per worker; ten in flight allowed.
    policy = {"max_in_flight": 10}
    async with stack_for(fake, database_dsn, policy, tenant_max_in_progress=2) as stack:
        stack.fake.words, stack.fake.delay = 20, 0.1  # two seconds each
        client = stack.openai()

        async def open_stream() -> Any:
            return await client.chat.completions.create(
                model="gpt-4o", messages=MESSAGES, max_tokens=50, stream=True
            )

        # All four start while the first two are still streaming.
        streams = [await asyncio.wait_for(open_stream(), 1.5) for _ in range(4)]
        for stream in streams:
            assert len([chunk async for chunk in stream]) == 22
        rows = await settled(db, 4)
        assert [r["output_tokens"] for r in rows] == [completion_tokens(20)] * 4
