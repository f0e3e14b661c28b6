"""Allotments against an exact twin: issue 25's "Proof", on the real PostgreSQL.

A seeded random stream of operations runs over a few tenants whose policies
say `"admission": "allotted"`, on two or three workers (Limiters) of one
database, standing for the workers of two replicas: admits, concurrent
bursts of admits, runs of one tenant's requests at one worker, settles
(actual usage at or below the reservation) and releases at any worker,
pauses that let the journal timers fire, and worker kills (its in-memory
state dropped without a close, its slices expired in SQL and returned by
another worker's sweep) followed by a restart (a new Limiter); in the
second test also stalls (a worker away past its slices' expiry: the
sweeper returns them while it lives, and it journals what it admitted from
them as orphans when it is back). Every admit, settle and release goes the
same way to one Limiter on the exact twin: a database from the same
template whose policies are the same but exact (no `admission` field).

What is asserted, with the numbers in the messages:

- the upper bound: the allotted side never admits more than the twin, per
  tenant and in all, in requests and in reserved tokens, over every prefix
  of the stream (checked after each operation) and over the whole of it;
- the books, after every worker has closed: no allotment left, every
  admitted reservation journaled exactly once (and none of those a hard
  kill lost), each settled one with exactly one ledger row holding the
  settled figures and each released one with none, and each tenant's
  layer holding its capacity less what was charged (slices and journaled
  reservations neither leak room nor return it twice); the twin's books
  the same; `lq_audit()` finds no drift on either database (the autouse
  `audited` fixture);
- the false refusals (requests the allotted side refused where the twin
  admitted them) are printed as `allotment false refusals: X of N (Y%)`
  (N: the requests the twin admitted) and stay below FALSE_REFUSAL_BOUND.

Why the twin comparison is sound, and the one way the stream departs from
"the same stream": once the two sides have decided a request differently
their histories differ, and a settle of a request only one side admitted
would refund room on that side alone. An exact limiter that refused a
request can then be out-admitted by another exact limiter that admitted
different ones and was refunded for them; "never more than the twin" would
fail without any bug. So a request admitted by only one side is left active
until the stream ends (then settled or released on its own side); settles
and releases go to the requests both admitted, with the same figures. Then,
per tenant, with c its (fixed) reserved tokens per request and D the number
of its requests only the twin admitted minus those only the allotted side
admitted, the allotted side's room (its layer plus every slice) is at most
the twin's plus c*D (plus what the sides refilled differently, under one
token at 1 token and 1 request a minute over a stream shorter than a
minute, which the integer costs absorb). An admission the twin refuses
therefore needs D >= 1 and leaves D >= 0: the allotted count never passes
the twin's, which is what the first assertion checks. A hard kill (a worker
dying with admissions not yet journaled) loses those reservations and gives
their room back through the sweeper: that is the documented crash window
(docs/scaling.md), so its admissions are counted apart (`lost`) and the
bound is the twin's count plus them; the twin releases its copies of them,
as their callers' settles find nothing on the allotted side. A stall has
the same window (`late`): the admissions the stalled worker had not
journaled when its slices were swept, and those it decides until it has
noticed that they are gone.

Refill is kept negligible with 1 token and 1 request a minute and bursts of
20-60 requests' worth, so every tenant reaches its limits; each seed has
its own tenants and workers and checks its own books, so a tenant lives for
one stream (a few seconds). Refusal memory is off on both sides (it answers
repeats from one worker's memory, which has nothing to do with slices and
would count as false refusals of the multi-worker side).
"""

from __future__ import annotations

import asyncio
import random
import time
import uuid
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any

import asyncpg
import pytest

from llmquota.admission.limiter import Limiter
from llmquota.config import Settings
from llmquota.domain.errors import RateLimited
from llmquota.domain.policy import Policy
from tests.support import APP_ROLE, dsn_as

MODEL = "gpt-4o"
# Fast variant: seeds, operations per stream; the slow variant runs more of both.
SEEDS = (1, 2, 3)
OPERATIONS = 200
SLOW_SEEDS = tuple(range(100, 112))
SLOW_OPERATIONS = 700

