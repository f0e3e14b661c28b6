"""Group admission with plans, provider ceilings, priorities and fallbacks:
a batch still decides exactly what one-by-one application decides.

The property test of test_group_admission.py, extended: the twins also get
plans (a priority and a default fallback list), tenants on them, routes with
fallback lists, and provider ceilings matched by names and globs, with
shedding ladders; requests carry priorities (lowered, or raised by an admin),
explicit fallbacks with their own input counts and output reserves (as a
learned estimate makes them: each model its own, at most max_tokens), and
degrade on or off. Every
field of the decision (model admitted, degraded, reason, ceiling,
utilization, priority, plan, alternatives) must agree, and so must the final
balances, the journal and the ledger.

Refill drift is handled as there: one unit a minute, integer costs, and
ladder floors ((1 - above) x burst) that are whole numbers, or a rounding
error below one, so a drift under one token cannot move a decision.
"""

from __future__ import annotations

import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

import asyncpg
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmquota.domain.plans import Ceiling, Plan, ShedStep
from llmquota.domain.policy import Policy
from llmquota.domain.records import AdmitDecision, AdmitRequest, FallbackCandidate, FinishRequest
from llmquota.domain.vocabulary import PRIORITIES
from llmquota.store.store import Store
from tests.integration.test_group_admission import (
    LEDGER_ROWS_OF_THIS_EXAMPLE,
    ROUTES,
    SLOW_RATE,
    TENANTS,
    UNKNOWN_TENANT,
    FinishPick,
    assert_same_decisions,
    assert_same_state,
    balance_tolerance,
    comparable_finish,
    finish_picks,
    policies,
    retry_tolerance_ms,
)
from tests.support import APP_ROLE, dsn_as

MODELS = ("m0", "m1", "m2", "x0")
PLANS = ("pa", "pb")


@pytest.fixture
async def stores(app_dsn: str, twin_dsn: str) -> AsyncIterator[tuple[Store, Store]]:
    """(batched, sequential): one store on each twin."""
    batched = await Store.connect(app_dsn, min_size=1, max_size=2)
    sequential = await Store.connect(dsn_as(twin_dsn, APP_ROLE), min_size=1, max_size=2)
    yield batched, sequential
    await batched.close()
    await sequential.close()


# -- strategies ---------------------------------------------------------------

model_lists = st.lists(st.sampled_from(MODELS), max_size=3, unique=True)
priorities = st.sampled_from(PRIORITIES)

shed_steps = st.builds(
    lambda above, admit, small: ShedStep(above=above, admit=admit, small_request_tokens=small),
    st.sampled_from((0.25, 0.5, 0.75, 0.9)),
    st.lists(priorities, min_size=1, max_size=3, unique=True),
    st.none() | st.sampled_from((200, 900, 1_600)),
)


def ladder(steps: list[ShedStep]) -> list[ShedStep]:
    """Steps in increasing order of `above`, one per value."""
    by_above = {float(s.above): s for s in steps}
    return [by_above[a] for a in sorted(by_above)]


ceilings = st.builds(
    lambda models, burst, steps: Ceiling(
        models=models, tokens_per_minute=SLOW_RATE, token_burst=burst, shed=ladder(steps)
    ),
    st.lists(st.sampled_from(("m0", "m1", "m*", "m2", "x*")), min_size=1, max_size=2, unique=True),
    st.integers(5, 200).map(lambda n: n * 100),
    st.lists(shed_steps, max_size=3),
)

# Layer policies are often absent, so that the ceilings, not the tenants, bind.
loose_policies = st.just(Policy()) | st.just(Policy()) | policies()

plans = st.builds(
    lambda policy, priority, fallbacks: Plan(
        priority=priority, fallback_models=fallbacks, **policy.model_dump(exclude_none=True)
    ),
    loose_policies,
    priorities,
    model_lists,
)


@dataclass(frozen=True)
class TenantSpec:
    """A tenant: on a plan or not, its own fields, its own default fallbacks."""

    plan: str | None
    own: Policy
    fallbacks: tuple[str, ...]


