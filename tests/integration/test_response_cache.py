"""The response cache's statements against the real PostgreSQL, as the service's role.

A hit writes its ledger row in the statement that finds it; a namespace
never reads another tenant's or route's entries; the bound per tenant is
exact under concurrent stores; expired entries are never served and the
sweeper deletes them; a semantic lookup serves the nearest entry of the same
context at or above the similarity and nothing below it.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator
from decimal import Decimal

import asyncpg
import pytest

from llmquota.admin.alerts import AlertService
from llmquota.admission.limiter import Limiter
from llmquota.domain.quotas import quota_spec
from llmquota.domain.response_cache import cosine, signature, unit
from llmquota.finance.ledger import LedgerStore
from llmquota.store.response_cache import CacheKey
from llmquota.store.store import Store
from tests.support import vector_at_cosine

ANSWER = b'{"id":"chatcmpl-1","choices":[{"message":{"content":"hi"}}]}'


@pytest.fixture
async def store(app_dsn: str) -> AsyncIterator[Store]:
    opened = await Store.connect(app_dsn, min_size=1, max_size=20)
    for tenant in ("acme", "globex"):  # an answer is kept only for a tenant that exists
        await opened.ensure_tenant(tenant)
    yield opened
    await opened.close()


def key(tenant: str = "acme", route: str | None = None, exact: int = 1, **more: object) -> CacheKey:
    return CacheKey(
        tenant=tenant,
        route=route,
        endpoint="chat",
        model="gpt-4o",
        exact_key=exact.to_bytes(32, "big"),
        **more,  # type: ignore[arg-type]
    )


async def put(store: Store, k: CacheKey, *, ttl: int = 600, max_entries: int = 100) -> int:
    return await store.response_cache.store(
        k, ANSWER, input_tokens=40, output_tokens=12, ttl_seconds=ttl, max_entries=max_entries
    )


async def test_an_exact_hit_is_served_once_and_booked_in_the_ledger(
    store: Store, db: asyncpg.Connection
) -> None:
    await put(store, key())
    hit = await store.response_cache.serve(
        key(), budget_seconds=5.0, similarity=0.9, price_usd=Decimal("0.0002")
    )
    assert hit is not None
    assert (hit.answer, hit.input_tokens, hit.output_tokens) == (ANSWER, 40, 12)
    row = await db.fetchrow(
        "SELECT reservation_id, entry_kind, outcome, tenant, route, model, input_tokens,"
        " output_tokens, reserved_tokens, serving_path, saved_input_tokens, saved_output_tokens,"
        " price_usd FROM usage_ledger"
    )
    assert row is not None
    assert dict(row) == {
        "reservation_id": hit.hit_id,
        "entry_kind": "usage",
        "outcome": "ok",
        "tenant": "acme",
        "route": None,
        "model": "gpt-4o",
        "input_tokens": 0,
        "output_tokens": 0,
        "reserved_tokens": 0,
        "serving_path": "cache",
        "saved_input_tokens": 40,
        "saved_output_tokens": 12,
        "price_usd": Decimal("0.0002"),
    }
    # Each hit is its own row with its own id.
    again = await store.response_cache.serve(
        key(), budget_seconds=5.0, similarity=0.9, price_usd=None
    )
    assert again is not None and again.hit_id != hit.hit_id
    assert await db.fetchval("SELECT count(*) FROM usage_ledger") == 2


async def test_a_miss_writes_nothing(store: Store, db: asyncpg.Connection) -> None:
    await put(store, key())
    assert (
        await store.response_cache.serve(
            key(exact=2), budget_seconds=5.0, similarity=0.9, price_usd=None
        )
        is None
    )
    assert await db.fetchval("SELECT count(*) FROM usage_ledger") == 0


async def test_another_tenant_or_route_never_reads_an_entry(
    store: Store, db: asyncpg.Connection
) -> None:
    await put(store, key("acme", route="support"))
    for other in (key("globex", route="support"), key("acme"), key("acme", route="sales")):
        assert (
            await store.response_cache.serve(
                other, budget_seconds=5.0, similarity=0.5, price_usd=None
            )
            is None
        )
    assert await store.response_cache.serve(
        key("acme", route="support"), budget_seconds=5.0, similarity=0.5, price_usd=None
    )
    assert await db.fetchval("SELECT count(*) FROM usage_ledger") == 1


async def test_an_expired_entry_is_not_served_and_the_sweeper_deletes_it(
    store: Store, db: asyncpg.Connection
) -> None:
    await put(store, key(exact=1))
    await put(store, key(exact=2))
    await db.execute(
        "UPDATE response_cache SET expires_at = clock_timestamp() - interval '1 second'"
        " WHERE exact_key = $1",
        (1).to_bytes(32, "big"),
    )
    assert (
        await store.response_cache.serve(
            key(exact=1), budget_seconds=5.0, similarity=0.9, price_usd=None
        )
        is None
    )
    assert await store.response_cache.sweep(100) == 1
    assert await db.fetchval("SELECT count(*) FROM response_cache") == 1
    assert await store.response_cache.serve(
        key(exact=2), budget_seconds=5.0, similarity=0.9, price_usd=None
    )


async def test_storing_the_same_key_again_refreshes_the_entry(
    store: Store, db: asyncpg.Connection
) -> None:
    await put(store, key(), ttl=10)
    await store.response_cache.store(
        key(), b'{"new":1}', input_tokens=3, output_tokens=4, ttl_seconds=600, max_entries=10
    )
    assert await db.fetchval("SELECT count(*) FROM response_cache") == 1
    hit = await store.response_cache.serve(
        key(), budget_seconds=5.0, similarity=0.9, price_usd=None
    )
    assert hit is not None and (hit.answer, hit.input_tokens, hit.output_tokens) == (
        b'{"new":1}',
        3,
        4,
    )


async def test_a_tenant_keeps_its_newest_entries_within_max_entries(
    store: Store, db: asyncpg.Connection
) -> None:
    removed = [await put(store, key(exact=i), max_entries=3) for i in range(1, 6)]
    assert removed == [0, 0, 0, 1, 1]
    kept = await db.fetch("SELECT exact_key FROM response_cache ORDER BY created_at")
    assert [int.from_bytes(r["exact_key"], "big") for r in kept] == [3, 4, 5]
    # Another tenant's entries neither count nor go.
    await put(store, key("globex", exact=9), max_entries=1)
    assert await db.fetchval("SELECT count(*) FROM response_cache WHERE tenant = 'acme'") == 3


async def test_the_bound_is_exact_under_concurrent_stores(
    store: Store, db: asyncpg.Connection
) -> None:
    await asyncio.gather(*(put(store, key(exact=i), max_entries=5) for i in range(1, 41)))
    assert await db.fetchval("SELECT count(*) FROM response_cache") == 5


def semantic(vector: list[float], exact: int, context: int = 7) -> CacheKey:
    return key(
        exact=exact,
        context_key=context.to_bytes(32, "big"),
        embedding=vector,
        signature=signature(vector),
    )


async def test_a_semantic_lookup_serves_the_nearest_of_its_context_above_the_similarity(
    store: Store, db: asyncpg.Connection
) -> None:
    rng = random.Random(5)
    stored = unit([rng.gauss(0.0, 1.0) for _ in range(256)])
    await store.response_cache.store(
        semantic(stored, exact=1),
        ANSWER,
        input_tokens=40,
        output_tokens=12,
        ttl_seconds=600,
        max_entries=10,
    )
    close, far = vector_at_cosine(stored, 0.95, rng), vector_at_cosine(stored, 0.80, rng)
    assert cosine(stored, close) == pytest.approx(0.95)
    hit = await store.response_cache.serve(
        semantic(close, exact=2), budget_seconds=5.0, similarity=0.92, price_usd=None
    )
    assert hit is not None and hit.similarity == pytest.approx(0.95, abs=1e-5)
    # Below the similarity, or another context (another system prompt): no hit.
    assert (
        await store.response_cache.serve(
            semantic(far, exact=3), budget_seconds=5.0, similarity=0.92, price_usd=None
        )
        is None
    )
    assert (
        await store.response_cache.serve(
            semantic(close, exact=4, context=8), budget_seconds=5.0, similarity=0.92, price_usd=None
        )
        is None
    )
    assert await db.fetchval("SELECT count(*) FROM usage_ledger") == 1


async def test_a_semantic_lookup_picks_the_most_similar(store: Store) -> None:
    rng = random.Random(9)
    query = unit([rng.gauss(0.0, 1.0) for _ in range(128)])
    for exact, cos in ((1, 0.93), (2, 0.99), (3, 0.96)):
        await store.response_cache.store(
            semantic(vector_at_cosine(query, cos, rng), exact=exact),
            str(exact).encode(),
            input_tokens=1,
            output_tokens=1,
            ttl_seconds=600,
            max_entries=10,
        )
    hit = await store.response_cache.serve(
        semantic(query, exact=9), budget_seconds=5.0, similarity=0.92, price_usd=None
    )
    assert hit is not None and hit.answer == b"2"


async def test_a_deleted_tenants_entries_go_with_it(store: Store, db: asyncpg.Connection) -> None:
    await put(store, key("acme"))
    await put(store, key("globex"))
    assert await db.fetchval("SELECT status FROM lq_delete_tenant('acme', NULL)") == "deleted"
    assert [r["tenant"] for r in await db.fetch("SELECT tenant FROM response_cache")] == ["globex"]
    # An answer that ends after its tenant went is not kept (a stream still running).
    assert await put(store, key("acme", exact=2)) == 0
    assert [r["tenant"] for r in await db.fetch("SELECT tenant FROM response_cache")] == ["globex"]


async def test_a_lookup_past_its_budget_books_nothing(store: Store, db: asyncpg.Connection) -> None:
    """The statement checks its budget before it writes the hit's row: a lookup
    held up past it (here by a lock on the table) answers a miss and books
    nothing, while the worker, waiting a grace longer, still hears the answer."""
    await put(store, key())
    async with db.transaction():
        await db.execute("LOCK TABLE response_cache IN ACCESS EXCLUSIVE MODE")
        lookup = asyncio.ensure_future(
            store.response_cache.serve(key(), budget_seconds=0.2, similarity=0.9, price_usd=None)
        )
        await asyncio.sleep(0.6)
    assert await lookup is None
    assert await db.fetchval("SELECT count(*) FROM usage_ledger") == 0
    # Within its budget, the same lookup is a hit.
    assert await store.response_cache.serve(
        key(), budget_seconds=5.0, similarity=0.9, price_usd=None
    )


async def test_the_billing_export_carries_a_hits_path_savings_and_price(
    store: Store, db: asyncpg.Connection
) -> None:
    await put(store, key())
    hit = await store.response_cache.serve(
        key(), budget_seconds=5.0, similarity=0.9, price_usd=Decimal("0.0002")
    )
    assert hit is not None
    (entry,) = await LedgerStore(db).export_page(0, 10, 10)
    line = entry.to_json()
    assert {k: line[k] for k in ("reservation_id", "serving_path", "input_tokens")} == {
        "reservation_id": str(hit.hit_id),
        "serving_path": "cache",
        "input_tokens": 0,
    }
    assert (line["saved_input_tokens"], line["saved_output_tokens"]) == (40, 12)
    assert line["price_usd"] == "0.0002"


async def test_a_priced_hit_is_charged_to_credits_and_cost_quotas_and_only_within_them(
    store: Store, db: asyncpg.Connection
) -> None:
    """A hit the operator prices is usage like any other: the prepaid balance and
    each cost quota it matches are charged its price, in the statement that
    books it; a blocking quota it would take past its cost, or a balance below
    the price, makes it a miss (admission then refuses as for any request)."""
    alerts = AlertService(store)
    assert await store.catalog.put_tenant_policy("acme", None, {"prepaid": True}) is not None
    await alerts.top_up("acme", Decimal("0.0005"), "invoice-1")
    quota, _ = await alerts.put_quota("acme", None, "spend", quota_spec(period="day", cost="1"))
    await put(store, key())
    price = Decimal("0.0002")
    served = [
        await store.response_cache.serve(key(), budget_seconds=5.0, similarity=0.9, price_usd=price)
        for _ in range(3)
    ]
    # 0.0005 pays for two hits of 0.0002; the third would take it below zero.
    assert [hit is not None for hit in served] == [True, True, False]
    account = await db.fetchrow(
        "SELECT balance, reserved FROM credit_accounts WHERE tenant = 'acme'"
    )
    assert (account["balance"], account["reserved"]) == (Decimal("0.0001"), 0)
    charges = await db.fetch(
        "SELECT reservation_id, amount FROM credit_ledger WHERE entry_kind = 'charge'"
    )
    assert sorted(c["reservation_id"] for c in charges) == sorted(h.hit_id for h in served if h)
    assert {c["amount"] for c in charges} == {-price}
    window = await db.fetchrow(
        "SELECT charged_cost, charged_tokens FROM quota_windows WHERE quota_id = $1",
        quota.quota_id,
    )
    assert (window["charged_cost"], window["charged_tokens"]) == (2 * price, 0)
    # A blocking cost quota with less room than the price: a miss, nothing charged.
    await alerts.top_up("acme", Decimal("1"), "invoice-2")
    await alerts.put_quota("acme", None, "spend", quota_spec(period="day", cost="0.0005"))
    miss = await store.response_cache.serve(
        key(), budget_seconds=5.0, similarity=0.9, price_usd=price
    )
    assert miss is None
    assert await db.fetchval("SELECT count(*) FROM usage_ledger WHERE serving_path = 'cache'") == 2
    # An unpriced hit of a prepaid tenant costs it nothing and is always served.
    free = await store.response_cache.serve(
        key(), budget_seconds=5.0, similarity=0.9, price_usd=None
    )
    assert free is not None
    assert await db.fetchval("SELECT count(*) FROM credit_ledger WHERE entry_kind = 'charge'") == 2


async def test_a_priced_hit_after_admission_counts_the_requests_own_hold_as_room(
    limiter: Limiter, db: asyncpg.Connection
) -> None:
    """serve_when_exhausted false: the lookup comes once the request is admitted,
    and what its reservation holds is room for the hit (which gives it back):
    a balance of 0.05 less a hold of 0.02025 still pays a hit of 0.04."""
    store = limiter.store
    alerts = AlertService(store)
    await LedgerStore(db).set_price(
        model="gpt-4o", input_usd_per_million=Decimal("2.50"),
        output_usd_per_million=Decimal("10"), set_by="test",
    )  # fmt: skip
    assert await store.catalog.put_tenant_policy("acme", None, {"prepaid": True}) is not None
    await alerts.top_up("acme", Decimal("0.05"), "invoice-1")
    await put(store, key())
    held = await limiter.admit(tenant="acme", model="gpt-4o", input_tokens=100, max_tokens=2000)
    hold = await db.fetchval(
        "SELECT credit_reserved FROM reservations WHERE reservation_id = $1", held.reservation_id
    )
    assert hold == Decimal("0.02025")  # 100 x 2.50 + 2,000 x 10.00 per million
    price = Decimal("0.04")
    alone = await store.response_cache.serve(
        key(), budget_seconds=5.0, similarity=0.9, price_usd=price
    )
    assert alone is None  # 0.02975 available without the hold
    hit = await store.response_cache.serve(
        key(),
        budget_seconds=5.0,
        similarity=0.9,
        price_usd=price,
        reservation_id=held.reservation_id,
    )
    assert hit is not None
    await held.release()  # the hit gives the hold back
    account = await db.fetchrow(
        "SELECT balance, reserved FROM credit_accounts WHERE tenant = 'acme'"
    )
    assert (account["balance"], account["reserved"]) == (Decimal("0.01"), 0)