# The bound on false refusals, over the requests the twin admitted.
#
# A worker refuses a request the twin admits only when the room it lacks is
# held elsewhere: in another worker's slice (lq_admit decides from the layer
# row, which excludes every slice), or in its own when a top-up is refused
# as 'low' (a grant below one request: the key is then decided exactly for
# EXACT_SECONDS and its slice given back). A slice takes at most
# allotment_share (0.1) of the tightest layer's room at each grant. The
# worst case is every other worker (two) sitting on a slice taken while the
# room was whole: 2 x 0.1 = 20% of a tenant's room out of reach each time it
# runs out. But slices shrink with the room, are topped up at half use rather
# than taken whole, and go back when their worker finds the room low, goes
# idle or stops, so near the limit the other workers hold a request or two:
# a false refusal or two per exhaustion, against the 20-60 requests each
# exhaustion admits, and every one of them also leaves that room to be
# admitted later on the allotted side (the streams' "admitted only by the
# allotted side" figure, about as large). Measured: 0.2% to 1.3% over the
# fast seeds, 1.5% over the slow ones (2.2% with slices taken only for
# keys asking 8 times a second, as main has them since f580f91). 5% is
# twice to four times that and a quarter of the worst case: scheduling
# noise stays under it, and a regression that keeps room in slices away
# from the requests that need it (slices that stop shrinking, or are not
# given back when low) heads for the worst case.
FALSE_REFUSAL_BOUND = 0.05


@dataclass(frozen=True, slots=True)
class Tenant:
    """One tenant of a stream: its policy and its (fixed) request shape."""

    name: str
    input_tokens: int
    max_tokens: int
    token_burst: int
    request_burst: int

    @property
    def cost(self) -> int:
        """What one request reserves (the whole max_tokens: no output estimate)."""
        return self.input_tokens + self.max_tokens

    def policy(self, admission: str | None) -> Policy:
        fields: dict[str, object] = {
            "tokens_per_minute": 1,
            "token_burst": self.token_burst,
            "requests_per_minute": 1,
            "request_burst": self.request_burst,
        }
        if admission is not None:
            fields["admission"] = admission
        return Policy.model_validate(fields)


@dataclass(slots=True)
class Request:
    """One admit of the stream, as each side answered it (None: refused)."""

    tenant: Tenant
    allotted: uuid.UUID | None
    twin: uuid.UUID | None


@dataclass(slots=True)
class Tally:
    """One tenant's admissions so far, per side."""

    allotted: int = 0
    twin: int = 0
    lost: int = 0  # allotted admissions a hard kill lost (never journaled)
    late: int = 0  # allotted admissions of a stalled worker, while its slice was swept

    @property
    def window(self) -> int:
        """The crash windows' admissions: what the bound allows past the twin."""
        return self.lost + self.late

    false_refusals: int = 0
    false_admissions: int = 0


@dataclass(slots=True)
class Finished:
    """What became of each side's reservations: settled figures, or released."""

    settled: dict[uuid.UUID, tuple[int, int]] = field(default_factory=dict)
    released: set[uuid.UUID] = field(default_factory=set)
    admitted: dict[uuid.UUID, Tenant] = field(default_factory=dict)
    lost: set[uuid.UUID] = field(default_factory=set)


@dataclass(slots=True)
class Figures:
    """A stream's outcome, summed over seeds."""

    twin_admitted: int = 0
    false_refusals: int = 0
    false_admissions: int = 0
    kills: int = 0
    hard_kills: int = 0
    lost: int = 0
    stalls: int = 0
    late: int = 0
    slices_swept: int = 0
    from_slices: int = 0  # allotted admissions decided from a slice (the rest: lq_admit)

    def add(self, other: Figures) -> None:
        for name in self.__dataclass_fields__:
            setattr(self, name, getattr(self, name) + getattr(other, name))


