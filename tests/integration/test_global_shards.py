"""A sharded global layer (migration 0012): its budget split over K rows, exact in total.

Each tenant's requests take one shard; a shard short of room for its part of
a batch makes the statement decide again with every shard pooled. So the
shards together never admit more than the global burst, and a request is
refused by the global layer only when all of them together lack room: the
decisions are those of one unsharded row (checked against a twin database,
releases and settlements included).
The refill rates are slow (a few tokens a minute), so refill during a test is
a fraction of a token.
"""

from __future__ import annotations

import asyncio
import random
import uuid

import asyncpg
import pytest

from llmquota.admission.limiter import Limiter, Reservation
from llmquota.domain.errors import RateLimited, RefusedValue
from llmquota.domain.plans import Ceiling
from llmquota.domain.policy import Policy
from llmquota.domain.records import AdmitRequest, FallbackCandidate, FinishRequest
from llmquota.store.store import Store
from tests.support import APP_ROLE, dsn_as

from .support import attempt, put


async def put_global(limiter: Limiter | Store, shards: int | None, **policy: int) -> int:
    store = limiter.store if isinstance(limiter, Limiter) else limiter
    return await store.put_policy("global", None, None, Policy(**policy), shards=shards)


async def global_rows(db: asyncpg.Connection) -> list[asyncpg.Record]:
    return await db.fetch(
        """SELECT shard, shards, tokens_per_minute, token_burst, requests_per_minute,
                  request_burst, max_in_flight, tokens, requests, in_flight, policy_version
             FROM limit_layers WHERE scope = 'global' ORDER BY shard"""
    )


async def global_tokens(db: asyncpg.Connection) -> float:
    return float(await db.fetchval("SELECT tokens FROM global_layer"))


async def test_the_shares_sum_to_the_policy_and_reads_show_it_whole(
    limiter: Limiter, db: asyncpg.Connection
) -> None:
    version = await put_global(
        limiter,
        4,
        tokens_per_minute=1_003,
        token_burst=1_003,
        requests_per_minute=10,
        request_burst=10,
    )

    rows = await global_rows(db)
    assert [r["shard"] for r in rows] == [0, 1, 2, 3]
    assert {r["shards"] for r in rows} == {4}
    assert [r["token_burst"] for r in rows] == [251, 251, 251, 250]
    assert [r["tokens_per_minute"] for r in rows] == [251, 251, 251, 250]
    assert [r["request_burst"] for r in rows] == [3, 3, 2, 2]
    assert [r["tokens"] for r in rows] == [251, 251, 251, 250]  # a new layer starts full
    assert {r["policy_version"] for r in rows} == {version}

    stored = await limiter.store.get_policy("global", None, None)
    assert stored is not None
    assert stored.shards == 4
    assert stored.policy.token_burst == 1_003
    assert stored.policy.request_burst == 10
    assert stored.policy_version == version
    await put(limiter, "tenant", "a")
    layers = {layer.scope: layer for layer in await limiter.store.layer_status("a")}
    assert layers["global"].policy.token_burst == 1_003
    assert layers["global"].tokens == pytest.approx(1_003, abs=1)


async def test_one_tenant_takes_the_whole_global_budget_through_its_shard(
    limiter: Limiter, db: asyncpg.Connection
) -> None:
    await put_global(limiter, 4, tokens_per_minute=4, token_burst=1_000)
    await put(limiter, "tenant", "a")

    for _ in range(10):  # its own shard holds 250: the rest is borrowed
        await limiter.admit(tenant="a", model="gpt-4o", input_tokens=100, max_tokens=0)
    with pytest.raises(RateLimited) as refused:
        await limiter.admit(tenant="a", model="gpt-4o", input_tokens=100, max_tokens=0)

    assert (refused.value.limit, refused.value.scope) == ("tokens", "global")
    # 100 tokens at the whole layer's 4 a minute: 25 minutes.
    assert 1_490_000 <= refused.value.retry_after_ms <= 1_500_000
    assert await global_tokens(db) == pytest.approx(0, abs=0.1)
    rows = await global_rows(db)
    assert sum(r["in_flight"] for r in rows) == 10
    assert all(r["tokens"] <= r["token_burst"] for r in rows)


async def test_a_request_larger_than_any_shard_fits_the_whole_layer(
    limiter: Limiter, db: asyncpg.Connection
) -> None:
    await put_global(limiter, 4, tokens_per_minute=4, token_burst=1_000)
    await put(limiter, "tenant", "a")

    held = await limiter.admit(tenant="a", model="gpt-4o", input_tokens=900, max_tokens=0)

    assert held.reserved_tokens == 900
    assert await global_tokens(db) == pytest.approx(100, abs=0.1)


