"""Learned output reservations against the real database.

The settle-time histograms (sql/estimates.sql) against the domain's maths,
no lost sample under concurrent settlements, the admission reserving what
the policy says, and the bound on what a tenant can overshoot under
`learned`: at most (max_tokens - reserved output) per request in flight.
"""

from __future__ import annotations

import asyncio
import random
import uuid

import asyncpg
import pytest

from llmquota.admission.limiter import Limiter, Reservation
from llmquota.config import Settings
from llmquota.domain.errors import RateLimited, RequestTooLarge
from llmquota.domain.output_estimates import (
    OUTPUT_BUCKET_BOUNDS,
    OUTPUT_HALF_LIFE_SECONDS,
    FixedEstimate,
    LearnedEstimate,
    bucket_counts,
    bucket_of,
    bucket_top,
    decay_factor,
    merge,
)
from llmquota.domain.plans import Ceiling, Plan
from llmquota.domain.policy import Policy
from llmquota.store.sqlfiles import queries
from tests.integration.support import put, raw_layer

LEARNED = {"strategy": "learned", "quantile": 0.95, "min_samples": 20}


async def _refresh(limiter: Limiter) -> None:
    """What a worker does in the background every few seconds, now."""
    await limiter.refresh_policies()
    await limiter.estimates.refresh()


async def _learn(limiter: Limiter, tenant: str, outputs: list[int], **request: object) -> None:
    """Admit and settle one request per output count: the samples of the histogram."""
    for output in outputs:
        held = await limiter.admit(
            tenant=tenant, model="gpt-4o", input_tokens=10, max_tokens=1000, **request
        )
        await held.settle(input_tokens=10, output_tokens=output)


async def test_the_sql_histogram_is_the_domain_histogram(db: asyncpg.Connection) -> None:
    assert await db.fetchval("SELECT lq_output_bucket_bounds()") == list(OUTPUT_BUCKET_BOUNDS)
    assert await db.fetchval("SELECT lq_output_half_life_seconds()") == OUTPUT_HALF_LIFE_SECONDS
    probes = [*range(300), *(b + d for b in OUTPUT_BUCKET_BOUNDS for d in (-1, 0, 1) if b + d >= 0)]
    found = await db.fetchval(
        "SELECT array_agg(width_bucket(v, lq_output_bucket_bounds()) - 1 ORDER BY o)"
        "  FROM unnest($1::bigint[]) WITH ORDINALITY AS u(v, o)",
        probes,
    )
    assert found == [bucket_of(v) for v in probes]
    weights = [3.0, 0.0, 1e-9, 7.5]
    counts = list(bucket_counts([0, 5, 5, 40]))
    for elapsed in (0.0, 1.0, 1800.0, 3600.0, 7 * 3600.0, 61 * 3600.0):
        merged = await db.fetchval(
            "SELECT lq_output_merge($1::float8[], $2::float8, $3::float8[])",
            weights,
            elapsed,
            counts,
        )
        assert merged == pytest.approx(list(merge(weights, decay_factor(elapsed), counts)))
    # The other way round: more weights than counts.
    long_weights = [1.0] * 40
    merged = await db.fetchval(
        "SELECT lq_output_merge($1::float8[], 60.0, $2::float8[])", long_weights, [0.0, 2.0]
    )
    assert merged == pytest.approx(list(merge(long_weights, decay_factor(60.0), [0.0, 2.0])))
    # No bucket at all: NULL, not an empty histogram.
    assert await db.fetchval("SELECT lq_output_merge('{}', 1.0, '{}')") is None


