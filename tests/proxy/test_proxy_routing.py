"""Several upstreams from LLMQUOTA_UPSTREAMS_FILE, models routed to them, and
models nobody serves or nobody can bound refused before anything is reserved;
through the official SDKs, each test ending on the ledger."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anthropic
import asyncpg
import openai
import pytest

from tests.proxy.conftest import GENEROUS, ledger, settled, stack_for
from tests.proxy.fake_provider import PROMPT_TOKENS, FakeProvider, completion_tokens

MESSAGES = [{"role": "user", "content": "Say something short."}]
LOCAL_KEY = "sk-local-upstream-secret-42"
MAIN_KEY = "sk-main-upstream-secret-42"


def upstreams_file(tmp_path: Path, main_url: str, local_url: str) -> str:
    key_file = tmp_path / "local.key"
    key_file.write_text(LOCAL_KEY)
    path = tmp_path / "upstreams.toml"
    path.write_text(
        f"""
[[upstream]]
name = "main"
format = "openai"
base_url = "{main_url}/v1"
api_key_env = "LQ_PROXY_TEST_MAIN_KEY"
models = ["gpt-4o", "gpt-4o-*"]

[[upstream]]
name = "local"
format = "openai"
base_url = "{local_url}/v1"
api_key_file = "{key_file}"
read_timeout_seconds = 30
models = ["llama-*"]

[[upstream]]
name = "claude"
format = "anthropic"
base_url = "{local_url}"
api_key_file = "{key_file}"
models = ["claude-sonnet-4*"]
"""
    )
    return str(path)


def upstreams_file_only(
    tmp_path: Path, main_url: str, local_url: str, monkeypatch: pytest.MonkeyPatch
) -> dict[str, Any]:
    """Settings that serve from upstreams_file alone (the simple variables unset),
    with main's key in the environment variable the file names."""
    monkeypatch.setenv("LQ_PROXY_TEST_MAIN_KEY", MAIN_KEY)
    unset = {"openai_base_url": None, "openai_api_key": None}
    unset |= {"anthropic_base_url": None, "anthropic_api_key": None}
    return {"upstreams_file": upstreams_file(tmp_path, main_url, local_url), **unset}


async def test_models_go_to_the_upstream_that_lists_them_with_its_own_key(
    fake: tuple[FakeProvider, str],
    *,
    second_fake: tuple[FakeProvider, str],
    database_dsn: str,
    db: asyncpg.Connection,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    main, local = fake[0], second_fake[0]
    settings = upstreams_file_only(tmp_path, fake[1], second_fake[1], monkeypatch)
    async with stack_for(fake, database_dsn, GENEROUS, **settings) as stack:
        client = stack.openai()
        to_main = await client.chat.completions.create(
            model="gpt-4o-2024-08-06", messages=MESSAGES, max_tokens=20
        )
        to_local = await client.chat.completions.create(
            model="llama-3.1-8b", messages=MESSAGES, max_tokens=20
        )
        message = await stack.anthropic().messages.create(
            model="claude-sonnet-4-5", messages=MESSAGES, max_tokens=20
        )
        with pytest.raises(openai.NotFoundError) as unserved:
            # Unserved comes first: no max_tokens and no known bound would be a 400 otherwise.
            await client.chat.completions.create(model="mistral-large", messages=MESSAGES)
        with pytest.raises(anthropic.NotFoundError) as unserved_claude:
            await stack.anthropic().messages.create(
                model="claude-opus-4", messages=MESSAGES, max_tokens=20
            )
        answers = str(unserved.value.body) + str(unserved_claude.value.body)
    assert to_main.choices[0].message.content == " w0 w1 w2 w3 w4 w5"
    assert to_local.choices[0].message.content == " w0 w1 w2"
    assert message.usage.output_tokens == completion_tokens(3)
    assert [r["model"] for r in main.requests] == ["gpt-4o-2024-08-06"]
    assert [r["model"] for r in local.requests] == ["llama-3.1-8b", "claude-sonnet-4-5"]
    assert main.headers[0]["authorization"] == f"Bearer {MAIN_KEY}"
    assert local.headers[0]["authorization"] == f"Bearer {LOCAL_KEY}"
    assert local.headers[1]["x-api-key"] == LOCAL_KEY
    # The unserved models: the provider's 404, naming the model, no key, nothing reserved.
    error = unserved.value.body
    assert isinstance(error, dict) and error["code"] == "model_not_found"
    assert error["param"] == "model" and "mistral-large" in error["message"]
    assert unserved_claude.value.status_code == 404
    assert MAIN_KEY not in answers and LOCAL_KEY not in answers
    rows = await settled(db, 3)
    assert [(r["model"], r["input_tokens"], r["output_tokens"]) for r in rows] == [
        ("gpt-4o-2024-08-06", PROMPT_TOKENS, completion_tokens(6)),
        ("llama-3.1-8b", PROMPT_TOKENS, completion_tokens(3)),
        ("claude-sonnet-4-5", PROMPT_TOKENS, completion_tokens(3)),
    ]
    assert await db.fetchval("SELECT count(*) FROM reservations") == 3


async def test_a_model_without_a_bound_is_refused_not_forwarded_with_a_guess(
    fake: tuple[FakeProvider, str], database_dsn: str, db: asyncpg.Connection
) -> None:
    async with stack_for(fake, database_dsn, GENEROUS) as stack:
        client = stack.openai()
        with pytest.raises(openai.BadRequestError) as refused:
            await client.chat.completions.create(model="my-own-model", messages=MESSAGES)
        error = refused.value.body
        assert isinstance(error, dict) and error["param"] == "max_completion_tokens"
        assert "no known maximum output" in error["message"]
        # Bounded by the caller, the same model is counted (an estimate) and forwarded.
        await client.chat.completions.create(
            model="my-own-model", messages=MESSAGES, max_completion_tokens=30
        )
        assert [r["model"] for r in stack.fake.requests] == ["my-own-model"]
    rows = await settled(db, 1)
    assert [(r["input_tokens"], r["output_tokens"]) for r in rows] == [(PROMPT_TOKENS, 13)]
    estimated = await db.fetchval("SELECT input_estimated FROM reservations")
    assert estimated is True
    assert len(await ledger(db)) == 1