@dataclass(frozen=True)
class Layout:
    global_policy: Policy | None
    plans: tuple[Plan, ...]
    tenants: tuple[TenantSpec, ...]
    routes: tuple[tuple[str, str, Policy, tuple[str, ...]], ...]
    ceilings: tuple[Ceiling, ...]


tenant_specs = st.builds(
    TenantSpec,
    st.none() | st.sampled_from(PLANS),
    loose_policies,
    model_lists.map(tuple),
)

layouts = st.builds(
    Layout,
    st.none() | st.none() | policies(),
    st.tuples(plans, plans),
    st.tuples(*(tenant_specs for _ in TENANTS)),
    st.lists(
        st.tuples(
            st.sampled_from(TENANTS), st.sampled_from(ROUTES), policies(), model_lists.map(tuple)
        ),
        max_size=2,
        unique_by=lambda t: (t[0], t[1]),
    ).map(tuple),
    st.lists(ceilings, min_size=1, max_size=3).map(tuple),
)


def admit_request(  # noqa: PLR0917 (hypothesis builds it from positional strategies)
    tenant: str,
    route: str | None,
    model: str,
    input_tokens: int,
    max_tokens: int,
    priority: Any,
    priority_any: bool,
    degrade: bool | None,
    fallbacks: list[tuple[str, int, int | None]],
    output_reserve: int | None,
) -> AdmitRequest:
    return AdmitRequest(
        tenant=tenant,
        route=route,
        model=model,
        input_tokens=input_tokens,
        max_tokens=max_tokens,
        input_estimated=False,
        lease_seconds=None,
        idempotency_key=None,
        request_hash=None,
        priority=priority,
        priority_any=priority_any,
        degrade=degrade,
        fallbacks=tuple(
            FallbackCandidate(m, n, None if out is None else min(out, max_tokens))
            for m, n, out in fallbacks
            if m != model
        ),
        output_reserve=None if output_reserve is None else min(output_reserve, max_tokens),
    )


admit_requests = st.builds(
    admit_request,
    st.sampled_from((*TENANTS, *TENANTS, UNKNOWN_TENANT)),
    st.sampled_from((None, *ROUTES)),
    st.sampled_from(MODELS),
    st.integers(0, 600),
    st.sampled_from((0, 1, 200, 800, 1_500, 7_000)),
    st.none() | priorities,
    st.booleans(),
    st.none() | st.booleans(),
    st.lists(
        st.tuples(st.sampled_from(MODELS), st.integers(0, 600), st.none() | st.integers(0, 7_000)),
        max_size=2,
        unique_by=lambda t: t[0],
    ),
    st.none() | st.integers(0, 7_000),
)


# -- running and comparing ----------------------------------------------------


async def reset(store: Store, db: asyncpg.Connection, layout: Layout) -> None:
    """Empty the twin and lay out the same layers in the same order (same layer ids)."""
    await db.execute("TRUNCATE reservations, limit_layers, tenants, plans RESTART IDENTITY CASCADE")
    if layout.global_policy is not None:
        await store.put_policy("global", None, None, layout.global_policy)
    for name, plan in zip(PLANS, layout.plans, strict=True):
        await store.catalog.put_plan(name, plan)
    for tenant, spec in zip(TENANTS, layout.tenants, strict=True):
        own = spec.own.model_dump(include=spec.own.model_fields_set, exclude_none=True)
        if spec.fallbacks:
            own["fallback_models"] = list(spec.fallbacks)
        assert await store.catalog.put_tenant_policy(tenant, spec.plan, own) is not None
    for tenant, route, policy, fallbacks in layout.routes:
        await store.put_policy("route", tenant, route, policy, fallback_models=fallbacks)
    for n, ceiling in enumerate(layout.ceilings):
        await store.catalog.put_ceiling(f"c{n}", ceiling)


