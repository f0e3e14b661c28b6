"""A plan changed while admissions run changes every tenant on it at once.

Generation g of the plan has token_burst = tokens_per_minute = BASE + g and
max_in_flight = 1,000 + g, so any figure read anywhere names the generation
it came from. While callers admit and release through the Limiter (batching
on) and new tenants join the plan, the plan is replaced several times, and:

- an observer reading every tenant of the plan in one statement never sees
  two generations at once (a plan change is one transaction over all its
  tenants), and each tenant's policy_version moves at every generation;
- an admission started after a plan change returned never decides with an
  older generation's figures;
- nothing deadlocks or times out, and at the end every tenant, joiners
  included, has the last generation's figures.
"""

from __future__ import annotations

import asyncio
import itertools
import random
from collections import defaultdict

import asyncpg

from llmquota.admission.limiter import Limiter
from llmquota.domain.plans import Plan

BASE = 100_000
GENERATIONS = 8
TENANTS = [f"b{n}" for n in range(20)]
JOINERS = [f"j{n}" for n in range(5)]
CALLERS = 4
ROUND = 12  # concurrent admissions per caller round


def plan_of(generation: int) -> Plan:
    return Plan(
        priority="high",
        tokens_per_minute=BASE + generation,
        token_burst=BASE + generation,
        max_in_flight=1_000 + generation,
    )


SNAPSHOT = """
    SELECT tenant, token_burst, tokens_per_minute, max_in_flight, policy_version
      FROM limit_layers WHERE plan = 'business' AND scope = 'tenant'"""


class Run:
    """What the concurrent parts share: the generations committed and seen."""

    def __init__(self) -> None:
        self.committed = 0  # the last generation whose put_plan returned
        self.done = False
        # generation -> {tenant: policy_version}, from the observer's snapshots
        self.versions: dict[int, dict[str, int]] = defaultdict(dict)
        self.admissions = 0
        self.snapshots = 0


async def change_plans(limiter: Limiter, run: Run) -> None:
    for generation in range(1, GENERATIONS + 1):
        changed = await limiter.store.catalog.put_plan("business", plan_of(generation))
        assert len(TENANTS) <= changed <= len(TENANTS) + len(JOINERS)
        run.committed = generation
        await asyncio.sleep(0.05)
    run.done = True


async def join(limiter: Limiter) -> None:
    for tenant in JOINERS:
        assert await limiter.store.catalog.put_tenant_policy(tenant, "business", {}) is not None
        await asyncio.sleep(0.03)


async def admit_and_release(limiter: Limiter, run: Run, seed: int) -> None:
    rng = random.Random(seed)

    async def one(tenant: str) -> None:
        floor = run.committed
        request = limiter.prepare(tenant=tenant, model="gpt-4o", input_tokens=40, max_tokens=60)
        decision = (await limiter.decide(request)).decision
        assert decision.status == "admitted", decision
        generation = (decision.tenant.token_burst or 0) - BASE
        assert decision.tenant.tokens_per_minute == BASE + generation
        # Never older than the plan known to be committed when this admission began.
        assert floor <= generation <= GENERATIONS
        assert decision.reservation_id is not None
        await limiter.release(decision.reservation_id)
        run.admissions += 1

    while not run.done:
        await asyncio.gather(*(one(rng.choice(TENANTS)) for _ in range(ROUND)))


async def observe(database_dsn: str, run: Run) -> None:
    connection = await asyncpg.connect(database_dsn)
    try:
        while not run.done:
            rows = await connection.fetch(SNAPSHOT)
            generations = {r["token_burst"] - BASE for r in rows}
            assert len(generations) == 1, f"two generations at once: {sorted(generations)}"
            (generation,) = generations
            for r in rows:
                assert r["tokens_per_minute"] == BASE + generation
                assert r["max_in_flight"] == 1_000 + generation
                known = run.versions[generation].setdefault(r["tenant"], r["policy_version"])
                assert known == r["policy_version"]  # versions move only with the plan
            run.snapshots += 1
            await asyncio.sleep(0.005)
    finally:
        await connection.close()


async def test_a_plan_put_under_load_changes_every_tenant_at_once(
    limiter: Limiter, database_dsn: str, db: asyncpg.Connection
) -> None:
    catalog = limiter.store.catalog
    assert await catalog.put_plan("business", plan_of(0)) == 0
    for tenant in TENANTS:
        assert await catalog.put_tenant_policy(tenant, "business", {}) is not None
    run = Run()

    # Any deadlock, lock timeout or failed assertion in a part surfaces here.
    await asyncio.gather(
        change_plans(limiter, run),
        join(limiter),
        observe(database_dsn, run),
        *(admit_and_release(limiter, run, seed) for seed in range(CALLERS)),
    )

    assert run.admissions >= ROUND * CALLERS and run.snapshots > GENERATIONS
    rows = await db.fetch(SNAPSHOT)
    assert {r["tenant"] for r in rows} == set(TENANTS) | set(JOINERS)
    assert {(r["token_burst"], r["max_in_flight"]) for r in rows} == {
        (BASE + GENERATIONS, 1_000 + GENERATIONS)
    }
    final = {r["tenant"]: r["policy_version"] for r in rows}
    # Each tenant's version moved from one observed generation to the next.
    observed = sorted(run.versions)
    assert len(observed) >= 2
    for older, newer in itertools.pairwise(observed):
        for tenant, version in run.versions[older].items():
            if tenant in run.versions[newer]:
                assert run.versions[newer][tenant] > version, (tenant, older, newer)
    last = run.versions[observed[-1]]
    for tenant, version in last.items():
        if observed[-1] == GENERATIONS:
            assert final[tenant] == version
        else:
            assert final[tenant] > version
    (stored,) = await catalog.get_plans("business")
    assert stored.tenants == len(TENANTS) + len(JOINERS)
    assert await db.fetchval("SELECT count(*) FROM reservations WHERE state <> 'released'") == 0
    assert await db.fetchval("SELECT sum(in_flight) FROM limit_layers") == 0
