"""Policy validation: what a layer may be configured with, before it is stored."""

from __future__ import annotations

import json
import math
import re
from decimal import Decimal
from typing import Any

import pytest
from pydantic import ValidationError

from llmquota.admission.policy_cache import PolicyCache
from llmquota.domain.policy import (
    DEFAULT_LEASE_SECONDS,
    MAX_IN_FLIGHT,
    MAX_LEASE_SECONDS,
    MAX_REQUESTS_PER_MINUTE,
    MAX_TOKENS_PER_MINUTE,
    CallWeight,
    Policy,
    call_weight,
)
from llmquota.domain.records import CachedLayer
from llmquota.domain.response_cache import (
    DEFAULT_MAX_ENTRIES,
    DEFAULT_TTL_SECONDS,
    HIT_PRICE_PATTERN,
    MAX_ENTRIES,
    MAX_HIT_PRICE_USD,
    MAX_TTL_SECONDS,
    CachePolicy,
    parse_cache_policy,
)

FIELDS = [
    "tokens_per_minute",
    "token_burst",
    "requests_per_minute",
    "request_burst",
    "max_in_flight",
    "lease_seconds",
]

# The rate each burst needs beside it, so that only the value under test is wrong.
COMPANION = {
    "token_burst": {"tokens_per_minute": 100},
    "request_burst": {"requests_per_minute": 10},
}

MAXIMUM = {
    "tokens_per_minute": MAX_TOKENS_PER_MINUTE,
    "token_burst": MAX_TOKENS_PER_MINUTE,
    "requests_per_minute": MAX_REQUESTS_PER_MINUTE,
    "request_burst": MAX_REQUESTS_PER_MINUTE,
    "max_in_flight": MAX_IN_FLIGHT,
    "lease_seconds": MAX_LEASE_SECONDS,
}


def _policy(field: str, value: Any) -> Policy:
    return Policy(**{**COMPANION.get(field, {}), field: value})


@pytest.mark.parametrize("field", FIELDS)
@pytest.mark.parametrize(
    "value",
    [
        -1,
        0,
        1.5,
        math.nan,
        math.inf,
        True,
        False,
        "100",
        [100],
        2**63,
    ],
    ids=[
        "negative",
        "zero",
        "fraction",
        "nan",
        "inf",
        "true",
        "false",
        "str",
        "list",
        "2^63",
    ],
)
def test_bad_values_are_rejected(field: str, value: Any) -> None:
    with pytest.raises(ValidationError):
        _policy(field, value)


@pytest.mark.parametrize("field", FIELDS)
def test_one_above_each_ceiling_is_rejected(field: str) -> None:
    with pytest.raises(ValidationError):
        _policy(field, MAXIMUM[field] + 1)


@pytest.mark.parametrize("field", FIELDS)
def test_each_ceiling_and_one_are_accepted(field: str) -> None:
    assert getattr(_policy(field, MAXIMUM[field]), field) == MAXIMUM[field]
    assert getattr(_policy(field, 1), field) == 1


def test_ceilings_are_the_documented_figures() -> None:
    assert MAX_TOKENS_PER_MINUTE == 10_000_000_000
    assert MAX_REQUESTS_PER_MINUTE == 100_000_000
    assert MAX_IN_FLIGHT == 1_000_000
    assert MAX_LEASE_SECONDS == 86_400


def test_token_burst_without_a_rate_is_rejected() -> None:
    with pytest.raises(ValidationError, match="token_burst needs tokens_per_minute"):
        Policy(token_burst=1_000)


def test_request_burst_without_a_rate_is_rejected() -> None:
    with pytest.raises(ValidationError, match="request_burst needs requests_per_minute"):
        Policy(request_burst=10)


@pytest.mark.parametrize("extra", ["tokens_per_second", "burst", "capacity", "max_tokens"])
def test_unknown_fields_are_rejected(extra: str) -> None:
    with pytest.raises(ValidationError):
        Policy(**{"tokens_per_minute": 100, extra: 5})


