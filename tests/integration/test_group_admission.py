"""Group admission: a batch statement decides exactly what one-by-one application would.

Everything here runs against the real PostgreSQL. The property test drives two
databases built from the same template: one gets each random batch as a
single lq_admit / lq_finish call, its twin gets the same requests one call per
request, and decisions and balances must agree.

Refill is continuous, so the twins drift by what refills between their calls.
The policies use a refill of one unit per minute and integer costs: a drift
below one unit cannot change a decision (an integer balance plus a fraction
covers an integer cost exactly when the integer balance does), and balances
and retry hints are compared with a tolerance derived from the elapsed time.
"""

from __future__ import annotations

import asyncio
import hashlib
import random
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

import asyncpg
import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmquota.admission.limiter import Limiter
from llmquota.api.app import create_app
from llmquota.config import Settings
from llmquota.domain.policy import Policy
from llmquota.domain.records import AdmitDecision, AdmitRequest, FinishRequest, FinishResult
from llmquota.store.store import Store
from tests.support import APP_ROLE, dsn_as

TENANTS = ("t0", "t1", "t2")
UNKNOWN_TENANT = "ghost"
ROUTES = ("r0", "r1")
# One unit per minute: negligible refill over a test, see the module docstring.
SLOW_RATE = 1


@pytest.fixture
async def stores(app_dsn: str, twin_dsn: str) -> AsyncIterator[tuple[Store, Store]]:
    """(batched, sequential): one store on each twin."""
    batched = await Store.connect(app_dsn, min_size=1, max_size=2)
    sequential = await Store.connect(dsn_as(twin_dsn, APP_ROLE), min_size=1, max_size=2)
    yield batched, sequential
    await batched.close()
    await sequential.close()


# -- strategies ---------------------------------------------------------------


def policies() -> st.SearchStrategy[Policy]:
    """A layer policy with slow refill: any mix of tokens, requests and concurrency."""
    return st.builds(
        lambda token_burst, request_burst, max_in_flight: Policy(
            tokens_per_minute=SLOW_RATE if token_burst else None,
            token_burst=token_burst,
            requests_per_minute=SLOW_RATE if request_burst else None,
            request_burst=request_burst,
            max_in_flight=max_in_flight,
        ),
        st.none() | st.integers(1, 4_000) | st.integers(4_000, 40_000),
        st.none() | st.integers(1, 6),
        st.none() | st.integers(1, 6),
    )


@dataclass(frozen=True)
class Layout:
    """Which layers exist, with which policies (the same on both twins)."""

    global_policy: Policy | None
    tenant_policies: tuple[Policy, ...]
    route_policies: tuple[tuple[str, str, Policy], ...]


layouts = st.builds(
    Layout,
    st.none() | policies(),
    st.tuples(*(policies() for _ in TENANTS)),
    st.lists(
        st.tuples(st.sampled_from(TENANTS), st.sampled_from(ROUTES), policies()),
        max_size=3,
        unique_by=lambda t: (t[0], t[1]),
    ).map(tuple),
)


def admit_request(  # noqa: PLR0917 (hypothesis builds it from positional strategies)
    tenant: str, route: str | None, model: str, input_tokens: int, max_tokens: int, key: str | None
) -> AdmitRequest:
    request_hash = None
    if key is not None:
        # The same key with the same request replays; with another, conflicts.
        canonical = f"{route}|{model}|{input_tokens}|{max_tokens}"
        request_hash = hashlib.sha256(canonical.encode()).hexdigest()
    return AdmitRequest(
        tenant=tenant,
        route=route,
        model=model,
        input_tokens=input_tokens,
        max_tokens=max_tokens,
        input_estimated=False,
        lease_seconds=None,
        idempotency_key=key,
        request_hash=request_hash,
    )


def keyed_request(tenant: str, key: str, variant: int) -> AdmitRequest:
    """An idempotent request: the same (tenant, key, variant) is the same request."""
    return admit_request(tenant, ROUTES[variant], "m0", 100 + variant, 900, key)


