"""The Limiter: the library a Python gateway uses, and what the API wraps.

It validates and counts a request (domain/admit_request.py), has the store
decide it (one statement per batch: batching.py coalesces concurrent calls,
decided as one by one in arrival order) and answers a Reservation or a typed
error. Every figure comes from PostgreSQL, but for a tenant whose policy says
`allotted`: its plain requests are decided from a slice of its layers' room
this worker took from them (allotments.py). When the store does not answer in
time, each layer's failure mode decides from the cached policies (`closed`:
503, `open`, `local`: a worker-local fraction), journaled and written exactly
once when it answers again (recovery.py). Repeats past a limit are refused
from memory for a moment (refusals.py); `max_wait_ms` waits for room (waiting.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Unpack

from llmquota.admin.sweeper import Sweeper, SweepReport
from llmquota.admission.accounting import TokenAccounting
from llmquota.admission.allotments import Allotments
from llmquota.admission.batching import Coalescer, isolating, single
from llmquota.admission.counting import TokenCounter
from llmquota.admission.estimates import OutputEstimator
from llmquota.admission.outage import FlushReport
from llmquota.admission.recovery import OutageRecovery
from llmquota.admission.refusals import RefusalMemory
from llmquota.admission.releases import BackgroundReleases
from llmquota.admission.reservation import Admission, Reservation, Settlement, heartbeat_refusal
from llmquota.admission.waiting import WaitQueue
from llmquota.config import Settings
from llmquota.domain.admit_request import AdmitArguments
from llmquota.domain.errors import (
    InvalidRequest,
    RefusedValue,
    ReservationConflict,
    ReservationNotFound,
    StoreTimeout,
    StoreUnavailable,
    TenantSuspended,
)
from llmquota.domain.outage_ids import is_outage_id
from llmquota.domain.records import (
    AdmitDecision,
    AdmitRequest,
    FinishRequest,
    FinishResult,
    HeartbeatResult,
)
from llmquota.domain.response_cache import CachePolicy
from llmquota.domain.upstream_usage import UpstreamUsage
from llmquota.domain.validation import (
    check_lease_generation,
    check_lease_seconds,
    check_token_count,
)
from llmquota.domain.vocabulary import OUTCOMES, SettledPath
from llmquota.metrics import Metrics
from llmquota.store.deadline import DeadlineQueue, within_store_deadline
from llmquota.store.store import Store

log = logging.getLogger(__name__)

__all__ = ["Admission", "Limiter", "Reservation", "Settlement", "SweepReport"]


class Limiter:
    """Admission control over one PostgreSQL database."""

    def __init__(self, store: Store, settings: Settings, metrics: Metrics | None = None) -> None:
        self.store = store
        self.settings = settings
        self.metrics = metrics or Metrics()
        self.deadline_seconds = settings.decision_deadline_ms / 1000.0
        self.refusals = RefusalMemory(settings.refusal_memory_ms / 1000.0)
        self.outage = OutageRecovery(store, settings, self.metrics, self.refusals.forget_all)
        self.policies = self.outage.policies
        # A suspension (announced, or done on this worker) reloads the policies with it.
        self.outage.changes.watch_tenants(lambda _tenant: self.outage.policies_changed())
        self.journal = self.outage.journal
        self.fallback = self.outage.fallback
        self.estimates = OutputEstimator(store, self.policies, settings)
        self._sweeper = Sweeper(store, settings, self.metrics)
        self.counter = TokenCounter(settings, server_key=lambda: self.fallback.id_key)
        self.accounting = TokenAccounting(self.metrics)
        self.allotments = Allotments(
            store.allotments, settings, self.policies, self.accounting.decided, store.cell_index
        )
        # Releases of admissions whose caller was cancelled or left.
        self.orphans = BackgroundReleases(self.release)
        self.waiting = WaitQueue(
            functools.partial(self.decide, answer=False, recall=False),
            self.orphans,
            self.metrics,
            cap_ms=settings.max_wait_ms_cap,
            max_per_tenant=settings.tenant_max_waiting_for_room,
            decide_first=functools.partial(self.decide, answer=False, recall=True),
            ladder_of=self.policies.ladder_of,
        )
        self._admissions: Coalescer[AdmitRequest, AdmitDecision] | None = None
        self._finishes: Coalescer[FinishRequest, FinishResult] | None = None
        deadline_ms = f"{self.deadline_seconds * 1000:.0f} ms"
        self._admit_timed_out = functools.partial(
            StoreTimeout, f"database gave no decision within {deadline_ms}"
        )
        self._finish_timed_out = functools.partial(StoreTimeout, f"no answer within {deadline_ms}")
        self._admit_deadlines = DeadlineQueue(self.deadline_seconds, self._admit_timed_out)
        self._finish_deadlines = DeadlineQueue(self.deadline_seconds, self._finish_timed_out)
        if settings.batching:
            window_seconds = settings.batch_window_ms / 1_000.0
            self._admissions = Coalescer(
                self._admit_batch,
                max_batch_size=settings.batch_max_size,
                window_seconds=window_seconds,
                max_in_flight=settings.batch_max_running,
                on_orphan=self.orphans.orphan,
            )
            self._finishes = Coalescer(
                self._finish_batch,
                max_batch_size=settings.batch_max_size,
                window_seconds=window_seconds,
                max_in_flight=settings.batch_max_running,
            )

    @classmethod
    async def connect(cls, dsn: str, settings: Settings | None = None) -> Limiter:
        """Open a pool to an already-migrated database."""
        settings = settings or Settings()
        store = await Store.connect(
            dsn,
            min_size=settings.pool_min_size,
            max_size=settings.pool_max_size,
            statement_timeout_ms=settings.statement_timeout_ms,
            lock_timeout_ms=settings.lock_timeout_ms,
            concurrency_retry_ms=settings.concurrency_retry_ms,
            admission_synchronous_commit=settings.admission_synchronous_commit,
            transaction_pooler=settings.transaction_pooler,
        )
        limiter = cls(store, settings)
        try:
            await limiter.refresh_policies()
        except Exception:
            # Only an outage needs it (without it every layer counts as closed).
            log.warning("could not load the policy cache at start; will retry", exc_info=True)
        if len(limiter.journal):
            limiter.outage.ensure_recovery()  # entries adopted from a stopped worker's spool
        return limiter

    async def close(self) -> None:
        """Finish batches, write what it can (journals), give slices back, close the pool."""
        if self._admissions is not None:
            await self._admissions.close()
        await self.orphans.close()
        if self._finishes is not None:
            await self._finishes.close()
        await self.allotments.close()
        await self.outage.close()
        await self.estimates.close()
        self.counter.close()
        await self.store.close()

    async def __aenter__(self) -> Limiter:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def prepare(self, **request: Unpack[AdmitArguments]) -> AdmitRequest:
        """Validate and count a request (AdmitArguments) now; raises InvalidRequest."""
        return self.counter.prepare(**request)

    async def prepare_off_loop(self, **request: Unpack[AdmitArguments]) -> AdmitRequest:
        """`prepare`, with big prompts counted off the event loop (see counting.py)."""
        return await self.counter.prepare_off_loop(**request)

    async def _admit_batch(self, requests: list[AdmitRequest]) -> list[AdmitDecision | Exception]:
        """One admit statement for the batch; a request whose data the database
        refuses gets that error alone (see batching.isolating). The batch's
        decisions are counted here, once per batch rather than per caller."""
        self.metrics.batch_size.labels("admit").observe(len(requests))
        results = await isolating(self._admit_statement, requests, RefusedValue)
        self.outage.store_answered()
        self.accounting.decided(results)
        return results

    async def _admit_statement(self, requests: list[AdmitRequest]) -> list[AdmitDecision]:
        return await self.outage.admit(requests, self.deadline_seconds)  # see abandoned.py

    async def _finish_batch(self, requests: list[FinishRequest]) -> list[FinishResult | Exception]:
        """One finish statement for the batch, isolating refused data like admissions."""
        self.metrics.batch_size.labels("finish").observe(len(requests))
        results = await isolating(self._finish_statement, requests, RefusedValue)
        self.refusals.forget_finished(results)  # what they held is back (refusals.py)
        return results

    async def _finish_statement(self, requests: list[FinishRequest]) -> list[FinishResult]:
        await self.allotments.journaled(r.reservation_id for r in requests)
        return await self.store.finish(requests, deadline_seconds=self.deadline_seconds)

    async def decide(
        self, request: AdmitRequest, *, answer: bool = True, recall: bool = True
    ) -> Admission:
        """One admission decision; refusals are returned, not raised.

        Concurrent calls share one statement (batching.py), answered as one by one
        in arrival order. StoreUnavailable only when the store cannot decide in
        time and some layer's failure mode is `closed` (or nothing is cached).
        An admission whose caller gave up meanwhile is released (releases.py).
        `answer=False`: counted by the wait queue once final (waiting.py);
        `recall`: a remembered refusal may answer (not a waiter: it waits it out).
        """
        started = time.perf_counter()
        request = self.estimates.apply(request)  # the output to reserve (estimates.py)
        remembered = self.refusals.recall(request, time.monotonic()) if recall else None
        if remembered is not None:  # a refusal that still holds (refusals.py)
            if answer:  # (a first decision's count is the wait queue's)
                self.metrics.count_answer(remembered, request.tenant)
            self.metrics.refusals_from_memory.inc()
            return Admission(remembered, request.input_tokens, request.input_estimated, None)
        try:
            allotted = self.allotments.decide(request)  # None: decide it exactly
            if allotted is not None:
                decision = allotted
            elif self._admissions is not None:
                decision = await self._admit_deadlines.watch(self._admissions.enqueue(request))
            else:
                decision = single(
                    await within_store_deadline(
                        self._admit_batch([request]), self.deadline_seconds, self._admit_timed_out
                    )
                )
        except StoreUnavailable as exc:
            self.outage.store_failed("admit", exc)
            try:
                admission = self.outage.decide_by_failure_mode(request, exc)
            finally:
                self.metrics.decision_seconds.observe(time.perf_counter() - started)
        else:
            self.metrics.decision_seconds.observe(time.perf_counter() - started)
            self.refusals.remember(request, decision, time.monotonic())
            admission = Admission(
                decision,
                request.input_tokens,
                request.input_estimated,
                None,
                # the admitted model's (a fallback's own when degraded)
                request.output_strategy_of(decision.model),
            )
        if answer:
            self.metrics.count_answer(admission.decision, request.tenant)
        return admission

    # -- while the store is away -------------------------------------------
    async def refresh_policies(self) -> None:
        """Load every layer's policy into this worker's cache (one row if unchanged)."""
        await self.outage.refresh_policies()

    async def cache_policy(self, tenant: str, route: str | None) -> CachePolicy | None:
        """The response cache policy of a request (the route's, else the tenant's, else
        its plan's; None: cache nothing), from this worker's policy cache, without a
        round trip: a change reaches it when announced, else within
        POLICY_CACHE_REFRESH_SECONDS, as an older copy is refreshed first (recovery.py)."""
        await self.outage.refresh_when_due(self.deadline_seconds)
        return self.policies.cache_policy(tenant, route)

    async def flush_outage_journal(self) -> FlushReport:
        """Write the outage journal to the store now (the recovery task does this by itself)."""
        return await self.outage.flush()

    async def admit(
        self, *, max_wait_ms: int | None = None, **request: Unpack[AdmitArguments]
    ) -> Reservation:
        """Reserve capacity for one request, or raise why not.

        Keyword arguments are those of `prepare`, and `max_wait_ms`: wait up
        to that long for room rather than raise RateLimited (waiting.py).
        """
        self.refuse_suspended(request["tenant"])
        if self.counter.inline(request):  # no coroutine for a count done here and now
            prepared = self.counter.prepare(**request)
        else:
            prepared = await self.counter.prepare_off_loop(**request)
        waits = self.waiting
        waited = (
            waits.decide(prepared, max_wait_ms) if max_wait_ms else waits.decide_at_once(prepared)
        )
        admission = (await waited).admission
        admission.raise_for_refusal(prepared.tenant)
        return Reservation(self, prepared.tenant, admission)

    def refuse_suspended(self, tenant: str) -> None:
        """TenantSuspended for a tenant this worker knows is suspended (policy_cache.py)."""
        if tenant in self.policies.suspended:
            raise TenantSuspended(f"tenant {tenant!r} is suspended")

    @contextlib.asynccontextmanager
    async def reservation(
        self, *, max_wait_ms: int | None = None, **request: Unpack[AdmitArguments]
    ) -> AsyncIterator[Reservation]:
        """Hold a reservation for a block; leaving it unsettled releases it.

        The release also runs on exceptions and cancellation (shielded, so a
        cancelled caller still returns its capacity).
        """
        held = await self.admit(max_wait_ms=max_wait_ms, **request)
        try:
            yield held
        finally:
            await held.release_unless_finished()

    async def _finish_one(
        self, request: FinishRequest, journal: bool = False, retried: bool = False
    ) -> FinishResult:
        """Settle or release one reservation, in a batch shared with concurrent callers
        (`journal`: a settle the store does not answer is journaled, see recovery.py)."""
        if is_outage_id(request.reservation_id):
            offline = self.fallback.finish(request, time.monotonic())
            if offline is not None:
                self.outage.ensure_recovery()
                return offline
        try:
            if self._finishes is not None:
                result = await self._finish_deadlines.watch(self._finishes.enqueue(request))
            else:
                result = single(
                    await within_store_deadline(
                        self._finish_batch([request]), self.deadline_seconds, self._finish_timed_out
                    )
                )
        except StoreUnavailable as exc:
            self.outage.store_failed(request.action, exc)
            if not journal:
                raise
            return self.outage.journal_settlement(request, exc)
        self.outage.store_answered()
        if result.status == "not_found":
            if not retried and self.allotments.may_journal_later(request.reservation_id):
                await asyncio.sleep(2 * self.allotments.journal_seconds)
                return await self._finish_one(request, journal, retried=True)
            self.outage.raise_not_found(request.reservation_id)
        return result

    async def settle(
        self,
        reservation_id: uuid.UUID,
        *,
        input_tokens: int,
        output_tokens: int,
        outcome: str = "ok",
        caller: str | None = None,
        usage: UpstreamUsage | None = None,
        serving_path: SettledPath | None = None,
    ) -> Settlement:
        """Charge actual usage for a reservation; idempotent for the same figures.

        `usage`: an upstream reported the figures, for an answer relayed
        already. Its source goes to the ledger row, and a store that does not
        answer gets the settle journaled, not lost (Settlement.journaled).
        `serving_path`: the ledger row's, when known better than at admission (the proxy's).
        """
        check_token_count("input_tokens", input_tokens)
        check_token_count("output_tokens", output_tokens)
        if outcome not in OUTCOMES:
            raise InvalidRequest(f"outcome must be one of {sorted(OUTCOMES)}")
        request = FinishRequest(
            reservation_id, "settle", caller, input_tokens, output_tokens, outcome, serving_path
        )
        request = request if usage is None else usage.onto(request)
        result = await self._finish_one(request, journal=usage is not None)
        if result.status == "conflict":
            raise ReservationConflict(
                "reservation was released; it cannot be settled"
                if result.state == "released"
                else "reservation was settled before with different figures",
                state=result.state,
            )
        settlement = Settlement(
            charged_tokens=int(result.charged_tokens or 0),
            refunded_tokens=int(result.refunded_tokens or 0),
            late=bool(result.late),
            excess_tokens=int(result.excess_tokens or 0),
            journaled=result.status == "journaled",
        )
        if result.status == "settled":
            self.accounting.settled(reservation_id, result, settlement)
        return settlement

    async def release(self, reservation_id: uuid.UUID, caller: str | None = None) -> None:
        """Return a reservation unused; idempotent."""
        result = await self._finish_one(FinishRequest(reservation_id, "release", caller))
        if result.status == "conflict":
            raise ReservationConflict(
                f"reservation is {result.state}; it cannot be released", state=result.state
            )
        if result.status == "released":
            self.accounting.released(reservation_id)

    async def heartbeat(
        self,
        reservation_id: uuid.UUID,
        lease_seconds: int | None = None,
        caller: str | None = None,
        lease_generation: int | None = None,
        relayed: bool = False,
    ) -> HeartbeatResult:
        """Extend a live lease, or raise why it cannot be.

        `lease_generation`: the caller's fencing token (from the admission or its
        last heartbeat); a stale one is refused, so a worker paused while another
        took over cannot extend it. `relayed`: the proxy relayed its output.
        """
        check_lease_seconds(lease_seconds)
        check_lease_generation(lease_generation)
        if is_outage_id(reservation_id):
            offline = self.fallback.heartbeat(reservation_id, caller, lease_seconds)
            if offline is not None:
                return offline
        try:
            await self.allotments.journaled((reservation_id,))
            result = await self.store.heartbeat(
                reservation_id,
                caller,
                lease_seconds,
                lease_generation,
                relayed=relayed,
                deadline_seconds=self.deadline_seconds,
            )
        except StoreUnavailable as exc:
            self.outage.store_failed("heartbeat", exc)
            raise
        self.outage.store_answered()
        if result is None:
            raise ReservationNotFound(f"no reservation {reservation_id}")
        if result.lease_expires_at is None:
            raise heartbeat_refusal(result, lease_generation)
        return result

    async def sweep(
        self, batch_size: int | None = None, max_batches: int | None = None
    ) -> SweepReport:
        """One sweeper run over this limiter's database (see admin/sweeper.py)."""
        return await self._sweeper.sweep(batch_size, max_batches)
