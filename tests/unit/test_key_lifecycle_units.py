"""The pure pieces of the key lifecycle: URL masking, the key cache's expiry and
tenant drops, the change feed's routing, the use notes' once-a-minute bound."""

from __future__ import annotations

import asyncio

import pytest

from llmquota.admission.changes import ChangeFeed
from llmquota.api.keycache import KeyCache
from llmquota.api.keyuses import UseNotes
from llmquota.config import Settings
from llmquota.domain.errors import InvalidRequest
from llmquota.domain.keys import KeyOwner, check_grace_seconds, check_scopes
from llmquota.domain.url_masking import mask_url


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("https://user:secret@host/", "https://user:***@host/"),
        ("https://ghp_token@github.example/hook", "https://***@github.example/hook"),
        ("https://h/p?a=1&token=abc&b=2", "https://h/p?a=1&token=***&b=2"),
        ("https://h/p?X-Amz-Signature=f00&X-Amz-Date=1", "https://h/p?X-Amz-Signature=***&X-Amz-Date=1"),
        ("https://h/p?client_secret=s&apikey=k&Password=p", "https://h/p?client_secret=***&apikey=***&Password=***"),
        ("https://h/p#access_token=t&state=s", "https://h/p#access_token=***&state=s"),
        ("https://h/p?token=&q=%20x", "https://h/p?token=&q=%20x"),
        ("http://[2606:2800:220:1::1]:9000/hook", "http://[2606:2800:220:1::1]:9000/hook"),
        ("http://[::1", "***"),
    ],
)  # fmt: skip
def test_mask_url(url: str, shown: str) -> None:
    assert mask_url(url) == shown


def test_a_cached_key_ends_at_its_valid_seconds() -> None:
    cache = KeyCache(refresh_seconds=60, max_stale_seconds=300, negative_seconds=5)
    cache.confirm(b"a", KeyOwner(1, "acme", valid_seconds=2.0), now=100.0)
    cache.confirm(b"b", KeyOwner(2, "acme"), now=100.0)
    assert cache.known(b"a", 101.999) is not None
    assert cache.known(b"a", 102.0) is None
    assert cache.known(b"b", 399.0) is not None  # no end: only the stale window


def test_a_tenant_change_drops_only_that_tenants_keys() -> None:
    cache = KeyCache(refresh_seconds=60, max_stale_seconds=300, negative_seconds=5)
    cache.confirm(b"a", KeyOwner(1, "acme"), now=0.0)
    cache.confirm(b"b", KeyOwner(2, "other"), now=0.0)
    cache.confirm(b"c", KeyOwner(3, None), now=0.0)
    cache.drop_tenant("acme")
    assert [cache.known(d, 1.0) is not None for d in (b"a", b"b", b"c")] == [False, True, True]


def test_a_lookup_under_way_during_a_change_is_not_remembered() -> None:
    cache = KeyCache(refresh_seconds=60, max_stale_seconds=300, negative_seconds=5)
    acme = KeyOwner(1, "acme")
    for change in (
        lambda: cache.drop(b"a"),
        lambda: cache.drop_key_id(1),
        lambda: cache.drop_tenant("acme"),
        cache.refresh_all,
    ):
        since = cache.generation
        change()  # announced while the lookup ran: it may have read the old row
        cache.confirm(b"a", acme, now=0.0, since=since)
        assert cache.known(b"a", 0.0) is None
    # A digest's own change (its row inserted: the key was just created) or any
    # change at all keeps a lookup's "no such key" from being remembered.
    for change in (lambda: cache.drop(b"a"), cache.refresh_all):
        since = cache.generation
        change()
        cache.refuse(b"a", now=0.0, since=since)
        assert not cache.refused(b"a", 0.0)
    since = cache.generation
    cache.drop(b"other")  # another key's change does not matter
    cache.confirm(b"a", acme, now=0.0, since=since)
    assert cache.known(b"a", 0.0) == acme
    cache.confirm(b"b", KeyOwner(1, "acme"), now=0.0)
    cache.drop_key_id(1)  # every secret of key 1
    assert cache.known(b"a", 0.0) is None and cache.known(b"b", 0.0) is None


def test_the_change_feed_routes_tenant_announcements_to_the_key_cache() -> None:
    reloads: list[int] = []
    feed = ChangeFeed(Settings(_env_file=None), lambda: reloads.append(1))  # type: ignore[call-arg]
    tenants: list[str] = []
    keys: list[bytes | None] = []
    feed.watch_tenants(tenants.append)
    feed.watch_keys(keys.append)
    feed.changed("tenants:acme")
    assert (tenants, keys, reloads) == (["acme"], [], [])
    feed.changed("api_keys:00ff")
    feed.changed("plans")
    assert (tenants, keys, reloads) == (["acme"], [b"\x00\xff"], [1])


def test_the_change_feed_reads_a_citus_shard_name_as_its_table() -> None:
    # In a cell on Citus the triggers fire on the shards: api_keys_102040.
    reloads: list[int] = []
    feed = ChangeFeed(Settings(_env_file=None), lambda: reloads.append(1))  # type: ignore[call-arg]
    tenants: list[str] = []
    keys: list[bytes | None] = []
    feed.watch_tenants(tenants.append)
    feed.watch_keys(keys.append)
    feed.changed("tenants_102021:acme_2")
    feed.changed("api_keys_102040:00ff")
    assert (tenants, keys, reloads) == (["acme_2"], [b"\x00\xff"], [])
    feed.changed("limit_layers_102023")
    feed.changed("plans_7")
    assert reloads == [1, 1]


async def test_a_key_use_is_noted_at_most_once_a_minute() -> None:
    noted: list[int] = []

    async def note(key_id: int) -> None:
        noted.append(key_id)

    uses = UseNotes(note, interval_seconds=60)
    for now in (0.0, 1.0, 59.9, 60.0, 61.0, 119.9, 120.0):
        uses.used(7, now)
    uses.used(8, 1.0)
    await asyncio.gather(*uses.tasks)
    assert sorted(noted) == [7, 7, 7, 8]


def test_scopes_and_grace_are_checked() -> None:
    assert check_scopes(["read", "admit", "read"]) == ("admit", "read")
    for bad in ([], ["write"]):
        with pytest.raises(InvalidRequest, match="scopes"):
            check_scopes(bad)
    assert check_grace_seconds(604_800) == 604_800
    with pytest.raises(InvalidRequest, match="grace_seconds"):
        check_grace_seconds(604_801)
