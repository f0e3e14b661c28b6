"""Comparison 9: learned output reservations, the accuracy lab.

One tenant sold TOKENS_PER_MINUTE (burst: one minute, MAX_IN_FLIGHT
requests at once) sends more than it is sold, over three routes whose
completion lengths are log-normal with medians at 20-60% of max_tokens;
halfway through, one route's answers triple. The same arrivals are replayed
under each output reservation strategy: max_tokens, learned p90/p95/p99,
fixed, and an oracle that reserves exactly what each request will use.

It is a discrete-event replay in simulated time (HOURS of traffic in a few
seconds, so the one-hour half-life of the learned histograms plays out as it
would): the token bucket is lq_admit's and lq_finish's arithmetic (refill at
the rate up to the burst, reserve input + output estimate or refuse, settle
refunds the difference or debits the excess, a balance may go negative), and
the estimates are the domain's own code (domain/output_estimates.py: the
histogram, the decay, the quantile, the policy) that tests prove equal to
the SQL's. The database's part (the statements, concurrency, no lost
sample, the bound) is proven by tests/integration/test_output_estimates.py.

Reported per strategy:
- usable entitlement: tokens the provider really used over the tenant's
  entitlement (burst + refill over the run);
- overshoot: the most the tenant was ever beyond capacity + refill so far
  (admitted usage minus burst minus rate x elapsed), in tokens and as a
  share of its per-minute budget, against the documented bound
  MAX_IN_FLIGHT x (max_tokens - reserved output);
- refusals a perfect oracle would have admitted (same arrival refused here,
  admitted under the oracle);
- for learned: how long after the shift the shifting route's reservation
  reached the new distribution's quantile (within one bucket).
"""

from __future__ import annotations

import heapq
import math
import random
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, TypeAlias

from llmquota.domain.output_estimates import (
    FixedEstimate,
    LearnedEstimate,
    MaxTokensEstimate,
    OutputHistogram,
    bucket_of,
    output_reserve,
)

TOKENS_PER_MINUTE = 20_000
BURST = TOKENS_PER_MINUTE
MAX_IN_FLIGHT = 16
HOURS = 8.0
# Offered load: the tokens the requests would really use, as a share of the
# tenant's budget: a tenant asking for about what it bought.
OFFERED = 1.1
TOKENS_PER_SECOND = 40.0  # streaming speed of the provider
FIRST_TOKEN_S = 0.5
MIN_SAMPLES = 50
SEED = 2026


@dataclass(frozen=True)
class Route:
    """A route's traffic: its share, input, max_tokens and log-normal completions."""

    name: str
    share: float
    input_tokens: int
    max_tokens: int
    median_fraction: float  # the completions' median, as a share of max_tokens
    sigma: float
    # From half-time on, the median is this share of max_tokens instead.
    shifted_fraction: float | None = None

    def median(self, shifted: bool) -> float:
        fraction = self.shifted_fraction if shifted and self.shifted_fraction else None
        return self.max_tokens * (fraction or self.median_fraction)

    def quantile(self, q: float, shifted: bool) -> float:
        z = statistics.NormalDist().inv_cdf(q)
        return min(self.max_tokens, self.median(shifted) * math.exp(z * self.sigma))


ROUTES = (
    Route("chat", 0.5, 500, 8192, 0.20, 0.50),
    Route("summaries", 0.3, 2000, 4096, 0.40, 0.35),
    Route("extract", 0.2, 400, 2048, 0.20, 0.40, shifted_fraction=0.60),
)
SHIFTING = "extract"


def _mean_tokens(route: Route) -> float:
    """A request's mean usage over the run (log-normal mean; half of it shifted)."""
    spread = math.exp(route.sigma**2 / 2)
    output = (route.median(False) + route.median(True)) / 2 * spread
    return route.input_tokens + output


ARRIVALS_PER_SECOND = (
    OFFERED * TOKENS_PER_MINUTE / 60.0 / sum(r.share * _mean_tokens(r) for r in ROUTES)
)

Estimate: TypeAlias = MaxTokensEstimate | LearnedEstimate | FixedEstimate | None
STRATEGIES: dict[str, Estimate] = {
    "max_tokens": MaxTokensEstimate(strategy="max_tokens"),
    "learned p90": LearnedEstimate(strategy="learned", quantile=0.90, min_samples=MIN_SAMPLES),
    "learned p95": LearnedEstimate(strategy="learned", quantile=0.95, min_samples=MIN_SAMPLES),
    "learned p99": LearnedEstimate(strategy="learned", quantile=0.99, min_samples=MIN_SAMPLES),
    "fixed 1024": FixedEstimate(strategy="fixed", tokens=1024),
    "oracle": None,  # reserves exactly what the request will use
}


@dataclass(frozen=True)
class Arrival:
    at_s: float
    route: Route
    output_tokens: int


