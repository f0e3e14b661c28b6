"""The sweeper: expires lapsed leases, purges old reservations, keeps partitions ahead.

It needs the store and the settings, nothing of the admission machinery, so
`llmquota sweep` (cron, or `--loop`) runs without a policy cache, an outage
journal or batch coalescers. Every loop is bounded: batch size times batches
per run, each statement within its deadline.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from llmquota.config import Settings
from llmquota.metrics import Metrics
from llmquota.store.store import Store


@dataclass(frozen=True, slots=True)
class SweepReport:
    """What one sweeper run did."""

    expired: int
    tokens_returned: int
    batches: int
    purged: int
    partitions_created: int = 0
    cache_entries_expired: int = 0
    slices_returned: int = 0


class Sweeper:
    """One database's maintenance, run by cron, a loop, or a library caller."""

    def __init__(self, store: Store, settings: Settings, metrics: Metrics | None = None) -> None:
        self.store = store
        self.settings = settings
        self.metrics = metrics or Metrics()
        # A sweep statement may take the whole statement timeout; one more
        # second lets the server's own timeout answer first.
        self._deadline_seconds = settings.statement_timeout_ms / 1000.0 + 1.0

    async def sweep(
        self, batch_size: int | None = None, max_batches: int | None = None
    ) -> SweepReport:
        """Keep ledger partitions ahead, give back dead workers' slices, expire
        lapsed reservations in bounded batches, then purge old finished ones and
        expired response cache entries.

        The partitions come first, so that the month a run crosses into
        already has one (a missing one would only send rows to the ledger's
        DEFAULT partition, never fail them).
        """
        batch_size = batch_size or self.settings.sweep_batch_size
        max_batches = max_batches or self.settings.sweep_max_batches
        partitions = await self.store.ensure_ledger_partitions(self.settings.ledger_months_ahead)
        slices = await self._return_slices(batch_size, max_batches)
        expired, tokens, batches = await self._expire(batch_size, max_batches)
        self.metrics.sweeper_reclaims.inc(expired)
        purged = await self._purge(batch_size, max_batches)
        cache_expired = await self._expire_cache(batch_size, max_batches)
        return SweepReport(
            expired=expired,
            tokens_returned=tokens,
            batches=batches,
            purged=purged,
            partitions_created=sum(status == "created" for status in partitions.values()),
            cache_entries_expired=cache_expired,
            slices_returned=slices,
        )

    async def _expire(self, batch_size: int, max_batches: int) -> tuple[int, int, int]:
        """(reservations expired, tokens returned, batches run)."""
        expired = tokens = batches = 0
        for _ in range(max_batches):
            count, returned = await self.store.sweep(
                batch_size, deadline_seconds=self._deadline_seconds
            )
            batches += 1
            expired += count
            tokens += returned
            if count < batch_size:
                break
        return expired, tokens, batches

    async def _purge(self, batch_size: int, max_batches: int) -> int:
        """Delete finished reservations past the retention window; how many."""
        retention = self.settings.retention_seconds
        return await self._in_batches(
            lambda n: self.store.purge_finished(
                retention, n, deadline_seconds=self._deadline_seconds
            ),
            batch_size,
            max_batches,
        )

    async def _expire_cache(self, batch_size: int, max_batches: int) -> int:
        """Delete response cache entries past their expiry (a hit never serves one:
        this only bounds the table); how many."""
        return await self._in_batches(
            lambda n: self.store.response_cache.sweep(n, deadline_seconds=self._deadline_seconds),
            batch_size,
            max_batches,
        )

    async def _return_slices(self, batch_size: int, max_batches: int) -> int:
        """Give back the slices of workers that stopped without returning them
        (admission/allotments.py); how many."""

        async def step(n: int) -> int:
            returned, _tokens = await self.store.allotments.sweep(
                n, deadline_seconds=self._deadline_seconds
            )
            return returned

        return await self._in_batches(step, batch_size, max_batches)

    @staticmethod
    async def _in_batches(
        step: Callable[[int], Awaitable[int]], batch_size: int, max_batches: int
    ) -> int:
        """Run `step` on batches until one comes back short; the total it did."""
        done = 0
        for _ in range(max_batches):
            count = await step(batch_size)
            done += count
            if count < batch_size:
                break
        return done