admit_requests = st.builds(
    admit_request,
    st.sampled_from((*TENANTS, *TENANTS, UNKNOWN_TENANT)),
    st.sampled_from((None, *ROUTES)),
    st.sampled_from(("m0", "m1")),
    st.integers(0, 600),
    st.sampled_from((0, 1, 200, 800, 1_500, 7_000)),
    st.none(),
) | st.builds(
    keyed_request, st.sampled_from(TENANTS), st.sampled_from(("k0", "k1")), st.integers(0, 1)
)


@dataclass(frozen=True)
class FinishPick:
    """A settle or release aimed at the reservation of the n-th admitted request."""

    target: int
    action: str
    input_tokens: int
    output_tokens: int
    outcome: str


finish_picks = st.builds(
    FinishPick,
    st.integers(0, 200),
    st.sampled_from(("settle", "settle", "release")),
    st.integers(0, 2_000),
    st.integers(0, 4_000),
    st.sampled_from(("ok", "error")),
)


# -- running and comparing ----------------------------------------------------


async def reset(store: Store, db: asyncpg.Connection, layout: Layout) -> None:
    """Empty the twin and lay out the same layers, in the same order (same layer ids).

    The ledger is append-only (it refuses TRUNCATE): its rows are compared per
    example through the reservations, which are emptied here.
    """
    await db.execute("TRUNCATE reservations, limit_layers, tenants RESTART IDENTITY CASCADE")
    if layout.global_policy is not None:
        await store.put_policy("global", None, None, layout.global_policy)
    for tenant, policy in zip(TENANTS, layout.tenant_policies, strict=True):
        await store.put_policy("tenant", tenant, None, policy)
    for tenant, route, policy in layout.route_policies:
        await store.put_policy("route", tenant, route, policy)


def retry_tolerance_ms(elapsed_s: float) -> float:
    # retry = deficit / rate: it shifts by the time that passed between the twins' decisions.
    return elapsed_s * 1_000 + 1


def balance_tolerance(elapsed_s: float) -> float:
    return elapsed_s * SLOW_RATE / 60 + 1e-6


def comparable(decision: AdmitDecision, origin: dict[uuid.UUID, int], position: int) -> tuple:
    """A decision with its reservation id replaced by the position that first got it."""
    rid = None
    if decision.reservation_id is not None:
        rid = origin.setdefault(decision.reservation_id, position)
    t = decision.tenant
    return (
        decision.status,
        rid,
        decision.reserved_tokens,
        decision.lease_generation,
        decision.capacity,
        decision.remaining_tokens,
        decision.remaining_requests,
        decision.remaining_in_flight,
        (t.tokens_per_minute, t.token_burst, t.requests_per_minute, t.request_burst),
    )


def assert_same_decisions(
    batched: Sequence[AdmitDecision],
    sequential: Sequence[AdmitDecision],
    origins: tuple[dict[uuid.UUID, int], dict[uuid.UUID, int]],
    first_position: int,
    elapsed_s: float,
) -> None:
    assert len(batched) == len(sequential)
    for offset, (b, s) in enumerate(zip(batched, sequential, strict=True)):
        position = first_position + offset
        assert comparable(b, origins[0], position) == comparable(s, origins[1], position), (
            f"request {position}"
        )
        if b.retry_after_ms is None or s.retry_after_ms is None:
            assert b.retry_after_ms is s.retry_after_ms is None
        else:
            assert abs(b.retry_after_ms - s.retry_after_ms) <= retry_tolerance_ms(elapsed_s)
        # The refusal names the layer with the longest wait. Two layers whose waits
        # differ by less than the twins' refill drift are a tie that drift may break
        # either way; any other difference in the named limit is a real one.
        if (b.limit_kind, b.limit_scope) != (s.limit_kind, s.limit_scope):
            assert b.status == "rate_limited", f"request {position}"
            assert b.retry_after_ms is not None and s.retry_after_ms is not None
            assert abs(b.retry_after_ms - s.retry_after_ms) <= retry_tolerance_ms(elapsed_s)
        for x, y in ((b.tenant.tokens, s.tenant.tokens), (b.tenant.requests, s.tenant.requests)):
            assert (x is None) == (y is None)
            if x is not None and y is not None:
                assert abs(x - y) <= balance_tolerance(elapsed_s)