async def test_a_fallback_larger_than_any_shard_fits_the_whole_layer(
    limiter: Limiter, db: asyncpg.Connection
) -> None:
    """A fallback reserves its own output (a learned estimate of its own), here
    more than the refused model's and more than a shard holds: the statement
    counts each candidate at its own cost when it checks the shards, so the
    batch is decided pooled and the fallback admitted."""
    await put_global(limiter, 4, tokens_per_minute=4, token_burst=1_000)
    await put(limiter, "tenant", "a")
    await limiter.store.catalog.put_ceiling(
        "starved", Ceiling(models=["gpt-4o"], tokens_per_minute=1, token_burst=5)
    )
    request = limiter.prepare(
        tenant="a", model="gpt-4o", input_tokens=10, max_tokens=1000, fallback_models=["o3"]
    )._replace(
        output_reserve=100,
        output_strategy="learned",
        fallbacks=(FallbackCandidate("o3", 10, 900, "learned"),),
    )

    [decision] = await limiter.store.admit([request])

    assert (decision.status, decision.model, decision.degraded) == ("admitted", "o3", True)
    assert decision.reserved_tokens == 910
    assert await global_tokens(db) == pytest.approx(90, abs=0.1)


async def test_concurrent_tenants_admit_exactly_the_global_burst(
    limiter: Limiter, db: asyncpg.Connection
) -> None:
    await put_global(limiter, 4, tokens_per_minute=4, token_burst=10_000)
    tenants = [f"t{i}" for i in range(40)]
    for tenant in tenants:
        await put(limiter, "tenant", tenant)

    results = await asyncio.gather(
        *(
            attempt(limiter, tenant=t, model="gpt-4o", input_tokens=50, max_tokens=50)
            for t in tenants * 5
        )
    )

    admitted = [r for r in results if isinstance(r, Reservation)]
    refused = [r for r in results if isinstance(r, RateLimited)]
    assert len(admitted) == 100  # 10,000 / 100, whatever the spread over shards
    assert len(refused) == 100
    assert {(e.limit, e.scope) for e in refused} == {("tokens", "global")}
    assert await global_tokens(db) == pytest.approx(0, abs=0.1)
    assert sum(r["in_flight"] for r in await global_rows(db)) == 100
    assert await limiter.store.audit() == []


async def test_changing_the_shard_count_under_load_admits_exactly_the_burst(
    limiter: Limiter, db: asyncpg.Connection
) -> None:
    await put_global(limiter, 4, tokens_per_minute=4, token_burst=10_000)
    tenants = [f"t{i}" for i in range(40)]
    for tenant in tenants:
        await put(limiter, "tenant", tenant)

    async def reshard() -> None:
        for shards in (2, 1, 4, 3, 1, 2):
            await put_global(limiter, shards, tokens_per_minute=4, token_burst=10_000)
            await asyncio.sleep(0.01)

    results, _ = await asyncio.gather(
        asyncio.gather(
            *(
                attempt(limiter, tenant=t, model="gpt-4o", input_tokens=50, max_tokens=50)
                for t in tenants * 5
            )
        ),
        reshard(),
    )

    admitted = [r for r in results if isinstance(r, Reservation)]
    refused = [r for r in results if isinstance(r, RateLimited)]
    assert len(admitted) + len(refused) == len(results)
    assert len(admitted) == 100  # no shard change loses or adds budget
    assert await global_tokens(db) == pytest.approx(0, abs=0.1)


async def test_permits_counted_on_the_shards_all_come_back(
    limiter: Limiter, db: asyncpg.Connection
) -> None:
    await put_global(limiter, 4, tokens_per_minute=4, token_burst=10_000)
    for tenant in ("a", "b", "c"):
        await put(limiter, "tenant", tenant)

    held = await asyncio.gather(
        *(
            limiter.admit(tenant=t, model="gpt-4o", input_tokens=600, max_tokens=0)
            for t in ("a", "b", "c") * 5
        )
    )  # 9,000 of 10,000: some batches pooled, some not

    assert sum(r["in_flight"] for r in await global_rows(db)) == 15
    for reservation in held:
        await reservation.settle(input_tokens=600, output_tokens=0)
    assert [r["in_flight"] for r in await global_rows(db)] == [0, 0, 0, 0]
    assert await limiter.store.audit() == []


