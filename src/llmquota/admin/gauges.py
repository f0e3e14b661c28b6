"""Utilization gauges, read from the database in the background.

A provider ceiling's utilization is a row in PostgreSQL, changed by every
worker's admissions: no worker can know it from its own traffic. So each
worker reads it every CEILING_METRICS_REFRESH_SECONDS (one small statement,
whatever the request rate) into its gauges, never on the request path. A
scrape sees the last values read; while the database does not answer they
stay as they were (the outage shows in the store error series).

Per-tenant utilization is one series per tenant: it is read only when
TENANT_UTILIZATION_METRICS is on, for the MAX_TENANT_UTILIZATION_SERIES most
utilized tenants.
"""

from __future__ import annotations

import asyncio
import logging

from llmquota.admin.service import AdminService
from llmquota.domain.errors import LimiterError
from llmquota.metrics import MAX_TENANT_UTILIZATION_SERIES, Metrics

log = logging.getLogger(__name__)


class UtilizationGauges:
    """Refreshes the ceiling (and, if enabled, tenant) utilization gauges."""

    def __init__(self, admin: AdminService, metrics: Metrics, *, tenants: bool) -> None:
        self.admin = admin
        self.metrics = metrics
        self.tenants = tenants

    async def refresh(self) -> None:
        """Read the utilizations now and replace the gauges (deleted ceilings vanish)."""
        ceilings = await self.admin.ceilings()
        self.metrics.set_ceiling_utilization(
            (c.name, c.utilization) for c in ceilings if c.utilization is not None
        )
        if self.tenants:
            self.metrics.set_tenant_utilization(
                await self.admin.tenant_utilization(MAX_TENANT_UTILIZATION_SERIES)
            )

    async def run(self, interval_seconds: float) -> None:
        """Refresh every `interval_seconds` until cancelled."""
        while True:
            try:
                await self.refresh()
            except (LimiterError, OSError) as exc:
                # A store that does not answer is reported by the admission path.
                log.info("utilization gauges not refreshed: %s", exc)
            await asyncio.sleep(interval_seconds)
