"""Allotted admission: a tenant's requests decided in memory, from slices.

A tenant (or route) whose policy says `"admission": "allotted"` has its
plain requests (no idempotency key, priority, explicit fallbacks or
deployments) decided here. The worker takes a slice of the request's layers'
room in one statement (lq_allot: a real debit of every layer, so nothing
decided from it can exceed what the exact path would allow), then admits
from it with no round trip: a reservation id, a few integers taken off the
slice. What it admitted is journaled as reservations every
`allotment_journal_ms` in one statement for all slices (lq_allot_journal),
and settles, releases and the sweeper treat those reservations as any other.

Near the limits it is exact again: a slice never takes more than
`allotment_share` of any layer's room, so slices shrink with the room, and
when less than the request's own cost can be granted the slice is given
back and the key is decided by lq_admit for a while (`EXACT_SECONDS`). A
slice unused for `IDLE_SECONDS` goes back too; one whose worker died comes
back through the sweeper after `allotment_hold_seconds`. What a dying worker
admitted but had not journaled yet is the over-admission a crash can cause:
at most one journal interval's admissions (docs/scaling.md).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable, Coroutine, Iterable, Sequence
from datetime import UTC, datetime
from typing import Any

from llmquota.admission.policy_cache import PolicyCache
from llmquota.config import Settings
from llmquota.domain.errors import StoreUnavailable
from llmquota.domain.records import (
    AdmitDecision,
    AdmitRequest,
    TenantFigures,
    TokenLayerFigures,
)
from llmquota.domain.slice_ids import SliceIds, may_be_journaled_later
from llmquota.store.allotments import AllotmentStore, Grant, SliceAdmission, SliceKey

log = logging.getLogger(__name__)

# How long a key whose layers were near their limits (or not allottable) is
# decided exactly before a slice is asked for again.
EXACT_SECONDS = 1.0
# A slice its worker has not admitted from for this long is given back.
IDLE_SECONDS = 5.0
# The first slice asks for this many requests' worth; each top-up doubles it,
# up to allotment_max_requests.
FIRST_REQUESTS = 8
# A key without a slice is decided exactly until it has asked this many times
# within WARM_SECONDS: a tenant seen once in a while never costs a statement
# of its own (its requests share lq_admit's batches).
WARM_REQUESTS = 8
WARM_SECONDS = 1.0
# Past this many unjournaled admissions the journal is written at once.
JOURNAL_BATCH = 2_048


class Slice:
    """What this worker holds of one key's layers, as it knows it."""

    __slots__ = (
        "allotment_id",
        "ask",
        "clock_offset",
        "grant",
        "granted",
        "key",
        "lease_seconds",
        "requests",
        "retry_at",
        "tokens",
        "topping",
        "used_at",
    )

    def __init__(self, key: SliceKey) -> None:
        self.allotment_id = uuid.uuid4()
        self.key = key
        self.tokens = 0
        self.requests = 0
        self.ask = FIRST_REQUESTS
        self.lease_seconds = 0
        self.grant: Grant | None = None
        self.granted = 0  # tokens the last grant added
        self.clock_offset = 0.0  # database time minus monotonic time, at the last grant
        self.used_at = time.monotonic()
        self.topping: asyncio.Future[None] | None = None
        self.retry_at = 0.0  # no top-up before (the store did not answer the last)

    def may_grow(self, now: float) -> bool:
        """Whether a top-up may start now: none under way, none failed just now."""
        return self.topping is None and now >= self.retry_at

    def take(self, cost: int, now: float) -> bool:
        """Take one request of `cost` tokens off the slice, if it holds them."""
        if self.tokens < cost or self.requests < 1:
            return False
        self.tokens -= cost
        self.requests -= 1
        self.used_at = now
        return True


