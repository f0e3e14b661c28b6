"""The decision latency histogram reads exactly as prometheus_client's own Histogram."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Histogram, generate_latest

from llmquota.metrics import DECISION_BUCKETS_SECONDS, LatencyHistogram

# On a bound, between bounds, past the last one.
OBSERVED_SECONDS = (0.0001, 0.0005, 0.0007, 0.03, 0.25, 3.0, 0.0)


def exposition(registry: CollectorRegistry) -> list[str]:
    """The text format without the creation time (it differs by construction)."""
    text = generate_latest(registry).decode()
    return [line for line in text.splitlines() if not line.startswith("llmquota_x_created")]


def test_the_same_observations_read_as_the_same_series() -> None:
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    latency = LatencyHistogram("llmquota_x", "doc", DECISION_BUCKETS_SECONDS, ours)
    reference = Histogram("llmquota_x", "doc", registry=theirs, buckets=DECISION_BUCKETS_SECONDS)
    assert exposition(ours) == exposition(theirs)
    for seconds in OBSERVED_SECONDS:
        latency.observe(seconds)
        reference.observe(seconds)
    assert exposition(ours) == exposition(theirs)
    assert ours.get_sample_value("llmquota_x_count") == len(OBSERVED_SECONDS)
    assert ours.get_sample_value("llmquota_x_created") is not None
