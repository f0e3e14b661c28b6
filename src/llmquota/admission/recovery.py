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
import functools
import logging
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

from llmquota.admission.abandoned import RETRY_MISSING_SECONDS, AbandonedAdmissions
from llmquota.admission.changes import ChangeFeed
from llmquota.admission.fallback import Fallback
from llmquota.admission.outage import FlushReport, JournalFull, OutageJournal
from llmquota.admission.policy_cache import PolicyCache
from llmquota.admission.reservation import Admission
from llmquota.config import Settings
from llmquota.domain.cell_hints import new_reservation_id
from llmquota.domain.errors import ReservationNotFound, StoreTimeout, StoreUnavailable
from llmquota.domain.outage_ids import is_outage_id
from llmquota.domain.records import AdmitDecision, AdmitRequest, FinishRequest, FinishResult
from llmquota.metrics import Metrics
from llmquota.store.store import Store

log = logging.getLogger(__name__)


class OutageRecovery:
    """The policy cache, the outage journal and the fallback of one worker."""

    def __init__(
        self,
        store: Store,
        settings: Settings,
        metrics: Metrics,
        policies_moved: Callable[[], None] = lambda: None,
    ) -> None:
        self._store = store
        # Called when policies changed (announced, or written by this worker).
        self._policies_moved = policies_moved
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
            store.cell_index,
        )
        # Admission statements abandoned at their deadline (abandoned.py).
        self.abandoned = AbandonedAdmissions(
            settings.outage_journal_max_entries, settings.statement_timeout_ms / 1000.0
        )
        self._refreshing: asyncio.Task[None] | None = None
        # When the running refresh started and a refresh last failed
        # (monotonic): see refresh_when_due.
        self._refresh_started_at = 0.0
        self._refresh_failed_at: float | None = None
        self._recovering: asyncio.Task[None] | None = None
        # One refresh at a time, so that a slow one cannot put an older
        # snapshot over a newer one; and one announced by NOTIFY waits for it.
        self._refresh_lock = asyncio.Lock()
        self._announced: asyncio.Task[None] | None = None
        self._announced_again = False
        # Announced changes (changes.py): listening from the first refresh on.
        self.changes = ChangeFeed(settings, self.policies_changed)
        metrics.outage_journal_pending.set_function(lambda: len(self.journal))

    def store_failed(self, operation: str, exc: StoreUnavailable) -> None:
        """Count a statement the store did not answer."""
        kind = "timeout" if isinstance(exc, StoreTimeout) else "unavailable"
        self._metrics.store_errors.labels(operation, kind).inc()

    def store_answered(self) -> None:
        """The store answered: record the outage journal and refresh policies if due."""
        if len(self.journal) or len(self.abandoned):
            self.ensure_recovery()
        if self.policies.due(time.monotonic()):
            self._start_refresh()

    def _start_refresh(self) -> asyncio.Task[None]:
        """The background refresh: the one running, else a new one."""
        if self._refreshing is None or self._refreshing.done():
            self._refreshing = asyncio.ensure_future(self._refresh_quietly())
            self._refresh_started_at = time.monotonic()
        return self._refreshing

    async def _refresh_quietly(self) -> None:
        """A background refresh: whatever goes wrong, decisions carry on."""
        try:
            await self.refresh_policies()
        except StoreUnavailable as exc:
            self._refresh_failed_at = time.monotonic()
            self.store_failed("policy_snapshot", exc)
        except Exception:
            self._refresh_failed_at = time.monotonic()
            log.warning("refreshing the policy cache failed", exc_info=True)

    async def refresh_when_due(self, wait_seconds: float) -> None:
        """Refresh the cache first when its refresh interval has passed; a reader
        that must see a change within that interval (the proxy's response cache
        policy) calls this before reading the copy.

        Callers share one refresh (store_answered's too), so a burst of them
        costs the store one snapshot, and they wait for it at most
        `wait_seconds` from its start, all together: past that the refresh
        carries on in the background and the last copy serves. Once a refresh
        has failed, none is started or waited for here until an interval has
        passed (recovery refreshes when the store is back): an outage must not
        add a wait to every request.
        """
        now = time.monotonic()
        if not self.policies.due(now):
            return
        failed_at = self._refresh_failed_at
        if failed_at is not None and now - failed_at < self.policies.refresh_seconds:
            return
        refreshing = self._start_refresh()
        left = self._refresh_started_at + wait_seconds - now
        if left > 0:
            with contextlib.suppress(TimeoutError):
                # Shielded: a caller that stops waiting leaves the refresh running.
                await asyncio.wait_for(asyncio.shield(refreshing), left)

    async def admit(
        self, requests: list[AdmitRequest], deadline_seconds: float
    ) -> list[AdmitDecision]:
        """One admit statement, under reservation ids named here: when nobody waits
        for its answer any more (its deadline passed, its connection was lost, its
        caller was cancelled), whatever it made is released once the store answers
        (abandoned.py), so the failure mode's answer is the only one."""
        cell = self._store.cell_index
        reservation_ids = [new_reservation_id(cell) for _ in requests]
        try:
            return await self._store.admit(
                requests, deadline_seconds=deadline_seconds, reservation_ids=reservation_ids
            )
        except (StoreUnavailable, asyncio.CancelledError):
            self.abandon(reservation_ids)
            raise

    def decide_by_failure_mode(self, request: AdmitRequest, cause: StoreUnavailable) -> Admission:
        """The store did not decide in time: the layers' failure modes do (see fallback.py)."""
        fallback = self.fallback.decide(request, time.monotonic())
        offline = fallback.decision
        status = offline.status if offline is not None else "refused"
        if status != "replayed":
            outcome = "admitted" if status == "admitted" else "refused"
            self._metrics.fallback_decisions.labels(fallback.mode, outcome).inc()
        if offline is None or fallback.mode == "closed":
            raise StoreUnavailable(f"{cause}; {fallback.reason}") from cause
        if status == "admitted":
            self.ensure_recovery()  # record it as soon as the store answers
        return Admission(offline, request.input_tokens, request.input_estimated, fallback.mode)

    def abandon(self, reservation_ids: list[uuid.UUID]) -> None:
        """An admission statement naming these ids was given up on: release
        whatever it made as soon as the store answers (abandoned.py)."""
        self.abandoned.abandon(reservation_ids)
        self.ensure_recovery()

    def raise_not_found(self, reservation_id: uuid.UUID) -> NoReturn:
        """The store has no such reservation: 404, unless a worker made it during
        an outage and has not recorded it yet (503, retry)."""
        if is_outage_id(reservation_id) and self.fallback.made_by_a_worker(reservation_id):
            raise StoreUnavailable(
                f"reservation {reservation_id} was admitted during an outage and "
                "is not recorded yet; retry"
            )
        raise ReservationNotFound(f"no reservation {reservation_id}")

    def policies_changed(self) -> None:
        """A change was announced (NOTIFY): refresh the cache now, and once more
        after a refresh already running, which may have read before the change."""
        self._announced_again = True
        self._policies_moved()
        if self._announced is None or self._announced.done():
            self._announced = asyncio.ensure_future(self._refresh_announced())

    async def _refresh_announced(self) -> None:
        while self._announced_again:
            self._announced_again = False
            await self._refresh_quietly()

    async def refresh_policies(self) -> None:
        """Load every layer's policy into this worker's cache (one row if unchanged),
        and the outage id key the first time; from then on, listen for changes."""
        self.changes.listen(self._store.dsn)
        async with self._refresh_lock:
            await self._refresh_policies()

    async def policies_written(self) -> None:
        """An admin write of this worker committed: reload the cache before it
        answers, so this worker's next admission already decides by it."""
        self._policies_moved()
        try:
            await self.refresh_policies()
        except StoreUnavailable as exc:
            # Committed all the same: the announcement, or the periodic refresh,
            # brings it as soon as the store answers.
            self.store_failed("policy_snapshot", exc)

    async def _refresh_policies(self) -> None:
        if self.fallback.id_key is None:
            self.fallback.id_key = await self._store.outage_id_key(
                deadline_seconds=self._settings.statement_timeout_ms / 1000.0
            )
        snapshot = await self._store.policy_snapshot(
            self.policies.version,
            self._settings.policy_cache_max_layers,
            deadline_seconds=self._settings.statement_timeout_ms / 1000.0,
        )
        # The budgets move with every admission: taken afresh each time, after
        # marking which of this worker's recorded outage admissions they hold.
        epoch = self.fallback.budgets.epoch()
        self.policies.replace_budgets(
            await self._store.outage.budgets(
                self._settings.policy_cache_max_layers,
                deadline_seconds=self._settings.statement_timeout_ms / 1000.0,
            )
        )
        self.fallback.budgets.rebase(epoch)
        self.policies.suspended = await self._store.tenants.suspended(
            deadline_seconds=self._settings.statement_timeout_ms / 1000.0
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
        while len(self.journal) or len(self.abandoned):
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
            if len(self.abandoned):  # ids not found yet: look again a little later
                await asyncio.sleep(RETRY_MISSING_SECONDS)

    def journal_settlement(self, request: FinishRequest, cause: StoreUnavailable) -> FinishResult:
        """Keep a settle the store did not answer (an upstream answer relayed
        already, whose usage must land), and replay it when the store is back.

        The answer is what the settle will most likely be (on time, the whole
        charge). A full journal cannot take it: the caller gets the store's
        error, and the lease expires as it would have (the audit flags it).
        """
        try:
            self.journal.add_settlement(request)
        except JournalFull as exc:
            raise StoreUnavailable(f"{cause}; {exc}") from cause
        self.ensure_recovery()
        log.warning(
            "settle of %s journaled: the store did not answer (%s)", request.reservation_id, cause
        )
        charged = int(request.input_tokens or 0) + int(request.output_tokens or 0)
        return FinishResult("journaled", "active", request.caller, charged, None, False)

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
        if len(self.abandoned):
            released = await self.abandoned.release(
                functools.partial(
                    self._store.finish,
                    deadline_seconds=self._settings.statement_timeout_ms / 1000.0,
                ),
                self._settings.outage_flush_batch_size,
                time.monotonic(),
            )
            self._metrics.abandoned_released.inc(released)
        return report

    async def close(self) -> None:
        """Stop the background tasks; record the journal if the store answers."""
        await self.changes.close()
        for task in (self._refreshing, self._recovering, self._announced):
            if task is not None and not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, StoreUnavailable):
                    await task
        if len(self.journal) or len(self.abandoned):
            try:
                await self.flush()
            except StoreUnavailable:
                log.error(
                    "closing with %d outage admissions not recorded%s",
                    len(self.journal),
                    "" if self._settings.outage_spool_dir else " (no spool dir: they are lost)",
                )
        self.journal.close()
