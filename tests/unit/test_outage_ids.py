"""Reservation ids made by workers during an outage are recognisable."""

from __future__ import annotations

import uuid

from llmquota.admission.outage import is_outage_id, new_outage_id
from llmquota.admission.policy_cache import PolicyCache
from llmquota.domain.policy import Policy
from llmquota.domain.records import CachedLayer


def test_outage_ids_are_version_8_and_postgres_ids_are_not() -> None:
    ids = {new_outage_id() for _ in range(1_000)}
    assert len(ids) == 1_000
    assert all(is_outage_id(i) and i.variant == uuid.RFC_4122 for i in ids)
    assert not any(is_outage_id(uuid.uuid4()) for _ in range(1_000))


def test_policy_cache_finds_the_layers_of_a_request_and_ages() -> None:
    cache = PolicyCache(refresh_seconds=10, max_stale_seconds=60)
    assert cache.due(0.0) and not cache.usable(0.0)
    layers = [
        CachedLayer("global", None, None, Policy(tokens_per_minute=10), 1),
        CachedLayer("tenant", "acme", None, Policy(failure_mode="open"), 2),
        CachedLayer("route", "acme", "chat", Policy(max_in_flight=2), 3),
    ]
    cache.replace((3, 3), layers, now=100.0)
    assert cache.complete and not cache.due(105.0) and cache.due(110.0)
    found = cache.layers_for("acme", "chat")
    assert found is not None and [layer.scope for layer in found] == ["global", "tenant", "route"]
    assert cache.layers_for("acme", None) == layers[:2]
    assert cache.layers_for("nobody", None) is None
    assert cache.usable(160.0) and not cache.usable(161.0)
    cache.confirm(200.0)
    assert cache.usable(250.0)
    cache.replace((9, 5), layers, now=300.0)
    assert not cache.complete  # 3 of 5 layers: the cap was hit
