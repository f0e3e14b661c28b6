"""Settlement, release, heartbeat and late usage against a real PostgreSQL."""

from __future__ import annotations

import asyncio
import math
import uuid
from datetime import timedelta
from typing import Any

import asyncpg
import pytest

from llmquota.admission.limiter import Limiter, Reservation, Settlement
from llmquota.domain.errors import (
    InvalidRequest,
    RateLimited,
    ReservationConflict,
    ReservationNotFound,
)

from .support import Clock, count, expire_leases, put, raw_layer, shift_refill, status, tokens

# Also run on a Citus coordinator by CI's Citus leg (pyproject.toml's markers).
pytestmark = pytest.mark.citus

BURST = 10_000


async def _standard_policy(limiter: Limiter, **overrides: Any) -> None:
    """Refill of 1 token and 1 request a minute: balances stay put while a test runs."""
    policy: dict[str, Any] = {
        "tokens_per_minute": 1,
        "token_burst": BURST,
        "requests_per_minute": 1,
        "request_burst": 5,
        "max_in_flight": 3,
    }
    policy.update(overrides)
    await put(limiter, "tenant", "acme", **policy)


async def _admit(limiter: Limiter, reserve: int = 1_000, **extra: Any) -> Reservation:
    return await limiter.admit(
        tenant="acme",
        model="gpt-4o",
        input_tokens=reserve // 2,
        max_tokens=reserve - reserve // 2,
        **extra,
    )


async def _snapshot(db: asyncpg.Connection) -> tuple[Any, ...]:
    """Everything settlement could change, minus the refill timestamp."""
    layer = await raw_layer(db, "tenant", "acme")
    reservations = await db.fetch(
        """SELECT reservation_id, state, charged_tokens, refunded_tokens, late,
                  settled_input_tokens, settled_output_tokens, outcome, finished_at
             FROM reservations ORDER BY reservation_id"""
    )
    ledger = await db.fetch("SELECT * FROM usage_ledger ORDER BY entry_id")
    return (
        round(layer["tokens"], 1),
        round(layer["requests"], 3),
        layer["in_flight"],
        [tuple(r) for r in reservations],
        [tuple(r) for r in ledger],
    )


# --- settle -----------------------------------------------------------------------


async def test_settle_refunds_what_was_reserved_and_not_used(
    limiter: Limiter, db: asyncpg.Connection
) -> None:
    await _standard_policy(limiter)
    held = await _admit(limiter, 1_000)
    assert await tokens(limiter, "acme") == pytest.approx(BURST - 1_000, abs=0.1)

    settlement = await held.settle(input_tokens=100, output_tokens=200)

    assert settlement == Settlement(charged_tokens=300, refunded_tokens=700, late=False)
    layer = await status(limiter, "acme")
    assert layer.tokens == pytest.approx(BURST - 300, abs=0.1)
    # The request itself was used: settlement gives back tokens, not the request.
    assert layer.requests == pytest.approx(4, abs=0.01)
    assert layer.in_flight == 0
    row = await db.fetchrow("SELECT * FROM reservations")
    assert (row["state"], row["charged_tokens"], row["refunded_tokens"], row["late"]) == (
        "settled",
        300,
        700,
        False,
    )
    assert (row["settled_input_tokens"], row["settled_output_tokens"], row["outcome"]) == (
        100,
        200,
        "ok",
    )
    ledger = await db.fetch("SELECT * FROM usage_ledger")
    assert len(ledger) == 1
    entry = ledger[0]
    assert (
        entry["entry_kind"],
        entry["input_tokens"],
        entry["output_tokens"],
        entry["reserved_tokens"],
        entry["outcome"],
        entry["reservation_id"],
    ) == ("usage", 100, 200, 1_000, "ok", held.reservation_id)


