"""How soon another worker's `Limiter.cache_policy` sees a cache policy written elsewhere.

The proxy reads the response cache policy from its worker's policy cache,
with no round trip of its own: a change must reach it when announced
(NOTIFY) and, without announcements, within POLICY_CACHE_REFRESH_SECONDS,
because `cache_policy` refreshes a copy that old before answering.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest

from llmquota.admin.service import AdminService
from llmquota.admission.limiter import Limiter
from llmquota.config import Settings
from llmquota.domain.plans import Plan
from llmquota.domain.policy import Policy
from llmquota.domain.response_cache import CachePolicy

EXACT = CachePolicy(mode="exact", ttl_seconds=60)
SEMANTIC = CachePolicy(mode="semantic", embedding_model="text-embedding-3-small")
REFRESH_SECONDS = 1.0


@pytest.fixture
async def writer(limiter: Limiter) -> AdminService:
    """Another worker's admin writes (its own policy cache is not the one under test)."""
    return AdminService(limiter.store)


async def _reader(app_dsn: str, **settings: object) -> Limiter:
    """Another worker, with `settings` (a slow shared machine: a wide decision deadline)."""
    chosen: dict[str, object] = {"pool_max_size": 2, "decision_deadline_ms": 60_000, **settings}
    return await Limiter.connect(app_dsn, Settings(_env_file=None, **chosen))  # type: ignore[call-arg, arg-type]


@pytest.fixture
async def unannounced(app_dsn: str) -> AsyncIterator[Limiter]:
    """A worker that hears of no change: only its periodic refresh brings them."""
    reader = await _reader(
        app_dsn, change_notifications=False, policy_cache_refresh_seconds=REFRESH_SECONDS
    )
    yield reader
    await reader.close()


async def test_a_change_is_seen_within_the_refresh_interval(
    writer: AdminService, unannounced: Limiter
) -> None:
    await writer.put_tenant_policy("acme", None, {"cache": EXACT.model_dump(mode="json")})
    await unannounced.refresh_policies()
    loaded = time.monotonic()
    assert await unannounced.cache_policy("acme", None) == EXACT
    await writer.put_plan("pro", Plan(cache=SEMANTIC))
    await writer.put_tenant_policy("acme", "pro", {})
    answer = await unannounced.cache_policy("acme", None)
    if time.monotonic() - loaded < REFRESH_SECONDS:
        assert answer == EXACT  # the copy answers, no question asked of the store
    await asyncio.sleep(max(0.0, loaded + REFRESH_SECONDS - time.monotonic()))
    # Due now: refreshed before answering, by nobody but cache_policy itself.
    assert await unannounced.cache_policy("acme", None) == SEMANTIC
    assert await unannounced.cache_policy("acme", "chat") == SEMANTIC


async def test_an_announced_change_is_seen_at_once(writer: AdminService, app_dsn: str) -> None:
    # A periodic refresh an hour away: only the announcement can bring the change.
    reader = await _reader(app_dsn, policy_cache_refresh_seconds=3_600.0)
    try:
        await writer.put_plan("pro", Plan(cache=EXACT))
        await writer.put_tenant_policy("acme", "pro", {})
        await writer.put_policy("route", "acme", "chat", Policy(cache=SEMANTIC))
        started = time.monotonic()
        while await reader.cache_policy("acme", "chat") != SEMANTIC:
            assert time.monotonic() - started < 5.0, "the announcement never arrived"
            await asyncio.sleep(0.02)
        while await reader.cache_policy("acme", None) != EXACT:
            assert time.monotonic() - started < 5.0, "the plan's cache never arrived"
            await asyncio.sleep(0.02)
        # A plan change reaches its tenants' layers, and with them the announcement.
        await writer.put_plan("pro", Plan())
        while await reader.cache_policy("acme", None) is not None:
            assert time.monotonic() - started < 10.0, "the plan change never arrived"
            await asyncio.sleep(0.02)
        assert await reader.cache_policy("acme", "chat") == SEMANTIC
    finally:
        await reader.close()


async def test_a_store_that_does_not_answer_delays_the_answer_once_at_most(
    writer: AdminService, app_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The copy serves when the refresh hangs: the callers of its first moment wait
    the decision deadline at most, together; those after it do not wait at all."""
    reader = await _reader(
        app_dsn,
        change_notifications=False,
        policy_cache_refresh_seconds=REFRESH_SECONDS,
        decision_deadline_ms=200,
    )
    try:
        await writer.put_tenant_policy("acme", None, {"cache": EXACT.model_dump(mode="json")})
        await reader.refresh_policies()
        hung = asyncio.Event()

        async def hangs(*_args: object, **_kwargs: object) -> object:
            hung.set()
            await asyncio.Event().wait()  # never answers (cancelled at close)
            raise AssertionError("unreachable")

        monkeypatch.setattr(reader.store, "policy_snapshot", hangs)
        await asyncio.sleep(REFRESH_SECONDS)
        started = time.monotonic()
        first = await asyncio.gather(*(reader.cache_policy("acme", None) for _ in range(20)))
        waited = time.monotonic() - started
        assert first == [EXACT] * 20 and hung.is_set()
        assert 0.15 < waited < 1.0, waited
        started = time.monotonic()
        assert await reader.cache_policy("acme", None) == EXACT
        assert time.monotonic() - started < 0.05
    finally:
        await reader.close()
