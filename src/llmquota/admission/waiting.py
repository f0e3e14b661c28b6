"""Admissions that wait for room (max_wait_ms) instead of taking a 429 at once.

A caller that would rather wait than retry says how long it may wait. A
refusal it could outlive (retryable, with a hint within its wait) is not
answered: the request joins its tenant's queue and is decided again at the
hinted time, then answered 201 or with the final 429. Waiting costs a
sleeping coroutine; no database connection is held between decisions.

Order. Each tenant's waiters form one FIFO, by arrival: only the head is
decided, so a later arrival never overtakes an earlier waiter of the same
tenant (a small request cannot starve a big one that came first). A request
arriving while its tenant has waiters joins the back of the queue without a
decision of its own. When the head leaves (admitted, out of time, or gone)
the next one is decided at once: a refill admits the queue in order, as
fast as it has room. Requests that do not wait are decided at once as
before; they may take room a waiter needed, which they would have done
without this queue too.

Bounds. `max_wait_ms` is capped by a setting (422 above it, naming the
field), and each tenant holds at most `max_per_tenant` waiters per worker:
past it a request is answered at once, with its own refusal, or when it had
none, with the refusal the queue is waiting out (`queue_full`). A waiter
not at the head when its time runs out is answered at its deadline with the
same refusal; it is never decided out of turn.

Ladder queues. A request a provider ceiling's shedding ladder refuses,
where the step in force says `queue_ms` (domain/ladder.py), waits up to that
long (at most the cap) in the ceiling's queue instead of taking its 429:
one queue per ceiling and worker, ordered by priority, then arrival, decided
head first as a tenant's queue is, and tried again at least every
SHED_POLL_SECONDS (releases and refunds free room sooner than the refill
hint says). It is entered with the refusal it waits out; a tenant holds at
most `max_per_tenant` waiters in it.

Leaving. A caller that goes away (the `left` awaitable completes: an HTTP
client disconnected) or is cancelled leaves the queue at once. A decision
already running when it left is not abandoned mid-statement: if it admits,
the reservation is released, so nothing is held for a caller who is gone.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import dataclasses
import itertools
import math
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from llmquota.admission.releases import BackgroundReleases
from llmquota.admission.reservation import Admission
from llmquota.domain.errors import InvalidRequest
from llmquota.domain.ladder import LadderStep, shed_wait_ms
from llmquota.domain.records import AdmitRequest
from llmquota.domain.vocabulary import priority_rank
from llmquota.metrics import Metrics

Decide = Callable[[AdmitRequest], Awaitable[Admission]]
# How often the head of a ceiling's queue tries again at most (see _TenantQueue).
SHED_POLL_SECONDS = 0.05


class ClientLeft(Exception):
    """The caller went away while its admission waited; nothing is held for it."""


@dataclass(frozen=True, slots=True)
class Waited:
    """The answer to an admission that could wait, and how it came about."""

    admission: Admission
    # Milliseconds spent in the queue (0: answered at once).
    waited_ms: int = 0
    # Answered at once because the tenant's queue was full.
    queue_full: bool = False


def _retryable(admission: Admission) -> bool:
    d = admission.decision
    return d.status == "rate_limited" and d.retry_after_ms is not None


# A queue: a tenant's ("tenant", name), or a provider ceiling's ("ceiling", name).
QueueKey = tuple[str, str]


class _Waiter:
    """One queued admission: its place, its deadline, and when it is next decided."""

    __slots__ = ("deadline", "last", "place", "retry_at", "tenant", "turn")

    def __init__(
        self,
        place: tuple[int, int],
        tenant: str,
        deadline: float,
        last: Admission | None,
        retry_at: float,
    ):
        # (rank, arrival): a ceiling's queue puts higher priorities first.
        self.place = place
        self.tenant = tenant
        self.deadline = deadline
        # Its latest refusal (None until it is first decided in the queue).
        self.last = last
        self.retry_at = retry_at
        # Set when it becomes the head of its queue.
        self.turn = asyncio.Event()


@dataclass
class _TenantQueue:
    waiters: list[_Waiter] = dataclasses.field(default_factory=list)
    # The latest refusal a waiter of this queue got: what the queue waits out.
    blocked_by: Admission | None = None
    # A ceiling's queue: the head tries again at least this often, since room
    # also comes back from releases and refunds, sooner than the refill hint.
    poll_seconds: float | None = None

    def retry_in(self, admission: Admission) -> float:
        """Seconds until the next try after the refusal `admission`."""
        hint = _hint(admission)
        return hint if self.poll_seconds is None else min(hint, self.poll_seconds)


class WaitQueue:
    """Per-tenant FIFO queues of admissions waiting for room, in one worker."""

    def __init__(
        self,
        decide: Decide,
        releases: BackgroundReleases,
        metrics: Metrics,
        *,
        cap_ms: int,
        max_per_tenant: int,
        decide_first: Decide | None = None,
        ladder_of: Callable[[str], Sequence[LadderStep]] = lambda _ceiling: (),
    ) -> None:
        self._decide_now = decide
        # The first decision of a caller that did not ask to wait (it may be
        # answered from the refusal memory); and a ceiling's queueing ladder.
        self._decide_first = decide_first or decide
        self._ladder_of = ladder_of
        self._releases = releases
        self.metrics = metrics
        self.cap_ms = cap_ms
        self.max_per_tenant = max_per_tenant
        self._queues: dict[QueueKey, _TenantQueue] = {}
        self._arrivals = itertools.count()

    def check(self, max_wait_ms: int) -> None:
        """Refuse a wait over the server's cap, naming the field."""
        if isinstance(max_wait_ms, bool) or not isinstance(max_wait_ms, int) or max_wait_ms < 0:
            raise InvalidRequest("max_wait_ms must be a non-negative integer")
        if max_wait_ms > self.cap_ms:
            raise InvalidRequest(
                f"max_wait_ms: at most {self.cap_ms} (this server's cap), got {max_wait_ms}"
            )

    def waiting(self, tenant: str | None = None) -> int:
        """Admissions waiting now: of one tenant, or of all."""
        return sum(
            sum(1 for w in q.waiters if tenant is None or w.tenant == tenant)
            for q in self._queues.values()
        )

    async def decide(
        self,
        request: AdmitRequest,
        max_wait_ms: int,
        *,
        left: Awaitable[object] | None = None,
        on_queued: Callable[[], None] | None = None,
    ) -> Waited:
        """Decide `request`, waiting up to `max_wait_ms` for room; raises ClientLeft
        when `left` completes first (the caller is gone).

        `on_queued` is called when the request starts waiting (the API gives
        its fair-share permit back then: a waiter holds no worker slot).
        """
        try:
            self.check(max_wait_ms)
        except InvalidRequest:
            if asyncio.iscoroutine(left):
                left.close()  # never started: no "never awaited" warning
            raise
        return await self._watching(self._decide_waiting(request, max_wait_ms, on_queued), left)

    async def _watching(
        self, deciding: Awaitable[Waited], left: Awaitable[object] | None
    ) -> Waited:
        """The answer of `deciding`; ClientLeft if `left` completes first."""
        work = asyncio.ensure_future(deciding)
        if left is None:
            return await work
        watcher = asyncio.ensure_future(left)
        try:
            await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
            if not work.done():
                work.cancel()
        if watcher.done() and not watcher.cancelled():
            # Gone, even if an answer came at the same moment: nobody will read it.
            with contextlib.suppress(asyncio.CancelledError):
                self._abandon(await work)
            raise ClientLeft("the caller left while its admission waited")
        return work.result()

    def _abandon(self, waited: Waited) -> None:
        """Release an admission whose caller left as it was made."""
        self._releases.release(waited.admission.decision)

    async def decide_at_once(
        self,
        request: AdmitRequest,
        *,
        left: Callable[[], Awaitable[object]] | None = None,
        on_queued: Callable[[], None] | None = None,
    ) -> Waited:
        """A decision for a caller that did not ask to wait: answered at once, unless
        a provider ceiling's ladder step sheds it with a `queue_ms` (wait_out_shed).
        `left` makes the awaitable of the caller going away, if it has to wait."""
        admission = await self._decide_first(request)
        wait_ms = self._shed_wait_ms(admission)
        if not wait_ms:
            return self._answer(admission, request.tenant)
        return await self.wait_out_shed(request, admission, wait_ms, left=left, on_queued=on_queued)

    def _shed_wait_ms(self, admission: Admission) -> int | None:
        """The wait the ladder step that shed `admission` grants (None: not shed, or none)."""
        d = admission.decision
        if d.reason != "shed" or d.ceiling is None or not self.cap_ms:
            return None
        ladder = self._ladder_of(d.ceiling)
        return shed_wait_ms(ladder, d.priority, d.reserved_tokens, d.utilization)

    async def wait_out_shed(
        self,
        request: AdmitRequest,
        shed: Admission,
        queue_ms: int,
        *,
        left: Callable[[], Awaitable[object]] | None = None,
        on_queued: Callable[[], None] | None = None,
    ) -> Waited:
        """Wait up to `queue_ms` (at most the cap) in the queue of the ceiling whose
        ladder shed `request` (its refusal, `shed`), then answer as `decide` does."""
        decision = shed.decision
        assert decision.ceiling is not None and decision.priority is not None
        key = ("ceiling", decision.ceiling)
        rank = -priority_rank(decision.priority)
        wait_ms = min(queue_ms, self.cap_ms)
        work = self._enter(key, rank, request, wait_ms, on_queued, first=shed)
        return await self._watching(work, None if left is None else left())

    async def _decide_waiting(
        self, request: AdmitRequest, max_wait_ms: int, on_queued: Callable[[], None] | None
    ) -> Waited:
        return await self._enter(("tenant", request.tenant), 0, request, max_wait_ms, on_queued)

    async def _enter(
        self,
        key: QueueKey,
        rank: int,
        request: AdmitRequest,
        max_wait_ms: int,
        on_queued: Callable[[], None] | None,
        *,
        first: Admission | None = None,
    ) -> Waited:
        """Join queue `key` at (rank, arrival) and wait there; a first decision is
        made here unless the queue is busy or `first` is given."""
        loop = asyncio.get_running_loop()
        started = loop.time()
        deadline = started + max_wait_ms / 1000.0
        seq = next(self._arrivals)
        queue = self._queues.get(key)
        poll = SHED_POLL_SECONDS if key[0] == "ceiling" else None
        if queue is None or first is not None:
            # Nobody waits here: decide now, as without waiting.
            first = first or await self._decide(request)
            queue = queue or _TenantQueue(poll_seconds=poll)
            if not _retryable(first) or loop.time() + queue.retry_in(first) > deadline:
                return self._answer(first, request.tenant)
            queue = self._queues.setdefault(key, queue)
        if self.waiting_in(queue, request.tenant) >= self.max_per_tenant:
            return self._answer(
                first or self._behind(queue, request), request.tenant, queue_full=True
            )
        if first is not None:
            queue.blocked_by = first
        retry_at = loop.time() + (queue.retry_in(first) if first is not None else 0.0)
        waiter = _Waiter((rank, seq), request.tenant, deadline, first, retry_at)
        bisect.insort(queue.waiters, waiter, key=lambda w: w.place)
        reason_of = first or queue.blocked_by
        assert reason_of is not None  # a non-empty queue has a refusal it waits out
        self.metrics.count_queued(reason_of.decision)
        self.metrics.waiting.inc()
        if on_queued is not None:
            on_queued()
        outcome = "left"  # cancelled: the caller went away
        try:
            admission = await self._wait(queue, waiter, request)
            status = admission.decision.status
            outcome = "admitted" if status in ("admitted", "replayed") else "refused"
        except Exception:
            outcome = "error"  # the store could not decide (a 503)
            raise
        finally:
            self.metrics.waiting.dec()
            self.metrics.wait_seconds.labels(outcome).observe(loop.time() - started)
            self._leave(key, queue, waiter)
        waited_ms = math.ceil((loop.time() - started) * 1000)
        return self._answer(admission, request.tenant, waited_ms=waited_ms)

    async def _wait(self, queue: _TenantQueue, waiter: _Waiter, request: AdmitRequest) -> Admission:
        """Wait for the turn, then decide at each hint until admitted or out of time.

        Every decision here comes after waiting: the request asks lq_admit to
        journal the serving path `queued`, so its settlement's ledger row says
        so whichever worker settles it (a fallback admitted says fallback_model).
        """
        loop = asyncio.get_running_loop()
        request = request._replace(serving_path="queued")
        while True:
            now = loop.time()
            if queue.waiters[0] is not waiter:
                if now >= waiter.deadline:
                    return self._timed_out(queue, waiter, request, now)
                waiter.turn.clear()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout_at(waiter.deadline):
                        await waiter.turn.wait()
                continue
            if waiter.last is not None and waiter.retry_at > waiter.deadline:
                return waiter.last  # the next try would come after the caller's time
            if waiter.retry_at > now:
                await asyncio.sleep(waiter.retry_at - now)
                if queue.waiters[0] is not waiter:
                    continue  # a higher priority came first meanwhile (a ceiling's queue)
            admission = await self._decide(request)
            if not _retryable(admission):
                return admission
            waiter.last = queue.blocked_by = admission
            waiter.retry_at = loop.time() + queue.retry_in(admission)

    def _timed_out(
        self, queue: _TenantQueue, waiter: _Waiter, request: AdmitRequest, now: float
    ) -> Admission:
        """The final refusal of a waiter whose time ran out before its turn came."""
        head = queue.waiters[0]
        retry_ms = max(1, math.ceil((head.retry_at - now) * 1000))
        refusal = waiter.last or self._behind(queue, request)
        return refusal._replace(decision=refusal.decision._replace(retry_after_ms=retry_ms))

    @staticmethod
    def _behind(queue: _TenantQueue, request: AdmitRequest) -> Admission:
        """A refusal for a request never decided: the one its tenant's queue waits out.

        Its own figures (tokens it would reserve, model) replace the blocker's;
        nothing was computed for it, so it offers no alternatives.
        """
        assert queue.blocked_by is not None
        blocker = queue.blocked_by.decision
        decision = blocker._replace(
            reserved_tokens=request.input_tokens + request.max_tokens,
            model=request.model,
            input_tokens=request.input_tokens,
            priority=None,
            utilization=None,
            alt_max_tokens=None,
            alt_models=(),
        )
        return Admission(decision, request.input_tokens, request.input_estimated)

    @staticmethod
    def waiting_in(queue: _TenantQueue, tenant: str) -> int:
        """The waiters of `tenant` in `queue` (all of them, in a tenant's own)."""
        return sum(1 for w in queue.waiters if w.tenant == tenant)

    def _leave(self, key: QueueKey, queue: _TenantQueue, waiter: _Waiter) -> None:
        """Take a waiter out; the next one, if it becomes the head, is decided at once."""
        was_head = bool(queue.waiters) and queue.waiters[0] is waiter
        queue.waiters.remove(waiter)
        if not queue.waiters:
            if self._queues.get(key) is queue:
                del self._queues[key]
            return
        if was_head:
            head = queue.waiters[0]
            head.retry_at = asyncio.get_running_loop().time()
            head.turn.set()

    def _answer(
        self, admission: Admission, tenant: str, *, waited_ms: int = 0, queue_full: bool = False
    ) -> Waited:
        self.metrics.count_answer(admission.decision, tenant)
        return Waited(admission, waited_ms, queue_full)

    async def _decide(self, request: AdmitRequest) -> Admission:
        """One decision that a cancelled caller does not cut short: an admission
        nobody will hear of is released."""
        task = asyncio.ensure_future(self._decide_now(request))
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            task.add_done_callback(self._release_when_admitted)
            raise

    def _release_when_admitted(self, task: asyncio.Future[Admission]) -> None:
        if not task.cancelled() and task.exception() is None:
            self._releases.release(task.result().decision)


def _hint(admission: Admission) -> float:
    """The refusal's retry hint in seconds."""
    return (admission.decision.retry_after_ms or 0) / 1000.0