class Allotments:
    """One worker's slices, their journal, and the decisions taken from them."""

    def __init__(
        self,
        store: AllotmentStore,
        settings: Settings,
        policies: PolicyCache,
        count: Callable[[Sequence[AdmitDecision]], None],
        cell: int | None = None,
    ) -> None:
        self.store = store
        self.policies = policies
        # The metrics of decisions (accounting.py), given a journal's worth at a
        # time: one increment per batch, as the store's decisions are counted.
        self.count = count
        self._uncounted: list[AdmitDecision] = []
        self.holder = f"worker-{uuid.uuid4().hex[:12]}"
        self.ids = SliceIds(cell)  # hinting at the cell (domain/cell_hints.py), if any
        self.journal_seconds = settings.allotment_journal_ms / 1000.0
        self.hold_seconds = settings.allotment_hold_seconds
        self.share = settings.allotment_share
        self.max_requests = settings.allotment_max_requests
        self.slices: dict[SliceKey, Slice] = {}
        self.exact_until: dict[SliceKey, float] = {}
        self.seen: dict[SliceKey, int] = {}  # requests without a slice, this WARM_SECONDS
        self._seen_since = time.monotonic()
        self.pending: list[tuple[Slice, SliceAdmission]] = []
        self._pending_ids: set[uuid.UUID] = set()
        self._timer: asyncio.TimerHandle | None = None
        self._writing: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._idle_check_at = time.monotonic() + IDLE_SECONDS

    def may_journal_later(self, reservation_id: uuid.UUID) -> bool:
        """Whether an id the store does not know may be a slice's admission that
        some worker has not journaled yet (worth a look after the interval): one
        of a slice's form, or any while some policy is allotted (a worker of an
        earlier release gave its slices' admissions version-4 ids)."""
        return may_be_journaled_later(reservation_id) or self.policies.any_allotted

    def applies(self, request: AdmitRequest) -> bool:
        """Whether a request may be decided from a slice: a plain one, of a
        tenant (route) whose policy says allotted, as the policy cache has it.
        Deployments named (the proxy names them always) are fine: with no
        provider ceiling on the model (lq_allot's condition) lq_admit sends a
        request to its model's first deployment, and so does a slice."""
        if (
            request.idempotency_key is not None
            or request.priority is not None  # (priority_any alone asks for nothing)
            or request.fallbacks
            or request.serving_path is not None
            or (request.deployments and _deployment(request) is None)
        ):
            return False
        for layer in self.policies.own_layers(request.tenant, request.route):
            if layer is not None and layer.policy.admission is not None:
                return layer.policy.admission == "allotted"
        return False

    def decide(self, request: AdmitRequest) -> AdmitDecision | None:
        """An admission from a slice, or None: decide it exactly (lq_admit). No
        round trip and no await: what needs the store runs in the background."""
        if not self.applies(request):
            return None
        now = time.monotonic()
        if now >= self._idle_check_at:
            self._give_back_idle(now)
        key = SliceKey(request.tenant, request.route, request.model, request.key_id)
        if self.exact_until.get(key, 0.0) > now:
            return None
        cost = request.reserved_tokens
        held = self.slices.get(key)
        if held is not None and held.take(cost, now):
            if held.tokens * 2 < held.granted and held.may_grow(now):
                self._grow(key, cost)  # half used: grow it before it runs dry
            return self._admitted(held, request, cost)
        # No slice with room: this one is decided exactly, and a slice is taken
        # meanwhile for a key that keeps asking (never a round trip of its own).
        if now - self._seen_since > WARM_SECONDS:
            self.seen, self._seen_since = {}, now
        seen = self.seen[key] = self.seen.get(key, 0) + 1
        if seen >= WARM_REQUESTS and (held is None or held.may_grow(now)):
            self._grow(key, cost)
        return None

    def _admitted(self, held: Slice, request: AdmitRequest, cost: int) -> AdmitDecision:
        """Journal the admission (soon) and answer it."""
        admission = SliceAdmission(
            held.allotment_id,
            self.ids.new(),
            request.input_tokens,
            request.input_estimated,
            request.max_tokens,
            cost,
            request.lease_seconds,
            _deployment(request),
        )
        self.pending.append((held, admission))
        self._pending_ids.add(admission.reservation_id)
        self._schedule_journal()
        grant = held.grant
        assert grant is not None  # a slice is taken from only once granted
        lease = request.lease_seconds or held.lease_seconds
        # the database's clock as of the grant, moved on by this worker's
        expires = datetime.fromtimestamp(time.monotonic() + held.clock_offset + lease, UTC)
        decision = AdmitDecision(
            "admitted",
            admission.reservation_id,
            cost,
            expires,
            1,  # lease_generation
            None,  # limit_kind
            None,  # limit_scope
            None,  # retry_after_ms
            None,  # capacity
            _remaining(grant.room_tokens, held.tokens),
            _remaining(grant.room_requests, held.requests),
            None,  # remaining_in_flight
            _with_slice(grant.tenant, held),
            request.model,
            request.input_tokens,
            plan=grant.plan,
            binding=None if grant.binding is None else _binding_with_slice(grant.binding, held),
            upstream=admission.upstream,
        )
        self._uncounted.append(decision)
        return decision

    # -- slices --------------------------------------------------------------
    def _grow(self, key: SliceKey, cost: int) -> None:
        """Take or top up the key's slice in the background (one statement at a
        time per slice)."""
        held = self.slices.get(key)
        if held is None:
            held = self.slices[key] = Slice(key)
        if held.topping is None:
            held.topping = self._spawn(self._allot(held, cost))
            held.topping.add_done_callback(lambda _f: setattr(held, "topping", None))

    async def _allot(self, held: Slice, cost: int) -> None:
        ask = held.ask
        try:
            grant = await self.store.allot(
                held.allotment_id,
                held.key,
                tokens=cost * ask,
                requests=ask,
                share=self.share,
                min_tokens=cost,
                holder=self.holder,
                hold_seconds=self.hold_seconds,
                top_up=held.grant is not None,
                deadline_seconds=self.hold_seconds / 4,
            )
        except StoreUnavailable:
            # What the slice holds is still a real debit: it keeps deciding.
            log.warning("slice of %s not grown: the store did not answer", held.key)
            held.retry_at = time.monotonic() + EXACT_SECONDS
            return
        if grant.status == "allotted":
            held.tokens += grant.tokens
            held.requests += grant.requests
            held.grant = grant
            held.granted = grant.tokens
            held.lease_seconds = grant.lease_seconds or held.lease_seconds
            held.clock_offset = grant.now.timestamp() - time.monotonic()
            held.ask = min(self.max_requests, ask * 2)
        elif grant.status == "stale":
            self._decide_exactly(held, 0.0)  # a fresh slice on the next request
        else:  # low, exact, unknown: lq_admit decides (and says why it refuses)
            self._decide_exactly(held, EXACT_SECONDS)

    def _decide_exactly(self, held: Slice, seconds: float) -> None:
        """Forget the slice (giving back what it holds) and decide its key exactly."""
        if self.slices.get(held.key) is held:
            del self.slices[held.key]
        if seconds:
            self.exact_until[held.key] = time.monotonic() + seconds
        if held.grant is not None:
            self._spawn(self._give_back([held]))

    def _give_back_idle(self, now: float) -> None:
        self._idle_check_at = now + IDLE_SECONDS
        self.exact_until = {k: t for k, t in self.exact_until.items() if t > now}
        idle = [
            s for s in self.slices.values() if now - s.used_at > IDLE_SECONDS and s.topping is None
        ]
        for held in idle:
            del self.slices[held.key]
        if idle:
            self._spawn(self._give_back(idle))

    async def _give_back(self, slices: list[Slice]) -> None:
        """Journal what they admitted, then return what they still hold."""
        await self.write_journal()
        ids = [s.allotment_id for s in slices if s.grant is not None]
        if ids:
            await self.store.give_back(ids, deadline_seconds=self.hold_seconds / 4)

    # -- the journal -----------------------------------------------------------
    def _schedule_journal(self) -> None:
        if len(self.pending) >= JOURNAL_BATCH:
            self._start_writing()
        elif self._timer is None:
            loop = asyncio.get_running_loop()
            self._timer = loop.call_later(self.journal_seconds, self._start_writing)

    def _start_writing(self) -> None:
        if self._uncounted:
            uncounted, self._uncounted = self._uncounted, []
            self.count(uncounted)
        if self._timer is not None:
            self._timer.cancel()  # (when called before it fires)
            self._timer = None
        if self.pending and (self._writing is None or self._writing.done()):
            self._writing = asyncio.ensure_future(self._write())
            self._writing.add_done_callback(_log_failure)

    async def write_journal(self) -> None:
        """Write every admission decided so far (and wait for a write under way);
        StoreUnavailable when the store does not take them (they stay pending).

        The write under way when this is called (a timer's, begun while the
        store was away) may fail after the store is back: then this call
        writes again itself. Any later write that fails answers the call, so
        it returns while the store stays away, however many writes others begin."""
        earlier = self._writing if self._writing is not None and not self._writing.done() else None
        while True:
            if self._writing is None or self._writing.done():
                if not self.pending:
                    return
                self._start_writing()
            writing = self._writing
            assert writing is not None
            await asyncio.wait([writing])
            if writing.exception() is not None:
                if writing is earlier:
                    earlier = None
                    continue
                raise StoreUnavailable("the allotment journal could not be written")

    async def journaled(self, reservation_ids: Iterable[uuid.UUID]) -> None:
        """Before a settle, release or heartbeat here: their reservations written."""
        if self._pending_ids and any(r in self._pending_ids for r in reservation_ids):
            await self.write_journal()

    async def _write(self) -> None:
        batch, self.pending = self.pending, []
        try:
            written = await self.store.journal(
                [a for _s, a in batch], self.hold_seconds, deadline_seconds=self.hold_seconds / 4
            )
            # A slice the sweeper returned (its worker was away): debit the layers again.
            batch = [(s, a) for s, a in batch if not written.get(s.allotment_id)]
            for held in {s.allotment_id: s for s, _a in batch}.values():
                if self.slices.get(held.key) is held:
                    del self.slices[held.key]  # the next request takes a new one
                orphans = [a for s, a in batch if s is held]
                await self.store.orphans(held.key, orphans, deadline_seconds=self.hold_seconds / 4)
            batch = []
        finally:
            if batch:  # not written: next time, never lost (both statements are idempotent)
                self.pending[:0] = batch
            self._pending_ids = {a.reservation_id for _s, a in self.pending}
            if self.pending:
                self._schedule_journal()

    def _spawn(self, work: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        task.add_done_callback(_log_failure)
        return task

    async def background_done(self) -> None:
        """Wait for the top-ups and give-backs under way (and those they start).
        asyncio.wait, not gather: a finished task leaves the set by a callback of
        the next loop turn, and on Python 3.12+ awaiting gather() of finished
        tasks does not yield to the loop, so `while tasks: await gather(...)`
        spun for ever (CI's Python 3.13 leg timed out in it)."""
        while self._tasks:
            await asyncio.wait(set(self._tasks))

    async def close(self) -> None:
        """Journal everything and give every slice back (a stopping worker)."""
        await self.background_done()  # a top-up under way lands in its slice first
        slices, self.slices = list(self.slices.values()), {}
        try:
            await self._give_back(slices)
        except StoreUnavailable:
            log.warning("slices not given back: the sweeper returns them", exc_info=True)
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


def _deployment(request: AdmitRequest) -> str | None:
    """The deployment a request admitted as asked goes to: its model's first."""
    if not request.deployments:
        return None
    return next((d.upstream for d in request.deployments if d.model == request.model), None)


def _with_slice(tenant: TenantFigures, held: Slice) -> TenantFigures:
    """The tenant layer as the last grant left it, plus what this slice holds.
    (Built field by field: NamedTuple._replace costs several times as much, once
    per admission.)"""
    return TenantFigures(
        tenant.tokens_per_minute,
        tenant.token_burst,
        _plus(tenant.tokens, held.tokens),
        tenant.requests_per_minute,
        tenant.request_burst,
        _plus(tenant.requests, held.requests),
    )


def _binding_with_slice(binding: TokenLayerFigures, held: Slice) -> TokenLayerFigures:
    """The binding token layer as the last grant left it, plus what this slice holds."""
    return TokenLayerFigures(
        binding.tokens_per_minute, binding.token_burst, _plus(binding.tokens, held.tokens)
    )


def _plus(balance: float | None, held: int) -> float | None:
    return None if balance is None else balance + held


def _remaining(room: float | None, held: int) -> int | None:
    """What the layers plus this slice hold, as the last grant saw the layers."""
    return None if room is None else max(0, int(room) + held)


def _log_failure(task: asyncio.Future[Any]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.warning("allotment work failed; it is retried", exc_info=task.exception())
