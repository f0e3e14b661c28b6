"""Comparison 7: oversubscription, seed 001's numbers with time scaled down.

50 tenants, each sold 5,000 tokens a minute, against one provider ceiling of
90,000 tokens a minute (2.8x oversubscribed): 30 free (low), 15 business
(high), 5 enterprise (critical), each asking for exactly its budget, open
loop, in requests of 500 tokens (100 input + max_tokens 400) sent every
tenth of a minute. One "minute" lasts MINUTE_S seconds, so every rate is
multiplied by 60 / MINUTE_S and every ratio is the seed's. The ceiling's
burst is one minute of its rate (90,000 tokens).

The ladder (stated in BENCHMARKS.md): above 50% utilization only high and
critical pass, above 80% only critical; as floors, free may not take the
ceiling below 45,000 tokens, business below 18,000, enterprise below 0.

Two systems, the same load, the same fake provider (usage = the reservation,
so nothing is refunded and what is admitted is what the provider counts):
- llmquota: plans, a ceiling with the ladder, the Limiter (batching on);
- read-then-admit (seed 001's global_admission_check): read the ceiling's
  balance, decide the ladder on it, then check-and-debit the tenant and debit
  the ceiling in a second statement. Each statement is atomic; the race is
  the window between the read and the debit.

Overshoot: tokens admitted beyond the ceiling's capacity plus its refill,
max over every admission (database time) of admitted-so-far minus (burst +
rate x elapsed).
"""

from __future__ import annotations

import asyncio
import datetime
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import asyncpg

from bench.common import BENCH_DECISION_DEADLINE_MS, Report
from bench.fake_provider import FakeProvider
from llmquota import Limiter, Settings
from llmquota.domain.plans import Ceiling, Plan, ShedStep
from llmquota.domain.vocabulary import Priority

MINUTE_S = 2.0
SPEEDUP = 60 / MINUTE_S
TENANT_TOKENS_PER_MINUTE = 5_000
CEILING_TOKENS_PER_MINUTE = 90_000
INPUT_TOKENS = 100
MAX_TOKENS = 400
COST = INPUT_TOKENS + MAX_TOKENS
SENDS_PER_MINUTE = TENANT_TOKENS_PER_MINUTE // COST  # 10: exactly the budget
MODEL = "gpt-4o"
TIERS: dict[str, tuple[Priority, int]] = {
    "enterprise": ("critical", 5),
    "business": ("high", 15),
    "free": ("low", 30),
}
LADDER = [
    ShedStep(above=0.5, admit=["high", "critical"]),
    ShedStep(above=0.8, admit=["critical"]),
]
PROVIDER = FakeProvider(first_token_s=0.05, tokens_per_second=4_000.0)
SAMPLE_S = 0.1


def floor_of(tier: str) -> float:
    """The ladder as floors: the lowest balance a tier's priority may leave."""
    ceiling = Ceiling(
        models=[MODEL], tokens_per_minute=1, token_burst=CEILING_TOKENS_PER_MINUTE, shed=LADDER
    )
    return float(ceiling.floor_tokens(TIERS[tier][0], COST))


def scaled(per_minute: int) -> int:
    """A per-minute rate in real time: the bench's minute lasts MINUTE_S seconds."""
    return round(per_minute * SPEEDUP)


def tenants() -> list[tuple[str, str]]:
    """(tenant, tier) for all 50."""
    return [(f"{tier}-{n}", tier) for tier, (_, count) in TIERS.items() for n in range(count)]


@dataclass
class Outcome:
    system: str
    minutes: float
    asked: Counter[str] = field(default_factory=Counter)
    served: Counter[str] = field(default_factory=Counter)
    # (database seconds, tokens, tier) of every admission
    admitted: list[tuple[float, int, str]] = field(default_factory=list)
    utilization: list[tuple[float, float]] = field(default_factory=list)
    overshoot_tokens: int = 0
    past_floor: int = 0  # admissions that left the ceiling below their priority's floor
    past_floor_tokens: int = 0  # the deepest of them, in tokens under the floor

    def share(self, tier: str) -> float:
        return 100.0 * self.served[tier] / self.asked[tier] if self.asked[tier] else 0.0

    def compute_overshoot(self) -> None:
        """Replay the admissions through the ceiling's own bucket (full at the first,
        refilling at its rate, never above its burst): how far below zero it went,
        and which admissions left it below their priority's floor.

        Admissions of one statement share a time; among them the highest floor
        goes first, an order that keeps every one above its floor if any does.
        """
        rate_per_s = CEILING_TOKENS_PER_MINUTE / MINUTE_S
        balance, lowest, last = float(CEILING_TOKENS_PER_MINUTE), 0.0, None
        for at, tokens, tier in sorted(self.admitted, key=lambda a: (a[0], -floor_of(a[2]))):
            if last is not None:
                balance = min(CEILING_TOKENS_PER_MINUTE, balance + rate_per_s * (at - last))
            balance -= tokens
            lowest = min(lowest, balance)
            last = at
            # Float time arithmetic: a billionth of a token is not past a floor.
            if balance + 1e-6 < floor_of(tier):
                self.past_floor += 1
                self.past_floor_tokens = max(
                    self.past_floor_tokens, round(floor_of(tier) - balance)
                )
        self.overshoot_tokens = max(0, round(-lowest - 1e-6))

    @property
    def peak_utilization(self) -> float:
        return max((u for _, u in self.utilization), default=0.0)


