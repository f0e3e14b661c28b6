"""Allotted admission against the real PostgreSQL (issue 25).

A tenant whose policy says `"admission": "allotted"` is decided from slices
of its layers' room that a worker holds (admission/allotments.py,
sql/allotments.sql). These tests hold the books at every step: what the
layers hold, plus what the slices hold, plus what the active reservations
hold, is the capacity (the refill of 1 token a second is kept out of the
way by a slow rate and a large burst).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Sequence

import asyncpg
import pytest

from llmquota.admission.allotments import WARM_REQUESTS
from llmquota.admission.limiter import Limiter
from llmquota.config import Settings
from llmquota.domain.errors import RateLimited, ReservationNotFound
from llmquota.domain.policy import Policy
from llmquota.domain.records import FinishRequest
from llmquota.domain.slice_ids import SLICE_ID_VERSION

# Counted admissions from slices mean the count, not the warm-up's clock.
pytestmark = pytest.mark.usefixtures("slices_off_the_clock")

BURST = 1_000_000
COST = 300 + 2_000  # input + max_tokens of every request here


def allotted(**limits: int | str) -> Policy:
    fields: dict[str, object] = {"tokens_per_minute": 60, "token_burst": BURST}
    fields.update(limits)
    fields.setdefault("admission", "allotted")
    return Policy.model_validate(fields)


async def admit(limiter: Limiter, tenant: str = "acme", **extra: object) -> uuid.UUID:
    held = await limiter.admit(
        tenant=tenant, model="gpt-4o", input_tokens=300, max_tokens=2_000, **extra
    )
    return held.reservation_id


async def books(db: asyncpg.Connection, tenant: str = "acme") -> tuple[float, int, int]:
    """(the tenant layer's balance now, what slices hold, what active reservations hold)."""
    layer = await db.fetchval(
        "SELECT lq_refilled(tokens, tokens_per_minute, token_burst, refilled_at, clock_timestamp())"
        " FROM limit_layers WHERE scope = 'tenant' AND tenant = $1",
        tenant,
    )
    slices = await db.fetchval(
        "SELECT coalesce(sum(tokens), 0) FROM allotments WHERE tenant = $1", tenant
    )
    active = await db.fetchval(
        "SELECT coalesce(sum(reserved_tokens), 0) FROM reservations"
        " WHERE tenant = $1 AND state = 'active'",
        tenant,
    )
    return float(layer), int(slices), int(active)


async def warm(limiter: Limiter, tenant: str = "acme") -> list[uuid.UUID]:
    """Admit until the tenant has a slice (the first few are decided exactly)."""
    ids = [await admit(limiter, tenant) for _ in range(WARM_REQUESTS)]
    await limiter.allotments.background_done()
    return ids


def conserved(figures: tuple[float, int, int], capacity: int = BURST) -> bool:
    """Layer + slices + active reservations == capacity, up to a few seconds' refill."""
    layer, slices, active = figures
    return capacity <= layer + slices + active <= capacity + 30


@pytest.fixture
async def second(app_dsn: str, settings: Settings) -> AsyncIterator[Limiter]:
    """Another worker on the same database."""
    other = await Limiter.connect(app_dsn, settings)
    yield other
    await other.close()


async def test_admissions_come_from_a_slice_and_are_journaled_as_reservations(
    limiter: Limiter, db: asyncpg.Connection
) -> None:
    await limiter.store.put_policy("tenant", "acme", None, allotted())
    await limiter.refresh_policies()
    exact = await warm(limiter)
    ids = []
    for _ in range(20):
        ids.append(await admit(limiter))
        # A top-up runs in the background once half the slice is used; letting
        # it land before the next request keeps this test off the clock (what
        # a request meets while a top-up is still under way is the next test's).
        await limiter.allotments.background_done()
    slices = await db.fetch("SELECT tokens, requests, layer_ids FROM allotments")
    assert len(slices) == 1
    await limiter.allotments.write_journal()
    rows = await db.fetch(
        "SELECT reservation_id, reserved_tokens, allotment_id, permits FROM reservations"
    )
    assert sorted(r["reservation_id"] for r in rows) == sorted(exact + ids)
    from_slices = [r for r in rows if r["allotment_id"] is not None]
    assert {r["reservation_id"] for r in from_slices} == set(ids)
    assert all(r["reserved_tokens"] == COST and r["permits"] == 0 for r in from_slices)
    assert conserved(await books(db))
    # One lq_allot for the first slice and a top-up or two, never one per request.
    assert await db.fetchval("SELECT count(*) FROM allotments") == 1


async def test_a_request_meeting_a_dry_slice_is_decided_exactly_rather_than_wait(
    limiter: Limiter, db: asyncpg.Connection, monkeypatch: pytest.MonkeyPatch
) -> None:
    await limiter.store.put_policy("tenant", "acme", None, allotted())
    await limiter.refresh_policies()
    await warm(limiter)
    held = next(iter(limiter.allotments.slices.values()))
    assert held.requests == 8  # FIRST_REQUESTS
    # The top-up the fifth request starts is held back until the gate opens.
    gate = asyncio.Event()
    allot = limiter.allotments.store.allot

    async def slow_allot(*args: object, **kwargs: object) -> object:
        await gate.wait()
        return await allot(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(limiter.allotments.store, "allot", slow_allot)
    from_slice = [await admit(limiter) for _ in range(8)]
    assert held.requests == 0 and held.topping is not None
    meanwhile = [await admit(limiter) for _ in range(3)]  # answered with the gate shut
    gate.set()
    await limiter.allotments.background_done()
    assert held.requests == 16  # the top-up asked for twice the first slice
    after = await admit(limiter)
    await limiter.allotments.write_journal()
    rows = {
        r["reservation_id"]: r["allotment_id"]
        for r in await db.fetch("SELECT reservation_id, allotment_id FROM reservations")
    }
    assert all(rows[i] == held.allotment_id for i in [*from_slice, after])
    assert all(rows[i] is None for i in meanwhile)
    assert conserved(await books(db))


async def test_a_settle_at_another_worker_finds_an_admission_not_yet_journaled(
    limiter: Limiter, second: Limiter, db: asyncpg.Connection
) -> None:
    await limiter.store.put_policy("tenant", "acme", None, allotted())
    await limiter.refresh_policies()
    await warm(limiter)
    await limiter.allotments.write_journal()
    reservation_id = await admit(limiter)
    assert reservation_id in limiter.allotments._pending_ids  # not written yet
    settlement = await second.settle(reservation_id, input_tokens=300, output_tokens=100)
    assert settlement.charged_tokens == 400
    assert settlement.refunded_tokens == COST - 400
    ledger = await db.fetchval(
        "SELECT count(*) FROM usage_ledger WHERE reservation_id = $1", reservation_id
    )
    assert ledger == 1
    assert conserved(await books(db), BURST - 400)


async def test_an_unknown_id_is_looked_up_again_only_where_a_slice_may_have_made_it(
    app_dsn: str, settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A settle that finds no row looks again after the journal interval (2 s to
    wait out here) only for an id a slice may have made and not journaled yet: a
    version-7 id (a slice's form), or, while some policy is allotted, any id (a
    worker of an earlier release gave its slices' admissions version-4 ids).
    Elsewhere an unknown id is not found at once."""
    slow = settings.model_copy(update={"allotment_journal_ms": 1_000})
    worker = await Limiter.connect(app_dsn, slow)
    lookups: list[int] = []
    finish = worker.store.finish

    async def counted(requests: Sequence[FinishRequest], **kw: float | None) -> object:
        lookups.append(len(requests))
        return await finish(requests, **kw)

    async def settled_unknown(reservation_id: uuid.UUID) -> list[int]:
        lookups.clear()
        with pytest.raises(ReservationNotFound):
            await worker.settle(reservation_id, input_tokens=300, output_tokens=0)
        return list(lookups)

    version_4 = uuid.uuid4()
    version_7 = uuid.UUID(int=uuid.uuid4().int & ~(0xF << 76) | 7 << 76)
    monkeypatch.setattr(worker.store, "finish", counted)
    try:
        await worker.store.put_policy("tenant", "acme", None, allotted(admission="exact"))
        await worker.refresh_policies()
        assert await settled_unknown(version_4) == [1]
        assert await settled_unknown(version_7) == [1, 1]
        await worker.store.put_policy("tenant", "acme", None, allotted())
        await worker.refresh_policies()
        assert await settled_unknown(version_4) == [1, 1]
        exact = await warm(worker)
        assert [i.version for i in exact] == [4] * WARM_REQUESTS
        assert (await admit(worker)).version == SLICE_ID_VERSION
    finally:
        await worker.close()


async def test_a_settle_at_the_same_worker_journals_first(
    limiter: Limiter, db: asyncpg.Connection
) -> None:
    await limiter.store.put_policy("tenant", "acme", None, allotted())
    await limiter.refresh_policies()
    await warm(limiter)
    ids = [await admit(limiter) for _ in range(3)]
    assert all(i in limiter.allotments._pending_ids for i in ids)
    await limiter.release(ids[0])
    await limiter.settle(ids[1], input_tokens=300, output_tokens=0)
    states = dict(await db.fetch("SELECT reservation_id, state FROM reservations"))
    assert states[ids[0]] == "released" and states[ids[1]] == "settled"
    await limiter.allotments.write_journal()
    assert states.get(ids[2]) in (None, "active")
    assert conserved(await books(db), BURST - 300)


async def test_near_the_limit_it_is_exact_again(limiter: Limiter, db: asyncpg.Connection) -> None:
    # 10 requests' room: a slice may take a tenth of it, less than one request.
    await limiter.store.put_policy(
        "tenant", "acme", None, allotted(tokens_per_minute=1, token_burst=10 * COST)
    )
    await limiter.refresh_policies()
    admitted = 0
    for _ in range(15):
        try:
            await admit(limiter)
            admitted += 1
        except RateLimited:
            pass
    assert admitted == 10  # what the exact path admits, no more, no fewer
    await limiter.allotments.write_journal()
    assert await db.fetchval("SELECT count(*) FROM allotments") == 0
    # A tenth of the whole room is one request at most: a slice holds one at
    # most, and from then on a tenth of what is left is less than one.
    exact = await db.fetchval("SELECT count(*) FROM reservations WHERE allotment_id IS NULL")
    assert exact >= 9


async def test_layers_with_concurrency_limits_are_decided_exactly(
    limiter: Limiter, db: asyncpg.Connection
) -> None:
    await limiter.store.put_policy("tenant", "acme", None, allotted(max_in_flight=5))
    await limiter.refresh_policies()
    for _ in range(5):
        await admit(limiter)
    with pytest.raises(RateLimited):
        await admit(limiter)
    assert await db.fetchval("SELECT count(*) FROM allotments") == 0
    assert await db.fetchval("SELECT count(*) FROM reservations WHERE allotment_id IS NULL") == 5


async def test_a_stopping_worker_gives_its_slices_back(
    app_dsn: str, settings: Settings, db: asyncpg.Connection
) -> None:
    worker = await Limiter.connect(app_dsn, settings)
    await worker.store.put_policy("tenant", "acme", None, allotted())
    await worker.refresh_policies()
    await warm(worker)
    for _ in range(7):
        await admit(worker)
    await worker.close()
    assert await db.fetchval("SELECT count(*) FROM allotments") == 0
    assert await db.fetchval("SELECT count(*) FROM reservations") == WARM_REQUESTS + 7
    assert conserved(await books(db))


async def test_a_dead_workers_slice_comes_back_through_the_sweeper(
    limiter: Limiter, second: Limiter, db: asyncpg.Connection
) -> None:
    await limiter.store.put_policy("tenant", "acme", None, allotted())
    await limiter.refresh_policies()
    await warm(limiter)
    for _ in range(4):
        await admit(limiter)
    await limiter.allotments.write_journal()
    held = await db.fetchval("SELECT tokens FROM allotments")
    assert held > 0
    # The worker dies: nothing of it runs again; its slice outlives it.
    limiter.allotments.slices.clear()
    await db.execute("UPDATE allotments SET expires_at = clock_timestamp() - interval '1 second'")
    report = await second.sweep()
    assert report.slices_returned == 1
    assert await db.fetchval("SELECT count(*) FROM allotments") == 0
    assert conserved(await books(db))


async def test_admissions_of_a_swept_slice_are_journaled_and_debited_again(
    limiter: Limiter, second: Limiter, db: asyncpg.Connection, monkeypatch: pytest.MonkeyPatch
) -> None:
    await limiter.store.put_policy("tenant", "acme", None, allotted())
    await limiter.refresh_policies()
    await warm(limiter)
    await admit(limiter)
    await limiter.allotments.write_journal()
    # The worker stalls past its slice's expiry, the sweeper returns it, then
    # the worker (awake again) journals what it admitted meanwhile. Stalled,
    # its journal timer does not fire either (it would renew the slice's
    # expiry, whenever a slow machine let it run between the sweep's steps).
    monkeypatch.setattr(limiter.allotments, "_schedule_journal", lambda: None)
    late = [await admit(limiter) for _ in range(3)]
    assert all(i in limiter.allotments._pending_ids for i in late)
    await db.execute("UPDATE allotments SET expires_at = clock_timestamp() - interval '1 second'")
    assert (await second.sweep()).slices_returned == 1
    await limiter.allotments.write_journal()
    rows = await db.fetch(
        "SELECT reservation_id FROM reservations WHERE reservation_id = ANY ($1::uuid[])", late
    )
    assert len(rows) == 3
    assert conserved(await books(db))
    await asyncio.sleep(0)


async def test_which_requests_a_slice_may_decide(limiter: Limiter) -> None:
    await limiter.store.put_policy("tenant", "acme", None, allotted())
    await limiter.store.put_policy("tenant", "other", None, allotted(admission="exact"))
    await limiter.refresh_policies()

    def applies(tenant: str = "acme", **extra: object) -> bool:
        request = limiter.prepare(
            tenant=tenant, model="gpt-4o", input_tokens=300, max_tokens=2_000, **extra
        )
        return limiter.allotments.applies(request)

    assert applies()
    # An admin's request may raise its priority; one that does not is plain.
    assert applies(priority_any=True)
    assert not applies(priority="high")
    assert not applies(idempotency_key="once")
    assert not applies(fallback_models=["gpt-4o-mini"])
    assert not applies("other")
    assert not applies("unknown")
