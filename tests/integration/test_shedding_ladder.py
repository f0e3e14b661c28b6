"""The shedding ladder is exact under concurrency: no admission below its floor.

200 concurrent mixed-priority requests go through the Limiter (batching on)
against one provider ceiling with a ladder. Refill is one token a minute, so
the ceiling's balance only falls during the run (by integer costs) and every
decision can be checked after it:

- each admitted decision reports the ceiling's balance after it
  (`remaining_tokens`: the ceiling is the only layer with a token limit), and
  since every admission takes at least 500 tokens those balances are distinct:
  sorted, they must be exactly the burst minus the running sum of the costs,
  which recovers the order the statements really applied them in;
- in that order each admitted request left the ceiling at or above its
  priority's floor, and each refused one reports the balance it saw
  (`utilization`) which must be a balance of that same sequence, and too low
  for it: below its floor after the request (`shed`) or below its cost
  (`capacity`);
- the totals are then exact: critical demand exceeds the burst, so the
  ceiling ends at exactly 0 tokens, and what each band of priorities took is
  bounded by the floor of the lowest priority in it.
"""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from dataclasses import dataclass

import asyncpg

from llmquota.admission.limiter import Limiter
from llmquota.domain.plans import Ceiling, Plan, ShedStep
from llmquota.domain.records import AdmitDecision
from llmquota.domain.vocabulary import Priority
from tests.integration.test_group_admission import batch_histogram

BURST = 40_000
SLOW_RATE = 1  # one token a minute: under one token of refill in the whole test
SMALL = 600  # small_request_tokens of the first step
LADDER = [
    ShedStep(above=0.5, admit=["high", "critical"], small_request_tokens=SMALL),
    ShedStep(above=0.8, admit=["critical"]),
]
PLANS: dict[str, Priority] = {
    "free": "low",
    "starter": "normal",
    "business": "high",
    "enterprise": "critical",
}


def floor_of(priority: Priority, cost: int) -> int:
    """The lowest balance this request may leave, written out from LADDER."""
    if priority == "critical":
        return 0
    if priority == "high" or cost < SMALL:
        return 8_000  # (1 - 0.8) x 40,000
    return 20_000  # (1 - 0.5) x 40,000


@dataclass(frozen=True)
class Ask:
    """One request of the run: which tenant, at what priority (None: the plan's), how big."""

    plan: str
    priority: Priority | None
    input_tokens: int
    max_tokens: int

    @property
    def cost(self) -> int:
        return self.input_tokens + self.max_tokens

    @property
    def effective(self) -> Priority:
        return self.priority or PLANS[self.plan]


def the_asks() -> list[Ask]:
    """200 requests: every band asks for more than it may take; critical for more than all."""
    asks = (
        [Ask("free", None, 200, 800)] * 30  # low, 1,000 tokens
        + [Ask("free", None, 100, 400)] * 20  # low but small: exempt from the first step
        + [Ask("starter", None, 300, 700)] * 10  # normal: shed like low here
        + [Ask("business", None, 250, 750)] * 30  # high
        + [Ask("enterprise", "low", 200, 800)] * 10  # critical tenants lowering themselves
        + [Ask("enterprise", None, 100, 400)] * 100  # critical, 50,000 tokens in all
    )
    random.Random(9).shuffle(asks)
    return asks


async def lay_out(limiter: Limiter) -> None:
    catalog = limiter.store.catalog
    await catalog.put_ceiling(
        "provider",
        Ceiling(
            models=["gpt-4o", "gpt-4o-2024-*"],
            tokens_per_minute=SLOW_RATE,
            token_burst=BURST,
            shed=LADDER,
        ),
    )
    for plan, priority in PLANS.items():
        # No token limit of their own: the ceiling is the only token layer.
        await catalog.put_plan(plan, Plan(priority=priority, max_in_flight=1_000))
        for n in range(3):
            assert await catalog.put_tenant_policy(f"{plan}-{n}", plan, {}) is not None