Decide = Callable[[str, str], Awaitable[bool]]


async def drive(outcome: Outcome, decide: Decide, sample: Callable[[], Awaitable[float]]) -> None:
    """Every tenant sends its budget on an absolute schedule; a refusal is not retried."""
    loop = asyncio.get_running_loop()
    interval_s = MINUTE_S / SENDS_PER_MINUTE
    sends = round(outcome.minutes * SENDS_PER_MINUTE)
    started = loop.time()
    everyone = tenants()
    jobs: set[asyncio.Task[None]] = set()

    async def request(tenant: str, tier: str) -> None:
        outcome.asked[tier] += COST
        if await decide(tenant, tier):
            outcome.served[tier] += COST

    async def sender(index: int, tenant: str, tier: str) -> None:
        offset = interval_s * index / len(everyone)
        for n in range(sends):
            await asyncio.sleep(max(0.0, started + offset + n * interval_s - loop.time()))
            job = loop.create_task(request(tenant, tier))
            jobs.add(job)
            job.add_done_callback(jobs.discard)

    async def sampler() -> None:
        end = started + outcome.minutes * MINUTE_S
        while loop.time() < end:
            outcome.utilization.append((loop.time() - started, await sample()))
            await asyncio.sleep(SAMPLE_S)

    await asyncio.gather(sampler(), *(sender(i, t, tier) for i, (t, tier) in enumerate(everyone)))
    while jobs:
        await asyncio.wait(set(jobs))
    outcome.compute_overshoot()


# -- llmquota -----------------------------------------------------------------------


async def run_llmquota(dsn: str, minutes: float) -> Outcome:
    settings = Settings(
        pool_max_size=8, decision_deadline_ms=BENCH_DECISION_DEADLINE_MS, _env_file=None
    )  # type: ignore[call-arg]
    outcome = Outcome("llmquota", minutes)
    async with await Limiter.connect(dsn, settings) as limiter:
        catalog = limiter.store.catalog
        for tier, (priority, _) in TIERS.items():
            plan = Plan(
                priority=priority,
                tokens_per_minute=scaled(TENANT_TOKENS_PER_MINUTE),
                token_burst=TENANT_TOKENS_PER_MINUTE,
            )
            await catalog.put_plan(tier, plan)
        for tenant, tier in tenants():
            await catalog.put_tenant_policy(tenant, tier, {})
        ceiling = Ceiling(
            models=[MODEL],
            tokens_per_minute=scaled(CEILING_TOKENS_PER_MINUTE),
            token_burst=CEILING_TOKENS_PER_MINUTE,
            shed=LADDER,
        )
        await catalog.put_ceiling("provider", ceiling)
        db = await asyncpg.connect(dsn)
        try:
            t0 = await db.fetchval(
                "SELECT refilled_at FROM limit_layers WHERE ceiling = 'provider'"
            )

            async def decide(tenant: str, tier: str) -> bool:
                request = limiter.prepare(
                    tenant=tenant, model=MODEL, input_tokens=INPUT_TOKENS, max_tokens=MAX_TOKENS
                )
                decision = (await limiter.decide(request)).decision
                if decision.status != "admitted" or decision.reservation_id is None:
                    return False
                usage = await PROVIDER.complete(INPUT_TOKENS, MAX_TOKENS)
                await limiter.settle(
                    decision.reservation_id,
                    input_tokens=usage.input_tokens,
                    output_tokens=usage.output_tokens,
                )
                return True

            async def sample() -> float:
                (stored,) = await catalog.get_ceilings("provider")
                return stored.utilization or 0.0

            await drive(outcome, decide, sample)
            rows = await db.fetch(
                """SELECT r.created_at, r.reserved_tokens, l.plan
                     FROM reservations AS r
                     JOIN limit_layers AS l ON l.scope = 'tenant' AND l.tenant = r.tenant"""
            )
            outcome.admitted = [
                (seconds(r["created_at"], t0), r["reserved_tokens"], r["plan"]) for r in rows
            ]
            outcome.compute_overshoot()
        finally:
            await db.close()
    return outcome


