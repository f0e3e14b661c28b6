"""Ceiling alerts, the pure part: thresholds, samples, validation and the webhook body."""

from __future__ import annotations

import dataclasses
import uuid
from datetime import UTC, datetime
from decimal import Decimal

import pytest
from pydantic import ValidationError

from llmquota.domain.alerts import AlertEvent
from llmquota.domain.ceiling_alerts import AlertDefaults, ceiling_samples
from llmquota.domain.plans import Ceiling, ShedStep, StoredCeiling

AT = datetime(2026, 12, 3, 10, 0, tzinfo=UTC)
LADDER = [ShedStep(above=0.8, admit=["critical"]), ShedStep(above=0.95, admit=["critical"])]


def stored(
    ceiling: Ceiling, *, tokens: float | None, requests: float | None = None
) -> StoredCeiling:
    return StoredCeiling("org", ceiling, 1, tokens, requests, 0, read_at=AT)


def test_without_alert_at_each_step_of_the_ladder_alerts() -> None:
    ceiling = Ceiling(models=["gpt-4o"], tokens_per_minute=60, token_burst=1_000, shed=LADDER)
    assert ceiling.alert_thresholds == (0.8, 0.95)
    samples = ceiling_samples([stored(ceiling, tokens=150.0)], AlertDefaults())
    assert [(s.dimension, s.threshold) for s in samples] == [
        ("tokens", Decimal("0.8")),
        ("tokens", Decimal("0.95")),
    ]
    first = samples[0]
    assert first.utilization == pytest.approx(0.85)
    assert (first.usage, first.capacity) == (850, 1_000)
    assert (first.hysteresis, first.quiet_seconds, first.sampled_at) == (0.05, 60.0, AT)


def test_alert_at_wins_and_an_empty_list_watches_nothing() -> None:
    base = {"models": ["gpt-4o"], "tokens_per_minute": 60, "shed": LADDER}
    own = Ceiling(**base, alert_at=[0.5])
    assert [s.threshold for s in ceiling_samples([stored(own, tokens=0.0)], AlertDefaults())] == [
        Decimal("0.5")
    ]
    silent = Ceiling(**base, alert_at=[])
    assert ceiling_samples([stored(silent, tokens=0.0)], AlertDefaults()) == []


def test_each_bucket_the_ceiling_limits_is_a_dimension_with_its_own_utilization() -> None:
    ceiling = Ceiling(
        models=["gpt-4o"],
        tokens_per_minute=600,
        requests_per_minute=10,
        alert_at=[0.5, 0.9],
        alert_hysteresis=0.1,
        alert_quiet_seconds=5,
    )
    samples = ceiling_samples([stored(ceiling, tokens=300.0, requests=1.0)], AlertDefaults())
    assert [(s.dimension, str(s.threshold), round(s.utilization, 3)) for s in samples] == [
        ("requests", "0.5", 0.9),
        ("requests", "0.9", 0.9),
        ("tokens", "0.5", 0.5),
        ("tokens", "0.9", 0.5),
    ]
    assert {(s.hysteresis, s.quiet_seconds) for s in samples} == {(0.1, 5.0)}
    # Requests only: no token bucket, no token samples.
    requests_only = Ceiling(models=["gpt-4o"], requests_per_minute=10, alert_at=[0.5])
    only = ceiling_samples([stored(requests_only, tokens=None, requests=10.0)], AlertDefaults())
    assert [(s.dimension, s.utilization) for s in only] == [("requests", 0.0)]


def test_a_debt_counts_above_one_and_a_read_without_the_clock_is_refused() -> None:
    ceiling = Ceiling(models=["gpt-4o"], tokens_per_minute=60, alert_at=[1.0])
    [sample] = ceiling_samples([stored(ceiling, tokens=-30.0)], AlertDefaults())
    assert sample.utilization == pytest.approx(1.5)
    assert sample.usage == 90
    with pytest.raises(ValueError, match="database clock"):
        ceiling_samples([StoredCeiling("org", ceiling, 1, 0.0, None, 0)], AlertDefaults())


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        ({"alert_at": [0.9, 0.8]}, "increasing order"),
        ({"alert_at": [0.8, 0.8]}, "increasing order"),
        ({"alert_at": [0.0]}, "greater than 0"),
        ({"alert_at": [1.01]}, "less than or equal to 1"),
        ({"alert_at": [0.01] * 21}, "at most 20"),
        ({"alert_hysteresis": 0.51}, "less than or equal to 0.5"),
        ({"alert_quiet_seconds": -1.0}, "greater than or equal to 0"),
    ],
)
def test_bad_alert_settings_are_refused(fields: dict[str, object], words: str) -> None:
    with pytest.raises(ValidationError, match=words):
        Ceiling.model_validate({"models": ["gpt-4o"], "tokens_per_minute": 60, **fields})


def test_a_ceiling_alert_has_the_quota_alerts_envelope_and_its_own_words() -> None:
    event = AlertEvent(
        event_id=uuid.uuid4(),
        event_type="ceiling.utilization",
        tenant=None,
        subject="ceiling:org:tokens",
        threshold=Decimal("0.80"),
        window_start=AT,
        window_end=None,
        usage=Decimal(850),
        limit=Decimal(1_000),
        projected_exhaustion_at=None,
        payload={"ceiling": "org", "dimension": "tokens", "utilization": 0.85},
    )
    body = event.body()
    assert list(body)[:12] == [
        "id",
        "type",
        "tenant",
        "quota",
        "route",
        "unit",
        "threshold",
        "usage",
        "limit",
        "window_start",
        "window_end",
        "projected_exhaustion_at",
    ]
    assert {k: body[k] for k in list(body)[12:]} == {
        "ceiling": "org",
        "dimension": "tokens",
        "utilization": "0.85",
        "episode_start": AT.isoformat(),
    }
    assert (body["unit"], body["threshold"], body["usage"]) == ("tokens", "0.8", "850")
    # A quota's alert is as it was: no ceiling words.
    quota = dataclasses.replace(event, event_type="quota.threshold")
    assert "ceiling" not in quota.body()
