"""Proxy settings and the pure parts of proxy mode: the output table, the
reading of requests, and the key that must never reach an error."""

from __future__ import annotations

import pydantic
import pytest

from llmquota.api.proxy.requests import BadProxyRequest, parse
from llmquota.api.proxy.stream import event_data
from llmquota.config import Settings
from llmquota.domain.model_limits import max_output_tokens


def settings(**values: object) -> Settings:
    return Settings(_env_file=None, **values)  # type: ignore[call-arg]


@pytest.mark.parametrize("given", ["openai_api_key", "anthropic_base_url"])
def test_an_upstream_needs_both_url_and_key_and_the_error_hides_the_key(given: str) -> None:
    with pytest.raises(pydantic.ValidationError) as refused:
        settings(**{given: "sk-do-not-print-me"})
    assert "sk-do-not-print-me" not in str(refused.value)
    assert "is set without" in str(refused.value)


def test_the_provider_key_is_secret_in_the_settings() -> None:
    configured = settings(openai_base_url="http://127.0.0.1:1/v1", openai_api_key="sk-hidden")
    assert "sk-hidden" not in repr(configured) and "sk-hidden" not in str(configured)
    assert configured.proxy_disconnect == "drain"


def test_model_maximum_output_by_longest_prefix() -> None:
    assert max_output_tokens("gpt-4o-2024-08-06") == 16_384
    assert max_output_tokens("gpt-4-0613") == 8_192
    assert max_output_tokens("gpt-4-turbo-preview") == 4_096
    assert max_output_tokens("claude-opus-4-5-20251101") == 64_000
    assert max_output_tokens("claude-opus-4-1") == 32_000
    assert max_output_tokens("llama-3") is None


def test_reading_requests() -> None:
    chat = parse(
        "chat",
        b'{"model": "gpt-4o", "messages": [{"role": "user", "content": [{"type": "text",'
        b' "text": "hi"}, {"type": "image_url", "image_url": {"url": "data:..."}}]}],'
        b' "max_completion_tokens": 7, "max_tokens": 99, "n": 2}',
        None,
    )
    assert chat.max_tokens == 14  # max_completion_tokens wins, times n
    image = {"type": "image_url", "image_url": {"url": "data:..."}}
    assert chat.messages == [{"role": "user", "content": ["hi", image]}]  # priced, not encoded
    claude = parse(
        "messages",
        b'{"model": "claude-3-5-haiku", "system": "be brief", "messages": []}',
        None,
    )
    assert claude.max_tokens == 8_192
    assert claude.messages == [{"role": "system", "content": ["be brief"]}]
    assert parse("chat", b'{"model": "x", "messages": []}', 300).max_tokens == 300
    with pytest.raises(BadProxyRequest) as bad:
        parse("embeddings", b'{"model": "x", "input": "a", "stream": true}', None)
    assert bad.value.status == 400 and bad.value.param == "stream"


def test_event_data() -> None:
    assert event_data(b'event: ping\ndata: {"type": "ping"}\n\n') == {"type": "ping"}
    assert event_data(b"data: [DONE]\n\n") is None
    assert event_data(b": keep-alive\n\n") is None
