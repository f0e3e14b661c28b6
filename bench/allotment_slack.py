"""Comparison 12: allotments beside an exact twin, near the limits.

One stream of admissions and settlements goes to three workers (Limiters)
of a database whose tenants say `"admission": "allotted"`, each request to
a worker drawn at random, and the same stream to one worker of a twin
database with the same policies, exact. The tenants' buckets hold 200
requests' worth and refill at one token a second (nothing, over the run):
each settled request keeps what it used, so the hot tenants' buckets drain
from full to empty over the run and then stay at the limit, where
allotments must turn exact. Two tenants are hot (70% of the requests: they
take slices), the rest ask now and then.

A false refusal is a request the allotted side refused and the exact twin
admitted; an excess admission the reverse. The rule allotments keep is that
the allotted side never admits more in total than the twin would have
(slices are real debits), so its admitted total is compared too.
"""

from __future__ import annotations

import asyncio
import random
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

from llmquota import Limiter, RateLimited, Settings
from llmquota.domain.policy import Policy

TENANTS = 20
HOT = 2  # tenants 0 and 1 get 70% of the requests
INPUT, MAX_TOKENS = 300, 2_000
COST = INPUT + MAX_TOKENS
BURST = 200 * COST
WORKERS = 3
SEED = 12


class Report(Protocol):
    sections: list[str]

    def line(self, text: str, *, summary: bool = False) -> None: ...


@dataclass(frozen=True)
class Outcome:
    requests: int
    twin_admitted: int
    allotted_admitted: int
    false_refusals: int
    excess_admissions: int
    from_slices: int
    # Over every tenant of the allotted side: charged beyond burst + refill
    # over the run (the rule slices keep; 0 is right).
    beyond_capacity: int

    @property
    def false_refusal_pct(self) -> float:
        return 100.0 * self.false_refusals / max(1, self.twin_admitted)


def settings() -> Settings:
    return Settings(  # type: ignore[call-arg]
        pool_min_size=1, pool_max_size=4, decision_deadline_ms=10_000, _env_file=None
    )


async def _policies(limiter: Limiter, admission: str | None) -> None:
    for t in range(TENANTS):
        fields: dict[str, object] = {"tokens_per_minute": 60, "token_burst": BURST}
        if admission:
            fields["admission"] = admission
        await limiter.store.put_policy("tenant", f"s{t}", None, Policy.model_validate(fields))


async def _admit(limiter: Limiter, tenant: str) -> object | None:
    try:
        return await limiter.admit(
            tenant=tenant, model="gpt-4o", input_tokens=INPUT, max_tokens=MAX_TOKENS
        )
    except RateLimited:
        return None


async def run(allotted_dsn: str, exact_dsn: str, requests: int) -> Outcome:
    """The stream, in order; each side's settlements mirror the other's."""
    rng = random.Random(SEED)
    workers = [await Limiter.connect(allotted_dsn, settings()) for _ in range(WORKERS)]
    twin = await Limiter.connect(exact_dsn, settings())
    await _policies(workers[0], "allotted")
    await _policies(twin, None)
    for limiter in (*workers, twin):
        await limiter.refresh_policies()
    open_pairs: deque[tuple[object | None, object | None, int]] = deque()
    twin_admitted = allotted_admitted = false_refusals = excess = 0
    try:
        for i in range(requests):
            t = rng.randrange(HOT) if rng.random() < 0.7 else rng.randrange(TENANTS)
            ours = await _admit(rng.choice(workers), f"s{t}")
            theirs = await _admit(twin, f"s{t}")
            allotted_admitted += ours is not None
            twin_admitted += theirs is not None
            false_refusals += ours is None and theirs is not None
            excess += ours is not None and theirs is None
            open_pairs.append((ours, theirs, rng.randrange(0, MAX_TOKENS)))
            # Settle the oldest once 30 are open: the same usage on both sides.
            while len(open_pairs) > 30:
                await _settle(*open_pairs.popleft())
            if i % 16 == 0:
                await asyncio.sleep(0.002)  # the background (journal, top-ups) runs
        while open_pairs:
            await _settle(*open_pairs.popleft())
        from_slices, beyond = await _books(workers[0])
    finally:
        for limiter in (*workers, twin):
            await limiter.close()
    return Outcome(
        requests, twin_admitted, allotted_admitted, false_refusals, excess, from_slices, beyond
    )


async def _settle(ours: object | None, theirs: object | None, output: int) -> None:
    for held in (ours, theirs):
        settle: Callable[..., Awaitable[object]] | None = getattr(held, "settle", None)
        if settle is not None:
            await settle(input_tokens=INPUT, output_tokens=output)


async def _books(limiter: Limiter) -> tuple[int, int]:
    """(admissions journaled from slices, tokens charged beyond each tenant's
    burst plus its refill since its first admission, summed)."""
    await limiter.allotments.write_journal()
    rows = await limiter.store.pool.fetch(
        """SELECT (SELECT count(*) FROM reservations WHERE allotment_id IS NOT NULL) AS slices,
                  (SELECT coalesce(sum(greatest(0, b.charged - $1::bigint - b.refill)), 0)
                     FROM (SELECT sum(coalesce(charged_tokens, reserved_tokens)) AS charged,
                                  extract(epoch FROM clock_timestamp() - min(created_at))
                                  AS refill
                             FROM reservations GROUP BY tenant) AS b)::bigint AS beyond""",
        (BURST,),
    )
    return int(rows[0]["slices"]), int(rows[0]["beyond"])


def summary_line(outcome: Outcome) -> str:
    return (
        f"allotment false refusals: {outcome.false_refusals} of {outcome.twin_admitted} "
        f"({outcome.false_refusal_pct:.1f}%)"
    )


async def section(fresh: Callable[[str], Awaitable[str]], quick: bool, report: Report) -> Outcome:
    report.line("== 12. allotments beside an exact twin, near the limits")
    allotted_dsn = await fresh("bench_allotted")
    exact_dsn = await fresh("bench_allotted_twin")
    outcome = await run(allotted_dsn, exact_dsn, 1_500 if quick else 6_000)
    line = summary_line(outcome)
    report.line(
        f"  {outcome.requests} requests: exact twin admitted {outcome.twin_admitted}, "
        f"allotted {outcome.allotted_admitted} ({outcome.from_slices} from slices); "
        f"refused by allotments only {outcome.false_refusals}, "
        f"admitted by allotments only {outcome.excess_admissions}; tokens beyond "
        f"capacity + refill: {outcome.beyond_capacity}"
    )
    report.sections.append(
        "\n".join(
            [
                "## 12. Allotments beside an exact twin, near the limits",
                "",
                __doc__.split("\n\n", 1)[1].strip(),
                "",
                "Once a refusal differs the two sides' histories differ (the side that",
                "admitted keeps what the request used), so a later request can go the other",
                "way: the bound that holds is each tenant's, tokens charged never beyond",
                "capacity plus refill, on the allotted side as on the exact one.",
                "",
                "| requests | exact twin admitted | allotted admitted | from slices "
                "| refused by allotments only | admitted by allotments only "
                "| tokens beyond capacity + refill |",
                "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
                f"| {outcome.requests:,} | {outcome.twin_admitted:,} "
                f"| {outcome.allotted_admitted:,} | {outcome.from_slices:,} "
                f"| {outcome.false_refusals:,} | {outcome.excess_admissions:,} "
                f"| {outcome.beyond_capacity:,} |",
                "",
                f"`{line}` (of the requests the exact twin admitted)",
            ]
        )
    )
    report.line(line, summary=True)
    return outcome
