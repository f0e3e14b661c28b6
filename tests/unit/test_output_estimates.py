"""The histogram, quantile and decay maths of learned output reservations, and
what a worker reserves with them for each model a request may be admitted as."""

from __future__ import annotations

import itertools
import math
from datetime import UTC, datetime
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import TypeAdapter, ValidationError

from llmquota.admission.estimates import OutputEstimator
from llmquota.admission.policy_cache import PolicyCache
from llmquota.config import Settings
from llmquota.domain.admit_request import prepare_admit_request
from llmquota.domain.output_estimates import (
    MAX_HALF_LIVES,
    MIN_WEIGHT,
    OUTPUT_BUCKET_BOUNDS,
    OUTPUT_HALF_LIFE_SECONDS,
    FixedEstimate,
    LearnedEstimate,
    MaxTokensEstimate,
    OutputEstimate,
    OutputHistogram,
    StoredHistogram,
    bucket_of,
    bucket_top,
    decay_factor,
    output_reserve,
    parse_output_estimate,
)
from llmquota.domain.policy import Policy
from llmquota.domain.records import CachedLayer, FallbackCandidate
from llmquota.store.estimates import HistogramRead

outputs = st.integers(min_value=0, max_value=200_000)
quantiles = st.floats(min_value=0.01, max_value=1.0)


def oracle(samples: list[int], q: float) -> int:
    """The q-quantile of a sorted list: its ceil(q * n)-th smallest element."""
    ordered = sorted(samples)
    rank = max(1, math.ceil(q * len(ordered) * (1.0 - 1e-12)))
    return ordered[rank - 1]


