"""The sweeper: lapsed leases are expired exactly once, in bounded batches, by
any number of sweepers at once; old finished reservations are purged."""

from __future__ import annotations

import asyncio
import uuid

import asyncpg
import pytest

from llmquota.admission.limiter import Limiter
from llmquota.config import Settings

from .support import count, database_now, expire_leases, put, raw_layer, seconds_before

# Also run on a Citus coordinator by CI's Citus leg (pyproject.toml's markers).
pytestmark = pytest.mark.citus

COST = 1_000
BURST = 1_000_000


async def _reserve(
    limiter: Limiter, n: int, lease_seconds: int = 1, tenant: str = "acme"
) -> list[uuid.UUID]:
    """n reservations of COST tokens, admitted in one batch statement."""
    batch = [
        limiter.prepare(
            tenant=tenant,
            model="gpt-4o",
            input_tokens=COST // 2,
            max_tokens=COST // 2,
            lease_seconds=lease_seconds,
        )
        for _ in range(n)
    ]
    decisions = await limiter.store.admit(batch)
    assert {d.status for d in decisions} == {"admitted"}
    return [d.reservation_id for d in decisions if d.reservation_id is not None]


async def test_concurrent_sweepers_expire_two_hundred_lapsed_leases_exactly_once(
    limiter: Limiter, db: asyncpg.Connection, app_dsn: str, settings: Settings
) -> None:
    await put(limiter, "tenant", "acme", tokens_per_minute=1, token_burst=BURST)
    lapsed = await _reserve(limiter, 200)
    live = await _reserve(limiter, 10, lease_seconds=600)
    assert await expire_leases(db, lapsed) == 200
    live_leases = await db.fetch(
        "SELECT reservation_id, lease_expires_at FROM reservations WHERE reservation_id = ANY($1)",
        live,
    )

    other = await Limiter.connect(app_dsn, settings)
    try:
        reports = await asyncio.gather(
            limiter.sweep(batch_size=17),
            other.sweep(batch_size=17),
            limiter.sweep(batch_size=17),
            other.sweep(batch_size=17),
        )
    finally:
        await other.close()

    assert sum(r.expired for r in reports) == 200
    assert sum(r.tokens_returned for r in reports) == 200 * COST
    assert all(r.purged == 0 for r in reports)
    expired_rows = await db.fetch(
        "SELECT reservation_id, input_tokens, output_tokens, reserved_tokens FROM usage_ledger"
        " WHERE entry_kind = 'usage' AND outcome = 'expired'"
    )
    assert len(expired_rows) == 200
    assert {r["reservation_id"] for r in expired_rows} == set(lapsed)
    assert {
        (r["input_tokens"], r["output_tokens"], r["reserved_tokens"]) for r in expired_rows
    } == {(0, 0, COST)}
    assert await count(db, "usage_ledger") == 200
    assert await count(db, "reservations", "state = 'expired'") == 200
    layer = await raw_layer(db, "tenant", "acme")
    assert layer["in_flight"] == 10
    assert layer["tokens"] == pytest.approx(BURST - 10 * COST, abs=0.1)
    # The live leases were not touched.
    assert (
        await db.fetch(
            "SELECT reservation_id, lease_expires_at FROM reservations"
            " WHERE reservation_id = ANY($1) AND state = 'active'",
            live,
        )
        == live_leases
    )


async def test_sweep_with_nothing_due_does_nothing(
    limiter: Limiter, db: asyncpg.Connection
) -> None:
    await put(limiter, "tenant", "acme", tokens_per_minute=1, token_burst=BURST)
    await _reserve(limiter, 5, lease_seconds=600)
    report = await limiter.sweep(batch_size=10)
    assert (report.expired, report.tokens_returned, report.batches, report.purged) == (0, 0, 1, 0)
    assert await count(db, "reservations", "state = 'active'") == 5


async def test_sweep_stops_after_max_batches_of_batch_size(
    limiter: Limiter, db: asyncpg.Connection
) -> None:
    await put(limiter, "tenant", "acme", tokens_per_minute=1, token_burst=BURST)
    lapsed = await _reserve(limiter, 50)
    # Distinct deadlines, oldest first in `lapsed`: the sweeper takes the oldest.
    await db.execute(
        f"""UPDATE reservations AS r
              SET lease_expires_at = {seconds_before("$2::timestamptz", "1000 - u.i")}
             FROM unnest($1::uuid[]) WITH ORDINALITY AS u(id, i)
            WHERE r.reservation_id = u.id""",
        lapsed,
        await database_now(db),
    )

    first = await limiter.sweep(batch_size=10, max_batches=3)

    assert (first.expired, first.batches, first.tokens_returned) == (30, 3, 30 * COST)
    expired = await db.fetch("SELECT reservation_id FROM reservations WHERE state = 'expired'")
    assert {r["reservation_id"] for r in expired} == set(lapsed[:30])
    assert await count(db, "reservations", "state = 'active'") == 20

    second = await limiter.sweep(batch_size=7)
    assert (second.expired, second.batches) == (20, 3)  # 7 + 7 + 6, the short batch ends it

    third = await limiter.sweep(batch_size=7)
    assert (third.expired, third.batches) == (0, 1)
    assert await count(db, "usage_ledger", "outcome = 'expired'") == 50
    assert (await raw_layer(db, "tenant", "acme"))["in_flight"] == 0