async def test_concurrent_settlements_lose_no_sample(app_dsn: str) -> None:
    # One statement per settlement, 20 connections: 240 transactions race for
    # the same four histogram rows.
    unbatched = Settings(  # type: ignore[call-arg]
        batching=False, pool_max_size=20, decision_deadline_ms=60_000, _env_file=None
    )
    rng = random.Random(12)
    keys = [(route, model) for route in ("chat", "batch") for model in ("gpt-4o", "o3")]
    async with await Limiter.connect(app_dsn, unbatched) as limiter:
        await put(limiter, "tenant", "acme")
        for route, _ in keys:
            await put(limiter, "route", "acme", route)
        held: list[tuple[tuple[str, str], Reservation, int]] = []
        for i in range(240):
            route, model = keys[i % len(keys)]
            reservation = await limiter.admit(
                tenant="acme", route=route, model=model, input_tokens=5, max_tokens=4000
            )
            held.append(((route, model), reservation, rng.randint(0, 3000)))
        rng.shuffle(held)
        await asyncio.gather(*(r.settle(input_tokens=5, output_tokens=out) for _, r, out in held))
        read = await limiter.store.estimates.histograms(tenant="acme", limit=100)
    by_key = {(h.route, h.model): h.histogram for h in read.histograms}
    assert set(by_key) == set(keys)
    for key, histogram in by_key.items():
        outputs = [out for k, _, out in held if k == key]
        assert histogram.samples == len(outputs) == 60
        # Every sample is there, each decayed by the seconds the test took at most.
        expected = bucket_counts(outputs)
        assert len(histogram.weights) == len(expected)
        for got, want in zip(histogram.weights, expected, strict=True):
            assert want * decay_factor(120.0) <= got <= want + 1e-9


async def test_batches_of_mixed_keys_in_any_order_neither_deadlock_nor_lose(
    limiter: Limiter, app_dsn: str
) -> None:
    await put(limiter, "tenant", "acme")
    await put(limiter, "tenant", "beta")
    ids: list[uuid.UUID] = []
    for i in range(160):
        r = await limiter.admit(
            tenant=("acme", "beta")[i % 2],
            model=f"m{i % 4}",
            input_tokens=1,
            max_tokens=100,
        )
        ids.append(r.reservation_id)
    connections = [await asyncpg.connect(app_dsn) for _ in range(8)]
    try:
        # Eight concurrent statements of 20 settlements each, every other one
        # in reverse order: the rows are locked in key order whatever the order.
        chunks = [ids[i::8] for i in range(8)]
        await asyncio.gather(
            *(
                c.fetch(
                    queries()["finish"],
                    chunk if n % 2 else chunk[::-1],
                    ["settle"] * len(chunk),
                    [None] * len(chunk),
                    [1] * len(chunk),
                    [7] * len(chunk),
                    ["ok"] * len(chunk),
                    None,  # usage sources, as reported figures: none (a REST settle)
                    None,
                    None,
                    None,  # serving paths: the journaled ones
                )
                for n, (c, chunk) in enumerate(zip(connections, chunks, strict=True))
            )
        )
        total = await connections[0].fetchval("SELECT sum(samples) FROM output_estimates")
    finally:
        for c in connections:
            await c.close()
    assert total == 160


async def test_only_on_time_ok_settlements_are_samples(
    limiter: Limiter, db: asyncpg.Connection
) -> None:
    await put(limiter, "tenant", "acme")
    kept = await limiter.admit(tenant="acme", model="m", input_tokens=1, max_tokens=50)
    await kept.settle(input_tokens=1, output_tokens=9)
    for outcome in ("error", "cancelled"):
        r = await limiter.admit(tenant="acme", model="m", input_tokens=1, max_tokens=50)
        await r.settle(input_tokens=1, output_tokens=30, outcome=outcome)
    released = await limiter.admit(tenant="acme", model="m", input_tokens=1, max_tokens=50)
    await released.release()
    row = await db.fetchrow("SELECT route, samples, weights FROM output_estimates")
    assert row is not None
    assert (row["route"], row["samples"]) == ("", 1)
    assert row["weights"][bucket_of(9)] == 1.0