async def test_settle_with_error_outcome_records_it(
    limiter: Limiter, db: asyncpg.Connection
) -> None:
    await _standard_policy(limiter)
    held = await _admit(limiter, 1_000)
    settlement = await held.settle(input_tokens=500, output_tokens=0, outcome="error")
    assert settlement == Settlement(charged_tokens=500, refunded_tokens=500, late=False)
    assert await db.fetchval("SELECT outcome FROM usage_ledger") == "error"


async def test_refund_never_lifts_a_refilled_bucket_above_its_burst(
    limiter: Limiter, db: asyncpg.Connection
) -> None:
    """Seed 001: reserve 2,300 from a nearly full bucket, let refill top it up,
    then refund 2,000; the balance stays at capacity, not 12,000."""
    await _standard_policy(limiter, tokens_per_minute=600)  # 10 tokens/s
    held = await _admit(limiter, 2_300)
    assert await tokens(limiter, "acme") == pytest.approx(BURST - 2_300, abs=5)
    await shift_refill(db, 600)
    assert await tokens(limiter, "acme") == BURST

    settlement = await held.settle(input_tokens=150, output_tokens=150)

    assert settlement.refunded_tokens == 2_000
    assert (await raw_layer(db, "tenant", "acme"))["tokens"] == BURST
    assert await tokens(limiter, "acme") == BURST


async def test_many_over_reservations_accumulate_no_phantom_headroom(
    limiter: Limiter, db: asyncpg.Connection
) -> None:
    await _standard_policy(
        limiter,
        tokens_per_minute=600,
        requests_per_minute=None,
        request_burst=None,
        max_in_flight=None,
    )
    held = [await _admit(limiter, 1_000) for _ in range(10)]
    await shift_refill(db, 10_000)
    for reservation in held:
        await reservation.settle(input_tokens=1, output_tokens=0)
    assert (await raw_layer(db, "tenant", "acme"))["tokens"] == BURST

    results = []
    for _ in range(11):
        try:
            results.append(await _admit(limiter, 1_000))
        except RateLimited as exc:
            results.append(exc)
    assert sum(isinstance(r, Reservation) for r in results) == 10
    assert isinstance(results[-1], RateLimited)


async def test_usage_above_the_reservation_debits_the_excess_and_refill_repays_it(
    limiter: Limiter, db: asyncpg.Connection
) -> None:
    rate = 6_000  # 100 tokens/s
    await _standard_policy(limiter, tokens_per_minute=rate, token_burst=2_000)
    clock = Clock()
    held = await _admit(limiter, 1_900)

    settlement = await held.settle(input_tokens=900, output_tokens=2_100)

    # 3,000 is above what this request could have used (ceil(950 x 1.25) + 64
    # + 950 = 2,202): the 798 beyond it are flagged, and still charged to the
    # tenant's own layer in full.
    assert settlement == Settlement(
        charged_tokens=3_000, refunded_tokens=0, late=False, excess_tokens=798
    )
    # 2,000 - 1,900 - (3,000 - 1,900) = -1,000, plus whatever refilled since.
    balance = await tokens(limiter, "acme")
    assert -1_000 <= balance <= -1_000 + clock.refill(rate)
    with pytest.raises(RateLimited) as refused:
        await _admit(limiter, 100)
    # 1,100 short at 100 tokens/s.
    assert 11_000 - clock.elapsed() * 1_000 - 1 <= refused.value.retry_after_ms <= 11_000

    await shift_refill(db, 20)
    repaid = await tokens(limiter, "acme")
    assert 1_000 <= repaid <= 1_000 + clock.refill(rate)
    await _admit(limiter, 900)


async def test_settling_twice_with_the_same_figures_replays_the_first_result(
    limiter: Limiter, db: asyncpg.Connection
) -> None:
    await _standard_policy(limiter)
    held = await _admit(limiter, 1_000)
    first = await held.settle(input_tokens=100, output_tokens=200)
    after_first = await _snapshot(db)

    second = await held.settle(input_tokens=100, output_tokens=200)
    third = await limiter.settle(held.reservation_id, input_tokens=100, output_tokens=200)

    assert first == second == third == Settlement(300, 700, False)
    assert await _snapshot(db) == after_first
    assert await count(db, "usage_ledger") == 1


