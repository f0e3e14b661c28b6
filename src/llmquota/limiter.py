"""The Limiter: the library a Python gateway uses, and what the API wraps.

It validates and counts a request (pure code), hands the decision to the
store (one statement), and turns the answer into a Reservation or a typed
error. While the store answers it holds no balances of its own: every figure
comes from PostgreSQL.

When the store does not answer within the decision deadline, each layer's
failure mode decides, from this worker's cached policies: `closed` refuses
(StoreUnavailable, a 503), `open` admits, `local` admits against a
worker-local fraction of the layer's limits. What is admitted that way goes
into the outage journal and is written to the store, exactly once, as soon as
it answers again; no restart is needed.

error. It holds no balances of its own: every figure comes from PostgreSQL.

Concurrent admissions of one process are coalesced into batch statements
(batching.py), and so are settlements and releases, which share one batch:
the SQL decides a batch exactly as it would decide its requests one by one
in arrival order, so callers see the same answers, only sooner.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import math
import re
import time
import uuid
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Literal

from llmquota.batching import Coalescer
from llmquota.config import MAX_TOKEN_COUNT, Settings
from llmquota.errors import (
    IdempotencyConflict,
    InvalidRequest,
    RateLimited,
    RequestTooLarge,
    ReservationConflict,
    ReservationNotFound,
    StoreTimeout,
    StoreUnavailable,
    UnknownTenant,
)
from llmquota.fallback import Fallback
from llmquota.metrics import Metrics
from llmquota.outage import (
    FlushReport,
    OutageJournal,
    OutageMode,
    is_outage_id,
)
from llmquota.policy import MAX_LEASE_SECONDS, NAME_PATTERN
from llmquota.policy_cache import PolicyCache
from llmquota.store import (
    AdmitDecision,
    AdmitRequest,
    FinishRequest,
    FinishResult,
    HeartbeatResult,
    Store,
)
from llmquota.tokens import TokenCountError, count_messages

log = logging.getLogger(__name__)

Outcome = Literal["ok", "error", "cancelled"]
OUTCOMES: frozenset[str] = frozenset({"ok", "error", "cancelled"})
MAX_MODEL_NAME_CHARS = 200
MAX_IDEMPOTENCY_KEY_CHARS = 255

_NAME = re.compile(NAME_PATTERN)


def check_name(kind: str, value: object) -> str:
    """A tenant or route name, or InvalidRequest."""
    if not isinstance(value, str) or not _NAME.fullmatch(value):
        raise InvalidRequest(f"{kind} must match {NAME_PATTERN}")
    return value


def check_token_count(name: str, value: object) -> int:
    """A token count: an integer in [0, MAX_TOKEN_COUNT], never a float or bool."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRequest(f"{name} must be an integer")
    if value < 0 or value > MAX_TOKEN_COUNT:
        raise InvalidRequest(f"{name} must be between 0 and {MAX_TOKEN_COUNT}")
    return value