def comparable_finish(result: FinishResult) -> tuple:
    return (
        result.status,
        result.state,
        result.tenant,
        result.charged_tokens,
        result.refunded_tokens,
        result.late,
    )


async def final_state(db: asyncpg.Connection) -> tuple[dict[tuple, tuple], Counter[tuple]]:
    layers = {
        (r["scope"], r["tenant"], r["route"]): (r["tokens"], r["requests"], r["in_flight"])
        for r in await db.fetch("SELECT * FROM limit_layers")
    }
    reservations = Counter(
        (
            r["tenant"],
            r["route"],
            r["model"],
            tuple(r["layer_ids"]),
            r["reserved_tokens"],
            r["idempotency_key"],
            r["state"],
            r["charged_tokens"],
            r["refunded_tokens"],
        )
        for r in await db.fetch("SELECT * FROM reservations")
    )
    return layers, reservations


def assert_same_state(
    batched: tuple[dict[tuple, tuple], Counter[tuple]],
    sequential: tuple[dict[tuple, tuple], Counter[tuple]],
    elapsed_s: float,
) -> None:
    layers_b, reservations_b = batched
    layers_s, reservations_s = sequential
    assert layers_b.keys() == layers_s.keys()
    for key, (tokens_b, requests_b, in_flight_b) in layers_b.items():
        tokens_s, requests_s, in_flight_s = layers_s[key]
        assert in_flight_b == in_flight_s, key
        for x, y in ((tokens_b, tokens_s), (requests_b, requests_s)):
            assert (x is None) == (y is None), key
            if x is not None:
                assert abs(x - y) <= balance_tolerance(elapsed_s), key
    assert reservations_b == reservations_s


LEDGER_ROWS_OF_THIS_EXAMPLE = """
    SELECT count(*) FROM usage_ledger
     WHERE reservation_id IN (SELECT reservation_id FROM reservations)"""


@pytest.mark.slow
@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    layout=layouts,
    batches=st.lists(st.lists(admit_requests, min_size=1, max_size=30), min_size=1, max_size=3),
    finishes=st.lists(finish_picks, max_size=25),
)
async def test_a_batch_decides_exactly_what_one_by_one_application_decides(  # noqa: PLR0917
    stores: tuple[Store, Store],
    database_dsn: str,
    twin_dsn: str,
    layout: Layout,
    batches: list[list[AdmitRequest]],
    finishes: list[FinishPick],
) -> None:
    batched, sequential = stores
    db_b = await asyncpg.connect(database_dsn)
    db_s = await asyncpg.connect(twin_dsn)
    try:
        await reset(batched, db_b, layout)
        await reset(sequential, db_s, layout)
        started = time.monotonic()
        origins: tuple[dict[uuid.UUID, int], dict[uuid.UUID, int]] = ({}, {})
        admitted: list[tuple[uuid.UUID, uuid.UUID, str]] = []
        position = 0
        for batch in batches:
            got_b = await batched.admit(batch)
            got_s = [(await sequential.admit([r]))[0] for r in batch]
            assert_same_decisions(got_b, got_s, origins, position, time.monotonic() - started)
            position += len(batch)
            admitted += [
                (b.reservation_id, s.reservation_id, r.tenant)
                for r, b, s in zip(batch, got_b, got_s, strict=True)
                if b.status == "admitted" and b.reservation_id and s.reservation_id
            ]

        # Settle and release a random mix (repeats included) as one lq_finish batch.
        if admitted and finishes:
            finish_b, finish_s = [], []
            for pick in finishes:
                id_b, id_s, tenant = admitted[pick.target % len(admitted)]
                fields: dict[str, Any] = {"caller": tenant}
                if pick.action == "settle":
                    fields |= {
                        "input_tokens": pick.input_tokens,
                        "output_tokens": pick.output_tokens,
                        "outcome": pick.outcome,
                    }
                finish_b.append(FinishRequest(id_b, pick.action, **fields))  # type: ignore[arg-type]
                finish_s.append(FinishRequest(id_s, pick.action, **fields))  # type: ignore[arg-type]
            results_b = await batched.finish(finish_b)
            results_s = [(await sequential.finish([r]))[0] for r in finish_s]
            assert [comparable_finish(r) for r in results_b] == [
                comparable_finish(r) for r in results_s
            ]

        elapsed_s = time.monotonic() - started
        assert_same_state(await final_state(db_b), await final_state(db_s), elapsed_s)
        ledger_b = await db_b.fetchval(LEDGER_ROWS_OF_THIS_EXAMPLE)
        ledger_s = await db_s.fetchval(LEDGER_ROWS_OF_THIS_EXAMPLE)
        assert ledger_b == ledger_s
    finally:
        await db_b.close()
        await db_s.close()