class TwinRun:
    """One seed's stream: the allotted workers, the exact twin, and the tallies."""

    def __init__(
        self,
        seed: int,
        operations: int,
        *,
        allotted_dsn: str,
        twin_dsn: str,
        owner: asyncpg.Connection,
        settings: Settings,
        stalls: bool,
    ) -> None:
        self.seed = seed
        self.stalls = stalls
        self.rng = random.Random(seed)
        self.operations = operations
        self.allotted_dsn = allotted_dsn
        self.twin_owner_dsn = twin_dsn
        self.twin_dsn = dsn_as(twin_dsn, APP_ROLE)
        self.owner = owner
        self.settings = settings
        self.workers: list[Limiter] = []
        self.twin: Limiter | None = None
        self.tenants = [self._tenant(i) for i in range(self.rng.randint(3, 4))]
        self.tally = {t.name: Tally() for t in self.tenants}
        self.open: list[Request] = []
        self.books_allotted = Finished()
        self.books_twin = Finished()
        self.figures = Figures()
        self.step = 0
        # Workers whose slices the sweeper returned while they were away, with
        # those slices' ids, until they have noticed (allotments.py's _write).
        self.stale: dict[Limiter, set[uuid.UUID]] = {}
        self.started = time.monotonic()

    def _tenant(self, i: int) -> Tenant:
        rng = self.rng
        input_tokens = rng.randint(50, 400)
        max_tokens = rng.randint(100, 1_200)
        requests = rng.randint(20, 60)
        # Tokens bind for some tenants, requests for others.
        token_requests = requests + rng.choice((-10, -5, 0, 5, 10))
        return Tenant(
            name=f"twin-{self.seed}-{i}",
            input_tokens=input_tokens,
            max_tokens=max_tokens,
            token_burst=max(1, token_requests) * (input_tokens + max_tokens),
            request_burst=requests,
        )

    # -- set-up and tear-down ---------------------------------------------------
    async def start(self) -> None:
        first = await Limiter.connect(self.allotted_dsn, self.settings)
        self.twin = await Limiter.connect(self.twin_dsn, self.settings)
        for tenant in self.tenants:
            await first.store.put_policy("tenant", tenant.name, None, tenant.policy("allotted"))
            await self.twin.store.put_policy("tenant", tenant.name, None, tenant.policy(None))
        await first.refresh_policies()
        await self.twin.refresh_policies()
        self.workers = [first]
        for _ in range(self.rng.randint(1, 2)):
            self.workers.append(await Limiter.connect(self.allotted_dsn, self.settings))

    async def close(self) -> None:
        for worker in self.workers:
            await worker.close()
        self.workers = []
        if self.twin is not None:
            await self.twin.close()
            self.twin = None

    # -- the stream ------------------------------------------------------------
    async def run(self) -> Figures:
        ops: list[tuple[float, Callable[[], Coroutine[Any, Any, None]]]] = [
            (50, self.admit_one),
            (10, self.admit_burst),
            (5, self.admit_run),
            (20, self.settle_one),
            (8, self.release_one),
            (6, self.pause),
            (1.2, self.kill_and_restart),
            (1.2 if self.stalls else 0, self.stall),
        ]
        weights = [w for w, _op in ops]
        kill_at = self.rng.randrange(self.operations // 3, self.operations)
        for step in range(self.operations):
            self.step = step
            if step == kill_at:
                await self.kill_and_restart()  # at least one per stream
            else:
                await self.rng.choices(ops, weights)[0][1]()
            self._forget_stale()
            self.check_prefix()
        await self.drain()
        await self.close()
        await self.check_books()
        self.figures.twin_admitted = sum(t.twin for t in self.tally.values())
        self.figures.false_refusals = sum(t.false_refusals for t in self.tally.values())
        self.figures.false_admissions = sum(t.false_admissions for t in self.tally.values())
        self.figures.lost = sum(t.lost for t in self.tally.values())
        self.figures.late = sum(t.late for t in self.tally.values())
        elapsed = time.monotonic() - self.started
        # The refill argument of the module's docstring needs a tenant to live under a minute.
        assert elapsed < 55, f"seed {self.seed}: the stream took {elapsed:.1f} s"
        return self.figures

    def _worker(self) -> Limiter:
        return self.rng.choice(self.workers)

    def _twin(self) -> Limiter:
        assert self.twin is not None
        return self.twin

    async def _try_admit(self, limiter: Limiter, tenant: Tenant) -> uuid.UUID | None:
        try:
            held = await limiter.admit(
                tenant=tenant.name,
                model=MODEL,
                input_tokens=tenant.input_tokens,
                max_tokens=tenant.max_tokens,
            )
        except RateLimited:
            return None
        assert held.reserved_tokens == tenant.cost, (
            f"seed {self.seed} step {self.step}: {tenant.name} reserved {held.reserved_tokens}, "
            f"not {tenant.cost}"
        )
        rid: uuid.UUID = held.reservation_id
        return rid

    def _record(self, tenant: Tenant, allotted: uuid.UUID | None, twin: uuid.UUID | None) -> None:
        tally = self.tally[tenant.name]
        if allotted is not None:
            tally.allotted += 1
            self.books_allotted.admitted[allotted] = tenant
        if twin is not None:
            tally.twin += 1
            self.books_twin.admitted[twin] = tenant
        if allotted is None and twin is not None:
            tally.false_refusals += 1
        if allotted is not None and twin is None:
            tally.false_admissions += 1
        if allotted is not None or twin is not None:
            self.open.append(Request(tenant, allotted, twin))

    def _late(self, worker: Limiter, tenant: Tenant, allotted: uuid.UUID | None) -> None:
        """An admission by a worker that may still decide from a swept slice."""
        if allotted is not None and worker in self.stale:
            self.tally[tenant.name].late += 1

    async def admit_one(self) -> None:
        tenant, worker = self.rng.choice(self.tenants), self._worker()
        allotted = await self._try_admit(worker, tenant)
        twin = await self._try_admit(self._twin(), tenant)
        self._late(worker, tenant, allotted)
        self._record(tenant, allotted, twin)

    async def admit_burst(self) -> None:
        """Concurrent admits over the workers; the twin gets the same, concurrently too."""
        picks = [
            (self.rng.choice(self.tenants), self._worker()) for _ in range(self.rng.randint(2, 8))
        ]
        allotted = await asyncio.gather(*(self._try_admit(w, t) for t, w in picks))
        twin = await asyncio.gather(*(self._try_admit(self._twin(), t) for t, _w in picks))
        for (tenant, worker), a, t in zip(picks, allotted, twin, strict=True):
            self._late(worker, tenant, a)
            self._record(tenant, a, t)

    async def admit_run(self) -> None:
        """A run of one tenant's requests at one worker (a key that keeps asking
        is the one a worker takes a slice for)."""
        tenant, worker = self.rng.choice(self.tenants), self._worker()
        for _ in range(self.rng.randint(4, 12)):
            allotted = await self._try_admit(worker, tenant)
            twin = await self._try_admit(self._twin(), tenant)
            self._late(worker, tenant, allotted)
            self._record(tenant, allotted, twin)

    def _take_common(self) -> Request | None:
        """An open request both sides admitted (only those are finished mid-stream)."""
        common = [i for i, r in enumerate(self.open) if r.allotted and r.twin]
        if not common:
            return None
        return self.open.pop(self.rng.choice(common))

    def _usage(self, tenant: Tenant) -> tuple[int, int]:
        """Actual usage: at the reservation a third of the time, else below it."""
        if self.rng.random() < 0.33:
            return tenant.input_tokens, tenant.max_tokens
        return tenant.input_tokens, self.rng.randint(0, tenant.max_tokens)

    async def _settle(
        self, limiter: Limiter, books: Finished, rid: uuid.UUID, usage: tuple[int, int]
    ) -> None:
        settlement = await limiter.settle(rid, input_tokens=usage[0], output_tokens=usage[1])
        assert settlement.charged_tokens == sum(usage), (
            f"seed {self.seed} step {self.step}: {rid} charged {settlement.charged_tokens}, "
            f"not {sum(usage)}"
        )
        books.settled[rid] = usage

    async def _release(self, limiter: Limiter, books: Finished, rid: uuid.UUID) -> None:
        await limiter.release(rid)
        books.released.add(rid)

    async def settle_one(self) -> None:
        request = self._take_common()
        if request is None:
            return
        assert request.allotted is not None and request.twin is not None
        usage = self._usage(request.tenant)
        await self._settle(self._worker(), self.books_allotted, request.allotted, usage)
        await self._settle(self._twin(), self.books_twin, request.twin, usage)

    async def release_one(self) -> None:
        request = self._take_common()
        if request is None:
            return
        assert request.allotted is not None and request.twin is not None
        await self._release(self._worker(), self.books_allotted, request.allotted)
        await self._release(self._twin(), self.books_twin, request.twin)

    async def pause(self) -> None:
        """Time between requests: the journal timers (20 ms) fire or not."""
        await asyncio.sleep(self.rng.choice((0.001, 0.005, 0.025, 0.06)))

    async def kill_and_restart(self) -> None:
        """A worker dies: what it holds in memory is gone, its slices outlive it
        until the sweeper (another worker) returns them; a new one takes its place.

        A clean kill dies just after a journal write; a hard one with
        admissions not yet journaled, which are lost (the crash window)."""
        hard = self.rng.random() < 0.4
        if hard:  # the worker with the most admissions not yet journaled
            pending = [len(w.allotments.pending) for w in self.workers]
            index = pending.index(max(pending))
        else:
            index = self.rng.randrange(len(self.workers))
        dead = self.workers[index]
        self.stale.pop(dead, None)
        lost = await self._drop_memory(dead, journal=not hard)
        holder = dead.allotments.holder
        status = await self.owner.execute(
            "UPDATE allotments SET expires_at = clock_timestamp() - interval '1 second'"
            " WHERE holder = $1",
            holder,
        )
        expired = int(status.split()[-1])
        survivor = self.workers[(index + 1) % len(self.workers)]
        # Its pool closes with nothing of its allotments left to write or give back.
        await dead.close()
        report = await survivor.sweep()
        assert report.slices_returned == expired, (
            f"seed {self.seed} step {self.step}: the sweep returned {report.slices_returned} "
            f"slices of the dead worker's {expired}"
        )
        left = await self.owner.fetchval(
            "SELECT count(*) FROM allotments WHERE holder = $1", holder
        )
        assert left == 0, f"seed {self.seed} step {self.step}: {left} slices of {holder} left"
        self.workers[index] = await Limiter.connect(self.allotted_dsn, self.settings)
        self.figures.kills += 1
        self.figures.hard_kills += hard
        self.figures.slices_swept += expired
        await self._forget_lost(lost)

    async def stall(self) -> None:
        """A worker is away past its slices' expiry (a long pause): the sweeper
        returns them, with the room of what it admitted and had not journaled
        yet; back, it journals those as orphans (lq_allot_orphans), debiting
        the layers again. Until it notices, its admissions are the window the
        bound allows (`late`): those not yet journaled, and those it decides
        from the swept slices meanwhile."""
        index = self.rng.randrange(len(self.workers))
        away = self.workers[index]
        held = away.allotments
        # Away: what it had under way has landed, and its journal timer waits.
        await self._land(away)
        if held._timer is not None:
            held._timer.cancel()
            held._timer = None
        swept = await self.owner.fetch(
            "UPDATE allotments SET expires_at = clock_timestamp() - interval '1 second'"
            " WHERE holder = $1 RETURNING allotment_id",
            held.holder,
        )
        ids = {row["allotment_id"] for row in swept}
        for _slice, admission in held.pending:
            if _slice.allotment_id in ids:
                self.tally[self.books_allotted.admitted[admission.reservation_id].name].late += 1
        survivor = self.workers[(index + 1) % len(self.workers)]
        report = await survivor.sweep()
        assert report.slices_returned == len(ids), (
            f"seed {self.seed} step {self.step}: the sweep returned {report.slices_returned} "
            f"of the {len(ids)} slices of a stalled worker"
        )
        if ids:
            self.stale.setdefault(away, set()).update(ids)
        if held.pending:  # back: its journal is written on time again
            held._schedule_journal()
        self.figures.stalls += 1
        self.figures.slices_swept += len(ids)

    def _forget_stale(self) -> None:
        """A stalled worker has noticed once nothing of its swept slices is left in
        its memory: neither the slice nor an admission of it waiting for the journal."""
        for worker, ids in list(self.stale.items()):
            held = worker.allotments
            if any(s.allotment_id in ids for s in held.slices.values()):
                continue
            if any(s.allotment_id in ids for s, _a in held.pending):
                continue
            if held._writing is not None and not held._writing.done():
                continue
            del self.stale[worker]

    @staticmethod
    async def _land(worker: Limiter) -> None:
        """Let the worker's statements under way land (top-ups, give-backs, a journal write)."""
        held = worker.allotments
        while held._tasks or (held._writing is not None and not held._writing.done()):
            running: list[asyncio.Future[Any]] = [*held._tasks]
            if held._writing is not None:
                running.append(held._writing)
            await asyncio.gather(*running, return_exceptions=True)

    async def _drop_memory(self, dead: Limiter, *, journal: bool) -> list[uuid.UUID]:
        """Drop a worker's allotment state as a crash would; the admissions lost."""
        held = dead.allotments
        await self._land(dead)  # (a crash between two statements)
        if journal:
            await held.write_journal()
        lost = [admission.reservation_id for _slice, admission in held.pending]
        if held._timer is not None:
            held._timer.cancel()
            held._timer = None
        held.pending = []
        held._pending_ids = set()
        held.slices.clear()
        held.exact_until.clear()
        return lost

    async def _forget_lost(self, lost: Sequence[uuid.UUID]) -> None:
        """The callers of lost admissions find nothing to settle on the allotted
        side; the twin releases its copies, so both sides hold nothing for them."""
        gone = set(lost)
        self.books_allotted.lost |= gone
        for request in [r for r in self.open if r.allotted in gone]:
            self.open.remove(request)
            self.tally[request.tenant.name].lost += 1
            if request.twin is not None:
                await self._release(self._twin(), self.books_twin, request.twin)

    async def drain(self) -> None:
        """Finish every open request on the side(s) that admitted it."""
        for request in self.open:
            usage = self._usage(request.tenant)
            release = self.rng.random() < 0.3
            for rid, limiter, books in (
                (request.allotted, self._worker(), self.books_allotted),
                (request.twin, self._twin(), self.books_twin),
            ):
                if rid is None:
                    continue
                if release:
                    await self._release(limiter, books, rid)
                else:
                    await self._settle(limiter, books, rid, usage)
        self.open = []

    # -- the assertions --------------------------------------------------------
    def check_prefix(self) -> None:
        """Never more admitted by the allotted side than by the twin (plus what a
        hard kill lost), per tenant and in all, in requests and in tokens."""
        total_allotted = total_twin = tokens_allotted = tokens_twin = 0
        for tenant in self.tenants:
            t = self.tally[tenant.name]
            assert t.allotted <= t.twin + t.window, (
                f"seed {self.seed} step {self.step}: {tenant.name} allotted admitted "
                f"{t.allotted} requests, the exact twin {t.twin} (+{t.lost} lost in hard "
                f"kills, +{t.late} in stalls)"
            )
            total_allotted += t.allotted
            total_twin += t.twin + t.window
            tokens_allotted += t.allotted * tenant.cost
            tokens_twin += (t.twin + t.window) * tenant.cost
        assert total_allotted <= total_twin, (
            f"seed {self.seed} step {self.step}: allotted admitted {total_allotted} requests, "
            f"the exact twin {total_twin} (with the crash windows')"
        )
        assert tokens_allotted <= tokens_twin, (
            f"seed {self.seed} step {self.step}: allotted admitted {tokens_allotted} tokens, "
            f"the exact twin {tokens_twin} (with the crash windows')"
        )

    async def check_books(self) -> None:
        names = [t.name for t in self.tenants]
        left = await self.owner.fetchval("SELECT count(*) FROM allotments")
        assert left == 0, f"seed {self.seed}: {left} allotments left after every worker closed"
        await self._check_side("allotted", self.owner, self.books_allotted, names)
        self.figures.from_slices = await self.owner.fetchval(
            "SELECT count(*) FROM reservations WHERE tenant = ANY ($1::text[])"
            " AND allotment_id IS NOT NULL",
            names,
        )
        twin_owner = await asyncpg.connect(self.twin_owner_dsn)
        try:
            await self._check_side("twin", twin_owner, self.books_twin, names)
        finally:
            await twin_owner.close()

    async def _check_side(
        self, side: str, db: asyncpg.Connection, books: Finished, names: list[str]
    ) -> None:
        where = f"seed {self.seed}, {side}"
        rows = await db.fetch(
            "SELECT reservation_id, state, reserved_tokens FROM reservations"
            " WHERE tenant = ANY ($1::text[])",
            names,
        )
        journaled: dict[uuid.UUID, int] = {}
        for row in rows:
            journaled[row["reservation_id"]] = journaled.get(row["reservation_id"], 0) + 1
        expected = set(books.admitted) - books.lost
        twice = {rid: n for rid, n in journaled.items() if n != 1}
        assert not twice, f"{where}: reservations written more than once: {twice}"
        missing = expected - set(journaled)
        extra = set(journaled) - expected
        assert not missing, f"{where}: {len(missing)} of {len(expected)} admissions not journaled"
        assert not extra, f"{where}: {len(extra)} reservations nobody was admitted for"
        lost = books.lost & set(journaled)
        assert not lost, f"{where}: {len(lost)} admissions a hard kill lost were journaled"
        states = {row["reservation_id"]: row["state"] for row in rows}
        wrong = {
            rid: states[rid]
            for rid in expected
            if states[rid] != ("settled" if rid in books.settled else "released")
        }
        assert not wrong, f"{where}: {len(wrong)} reservations in the wrong state: {wrong}"
        await self._check_ledger(where, db, books, names)
        await self._check_room(where, db, books)

    async def _check_ledger(
        self, where: str, db: asyncpg.Connection, books: Finished, names: list[str]
    ) -> None:
        rows = await db.fetch(
            "SELECT reservation_id, entry_kind, input_tokens, output_tokens FROM usage_ledger"
            " WHERE tenant = ANY ($1::text[])",
            names,
        )
        ledger: dict[uuid.UUID, list[tuple[str, int, int]]] = {}
        for row in rows:
            ledger.setdefault(row["reservation_id"], []).append(
                (row["entry_kind"], row["input_tokens"], row["output_tokens"])
            )
        wrong = {
            rid: ledger.get(rid)
            for rid, (used_in, used_out) in books.settled.items()
            if ledger.get(rid) != [("usage", used_in, used_out)]
        }
        assert not wrong, (
            f"{where}: {len(wrong)} of {len(books.settled)} settled reservations without exactly "
            f"one ledger row of their figures: {dict(list(wrong.items())[:5])}"
        )
        others = set(ledger) - set(books.settled)
        assert not others, f"{where}: {len(others)} ledger rows of unsettled reservations"

    async def _check_room(self, where: str, db: asyncpg.Connection, books: Finished) -> None:
        """Each tenant's layer holds its capacity less what was charged (up to the
        refill of the stream's seconds: under one token)."""
        for tenant in self.tenants:
            room = await db.fetchval(
                "SELECT lq_refilled(tokens, tokens_per_minute, token_burst, refilled_at,"
                " clock_timestamp()) FROM limit_layers WHERE scope = 'tenant' AND tenant = $1",
                tenant.name,
            )
            charged = sum(
                sum(usage) for rid, usage in books.settled.items() if books.admitted[rid] is tenant
            )
            expected = tenant.token_burst - charged
            refill = (time.monotonic() - self.started) / 60 + 1e-6
            assert expected <= room <= expected + refill, (
                f"{where}: {tenant.name} holds {room:.3f} tokens; capacity {tenant.token_burst} "
                f"less {charged} charged is {expected} (+ at most {refill:.3f} of refill)"
            )


async def run_streams(
    seeds: Sequence[int],
    operations: int,
    *,
    app_dsn: str,
    twin_dsn: str,
    db: asyncpg.Connection,
    settings: Settings,
    stalls: bool,
) -> Figures:
    """Run one stream per seed; print and check the false refusals over all."""
    settings = settings.model_copy(update={"refusal_memory_ms": 0})
    total = Figures()
    for seed in seeds:
        run = TwinRun(
            seed,
            operations,
            allotted_dsn=app_dsn,
            twin_dsn=twin_dsn,
            owner=db,
            settings=settings,
            stalls=stalls,
        )
        await run.start()
        try:
            total.add(await run.run())
        finally:
            await run.close()
    rate = total.false_refusals / max(1, total.twin_admitted)
    print(
        f"\nallotment false refusals: {total.false_refusals} of {total.twin_admitted} "
        f"({100 * rate:.1f}%)"
    )
    print(
        f"allotment twin: {len(seeds)} streams of {operations} operations, "
        f"{total.from_slices} admissions from slices, "
        f"{total.false_admissions} admitted only by the allotted side, {total.kills} kills "
        f"({total.hard_kills} hard, {total.lost} admissions lost), {total.stalls} stalls "
        f"({total.late} admissions in their window), "
        f"{total.slices_swept} slices swept"
    )
    assert rate < FALSE_REFUSAL_BOUND, (
        f"allotment false refusals: {total.false_refusals} of {total.twin_admitted} "
        f"({100 * rate:.1f}%), above the bound of {100 * FALSE_REFUSAL_BOUND:.0f}%"
    )
    return total


async def test_allotted_workers_never_admit_more_than_their_exact_twin(
    app_dsn: str, twin_dsn: str, db: asyncpg.Connection, settings: Settings
) -> None:
    """Admits, bursts, settles, releases, pauses, kills and restarts."""
    total = await run_streams(
        SEEDS,
        OPERATIONS,
        app_dsn=app_dsn,
        twin_dsn=twin_dsn,
        db=db,
        settings=settings,
        stalls=False,
    )
    assert total.kills >= len(SEEDS) and total.twin_admitted > 0


async def test_allotted_workers_with_stalls_never_admit_more_than_their_exact_twin(
    app_dsn: str, twin_dsn: str, db: asyncpg.Connection, settings: Settings
) -> None:
    """The same, and workers away past their slices' expiry (`TwinRun.stall`)."""
    total = await run_streams(
        SEEDS, OPERATIONS, app_dsn=app_dsn, twin_dsn=twin_dsn, db=db, settings=settings, stalls=True
    )
    assert total.stalls > 0 and total.twin_admitted > 0


@pytest.mark.slow
@pytest.mark.timeout(900)
async def test_allotted_workers_never_admit_more_than_their_exact_twin_long(
    app_dsn: str, twin_dsn: str, db: asyncpg.Connection, settings: Settings
) -> None:
    total = await run_streams(
        SLOW_SEEDS,
        SLOW_OPERATIONS,
        app_dsn=app_dsn,
        twin_dsn=twin_dsn,
        db=db,
        settings=settings,
        stalls=True,
    )
    assert total.kills >= len(SLOW_SEEDS) and total.twin_admitted > 0


async def test_a_slice_swept_while_its_worker_was_away_is_not_topped_up_under_its_old_id(
    app_dsn: str, db: asyncpg.Connection, settings: Settings
) -> None:
    """The bug the twin's stalls found, alone (it fails on aae1453).

    A worker away past its slice's expiry (a long pause) comes back still
    holding the slice in memory; the sweeper has returned the row. Its next
    top-up calls lq_allot with the same allotment_id, which finds no row and
    INSERTs a new one holding only the new grant, while the worker's Slice
    adds the grant to what it believed it held. It then admits more than the
    row holds, and lq_allot_journal (one statement for all of the worker's
    slices) subtracts past zero: allotments_tokens_check fails it, on every
    retry, so none of that worker's admissions, of any slice, are journaled
    again (settles elsewhere find nothing; close() gives up on them). What
    it should do: a top-up of a slice that is gone is 'stale' (or the
    journal finds the slice gone first), the admissions of the swept slice
    are journaled as orphans, and the books hold.
    """
    slow = settings.model_copy(update={"allotment_journal_ms": 1_000, "refusal_memory_ms": 0})
    worker = await Limiter.connect(app_dsn, slow)
    other = await Limiter.connect(app_dsn, slow)
    try:
        # Room for 40 requests: the slices shrink to nothing within the test.
        tenant = Tenant("away", 300, 2_000, 40 * 2_300, 400)
        await worker.store.put_policy("tenant", tenant.name, None, tenant.policy("allotted"))
        await worker.refresh_policies()

        async def admit() -> uuid.UUID | None:
            try:
                held = await worker.admit(
                    tenant=tenant.name, model=MODEL, input_tokens=300, max_tokens=2_000
                )
            except RateLimited:
                return None
            await worker.allotments.background_done()  # a top-up or give-back lands first
            rid: uuid.UUID = held.reservation_id
            return rid

        # Until it has a slice (a key may be decided exactly until it is warm).
        ids: list[uuid.UUID] = []
        while await db.fetchval("SELECT count(*) FROM allotments") == 0:
            assert len(ids) < 20, "no slice after 20 admissions"
            admitted = await admit()
            assert admitted is not None
            ids.append(admitted)
        await worker.allotments.write_journal()
        # Away past the slice's expiry: the sweeper returns it.
        await db.execute("UPDATE allotments SET expires_at = clock_timestamp() - interval '1 s'")
        assert (await other.sweep()).slices_returned == 1
        # Back: it admits on from the slice it remembers, tops it up (a new row
        # under the old id), and runs it down to the limit.
        while len(ids) < 60 and (admitted := await admit()) is not None:
            ids.append(admitted)
        # StoreUnavailable: allotments_tokens_check (or _requests_check) fails the journal.
        await worker.allotments.write_journal()
    finally:
        await worker.close()
        await other.close()
    journaled = await db.fetchval(
        "SELECT count(*) FROM reservations WHERE reservation_id = ANY ($1::uuid[])", ids
    )
    assert journaled == len(ids), f"{journaled} of {len(ids)} admissions journaled"
    assert await db.fetchval("SELECT count(*) FROM allotments") == 0
