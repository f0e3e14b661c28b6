"""Reservation ids made by workers during an outage are recognisable."""

from __future__ import annotations

import uuid

from llmquota.admission.policy_cache import PolicyCache
from llmquota.domain.outage_ids import is_outage_id, is_signed_outage_id, new_outage_id
from llmquota.domain.policy import Policy
from llmquota.domain.records import CachedLayer

KEY = bytes(range(32))


def test_outage_ids_are_version_8_and_postgres_ids_are_not() -> None:
    ids = {new_outage_id(KEY) for _ in range(1_000)}
    assert len(ids) == 1_000
    assert all(is_outage_id(i) and i.variant == uuid.RFC_4122 for i in ids)
    assert not any(is_outage_id(uuid.uuid4()) for _ in range(1_000))


def test_only_ids_signed_with_the_key_count_as_made_by_a_worker() -> None:
    ids = [new_outage_id(KEY) for _ in range(1_000)]
    assert all(is_signed_outage_id(i, KEY) for i in ids)
    other_key = bytes(32)
    assert not any(is_signed_outage_id(i, other_key) for i in ids)
    # Made up in the right form: version 8, RFC 4122 variant, random otherwise.
    made_up = [
        uuid.UUID(bytes=bytes(raw))
        for raw in (bytearray(uuid.uuid4().bytes) for _ in range(1_000))
        if not raw.__setitem__(6, (raw[6] & 0x0F) | 0x80)
    ]
    assert all(is_outage_id(i) for i in made_up)
    assert not any(is_signed_outage_id(i, KEY) for i in made_up)
    # A PostgreSQL id is never taken for a signed one.
    assert not any(is_signed_outage_id(uuid.uuid4(), KEY) for _ in range(1_000))


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
