"""`maintenance_running`: the maintenance leader loop for the length of a block."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

from llmquota.admin.maintenance import MaintenanceLeader
from llmquota.admin.sweeper import Sweeper
from llmquota.config import Settings
from llmquota.domain.errors import StoreUnavailable
from llmquota.metrics import Metrics
from llmquota.store.cells import cell_served_at
from llmquota.store.leader import MAINTENANCE_LOCK_NAME, LeaderLock
from llmquota.store.store import Store

log = logging.getLogger("llmquota.maintenance")


@contextlib.asynccontextmanager
async def maintenance_running(
    store: Store, settings: Settings, metrics: Metrics, dsn: str
) -> AsyncIterator[MaintenanceLeader | None]:
    """Compete for the maintenance lock in the background (unless
    LLMQUOTA_SERVE_SWEEPER=false); give it up when the block ends.

    The lock needs a session on the server itself: `listen_database_url` when
    set, else the service's DSN, except behind a transaction pooler, where
    without a direct DSN nothing leads and cron's `llmquota sweep` must run.
    """
    target = settings.listen_database_url or (None if settings.transaction_pooler else dsn)
    if not settings.serve_sweeper or target is None:
        if settings.serve_sweeper:
            log.warning(
                "maintenance: no direct DSN for the leader's lock behind a transaction "
                "pooler (set LLMQUOTA_LISTEN_DATABASE_URL); run `llmquota sweep` from cron"
            )
        yield None
        return
    # The cells of one database share its advisory locks: each cell's
    # services lead their own cell (a deployment without cells: the one lock).
    try:
        cell = await cell_served_at(dsn)
    except StoreUnavailable:
        # Named by the DSN when it can be; a role's search_path needs the server.
        log.warning("maintenance: could not ask which cell this service serves; leading as one")
        cell = None
    name = MAINTENANCE_LOCK_NAME if cell is None else f"{MAINTENANCE_LOCK_NAME}:{cell}"
    leader = MaintenanceLeader(
        LeaderLock(target, name),
        Sweeper(store, settings, metrics),
        metrics,
        sweep_interval_seconds=settings.sweep_interval_seconds,
        retry_seconds=settings.maintenance_retry_seconds,
    )
    stop = asyncio.Event()
    task = asyncio.create_task(leader.run(stop), name="llmquota-maintenance")
    try:
        yield leader
    finally:
        stop.set()
        # A sweep statement is bounded by the statement timeout; then it is cut.
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(task, settings.statement_timeout_ms / 1000.0 + 2.0)
