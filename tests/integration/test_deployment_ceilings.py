"""Ceilings scoped to one deployment, and the deployment chosen in the admission statement.

Two deployments of one model ("main" and "azure"), each with a provider
ceiling of its own (a ceiling's `upstream`). Through the library: a request
naming both goes to the first whose ceiling has room, so that traffic beyond
the first ceiling spills to the second, exactly, whatever the concurrency; the
reservation journals the deployment and the serving path; `least_utilized`
goes where the most room is left; a request naming no deployment is bounded
by every ceiling of its model, scoped or not; a ceiling without `upstream`
bounds every deployment. Token rates are one per minute: refill during a test
is far below one request.
"""

from __future__ import annotations

import asyncio
from collections import Counter

import asyncpg
import pytest

from llmquota.admission.limiter import Limiter
from llmquota.domain.errors import InvalidRequest
from llmquota.domain.plans import Ceiling
from llmquota.domain.records import AdmitDecision, AdmitRequest, Deployment

SLOW = 1
MODEL = "gpt-4o"
COST = 100  # input 20 + max_tokens 80: what each request reserves
BOTH = ["main", "azure"]


async def lay_out(limiter: Limiter, main: int, azure: int, shared: int | None = None) -> None:
    """acme unlimited; ceilings of `main` and `azure` requests each (None: none)."""
    catalog = limiter.store.catalog
    assert await catalog.put_tenant_policy("acme", None, {"unlimited": True}) is not None
    for name, fits in (("main", main), ("azure", azure)):
        ceiling = Ceiling(
            models=[MODEL], tokens_per_minute=SLOW, token_burst=fits * COST, upstream=name
        )
        await catalog.put_ceiling(f"{name}-gpt4o", ceiling)
    if shared is not None:
        ceiling = Ceiling(models=[MODEL], tokens_per_minute=SLOW, token_burst=shared * COST)
        await catalog.put_ceiling("account-gpt4o", ceiling)
    await limiter.refresh_policies()


def prepared(limiter: Limiter, upstreams: list[str] | None, **extra: object) -> AdmitRequest:
    """acme's request of COST tokens, naming `upstreams`."""
    return limiter.prepare(
        tenant="acme",
        model=MODEL,
        input_tokens=20,
        max_tokens=80,
        upstreams=upstreams,
        **extra,  # type: ignore[arg-type]
    )


async def decide(limiter: Limiter, upstreams: list[str] | None, **extra: object) -> AdmitDecision:
    return (await limiter.decide(prepared(limiter, upstreams, **extra))).decision


async def journaled(db: asyncpg.Connection) -> Counter[tuple[str | None, str | None]]:
    rows = await db.fetch("SELECT upstream, serving_path FROM reservations")
    return Counter((r["upstream"], r["serving_path"]) for r in rows)


async def test_traffic_beyond_the_first_ceiling_spills_to_the_second_exactly_at_200_way(
    limiter: Limiter, db: asyncpg.Connection
) -> None:
    await lay_out(limiter, main=70, azure=50)
    decisions = await asyncio.gather(*(decide(limiter, BOTH) for _ in range(200)))
    served = Counter((d.status, d.upstream) for d in decisions)
    assert served == {
        ("admitted", "main"): 70,
        ("admitted", "azure"): 50,
        ("rate_limited", None): 80,
    }
    # Each refusal names a ceiling the request lacked room in; nothing was degraded.
    assert {d.ceiling for d in decisions if d.status == "rate_limited"} <= {
        "main-gpt4o",
        "azure-gpt4o",
    }
    assert not any(d.degraded for d in decisions)
    # Journaled: the deployment, and how it was served (NULL: primary).
    assert await journaled(db) == {("main", None): 70, ("azure", "second_deployment"): 50}
    # Each ceiling holds exactly what its deployment's reservations took.
    rows = await db.fetch(
        "SELECT ceiling, tokens FROM limit_layers WHERE scope = 'ceiling' ORDER BY ceiling"
    )
    assert [(r["ceiling"], round(r["tokens"])) for r in rows] == [
        ("azure-gpt4o", 0),
        ("main-gpt4o", 0),
    ]


async def test_settling_gives_back_to_the_chosen_deployments_ceiling_only(
    limiter: Limiter, db: asyncpg.Connection
) -> None:
    await lay_out(limiter, main=1, azure=3)
    first, second = await decide(limiter, BOTH), await decide(limiter, BOTH)
    assert (first.upstream, second.upstream) == ("main", "azure")
    reservation = await limiter.admit(
        tenant="acme", model=MODEL, input_tokens=20, max_tokens=80, upstreams=BOTH
    )
    assert reservation.decision.upstream == "azure"
    await reservation.settle(input_tokens=20, output_tokens=30)  # 50 of the 100 back
    rows = await db.fetch(
        "SELECT ceiling, tokens FROM limit_layers WHERE scope = 'ceiling' ORDER BY ceiling"
    )
    assert [(r["ceiling"], round(r["tokens"])) for r in rows] == [
        ("azure-gpt4o", 3 * COST - 2 * COST + 50),
        ("main-gpt4o", 0),
    ]


