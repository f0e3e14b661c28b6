"""What a worker remembers about keys and failed authentications, and when a layer binds.

Pure bookkeeping with the time passed in, so every age is exact. The same
behaviour over real sockets and a real outage is in tests/faults/test_auth_outage.py.
"""

from __future__ import annotations

from llmquota.api.failures import FailureBudget
from llmquota.api.keycache import KeyCache
from llmquota.domain.keys import KeyOwner
from llmquota.domain.policy import Policy
from llmquota.domain.records import LayerStatus
from llmquota.domain.refusals import binding_retry_ms

ACME = KeyOwner(key_id=1, tenant="acme")


def test_a_known_key_refreshes_while_in_use_and_lasts_the_stale_window() -> None:
    cache = KeyCache(refresh_seconds=10, max_stale_seconds=100, negative_seconds=5)
    cache.confirm(b"k", ACME, now=0)
    assert cache.known(b"k", 9) == ACME
    assert not cache.claim_refresh(b"k", 9)
    # Past the refresh age: one use claims the refresh, the others do not.
    assert cache.claim_refresh(b"k", 10)
    assert not cache.claim_refresh(b"k", 15)
    # The refresh failed (an outage): the key serves until the stale window ends,
    # and a retry is claimed every refresh_seconds meanwhile.
    assert cache.known(b"k", 99) == ACME
    assert cache.claim_refresh(b"k", 20)
    assert cache.known(b"k", 100) == ACME
    assert cache.known(b"k", 100.5) is None
    assert len(cache) == 0  # too old: forgotten, to be looked up again
    # A refresh that succeeds makes it fresh again.
    cache.confirm(b"k", ACME, now=200)
    assert cache.known(b"k", 299) == ACME and not cache.claim_refresh(b"k", 209)


def test_a_refused_digest_is_remembered_for_the_negative_window() -> None:
    cache = KeyCache(refresh_seconds=10, max_stale_seconds=100, negative_seconds=5)
    cache.confirm(b"gone", ACME, now=0)
    cache.refuse(b"gone", now=1)  # deleted from the database: refused on refresh
    assert cache.known(b"gone", 1) is None
    assert cache.refused(b"gone", 5.9)
    assert not cache.refused(b"gone", 6)
    off = KeyCache(refresh_seconds=10, max_stale_seconds=100, negative_seconds=0)
    off.refuse(b"x", now=0)
    assert not off.refused(b"x", 0)


def test_the_key_maps_are_bounded() -> None:
    cache = KeyCache(refresh_seconds=10, max_stale_seconds=100, negative_seconds=5, max_entries=3)
    for i in range(5):
        cache.confirm(bytes([i]), ACME, now=i)
        cache.refuse(bytes([100 + i]), now=i)
    assert len(cache) == 3
    assert cache.known(bytes([0]), 5) is None and cache.known(bytes([4]), 5) == ACME
    assert not cache.refused(bytes([100]), 4) and cache.refused(bytes([104]), 4)


def test_failed_authentications_are_budgeted_per_client() -> None:
    budget = FailureBudget(per_second=20, burst=40, max_clients=2)
    for _ in range(40):
        assert budget.retry_after_ms("1.2.3.4", 0) is None
        assert budget.spend("1.2.3.4", 0) is None
    assert budget.retry_after_ms("1.2.3.4", 0) == 50  # one token at 20 a second
    assert budget.spend("1.2.3.4", 0) == 50  # refused, taking nothing
    # A lookup paid for up front and finding the key is paid back.
    budget.refund("1.2.3.4", 0)
    assert budget.spend("1.2.3.4", 0) is None
    assert budget.retry_after_ms("5.6.7.8", 0) is None  # another client is not affected
    assert budget.retry_after_ms("1.2.3.4", 0.05) is None
    # A bucket that refilled completely is dropped; the table holds at most 2 clients.
    assert budget.retry_after_ms("1.2.3.4", 10) is None and len(budget) == 0
    for client in ("a", "b", "c"):
        budget.spend(client, 20)
    assert len(budget) == 2