async def test_a_give_back_larger_than_one_shard_returns_in_full(
    limiter: Limiter, db: asyncpg.Connection
) -> None:
    await put_global(limiter, 2, tokens_per_minute=4, token_burst=1_000)
    await put(limiter, "tenant", "a")

    held = await limiter.admit(tenant="a", model="gpt-4o", input_tokens=900, max_tokens=0)
    assert await global_tokens(db) == pytest.approx(100, abs=0.1)
    await held.release()  # 900 back: more than either shard's headroom

    assert await global_tokens(db) == pytest.approx(1_000, abs=0.1)
    again = await limiter.admit(tenant="a", model="gpt-4o", input_tokens=900, max_tokens=0)
    settled = await again.settle(input_tokens=100, output_tokens=0)  # 800 refunded
    assert settled is not None
    assert await global_tokens(db) == pytest.approx(900, abs=0.1)
    assert all(r["tokens"] <= r["token_burst"] for r in await global_rows(db))


async def test_changing_the_shard_count_keeps_the_balance(
    limiter: Limiter, db: asyncpg.Connection
) -> None:
    await put_global(limiter, 4, tokens_per_minute=4, token_burst=1_000)
    await put(limiter, "tenant", "a")
    held = [
        await limiter.admit(tenant="a", model="gpt-4o", input_tokens=100, max_tokens=0)
        for _ in range(4)
    ]

    await put_global(limiter, 2, tokens_per_minute=4, token_burst=1_000)
    rows = await global_rows(db)
    assert [r["shard"] for r in rows] == [0, 1]
    assert [r["token_burst"] for r in rows] == [500, 500]
    assert await global_tokens(db) == pytest.approx(600, abs=0.5)

    await put_global(limiter, None, tokens_per_minute=4, token_burst=1_000)  # keeps 2
    assert len(await global_rows(db)) == 2
    await put_global(limiter, 1, tokens_per_minute=4, token_burst=1_000)
    assert await global_tokens(db) == pytest.approx(600, abs=0.5)

    for reservation in held:  # admitted on rows that may be gone: they still settle
        await reservation.settle(input_tokens=100, output_tokens=0)
    assert await global_tokens(db) == pytest.approx(600, abs=0.5)


async def test_reservations_released_after_4_2_1_3_shards_give_back_everything(
    limiter: Limiter, db: asyncpg.Connection
) -> None:
    # Issue 20: rows beyond a new count were deleted with their open
    # reservations' give-backs (global stayed at 7,000).
    await put_global(limiter, 4, tokens_per_minute=4, token_burst=10_000)
    for tenant in ("a", "b", "c"):
        await put(limiter, "tenant", tenant)
    held = [
        await limiter.admit(tenant=t, model="gpt-4o", input_tokens=1_000, max_tokens=0)
        for t in ("a", "b", "c")
    ]
    assert await global_tokens(db) == pytest.approx(7_000, abs=0.1)

    for shards in (2, 1, 3):
        await put_global(limiter, shards, tokens_per_minute=4, token_burst=10_000)
        rows = await global_rows(db)
        assert [r["shard"] for r in rows] == list(range(shards))
        assert sum(r["in_flight"] for r in rows) == 3  # the permits moved with them
        assert await global_tokens(db) == pytest.approx(7_000, abs=0.1)
    for reservation in held:
        await reservation.release()

    assert await global_tokens(db) == pytest.approx(10_000, abs=1e-6)
    assert [r["in_flight"] for r in await global_rows(db)] == [0, 0, 0]
    assert await limiter.store.audit() == []


async def test_a_whole_burst_in_flight_survives_shrinking_to_one_row(
    limiter: Limiter, db: asyncpg.Connection
) -> None:
    await put_global(limiter, 4, tokens_per_minute=4, token_burst=10_000)
    tenants = [f"t{i}" for i in range(10)]
    for tenant in tenants:
        await put(limiter, "tenant", tenant)
    held = [
        await limiter.admit(tenant=t, model="gpt-4o", input_tokens=1_000, max_tokens=0)
        for t in tenants
    ]
    assert await global_tokens(db) == pytest.approx(0, abs=0.1)

    await put_global(limiter, 1, tokens_per_minute=4, token_burst=10_000)
    assert [r["in_flight"] for r in await global_rows(db)] == [10]
    for reservation in held:
        await reservation.release()

    assert await global_tokens(db) == pytest.approx(10_000, abs=1e-6)


