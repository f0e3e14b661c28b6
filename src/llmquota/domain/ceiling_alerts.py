"""Provider ceiling alerts: which thresholds each ceiling is watched at, and the samples.

Pure. The detector of every worker (llmquota.admin.ceiling_alerts) reads the
ceilings with their balances at one moment of the database clock
(get_ceilings, the statement /v1/ceilings and the utilization gauges read)
and turns them here into samples: one per ceiling, dimension (its token and
its request bucket, each it limits) and threshold, with the utilization of
that bucket, 1 - balance / capacity. What a sample does to its episode is
decided by one guarded upsert in SQL (record_ceiling_samples in
sql/alerts_queries.sql), so two workers racing decide it once:

- no episode open and utilization >= threshold: an episode opens at the
  sample's time, and its alert goes into the outbox in the same statement;
- an episode open and utilization below threshold - hysteresis (or the
  bucket idle, utilization 0): the first such sample notes when; a sample
  at least the quiet time after that, with every sample between below too,
  ends the episode;
- anything else in an open episode (above, or dipping less than the
  hysteresis) keeps it open and forgets a run of samples below.

A ceiling read with a cell away (over cells, `StoredCeiling.estimated`) has
a utilization at most the truth: a sample of it at or above a threshold is
certain and counts, one below is not and is left out (an episode is not
ended, nor a run of samples below begun, by a cell's outage).

A crossing that begins and ends between two samples is not seen: samples
are LLMQUOTA_CEILING_ALERT_INTERVAL_SECONDS apart (1 s), and a bucket refills
at most its rate per minute, so a ceiling stays near a threshold it reached
for longer than that unless a whole burst refills in a second.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal

from llmquota.domain.plans import StoredCeiling
from llmquota.domain.vocabulary import Dimension


@dataclass(frozen=True, slots=True)
class AlertDefaults:
    """The hysteresis and quiet time of ceilings that set none (the settings)."""

    hysteresis: float = 0.05
    quiet_seconds: float = 60.0


@dataclass(frozen=True, slots=True)
class CeilingSample:
    """One bucket of one ceiling against one threshold, at one moment of the database clock."""

    ceiling: str
    dimension: Dimension
    threshold: Decimal
    utilization: float
    level: float
    capacity: int
    hysteresis: float
    quiet_seconds: float
    sampled_at: datetime

    @property
    def usage(self) -> int:
        """What the bucket has in use (capacity - balance), whole, for the alert's `usage`."""
        return max(0, round(self.capacity - self.level))


def ceiling_samples(
    ceilings: Iterable[StoredCeiling], defaults: AlertDefaults
) -> list[CeilingSample]:
    """The samples of every ceiling read, in (ceiling, dimension, threshold) order: the
    order the upsert locks their state rows in, the same in every worker."""
    samples = []
    for stored in ceilings:
        if stored.read_at is None:
            raise ValueError(f"ceiling {stored.name!r} was read without the database clock")
        ceiling = stored.ceiling
        hysteresis = (
            ceiling.alert_hysteresis
            if ceiling.alert_hysteresis is not None
            else defaults.hysteresis
        )
        quiet = (
            ceiling.alert_quiet_seconds
            if ceiling.alert_quiet_seconds is not None
            else defaults.quiet_seconds
        )
        buckets: list[tuple[Dimension, float | None, int | None, float | None]] = [
            (
                "requests",
                stored.requests,
                ceiling.effective_request_burst,
                stored.request_utilization,
            ),
            ("tokens", stored.tokens, ceiling.effective_token_burst, stored.utilization),
        ]
        for dimension, level, capacity, utilization in buckets:
            if level is None or capacity is None or utilization is None:
                continue
            for threshold in sorted({_decimal(t) for t in ceiling.alert_thresholds}):
                if stored.estimated and utilization < float(threshold):
                    continue
                samples.append(
                    CeilingSample(
                        ceiling=stored.name,
                        dimension=dimension,
                        threshold=threshold,
                        utilization=utilization,
                        level=level,
                        capacity=capacity,
                        hysteresis=hysteresis,
                        quiet_seconds=quiet,
                        sampled_at=stored.read_at,
                    )
                )
    samples.sort(key=lambda s: (s.ceiling, s.dimension, s.threshold))
    return samples


def _decimal(fraction: float) -> Decimal:
    """A threshold as the outbox stores it: the shortest decimal of the float (0.8, not
    0.8000000000000000444)."""
    return Decimal(repr(fraction))