async def final_state(db: asyncpg.Connection) -> tuple[dict[tuple, tuple], Counter[tuple]]:
    """Every layer's balances (ceilings by name too) and every reservation."""
    layers = {
        (r["scope"], r["tenant"], r["route"], r["ceiling"]): (
            r["tokens"],
            r["requests"],
            r["in_flight"],
        )
        for r in await db.fetch("SELECT * FROM limit_layers")
    }
    reservations = Counter(
        (
            r["tenant"],
            r["route"],
            r["model"],
            r["input_tokens"],
            tuple(r["layer_ids"]),
            r["reserved_tokens"],
            r["state"],
            r["charged_tokens"],
            r["refunded_tokens"],
        )
        for r in await db.fetch("SELECT * FROM reservations")
    )
    return layers, reservations


def plans_comparable(d: AdmitDecision) -> tuple[Any, ...]:
    """What the plans and ceilings added to a decision, refusal details apart."""
    return (
        d.model,
        d.input_tokens,
        d.degraded,
        d.priority,
        d.plan,
        d.alt_max_tokens,
        d.alt_models,
    )


def assert_same_plan_fields(
    batched: Sequence[AdmitDecision],
    sequential: Sequence[AdmitDecision],
    first_position: int,
    elapsed_s: float,
) -> None:
    for offset, (b, s) in enumerate(zip(batched, sequential, strict=True)):
        position = first_position + offset
        assert plans_comparable(b) == plans_comparable(s), f"request {position}"
        if (b.limit_kind, b.limit_scope, b.reason, b.ceiling) != (
            s.limit_kind,
            s.limit_scope,
            s.reason,
            s.ceiling,
        ):
            # Two layers whose waits differ by less than the drift: a tie either may name.
            assert b.retry_after_ms is not None and s.retry_after_ms is not None
            assert abs(b.retry_after_ms - s.retry_after_ms) <= retry_tolerance_ms(elapsed_s)
            continue
        if b.utilization is None or s.utilization is None:
            assert b.utilization is s.utilization is None, f"request {position}"
        else:
            # utilization = 1 - (balance - cost) / burst: it moves by drift / burst (burst >= 100)
            assert abs(b.utilization - s.utilization) <= balance_tolerance(elapsed_s) / 100


async def finish_both(
    batched: Store,
    sequential: Store,
    admitted: list[tuple[uuid.UUID, uuid.UUID, str]],
    finishes: list[FinishPick],
) -> None:
    """Settle and release a random mix (repeats included) as one lq_finish batch."""
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
    assert [comparable_finish(r) for r in results_b] == [comparable_finish(r) for r in results_s]


@pytest.mark.slow
@settings(
    max_examples=50,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    layout=layouts,
    batches=st.lists(st.lists(admit_requests, min_size=1, max_size=30), min_size=1, max_size=3),
    finishes=st.lists(finish_picks, max_size=25),
)
async def test_with_plans_ceilings_and_fallbacks_a_batch_decides_as_one_by_one(  # noqa: PLR0917
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
            elapsed_s = time.monotonic() - started
            assert_same_decisions(got_b, got_s, origins, position, elapsed_s)
            assert_same_plan_fields(got_b, got_s, position, elapsed_s)
            position += len(batch)
            admitted += [
                (b.reservation_id, s.reservation_id, r.tenant)
                for r, b, s in zip(batch, got_b, got_s, strict=True)
                if b.status == "admitted" and b.reservation_id and s.reservation_id
            ]
        if admitted and finishes:
            await finish_both(batched, sequential, admitted, finishes)

        elapsed_s = time.monotonic() - started
        assert_same_state(await final_state(db_b), await final_state(db_s), elapsed_s)
        ledger = """SELECT model, count(*) FROM usage_ledger
                     WHERE reservation_id IN (SELECT reservation_id FROM reservations)
                     GROUP BY model ORDER BY model"""
        assert await db_b.fetch(ledger) == await db_s.fetch(ledger)
        ledger_b = await db_b.fetchval(LEDGER_ROWS_OF_THIS_EXAMPLE)
        assert ledger_b == await db_s.fetchval(LEDGER_ROWS_OF_THIS_EXAMPLE)
    finally:
        await db_b.close()
        await db_s.close()
