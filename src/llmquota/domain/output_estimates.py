"""Learned output reservations: the policy, the histogram, its quantile and decay.

Pure code. A policy's `output_estimate` chooses what admission reserves for a
request's output: `max_tokens` (the default: all of it), `learned` (a
quantile of the completions this tenant, route and model settled before,
capped at max_tokens, once `min_samples` of them exist) or `fixed` N.

The statistics are a histogram per (tenant, route, model) with log-spaced
buckets, kept by the database at settlement (sql/estimates.sql) with the
same arithmetic as `record` below: every bucket of a key decays by half each
`OUTPUT_HALF_LIFE_SECONDS`, then each new sample adds 1 to its bucket. A
bucket's bounds are integers (`OUTPUT_BUCKET_BOUNDS`): 0, then for each
power of two 2^e eight equal steps of 2^e / 8, so a bucket is never wider
than an eighth of its lower bound (exactly 1 token below 8). A quantile read
from the histogram is the largest count of its bucket: never below the true
quantile of the samples, and above it by less than 1/8 of it plus 1.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, Literal, NamedTuple, TypedDict

from pydantic import BaseModel, ConfigDict, Field, StrictFloat, TypeAdapter

from llmquota.domain.json_numbers import WholeNumber

OutputStrategy = Literal["max_tokens", "learned", "fixed"]
OUTPUT_STRATEGIES: tuple[OutputStrategy, ...] = ("max_tokens", "learned", "fixed")

# Steps per power of two, and the largest exponent with buckets of its own:
# counts from 15 << 20 (about 15.7 million) up share the last bucket.
SUB_BUCKETS = 8
MAX_EXPONENT = 23
# Half the weight of every sample is gone after this long: a shift in a
# route's completions is followed within a few hours. Equals
# lq_output_half_life_seconds() of sql/estimates.sql (a test checks).
OUTPUT_HALF_LIFE_SECONDS = 3_600.0
# Decay is applied for at most this many half-lives at once: a key idle for
# longer starts again from its new samples.
MAX_HALF_LIVES = 60.0
# A decayed weight below this counts as nothing (and can never underflow).
MIN_WEIGHT = 1e-9
DEFAULT_QUANTILE = 0.95
DEFAULT_MIN_SAMPLES = 50
MAX_MIN_SAMPLES = 1_000_000
# A fixed reservation's ceiling: validation.MAX_TOKEN_COUNT (which imports
# policy.py, which imports this module).
MAX_FIXED_TOKENS = 10_000_000


def _bounds() -> tuple[int, ...]:
    found = {0}
    for exponent in range(MAX_EXPONENT + 1):
        for step in range(SUB_BUCKETS):
            found.add(((SUB_BUCKETS + step) << exponent) // SUB_BUCKETS)
    return tuple(sorted(found))


# The lower bound of each bucket, in order: what lq_output_bucket_bounds() returns.
OUTPUT_BUCKET_BOUNDS: tuple[int, ...] = _bounds()
OUTPUT_BUCKETS = len(OUTPUT_BUCKET_BOUNDS)


def bucket_of(tokens: int) -> int:
    """The bucket (0-based) a completion of `tokens` falls in; negatives count as 0.

    SQL: width_bucket(tokens, lq_output_bucket_bounds()) - 1.
    """
    return bisect.bisect_right(OUTPUT_BUCKET_BOUNDS, max(tokens, 0)) - 1


def bucket_top(bucket: int) -> int:
    """The largest count in a bucket (the last one's: twice its lower bound)."""
    if bucket + 1 < OUTPUT_BUCKETS:
        return OUTPUT_BUCKET_BOUNDS[bucket + 1] - 1
    return OUTPUT_BUCKET_BOUNDS[-1] * 2


def decay_factor(
    elapsed_seconds: float, half_life_seconds: float = OUTPUT_HALF_LIFE_SECONDS
) -> float:
    """What is left of a weight after `elapsed_seconds` (never more than 1)."""
    half_lives = max(elapsed_seconds, 0.0) / half_life_seconds
    if half_lives > MAX_HALF_LIVES:
        return 0.0
    return float(2.0**-half_lives)


def merge(weights: Sequence[float], factor: float, counts: Sequence[float]) -> tuple[float, ...]:
    """Decay `weights` by `factor`, then add `counts`, bucket by bucket.

    SQL: lq_output_merge. Decayed weights under MIN_WEIGHT become 0.
    """
    size = max(len(weights), len(counts))
    merged = []
    for i in range(size):
        old = weights[i] * factor if i < len(weights) else 0.0
        if old < MIN_WEIGHT:
            old = 0.0
        merged.append(old + (counts[i] if i < len(counts) else 0.0))
    return tuple(merged)


def bucket_counts(samples: Sequence[int]) -> tuple[float, ...]:
    """A batch of samples as counts per bucket, up to the highest bucket used."""
    if not samples:
        return ()
    indices = [bucket_of(s) for s in samples]
    counts = [0.0] * (max(indices) + 1)
    for i in indices:
        counts[i] += 1.0
    return tuple(counts)


@dataclass(frozen=True, slots=True)
class OutputHistogram:
    """The decayed completions of one (tenant, route, model), as of `updated_at`.

    `weights[i]` is bucket i's decayed weight at `updated_at` (seconds, any
    clock). `samples` counts the samples recorded (not decayed) since the
    histogram last decayed to nothing: a key idle for about 30 half-lives
    forgets its past and starts counting again, so min_samples is met by
    samples that still weigh.
    """

    weights: tuple[float, ...] = ()
    samples: int = 0
    updated_at: float = 0.0

    @property
    def effective_samples(self) -> float:
        """The decayed number of samples (what the quantile weighs)."""
        return math.fsum(self.weights)

    def record(self, outputs: Sequence[int], now: float) -> OutputHistogram:
        """The histogram after a batch of samples settled at `now` (what SQL does)."""
        if not outputs:
            return self
        factor = decay_factor(now - self.updated_at) if self.samples else 1.0
        forgotten = not any(merge(self.weights, factor, ()))
        return OutputHistogram(
            weights=merge(self.weights, factor, bucket_counts(outputs)),
            samples=len(outputs) + (0 if forgotten else self.samples),
            updated_at=max(self.updated_at, now),
        )

    def quantile(self, q: float) -> int | None:
        """The q-quantile's bucket top; None for an empty histogram.

        The smallest bucket whose cumulative weight reaches q of the total,
        so for unit weights the bucket of the ceil(q * n)-th smallest sample.
        """
        total = math.fsum(self.weights)
        if total <= 0.0:
            return None
        target = q * total * (1.0 - 1e-12)
        cumulative = 0.0
        for i, weight in enumerate(self.weights):
            cumulative += weight
            if weight > 0.0 and cumulative >= target:
                return bucket_top(i)
        return bucket_top(max(i for i, w in enumerate(self.weights) if w > 0.0))


class MaxTokensEstimate(BaseModel):
    """Reserve the whole max_tokens (today's behaviour, and the default)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    strategy: Literal["max_tokens"]


class LearnedEstimate(BaseModel):
    """Reserve a quantile of past completions, capped at max_tokens, once enough exist."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    strategy: Literal["learned"]
    quantile: Annotated[StrictFloat, Field(gt=0.0, le=1.0)] = DEFAULT_QUANTILE
    min_samples: Annotated[int, WholeNumber(ge=1, le=MAX_MIN_SAMPLES)] = DEFAULT_MIN_SAMPLES


class FixedEstimate(BaseModel):
    """Reserve N output tokens, capped at max_tokens."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    strategy: Literal["fixed"]
    tokens: Annotated[int, WholeNumber(ge=0, le=MAX_FIXED_TOKENS)]


OutputEstimate = Annotated[
    MaxTokensEstimate | LearnedEstimate | FixedEstimate, Field(discriminator="strategy")
]
DEFAULT_LEARNED = LearnedEstimate(strategy="learned")


_ESTIMATE_ADAPTER: TypeAdapter[MaxTokensEstimate | LearnedEstimate | FixedEstimate] = TypeAdapter(
    OutputEstimate
)


def parse_output_estimate(
    text: str | None,
) -> MaxTokensEstimate | LearnedEstimate | FixedEstimate | None:
    """A stored `output_estimate` (JSON text), or None when unset or not understood.

    A strategy this worker does not know yet (a newer release stored it)
    counts as unset: the request reserves max_tokens, never less.
    """
    if not text:
        return None
    try:
        return _ESTIMATE_ADAPTER.validate_json(text)
    except ValueError:
        return None


class OutputEstimateInfo(TypedDict):
    """What an admission says it reserved for output: `{"strategy": ..., "tokens": N}`."""

    strategy: OutputStrategy
    tokens: int


class OutputReserve(NamedTuple):
    """What admission reserves for a request's output, and by which strategy
    (a NamedTuple: one is built per admission, see domain/records.py)."""

    strategy: OutputStrategy
    tokens: int


def output_reserve(
    policy: MaxTokensEstimate | LearnedEstimate | FixedEstimate | None,
    histogram: OutputHistogram | None,
    max_tokens: int,
    *,
    max_tokens_given: bool = True,
) -> OutputReserve:
    """The output tokens to reserve for a request under its layers' policy.

    Never more than max_tokens. `learned` without `min_samples` (see
    OutputHistogram.samples) reserves max_tokens, and says so. A request
    that gave no max_tokens (its max_tokens is then the model's maximum
    output) reserves the learned quantile whatever the policy, unless the
    policy is `fixed`.
    """
    if policy is None or isinstance(policy, MaxTokensEstimate):
        if max_tokens_given:
            return OutputReserve("max_tokens", max_tokens)
        policy = DEFAULT_LEARNED
    if isinstance(policy, FixedEstimate):
        return OutputReserve("fixed", min(policy.tokens, max_tokens))
    if histogram is not None and histogram.samples >= policy.min_samples:
        learned = histogram.quantile(policy.quantile)
        if learned is not None:
            return OutputReserve("learned", min(learned, max_tokens))
    return OutputReserve("max_tokens", max_tokens)


@dataclass(frozen=True, slots=True)
class StoredHistogram:
    """One (tenant, route, model) histogram as the database holds it."""

    tenant: str
    route: str | None
    model: str
    histogram: OutputHistogram

    @property
    def key(self) -> tuple[str, str | None, str]:
        """What the worker cache is keyed by."""
        return (self.tenant, self.route, self.model)