async def test_least_utilized_goes_where_the_most_room_is_left(
    limiter: Limiter, db: asyncpg.Connection
) -> None:
    await lay_out(limiter, main=10, azure=10)
    # azure starts 6 requests down: least_utilized sends the next 6 to main
    # (each leaves main with more room than azure has), then alternates.
    for _ in range(6):
        assert (await decide(limiter, ["azure"])).upstream == "azure"
    chosen = [
        (await decide(limiter, BOTH, upstream_rule="least_utilized")).upstream for _ in range(10)
    ]
    assert chosen[:6] == ["main"] * 6
    assert Counter(chosen) == {"main": 8, "azure": 2}
    # A balance, not a spill: no request journals second_deployment.
    assert await journaled(db) == {("azure", None): 8, ("main", None): 8}


async def test_least_utilized_reads_the_running_balances_of_its_batch(limiter: Limiter) -> None:
    """One statement for 8 requests (the store's batch, no coalescer): each choice
    sees what the requests before it in the batch took."""
    await lay_out(limiter, main=10, azure=10)
    request = prepared(limiter, BOTH, upstream_rule="least_utilized")
    batch = await limiter.store.admit([request] * 8)
    assert [d.upstream for d in batch] == ["main", "azure"] * 4


async def test_an_admission_on_a_later_deployment_reports_no_refusal(limiter: Limiter) -> None:
    """main's ceiling can never hold the request (too large there); azure's can,
    once: the admission says nothing of main's refusal, and the 429 after it
    is azure's own (not main's capacity)."""
    await lay_out(limiter, main=1, azure=1)
    small = Ceiling(models=[MODEL], tokens_per_minute=SLOW, token_burst=50, upstream="main")
    await limiter.store.catalog.put_ceiling("main-gpt4o", small)
    admitted = await decide(limiter, BOTH)
    assert (admitted.status, admitted.upstream, admitted.degraded) == ("admitted", "azure", False)
    assert (admitted.limit_kind, admitted.ceiling, admitted.capacity, admitted.reason) == (
        None,
        None,
        None,
        None,
    )
    refused = await decide(limiter, BOTH)
    assert (refused.status, refused.ceiling, refused.capacity, refused.limit_kind) == (
        "rate_limited",
        "azure-gpt4o",
        None,
        "tokens",
    )


async def test_a_request_naming_no_deployment_is_bounded_by_every_ceiling_of_its_model(
    limiter: Limiter,
) -> None:
    await lay_out(limiter, main=1, azure=5)
    assert (await decide(limiter, ["main"])).upstream == "main"  # main is now full
    unnamed = await decide(limiter, None)
    assert (unnamed.status, unnamed.ceiling, unnamed.upstream) == (
        "rate_limited",
        "main-gpt4o",
        None,
    )
    # Named, the same request goes to azure.
    assert (await decide(limiter, BOTH)).upstream == "azure"


async def test_a_ceiling_without_upstream_bounds_every_deployment(limiter: Limiter) -> None:
    await lay_out(limiter, main=5, azure=5, shared=3)
    decisions = [await decide(limiter, BOTH) for _ in range(5)]
    assert [d.upstream for d in decisions] == ["main", "main", "main", None, None]
    assert {d.ceiling for d in decisions[3:]} == {"account-gpt4o"}


async def test_a_fallback_model_is_tried_on_its_own_deployments_after_the_requested_ones(
    limiter: Limiter, db: asyncpg.Connection
) -> None:
    await lay_out(limiter, main=1, azure=1)
    mini = Ceiling(models=["gpt-4o-mini"], tokens_per_minute=SLOW, token_burst=5 * COST)
    await limiter.store.catalog.put_ceiling(
        "mini-azure", mini.model_copy(update={"upstream": "azure"})
    )
    await limiter.refresh_policies()
    request = limiter.prepare(
        tenant="acme", model=MODEL, input_tokens=20, max_tokens=80, fallback_models=["gpt-4o-mini"]
    )
    # The proxy names the fallback's deployments too (the library takes the requested model's).
    named = request._replace(
        deployments=(
            Deployment(MODEL, "main"),
            Deployment(MODEL, "azure"),
            Deployment("gpt-4o-mini", "azure"),
        )
    )
    chosen = [(await limiter.decide(named)).decision for _ in range(3)]
    assert [(d.model, d.upstream, d.degraded) for d in chosen] == [
        (MODEL, "main", False),
        (MODEL, "azure", False),
        ("gpt-4o-mini", "azure", True),
    ]
    assert await journaled(db) == {
        ("main", None): 1,
        ("azure", "second_deployment"): 1,
        ("azure", "fallback_model"): 1,
    }


@pytest.mark.parametrize(
    ("upstreams", "rule", "message"),
    [
        (["main", "main"], None, "each name once"),
        ([], None, "1 to 16 names"),
        (["bad\nname"], None, "printable characters"),
        (["x" * 129], None, "printable characters"),
        ("main", None, "must be a list"),
        (BOTH, "fastest", "upstream_rule must be one of order, least_utilized"),
    ],
)
async def test_bad_upstreams_are_refused_naming_the_field(
    limiter: Limiter, db: asyncpg.Connection, upstreams: object, rule: object, message: str
) -> None:
    await lay_out(limiter, main=1, azure=1)
    with pytest.raises(InvalidRequest, match=message):
        await decide(limiter, upstreams, upstream_rule=rule)  # type: ignore[arg-type]
    assert await db.fetchval("SELECT count(*) FROM reservations") == 0