@pytest.mark.parametrize(
    "figures",
    [
        {"input_tokens": 100, "output_tokens": 201},
        {"input_tokens": 101, "output_tokens": 200},
        {"input_tokens": 100, "output_tokens": 200, "outcome": "error"},
    ],
    ids=["output", "input", "outcome"],
)
async def test_settling_again_with_other_figures_is_a_conflict_and_changes_nothing(
    limiter: Limiter, db: asyncpg.Connection, figures: dict[str, Any]
) -> None:
    await _standard_policy(limiter)
    held = await _admit(limiter, 1_000)
    await held.settle(input_tokens=100, output_tokens=200)
    before = await _snapshot(db)

    with pytest.raises(ReservationConflict):
        await limiter.settle(held.reservation_id, **figures)

    assert await _snapshot(db) == before


async def test_twenty_concurrent_identical_settles_charge_once(
    limiter: Limiter, db: asyncpg.Connection
) -> None:
    await _standard_policy(limiter)
    held = await _admit(limiter, 1_000)

    results = await asyncio.gather(
        *(
            limiter.settle(held.reservation_id, input_tokens=100, output_tokens=200)
            for _ in range(20)
        )
    )

    assert set(results) == {Settlement(300, 700, False)}
    assert await count(db, "usage_ledger") == 1
    layer = await raw_layer(db, "tenant", "acme")
    assert (round(layer["tokens"], 1), layer["in_flight"]) == (BURST - 300, 0)


async def test_concurrent_settle_and_release_resolve_the_reservation_exactly_once(
    limiter: Limiter, db: asyncpg.Connection
) -> None:
    await _standard_policy(limiter)
    held = [await _admit(limiter, 1_000) for _ in range(3)]

    async def settle(r: Reservation) -> str:
        try:
            await limiter.settle(r.reservation_id, input_tokens=100, output_tokens=100)
        except ReservationConflict:
            return "conflict"
        return "settled"

    async def release(r: Reservation) -> str:
        try:
            await limiter.release(r.reservation_id)
        except ReservationConflict:
            return "conflict"
        return "released"

    outcomes = await asyncio.gather(*(f(r) for r in held for f in (settle, release) * 5))

    per_reservation = [outcomes[i * 10 : (i + 1) * 10] for i in range(3)]
    states = await db.fetch("SELECT reservation_id, state FROM reservations")
    for reservation, results in zip(held, per_reservation, strict=True):
        state = next(
            s["state"] for s in states if s["reservation_id"] == reservation.reservation_id
        )
        if state == "settled":
            assert set(results[0::2]) == {"settled"}
            assert set(results[1::2]) == {"conflict"}
        else:
            assert state == "released"
            assert set(results[0::2]) == {"conflict"}
            assert set(results[1::2]) == {"released"}
    settled = sum(s["state"] == "settled" for s in states)
    layer = await raw_layer(db, "tenant", "acme")
    assert layer["in_flight"] == 0
    assert round(layer["tokens"], 1) == BURST - 200 * settled
    assert await count(db, "usage_ledger") == settled


@pytest.mark.parametrize(
    "figures",
    [
        {"input_tokens": -1, "output_tokens": 0},
        {"input_tokens": 0, "output_tokens": 10_000_001},
        {"input_tokens": 1.0, "output_tokens": 0},
        {"input_tokens": True, "output_tokens": 0},
        {"input_tokens": 0, "output_tokens": 0, "outcome": "expired"},
        {"input_tokens": 0, "output_tokens": 0, "outcome": "OK"},
    ],
    ids=["negative", "over-10M", "float", "bool", "outcome-expired", "outcome-case"],
)
async def test_invalid_settlement_figures_are_refused_and_change_nothing(
    limiter: Limiter, db: asyncpg.Connection, figures: dict[str, Any]
) -> None:
    await _standard_policy(limiter)
    held = await _admit(limiter, 1_000)
    before = await _snapshot(db)
    with pytest.raises(InvalidRequest):
        await limiter.settle(held.reservation_id, **figures)
    assert await _snapshot(db) == before