def seconds(at: datetime.datetime, t0: datetime.datetime) -> float:
    return (at - t0).total_seconds()


# -- read-then-admit --------------------------------------------------------------------

NAIVE_SCHEMA = """
DROP TABLE IF EXISTS naive_buckets;
CREATE TABLE naive_buckets (
    name        text PRIMARY KEY,
    tokens      double precision NOT NULL,
    per_second  double precision NOT NULL,
    burst       double precision NOT NULL,
    refilled_at timestamptz NOT NULL DEFAULT clock_timestamp()
);
"""
REFILLED = (
    "least(b.burst, b.tokens + extract(epoch FROM clock_timestamp() - b.refilled_at)"
    " * b.per_second)"
)
# Step 1, the seed's get_global_usage(): a plain read, no lock.
READ_CEILING = f"SELECT {REFILLED} FROM naive_buckets AS b WHERE b.name = 'ceiling'"
# Step 2, the seed's check_and_reserve(): check and debit the tenant, and debit
# the ceiling, atomically, whatever the ceiling holds now.
DEBIT = f"""
WITH tenant AS (
    UPDATE naive_buckets AS b SET tokens = {REFILLED} - $2, refilled_at = clock_timestamp()
     WHERE b.name = $1 AND {REFILLED} >= $2
 RETURNING 1)
UPDATE naive_buckets AS b SET tokens = {REFILLED} - $2, refilled_at = clock_timestamp()
 WHERE b.name = 'ceiling' AND EXISTS (SELECT 1 FROM tenant)
RETURNING clock_timestamp()
"""


def naive_floor(priority: Priority) -> float:
    """The same ladder, as floors: the lowest balance a priority may leave."""
    floors = [(1 - float(s.above)) * CEILING_TOKENS_PER_MINUTE for s in LADDER]
    return max(
        (f for f, s in zip(floors, LADDER, strict=True) if priority not in s.admit), default=0
    )


async def run_read_then_admit(dsn: str, minutes: float) -> Outcome:
    outcome = Outcome("read-then-admit", minutes)
    pool = await asyncpg.create_pool(dsn, min_size=8, max_size=8)
    try:
        async with pool.acquire() as connection:
            await connection.execute(NAIVE_SCHEMA)
            buckets = [("ceiling", CEILING_TOKENS_PER_MINUTE)] + [
                (t, TENANT_TOKENS_PER_MINUTE) for t, _ in tenants()
            ]
            await connection.executemany(
                """INSERT INTO naive_buckets (name, per_second, burst, tokens)
                   VALUES ($1, $2, $3, $3)""",
                [
                    (name, scaled(per_minute) / 60.0, float(per_minute))
                    for name, per_minute in buckets
                ],
            )
            t0 = await connection.fetchval(
                "SELECT refilled_at FROM naive_buckets WHERE name = 'ceiling'"
            )

        async def decide(tenant: str, tier: str) -> bool:
            balance = await pool.fetchval(READ_CEILING)
            if balance - COST < floor_of(tier):
                return False
            at = await pool.fetchval(DEBIT, tenant, float(COST))
            if at is None:
                return False
            outcome.admitted.append((seconds(at, t0), COST, tier))
            await PROVIDER.complete(INPUT_TOKENS, MAX_TOKENS)
            return True

        async def sample() -> float:
            balance = await pool.fetchval(READ_CEILING)
            return float(1 - balance / CEILING_TOKENS_PER_MINUTE)

        await drive(outcome, decide, sample)
    finally:
        await pool.close()
    return outcome


# -- the report section -------------------------------------------------------------------


def chart(outcomes: list[Outcome], path: Path) -> None:
    """Ceiling utilization over time, against the ladder's steps."""
    import matplotlib.pyplot as plt

    from bench.charts import DPI  # chooses matplotlib's Agg backend first

    fig, ax = plt.subplots(figsize=(9, 4.5))
    for outcome in outcomes:
        xs = [t / MINUTE_S for t, _ in outcome.utilization]
        ax.plot(xs, [100 * u for _, u in outcome.utilization], label=outcome.system)
    for step, text in ((50, "above 50%: high, critical"), (80, "above 80%: critical only")):
        ax.axhline(step, color="grey", linestyle="--", linewidth=1)
        ax.text(0.02, step + 1, text, fontsize=8, color="grey")
    ax.axhline(100, color="black", linewidth=1)
    ax.set_xlabel(f"minutes (one minute = {MINUTE_S:g} s here)")
    ax.set_ylabel("ceiling utilization (%)")
    ax.set_title("90k/min ceiling sold 250k/min: 30 free, 15 business, 5 enterprise")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)


