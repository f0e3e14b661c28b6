"""A key's own limits hold on the proxy too, through the official SDKs: a model
the key may not use is the provider's 403 naming it, the key's token bucket
refuses with the provider's 429, and neither reaches the provider; the
tenant's other key is not limited by them."""

from __future__ import annotations

import anthropic
import asyncpg
import openai
import pytest

from tests.proxy.conftest import Stack

MESSAGES = [{"role": "user", "content": "hello"}]


async def test_a_keys_models_and_tokens_bind_on_the_proxy(
    stack: Stack, db: asyncpg.Connection
) -> None:
    body = {"models": ["gpt-4o-mini", "claude-*"], "tokens_per_minute": 1, "token_burst": 300}
    created = await stack.admin.post("/v1/tenants/acme/keys", json=body)
    assert created.status_code == 201, created.text
    limited = stack.openai(api_key=created.json()["key"])
    calls = len(stack.fake.requests)

    with pytest.raises(openai.PermissionDeniedError) as denied:
        await limited.chat.completions.create(model="gpt-4o", messages=MESSAGES, max_tokens=5)
    assert denied.value.status_code == 403 and "'gpt-4o'" in denied.value.message

    # 200 output tokens plus the prompt: the first fits the key's 300, the second not.
    done = await limited.chat.completions.create(
        model="gpt-4o-mini", messages=MESSAGES, max_tokens=200
    )
    assert done.choices[0].message.content
    with pytest.raises(openai.RateLimitError) as limited_out:
        await limited.chat.completions.create(
            model="gpt-4o-mini", messages=MESSAGES, max_tokens=290
        )
    assert limited_out.value.status_code == 429
    assert len(stack.fake.requests) == calls + 1  # only the admitted one went upstream

    claude = stack.anthropic(api_key=created.json()["key"])
    with pytest.raises(anthropic.RateLimitError):  # the same key's bucket, other provider
        await claude.messages.create(
            model="claude-3-5-sonnet-latest", messages=MESSAGES, max_tokens=290
        )
    # The tenant's own key: neither limit applies.
    other = await stack.openai().chat.completions.create(
        model="gpt-4o", messages=MESSAGES, max_tokens=290
    )
    assert other.choices[0].message.content
    row = await db.fetchrow(
        "SELECT tokens, in_flight FROM limit_layers WHERE api_key_id = $1", created.json()["id"]
    )
    assert row["in_flight"] == 0  # settled from the usage the provider reported
    used = await db.fetchval(
        "SELECT input_tokens + output_tokens FROM usage_ledger"
        " WHERE entry_kind = 'usage' AND model = 'gpt-4o-mini'"
    )
    assert row["tokens"] == pytest.approx(300 - used, abs=0.5)  # refill: 1 token a minute