async def test_settling_an_unknown_reservation_is_not_found(limiter: Limiter) -> None:
    with pytest.raises(ReservationNotFound):
        await limiter.settle(uuid.uuid4(), input_tokens=1, output_tokens=1)
    with pytest.raises(ReservationNotFound):
        await limiter.release(uuid.uuid4())


# --- release ----------------------------------------------------------------------


async def test_release_returns_tokens_the_request_and_the_permit(
    limiter: Limiter, db: asyncpg.Connection
) -> None:
    await _standard_policy(limiter)
    held = await _admit(limiter, 1_000)
    inside = await raw_layer(db, "tenant", "acme")
    assert (round(inside["tokens"]), round(inside["requests"]), inside["in_flight"]) == (
        BURST - 1_000,
        4,
        1,
    )

    await held.release()

    layer = await raw_layer(db, "tenant", "acme")
    assert (layer["tokens"], layer["requests"], layer["in_flight"]) == (BURST, 5, 0)
    assert await db.fetchval("SELECT state FROM reservations") == "released"
    assert await count(db, "usage_ledger") == 0


async def test_releasing_twice_is_harmless(limiter: Limiter, db: asyncpg.Connection) -> None:
    await _standard_policy(limiter)
    held = await _admit(limiter, 1_000)
    await _admit(limiter, 500)  # a second one keeps the balances off their caps
    await held.release()
    before = await _snapshot(db)

    await held.release()
    await limiter.release(held.reservation_id)

    assert await _snapshot(db) == before
    assert (await raw_layer(db, "tenant", "acme"))["in_flight"] == 1


async def test_settle_after_release_is_a_conflict(limiter: Limiter, db: asyncpg.Connection) -> None:
    await _standard_policy(limiter)
    held = await _admit(limiter, 1_000)
    await held.release()
    before = await _snapshot(db)

    with pytest.raises(ReservationConflict, match="released"):
        await held.settle(input_tokens=10, output_tokens=10)

    assert await _snapshot(db) == before


async def test_release_after_settle_is_a_conflict(limiter: Limiter, db: asyncpg.Connection) -> None:
    await _standard_policy(limiter)
    held = await _admit(limiter, 1_000)
    await held.settle(input_tokens=10, output_tokens=10)
    before = await _snapshot(db)

    with pytest.raises(ReservationConflict, match="settled"):
        await held.release()

    assert await _snapshot(db) == before


# --- heartbeat --------------------------------------------------------------------


async def test_heartbeat_extends_the_lease_and_bumps_its_generation(
    limiter: Limiter, db: asyncpg.Connection
) -> None:
    await _standard_policy(limiter)
    held = await _admit(limiter, 1_000, lease_seconds=60)
    first = await db.fetchrow("SELECT lease_expires_at, lease_generation FROM reservations")
    assert first["lease_generation"] == 1

    started = await db.fetchval("SELECT clock_timestamp()")
    result = await limiter.heartbeat(held.reservation_id, lease_seconds=600)
    ended = await db.fetchval("SELECT clock_timestamp()")

    row = await db.fetchrow("SELECT lease_expires_at, lease_generation FROM reservations")
    assert result.lease_generation == row["lease_generation"] == 2
    assert result.lease_expires_at == row["lease_expires_at"]
    assert result.lease_expires_at > first["lease_expires_at"]
    assert result.lease_expires_at is not None
    lease = timedelta(seconds=600)
    assert started + lease <= result.lease_expires_at <= ended + lease

    # Without a figure, the reservation's own lease (60 s) is granted again.
    started = await db.fetchval("SELECT clock_timestamp()")
    expires = await held.heartbeat()
    ended = await db.fetchval("SELECT clock_timestamp()")
    row = await db.fetchrow("SELECT lease_expires_at, lease_generation FROM reservations")
    assert (row["lease_expires_at"], row["lease_generation"]) == (expires, 3)
    lease = timedelta(seconds=60)
    assert started + lease <= expires <= ended + lease
    assert held.lease_expires_at == expires


