"""Requests that `Limiter.prepare` refuses before anything reaches the database.

`Limiter.prepare` is its TokenCounter's `prepare` (admission/counting.py), so
every case runs here without a database. That none of them writes a row, and
that `Limiter.admit` refuses each the same way, is
tests/integration/test_admission.py's `test_invalid_requests_write_no_rows`,
which walks the same table against a real PostgreSQL (and on Citus).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import pytest

from llmquota.admission.counting import TokenCounter
from llmquota.config import Settings
from llmquota.domain.errors import InvalidRequest

INVALID: list[tuple[str, dict[str, Any]]] = [
    ("negative max_tokens", {"max_tokens": -1}),
    ("max_tokens over 10M", {"max_tokens": 10_000_001}),
    ("float max_tokens", {"max_tokens": 100.0}),
    ("bool max_tokens", {"max_tokens": True}),
    ("nan max_tokens", {"max_tokens": math.nan}),
    ("string max_tokens", {"max_tokens": "100"}),
    # Without max_tokens the model's maximum output applies (model_limits.py),
    # so only a model missing there is refused.
    ("missing max_tokens, unknown model", {"max_tokens": None, "model": "llama-3"}),
    ("negative input_tokens", {"input_tokens": -5}),
    ("input_tokens over 10M", {"input_tokens": 10_000_001}),
    ("float input_tokens", {"input_tokens": 2.0}),
    ("bool input_tokens", {"input_tokens": False}),
    ("nan input_tokens", {"input_tokens": math.nan}),
    ("both messages and input_tokens", {"messages": [{"role": "user", "content": "hi"}]}),
    ("neither messages nor input_tokens", {"input_tokens": None}),
    ("empty tenant", {"tenant": ""}),
    ("tenant with a space", {"tenant": "ac me"}),
    ("tenant with a slash", {"tenant": "acme/x"}),
    ("tenant of 129 chars", {"tenant": "a" * 129}),
    ("non-ascii tenant", {"tenant": "acmé"}),
    ("tenant not a string", {"tenant": 5}),
    ("tenant None", {"tenant": None}),
    ("tenant with newline", {"tenant": "acme\n"}),
    ("tenant '..'", {"tenant": ".."}),
    ("tenant starting with a dot", {"tenant": ".acme"}),
    ("tenant with a colon", {"tenant": "acme:x"}),
    ("empty route", {"route": ""}),
    ("route with a space", {"route": "a b"}),
    ("route of 129 chars", {"route": "r" * 129}),
    ("route not a string", {"route": 7}),
    ("lease_seconds 0", {"lease_seconds": 0}),
    ("negative lease_seconds", {"lease_seconds": -1}),
    ("lease_seconds over a day", {"lease_seconds": 86_401}),
    ("bool lease_seconds", {"lease_seconds": True}),
    ("float lease_seconds", {"lease_seconds": 1.5}),
    ("empty model", {"model": ""}),
    ("model of 201 chars", {"model": "m" * 201}),
    ("model None", {"model": None}),
    ("model with a space", {"model": "gpt 4o"}),
    ("model with a newline", {"model": "gpt-4o\nforged"}),
    ("model with an escape", {"model": "gpt-4o\x1b[2J"}),
    ("model that is a formula", {"model": "=SUM(1)"}),
    ("model glob", {"model": "gpt-4o*"}),
    ("fallback model with a tab", {"fallback_models": ["gpt-4o\tmini"]}),
    ("empty idempotency key", {"idempotency_key": ""}),
    ("idempotency key of 256 chars", {"idempotency_key": "k" * 256}),
    ("idempotency key not a string", {"idempotency_key": 12}),
    ("messages a string", {"input_tokens": None, "messages": "hello"}),
    ("message content a number", {"input_tokens": None, "messages": [{"content": 1}]}),
]


@pytest.fixture(scope="module")
def counter() -> Iterator[TokenCounter]:
    counter = TokenCounter(Settings(_env_file=None))  # type: ignore[call-arg]
    yield counter
    counter.close()


@pytest.mark.parametrize(("case", "override"), INVALID, ids=[c for c, _ in INVALID])
def test_invalid_requests_are_refused_by_prepare(
    counter: TokenCounter, case: str, override: dict[str, Any]
) -> None:
    request = {"tenant": "acme", "model": "gpt-4o", "max_tokens": 100, "input_tokens": 50}
    request.update(override)
    with pytest.raises(InvalidRequest):
        counter.prepare(**request)


def test_a_valid_request_is_prepared(counter: TokenCounter) -> None:
    """The baseline every case above changes one field of is itself valid."""
    prepared = counter.prepare(tenant="acme", model="gpt-4o", max_tokens=100, input_tokens=50)
    assert (prepared.tenant, prepared.input_tokens, prepared.max_tokens) == ("acme", 50, 100)