def workload(seed: int = SEED) -> list[Arrival]:
    """Poisson arrivals over HOURS; each completion log-normal, capped at max_tokens."""
    rng = random.Random(seed)
    end_s, now = HOURS * 3600.0, 0.0
    arrivals: list[Arrival] = []
    weights = [r.share for r in ROUTES]
    while True:
        now += rng.expovariate(ARRIVALS_PER_SECOND)
        if now >= end_s:
            return arrivals
        route = rng.choices(ROUTES, weights)[0]
        median = route.median(shifted=now >= end_s / 2)
        output = min(route.max_tokens, round(rng.lognormvariate(math.log(median), route.sigma)))
        arrivals.append(Arrival(now, route, output))


@dataclass
class Outcome:
    """What one strategy did with the arrivals."""

    strategy: str
    used_tokens: int = 0
    admitted: set[int] = field(default_factory=set)
    refused: set[int] = field(default_factory=set)
    overshoot_tokens: float = 0.0
    bound_tokens: int = 0
    # (seconds, the shifting route's output reservation) at each of its admissions.
    shifting_reserve: list[tuple[float, int]] = field(default_factory=list)
    beyond_reserve: int = 0  # settlements above their reservation

    @property
    def entitlement_tokens(self) -> float:
        return BURST + TOKENS_PER_MINUTE * HOURS * 60

    @property
    def usable_pct(self) -> float:
        return 100.0 * self.used_tokens / self.entitlement_tokens

    @property
    def overshoot_pct(self) -> float:
        """The overshoot as a share of one minute's budget."""
        return 100.0 * self.overshoot_tokens / TOKENS_PER_MINUTE

    def follow_minutes(self, quantile: float) -> float | None:
        """Minutes from the shift until the shifting route reserved its new quantile
        (within one bucket); None when it never did."""
        shift_s = HOURS * 3600.0 / 2
        route = next(r for r in ROUTES if r.name == SHIFTING)
        target = bucket_of(math.floor(route.quantile(quantile, shifted=True)))
        for at_s, reserve in self.shifting_reserve:
            if at_s >= shift_s and bucket_of(reserve) >= target:
                return (at_s - shift_s) / 60.0
        return None


def replay(name: str, estimate: Estimate, arrivals: Sequence[Arrival]) -> Outcome:
    """The token bucket of lq_admit and lq_finish under one strategy, in simulated time."""
    outcome = Outcome(name)
    rate = TOKENS_PER_MINUTE / 60.0
    balance, refilled_s, in_flight = float(BURST), 0.0, 0
    histograms: dict[str, OutputHistogram] = {}
    ends: list[tuple[float, int, int, int, str]] = []  # (at, arrival, reserved, used, route)

    def refill(now: float) -> None:
        nonlocal balance, refilled_s
        balance = min(float(BURST), balance + (now - refilled_s) * rate)
        refilled_s = now

    def settle_until(now: float) -> None:
        nonlocal balance, in_flight
        while ends and ends[0][0] <= now:
            at_s, _, reserved, used, route = heapq.heappop(ends)
            refill(at_s)
            balance = min(float(BURST), balance + reserved - used)  # lq_credit_layers clamps
            in_flight -= 1
            outcome.used_tokens += used
            outcome.beyond_reserve += used > reserved
            output = used - next(r.input_tokens for r in ROUTES if r.name == route)
            histograms[route] = histograms.get(route, OutputHistogram()).record([output], at_s)
            # Below zero the tenant has used more than its capacity and refill so far.
            outcome.overshoot_tokens = max(outcome.overshoot_tokens, -balance)

    for i, arrival in enumerate(arrivals):
        settle_until(arrival.at_s)
        refill(arrival.at_s)
        route = arrival.route
        if estimate is None:
            output = arrival.output_tokens
        else:
            output = output_reserve(estimate, histograms.get(route.name), route.max_tokens).tokens
        cost = route.input_tokens + output
        if in_flight >= MAX_IN_FLIGHT or balance + 1e-6 < cost:
            outcome.refused.add(i)
            continue
        balance -= cost
        in_flight += 1
        outcome.admitted.add(i)
        outcome.bound_tokens = max(outcome.bound_tokens, route.max_tokens - output)
        if route.name == SHIFTING:
            outcome.shifting_reserve.append((arrival.at_s, output))
        duration = FIRST_TOKEN_S + arrival.output_tokens / TOKENS_PER_SECOND
        used = route.input_tokens + arrival.output_tokens
        heapq.heappush(ends, (arrival.at_s + duration, i, cost, used, route.name))
    settle_until(math.inf)
    # The documented bound: MAX_IN_FLIGHT requests, each at most max_tokens - reserved.
    outcome.bound_tokens *= MAX_IN_FLIGHT
    return outcome


