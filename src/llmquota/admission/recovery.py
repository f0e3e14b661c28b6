"""A worker's memory for outages: the policy cache, the outage journal, and recovery.

While the store answers, this only keeps the cached policies fresh (in the
background, never on a decision's path). When the store stops answering,
the Fallback decides from that cache and journals what it admits; as soon
as the store answers again, a recovery task records the journal, exactly
once, and refreshes the cache. No restart is needed for either.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from pathlib import Path

from llmquota.admission.fallback import Fallback
from llmquota.admission.outage import FlushReport, OutageJournal
from llmquota.admission.policy_cache import PolicyCache
from llmquota.config import Settings
from llmquota.domain.errors import StoreTimeout, StoreUnavailable
from llmquota.metrics import Metrics
from llmquota.store.store import Store

log = logging.getLogger(__name__)


class OutageRecovery:
    """The policy cache, the outage journal and the fallback of one worker."""

    def __init__(self, store: Store, settings: Settings, metrics: Metrics) -> None:
        self._store = store
        self._settings = settings
        self._metrics = metrics
        self._deadline_seconds = settings.decision_deadline_ms / 1000.0
        self.policies = PolicyCache(
            settings.policy_cache_refresh_seconds, settings.policy_cache_max_stale_seconds
        )
        spool = Path(settings.outage_spool_dir) if settings.outage_spool_dir else None
        self.journal = OutageJournal(settings.outage_journal_max_entries, spool)
        self.fallback = Fallback(
            self.policies,
            self.journal,
            settings.outage_local_fraction,
            settings.concurrency_retry_ms,
        )
        self._refreshing: asyncio.Task[None] | None = None
        self._recovering: asyncio.Task[None] | None = None
        metrics.outage_journal_pending.set_function(lambda: len(self.journal))

    def store_failed(self, operation: str, exc: StoreUnavailable) -> None:
        """Count a statement the store did not answer."""
        kind = "timeout" if isinstance(exc, StoreTimeout) else "unavailable"
        self._metrics.store_errors.labels(operation, kind).inc()

    def store_answered(self) -> None:
        """The store answered: record the outage journal and refresh policies if due."""
        if len(self.journal):
            self.ensure_recovery()
        if self.policies.due(time.monotonic()) and (
            self._refreshing is None or self._refreshing.done()
        ):
            self._refreshing = asyncio.ensure_future(self._refresh_quietly())

    async def _refresh_quietly(self) -> None:
        """A background refresh: whatever goes wrong, decisions carry on."""
        try:
            await self.refresh_policies()
        except StoreUnavailable as exc:
            self.store_failed("policy_snapshot", exc)
        except Exception:
            log.warning("refreshing the policy cache failed", exc_info=True)

    async def refresh_policies(self) -> None:
        """Load every layer's policy into this worker's cache (one row if unchanged),
        and the outage id key the first time."""
        if self.fallback.id_key is None:
            self.fallback.id_key = await self._store.outage_id_key(
                deadline_seconds=self._settings.statement_timeout_ms / 1000.0
            )
        snapshot = await self._store.policy_snapshot(
            self.policies.version,
            self._settings.policy_cache_max_layers,
            deadline_seconds=self._settings.statement_timeout_ms / 1000.0,
        )
        now = time.monotonic()
        if snapshot.layers is None:
            self.policies.confirm(now)
            return
        self.policies.replace(snapshot.version, snapshot.layers, now)
        if not self.policies.complete:
            log.warning(
                "policy cache holds %d of %d layers (policy_cache_max_layers); the rest "
                "count as closed during an outage",
                len(self.policies),
                snapshot.version[1],
            )

    def ensure_recovery(self) -> None:
        """Start recording the journal (if it is not being recorded already)."""
        if self._recovering is None or self._recovering.done():
            self._recovering = asyncio.ensure_future(self._recover())

    async def _recover(self) -> None:
        """Until the journal is empty: try to record it, wait, try again."""
        while len(self.journal):
            try:
                # A cheap probe first, within the decision deadline: while the
                # store hangs, no flush sits on a statement for long.
                await self._store.ping(deadline_seconds=self._deadline_seconds)
                await self.flush()
            except StoreUnavailable as exc:
                self.store_failed("record_outage", exc)
                await asyncio.sleep(self._settings.outage_probe_seconds)
                continue
            except Exception:
                # Not an outage: a bug or a refused statement. Say so loudly and
                # keep the journal for the next attempt rather than drop it.
                log.exception("recording the outage journal failed; will retry")
                await asyncio.sleep(self._settings.outage_probe_seconds)
                continue
            await self._refresh_quietly()

    async def flush(self) -> FlushReport:
        """Write the outage journal to the store now (the recovery task does this by itself)."""
        report = await self.journal.flush(
            self._store,
            self._settings.outage_flush_batch_size,
            deadline_seconds=self._settings.statement_timeout_ms / 1000.0,
        )
        self.fallback.recorded(report.forgotten, time.monotonic())
        self._metrics.outage_recorded.labels("admission").inc(report.admissions_recorded)
        self._metrics.outage_recorded.labels("finish").inc(report.finishes_recorded)
        return report

    async def close(self) -> None:
        """Stop the background tasks; record the journal if the store answers."""
        for task in (self._refreshing, self._recovering):
            if task is not None and not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, StoreUnavailable):
                    await task
        if len(self.journal):
            try:
                await self.flush()
            except StoreUnavailable:
                log.error(
                    "closing with %d outage admissions not recorded%s",
                    len(self.journal),
                    "" if self._settings.outage_spool_dir else " (no spool dir: they are lost)",
                )
        self.journal.close()
