"""SettlesInFlight (api/proxy/settles.py): whom a tenant's next request waits for,
and what a stopping worker waits for, with real asyncio tasks."""

from __future__ import annotations

import asyncio
import logging

import pytest

from llmquota.api.proxy.settles import SettlesInFlight


async def test_a_tenant_waits_for_its_own_settlements_only() -> None:
    settles = SettlesInFlight()
    acme_done, beta_done = asyncio.Event(), asyncio.Event()
    finished: list[str] = []

    async def settle(name: str, done: asyncio.Event) -> None:
        await done.wait()
        finished.append(name)

    settles.start("acme", settle("acme", acme_done))
    settles.start("beta", settle("beta", beta_done))
    await asyncio.wait_for(settles.behind("nobody"), 1)  # nothing to wait for
    waiting = asyncio.create_task(settles.behind("acme"))
    await asyncio.sleep(0.01)
    assert not waiting.done()
    acme_done.set()
    await asyncio.wait_for(waiting, 1)
    assert finished == ["acme"]  # beta's still runs
    beta_done.set()
    await asyncio.wait_for(settles.behind("beta"), 1)
    assert finished == ["acme", "beta"]


async def test_closing_waits_for_settlements_started_while_it_waits() -> None:
    settles = SettlesInFlight()
    finished: list[int] = []

    async def settle(n: int) -> None:
        await asyncio.sleep(0.02)
        if n < 3:  # each one's end starts the next (a pump settling as shutdown waits)
            settles.start("acme", settle(n + 1))
        finished.append(n)

    settles.start("acme", settle(1))
    await asyncio.wait_for(settles.close(), 2)
    assert finished == [1, 2, 3]


async def test_a_failed_settlement_is_logged_and_waits_for_no_one(
    caplog: pytest.LogCaptureFixture,
) -> None:
    settles = SettlesInFlight()

    async def settle() -> None:
        raise RuntimeError("the store said something unheard of")

    settles.start("acme", settle())
    await asyncio.wait_for(settles.behind("acme"), 1)  # no exception reaches the waiter
    await asyncio.sleep(0)  # the done callback runs
    await asyncio.wait_for(settles.behind("acme"), 1)
    assert [r.levelno for r in caplog.records] == [logging.ERROR]
    assert "a settlement of tenant 'acme' failed" in caplog.text