def check_lease_seconds(value: object) -> None:
    """A lease length, when given: an integer number of seconds within the ceiling."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_LEASE_SECONDS:
        raise InvalidRequest(f"lease_seconds must be an integer from 1 to {MAX_LEASE_SECONDS}")


@dataclass(frozen=True, slots=True)
class Admission:
    """A decision with what the limiter counted to reach it."""

    decision: AdmitDecision
    input_tokens: int
    input_estimated: bool
    # The failure mode that admitted or refused it while the store was away.
    fallback: OutageMode | None = None

    def raise_for_refusal(self, tenant: str) -> None:
        """Raise the typed error for anything but an admission (or its replay)."""
        d = self.decision
        if d.status in ("admitted", "replayed"):
            return
        if d.status == "rate_limited":
            raise RateLimited(
                limit=d.limit_kind,  # type: ignore[arg-type]
                scope=d.limit_scope,  # type: ignore[arg-type]
                retry_after_ms=int(d.retry_after_ms or 0),
                message=refusal_message(tenant, d),
            )
        if d.status == "too_large":
            raise RequestTooLarge(
                scope=d.limit_scope,  # type: ignore[arg-type]
                requested=int(d.reserved_tokens or 0),
                capacity=int(d.capacity or 0),
                message=refusal_message(tenant, d),
            )
        if d.status == "unknown_tenant":
            raise UnknownTenant(f"unknown tenant {tenant!r}")
        raise IdempotencyConflict(
            "idempotency_key was already used for a different request by this tenant"
        )


def refusal_message(tenant: str, d: AdmitDecision) -> str:
    """A sentence a developer can act on: what bound, and what to do."""
    if d.status == "too_large":
        return (
            f"Request reserves {d.reserved_tokens} tokens but the {d.limit_scope} token "
            f"capacity for tenant {tenant} is {d.capacity}; it can never fit. Lower "
            f"max_tokens or split the input."
        )
    retry_s = (d.retry_after_ms or 0) / 1000.0
    what = {
        "tokens": f"has too few tokens for {d.reserved_tokens}",
        "requests": "is out of requests",
        "concurrency": "has no free concurrency permit",
    }.get(d.limit_kind or "", "refused")
    return (
        f"The {d.limit_scope} {d.limit_kind} limit for tenant {tenant} {what}; "
        f"retry in {retry_s:.3f}s."
    )


@dataclass(frozen=True, slots=True)
class Settlement:
    """What settling charged and gave back."""

    charged_tokens: int
    refunded_tokens: int
    late: bool


class Reservation:
    """Admitted capacity held until settled, released or expired."""

    def __init__(self, limiter: Limiter, tenant: str, admission: Admission) -> None:
        d = admission.decision
        if d.reservation_id is None or d.lease_expires_at is None:
            raise RuntimeError("a reservation needs an admitted decision")
        self._limiter = limiter
        self.tenant = tenant
        self.reservation_id: uuid.UUID = d.reservation_id
        self.reserved_tokens = int(d.reserved_tokens or 0)
        self.input_tokens = admission.input_tokens
        self.input_estimated = admission.input_estimated
        self.lease_expires_at: datetime = d.lease_expires_at
        self.replayed = d.status == "replayed"
        self.settlement: Settlement | None = None
        self.released = False

    @property
    def finished(self) -> bool:
        """Settled or released by this object."""
        return self.settlement is not None or self.released

    async def settle(
        self, *, input_tokens: int, output_tokens: int, outcome: Outcome = "ok"
    ) -> Settlement:
        """Charge what the provider reported; refund (or debit) the difference."""
        self.settlement = await self._limiter.settle(
            self.reservation_id,
            input_tokens=input_tokens,
            output_tokens=output_tokens,
            outcome=outcome,
        )
        return self.settlement

    async def release(self) -> None:
        """Give everything back: the provider was never called."""
        await self._limiter.release(self.reservation_id)
        self.released = True

    async def heartbeat(self, lease_seconds: int | None = None) -> datetime:
        """Extend the lease while the work is healthy."""
        result = await self._limiter.heartbeat(self.reservation_id, lease_seconds=lease_seconds)
        assert result.lease_expires_at is not None
        self.lease_expires_at = result.lease_expires_at
        return self.lease_expires_at


@dataclass(frozen=True, slots=True)
class SweepReport:
    """What one sweeper run did."""

    expired: int
    tokens_returned: int
    batches: int
    purged: int
    partitions_created: int = 0


class Limiter:
    """Admission control over one PostgreSQL database."""

    def __init__(self, store: Store, settings: Settings, metrics: Metrics | None = None) -> None:
        self.store = store
        self.settings = settings
        self.metrics = metrics or Metrics()
        self.deadline_seconds = settings.decision_deadline_ms / 1000.0
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
        self.metrics.outage_journal_pending.set_function(lambda: len(self.journal))
        self._admissions: Coalescer[AdmitRequest, AdmitDecision] | None = None
        self._finishes: Coalescer[FinishRequest, FinishResult] | None = None
        if settings.batching:
            window_seconds = settings.batch_window_ms / 1_000.0
            self._admissions = Coalescer(
                self._admit_batch,
                max_batch_size=settings.batch_max_size,
                window_seconds=window_seconds,
                max_in_flight=settings.batch_max_in_flight,
                on_orphan=self._release_orphan,
            )
            self._finishes = Coalescer(
                self._finish_batch,
                max_batch_size=settings.batch_max_size,
                window_seconds=window_seconds,
                max_in_flight=settings.batch_max_in_flight,
            )
        # Releases of admissions whose caller was cancelled mid-batch.
        self._orphan_releases: set[asyncio.Task[None]] = set()

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
        )
        limiter = cls(store, settings)
        try:
            await limiter.refresh_policies()
        except Exception:
            # The cache only matters during an outage: without it every layer
            # counts as closed, so a limiter that cannot load it still decides.
            log.warning("could not load the policy cache at start; will retry", exc_info=True)
        if len(limiter.journal):
            limiter._ensure_recovery()  # entries adopted from a stopped worker's spool
        return limiter

    async def close(self) -> None:
        """Let gathered batches finish, record the outage journal if the store
        answers, then close the pool."""
        if self._admissions is not None:
            await self._admissions.close()
        while self._orphan_releases:
            await asyncio.wait(set(self._orphan_releases))
        if self._finishes is not None:
            await self._finishes.close()
        for task in (self._refreshing, self._recovering):
            if task is not None and not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, StoreUnavailable):
                    await task
        if len(self.journal):
            try:
                await self.flush_outage_journal()
            except StoreUnavailable:
                log.error(
                    "closing with %d outage admissions not recorded%s",
                    len(self.journal),
                    "" if self.settings.outage_spool_dir else " (no spool dir: they are lost)",
                )
        self.journal.close()
        await self.store.close()

    async def __aenter__(self) -> Limiter:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def prepare(
        self,
        *,
        tenant: str,
        model: str,
        max_tokens: int,
        messages: Sequence[Mapping[str, Any]] | None = None,
        input_tokens: int | None = None,
        route: str | None = None,
        lease_seconds: int | None = None,
        idempotency_key: str | None = None,
    ) -> AdmitRequest:
        """Validate and count a request; pure, raises InvalidRequest."""
        check_name("tenant", tenant)
        if route is not None:
            check_name("route", route)
        if not isinstance(model, str) or not 0 < len(model) <= MAX_MODEL_NAME_CHARS:
            raise InvalidRequest(
                f"model must be a string of 1 to {MAX_MODEL_NAME_CHARS} characters"
            )
        check_token_count("max_tokens", max_tokens)
        check_lease_seconds(lease_seconds)
        if idempotency_key is not None and (
            not isinstance(idempotency_key, str)
            or not 0 < len(idempotency_key) <= MAX_IDEMPOTENCY_KEY_CHARS
        ):
            raise InvalidRequest(
                f"idempotency_key must be a string of 1 to {MAX_IDEMPOTENCY_KEY_CHARS} characters"
            )
        if (messages is None) == (input_tokens is None):
            raise InvalidRequest("give exactly one of messages or input_tokens")
        if input_tokens is not None:
            counted, estimated = check_token_count("input_tokens", input_tokens), False
        else:
            try:
                count = count_messages(messages or [], model, self.settings.estimate_factors)
            except TokenCountError as exc:
                raise InvalidRequest(str(exc)) from exc
            counted, estimated = count.tokens, count.estimated
            if counted > MAX_TOKEN_COUNT:
                raise InvalidRequest(f"messages hold more than {MAX_TOKEN_COUNT} tokens")
        request_hash = None
        if idempotency_key is not None:
            canonical = json.dumps(
                [route, model, max_tokens, lease_seconds, input_tokens, messages],
                sort_keys=True,
                separators=(",", ":"),
                default=repr,
            )
            request_hash = hashlib.sha256(canonical.encode()).hexdigest()
        return AdmitRequest(
            tenant=tenant,
            route=route,
            model=model,
            input_tokens=counted,
            max_tokens=max_tokens,
            input_estimated=estimated,
            lease_seconds=lease_seconds,
            idempotency_key=idempotency_key,
            request_hash=request_hash,
        )

    async def _admit_batch(self, requests: list[AdmitRequest]) -> list[AdmitDecision]:
        self.metrics.batch_size.labels("admit").observe(len(requests))
        return await self.store.admit(requests, deadline_seconds=self.deadline_seconds)

    async def _finish_batch(self, requests: list[FinishRequest]) -> list[FinishResult]:
        self.metrics.batch_size.labels("finish").observe(len(requests))
        return await self.store.finish(requests, deadline_seconds=self.deadline_seconds)

    async def _store_decision(self, request: AdmitRequest) -> AdmitDecision:
        """The store's decision within the deadline, waiting for a batch included.

        A caller that gives up while its batch is in flight loses nothing: an
        admission nobody heard of is released (see _release_orphan).
        """
        try:
            async with asyncio.timeout(self.deadline_seconds):
                if self._admissions is not None:
                    return await self._admissions.submit(request)
                (decision,) = await self._admit_batch([request])
                return decision
        except TimeoutError:
            raise StoreTimeout(
                f"database gave no decision within {self.deadline_seconds * 1000:.0f} ms"
            ) from None

    def _release_orphan(self, request: AdmitRequest, decision: AdmitDecision) -> None:
        """Give back an admission whose caller was cancelled before it heard of it.

        Nobody holds its id, so nobody can call the provider with it: without
        this it would hold its tokens and permit until the sweeper expired it.
        A replayed admission belongs to whoever made it first and is left alone.
        """
        if decision.status != "admitted" or decision.reservation_id is None:
            return
        reservation_id = decision.reservation_id

        async def release() -> None:
            with contextlib.suppress(StoreUnavailable, ReservationNotFound, ReservationConflict):
                await self.release(reservation_id)

        task = asyncio.get_running_loop().create_task(release())
        self._orphan_releases.add(task)
        task.add_done_callback(self._orphan_releases.discard)

    async def decide(self, request: AdmitRequest) -> Admission:
        """One admission decision; refusals are returned, not raised.

        Concurrent calls share one statement (see batching.py); the answer is
        the one deciding the requests one by one in arrival order would give.
        Raises StoreUnavailable only when the store cannot decide in time and
        the failure mode of some layer is `closed` (or nothing is cached).
        """
        started = time.perf_counter()
        try:
            decision = await self._store_decision(request)
        except StoreUnavailable as exc:
            self._store_failed("admit", exc)
            try:
                return self._decide_by_failure_mode(request, exc)
            finally:
                self.metrics.decision_seconds.observe(time.perf_counter() - started)
        self._store_answered()
        self.metrics.decision_seconds.observe(time.perf_counter() - started)
        self._count_decision(decision)
        return Admission(decision, request.input_tokens, request.input_estimated)

    def _decide_by_failure_mode(self, request: AdmitRequest, cause: StoreUnavailable) -> Admission:
        """The store did not decide in time: the layers' failure modes do (see fallback.py)."""
        fallback = self.fallback.decide(request, time.monotonic())
        offline = fallback.decision
        status = offline.status if offline is not None else "refused"
        if status != "replayed":
            outcome = "admitted" if status == "admitted" else "refused"
            self.metrics.fallback_decisions.labels(fallback.mode, outcome).inc()
        if offline is None or fallback.mode == "closed":
            raise StoreUnavailable(f"{cause}; {fallback.reason}") from cause
        if status == "admitted":
            self._ensure_recovery()  # record it as soon as the store answers
        return Admission(offline, request.input_tokens, request.input_estimated, fallback.mode)

    def _count_decision(self, decision: AdmitDecision) -> None:
        if decision.status == "admitted":
            self.metrics.admits.inc()
        elif decision.status in ("rate_limited", "too_large"):
            self.metrics.denials.labels(
                decision.limit_kind, decision.limit_scope, decision.status
            ).inc()
            if decision.limit_kind == "concurrency":
                self.metrics.concurrency_denials.labels(decision.limit_scope).inc()
            else:
                self.metrics.policy_denials.labels(
                    decision.limit_kind, decision.limit_scope, decision.status
                ).inc()

    # -- while the store is away -------------------------------------------

    def _store_failed(self, operation: str, exc: StoreUnavailable) -> None:
        kind = "timeout" if isinstance(exc, StoreTimeout) else "unavailable"
        self.metrics.store_errors.labels(operation, kind).inc()

    def _store_answered(self) -> None:
        """The store answered: record the outage journal and refresh policies if due."""
        if len(self.journal):
            self._ensure_recovery()
        if self.policies.due(time.monotonic()) and (
            self._refreshing is None or self._refreshing.done()
        ):
            self._refreshing = asyncio.ensure_future(self._refresh_quietly())

    async def _refresh_quietly(self) -> None:
        """A background refresh: whatever goes wrong, decisions carry on."""
        try:
            await self.refresh_policies()
        except StoreUnavailable as exc:
            self._store_failed("policy_snapshot", exc)
        except Exception:
            log.warning("refreshing the policy cache failed", exc_info=True)

    async def refresh_policies(self) -> None:
        """Load every layer's policy into this worker's cache (one row if unchanged)."""
        snapshot = await self.store.policy_snapshot(
            self.policies.version,
            self.settings.policy_cache_max_layers,
            deadline_seconds=self.settings.statement_timeout_ms / 1000.0,
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

    def _ensure_recovery(self) -> None:
        if self._recovering is None or self._recovering.done():
            self._recovering = asyncio.ensure_future(self._recover())

    async def _recover(self) -> None:
        """Until the journal is empty: try to record it, wait, try again."""
        while len(self.journal):
            try:
                # A cheap probe first, within the decision deadline: while the
                # store hangs, no flush sits on a statement for long.
                await self.store.ping(deadline_seconds=self.deadline_seconds)
                await self.flush_outage_journal()
            except StoreUnavailable as exc:
                self._store_failed("record_outage", exc)
                await asyncio.sleep(self.settings.outage_probe_seconds)
                continue
            except Exception:
                # Not an outage: a bug or a refused statement. Say so loudly and
                # keep the journal for the next attempt rather than drop it.
                log.exception("recording the outage journal failed; will retry")
                await asyncio.sleep(self.settings.outage_probe_seconds)
                continue
            await self._refresh_quietly()

    async def flush_outage_journal(self) -> FlushReport:
        """Write the outage journal to the store now (the recovery task does this by itself)."""
        report = await self.journal.flush(
            self.store,
            self.settings.outage_flush_batch_size,
            deadline_seconds=self.settings.statement_timeout_ms / 1000.0,
        )
        self.fallback.recorded(report.forgotten, time.monotonic())
        self.metrics.outage_recorded.labels("admission").inc(report.admissions_recorded)
        self.metrics.outage_recorded.labels("finish").inc(report.finishes_recorded)
        return report

    async def admit(self, **request: Any) -> Reservation:
        """Reserve capacity for one request, or raise why not.

        Keyword arguments are those of `prepare`.
        """
        prepared = self.prepare(**request)
        admission = await self.decide(prepared)
        admission.raise_for_refusal(prepared.tenant)
        return Reservation(self, prepared.tenant, admission)

    @contextlib.asynccontextmanager
    async def reservation(self, **request: Any) -> AsyncIterator[Reservation]:
        """Hold a reservation for a block; leaving it unsettled releases it.

        The release also runs on exceptions and cancellation (shielded, so a
        cancelled caller still returns its capacity).
        """
        held = await self.admit(**request)
        try:
            yield held
        finally:
            if not held.finished:
                try:
                    await asyncio.shield(self.release(held.reservation_id))
                except ReservationConflict as exc:
                    # The lease ran out inside the block: the expiry already
                    # returned the capacity, so there is nothing left to release.
                    if exc.state != "expired":
                        raise
                held.released = True

    async def _finish_one(self, request: FinishRequest) -> FinishResult:
        """Settle or release one reservation, in a batch shared with concurrent callers."""
        if is_outage_id(request.reservation_id):
            offline = self.fallback.finish(request, time.monotonic())
            if offline is not None:
                self._ensure_recovery()
                return offline
        try:
            async with asyncio.timeout(self.deadline_seconds):
                if self._finishes is not None:
                    result = await self._finishes.submit(request)
                else:
                    (result,) = await self._finish_batch([request])
        except TimeoutError:
            timeout = StoreTimeout(f"no answer within {self.deadline_seconds * 1000:.0f} ms")
            self._store_failed(request.action, timeout)
            raise timeout from None
        except StoreUnavailable as exc:
            self._store_failed(request.action, exc)
            raise
        self._store_answered()
        if result.status == "not_found":
            if is_outage_id(request.reservation_id):
                # Admitted during an outage by a worker that has not recorded it yet.
                raise StoreUnavailable(
                    f"reservation {request.reservation_id} was admitted during an outage and "
                    "is not recorded yet; retry"
                )
            raise ReservationNotFound(f"no reservation {request.reservation_id}")
        return result

    async def settle(
        self,
        reservation_id: uuid.UUID,
        *,
        input_tokens: int,
        output_tokens: int,
        outcome: str = "ok",
        caller: str | None = None,
    ) -> Settlement:
        """Charge actual usage for a reservation; idempotent for the same figures."""
        check_token_count("input_tokens", input_tokens)
        check_token_count("output_tokens", output_tokens)
        if outcome not in OUTCOMES:
            raise InvalidRequest(f"outcome must be one of {sorted(OUTCOMES)}")
        result = await self._finish_one(
            FinishRequest(reservation_id, "settle", caller, input_tokens, output_tokens, outcome)
        )
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
        )
        if result.status == "settled":
            self.metrics.settlements.labels(str(settlement.late).lower()).inc()
            self.metrics.refunded_tokens.inc(settlement.refunded_tokens)
        return settlement

    async def release(self, reservation_id: uuid.UUID, caller: str | None = None) -> None:
        """Return a reservation unused; idempotent."""
        result = await self._finish_one(FinishRequest(reservation_id, "release", caller))
        if result.status == "conflict":
            raise ReservationConflict(
                f"reservation is {result.state}; it cannot be released", state=result.state
            )
        if result.status == "released":
            self.metrics.releases.inc()

    async def heartbeat(
        self,
        reservation_id: uuid.UUID,
        lease_seconds: int | None = None,
        caller: str | None = None,
        lease_generation: int | None = None,
    ) -> HeartbeatResult:
        """Extend a live lease, or raise why it cannot be.

        `lease_generation`, when given, is the fencing token the caller holds
        (from the admission or its last heartbeat): a stale one is refused, so
        a worker that was paused while another took over cannot extend it.
        """
        check_lease_seconds(lease_seconds)
        if lease_generation is not None and (
            isinstance(lease_generation, bool)
            or not isinstance(lease_generation, int)
            or lease_generation < 1
        ):
            raise InvalidRequest("lease_generation must be a positive integer")
        if is_outage_id(reservation_id):
            offline = self.fallback.heartbeat(reservation_id, caller, lease_seconds)
            if offline is not None:
                return offline
        try:
            result = await self.store.heartbeat(
                reservation_id,
                caller,
                lease_seconds,
                lease_generation,
                deadline_seconds=self.deadline_seconds,
            )
        except StoreUnavailable as exc:
            self._store_failed("heartbeat", exc)
            raise
        self._store_answered()
        if result is None:
            raise ReservationNotFound(f"no reservation {reservation_id}")
        if result.lease_expires_at is None:
            if (
                result.lease_live
                and lease_generation is not None
                and result.current_generation != lease_generation
            ):
                raise ReservationConflict(
                    f"stale lease generation {lease_generation}: the lease is at generation "
                    f"{result.current_generation}; another holder extended it",
                    state=result.state,
                )
            # 'active' here means the lease ran out, or a settle won the race.
            state = (
                "no longer active (its lease ran out, or it was just settled)"
                if result.state == "active"
                else result.state
            )
            raise ReservationConflict(
                f"reservation is {state}; its lease cannot be extended", state=result.state
            )
        return result

    async def sweep(
        self, batch_size: int | None = None, max_batches: int | None = None
    ) -> SweepReport:
        """Keep ledger partitions ahead, expire lapsed reservations in bounded
        batches, then purge old finished ones.

        The partitions come first, so that the month a run crosses into
        already has one (a missing one would only send rows to the ledger's
        DEFAULT partition, never fail them).
        """
        batch_size = batch_size or self.settings.sweep_batch_size
        max_batches = max_batches or self.settings.sweep_max_batches
        partitions = await self.store.ensure_ledger_partitions(self.settings.ledger_months_ahead)
        expired = tokens = batches = 0
        deadline = self.settings.statement_timeout_ms / 1000.0 + 1.0
        for _ in range(max_batches):
            count, returned = await self.store.sweep(batch_size, deadline_seconds=deadline)
            batches += 1
            expired += count
            tokens += returned
            if count < batch_size:
                break
        self.metrics.sweeper_reclaims.inc(expired)
        purged = 0
        for _ in range(max_batches):
            deleted = await self.store.purge_finished(
                self.settings.retention_seconds, batch_size, deadline_seconds=deadline
            )
            purged += deleted
            if deleted < batch_size:
                break
        return SweepReport(
            expired=expired,
            tokens_returned=tokens,
            batches=batches,
            purged=purged,
            partitions_created=sum(status == "created" for status in partitions.values()),
        )


def seconds_until_full(
    balance: float | None, burst: int | None, per_minute: int | None
) -> float | None:
    """How long a bucket takes to refill completely; None where there is no limit."""
    if balance is None or burst is None or not per_minute:
        return None
    return max(0.0, (burst - balance) * 60.0 / per_minute)


def ceil_seconds(milliseconds: int) -> int:
    """Whole seconds, rounded up, for a Retry-After header."""
    return max(1, math.ceil(milliseconds / 1000))
