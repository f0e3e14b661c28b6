"""The histogram, quantile and decay maths of learned output reservations."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import TypeAdapter, ValidationError

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
    bucket_of,
    bucket_top,
    decay_factor,
    output_reserve,
    parse_output_estimate,
)

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