# -- one hot tenant -------------------------------------------------------------


def hot_requests(count: int, tenant: str = "hot", cost: int = 100) -> list[AdmitRequest]:
    return [admit_request(tenant, None, "gpt-4o", cost // 2, cost - cost // 2, None)] * count


async def test_a_hot_tenant_batch_of_500_admits_exactly_what_fits(
    limiter: Limiter, db: asyncpg.Connection
) -> None:
    k = 37
    await limiter.store.put_policy(
        "tenant", "hot", None, Policy(tokens_per_minute=SLOW_RATE, token_burst=k * 100 + 99)
    )
    started = time.monotonic()
    decisions = await limiter.store.admit(hot_requests(500))

    statuses = [d.status for d in decisions]
    # Arrival order: the first k fit, every later one is refused.
    assert statuses == ["admitted"] * k + ["rate_limited"] * (500 - k)
    refused = decisions[k:]
    assert {(d.limit_kind, d.limit_scope) for d in refused} == {("tokens", "tenant")}
    # 99 tokens are left: one more request lacks 1 token, 60,000 ms at one token a minute.
    assert all(59_000 <= (d.retry_after_ms or 0) <= 60_000 for d in refused)
    assert [d.remaining_tokens for d in decisions[:3]] == [k * 100 - n for n in (1, 101, 201)]
    row = await db.fetchrow("SELECT tokens, in_flight FROM limit_layers WHERE tenant = 'hot'")
    assert abs(row["tokens"] - 99) <= balance_tolerance(time.monotonic() - started)
    assert row["in_flight"] == k
    assert await db.fetchval("SELECT count(*) FROM reservations WHERE state = 'active'") == k


async def test_in_one_batch_the_global_layer_binds_across_tenants(
    limiter: Limiter, db: asyncpg.Connection
) -> None:
    await limiter.store.put_policy(
        "global", None, None, Policy(requests_per_minute=SLOW_RATE, request_burst=25)
    )
    for tenant in ("a", "b"):
        await limiter.store.put_policy("tenant", tenant, None, Policy(max_in_flight=20))
    pairs = zip(hot_requests(250, "a"), hot_requests(250, "b"), strict=True)
    batch = [r for pair in pairs for r in pair]
    decisions = await limiter.store.admit(batch)

    admitted = [(r.tenant, d.status) for r, d in zip(batch, decisions, strict=True)]
    # a and b alternate, so the 25 requests the global layer allows are 13 a and 12 b.
    assert Counter(t for t, s in admitted if s == "admitted") == {"a": 13, "b": 12}
    assert [s for _, s in admitted[:25]] == ["admitted"] * 25
    assert {(d.limit_kind, d.limit_scope) for d in decisions[25:]} == {("requests", "global")}
    layers = {
        r["scope"]: r for r in await db.fetch("SELECT scope, requests, in_flight FROM limit_layers")
    }
    assert layers["global"]["in_flight"] == 25
    assert layers["global"]["requests"] < 1


async def test_concurrency_permits_in_one_batch(limiter: Limiter) -> None:
    await limiter.store.put_policy("tenant", "hot", None, Policy(max_in_flight=7))
    decisions = await limiter.store.admit(hot_requests(500))
    assert [d.status for d in decisions].count("admitted") == 7
    assert [d.status for d in decisions[:7]] == ["admitted"] * 7
    assert {(d.limit_kind, d.limit_scope) for d in decisions[7:]} == {("concurrency", "tenant")}


# -- through the Limiter: callers really concurrent, batches really shared ---------


async def test_concurrent_limiter_callers_share_batches_and_admit_exactly_k(
    limiter: Limiter, db: asyncpg.Connection
) -> None:
    k, callers, cost = 23, 300, 1_000
    await limiter.store.put_policy(
        "tenant", "acme", None, Policy(tokens_per_minute=SLOW_RATE, token_burst=k * cost)
    )
    await limiter.store.put_policy(
        "global", None, None, Policy(tokens_per_minute=SLOW_RATE, token_burst=10**9)
    )

    async def one() -> str:
        admission = await limiter.decide(
            limiter.prepare(tenant="acme", model="gpt-4o", input_tokens=400, max_tokens=600)
        )
        return admission.decision.status

    statuses = Counter(await asyncio.gather(*(one() for _ in range(callers))))
    assert statuses == {"admitted": k, "rate_limited": callers - k}
    row = await db.fetchrow("SELECT tokens, in_flight FROM limit_layers WHERE tenant = 'acme'")
    assert row["tokens"] < 1 and row["in_flight"] == k
    # 300 callers did not take 300 statements: they were coalesced.
    count, total = batch_histogram(limiter, "admit")
    assert total == callers and count < callers / 4


async def test_concurrent_settlements_and_releases_share_batches(
    limiter: Limiter, db: asyncpg.Connection
) -> None:
    await limiter.store.put_policy("tenant", "acme", None, Policy(tokens_per_minute=10**6))
    held = await asyncio.gather(
        *(
            limiter.admit(tenant="acme", model="gpt-4o", input_tokens=100, max_tokens=900)
            for _ in range(120)
        )
    )
    settled, released = held[:80], held[80:]
    results = await asyncio.gather(
        *(r.settle(input_tokens=100, output_tokens=400) for r in settled),
        *(r.release() for r in released),
    )
    assert all(s is not None and s.refunded_tokens == 500 for s in results[:80])
    counts = dict(await db.fetch("SELECT state, count(*) FROM reservations GROUP BY state"))
    assert counts == {"settled": 80, "released": 40}
    assert await db.fetchval("SELECT count(*) FROM usage_ledger") == 80
    assert await db.fetchval("SELECT in_flight FROM limit_layers WHERE tenant = 'acme'") == 0
    count, total = batch_histogram(limiter, "finish")
    assert total == 120 and count < 120 / 4


def batch_histogram(limiter: Limiter, operation: str) -> tuple[float, float]:
    """(statements, requests) the batch-size histogram counted for an operation."""
    samples = {
        s.name: s.value
        for metric in limiter.metrics.batch_size.collect()
        for s in metric.samples
        if s.labels.get("operation") == operation and s.name.endswith(("_count", "_sum"))
    }
    return samples["llmquota_batch_size_count"], samples["llmquota_batch_size_sum"]


async def test_a_caller_cancelled_mid_batch_has_its_admission_released(
    limiter: Limiter, db: asyncpg.Connection, database_dsn: str
) -> None:
    await limiter.store.put_policy("tenant", "acme", None, Policy(max_in_flight=5))
    blocker = await asyncpg.connect(database_dsn)
    try:
        # Hold the tenant row so the batch statement is stuck in flight.
        transaction = blocker.transaction()
        await transaction.start()
        await blocker.execute("SELECT 1 FROM limit_layers WHERE tenant = 'acme' FOR UPDATE")
        request = limiter.prepare(tenant="acme", model="gpt-4o", input_tokens=1, max_tokens=1)
        stays = asyncio.create_task(limiter.decide(request))
        leaves = asyncio.create_task(limiter.decide(request))
        await asyncio.sleep(0.2)
        leaves.cancel()
        await asyncio.sleep(0.05)
        await transaction.commit()
    finally:
        await blocker.close()
    assert (await stays).decision.status == "admitted"
    assert leaves.cancelled()
    # Nobody holds the cancelled caller's reservation id: it was given back.
    for _ in range(100):
        states = Counter(r["state"] for r in await db.fetch("SELECT state FROM reservations"))
        if states == {"active": 1, "released": 1}:
            break
        await asyncio.sleep(0.02)
    assert states == {"active": 1, "released": 1}
    assert await db.fetchval("SELECT in_flight FROM limit_layers WHERE tenant = 'acme'") == 1


async def test_without_batching_every_request_is_its_own_statement(
    app_dsn: str, db: asyncpg.Connection
) -> None:
    # One statement per request queues on the hot row: keep the decision
    # deadline (an outage behaviour, tested in tests/faults) out of the way.
    settings_off = Settings(
        batching=False,
        pool_max_size=20,
        decision_deadline_ms=60_000,
        _env_file=None,  # type: ignore[call-arg]
    )
    async with await Limiter.connect(app_dsn, settings_off) as limiter:
        await limiter.store.put_policy("tenant", "acme", None, Policy(max_in_flight=9))
        results = await asyncio.gather(
            *(
                limiter.decide(
                    limiter.prepare(tenant="acme", model="m", input_tokens=1, max_tokens=1)
                )
                for _ in range(40)
            )
        )
        assert Counter(r.decision.status for r in results) == {"admitted": 9, "rate_limited": 31}
        assert batch_histogram(limiter, "admit") == (40, 40)


# -- no deadlock -------------------------------------------------------------------


@pytest.mark.slow
async def test_concurrent_batches_over_overlapping_tenants_never_deadlock(
    app_dsn: str, db: asyncpg.Connection
) -> None:
    tenants = [f"t{i}" for i in range(12)]
    workers, rounds, batch_size = 12, 12, 24
    store = await Store.connect(app_dsn, min_size=workers, max_size=workers)
    try:
        await store.put_policy(
            "global", None, None, Policy(tokens_per_minute=SLOW_RATE, token_burst=10**9)
        )
        for tenant in tenants:
            await store.put_policy(
                "tenant",
                tenant,
                None,
                Policy(tokens_per_minute=SLOW_RATE, token_burst=10**7, max_in_flight=10**4),
            )
            await store.put_policy(
                "route", tenant, "r0", Policy(requests_per_minute=SLOW_RATE, request_burst=10**6)
            )

        mine: list[list[tuple[uuid.UUID, str]]] = [[] for _ in range(workers)]

        async def worker(n: int) -> None:
            rng = random.Random(n)
            for _ in range(rounds):
                batch = [
                    admit_request(rng.choice(tenants), rng.choice((None, "r0")), "m", 10, 90, None)
                    for _ in range(batch_size)
                ]
                for r, d in zip(batch, await store.admit(batch), strict=True):
                    assert d.status == "admitted"
                    mine[n].append((d.reservation_id, r.tenant))  # type: ignore[arg-type]
                # Finish a random mix of this worker's and other workers' reservations.
                pool = [x for m in mine for x in m]
                picks = rng.sample(pool, min(len(pool), batch_size))
                await store.finish(
                    [
                        FinishRequest(rid, "settle", None, 5, 20, "ok")
                        if rng.random() < 0.7
                        else FinishRequest(rid, "release")
                        for rid, _ in picks
                    ]
                )

        started = time.monotonic()
        # Any DeadlockDetectedError or lock timeout would surface here.
        await asyncio.gather(*(worker(n) for n in range(workers)))
        elapsed_s = time.monotonic() - started
    finally:
        await store.close()

    total = workers * rounds * batch_size
    assert await db.fetchval("SELECT count(*) FROM reservations") == total
    # Every layer's books balance: permits held = active reservations naming it, and
    # tokens = capacity - reserved by active ones - charged by settled ones.
    rows = await db.fetch(
        """SELECT l.layer_id, l.in_flight, l.tokens, l.token_burst, l.requests, l.request_burst,
                  count(r.*) FILTER (WHERE r.state = 'active') AS active,
                  count(r.*) FILTER (WHERE r.state = 'settled') AS settled,
                  coalesce(sum(r.reserved_tokens) FILTER (WHERE r.state = 'active'), 0)::bigint
                      AS held,
                  coalesce(sum(r.charged_tokens) FILTER (WHERE r.state = 'settled'), 0)::bigint
                      AS charged
             FROM limit_layers AS l
             LEFT JOIN reservations AS r ON l.layer_id = ANY (r.layer_ids)
            GROUP BY l.layer_id"""
    )
    tolerance = balance_tolerance(elapsed_s)
    for row in rows:
        assert row["in_flight"] == row["active"]
        if row["tokens"] is not None:
            expected = row["token_burst"] - row["held"] - row["charged"]
            assert abs(row["tokens"] - expected) <= tolerance
        if row["requests"] is not None:
            expected = row["request_burst"] - row["active"] - row["settled"]
            assert abs(row["requests"] - expected) <= tolerance


# -- over HTTP: one server worker's concurrent requests share batches ---------------------


async def test_concurrent_http_admits_share_batches_and_admit_exactly_k(
    app_dsn: str, db: asyncpg.Connection
) -> None:
    admin_key = "lq_test_admin_key_for_batching"
    settings = Settings(
        admin_key=admin_key,
        pool_max_size=10,
        decision_deadline_ms=60_000,
        _env_file=None,  # type: ignore[call-arg]
    )
    app = create_app(settings, dsn=app_dsn)
    headers = {"Authorization": f"Bearer {admin_key}"}
    k, requests = 17, 120
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://llmquota") as client:
            policy = {"tokens_per_minute": SLOW_RATE, "token_burst": k * 1_000}
            response = await client.put("/v1/tenants/acme/policy", json=policy, headers=headers)
            assert response.status_code == 200, response.text
            body = {"tenant": "acme", "model": "gpt-4o", "input_tokens": 400, "max_tokens": 600}
            responses = await asyncio.gather(
                *(client.post("/v1/admit", json=body, headers=headers) for _ in range(requests))
            )
            metrics = (await client.get("/metrics")).text

    assert Counter(r.status_code for r in responses) == {201: k, 429: requests - k}
    assert await db.fetchval("SELECT count(*) FROM reservations") == k
    (statements,) = [
        float(line.rsplit(" ", 1)[1])
        for line in metrics.splitlines()
        if line.startswith('llmquota_batch_size_count{operation="admit"}')
    ]
    assert statements < requests / 4


async def test_admission_without_flush_decides_alike_and_leaves_the_session_synchronous(
    app_dsn: str, db: asyncpg.Connection
) -> None:
    store = await Store.connect(app_dsn, min_size=1, max_size=1, admission_synchronous_commit=False)
    try:
        await store.put_policy("tenant", "hot", None, Policy(max_in_flight=3))
        decisions = await store.admit(hot_requests(5))
        # The one pooled connection ran that statement; its own setting is untouched.
        async with store._pool.acquire() as connection:
            setting = await connection.fetchval("SHOW synchronous_commit")
    finally:
        await store.close()
    assert [d.status for d in decisions] == ["admitted"] * 3 + ["rate_limited"] * 2
    assert setting == "on"
    assert await db.fetchval("SELECT count(*) FROM reservations") == 3