async def test_learned_reserves_the_quantile_once_min_samples_exist(
    limiter: Limiter, db: asyncpg.Connection
) -> None:
    await limiter.store.catalog.put_tenant_policy(
        "acme", None, {"tokens_per_minute": 100_000, "output_estimate": LEARNED}
    )
    await _learn(limiter, "acme", [100] * 19)
    await _refresh(limiter)
    cold = await limiter.admit(tenant="acme", model="gpt-4o", input_tokens=10, max_tokens=1000)
    assert cold.output_estimate == {"strategy": "max_tokens", "tokens": 1000}
    assert cold.reserved_tokens == 1010
    await cold.settle(input_tokens=10, output_tokens=100)  # the twentieth sample
    await _refresh(limiter)

    warm = await limiter.admit(tenant="acme", model="gpt-4o", input_tokens=10, max_tokens=1000)
    learned = bucket_top(bucket_of(100))
    assert warm.output_estimate == {"strategy": "learned", "tokens": learned}
    assert warm.reserved_tokens == 10 + learned
    row = await db.fetchrow(
        "SELECT max_tokens, reserved_tokens FROM reservations WHERE reservation_id = $1",
        warm.reservation_id,
    )
    assert row is not None
    assert (row["max_tokens"], row["reserved_tokens"]) == (1000, 10 + learned)
    # Capped at max_tokens, and per model: another model is still cold.
    small = await limiter.admit(tenant="acme", model="gpt-4o", input_tokens=10, max_tokens=50)
    assert small.output_estimate == {"strategy": "learned", "tokens": 50}
    other = await limiter.admit(tenant="acme", model="o3", input_tokens=10, max_tokens=1000)
    assert other.output_estimate == {"strategy": "max_tokens", "tokens": 1000}


async def test_a_route_policy_wins_over_the_tenant_and_the_plan_over_nothing(
    limiter: Limiter,
) -> None:
    await limiter.store.catalog.put_plan(
        "pro",
        Plan(tokens_per_minute=100_000, output_estimate=FixedEstimate(strategy="fixed", tokens=64)),
    )
    await limiter.store.catalog.put_tenant_policy("acme", "pro", {})
    await limiter.store.put_policy(
        "route",
        "acme",
        "summaries",
        Policy(output_estimate=LearnedEstimate(strategy="learned", min_samples=5)),
    )
    await _learn(limiter, "acme", [300] * 5, route="summaries")
    await _refresh(limiter)
    plain = await limiter.admit(tenant="acme", model="gpt-4o", input_tokens=10, max_tokens=1000)
    assert plain.output_estimate == {"strategy": "fixed", "tokens": 64}
    routed = await limiter.admit(
        tenant="acme", route="summaries", model="gpt-4o", input_tokens=10, max_tokens=1000
    )
    assert routed.output_estimate == {"strategy": "learned", "tokens": bucket_top(bucket_of(300))}
    # A request without max_tokens: the learned quantile where there is one,
    # else the model's maximum output.
    bare = await limiter.admit(tenant="acme", route="summaries", model="gpt-4o", input_tokens=10)
    assert bare.output_estimate == routed.output_estimate
    await limiter.store.catalog.put_tenant_policy("acme", None, {"tokens_per_minute": 100_000})
    await _refresh(limiter)
    cold = await limiter.admit(tenant="acme", route="chat", model="gpt-4o", input_tokens=10)
    assert cold.output_estimate == {"strategy": "max_tokens", "tokens": 16_384}