class Report(Protocol):
    sections: list[str]

    def line(self, text: str, *, summary: bool = False) -> None: ...

    def chart(self, name: str) -> tuple[Path, str]: ...


def run() -> list[Outcome]:
    arrivals = workload()
    return [replay(name, estimate, arrivals) for name, estimate in STRATEGIES.items()]


def summary_line(outcomes: Sequence[Outcome]) -> str:
    by_name = {o.strategy: o for o in outcomes}
    full, p95 = by_name["max_tokens"], by_name["learned p95"]
    return (
        f"estimates: usable entitlement max_tokens {full.usable_pct:.0f}%, learned p95 "
        f"{p95.usable_pct:.0f}%; overshoot {p95.overshoot_pct:.1f}% of budget"
    )


def section(report: Report) -> None:
    """Replay every strategy, add the section and chart, print the summary line."""
    report.line("== 9. learned output reservations: the accuracy lab")
    outcomes = run()
    oracle = next(o for o in outcomes if o.strategy == "oracle")
    rows = [
        "| strategy | usable entitlement | overshoot (tokens, % of a minute's budget) "
        "| bound (in flight x (max_tokens - reserved)) | settled above reservation "
        "| refused, oracle would admit | shift followed in |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for o in outcomes:
        lost = len(o.refused & oracle.admitted)
        estimate = STRATEGIES[o.strategy]
        follow = (
            o.follow_minutes(estimate.quantile) if isinstance(estimate, LearnedEstimate) else None
        )
        followed = "-" if follow is None else f"{follow:.0f} min"
        above = 100.0 * o.beyond_reserve / max(len(o.admitted), 1)
        rows.append(
            f"| {o.strategy} | {o.usable_pct:.1f}% | {o.overshoot_tokens:,.0f} "
            f"({o.overshoot_pct:.1f}%) | {o.bound_tokens:,} | {above:.1f}% | {lost:,} "
            f"| {followed} |"
        )
        report.line(
            f"  {o.strategy:12}: usable {o.usable_pct:.1f}%, overshoot "
            f"{o.overshoot_tokens:,.0f} tokens ({o.overshoot_pct:.1f}% of a minute), bound "
            f"{o.bound_tokens:,}, refused-but-oracle-admits {lost:,}, shift followed {followed}"
        )
    path, link = report.chart("estimates.png")
    chart(outcomes, path)
    line = summary_line(outcomes)
    report.sections.append("\n".join(describe(rows, link, line)))
    report.line(line, summary=True)


def describe(rows: list[str], link: str, line: str) -> list[str]:
    routes = ", ".join(
        f"{r.name} ({100 * r.share:.0f}% of requests, input {r.input_tokens}, max_tokens "
        f"{r.max_tokens}, median {100 * r.median_fraction:.0f}% of it"
        + (f", {100 * r.shifted_fraction:.0f}% after the shift" if r.shifted_fraction else "")
        + f", sigma {r.sigma})"
        for r in ROUTES
    )
    return [
        "## 9. Learned output reservations: the accuracy lab",
        "",
        f"One tenant sold {TOKENS_PER_MINUTE:,} tokens a minute (burst one minute, "
        f"max_in_flight {MAX_IN_FLIGHT}), {ARRIVALS_PER_SECOND:.3f} requests a second "
        f"(Poisson) over {HOURS:g} simulated hours: what they really use is {OFFERED:.0%} of "
        f"what it is sold. Completion lengths are "
        f"log-normal per route: {routes}. Output streams at {TOKENS_PER_SECOND:g} tokens/s "
        f"after {FIRST_TOKEN_S} s. The same arrivals are replayed under each strategy "
        f"(learned: min_samples {MIN_SAMPLES}, the shipped one-hour half-life).",
        "",
        "A discrete-event replay in simulated time of lq_admit's and lq_finish's bucket "
        "arithmetic with the domain's histogram code (bench/estimates.py says why and what "
        "the integration tests prove against the database instead). Overshoot: the most the "
        "tenant was ever beyond capacity + refill so far; the bound is max_in_flight x "
        "(max_tokens - reserved output) of the widest route.",
        "",
        *rows,
        "",
        f"![usable entitlement against overshoot]({link})",
        "",
        f"Summary: `{line}`",
    ]


def chart(outcomes: Sequence[Outcome], path: Path) -> None:
    """Usable entitlement against overshoot, one point per strategy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for o in outcomes:
        ax.scatter([o.overshoot_pct], [o.usable_pct], s=60)
        ax.annotate(
            o.strategy, (o.overshoot_pct, o.usable_pct), xytext=(6, 4), textcoords="offset points"
        )
    ax.set_xlabel("overshoot, % of a minute's budget")
    ax.set_ylabel("usable entitlement, %")
    ax.set_ylim(0, 105)
    ax.grid(alpha=0.3)
    ax.set_title("output reservation strategies")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
