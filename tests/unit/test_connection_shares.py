"""The upstream pool's slots, counted per tenant (api/proxy/pool.py)."""

from __future__ import annotations

import asyncio

import pytest

from llmquota.api.proxy.pool import ConnectionShares, PoolRefusal


def shares(
    capacity: int, share: float = 0.5, wait: float = 0.2, drains: int = 2
) -> ConnectionShares:
    return ConnectionShares("openai", capacity, share, wait, drains)


def test_a_tenant_share_is_at_least_one_and_never_the_whole_pool() -> None:
    assert shares(200).tenant_limit == 100
    assert shares(200, share=0.999).tenant_limit == 199
    assert shares(3, share=0.1).tenant_limit == 1
    assert shares(1).tenant_limit == 1


async def test_past_its_share_a_tenant_is_refused_at_once_and_others_still_get_slots() -> None:
    pool = shares(4)
    held = [await pool.acquire("noisy") for _ in range(2)]
    started = asyncio.get_running_loop().time()
    with pytest.raises(PoolRefusal) as refused:
        await pool.acquire("noisy")
    assert refused.value.status == 429 and "share" in str(refused.value)
    assert asyncio.get_running_loop().time() - started < 0.05  # no wait for its own doing
    quiet = await pool.acquire("quiet")
    assert (pool.in_use, pool.held("noisy"), pool.held("quiet")) == (3, 2, 1)
    for slot in [*held, quiet]:
        slot.release()
        slot.release()  # once only
    assert (pool.in_use, pool.held("noisy")) == (0, 0)


async def test_a_full_pool_waits_briefly_then_is_busy_and_a_release_wakes_a_waiter() -> None:
    pool = shares(2, share=0.5, wait=0.2)
    first, second = await pool.acquire("a"), await pool.acquire("b")
    started = asyncio.get_running_loop().time()
    with pytest.raises(PoolRefusal) as busy:
        await pool.acquire("c")
    waited = asyncio.get_running_loop().time() - started
    assert busy.value.status == 503 and 0.15 <= waited < 1.0
    waiter = asyncio.create_task(pool.acquire("c"))
    await asyncio.sleep(0.05)
    first.release()
    third = await asyncio.wait_for(waiter, 1.0)
    assert pool.held("c") == 1
    second.release()
    third.release()


async def test_drains_are_capped_per_tenant_and_end_with_the_slot() -> None:
    pool = shares(10, drains=2)
    slots = [await pool.acquire("noisy") for _ in range(3)]
    for slot in slots[:2]:
        assert slot.may_drain()
        slot.start_drain()
    assert not slots[2].may_drain()  # past the cap: this hang-up is cancelled instead
    assert (await pool.acquire("quiet")).may_drain()  # another tenant's cap is its own
    slots[0].release()
    assert slots[2].may_drain()
