"""Degradation: a fallback is admitted exactly when the requested model is refused.

Two provider ceilings, one per model. Concurrent callers through the Limiter
(batching on) ask for the scarce model with a fallback list: exactly as many
as the scarce ceiling holds get it, every other one gets the fallback and
says why the requested model was refused. The reservation, its settlement
and its ledger row carry the model admitted, so fallback usage is billed.
"""

from __future__ import annotations

import asyncio
from collections import Counter

import asyncpg

from llmquota.admission.limiter import Limiter
from llmquota.domain.plans import Ceiling, Plan, ShedStep
from llmquota.domain.records import AdmitDecision

SLOW_RATE = 1
SCARCE = "gpt-4o"
CHEAP = "gpt-4o-mini"
UNCAPPED = "gpt-4.1"  # no ceiling names it
SCARCE_BURST = 10_000
CHEAP_BURST = 1_000_000


async def lay_out(limiter: Limiter) -> None:
    catalog = limiter.store.catalog
    await catalog.put_ceiling(
        "scarce",
        Ceiling(
            models=[SCARCE],
            tokens_per_minute=SLOW_RATE,
            token_burst=SCARCE_BURST,
            # low may take it down to half; critical to the last token
            shed=[ShedStep(above=0.5, admit=["high", "critical"])],
        ),
    )
    await catalog.put_ceiling(
        "cheap", Ceiling(models=[CHEAP], tokens_per_minute=SLOW_RATE, token_burst=CHEAP_BURST)
    )
    # free's tenants degrade by the plan's default list; enterprise's name theirs.
    await catalog.put_plan("free", Plan(priority="low", fallback_models=[CHEAP]))
    await catalog.put_plan("enterprise", Plan(priority="critical"))
    assert await catalog.put_tenant_policy("acme", "free", {}) is not None
    assert await catalog.put_tenant_policy("vip", "enterprise", {}) is not None
    # a tenant whose own limit binds whatever the model
    own = {"tokens_per_minute": SLOW_RATE, "token_burst": 1_500}
    assert await catalog.put_tenant_policy("capped", "free", own) is not None


async def decide(
    limiter: Limiter, tenant: str, model: str = SCARCE, **extra: object
) -> AdmitDecision:
    request = limiter.prepare(
        tenant=tenant,
        model=model,
        input_tokens=200,
        max_tokens=800,
        **extra,  # type: ignore[arg-type]
    )
    return (await limiter.decide(request)).decision


def kinds(decisions: list[AdmitDecision]) -> Counter[tuple[str, str | None, bool]]:
    return Counter((d.status, d.model, d.degraded) for d in decisions)


async def test_the_fallback_is_admitted_exactly_when_the_requested_model_is_refused(
    limiter: Limiter, db: asyncpg.Connection
) -> None:
    await lay_out(limiter)

    # 60 low requests: the ladder lets low take the scarce ceiling to 5,000,
    # so exactly 5 get it; the 55 others are shed there and degrade.
    low = await asyncio.gather(*(decide(limiter, "acme") for _ in range(60)))
    assert kinds(low) == {("admitted", SCARCE, False): 5, ("admitted", CHEAP, True): 55}
    for d in low:
        assert d.priority == "low" and d.plan == "free"
        if d.degraded:
            assert (d.limit_kind, d.limit_scope, d.reason, d.ceiling) == (
                "tokens",
                "ceiling",
                "shed",
                "scarce",
            )
        else:
            assert d.reason is None and d.ceiling is None

    # 10 critical requests with an explicit list: 5,000 left, so 5 fit and 5
    # degrade because the ceiling is empty (capacity, not shed).
    vip = await asyncio.gather(
        *(decide(limiter, "vip", fallback_models=[CHEAP]) for _ in range(10))
    )
    assert kinds(vip) == {("admitted", SCARCE, False): 5, ("admitted", CHEAP, True): 5}
    assert {d.reason for d in vip if d.degraded} == {"capacity"}

    # Not degrading: refused, told which fallback would fit now, nothing held.
    refused = await decide(limiter, "vip", fallback_models=[CHEAP], degrade=False)
    assert (refused.status, refused.model, refused.degraded) == ("rate_limited", SCARCE, False)
    assert refused.alt_models == (CHEAP,) and refused.reservation_id is None

    # The tenant's own limit refuses the fallback too: no degradation past it.
    capped = [
        await decide(limiter, "capped", model=UNCAPPED, fallback_models=[CHEAP]) for _ in range(2)
    ]
    assert kinds(capped) == {("admitted", UNCAPPED, False): 1, ("rate_limited", UNCAPPED, False): 1}
    assert (capped[1].limit_scope, capped[1].reason) == ("tenant", "capacity")

    admitted = [d for d in [*low, *vip, *capped] if d.status == "admitted"]
    await check_journal_and_ledger(limiter, db, admitted)


async def check_journal_and_ledger(
    limiter: Limiter, db: asyncpg.Connection, admitted: list[AdmitDecision]
) -> None:
    by_id = {d.reservation_id: d for d in admitted}
    rows = await db.fetch("SELECT reservation_id, model, input_tokens, layer_ids FROM reservations")
    assert {r["reservation_id"]: r["model"] for r in rows} == {
        rid: d.model for rid, d in by_id.items()
    }
    ceilings = dict(
        await db.fetch("SELECT layer_id, ceiling FROM limit_layers WHERE ceiling IS NOT NULL")
    )
    for r in rows:
        # each reservation passed the ceiling of the model it got, and only that one
        passed = {ceilings[x] for x in r["layer_ids"] if x in ceilings}
        assert passed == {SCARCE: {"scarce"}, CHEAP: {"cheap"}, UNCAPPED: set()}[r["model"]]

    await asyncio.gather(
        *(limiter.settle(rid, input_tokens=200, output_tokens=300) for rid in by_id)
    )
    ledger = await db.fetch(
        "SELECT reservation_id, model, input_tokens, output_tokens FROM usage_ledger"
    )
    assert {r["reservation_id"]: r["model"] for r in ledger} == {
        rid: d.model for rid, d in by_id.items()
    }
    assert Counter(r["model"] for r in ledger) == {SCARCE: 10, CHEAP: 60, UNCAPPED: 1}
    states = Counter(r["state"] for r in await db.fetch("SELECT state FROM reservations"))
    assert states == {"settled": len(admitted)}
    # Each ceiling got back what its own requests did not use (1,000 held, 500 used).
    balances = dict(
        await db.fetch("SELECT ceiling, tokens FROM limit_layers WHERE ceiling IS NOT NULL")
    )
    assert abs(balances["scarce"] - (SCARCE_BURST - 10 * 500)) < 1
    assert abs(balances["cheap"] - (CHEAP_BURST - 60 * 500)) < 1