async def test_overshoot_under_learned_is_bounded_by_the_requests_in_flight(
    limiter: Limiter, db: asyncpg.Connection
) -> None:
    # The bound (README, RELIABILITY.md): a request reserves input + r, r the
    # learned quantile <= max_tokens, and may settle up to input + max_tokens,
    # so the most a tenant's balance can end below zero is the sum over its
    # requests in flight of (max_tokens - r): max_in_flight x (max_tokens - r).
    in_flight, max_tokens, input_tokens = 200, 1000, 10
    await limiter.store.catalog.put_tenant_policy(
        "acme",
        None,
        {
            "tokens_per_minute": 1,  # refill: one token a minute, nothing during the test
            "token_burst": 30_000,
            "max_in_flight": in_flight,
            "output_estimate": LEARNED,
        },
    )
    await _learn(limiter, "acme", [100] * 20)
    await _refresh(limiter)
    learned = bucket_top(bucket_of(100))
    assert learned == 103  # twenty answers of 100 tokens: the top of their bucket, 96..103
    budget = 250 * (input_tokens + learned)  # room for 250 reservations, not 250 answers
    await db.execute(
        "UPDATE limit_layers SET tokens = $1::bigint, token_burst = $1::bigint"
        " WHERE scope = 'tenant'",
        budget,
    )

    async def admit() -> Reservation | None:
        try:
            return await limiter.admit(
                tenant="acme", model="gpt-4o", input_tokens=input_tokens, max_tokens=max_tokens
            )
        except RateLimited as exc:
            assert exc.limit == "concurrency"
            return None

    admitted = [r for r in await asyncio.gather(*(admit() for _ in range(250))) if r]
    assert len(admitted) == in_flight  # max_in_flight bounds the requests in flight
    assert {r.reserved_tokens for r in admitted} == {input_tokens + learned}
    # Every one of them runs to max_tokens.
    await asyncio.gather(
        *(r.settle(input_tokens=input_tokens, output_tokens=max_tokens) for r in admitted)
    )
    balance = (await raw_layer(db, "tenant", "acme"))["tokens"]
    charged = in_flight * (input_tokens + max_tokens)
    overshoot = charged - budget
    bound = in_flight * (max_tokens - learned)
    assert overshoot == 202_000 - 28_250 == 173_750
    assert bound == 200 * (1000 - 103) == 179_400
    assert overshoot <= bound
    assert balance == pytest.approx(budget - charged, abs=1.0)  # the debt is on the books
    # Nothing more passes until refill repays it: the overshoot never compounds.
    with pytest.raises(RateLimited) as refused:
        await limiter.admit(tenant="acme", model="gpt-4o", input_tokens=10, max_tokens=1000)
    assert refused.value.limit == "tokens"


async def _seed(db: asyncpg.Connection, tenant: str, outputs: dict[str, list[int]]) -> None:
    """Samples of each model's completions, as settlements record them (lq_finish's call)."""
    rows = [(model, output) for model, samples in outputs.items() for output in samples]
    await db.execute(
        "SELECT lq_record_output_samples($1::text[], $2::text[], $3::text[], $4::bigint[])",
        [tenant] * len(rows),
        [None] * len(rows),
        [model for model, _ in rows],
        [output for _, output in rows],
    )


async def test_a_degraded_admission_reserves_the_admitted_models_estimate(
    limiter: Limiter, db: asyncpg.Connection
) -> None:
    """Issue 23's leftover: the fallback admitted reserves its own learned
    quantile, not the refused model's, on every layer, and says so."""
    await limiter.store.catalog.put_tenant_policy(
        "acme",
        None,
        # A refill of one token a minute: the balances below move only by what
        # admission takes. 600 cannot afford gpt-4o's ~1,000 tokens of output.
        {"tokens_per_minute": 1, "token_burst": 600, "output_estimate": LEARNED},
    )
    await _seed(db, "acme", {"gpt-4o": [1000] * 20, "gpt-4o-mini": [100] * 20})
    await _refresh(limiter)
    big, small = bucket_top(bucket_of(1000)), bucket_top(bucket_of(100))
    assert (big, small) == (1023, 103)
    with pytest.raises(RequestTooLarge):  # the requested model alone: 10 + 1,023 > 600
        await limiter.admit(tenant="acme", model="gpt-4o", input_tokens=10, max_tokens=4000)

    held = await limiter.admit(
        tenant="acme",
        model="gpt-4o",
        input_tokens=10,
        max_tokens=4000,
        fallback_models=["gpt-4o-mini"],
    )
    assert (held.model, held.degraded) == ("gpt-4o-mini", True)
    assert held.output_estimate == {"strategy": "learned", "tokens": small}
    assert held.reserved_tokens == 10 + small
    row = await db.fetchrow(
        "SELECT model, max_tokens, reserved_tokens FROM reservations WHERE reservation_id = $1",
        held.reservation_id,
    )
    assert row is not None
    assert tuple(row) == ("gpt-4o-mini", 4000, 10 + small)
    tenant = await raw_layer(db, "tenant", "acme")
    assert tenant["tokens"] == pytest.approx(600 - 10 - small, abs=0.5)
    await held.release()  # gives back exactly what it took
    assert (await raw_layer(db, "tenant", "acme"))["tokens"] == pytest.approx(600, abs=0.5)