def ascii_utilization(outcome: Outcome, width: int = 50) -> list[str]:
    """One line per half minute: the utilization then, as a bar (| marks 50% and 80%)."""
    lines = []
    step_s = MINUTE_S / 2
    next_at = 0.0
    for t, u in outcome.utilization:
        if t + 1e-9 < next_at:
            continue
        next_at += step_s
        filled = round(min(u, 1.2) * width)
        bar = "".join(
            "#" if i < filled else ("|" if i in (width // 2, width * 4 // 5) else ".")
            for i in range(round(1.2 * width))
        )
        lines.append(f"{t / MINUTE_S:5.1f} min {100 * u:6.1f}% {bar}")
    return lines


def summary_line(ours: Outcome) -> str:
    return (
        f"oversubscription: ceiling overshoot {ours.overshoot_tokens} tokens; served "
        f"enterprise {ours.share('enterprise'):.1f}%, business {ours.share('business'):.1f}%, "
        f"free {ours.share('free'):.1f}%"
    )


async def section(
    server_dsn_fresh: Callable[[str], Awaitable[str]], quick: bool, report: Report
) -> None:
    """Run both systems and add the section; `server_dsn_fresh(name)` makes a migrated database."""
    report.line("== 8. oversubscription: a 90k/min ceiling sold 250k/min, shed by priority")
    minutes = 4.0 if quick else 8.0
    ours = await run_llmquota(await server_dsn_fresh("bench_oversubscription"), minutes)
    naive = await run_read_then_admit(await server_dsn_fresh("bench_read_then_admit"), minutes)
    rows = [
        "| system | beyond capacity + refill (tokens) | admissions past their floor "
        "(deepest, tokens) | peak utilization | enterprise served | business served "
        "| free served |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for o in (ours, naive):
        shares = " | ".join(f"{o.share(tier):.1f}%" for tier in TIERS)
        rows.append(
            f"| {o.system} | {o.overshoot_tokens:,} | {o.past_floor:,} ({o.past_floor_tokens:,}) "
            f"| {100 * o.peak_utilization:.1f}% | {shares} |"
        )
        report.line(
            f"  {o.system:16}: overshoot {o.overshoot_tokens:,} tokens, {o.past_floor} "
            f"admissions past their floor (deepest {o.past_floor_tokens:,}), peak utilization "
            f"{100 * o.peak_utilization:.1f}%, served "
            + ", ".join(f"{tier} {o.share(tier):.1f}%" for tier in TIERS)
        )
    path, link = report.chart("oversubscription.png")
    chart([ours, naive], path)
    line = summary_line(ours)
    report.sections.append("\n".join(describe(minutes, rows, link, ours, line)))
    report.line(line, summary=True)


def describe(minutes: float, rows: list[str], link: str, ours: Outcome, line: str) -> list[str]:
    asked = {tier: ours.asked[tier] for tier in TIERS}
    return [
        "## 8. Oversubscription: a provider ceiling shed by priority",
        "",
        "Seed 001's numbers with time scaled down: 50 tenants sold 5,000 tokens a minute",
        "each against one provider ceiling of 90,000 a minute (burst: one minute), 30 free",
        "(low), 15 business (high), 5 enterprise (critical), each asking for exactly its",
        f"budget in 500-token requests, open loop, refusals not retried. One minute lasts "
        f"{MINUTE_S:g} s here",
        f"(every rate x{SPEEDUP:g}, every ratio the seed's); {minutes:g} minutes per system. "
        'Ladder: `[{"above": 0.5, "admit": ["high", "critical"]}, '
        '{"above": 0.8, "admit": ["critical"]}]`,',
        "that is floors of 45,000 tokens for free, 18,000 for business, 0 for enterprise.",
        "The fake provider reports usage = the reservation, so nothing is refunded.",
        "read-then-admit is seed 001's global_admission_check on PostgreSQL: read the",
        "ceiling's balance, decide the same ladder on it, then check-and-debit the tenant",
        "and debit the ceiling in a second statement (each statement atomic).",
        "Beyond capacity + refill: the admissions (database time) replayed through the",
        "ceiling's token bucket; how far below zero it went. Past their floor: admissions",
        "that left that replayed balance below their own priority's floor.",
        f"Asked, in tokens: {', '.join(f'{t} {n:,}' for t, n in asked.items())}.",
        "",
        *rows,
        "",
        f"![ceiling utilization over time against the ladder]({link})",
        "",
        "llmquota's utilization, every half minute (`|` marks 50% and 80%):",
        "",
        "```",
        *ascii_utilization(ours),
        "```",
        "",
        f"`{line}`",
    ]