async def test_sweep_takes_a_full_last_batch_and_checks_once_more(
    limiter: Limiter, db: asyncpg.Connection
) -> None:
    await put(limiter, "tenant", "acme", tokens_per_minute=1, token_burst=BURST)
    await _reserve(limiter, 20)
    await expire_leases(db)
    report = await limiter.sweep(batch_size=10, max_batches=5)
    assert (report.expired, report.batches) == (20, 3)


async def test_sweep_returns_tokens_and_permits_to_every_layer(
    limiter: Limiter, db: asyncpg.Connection
) -> None:
    await put(limiter, "global", tokens_per_minute=1, token_burst=BURST, max_in_flight=100)
    await put(limiter, "tenant", "acme", tokens_per_minute=1, token_burst=BURST)
    await put(limiter, "route", "acme", "chat", tokens_per_minute=1, token_burst=50_000)
    batch = [
        limiter.prepare(
            tenant="acme",
            route="chat",
            model="gpt-4o",
            input_tokens=500,
            max_tokens=500,
            lease_seconds=1,
        )
        for _ in range(30)
    ]
    await limiter.store.admit(batch)
    await expire_leases(db)

    report = await limiter.sweep(batch_size=8)

    assert report.expired == 30
    for scope, tenant, route, burst in (
        ("global", None, None, BURST),
        ("tenant", "acme", None, BURST),
        ("route", "acme", "chat", 50_000),
    ):
        layer = await raw_layer(db, scope, tenant, route)
        assert (layer["tokens"], layer["in_flight"]) == (burst, 0)


# --- purge ---------------------------------------------------------------------------


async def _age_finished(db: asyncpg.Connection, ids: list[uuid.UUID], seconds: int) -> None:
    await db.execute(
        f"""UPDATE reservations
              SET finished_at = {seconds_before("finished_at", "$2")},
                  created_at = {seconds_before("created_at", "$2")}
            WHERE reservation_id = ANY ($1)""",
        ids,
        seconds,
    )


async def test_purge_deletes_finished_reservations_past_retention_and_keeps_the_ledger(
    limiter: Limiter, db: asyncpg.Connection, settings: Settings
) -> None:
    assert settings.retention_seconds == 7 * 86_400
    await put(limiter, "tenant", "acme", tokens_per_minute=1, token_burst=BURST)
    ids = await _reserve(limiter, 10, lease_seconds=600)
    settled, released, expired, recent, active = ids[:3], ids[3:5], ids[5:7], ids[7:9], ids[9:]
    for rid in settled + recent:
        await limiter.settle(rid, input_tokens=10, output_tokens=10)
    for rid in released:
        await limiter.release(rid)
    await expire_leases(db, expired)
    assert (await limiter.sweep()).expired == 2
    await _age_finished(db, settled + released + expired, settings.retention_seconds + 60)
    # Just inside the retention window: kept.
    await _age_finished(db, recent, settings.retention_seconds - 60)
    # An active reservation is never purged, however old.
    await db.execute(
        f"UPDATE reservations SET created_at = {seconds_before('created_at', '$2')}"
        " WHERE reservation_id = $1",
        active[0],
        30 * 86_400,
    )
    ledger_before = await db.fetch("SELECT * FROM usage_ledger ORDER BY entry_id")

    report = await limiter.sweep()

    assert (report.expired, report.purged) == (0, 7)
    left = await db.fetch("SELECT reservation_id, state FROM reservations")
    assert {r["reservation_id"] for r in left} == set(recent + active)
    assert await db.fetch("SELECT * FROM usage_ledger ORDER BY entry_id") == ledger_before
    assert len(ledger_before) == 3 + 2 + 2  # settled + recent usage, expired rows
    assert (await limiter.sweep()).purged == 0


async def test_purge_works_in_batches_bounded_by_max_batches(
    limiter: Limiter, db: asyncpg.Connection, settings: Settings
) -> None:
    await put(limiter, "tenant", "acme", tokens_per_minute=1, token_burst=BURST)
    ids = await _reserve(limiter, 5, lease_seconds=600)
    for rid in ids:
        await limiter.release(rid)
    await _age_finished(db, ids, settings.retention_seconds + 1)

    # Two statements of two rows each per run: 4 purged, then the last one.
    assert (await limiter.sweep(batch_size=2, max_batches=2)).purged == 4
    assert await count(db, "reservations") == 1
    assert (await limiter.sweep(batch_size=2, max_batches=2)).purged == 1
    assert await count(db, "reservations") == 0


async def test_purged_idempotency_key_can_be_used_again(
    limiter: Limiter, db: asyncpg.Connection, settings: Settings
) -> None:
    await put(limiter, "tenant", "acme", tokens_per_minute=1, token_burst=BURST)
    request = {"tenant": "acme", "model": "gpt-4o", "input_tokens": 10, "max_tokens": 10}
    first = await limiter.admit(**request, idempotency_key="nightly")
    await first.settle(input_tokens=5, output_tokens=5)
    await _age_finished(db, [first.reservation_id], settings.retention_seconds + 1)
    assert (await limiter.sweep()).purged == 1

    again = await limiter.admit(**request, idempotency_key="nightly")

    assert again.reservation_id != first.reservation_id
    assert not again.replayed
    assert await count(db, "usage_ledger", "reservation_id = $1", first.reservation_id) == 1