def _layer(tokens: float | None, requests: float | None, in_flight: int) -> LayerStatus:
    policy = Policy(tokens_per_minute=6_000, requests_per_minute=60, max_in_flight=2).resolved()
    return LayerStatus("global", None, None, policy, 1, tokens, requests, in_flight)


def test_a_layer_binds_when_it_would_refuse_a_minimal_request() -> None:
    assert binding_retry_ms(_layer(1.0, 1.0, 1), 1_000) is None
    # Half a token short at 100 tokens a second: 5 ms.
    assert binding_retry_ms(_layer(0.5, 10, 0), 1_000) == 5
    # Three requests in debt at one a second: 4 s, the longest wait wins.
    assert binding_retry_ms(_layer(0.5, -3, 0), 1_000) == 4_000
    # Every permit taken: the concurrency hint.
    assert binding_retry_ms(_layer(100, 10, 2), 1_000) == 1_000


def test_an_announced_key_change_drops_what_the_cache_knew_of_it() -> None:
    cache = KeyCache(refresh_seconds=30, max_stale_seconds=3_600, negative_seconds=5)
    known, refused = b"k" * 32, b"r" * 32
    cache.confirm(known, KeyOwner(key_id=1, tenant="acme"), now=0.0)
    cache.refuse(refused, now=0.0)
    cache.drop(known)
    cache.drop(refused)
    assert cache.known(known, now=1.0) is None
    assert not cache.refused(refused, now=1.0)


def test_a_resync_makes_every_known_key_refresh_at_its_next_use() -> None:
    cache = KeyCache(refresh_seconds=30, max_stale_seconds=3_600, negative_seconds=5)
    known, refused = b"k" * 32, b"r" * 32
    cache.confirm(known, KeyOwner(key_id=1, tenant="acme"), now=0.0)
    cache.refuse(refused, now=0.0)
    assert not cache.claim_refresh(known, now=1.0)
    cache.refresh_all()
    # Still serving, but its next use claims a lookup; no refusal stands.
    assert cache.known(known, now=1.0) == KeyOwner(key_id=1, tenant="acme")
    assert cache.claim_refresh(known, now=1.0)
    assert not cache.refused(refused, now=1.0)


def test_a_key_whose_row_changed_keeps_its_tenants_lane_until_looked_up_again() -> None:
    """A busy tenant's key is not a stranger after an announcement: its burst queues in
    the tenant's lane, not in the unknown keys' small one (whose overflow is 429)."""
    cache = KeyCache(refresh_seconds=30, max_stale_seconds=3_600, negative_seconds=5)
    acme, beta, never = b"a" * 32, b"b" * 32, b"n" * 32
    cache.confirm(acme, ACME, now=0.0)
    cache.confirm(beta, KeyOwner(key_id=2, tenant="beta"), now=0.0)
    cache.drop(acme)  # the key's row changed
    cache.drop_tenant("beta")  # the tenant was resumed
    cache.drop(never)  # announced, but never known here
    assert cache.known(acme, 1.0) is None
    assert (cache.former_tenant(acme), cache.former_tenant(beta)) == ("acme", "beta")
    assert cache.former_tenant(never) is None
    # A lookup that began before the change cannot confirm the key, but keeps its lane.
    since = cache.generation
    cache.drop(acme)
    cache.confirm(acme, ACME, now=2.0, since=since - 1)
    assert cache.known(acme, 2.0) is None and cache.former_tenant(acme) == "acme"
    # Looked up again: known (or refused), and no longer rechecking.
    cache.confirm(acme, ACME, now=3.0, since=cache.generation)
    cache.refuse(beta, now=3.0, since=cache.generation)
    assert cache.known(acme, 3.0) == ACME
    assert (cache.former_tenant(acme), cache.former_tenant(beta)) == (None, None)
