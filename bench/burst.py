"""Comparison 4: accuracy under a burst, the seeds' 09:14 incident scaled down.

A tenant with a 100,000-token bucket (100,000 a minute) opens 200 requests
inside 400 ms, each with 300 input tokens and max_tokens 2,000, generating
1,600-2,000 tokens. Generation runs faster than the seed's 63 tokens/s so the
run takes seconds; everything else is the seed's numbers. Refused requests
retry after the hint they were given, until the window closes.

Three strategies, all on llmquota's own statements so only the accounting differs:
- debit-on-response (bench only): reserve nothing (a zero-token reservation
  passes while the balance is not negative) and settle the real usage when
  the response arrives, which debits it: the seed's failing limiter;
- reserve-max-tokens: reserve input + max_tokens and keep all of it (settle
  charging the whole reservation): strict, no refunds;
- reserve + refund (the product): reserve input + max_tokens, settle the
  real usage, and the difference is refunded.

Tokens admitted in the window are the real usage of the requests admitted in
it; the budget is capacity plus refill over the window.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from bench.common import BENCH_DECISION_DEADLINE_MS, reset_state
from bench.fake_provider import FakeProvider, output_lengths
from llmquota import Limiter, Policy, RateLimited, Settings

TENANT = "acme"
CAPACITY_TOKENS = 100_000
TOKENS_PER_MINUTE = 100_000
REQUESTS = 200
BURST_SPREAD_S = 0.4
INPUT_TOKENS = 300
MAX_TOKENS = 2_000
OUTPUT_RANGE = (1_600, 2_000)
SEED_TOKENS_PER_SECOND = 63.0
STRATEGIES = ("debit-on-response", "reserve-max-tokens", "reserve + refund")


@dataclass
class BurstResult:
    strategy: str
    window_s: float
    speedup: float
    admitted: int = 0
    tokens_admitted: int = 0
    # (seconds since the burst began, cumulative tokens admitted)
    timeline: list[tuple[float, int]] = field(default_factory=list)

    @property
    def budget(self) -> float:
        return CAPACITY_TOKENS + TOKENS_PER_MINUTE / 60.0 * self.window_s

    @property
    def overshoot(self) -> float:
        return self.tokens_admitted / self.budget

    @property
    def beyond_budget(self) -> int:
        return max(0, round(self.tokens_admitted - self.budget))


async def run_strategy(dsn: str, strategy: str, *, window_s: float, speedup: float) -> BurstResult:
    """One strategy: the same 200 requests, the same fake provider."""
    await reset_state(dsn)
    settings = Settings(
        pool_max_size=10, decision_deadline_ms=BENCH_DECISION_DEADLINE_MS, _env_file=None
    )  # type: ignore[call-arg]
    limiter = await Limiter.connect(dsn, settings)
    await limiter.store.put_policy(
        "tenant",
        TENANT,
        None,
        Policy(tokens_per_minute=TOKENS_PER_MINUTE, token_burst=CAPACITY_TOKENS),
    )
    provider = FakeProvider(first_token_s=0.3, tokens_per_second=SEED_TOKENS_PER_SECOND * speedup)
    outputs = output_lengths(REQUESTS, *OUTPUT_RANGE, seed=914)
    result = BurstResult(strategy, window_s, speedup)
    loop = asyncio.get_running_loop()
    began = loop.time()
    closes = began + window_s
    reserve_input, reserve_max = (
        (0, 0) if strategy == "debit-on-response" else (INPUT_TOKENS, MAX_TOKENS)
    )

    async def job(n: int) -> None:
        await asyncio.sleep(BURST_SPREAD_S * n / REQUESTS)
        while loop.time() < closes:
            try:
                reservation = await limiter.admit(
                    tenant=TENANT,
                    model="gpt-4o",
                    input_tokens=reserve_input,
                    max_tokens=reserve_max,
                )
            except RateLimited as refused:
                await asyncio.sleep(min(refused.retry_after, max(0.0, closes - loop.time())))
                continue
            # What this admission will really cost, counted when it is admitted.
            result.admitted += 1
            result.tokens_admitted += INPUT_TOKENS + outputs[n]
            result.timeline.append((loop.time() - began, result.tokens_admitted))
            usage = await provider.complete(INPUT_TOKENS, outputs[n])
            charged_output = MAX_TOKENS if strategy == "reserve-max-tokens" else usage.output_tokens
            await reservation.settle(input_tokens=INPUT_TOKENS, output_tokens=charged_output)
            return

    try:
        await asyncio.gather(*(job(n) for n in range(REQUESTS)))
    finally:
        await limiter.close()
    return result