def test_empty_policy_means_no_limits_and_the_default_lease() -> None:
    policy = Policy()
    assert policy.model_dump() == {
        "tokens_per_minute": None,
        "token_burst": None,
        "requests_per_minute": None,
        "request_burst": None,
        "max_in_flight": None,
        "lease_seconds": 120,
        "failure_mode": "closed",
        "output_estimate": None,
        "request_cost": None,
        "uses_concurrency": None,
        "cache": None,
        "admission": None,
    }
    assert DEFAULT_LEASE_SECONDS == 120
    assert policy.resolved() == policy


def test_bursts_default_to_one_minute_of_refill_when_resolved() -> None:
    policy = Policy(tokens_per_minute=100_000, requests_per_minute=4_000)
    assert policy.token_burst is None
    assert policy.request_burst is None
    resolved = policy.resolved()
    assert resolved.token_burst == 100_000
    assert resolved.request_burst == 4_000
    assert resolved.tokens_per_minute == 100_000
    assert resolved.requests_per_minute == 4_000
    assert policy.effective_token_burst == 100_000
    assert policy.effective_request_burst == 4_000


def test_explicit_bursts_are_kept_whether_smaller_or_larger_than_the_rate() -> None:
    policy = Policy(
        tokens_per_minute=100_000, token_burst=250_000, requests_per_minute=60, request_burst=5
    )
    resolved = policy.resolved()
    assert (resolved.token_burst, resolved.request_burst) == (250_000, 5)


def test_resolved_policy_is_still_valid_and_idempotent() -> None:
    resolved = Policy(tokens_per_minute=7, max_in_flight=3, lease_seconds=30).resolved()
    assert Policy.model_validate(resolved.model_dump()) == resolved
    assert resolved.resolved() == resolved
    assert (resolved.max_in_flight, resolved.lease_seconds) == (3, 30)


def test_policy_is_frozen() -> None:
    policy = Policy(tokens_per_minute=100)
    with pytest.raises(ValidationError):
        policy.tokens_per_minute = 200  # type: ignore[misc]


def test_json_with_fractions_or_strings_is_rejected() -> None:
    # 100.0 is the integer 100, as JSON Schema (and so the OpenAPI document) reads it.
    assert Policy.model_validate_json('{"tokens_per_minute": 100.0}').tokens_per_minute == 100
    with pytest.raises(ValidationError):
        Policy.model_validate_json('{"tokens_per_minute": 100.5}')
    with pytest.raises(ValidationError):
        Policy.model_validate_json('{"tokens_per_minute": "100"}')
    with pytest.raises(ValidationError):
        Policy.model_validate_json('{"tokens_per_minute": NaN}')
    assert Policy.model_validate_json('{"tokens_per_minute": 100}').tokens_per_minute == 100


def test_a_calls_weight_is_its_routes_else_its_tenants_else_one_request_and_a_permit() -> None:
    tenant = Policy(request_cost=3, uses_concurrency=False)
    assert call_weight({}) == CallWeight(1, 1)
    assert call_weight({"tenant": tenant}) == CallWeight(3, 0)
    assert call_weight({"tenant": tenant, "route": Policy()}) == CallWeight(3, 0)
    assert call_weight({"tenant": tenant, "route": Policy(request_cost=0)}) == CallWeight(0, 0)
    assert call_weight({"route": Policy(uses_concurrency=True), "tenant": tenant}) == (3, 1)
    for bad in ({"request_cost": -1}, {"request_cost": 10_001}, {"uses_concurrency": 1}):
        with pytest.raises(ValueError, match=r"request_cost|uses_concurrency"):
            Policy(**bad)  # type: ignore[arg-type]


SEMANTIC = {"mode": "semantic", "embedding_model": "text-embedding-3-small"}


