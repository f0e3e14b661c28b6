"""A busy event loop is not a database outage.

The decision deadline measures the store: when this process's own CPU keeps
the event loop from running (here, blocking calls of half a second, longer
than the 250 ms deadline, as counting a huge prompt on the loop once did),
the store's answers are read late but they are read, and no failure mode
decides. An `open` tenant with max_in_flight 3 stays at 3; a `closed` one
gets no 503.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest

from llmquota.admission.limiter import Limiter
from llmquota.domain.errors import LimiterError, RateLimited, StoreUnavailable
from tests.faults.conftest import fault_settings, put

HOG_SECONDS = 0.5
HOG_ROUNDS = 6
ADMITS = 40


@pytest.fixture
async def deadline_limiter(database_dsn: str) -> AsyncIterator[Limiter]:
    limiter = await Limiter.connect(database_dsn, fault_settings(decision_deadline_ms=250))
    yield limiter
    await limiter.close()


async def _hog() -> None:
    """Keep the event loop from running, in bursts longer than the deadline."""
    for _ in range(HOG_ROUNDS):
        time.sleep(HOG_SECONDS)  # noqa: ASYNC251 - blocking the loop is the point
        await asyncio.sleep(0.01)


async def _admits(limiter: Limiter, tenant: str) -> list[object]:
    async def one(i: int) -> object:
        await asyncio.sleep(i * HOG_SECONDS * HOG_ROUNDS / ADMITS)  # spread over the hog
        try:
            return await limiter.admit(tenant=tenant, model="m", input_tokens=1, max_tokens=1)
        except LimiterError as exc:
            return exc

    return list(await asyncio.gather(*(one(i) for i in range(ADMITS))))


async def test_open_tenant_never_exceeds_max_in_flight_while_the_loop_is_busy(
    deadline_limiter: Limiter,
) -> None:
    limiter = deadline_limiter
    await put(limiter, "tenant", "open-t", max_in_flight=3, failure_mode="open")
    await limiter.refresh_policies()

    results, _ = await asyncio.gather(_admits(limiter, "open-t"), _hog())

    admitted = [r for r in results if not isinstance(r, LimiterError)]
    refused = [r for r in results if isinstance(r, RateLimited)]
    assert len(admitted) == 3, results
    assert len(refused) == ADMITS - 3
    assert all(r.limit == "concurrency" for r in refused)
    fallback = limiter.metrics.fallback_decisions.labels("open", "admitted")._value.get()
    assert fallback == 0
    layers = await limiter.store.layer_status("open-t")
    (tenant,) = [layer for layer in layers if layer.scope == "tenant"]
    assert tenant.in_flight == 3
    assert len(limiter.journal) == 0


async def test_closed_tenant_gets_no_503_while_the_loop_is_busy(
    deadline_limiter: Limiter,
) -> None:
    limiter = deadline_limiter
    await put(limiter, "tenant", "closed-t", max_in_flight=1_000)

    results, _ = await asyncio.gather(_admits(limiter, "closed-t"), _hog())

    assert not [r for r in results if isinstance(r, StoreUnavailable)]
    assert all(not isinstance(r, LimiterError) for r in results)