async def test_settlements_and_expiries_after_shard_changes_take_exactly_what_was_used(
    limiter: Limiter, db: asyncpg.Connection
) -> None:
    await put_global(limiter, 4, tokens_per_minute=4, token_burst=10_000)
    for tenant in ("a", "b", "c"):
        await put(limiter, "tenant", tenant)
    settled, expired, released = [
        await limiter.admit(tenant=t, model="gpt-4o", input_tokens=1_000, max_tokens=0)
        for t in ("a", "b", "c")
    ]
    await put_global(limiter, 1, tokens_per_minute=4, token_burst=10_000)
    await db.execute(
        "UPDATE reservations SET lease_expires_at = clock_timestamp() - interval '1 second' "
        "WHERE reservation_id = $1",
        expired.reservation_id,
    )
    assert await limiter.store.sweep(10) == (1, 1_000)  # gives back the 1,000 it held
    await put_global(limiter, 2, tokens_per_minute=4, token_burst=10_000)

    await settled.settle(input_tokens=400, output_tokens=0)  # 600 refunded
    await expired.settle(input_tokens=300, output_tokens=0)  # late: 300 debited now
    await released.release()

    assert await global_tokens(db) == pytest.approx(10_000 - 400 - 300, abs=0.1)
    assert await limiter.store.audit() == []


async def test_shards_that_cannot_split_a_limit_are_refused_and_change_nothing(
    limiter: Limiter, db: asyncpg.Connection
) -> None:
    with pytest.raises(RefusedValue):
        await put_global(limiter, 8, token_burst=5, tokens_per_minute=60)
    with pytest.raises(RefusedValue):  # permits are counted per row: no cap when sharded
        await put_global(limiter, 2, max_in_flight=5)
    assert await global_rows(db) == []


# -- the same decisions as one row ------------------------------------------------


async def test_sharded_batches_decide_exactly_as_one_global_row(
    app_dsn: str, twin_dsn: str
) -> None:
    sharded = await Store.connect(app_dsn, min_size=1, max_size=2)
    whole = await Store.connect(dsn_as(twin_dsn, APP_ROLE), min_size=1, max_size=2)
    try:
        policy = {
            "tokens_per_minute": 4,
            "token_burst": 20_000,
            "request_burst": 120,
            "requests_per_minute": 4,
        }
        await put_global(sharded, 4, **policy)
        await put_global(whole, 1, **policy)
        tenants = [f"t{i}" for i in range(12)]
        for store in (sharded, whole):
            for tenant in tenants[:-1]:  # the last one is unknown
                await store.put_policy(
                    "tenant", tenant, None, Policy(token_burst=6_000, tokens_per_minute=1)
                )
        rng = random.Random(20261201)
        statuses: list[tuple[str, str]] = []
        held: list[tuple[uuid.UUID, uuid.UUID]] = []  # (sharded, whole) of one admission
        for _ in range(40):
            batch = [
                AdmitRequest(
                    tenant=rng.choice(tenants),
                    route=None,
                    model="gpt-4o",
                    input_tokens=rng.randint(1, 400),
                    max_tokens=rng.choice([0, 100, 1_500]),
                    input_estimated=False,
                    lease_seconds=None,
                    idempotency_key=None,
                    request_hash=None,
                )
                for _ in range(rng.randint(1, 16))
            ]
            for a, b in zip(await sharded.admit(batch), await whole.admit(batch), strict=True):
                assert (a.status, a.limit_scope, a.limit_kind) == (
                    b.status,
                    b.limit_scope,
                    b.limit_kind,
                )
                statuses.append((a.status, a.limit_scope or ""))
                if a.reservation_id is not None and b.reservation_id is not None:
                    held.append((a.reservation_id, b.reservation_id))
            # Give some back: releases, and settlements below and above the reservation.
            rng.shuffle(held)
            finishing, held = held[: len(held) // 3], held[len(held) // 3 :]
            actions = [
                ("release", None) if rng.random() < 0.4 else ("settle", rng.randint(0, 2_000))
                for _ in finishing
            ]
            for store, side in ((sharded, 0), (whole, 1)):
                await store.finish(
                    [
                        FinishRequest(pair[side], "release")
                        if action == "release"
                        else FinishRequest(pair[side], "settle", None, 1, output, "ok")
                        for pair, (action, output) in zip(finishing, actions, strict=True)
                    ]
                )
        # The run reached every global limit and still agreed throughout.
        assert ("admitted", "") in statuses
        assert ("rate_limited", "global") in statuses
        assert ("unknown_tenant", "") in statuses
    finally:
        await sharded.close()
        await whole.close()
