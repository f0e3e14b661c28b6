"""Admission against a real PostgreSQL: buckets, caps, layers, refusals, idempotency.

Refill is continuous, so a balance read a few milliseconds later has grown a
little. Tests that want exact figures use a refill of 1 token a minute (a
drift of ~0.02 tokens a second); the rest bound the drift with `Clock`.
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import asyncpg
import pytest

from llmquota.admission.limiter import Limiter, Reservation
from llmquota.domain.errors import (
    IdempotencyConflict,
    InvalidRequest,
    RateLimited,
    RequestTooLarge,
    UnknownTenant,
)
from llmquota.domain.tokens import get_encoding
from tests.unit.test_invalid_requests import INVALID

from .support import (
    Clock,
    attempt,
    count,
    database_now,
    put,
    raw_layer,
    shift_refill,
    status,
    tokens,
)

# Also run on a Citus coordinator by CI's Citus leg (pyproject.toml's markers).
pytestmark = pytest.mark.citus

N = 60
K = 7
COST = 1_000  # input 100 + max_tokens 900
REQUEST: dict[str, Any] = {
    "tenant": "acme",
    "model": "gpt-4o",
    "input_tokens": 100,
    "max_tokens": 900,
}


async def _admit_concurrently(limiter: Limiter, n: int, **request: Any) -> list[Any]:
    return await asyncio.gather(*(attempt(limiter, **request) for _ in range(n)))


def _split(results: list[Any]) -> tuple[list[Reservation], list[RateLimited]]:
    admitted = [r for r in results if isinstance(r, Reservation)]
    refused = [r for r in results if isinstance(r, RateLimited)]
    assert len(admitted) + len(refused) == len(results), results
    return admitted, refused


# --- one limit, many concurrent callers ---------------------------------------


async def test_token_bucket_admits_exactly_the_seven_reservations_it_holds(
    limiter: Limiter, db: asyncpg.Connection
) -> None:
    await put(limiter, "tenant", "acme", tokens_per_minute=1, token_burst=K * COST)
    clock = Clock()

    admitted, refused = _split(await _admit_concurrently(limiter, N, **REQUEST))

    assert len(admitted) == K
    assert len(refused) == N - K
    assert len({r.reservation_id for r in admitted}) == K
    assert all(r.reserved_tokens == COST for r in admitted)
    for exc in refused:
        assert (exc.limit, exc.scope) == ("tokens", "tenant")
        # (1,000 - balance) tokens at 1 token/min: just under 60,000,000 ms.
        assert 59_000_000 < exc.retry_after_ms <= 60_000_000
    balance = await tokens(limiter, "acme")
    assert 0 <= balance <= clock.refill(1)
    assert (await raw_layer(db, "tenant", "acme"))["in_flight"] == K
    assert await count(db, "reservations", "state = 'active'") == K


async def test_request_bucket_admits_exactly_the_seven_requests_it_holds(
    limiter: Limiter, db: asyncpg.Connection
) -> None:
    await put(limiter, "tenant", "acme", requests_per_minute=1, request_burst=K)
    clock = Clock()

    admitted, refused = _split(await _admit_concurrently(limiter, N, **REQUEST))

    assert len(admitted) == K
    assert len(refused) == N - K
    for exc in refused:
        assert (exc.limit, exc.scope) == ("requests", "tenant")
        # One request at 1 request/min: just under 60,000 ms.
        assert 59_000 < exc.retry_after_ms <= 60_000
    layer = await status(limiter, "acme")
    assert layer.requests is not None
    assert 0 <= layer.requests <= clock.refill(1)
    assert layer.tokens is None
    assert await count(db, "reservations") == K


async def test_concurrency_cap_admits_exactly_seven_and_a_settle_frees_a_permit(
    limiter: Limiter, db: asyncpg.Connection
) -> None:
    await put(limiter, "tenant", "acme", max_in_flight=K)

    admitted, refused = _split(await _admit_concurrently(limiter, N, **REQUEST))

    assert len(admitted) == K
    assert len(refused) == N - K
    for exc in refused:
        assert (exc.limit, exc.scope, exc.retry_after_ms) == ("concurrency", "tenant", 1_000)
    assert (await status(limiter, "acme")).in_flight == K

    await admitted[0].settle(input_tokens=100, output_tokens=10)
    assert (await status(limiter, "acme")).in_flight == K - 1
    again, refused_again = _split(await _admit_concurrently(limiter, 3, **REQUEST))
    assert len(again) == 1
    assert len(refused_again) == 2
    assert (await raw_layer(db, "tenant", "acme"))["in_flight"] == K


# --- capacity and refill (seed 001) ---------------------------------------------


async def test_full_bucket_admits_its_capacity_of_a_larger_batch_and_refills_half_in_30s(
    limiter: Limiter, db: asyncpg.Connection
) -> None:
    """Capacity 100,000, refill 100,000/min, idle tenant, a 150,000-token batch:
    the first 100,000 are admitted one by one, the rest wait ~6 s each, the
    bucket is empty, and 30 s later it holds 50,000."""
    rate = 100_000
    await put(limiter, "tenant", "acme", tokens_per_minute=rate, token_burst=100_000)
    await shift_refill(db, 3_600)  # idle for an hour: still only one bucketful
    clock = Clock()
    batch = [
        limiter.prepare(tenant="acme", model="gpt-4o", input_tokens=2_000, max_tokens=8_000)
        for _ in range(15)
    ]

    decisions = await limiter.store.admit(batch)

    statuses = [d.status for d in decisions]
    assert statuses == ["admitted"] * 10 + ["rate_limited"] * 5
    assert sum(d.reserved_tokens or 0 for d in decisions if d.status == "admitted") == 100_000
    for d in decisions[10:]:
        # 10,000 short of an empty bucket at 1,666.67 tokens/s: exactly 6,000 ms.
        assert (d.limit_kind, d.limit_scope, d.retry_after_ms) == ("tokens", "tenant", 6_000)
    assert decisions[9].tenant.tokens == 0.0
    assert decisions[9].remaining_tokens == 0
    assert 0 <= await tokens(limiter, "acme") <= clock.refill(rate)

    await shift_refill(db, 30)
    balance = await tokens(limiter, "acme")
    # 30 s of refill, plus what refilled while the test itself ran (measured).
    assert 50_000 <= balance <= 50_000 + clock.refill(rate)

    # The refused half fits now: five more, and not a sixth.
    retry = [
        limiter.prepare(tenant="acme", model="gpt-4o", input_tokens=2_000, max_tokens=8_000)
        for _ in range(6)
    ]
    again = await limiter.store.admit(retry)
    assert [d.status for d in again] == ["admitted"] * 5 + ["rate_limited"]


async def test_concurrent_burst_over_capacity_is_split_at_capacity_with_deficit_retry(
    limiter: Limiter, db: asyncpg.Connection
) -> None:
    rate = 100_000
    await put(limiter, "tenant", "acme", tokens_per_minute=rate, token_burst=100_000)
    clock = Clock()

    results = await _admit_concurrently(
        limiter, 15, tenant="acme", model="gpt-4o", input_tokens=2_000, max_tokens=8_000
    )

    admitted, refused = _split(results)
    assert len(admitted) == 10
    assert sum(r.reserved_tokens for r in admitted) == 100_000
    assert len(refused) == 5
    elapsed_ms = clock.elapsed() * 1_000
    for exc in refused:
        assert (exc.limit, exc.scope) == ("tokens", "tenant")
        # deficit / rate = 10,000 / (100,000/60,000 ms) = 6,000 ms, less what refilled since.
        assert 6_000 - elapsed_ms - 1 <= exc.retry_after_ms <= 6_000
    assert 0 <= await tokens(limiter, "acme") <= clock.refill(rate)


async def test_a_refusal_writes_nothing_and_its_refill_is_not_lost(
    limiter: Limiter, db: asyncpg.Connection
) -> None:
    rate = 600  # 10 tokens a second
    await put(limiter, "tenant", "acme", tokens_per_minute=rate, token_burst=1_000)
    await limiter.admit(tenant="acme", model="gpt-4o", input_tokens=900, max_tokens=0)
    await shift_refill(db, 10)
    shifted = await raw_layer(db, "tenant", "acme")
    assert shifted["tokens"] == 100
    row_version = await db.fetchval(
        "SELECT xmin::text FROM limit_layers WHERE scope = 'tenant' AND tenant = 'acme'"
    )
    clock = Clock()
    before = await tokens(limiter, "acme")
    assert before == pytest.approx(200, abs=5)  # 10 tokens/s since the admission

    for _ in range(3):
        with pytest.raises(RateLimited) as refused:
            await limiter.admit(tenant="acme", model="gpt-4o", input_tokens=500, max_tokens=0)

    # Refill is a function of the clock: the stored row is untouched (the same
    # row version, balance and refilled_at), and the balance read now still
    # counts every token refilled since.
    assert await raw_layer(db, "tenant", "acme") == shifted
    assert row_version == await db.fetchval(
        "SELECT xmin::text FROM limit_layers WHERE scope = 'tenant' AND tenant = 'acme'"
    )
    after = await tokens(limiter, "acme")
    assert before <= after <= before + clock.refill(rate)
    # 500 - ~200 = ~300 tokens at 10/s.
    assert 29_000 <= refused.value.retry_after_ms <= 30_000
    assert await count(db, "reservations") == 1
    # The next admission that fits is debited from the refilled balance.
    await limiter.admit(tenant="acme", model="gpt-4o", input_tokens=150, max_tokens=0)
    stored = await raw_layer(db, "tenant", "acme")
    assert before - 150 <= stored["tokens"] <= after + clock.refill(rate) - 150
    assert stored["in_flight"] == 2


@dataclass(frozen=True)
class TooLarge:
    """Bursts of the three layers, the request, and the refusal expected."""

    global_burst: int
    tenant_burst: int
    route_burst: int
    route: str | None
    requested: int
    scope: str
    capacity: int


@pytest.mark.parametrize(
    "case",
    [
        TooLarge(50_000, 10_000, 2_000, "chat", 2_001, "route", 2_000),
        TooLarge(50_000, 10_000, 2_000, None, 10_001, "tenant", 10_000),
        TooLarge(5_000, 10_000, 20_000, "chat", 6_000, "global", 5_000),
        TooLarge(5_000, 10_000, 2_000, "chat", 60_000, "route", 2_000),
    ],
    ids=["route", "tenant", "global", "smallest-of-three"],
)
async def test_reservation_over_a_token_burst_is_too_large_and_debits_nothing(
    limiter: Limiter, db: asyncpg.Connection, case: TooLarge
) -> None:
    global_burst, tenant_burst, route_burst = case.global_burst, case.tenant_burst, case.route_burst
    route, requested, scope, capacity = case.route, case.requested, case.scope, case.capacity
    await put(limiter, "global", tokens_per_minute=1, token_burst=global_burst)
    await put(
        limiter,
        "tenant",
        "acme",
        tokens_per_minute=1,
        token_burst=tenant_burst,
        requests_per_minute=1,
        request_burst=5,
        max_in_flight=3,
    )
    await put(limiter, "route", "acme", "chat", tokens_per_minute=1, token_burst=route_burst)

    with pytest.raises(RequestTooLarge) as too_large:
        await limiter.admit(
            tenant="acme",
            route=route,
            model="gpt-4o",
            input_tokens=requested - 500,
            max_tokens=500,
        )

    exc = too_large.value
    assert (exc.limit, exc.scope, exc.requested, exc.capacity) == (
        "tokens",
        scope,
        requested,
        capacity,
    )
    assert str(capacity) in exc.message
    assert str(requested) in exc.message
    assert await tokens(limiter, "acme", "global") == global_burst
    tenant_layer = await status(limiter, "acme")
    assert (tenant_layer.tokens, tenant_layer.requests, tenant_layer.in_flight) == (
        tenant_burst,
        5,
        0,
    )
    assert await tokens(limiter, "acme", "route", "chat") == route_burst
    assert await count(db, "reservations") == 0


async def test_reservation_equal_to_the_burst_fits_exactly(limiter: Limiter) -> None:
    await put(limiter, "tenant", "acme", tokens_per_minute=1, token_burst=10_000)
    held = await limiter.admit(tenant="acme", model="gpt-4o", input_tokens=4_000, max_tokens=6_000)
    assert held.reserved_tokens == 10_000
    assert 0 <= await tokens(limiter, "acme") < 0.1


# --- layers -----------------------------------------------------------------------


async def test_route_policy_tighter_than_its_tenant_binds_with_scope_route(
    limiter: Limiter,
) -> None:
    await put(limiter, "tenant", "acme", tokens_per_minute=1, token_burst=10_000)
    await put(limiter, "route", "acme", "embed", tokens_per_minute=1, token_burst=1_000)
    embed = {"tenant": "acme", "route": "embed", "model": "gpt-4o", "max_tokens": 0}

    await limiter.admit(**embed, input_tokens=800)
    with pytest.raises(RateLimited) as refused:
        await limiter.admit(**embed, input_tokens=800)
    await limiter.admit(tenant="acme", route="chat", model="gpt-4o", input_tokens=800, max_tokens=0)
    await limiter.admit(tenant="acme", model="gpt-4o", input_tokens=800, max_tokens=0)

    assert (refused.value.limit, refused.value.scope) == ("tokens", "route")
    # 600 short at 1 token/min.
    assert 35_990_000 < refused.value.retry_after_ms <= 36_000_000
    assert await tokens(limiter, "acme", "route", "embed") == pytest.approx(200, abs=0.1)
    # The route's admission debited its tenant too: 10,000 - 3 x 800.
    assert await tokens(limiter, "acme") == pytest.approx(7_600, abs=0.1)


async def test_global_policy_is_one_bucket_shared_by_every_tenant(limiter: Limiter) -> None:
    await put(limiter, "global", tokens_per_minute=1, token_burst=3_000)
    await put(limiter, "tenant", "a", tokens_per_minute=1, token_burst=10_000)
    await put(limiter, "tenant", "b", tokens_per_minute=1, token_burst=10_000)

    await limiter.admit(tenant="a", model="gpt-4o", input_tokens=2_000, max_tokens=0)
    await limiter.admit(tenant="b", model="gpt-4o", input_tokens=1_000, max_tokens=0)
    with pytest.raises(RateLimited) as refused_b:
        await limiter.admit(tenant="b", model="gpt-4o", input_tokens=500, max_tokens=0)
    with pytest.raises(RateLimited) as refused_a:
        await limiter.admit(tenant="a", model="gpt-4o", input_tokens=1, max_tokens=0)

    assert (refused_b.value.limit, refused_b.value.scope) == ("tokens", "global")
    assert (refused_a.value.limit, refused_a.value.scope) == ("tokens", "global")
    assert await tokens(limiter, "a", "global") == pytest.approx(0, abs=0.1)
    assert await tokens(limiter, "a") == pytest.approx(8_000, abs=0.1)
    assert await tokens(limiter, "b") == pytest.approx(9_000, abs=0.1)


async def test_global_concurrency_cap_is_shared_by_concurrent_tenants(
    limiter: Limiter, db: asyncpg.Connection
) -> None:
    await put(limiter, "global", max_in_flight=5)
    for tenant in ("a", "b", "c"):
        await put(limiter, "tenant", tenant, max_in_flight=4)

    results = await asyncio.gather(
        *(
            attempt(limiter, tenant=t, model="gpt-4o", input_tokens=1, max_tokens=1)
            for t in ("a", "b", "c") * 10
        )
    )

    admitted, refused = _split(results)
    assert len(admitted) == 5
    assert len(refused) == 25
    assert {(e.limit, e.scope) for e in refused} <= {
        ("concurrency", "global"),
        ("concurrency", "tenant"),
    }
    assert (await raw_layer(db, "global"))["in_flight"] == 5


async def test_when_several_layers_refuse_the_longest_wait_is_named(limiter: Limiter) -> None:
    # Global refills at 1 token/s, the tenant at 100/s: after draining both, a
    # 100-token request waits ~100 s on the global bucket and ~1 s on the tenant's.
    await put(limiter, "global", tokens_per_minute=60, token_burst=1_000)
    await put(limiter, "tenant", "acme", tokens_per_minute=6_000, token_burst=1_000)
    await limiter.admit(tenant="acme", model="gpt-4o", input_tokens=1_000, max_tokens=0)

    with pytest.raises(RateLimited) as refused:
        await limiter.admit(tenant="acme", model="gpt-4o", input_tokens=100, max_tokens=0)

    assert (refused.value.limit, refused.value.scope) == ("tokens", "global")
    assert 99_000 <= refused.value.retry_after_ms <= 100_000


async def test_longest_wait_picks_the_route_over_its_tenant(limiter: Limiter) -> None:
    await put(limiter, "tenant", "acme", tokens_per_minute=6_000, token_burst=1_000)
    await put(limiter, "route", "acme", "slow", tokens_per_minute=60, token_burst=1_000)
    slow = {"tenant": "acme", "route": "slow", "model": "gpt-4o", "max_tokens": 0}
    await limiter.admit(**slow, input_tokens=1_000)

    with pytest.raises(RateLimited) as refused:
        await limiter.admit(**slow, input_tokens=100)

    assert (refused.value.limit, refused.value.scope) == ("tokens", "route")
    assert 99_000 <= refused.value.retry_after_ms <= 100_000


async def test_longest_wait_picks_requests_over_tokens(limiter: Limiter) -> None:
    # Tokens come back in ~1 s, the request token in 60 s.
    await put(
        limiter,
        "tenant",
        "acme",
        tokens_per_minute=6_000,
        token_burst=1_000,
        requests_per_minute=1,
        request_burst=1,
    )
    await limiter.admit(tenant="acme", model="gpt-4o", input_tokens=1_000, max_tokens=0)

    with pytest.raises(RateLimited) as refused:
        await limiter.admit(tenant="acme", model="gpt-4o", input_tokens=100, max_tokens=0)

    assert (refused.value.limit, refused.value.scope) == ("requests", "tenant")
    assert 59_000 <= refused.value.retry_after_ms <= 60_000


async def test_tenant_without_limits_admits_and_counts_in_flight(
    limiter: Limiter, db: asyncpg.Connection
) -> None:
    await limiter.store.ensure_tenant("free")
    held = [
        await limiter.admit(tenant="free", model="gpt-4o", input_tokens=10_000_000, max_tokens=0)
        for _ in range(3)
    ]
    assert len(held) == 3
    layer = await status(limiter, "free")
    assert (layer.tokens, layer.requests, layer.in_flight) == (None, None, 3)


# --- refusals before any state changes ------------------------------------------


async def test_unknown_tenant_is_refused_and_changes_nothing(
    limiter: Limiter, db: asyncpg.Connection
) -> None:
    await put(limiter, "global", tokens_per_minute=1, token_burst=5_000, max_in_flight=2)

    with pytest.raises(UnknownTenant):
        await limiter.admit(tenant="ghost", model="gpt-4o", input_tokens=10, max_tokens=10)

    assert not await limiter.store.tenant_exists("ghost")
    assert await count(db, "reservations") == 0
    assert await count(db, "usage_ledger") == 0
    assert await count(db, "limit_layers", "tenant = 'ghost'") == 0
    global_layer = await raw_layer(db, "global")
    assert (global_layer["tokens"], global_layer["in_flight"]) == (5_000, 0)


async def test_invalid_requests_write_no_rows(limiter: Limiter, db: asyncpg.Connection) -> None:
    await put(limiter, "tenant", "acme", tokens_per_minute=1, token_burst=5_000)
    before = await raw_layer(db, "tenant", "acme")
    accepted = []
    for case, override in INVALID:
        request = {"tenant": "acme", "model": "gpt-4o", "max_tokens": 100, "input_tokens": 50}
        request.update(override)
        try:
            await limiter.admit(**request)
        except InvalidRequest:
            continue
        accepted.append(case)

    assert accepted == []
    assert await count(db, "reservations") == 0
    assert await count(db, "tenants") == 1
    assert await raw_layer(db, "tenant", "acme") == before


@pytest.mark.parametrize(
    ("override", "field"),
    [
        ({"model": "gpt-4o\x1b[2J"}, "model"),
        ({"fallback_models": ["mini\r"]}, "fallback_models"),
        ({"tenant": ".."}, "tenant"),
        ({"route": "a/b"}, "route"),
    ],
)
async def test_a_name_outside_its_pattern_is_an_invalid_request_naming_the_field(
    limiter: Limiter, db: asyncpg.Connection, override: dict[str, Any], field: str
) -> None:
    await put(limiter, "tenant", "acme", tokens_per_minute=1_000)
    request: dict[str, Any] = {"tenant": "acme", "model": "gpt-4o", "max_tokens": 5}
    request.update(override)
    with pytest.raises(InvalidRequest, match=f"^{field} must be ") as refused:
        await limiter.admit(**request, input_tokens=5)
    assert "ASCII letters, digits" in str(refused.value)
    assert await count(db, "reservations") == 0


async def test_largest_valid_counts_are_accepted(limiter: Limiter) -> None:
    await limiter.store.ensure_tenant("big")
    held = await limiter.admit(
        tenant="big",
        route="r" * 128,
        model="m" * 200,
        input_tokens=10_000_000,
        max_tokens=10_000_000,
        lease_seconds=86_400,
        idempotency_key="k" * 255,
    )
    assert held.reserved_tokens == 20_000_000


# --- idempotency ---------------------------------------------------------------------


async def test_same_key_and_body_returns_the_same_reservation_and_debits_once(
    limiter: Limiter, db: asyncpg.Connection
) -> None:
    await put(limiter, "tenant", "acme", tokens_per_minute=1, token_burst=10_000)

    first = await limiter.admit(**REQUEST, idempotency_key="job-1")
    second = await limiter.admit(**REQUEST, idempotency_key="job-1")

    assert second.reservation_id == first.reservation_id
    assert (first.replayed, second.replayed) == (False, True)
    assert second.reserved_tokens == first.reserved_tokens == COST
    assert second.lease_expires_at == first.lease_expires_at
    assert await tokens(limiter, "acme") == pytest.approx(10_000 - COST, abs=0.1)
    assert await count(db, "reservations") == 1
    assert (await raw_layer(db, "tenant", "acme"))["in_flight"] == 1


async def test_same_key_with_a_different_body_is_an_idempotency_conflict(
    limiter: Limiter, db: asyncpg.Connection
) -> None:
    await put(limiter, "tenant", "acme", tokens_per_minute=1, token_burst=10_000)
    await limiter.admit(**REQUEST, idempotency_key="job-1")

    with pytest.raises(IdempotencyConflict):
        await limiter.admit(**{**REQUEST, "max_tokens": 901}, idempotency_key="job-1")
    with pytest.raises(IdempotencyConflict):
        await limiter.admit(**REQUEST, route="other", idempotency_key="job-1")

    assert await tokens(limiter, "acme") == pytest.approx(10_000 - COST, abs=0.1)
    assert await count(db, "reservations") == 1


async def test_idempotency_keys_are_scoped_to_their_tenant(
    limiter: Limiter, db: asyncpg.Connection
) -> None:
    await put(limiter, "tenant", "a", tokens_per_minute=1, token_burst=10_000)
    await put(limiter, "tenant", "b", tokens_per_minute=1, token_burst=10_000)

    held_a = await limiter.admit(**{**REQUEST, "tenant": "a"}, idempotency_key="job-1")
    held_b = await limiter.admit(**{**REQUEST, "tenant": "b"}, idempotency_key="job-1")

    assert held_a.reservation_id != held_b.reservation_id
    assert not held_b.replayed
    assert await count(db, "reservations") == 2


async def test_twenty_concurrent_admits_with_one_key_make_one_reservation(
    limiter: Limiter, db: asyncpg.Connection
) -> None:
    await put(limiter, "tenant", "acme", tokens_per_minute=1, token_burst=100_000)

    held = await asyncio.gather(
        *(limiter.admit(**REQUEST, idempotency_key="once") for _ in range(20))
    )

    assert len({h.reservation_id for h in held}) == 1
    assert sum(not h.replayed for h in held) == 1
    assert await count(db, "reservations") == 1
    assert await tokens(limiter, "acme") == pytest.approx(100_000 - COST, abs=0.1)
    assert (await raw_layer(db, "tenant", "acme"))["in_flight"] == 1


async def test_replay_after_settlement_returns_the_settled_reservation_without_debit(
    limiter: Limiter, db: asyncpg.Connection
) -> None:
    await put(limiter, "tenant", "acme", tokens_per_minute=1, token_burst=10_000)
    first = await limiter.admit(**REQUEST, idempotency_key="job-1")
    await first.settle(input_tokens=100, output_tokens=200)

    again = await limiter.admit(**REQUEST, idempotency_key="job-1")

    assert again.reservation_id == first.reservation_id
    assert again.replayed
    assert await tokens(limiter, "acme") == pytest.approx(10_000 - 300, abs=0.1)
    assert (await raw_layer(db, "tenant", "acme"))["in_flight"] == 0


# --- estimated input -------------------------------------------------------------------


async def test_claude_input_is_an_estimate_scaled_by_one_and_a_quarter(
    limiter: Limiter, db: asyncpg.Connection
) -> None:
    await put(limiter, "tenant", "acme", tokens_per_minute=1, token_burst=100_000)
    messages = [
        {"role": "system", "content": "Summarise contracts."},
        {"role": "user", "content": "Here is the contract: the party of the first part..."},
    ]
    o200k = get_encoding("o200k_base")
    raw = 3 + sum(
        3 + len(o200k.encode(m["role"])) + len(o200k.encode(m["content"])) for m in messages
    )
    expected = math.ceil(raw * 1.25)

    held = await limiter.admit(
        tenant="acme", model="claude-3-5-sonnet-20241022", messages=messages, max_tokens=1_000
    )

    assert held.input_estimated is True
    assert held.input_tokens == expected
    assert held.reserved_tokens == expected + 1_000
    row = await db.fetchrow(
        "SELECT input_tokens, input_estimated, reserved_tokens FROM reservations"
    )
    assert tuple(row) == (expected, True, expected + 1_000)


async def test_openai_input_is_counted_exactly(limiter: Limiter, db: asyncpg.Connection) -> None:
    await limiter.store.ensure_tenant("acme")
    held = await limiter.admit(
        tenant="acme",
        model="gpt-4o",
        messages=[{"role": "user", "content": "hello world"}],
        max_tokens=100,
    )
    assert (held.input_tokens, held.input_estimated, held.reserved_tokens) == (9, False, 109)
    assert await db.fetchval("SELECT input_estimated FROM reservations") is False


# --- the reservation context manager -------------------------------------------------------


async def _full_again(limiter: Limiter, db: asyncpg.Connection) -> None:
    layer = await raw_layer(db, "tenant", "acme")
    assert (layer["tokens"], layer["requests"], layer["in_flight"]) == (10_000, 5, 0)
    assert await db.fetchval("SELECT state FROM reservations") == "released"
    assert await count(db, "usage_ledger") == 0


async def _policy_for_context(limiter: Limiter) -> None:
    await put(
        limiter,
        "tenant",
        "acme",
        tokens_per_minute=1,
        token_burst=10_000,
        requests_per_minute=1,
        request_burst=5,
        max_in_flight=2,
    )


async def test_reservation_left_unsettled_is_released(
    limiter: Limiter, db: asyncpg.Connection
) -> None:
    await _policy_for_context(limiter)
    async with limiter.reservation(**REQUEST) as held:
        inside = await raw_layer(db, "tenant", "acme")
        assert inside["in_flight"] == 1
        assert inside["tokens"] == pytest.approx(10_000 - COST, abs=0.1)
    assert held.released
    await _full_again(limiter, db)


async def test_reservation_is_released_when_the_body_raises(
    limiter: Limiter, db: asyncpg.Connection
) -> None:
    await _policy_for_context(limiter)
    with pytest.raises(RuntimeError, match="provider exploded"):
        async with limiter.reservation(**REQUEST):
            raise RuntimeError("provider exploded")
    await _full_again(limiter, db)


async def test_reservation_is_released_when_the_task_is_cancelled(
    limiter: Limiter, db: asyncpg.Connection
) -> None:
    await _policy_for_context(limiter)
    entered = asyncio.Event()

    async def worker() -> None:
        async with limiter.reservation(**REQUEST):
            entered.set()
            await asyncio.sleep(3_600)

    task = asyncio.create_task(worker())
    await entered.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await _full_again(limiter, db)


async def test_reservation_settled_in_the_block_is_not_released(
    limiter: Limiter, db: asyncpg.Connection
) -> None:
    await _policy_for_context(limiter)
    async with limiter.reservation(**REQUEST) as held:
        settlement = await held.settle(input_tokens=100, output_tokens=50)
    assert (settlement.charged_tokens, settlement.refunded_tokens) == (150, 850)
    assert not held.released
    layer = await raw_layer(db, "tenant", "acme")
    assert (layer["tokens"], layer["in_flight"]) == (pytest.approx(10_000 - 150, abs=0.1), 0)
    assert await db.fetchval("SELECT state FROM reservations") == "settled"


@pytest.mark.parametrize("body_raises", [False, True], ids=["clean-exit", "body-raises"])
async def test_reservation_whose_lease_ran_out_exits_without_a_release_conflict(
    limiter: Limiter, db: asyncpg.Connection, body_raises: bool
) -> None:
    """The lease lapsed while the block ran: the capacity is already coming
    back through expiry, so leaving the block must neither fail nor replace
    the body's own exception with ReservationConflict."""
    await _policy_for_context(limiter)

    async def run() -> None:
        async with limiter.reservation(**REQUEST, lease_seconds=1):
            await db.execute(
                "UPDATE reservations SET lease_expires_at = $1",
                await database_now(db) - timedelta(seconds=1),
            )
            if body_raises:
                raise RuntimeError("provider timed out")

    if body_raises:
        with pytest.raises(RuntimeError, match="provider timed out"):
            await run()
    else:
        await run()
    layer = await raw_layer(db, "tenant", "acme")
    assert (layer["tokens"], layer["in_flight"]) == (10_000, 0)
    assert await db.fetchval("SELECT state FROM reservations") == "expired"