def test_a_policys_cache_is_checked_and_stored_as_it_is_answered() -> None:
    assert Policy().cache is None
    policy = Policy.model_validate({"cache": {**SEMANTIC, "hit_price_usd": "0.50"}})
    assert policy.cache is not None and policy.cache.hit_price_usd == Decimal("0.5")
    # The stored form (jsonb) and the answer: the price a decimal string without
    # trailing zeros, every default written out; read back, the same policy.
    dumped = policy.model_dump(mode="json")["cache"]
    assert dumped == {
        **SEMANTIC,
        "ttl_seconds": DEFAULT_TTL_SECONDS,
        "max_entries": DEFAULT_MAX_ENTRIES,
        "similarity": 0.92,
        "sampled": False,
        "serve_when_exhausted": True,
        "hit_price_usd": "0.5",
    }
    assert parse_cache_policy(json.dumps(dumped)) == policy.cache
    assert Policy.model_validate({"cache": dumped}) == policy
    # A Decimal given in Python is taken as it is.
    assert CachePolicy(mode="exact", hit_price_usd=Decimal("2")).hit_price_usd == 2
    for bad in (
        {"mode": "semantic"},
        {"mode": "exact", "embedding_model": "m"},
        {**SEMANTIC, "similarity": 0.0},
        {**SEMANTIC, "similarity": 1.5},
        {"mode": "exact", "ttl_seconds": 0},
        {"mode": "exact", "ttl_seconds": MAX_TTL_SECONDS + 1},
        {"mode": "exact", "max_entries": MAX_ENTRIES + 1},
        {"mode": "exact", "hit_price_usd": 0.5},  # money is a string
        {"mode": "exact", "hit_price_usd": "1e-4"},
        {"mode": "exact", "hit_price_usd": "-1"},
        {"mode": "exact", "hit_price_usd": f"{MAX_HIT_PRICE_USD}.000001"},
        {"mode": "exact", "hit_price_usd": "0.0000001"},
        {"mode": "exact", "max_tokens": 5},
    ):
        with pytest.raises(ValidationError):
            Policy.model_validate({"cache": bad})
    assert Policy.model_validate({"cache": {"mode": "exact", "hit_price_usd": "1000.0"}})


def test_the_hit_price_pattern_is_the_validators_bound() -> None:
    """The schema's pattern states the bounds: what it allows is what the model takes."""
    for text in ("0", "0.000001", "12.5", "999.999999", "1000", "1000.000000"):
        assert re.fullmatch(HIT_PRICE_PATTERN, text), text
        taken = CachePolicy.model_validate({"mode": "exact", "hit_price_usd": text})
        assert taken.hit_price_usd == Decimal(text)
    for text in ("00", "01", "1000.000001", "1001", ".5", "5.", "1e3", " 1", "0.0000001"):
        assert not re.fullmatch(HIT_PRICE_PATTERN, text), text


def test_the_policy_cache_answers_the_routes_cache_over_the_tenants() -> None:
    cache = PolicyCache(refresh_seconds=10, max_stale_seconds=60)
    tenant = CachePolicy(mode="exact", ttl_seconds=8)
    route = CachePolicy.model_validate(SEMANTIC)
    cache.replace(
        (4, 4),
        [
            CachedLayer("global", None, None, Policy(tokens_per_minute=10), 1),
            CachedLayer("tenant", "acme", None, Policy(cache=tenant), 2),
            CachedLayer("route", "acme", "chat", Policy(cache=route), 3),
            CachedLayer("route", "acme", "plain", Policy(max_in_flight=2), 4),
            CachedLayer("tenant", "beta", None, Policy(), 5),
        ],
        now=0.0,
    )
    assert cache.cache_policy("acme", "chat") == route
    assert cache.cache_policy("acme", "plain") == tenant  # a route layer without one
    assert cache.cache_policy("acme", "other") == tenant  # no such route layer
    assert cache.cache_policy("acme", None) == tenant
    assert cache.cache_policy("beta", None) is None
    assert cache.cache_policy("nobody", "chat") is None  # not cached: cache nothing
