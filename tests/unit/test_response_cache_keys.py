"""The response cache's pure parts: its policy, its keys, its signature."""

from __future__ import annotations

import math
import random
from decimal import Decimal
from typing import Any

import pytest
from pydantic import ValidationError

from llmquota.domain.response_cache import (
    SIGNATURE_BITS,
    SIGNATURE_MAX_DISTANCE,
    CachePolicy,
    context_key,
    cosine,
    exact_key,
    is_sampled,
    last_user_text,
    parse_cache_policy,
    signature,
    unit,
)
from tests.support import vector_at_cosine

CHAT = {"model": "gpt-4o", "temperature": 0, "messages": [{"role": "user", "content": "Hi there"}]}


def test_the_exact_key_ignores_member_order_and_answer_neutral_members() -> None:
    reordered = {"messages": CHAT["messages"], "temperature": 0, "model": "gpt-4o"}
    neutral = {**CHAT, "user": "u-1", "metadata": {"a": 1}, "stream_options": {"x": 1}}
    assert exact_key("chat", "gpt-4o", CHAT) == exact_key("chat", "gpt-4o", reordered)
    assert exact_key("chat", "gpt-4o", CHAT) == exact_key("chat", "gpt-4o", neutral)
    assert exact_key("chat", "gpt-4o", CHAT) == exact_key(
        "chat", "gpt-4o", {**CHAT, "stream": False}
    )


@pytest.mark.parametrize(
    "change",
    [
        {"temperature": 0.5},
        {"max_tokens": 10},
        {"messages": [{"role": "user", "content": "Hi there!"}]},
        {"stream": True},
        {"tools": []},
    ],
)
def test_the_exact_key_changes_with_what_changes_the_answer(change: dict[str, object]) -> None:
    assert exact_key("chat", "gpt-4o", CHAT) != exact_key("chat", "gpt-4o", {**CHAT, **change})


def test_the_exact_key_names_the_endpoint_and_the_model() -> None:
    assert exact_key("chat", "gpt-4o", CHAT) != exact_key("chat", "gpt-4o-mini", CHAT)
    assert exact_key("chat", "gpt-4o", CHAT) != exact_key("messages", "gpt-4o", CHAT)


def test_the_context_leaves_out_the_last_user_turn_only() -> None:
    def context(body: dict[str, Any], embedding_model: str = "e") -> bytes:
        return context_key("chat", "m", body, embedding_model)

    paraphrase = {**CHAT, "messages": [{"role": "user", "content": "Hello there"}]}
    assert context(CHAT) == context(paraphrase)
    system = {**CHAT, "messages": [{"role": "system", "content": "Be terse"}, *CHAT["messages"]]}
    assert context(CHAT) != context(system)
    assert context(CHAT) != context({**CHAT, "max_tokens": 5})
    # The last turn's other members, and the embedding model, are context too.
    named = {**CHAT, "messages": [{"role": "user", "content": "Hi there", "name": "bob"}]}
    assert context(CHAT) != context(named)
    assert context(CHAT) != context(CHAT, embedding_model="other")


@pytest.mark.parametrize(
    ("body", "sampled"),
    [
        ({}, True),
        ({"temperature": 1}, True),
        ({"temperature": 0}, False),
        ({"temperature": 0.0}, False),
    ],
)
def test_a_request_without_temperature_0_samples(body: dict[str, object], sampled: bool) -> None:
    assert is_sampled(body) is sampled


def test_the_last_user_turn_is_its_text() -> None:
    assert last_user_text(CHAT) == "Hi there"
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    assert last_user_text({"messages": [{"role": "user", "content": parts}]}) == "a\nb"
    image = [{"type": "image_url", "image_url": {"url": "x"}}, {"type": "text", "text": "a"}]
    assert last_user_text({"messages": [{"role": "user", "content": image}]}) is None
    assert last_user_text({"messages": [{"role": "assistant", "content": "x"}]}) is None
    assert last_user_text({}) is None


def test_the_policy_checks_its_members() -> None:
    policy = CachePolicy(mode="semantic", embedding_model="text-embedding-3-small")
    assert (policy.ttl_seconds, policy.max_entries, policy.similarity) == (3600, 1000, 0.92)
    with pytest.raises(ValidationError, match="embedding_model is required"):
        CachePolicy(mode="semantic")
    with pytest.raises(ValidationError, match="only for mode semantic"):
        CachePolicy(mode="exact", embedding_model="e")
    for bad in ({"similarity": 0.0}, {"similarity": 1.5}, {"ttl_seconds": 0}, {"max_entries": 0}):
        with pytest.raises(ValidationError):
            CachePolicy.model_validate({"mode": "exact", **bad})
    with pytest.raises(ValidationError):
        CachePolicy.model_validate({"mode": "exact", "hit_price_usd": "0.0000001"})
    assert CachePolicy(mode="exact", hit_price_usd=Decimal("0.25")).hit_price_usd == Decimal("0.25")


def test_a_stored_policy_this_worker_does_not_understand_caches_nothing() -> None:
    assert parse_cache_policy('{"mode": "exact", "ttl_seconds": 5}') == CachePolicy(
        mode="exact", ttl_seconds=5
    )
    assert parse_cache_policy('{"mode": "fuzzy"}') is None
    assert parse_cache_policy(None) is None


def test_unit_vectors_and_cosine() -> None:
    assert cosine(unit([3.0, 4.0]), unit([3.0, 4.0])) == pytest.approx(1.0)
    assert cosine(unit([1.0, 0.0]), unit([0.0, 2.0])) == 0.0
    assert cosine([1.0], [1.0, 0.0]) == 0.0
    with pytest.raises(ValueError):
        unit([0.0, 0.0])
    with pytest.raises(ValueError):
        unit([math.inf, 1.0])


def _distance(a: int, b: int) -> int:
    return bin((a ^ b) & ((1 << SIGNATURE_BITS) - 1)).count("1")


def test_the_signature_keeps_near_pairs_and_drops_unrelated_ones() -> None:
    """The prefilter's promise, measured: 200 pairs at cosine 0.92 (the default
    similarity) all within the cut; 200 unrelated pairs almost all outside it."""
    rng = random.Random(1)
    near_kept = far_kept = 0
    for _ in range(200):
        a = unit([rng.gauss(0.0, 1.0) for _ in range(384)])
        near_kept += (
            _distance(signature(a), signature(vector_at_cosine(a, 0.92, rng)))
            <= SIGNATURE_MAX_DISTANCE
        )
        b = unit([rng.gauss(0.0, 1.0) for _ in range(384)])
        far_kept += _distance(signature(a), signature(b)) <= SIGNATURE_MAX_DISTANCE
    assert near_kept == 200
    assert far_kept <= 4


def test_the_signature_is_a_signed_64_bit_integer_and_deterministic() -> None:
    vector = unit([float(i % 7) - 3.0 for i in range(100)])
    assert signature(vector) == signature(list(vector))
    assert -(1 << 63) <= signature(vector) < (1 << 63)
