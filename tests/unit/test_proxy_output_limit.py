"""A proxied request without an output limit: the model's maximum, marked as not given,
so admission reserves the learned estimate where it has one."""

from __future__ import annotations

import json

import pytest

from llmquota.api.proxy.requests import parse
from llmquota.domain.admit_request import prepare_admit_request
from llmquota.domain.errors import InvalidRequest


def _chat(**fields: object) -> bytes:
    body = {"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}], **fields}
    return json.dumps(body).encode()


def test_a_body_without_max_tokens_takes_the_models_maximum_not_given() -> None:
    bare = parse("chat", _chat(), None)
    assert (bare.max_tokens, bare.max_tokens_given) == (16_384, False)
    configured = parse("chat", _chat(), 700)
    assert (configured.max_tokens, configured.max_tokens_given) == (700, False)
    asked = parse("chat", _chat(max_completion_tokens=300, n=2), None)
    assert (asked.max_tokens, asked.max_tokens_given) == (600, True)


def test_the_library_without_max_tokens_takes_the_models_maximum() -> None:
    request = prepare_admit_request(
        tenant="acme", model="claude-opus-4-1", input_tokens=5, estimate_factors={}
    )
    assert (request.max_tokens, request.max_tokens_given) == (32_000, False)
    given = prepare_admit_request(
        tenant="acme", model="gpt-4o", input_tokens=5, max_tokens=9, estimate_factors={}
    )
    assert (given.max_tokens, given.max_tokens_given) == (9, True)


def test_an_unknown_model_without_max_tokens_is_refused_not_guessed() -> None:
    with pytest.raises(InvalidRequest, match="give max_tokens"):
        prepare_admit_request(tenant="acme", model="llama-3", input_tokens=5, estimate_factors={})
