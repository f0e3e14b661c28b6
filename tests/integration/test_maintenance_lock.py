"""The maintenance lock and its leader loop, in one process on a real database.

One session holds the lock and the others are refused at once; a leader
whose session is cut (pg_terminate_backend, as a network cut or a restart
would) stops leading at once, and at no moment do two leaders sweep.
"""

from __future__ import annotations

import asyncio
import logging
import time

import asyncpg
import pytest

from llmquota.admin.maintenance import MaintenanceLeader
from llmquota.admin.sweeper import Sweeper
from llmquota.admission.limiter import Limiter
from llmquota.config import Settings
from llmquota.metrics import Metrics
from llmquota.store.leader import LeaderLock

# What "at once" is held to: from the session cut to the leader saying it no
# longer leads (the driver reports a closed socket in milliseconds).
STOPS_WITHIN_SECONDS = 0.5


async def test_one_session_holds_the_lock_and_a_second_is_refused_until_it_is_given_up(
    app_dsn: str,
) -> None:
    first, second = LeaderLock(app_dsn), LeaderLock(app_dsn)
    try:
        assert await first.try_acquire() is True
        assert await second.try_acquire() is False
        assert await first.check(1.0) is True
        await first.release()
        assert await second.try_acquire() is True
        assert await first.try_acquire() is False
    finally:
        await first.release()
        await second.release()


def leader(limiter: Limiter, app_dsn: str, settings: Settings) -> tuple[MaintenanceLeader, Metrics]:
    metrics = Metrics()
    return (
        MaintenanceLeader(
            LeaderLock(app_dsn),
            Sweeper(limiter.store, settings, metrics),
            metrics,
            sweep_interval_seconds=0.2,
            retry_seconds=0.2,
        ),
        metrics,
    )


async def test_a_leader_whose_session_is_cut_stops_at_once_and_two_never_lead(
    app_dsn: str,
    limiter: Limiter,
    settings: Settings,
    db: asyncpg.Connection,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="llmquota.maintenance")
    (a, a_metrics), (b, b_metrics) = (
        leader(limiter, app_dsn, settings),
        leader(limiter, app_dsn, settings),
    )
    stop = asyncio.Event()
    tasks = [asyncio.create_task(a.run(stop)), asyncio.create_task(b.run(stop))]
    registries = (a_metrics.registry, b_metrics.registry)

    def leading() -> list[float]:
        return [r.get_sample_value("llmquota_maintenance_leader") or 0.0 for r in registries]

    both = 0

    async def sample(seconds: float) -> None:
        nonlocal both
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            both += leading() == [1.0, 1.0]
            await asyncio.sleep(0.002)

    try:
        deadline = time.monotonic() + 5
        while sum(leading()) != 1:
            assert time.monotonic() < deadline, "nobody led"
            await asyncio.sleep(0.01)
        await sample(0.5)
        which = leading().index(1.0)
        swept = registries[which].get_sample_value("llmquota_sweeps_total", {"result": "ok"})
        assert swept is not None and swept >= 1
        caplog.clear()
        cut = await db.fetchval(
            """SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity
                WHERE application_name = 'llmquota-maintenance'
                  AND datname = current_database()
                  AND pid IN (SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND granted)"""
        )
        assert cut == 1
        cut_at = time.time()
        await sample(1.5)
        lost = [r for r in caplog.records if "no longer leading" in r.getMessage()]
        assert len(lost) == 1
        print(f"\nsession cut to the leader stopping: {(lost[0].created - cut_at) * 1000:.0f} ms")
        assert lost[0].created - cut_at < STOPS_WITHIN_SECONDS
        # One leads again (either), and never were both leading.
        assert sum(leading()) == 1
        assert both == 0
    finally:
        stop.set()
        await asyncio.gather(*tasks)
    assert leading() == [0.0, 0.0]
