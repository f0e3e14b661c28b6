"""The maintenance leader loop against a lock and a sweeper it cannot tell from real ones.

What the loop decides, without a database: a session lost mid-sweep cancels
the sweep at once; a failed sweep is counted and the next interval sweeps
again; `stop` gives the lock up.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from llmquota.admin.maintenance import MaintenanceLeader
from llmquota.admin.sweeper import SweepReport
from llmquota.metrics import Metrics


class FakeLock:
    """Always free; its session is lost when the test says so."""

    def __init__(self) -> None:
        self.lost = asyncio.Event()
        self.acquired = 0
        self.released = 0

    async def try_acquire(self) -> bool:
        if self.lost.is_set():
            self.lost = asyncio.Event()  # a new session
        self.acquired += 1
        return True

    async def check(self, timeout_seconds: float) -> bool:
        return not self.lost.is_set()

    async def release(self) -> None:
        self.released += 1


class ScriptedSweeper:
    """Each sweep does the next thing of `script`: 'ok', 'fail' or 'hang'."""

    def __init__(self, *script: str) -> None:
        self.script = list(script)
        self.started = 0
        self.cancelled = 0
        self.hanging = asyncio.Event()

    async def sweep(self) -> SweepReport:
        self.started += 1
        step = self.script.pop(0) if self.script else "ok"
        if step == "fail":
            raise RuntimeError("permission denied for function lq_sweep")
        if step == "hang":
            self.hanging.set()
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                self.cancelled += 1
                raise
        return SweepReport(expired=1, tokens_returned=10, batches=1, purged=0)


async def until(check: Callable[[], bool], within: float = 2.0) -> None:
    deadline = time.monotonic() + within
    while not check():
        assert time.monotonic() < deadline, "not within the time allowed"
        await asyncio.sleep(0.001)


def sample(metrics: Metrics, name: str, **labels: str) -> float:
    return metrics.registry.get_sample_value(name, labels) or 0.0


def leader(sweeper: Any, lock: FakeLock, metrics: Metrics) -> MaintenanceLeader:
    return MaintenanceLeader(
        lock,  # type: ignore[arg-type]
        sweeper,
        metrics,
        sweep_interval_seconds=0.05,
        retry_seconds=0.05,
    )


async def test_a_failed_sweep_is_counted_and_the_next_interval_sweeps_again() -> None:
    metrics, lock, sweeper = Metrics(), FakeLock(), ScriptedSweeper("fail", "ok", "ok")
    stop = asyncio.Event()
    task = asyncio.create_task(leader(sweeper, lock, metrics).run(stop))
    await until(lambda: sweeper.started >= 3)
    assert sample(metrics, "llmquota_maintenance_leader") == 1
    stop.set()
    await asyncio.wait_for(task, 2)
    assert sample(metrics, "llmquota_sweeps_total", result="failed") == 1
    assert sample(metrics, "llmquota_sweeps_total", result="ok") >= 2
    assert sample(metrics, "llmquota_maintenance_leader") == 0
    assert lock.acquired == 1 and lock.released >= 1


async def test_a_session_lost_mid_sweep_cancels_the_sweep_at_once_and_leads_again() -> None:
    metrics, lock, sweeper = Metrics(), FakeLock(), ScriptedSweeper("hang", "ok")
    stop = asyncio.Event()
    task = asyncio.create_task(leader(sweeper, lock, metrics).run(stop))
    await asyncio.wait_for(sweeper.hanging.wait(), 2)
    lost_at = time.monotonic()
    lock.lost.set()
    await until(lambda: sweeper.cancelled > 0)
    cancelled_after = time.monotonic() - lost_at
    assert cancelled_after < 0.1
    # It takes a new session and sweeps again.
    await until(lambda: sweeper.started >= 2)
    assert lock.acquired == 2
    stop.set()
    await asyncio.wait_for(task, 2)
    assert sample(metrics, "llmquota_sweeps_total", result="ok") >= 1
    assert sample(metrics, "llmquota_maintenance_leader") == 0
