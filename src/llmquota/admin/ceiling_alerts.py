"""The provider ceilings' alert detector: a background loop on every worker.

A ceiling's utilization is a row in PostgreSQL that every worker's
admissions change, so no worker can see a crossing in its own traffic, and
the admission statement is not where to look for one (it is the hot path;
it does no more work for alerts). Instead every `serve` worker and every
`sweep --loop` runs this loop: every CEILING_ALERT_INTERVAL_SECONDS it reads
every ceiling with its balances at one moment of the database clock (one
statement, get_ceilings: what /v1/ceilings and the utilization gauges read),
makes a sample per ceiling, bucket and threshold (domain/ceiling_alerts.py),
and applies them to the episodes with one more statement
(record_ceiling_samples), which also writes the alert of every episode it
opens into the outbox that quota alerts go through. The delivery loop
(admin/delivery.py) sends it signed, like any alert.

Any number of workers run it at once against one database: the record
statement is one guarded upsert per state row, so an episode opens once and
its alert is written once, whichever worker saw the crossing first, and a
worker killed during the statement leaves nothing half done. Once a minute
(PRUNE_EVERY_SECONDS) a worker forgets the state of ceilings and thresholds
that are gone.

Over cells each cell holds a slice of every ceiling: there the detector
reads the slices added up (ceilings_over_cells.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from datetime import datetime
from typing import Protocol

from llmquota.config import Settings
from llmquota.domain.ceiling_alerts import AlertDefaults, CeilingSample, ceiling_samples
from llmquota.domain.errors import LimiterError
from llmquota.domain.plans import StoredCeiling
from llmquota.store.alerts import AlertStore

log = logging.getLogger("llmquota.alerts")

# How often a detector prunes the state of what no ceiling watches any more.
PRUNE_EVERY_SECONDS = 60.0


class CeilingReader(Protocol):
    """Where a detector reads every ceiling with its balances (store/catalog.py)."""

    async def get_ceilings(
        self, name: str | None = None, *, deadline_seconds: float | None = None
    ) -> list[StoredCeiling]: ...


class CeilingAlertDetector:
    """Reads the ceilings' utilization and records threshold crossings, once each."""

    def __init__(
        self,
        catalog: CeilingReader,
        alerts: AlertStore,
        defaults: AlertDefaults | None = None,
        *,
        deadline_seconds: float | None = None,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self._catalog = catalog
        self._alerts = alerts
        self._defaults = defaults or AlertDefaults()
        self._deadline_seconds = deadline_seconds
        self._monotonic = monotonic
        self._pruned_at: float | None = None

    async def run_once(self) -> list[tuple[CeilingSample, uuid.UUID | None]]:
        """One read and one record: the episodes this call opened, each with its alert's
        event id (None: it had fired already)."""
        ceilings = await self._catalog.get_ceilings(deadline_seconds=self._deadline_seconds)
        samples = ceiling_samples(ceilings, self._defaults)
        opened = await self._alerts.record_ceiling_samples(samples)
        for sample, event_id in opened:
            log.info(
                "ceiling %s: %s utilization %.3f crossed %s, alert %s",
                sample.ceiling,
                sample.dimension,
                sample.utilization,
                sample.threshold,
                event_id,
            )
        now = self._monotonic()
        # A read with a cell away leaves samples out: their states are kept.
        complete = not any(ceiling.estimated for ceiling in ceilings)
        due = self._pruned_at is None or now - self._pruned_at >= PRUNE_EVERY_SECONDS
        if complete and due:
            read_at: datetime | None = ceilings[0].read_at if ceilings else None
            await self._alerts.prune_ceiling_alert_states(samples, read_at)
            self._pruned_at = now
        return list(opened)

    async def run(self, interval_seconds: float, stop: asyncio.Event | None = None) -> None:
        """Detect every `interval_seconds` until `stop` is set (or the task is
        cancelled), outliving outages."""
        stop = stop or asyncio.Event()
        while not stop.is_set():
            try:
                await self.run_once()
            except (LimiterError, OSError) as exc:
                # An outage is reported by the admission path; the next round tries again.
                log.info("ceiling alerts not checked: %s", exc)
            except Exception:
                # Never the end of the loop: ceilings would stop alerting unseen.
                log.exception("ceiling alerts not checked")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), interval_seconds)


@contextlib.asynccontextmanager
async def ceiling_alerts_running(
    catalog: CeilingReader, alerts: AlertStore, settings: Settings
) -> AsyncIterator[CeilingAlertDetector | None]:
    """Run the detector in the background for the block (unless
    LLMQUOTA_CEILING_ALERTS=false); stop it after, a statement in flight cut."""
    if not settings.ceiling_alerts:
        yield None
        return
    detector = CeilingAlertDetector(
        catalog,
        alerts,
        AlertDefaults(
            hysteresis=settings.ceiling_alert_hysteresis,
            quiet_seconds=settings.ceiling_alert_quiet_seconds,
        ),
        deadline_seconds=settings.statement_timeout_ms / 1000.0 + 1.0,
    )
    stop = asyncio.Event()
    task = asyncio.create_task(
        detector.run(settings.ceiling_alert_interval_seconds, stop),
        name="llmquota-ceiling-alerts",
    )
    try:
        yield detector
    finally:
        stop.set()
        # A record statement is atomic: cut mid-way, it wrote nothing.
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
