"""The maintenance every `llmquota serve` runs: one leader sweeps, the others wait.

Every worker of every replica runs this loop. Each tries the maintenance
lock (store/leader.py) every `maintenance_retry_seconds`; the one that holds
it is the leader and runs the sweeper (admin/sweeper.py) at once and then
every `sweep_interval_seconds`. When the leader dies its session ends and
PostgreSQL frees the lock, so another worker leads within one retry.

Leadership is about work, not safety: two sweeps at once are correct (each
batch of lq_sweep locks its rows with SKIP LOCKED, and `llmquota sweep` from
cron may run beside it), so a leader that learns late that it lost its
session has at worst swept once more. Still, the moment the driver reports
the lock's session gone the leader stops: its sweep in flight is cancelled
and the gauge `llmquota_maintenance_leader` drops to 0 before it retries.
A session that stops answering is found by a round trip before each sweep.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Coroutine
from typing import Any

from llmquota.admin.sweeper import Sweeper
from llmquota.domain.errors import StoreUnavailable
from llmquota.metrics import Metrics
from llmquota.store.leader import LeaderLock

log = logging.getLogger("llmquota.maintenance")


class MaintenanceLeader:
    """Competes for the maintenance lock and, while holding it, sweeps."""

    def __init__(
        self,
        lock: LeaderLock,
        sweeper: Sweeper,
        metrics: Metrics,
        *,
        sweep_interval_seconds: float,
        retry_seconds: float,
    ) -> None:
        self._lock = lock
        self._sweeper = sweeper
        self._metrics = metrics
        self._interval = sweep_interval_seconds
        self._retry = retry_seconds

    @property
    def leading(self) -> bool:
        """Whether this process holds the lock now (and so sweeps)."""
        return self._lock.held

    async def run(self, stop: asyncio.Event) -> None:
        """Until `stop`: wait for the lock, lead while it holds, give it up at the end."""
        try:
            while not stop.is_set():
                try:
                    led = await self._round(stop)
                except Exception:
                    # Not an outage (those are answered inside): a bug must not end
                    # the maintenance of every later hour. Say so, give the lock up.
                    log.exception("maintenance: the leader loop failed; trying again")
                    self._metrics.maintenance_leader.set(0)
                    await self._lock.release()
                    led = False
                if led and not stop.is_set():
                    continue  # lost the lock's session: try again at once, it may be free
                await _wait(stop, self._retry)
        finally:
            self._metrics.maintenance_leader.set(0)
            await self._lock.release()

    async def _round(self, stop: asyncio.Event) -> bool:
        """Try the lock once; if taken, lead until its session is lost or `stop`.
        True when this process led."""
        if not await self._lock.try_acquire():
            return False
        log.info("maintenance: this process leads")
        self._metrics.maintenance_leader.set(1)
        try:
            await self._lead(stop)
        finally:
            self._metrics.maintenance_leader.set(0)
        if not stop.is_set():
            log.warning("maintenance: the lock's session was lost; no longer leading")
        return True

    async def _lead(self, stop: asyncio.Event) -> None:
        """Sweep now and every interval while the lock's session lives."""
        while not stop.is_set() and await self._lock.check(self._retry):
            sweep = asyncio.ensure_future(self._sweep_once())
            await _first(sweep, self._lock.lost.wait(), stop.wait())
            if not sweep.done():
                sweep.cancel()  # the session went mid-sweep (or we stop): at once
                with contextlib.suppress(asyncio.CancelledError):
                    await sweep
                return
            await _first(self._lock.lost.wait(), stop.wait(), within=self._interval)

    async def _sweep_once(self) -> None:
        try:
            report = await self._sweeper.sweep()
        except StoreUnavailable as exc:
            self._metrics.sweeps.labels("failed").inc()
            log.warning("maintenance: sweep skipped, database unavailable: %s", exc)
            return
        except Exception:
            # A statement refused (a bug, a privilege lost): counted and logged;
            # the next interval tries again, as a cron sweep would.
            self._metrics.sweeps.labels("failed").inc()
            log.exception("maintenance: sweep failed")
            return
        self._metrics.sweeps.labels("ok").inc()
        if (
            report.expired
            or report.purged
            or report.partitions_created
            or report.cache_entries_expired
            or report.slices_returned
        ):
            log.info(
                "maintenance: expired=%d tokens_returned=%d purged=%d partitions_created=%d "
                "cache_entries_expired=%d slices_returned=%d",
                report.expired,
                report.tokens_returned,
                report.purged,
                report.partitions_created,
                report.cache_entries_expired,
                report.slices_returned,
            )


async def _first(
    *waits: Coroutine[Any, Any, Any] | asyncio.Future[Any], within: float | None = None
) -> None:
    """Return when the first of `waits` is done (or after `within` seconds); cancel the rest.
    A future passed in (the sweep) is left running for the caller to judge."""
    futures = [asyncio.ensure_future(w) for w in waits]
    owned = [f for f, w in zip(futures, waits, strict=True) if f is not w]
    try:
        await asyncio.wait(futures, timeout=within, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for future in owned:
            future.cancel()


async def _wait(stop: asyncio.Event, seconds: float) -> None:
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stop.wait(), seconds)