async def test_heartbeat_by_the_owning_tenant_is_allowed(limiter: Limiter) -> None:
    await _standard_policy(limiter)
    held = await _admit(limiter, 1_000)
    result = await limiter.heartbeat(held.reservation_id, caller="acme")
    assert result.lease_generation == 2


async def test_heartbeat_of_a_settled_reservation_is_a_conflict(
    limiter: Limiter, db: asyncpg.Connection
) -> None:
    await _standard_policy(limiter)
    held = await _admit(limiter, 1_000)
    await held.settle(input_tokens=1, output_tokens=1)
    with pytest.raises(ReservationConflict, match="settled"):
        await held.heartbeat()
    assert await db.fetchval("SELECT lease_generation FROM reservations") == 1


async def test_heartbeat_of_a_swept_reservation_is_a_conflict(
    limiter: Limiter, db: asyncpg.Connection
) -> None:
    await _standard_policy(limiter)
    held = await _admit(limiter, 1_000, lease_seconds=1)
    await expire_leases(db)
    assert (await limiter.sweep()).expired == 1
    with pytest.raises(ReservationConflict, match="expired"):
        await held.heartbeat()


async def test_heartbeat_after_the_lease_ran_out_is_a_conflict_even_before_the_sweep(
    limiter: Limiter, db: asyncpg.Connection
) -> None:
    await _standard_policy(limiter)
    held = await _admit(limiter, 1_000, lease_seconds=1)
    await expire_leases(db)
    before = await db.fetchrow("SELECT lease_expires_at, lease_generation, state FROM reservations")
    with pytest.raises(ReservationConflict, match="lease ran out"):
        await held.heartbeat(lease_seconds=600)
    after = await db.fetchrow("SELECT lease_expires_at, lease_generation, state FROM reservations")
    assert before == after


async def test_heartbeat_from_another_tenant_is_not_found(
    limiter: Limiter, db: asyncpg.Connection
) -> None:
    await _standard_policy(limiter)
    held = await _admit(limiter, 1_000)
    with pytest.raises(ReservationNotFound):
        await limiter.heartbeat(held.reservation_id, caller="other")
    with pytest.raises(ReservationNotFound):
        await limiter.heartbeat(uuid.uuid4())
    assert await db.fetchval("SELECT lease_generation FROM reservations") == 1


@pytest.mark.parametrize("lease_seconds", [0, -5, 86_401, True, 2.5])
async def test_heartbeat_with_an_invalid_lease_is_refused(
    limiter: Limiter, db: asyncpg.Connection, lease_seconds: Any
) -> None:
    await _standard_policy(limiter)
    held = await _admit(limiter, 1_000)
    with pytest.raises(InvalidRequest):
        await limiter.heartbeat(held.reservation_id, lease_seconds=lease_seconds)
    assert await db.fetchval("SELECT lease_generation FROM reservations") == 1


# --- late settlement ---------------------------------------------------------------