def balance_seen(decision: AdmitDecision, cost: int) -> int:
    """The ceiling's balance a refused request was decided against (from its utilization)."""
    assert decision.utilization is not None
    return round((1 - decision.utilization) * BURST + cost)


async def test_200_concurrent_mixed_priorities_never_take_the_ceiling_below_a_floor(
    limiter: Limiter, db: asyncpg.Connection
) -> None:
    await lay_out(limiter)
    asks = the_asks()
    counters = Counter(a.plan for a in asks)
    seen: Counter[str] = Counter()

    async def one(ask: Ask) -> AdmitDecision:
        seen[ask.plan] += 1
        tenant = f"{ask.plan}-{(seen[ask.plan]) % 3}"
        model = "gpt-4o" if seen[ask.plan] % 2 else "gpt-4o-2024-08-06"
        request = limiter.prepare(
            tenant=tenant,
            model=model,
            input_tokens=ask.input_tokens,
            max_tokens=ask.max_tokens,
            priority=ask.priority,
        )
        return (await limiter.decide(request)).decision

    decisions = await asyncio.gather(*(one(a) for a in asks))
    assert sum(counters.values()) == 200
    statements, requests = batch_histogram(limiter, "admit")
    assert requests == 200 and statements < 200 / 4  # the callers really shared batches

    admitted = [(a, d) for a, d in zip(asks, decisions, strict=True) if d.status == "admitted"]
    refused = [(a, d) for a, d in zip(asks, decisions, strict=True) if d.status != "admitted"]
    for ask, d in zip(asks, decisions, strict=True):
        assert d.priority == ask.effective
        assert d.model in {"gpt-4o", "gpt-4o-2024-08-06"} and not d.degraded

    # The order the statements applied the admissions in, from the balances they left.
    admitted.sort(key=lambda pair: -(pair[1].remaining_tokens or 0))
    balances = [BURST]
    for ask, d in admitted:
        balances.append(balances[-1] - ask.cost)
        assert d.remaining_tokens == balances[-1]
        assert d.reserved_tokens == ask.cost
        assert d.remaining_tokens >= floor_of(ask.effective, ask.cost), (ask, d)

    # Every refusal was due: the balance it saw is one of the sequence, and too low.
    for ask, d in refused:
        assert (d.status, d.limit_kind, d.limit_scope, d.ceiling) == (
            "rate_limited",
            "tokens",
            "ceiling",
            "provider",
        )
        seen_balance = balance_seen(d, ask.cost)
        assert seen_balance in balances
        if d.reason == "shed":
            assert ask.cost <= seen_balance
            assert seen_balance - ask.cost < floor_of(ask.effective, ask.cost), (ask, d)
        else:
            assert d.reason == "capacity"
            assert seen_balance < ask.cost

    # Exact totals: critical demand (50,000) exceeds the burst, so it empties the ceiling.
    taken: Counter[Priority] = Counter()
    for ask, _ in admitted:
        taken[ask.effective] += ask.cost

    assert balances[-1] == 0
    assert sum(taken.values()) == BURST
    large_low = sum(
        a.cost for a, _ in admitted if a.effective in ("low", "normal") and a.cost >= SMALL
    )
    assert large_low <= BURST - 20_000
    assert taken["low"] + taken["normal"] + taken["high"] <= BURST - 8_000
    assert any(d.reason == "shed" for a, d in refused if a.effective != "critical")
    assert all(d.reason == "capacity" for a, d in refused if a.effective == "critical")

    # The database agrees: the ceiling row, its permits, and the journal.
    row = await db.fetchrow(
        "SELECT layer_id, tokens, in_flight FROM limit_layers WHERE ceiling = 'provider'"
    )
    assert 0 <= row["tokens"] < 1
    assert row["in_flight"] == len(admitted)
    journal = await db.fetchrow(
        """SELECT count(*) AS n, sum(reserved_tokens) AS tokens FROM reservations
            WHERE $1 = ANY (layer_ids)""",
        row["layer_id"],
    )
    assert (journal["n"], journal["tokens"]) == (len(admitted), BURST)