async def test_a_fallback_with_a_larger_estimate_reserves_the_larger(
    limiter: Limiter, db: asyncpg.Connection
) -> None:
    """The reverse: the refused model's output is small, the fallback's large, and
    the fallback reserves its own, on the tenant and the fallback's ceiling alike."""
    catalog = limiter.store.catalog
    # gpt-4o-mini is always refused (413 at its ceiling); gpt-4o's ceiling has room.
    await catalog.put_ceiling(
        "mini", Ceiling(models=["gpt-4o-mini"], tokens_per_minute=1, token_burst=5)
    )
    await catalog.put_ceiling(
        "big", Ceiling(models=["gpt-4o"], tokens_per_minute=1, token_burst=50_000)
    )
    await catalog.put_tenant_policy(
        "acme", None, {"tokens_per_minute": 1, "token_burst": 20_000, "output_estimate": LEARNED}
    )
    await _seed(db, "acme", {"gpt-4o": [1000] * 20, "gpt-4o-mini": [100] * 20})
    await _refresh(limiter)
    big = bucket_top(bucket_of(1000))
    held = await limiter.admit(
        tenant="acme",
        model="gpt-4o-mini",
        input_tokens=10,
        max_tokens=4000,
        fallback_models=["gpt-4o"],
    )
    assert (held.model, held.degraded) == ("gpt-4o", True)
    assert held.output_estimate == {"strategy": "learned", "tokens": big}
    assert held.reserved_tokens == 10 + big
    tenant = await raw_layer(db, "tenant", "acme")
    assert tenant["tokens"] == pytest.approx(20_000 - 10 - big, abs=0.5)
    ceiling = await db.fetchval("SELECT tokens FROM limit_layers WHERE ceiling = 'big'")
    assert ceiling == pytest.approx(50_000 - 10 - big, abs=0.5)
    await held.settle(input_tokens=10, output_tokens=900)  # 123 of the reservation back
    tenant = await raw_layer(db, "tenant", "acme")
    assert tenant["tokens"] == pytest.approx(20_000 - 910, abs=0.5)


async def test_a_default_list_fallback_reserves_its_own_estimate(
    limiter: Limiter, db: asyncpg.Connection
) -> None:
    """The leftover for default lists: a fallback of the tenant's (plan's) own
    `fallback_models`, which the caller does not name, reserves its own learned
    quantile too, as an explicit one does."""
    await limiter.store.catalog.put_plan("free", Plan(fallback_models=["gpt-4o-mini"]))
    await limiter.store.catalog.put_tenant_policy(
        "acme", "free", {"tokens_per_minute": 1, "token_burst": 600, "output_estimate": LEARNED}
    )
    await _seed(db, "acme", {"gpt-4o": [1000] * 20, "gpt-4o-mini": [100] * 20})
    await _refresh(limiter)
    small = bucket_top(bucket_of(100))
    held = await limiter.admit(tenant="acme", model="gpt-4o", input_tokens=10, max_tokens=4000)
    assert (held.model, held.degraded) == ("gpt-4o-mini", True)
    assert held.output_estimate == {"strategy": "learned", "tokens": small}
    assert held.reserved_tokens == 10 + small
    tenant = await raw_layer(db, "tenant", "acme")
    assert tenant["tokens"] == pytest.approx(600 - 10 - small, abs=0.5)
    # With degrade false, nothing is degraded, and the 429 lists the default that fits.
    with pytest.raises(RequestTooLarge):
        await limiter.admit(
            tenant="acme", model="gpt-4o", input_tokens=10, max_tokens=4000, degrade=False
        )