async def test_late_settle_after_the_sweep_debits_what_was_really_used(
    limiter: Limiter, db: asyncpg.Connection
) -> None:
    await _standard_policy(limiter, max_in_flight=1)
    held = await _admit(limiter, 1_000, lease_seconds=1)
    await expire_leases(db)

    report = await limiter.sweep()

    assert (report.expired, report.tokens_returned) == (1, 1_000)
    layer = await raw_layer(db, "tenant", "acme")
    assert (layer["tokens"], layer["in_flight"]) == (BURST, 0)
    expired = await db.fetchrow("SELECT * FROM usage_ledger")
    assert (
        expired["entry_kind"],
        expired["outcome"],
        expired["input_tokens"],
        expired["output_tokens"],
        expired["reserved_tokens"],
    ) == ("usage", "expired", 0, 0, 1_000)
    # The permit really is free: another request is admitted under max_in_flight=1.
    other = await _admit(limiter, 100)

    settlement = await held.settle(input_tokens=100, output_tokens=200)

    assert settlement == Settlement(charged_tokens=300, refunded_tokens=0, late=True)
    late = await db.fetchrow("SELECT * FROM usage_ledger WHERE entry_kind = 'late'")
    assert (
        late["outcome"],
        late["input_tokens"],
        late["output_tokens"],
        late["reserved_tokens"],
    ) == (
        "late",
        100,
        200,
        0,
    )
    layer = await raw_layer(db, "tenant", "acme")
    assert round(layer["tokens"], 1) == BURST - 100 - 300
    assert layer["in_flight"] == 1  # only `other`
    row = await db.fetchrow(
        "SELECT state, charged_tokens, late FROM reservations WHERE reservation_id = $1",
        held.reservation_id,
    )
    assert tuple(row) == ("expired", 300, True)

    replay = await held.settle(input_tokens=100, output_tokens=200)
    assert replay == settlement
    assert await count(db, "usage_ledger") == 2
    assert round((await raw_layer(db, "tenant", "acme"))["tokens"], 1) == BURST - 400
    with pytest.raises(ReservationConflict):
        await held.settle(input_tokens=100, output_tokens=201)
    await other.release()


async def test_settle_after_the_lease_ran_out_is_late_even_before_the_sweep(
    limiter: Limiter, db: asyncpg.Connection
) -> None:
    await _standard_policy(limiter)
    held = await _admit(limiter, 1_000, lease_seconds=1)
    await expire_leases(db)

    settlement = await held.settle(input_tokens=100, output_tokens=200)

    assert settlement == Settlement(charged_tokens=300, refunded_tokens=0, late=True)
    kinds = await db.fetch(
        "SELECT entry_kind, outcome, input_tokens, output_tokens, reserved_tokens"
        " FROM usage_ledger ORDER BY entry_kind DESC"
    )
    assert [tuple(k) for k in kinds] == [
        ("usage", "expired", 0, 0, 1_000),
        ("late", "late", 100, 200, 0),
    ]
    layer = await raw_layer(db, "tenant", "acme")
    assert (round(layer["tokens"], 1), layer["in_flight"]) == (BURST - 300, 0)
    assert await db.fetchval("SELECT state FROM reservations") == "expired"
    # The sweeper finds nothing left to do.
    assert (await limiter.sweep()).expired == 0
    assert await count(db, "usage_ledger") == 2


async def test_release_after_the_lease_ran_out_expires_the_reservation(
    limiter: Limiter, db: asyncpg.Connection
) -> None:
    await _standard_policy(limiter)
    held = await _admit(limiter, 1_000, lease_seconds=1)
    await expire_leases(db)
    with pytest.raises(ReservationConflict, match="expired"):
        await held.release()
    layer = await raw_layer(db, "tenant", "acme")
    # Expiry returned the tokens and the permit, but not the request.
    assert (layer["tokens"], math.floor(layer["requests"]), layer["in_flight"]) == (BURST, 4, 0)
    assert await db.fetchval("SELECT outcome FROM usage_ledger") == "expired"


# --- caller scoping ----------------------------------------------------------------


async def test_another_tenant_cannot_settle_or_release(
    limiter: Limiter, db: asyncpg.Connection
) -> None:
    await _standard_policy(limiter)
    await put(limiter, "tenant", "other", tokens_per_minute=1, token_burst=BURST)
    held = await _admit(limiter, 1_000)
    before = await _snapshot(db)

    with pytest.raises(ReservationNotFound):
        await limiter.settle(held.reservation_id, input_tokens=1, output_tokens=1, caller="other")
    with pytest.raises(ReservationNotFound):
        await limiter.release(held.reservation_id, caller="other")

    assert await _snapshot(db) == before
    assert await tokens(limiter, "other") == BURST
    settled = await limiter.settle(
        held.reservation_id, input_tokens=1, output_tokens=1, caller="acme"
    )
    assert settled == Settlement(2, 998, False)