def test_bucket_bounds_are_integer_log_linear() -> None:
    assert OUTPUT_BUCKET_BOUNDS[:12] == (0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11)
    assert OUTPUT_BUCKET_BOUNDS[-1] == 15 << 20
    for low, high in itertools.pairwise(OUTPUT_BUCKET_BOUNDS):
        assert high - low <= max(1, low // 8)  # never wider than an eighth of its lower bound


@given(outputs)
def test_every_count_falls_in_the_bucket_that_holds_it(tokens: int) -> None:
    bucket = bucket_of(tokens)
    assert OUTPUT_BUCKET_BOUNDS[bucket] <= tokens <= bucket_top(bucket)


@given(st.lists(outputs, min_size=1, max_size=300), quantiles)
def test_quantile_matches_a_sorted_list_within_one_bucket(samples: list[int], q: float) -> None:
    histogram = OutputHistogram().record(samples, now=0.0)
    estimate = histogram.quantile(q)
    truth = oracle(samples, q)
    assert estimate is not None
    # Never below the truth, and in the same bucket: above by < 1/8 of it + 1.
    assert estimate >= truth
    assert bucket_of(estimate) == bucket_of(truth)
    assert estimate < truth + truth / 8 + 1


@given(st.lists(outputs, min_size=1, max_size=100), st.lists(outputs, min_size=1, max_size=100))
def test_batches_at_the_same_moment_add_up(first: list[int], second: list[int]) -> None:
    together = OutputHistogram().record(first + second, now=5.0)
    apart = OutputHistogram().record(first, now=5.0).record(second, now=5.0)
    assert apart.samples == together.samples == len(first) + len(second)
    assert apart.weights == pytest.approx(together.weights)


def test_cold_start_has_no_quantile_and_reserves_max_tokens() -> None:
    assert OutputHistogram().quantile(0.95) is None
    learned = LearnedEstimate(strategy="learned", quantile=0.95, min_samples=50)
    assert output_reserve(learned, None, 2000).strategy == "max_tokens"
    few = OutputHistogram().record([100] * 49, now=0.0)
    assert output_reserve(learned, few, 2000) == output_reserve(None, None, 2000)
    enough = few.record([100], now=0.0)
    reserve = output_reserve(learned, enough, 2000)
    assert reserve.strategy == "learned"
    assert reserve.tokens == bucket_top(bucket_of(100))


def test_learned_and_fixed_never_exceed_max_tokens() -> None:
    histogram = OutputHistogram().record([5000] * 100, now=0.0)
    learned = LearnedEstimate(strategy="learned", min_samples=1)
    assert output_reserve(learned, histogram, 300).tokens == 300
    assert output_reserve(FixedEstimate(strategy="fixed", tokens=900), None, 300).tokens == 300
    assert output_reserve(FixedEstimate(strategy="fixed", tokens=200), None, 300).tokens == 200
    explicit = MaxTokensEstimate(strategy="max_tokens")
    assert output_reserve(explicit, histogram, 300).tokens == 300


def test_a_request_without_max_tokens_reserves_the_learned_quantile() -> None:
    histogram = OutputHistogram().record([400] * 60, now=0.0)
    reserve = output_reserve(None, histogram, 16_384, max_tokens_given=False)
    assert reserve.strategy == "learned"
    assert reserve.tokens == bucket_top(bucket_of(400))
    # Without enough samples: the model's maximum output (its max_tokens here).
    assert output_reserve(None, None, 16_384, max_tokens_given=False).tokens == 16_384


def test_decay_halves_each_half_life_and_forgets_past_the_limit() -> None:
    assert decay_factor(0.0) == 1.0
    assert decay_factor(-5.0) == 1.0
    assert decay_factor(OUTPUT_HALF_LIFE_SECONDS) == pytest.approx(0.5)
    assert decay_factor(3 * OUTPUT_HALF_LIFE_SECONDS) == pytest.approx(0.125)
    assert decay_factor((MAX_HALF_LIVES + 1) * OUTPUT_HALF_LIFE_SECONDS) == 0.0


def test_decay_follows_a_shift_in_the_distribution() -> None:
    hour = OUTPUT_HALF_LIFE_SECONDS
    histogram = OutputHistogram()
    for minute in range(600):  # ten hours of short answers, one a minute
        histogram = histogram.record([100], now=minute * 60.0)
    assert histogram.quantile(0.5) == bucket_top(bucket_of(100))
    start = 600 * 60.0
    for minute in range(240):  # then answers five times longer
        histogram = histogram.record([500], now=start + minute * 60.0)
        if histogram.quantile(0.5) == bucket_top(bucket_of(500)):
            break
    # The median moves once the new weight passes the old, decayed one: ~1 half-life.
    assert minute * 60.0 == pytest.approx(hour, rel=0.1)
    assert histogram.samples == 600 + minute + 1


def test_weights_below_the_floor_are_dropped_and_long_idle_starts_again() -> None:
    histogram = OutputHistogram().record([100] * 10, now=0.0)
    later = histogram.record([7000], now=(MAX_HALF_LIVES + 1) * OUTPUT_HALF_LIFE_SECONDS)
    assert later.samples == 1  # forgotten: min_samples counts again from here
    assert later.effective_samples == 1.0
    assert all(w == 0.0 or w >= MIN_WEIGHT for w in later.weights)
    assert later.quantile(0.5) == bucket_top(bucket_of(7000))


def test_the_policy_field_takes_exactly_the_three_shapes() -> None:
    adapter: TypeAdapter[MaxTokensEstimate | LearnedEstimate | FixedEstimate] = TypeAdapter(
        OutputEstimate
    )
    learned = adapter.validate_python({"strategy": "learned"})
    assert learned == LearnedEstimate(strategy="learned", quantile=0.95, min_samples=50)
    assert adapter.validate_python({"strategy": "fixed", "tokens": 300}).tokens == 300  # type: ignore[union-attr]
    for bad in (
        {"strategy": "guess"},
        {"strategy": "fixed"},
        {"strategy": "fixed", "tokens": -1},
        {"strategy": "learned", "quantile": 1.5},
        {"strategy": "learned", "min_samples": 0},
        {"strategy": "max_tokens", "tokens": 3},
    ):
        with pytest.raises(ValidationError):
            adapter.validate_python(bad)


def test_a_stored_strategy_this_worker_does_not_know_counts_as_unset() -> None:
    assert parse_output_estimate(None) is None
    assert parse_output_estimate('{"strategy": "oracle", "magic": 1}') is None
    assert parse_output_estimate('{"strategy": "fixed", "tokens": 12}') == FixedEstimate(
        strategy="fixed", tokens=12
    )


class _Histograms:
    """The one statement OutputEstimator.refresh runs, answered from a dict."""

    def __init__(self, outputs: dict[str, list[int]]) -> None:
        self._read = HistogramRead(
            read_at=datetime.now(UTC),
            histograms=[
                StoredHistogram("acme", None, model, OutputHistogram().record(samples, now=0.0))
                for model, samples in outputs.items()
            ],
        )

    async def histograms(self, **_: Any) -> HistogramRead:
        return self._read


class _Store:
    def __init__(self, outputs: dict[str, list[int]]) -> None:
        self.estimates = _Histograms(outputs)


async def _estimator(
    policy: LearnedEstimate | FixedEstimate | None, outputs: dict[str, list[int]]
) -> tuple[OutputEstimator, PolicyCache]:
    """An estimator whose cache holds acme's histograms, acme's policy `policy`."""
    policies = PolicyCache(refresh_seconds=10.0, max_stale_seconds=60.0)
    layer = CachedLayer("tenant", "acme", None, Policy(output_estimate=policy), 1)
    policies.replace((1, 1), [layer], now=0.0)
    estimator = OutputEstimator(_Store(outputs), policies, Settings(_env_file=None))  # type: ignore[arg-type, call-arg]
    await estimator.refresh()  # loaded now: apply starts no refresh of its own
    return estimator, policies


async def test_each_explicit_fallback_reserves_its_own_models_estimate() -> None:
    """A degraded admission reserves the output of the model it admits: each
    fallback gets the quantile of its own histogram, under the request's policy
    (issue 23's leftover: it used to be the requested model's)."""
    learned = LearnedEstimate(strategy="learned", quantile=0.95, min_samples=20)
    estimator, policies = await _estimator(
        learned, {"gpt-4o": [1000] * 20, "gpt-4o-mini": [100] * 20, "o3": [5000] * 20}
    )
    request = prepare_admit_request(
        tenant="acme",
        model="gpt-4o",
        input_tokens=10,
        max_tokens=4000,
        fallback_models=["gpt-4o-mini", "gpt-4.1", "o3"],
        estimate_factors={},
    )
    applied = estimator.apply(request)
    big, small = bucket_top(bucket_of(1000)), bucket_top(bucket_of(100))
    assert (applied.output_strategy, applied.output_reserve) == ("learned", big)
    assert applied.fallbacks == (
        FallbackCandidate("gpt-4o-mini", 10, small, "learned"),
        FallbackCandidate("gpt-4.1", 10, None, "max_tokens"),  # no samples: max_tokens
        FallbackCandidate("o3", 10, 4000, "learned"),  # capped at max_tokens, as any
    )
    assert [applied.output_strategy_of(m) for m in ("gpt-4o", "gpt-4o-mini", "gpt-4.1")] == [
        "learned",
        "learned",
        "max_tokens",
    ]
    # A model of a default list (only the statement reads those) is reserved
    # as the requested one.
    assert applied.output_strategy_of("claude-3-5-haiku-latest") == "learned"
    assert estimator.apply(applied) is applied  # nothing changed: no copy

    # A fixed policy is the same for every candidate; without a policy, max_tokens.
    fixed = CachedLayer(
        "tenant",
        "acme",
        None,
        Policy(output_estimate=FixedEstimate(strategy="fixed", tokens=64)),
        2,
    )
    policies.replace((2, 1), [fixed], now=0.0)
    assert [(c.output_reserve, c.output_strategy) for c in estimator.apply(applied).fallbacks] == [
        (64, "fixed")
    ] * 3
    policies.replace((3, 1), [CachedLayer("tenant", "acme", None, Policy(), 3)], now=0.0)
    unset = estimator.apply(applied)
    assert {(c.output_reserve or 4000, c.output_strategy) for c in unset.fallbacks} == {
        (4000, "max_tokens")
    }
    assert estimator.apply(request) is request  # the request as prepared: max_tokens already
