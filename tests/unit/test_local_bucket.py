"""The worker-local limits of failure mode `local`: pure arithmetic."""

from __future__ import annotations

import pytest

from llmquota.domain.local_bucket import (
    Bucket,
    LocalLayer,
    admit_locally,
    give_back_locally,
)
from llmquota.domain.policy import Policy


def test_bucket_refills_continuously_up_to_capacity_and_never_backwards() -> None:
    bucket = Bucket.full(capacity=100, per_minute=600, now=0.0)  # 10 a second
    bucket.balance = 0
    bucket.refill(2.5)
    assert bucket.balance == pytest.approx(25)
    bucket.refill(1.0)  # a clock that went backwards adds nothing
    assert bucket.balance == pytest.approx(25)
    bucket.refill(60.0)
    assert bucket.balance == 100


def test_wait_is_the_deficit_over_the_rate() -> None:
    bucket = Bucket.full(capacity=100, per_minute=600, now=0.0)
    bucket.balance = 40
    assert bucket.wait_ms(40) == 0
    assert bucket.wait_ms(100) == 6_000


def test_local_layer_holds_a_fraction_rounded_down() -> None:
    policy = Policy(
        tokens_per_minute=1_000, token_burst=999, requests_per_minute=10, max_in_flight=7
    )
    layer = LocalLayer.from_policy("tenant", policy, 0.25, now=0.0)
    assert layer.tokens is not None and layer.requests is not None
    assert (layer.tokens.capacity, layer.tokens.per_second) == (249, pytest.approx(250 / 60))
    assert (layer.requests.capacity, layer.max_in_flight) == (2, 1)


def test_admission_is_all_or_nothing_and_names_the_longest_wait() -> None:
    tenant = LocalLayer.from_policy("tenant", Policy(tokens_per_minute=600), 1.0, now=0.0)
    route = LocalLayer.from_policy(
        "route", Policy(tokens_per_minute=60, token_burst=150), 1.0, now=0.0
    )
    assert admit_locally([tenant, route], 100, now=0.0, concurrency_retry_ms=1_000) is None
    refusal = admit_locally([tenant, route], 100, now=0.0, concurrency_retry_ms=1_000)
    assert refusal is not None
    # The route has 50 left at 1 a second: 50 s; the tenant has plenty.
    assert (refusal.limit, refusal.scope, refusal.retry_after_ms) == ("tokens", "route", 50_000)
    assert tenant.tokens is not None and tenant.tokens.balance == 500  # not debited
    assert tenant.in_flight == route.in_flight == 1


def test_concurrency_and_give_back() -> None:
    layer = LocalLayer.from_policy(
        "tenant", Policy(tokens_per_minute=60, max_in_flight=4), 0.5, now=0.0
    )
    assert admit_locally([layer], 10, 0.0, 1_000) is None
    assert admit_locally([layer], 10, 0.0, 1_000) is None
    refusal = admit_locally([layer], 10, 0.0, 1_000)
    assert refusal is not None and refusal.limit == "concurrency"
    give_back_locally([layer], tokens=10, requests=0, now=0.0)  # a release
    assert layer.in_flight == 1
    assert layer.tokens is not None and layer.tokens.balance == 20
    give_back_locally([layer], tokens=-50, requests=0, now=0.0)  # used 60 of 10
    assert layer.tokens.balance == -30 and layer.in_flight == 0
    give_back_locally([layer], tokens=1_000, requests=0, now=0.0)
    assert layer.tokens.balance == 30  # never above capacity
