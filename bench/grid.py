"""Comparison 5: the two-axis grid, request rate x completion length.

Seed 004's load test with both axes: each cell is one open-loop run of the
fake provider through the limiter, and the cell names the limit that refused
most (its first refusal is recorded too). One tenant has a token bucket, a
request bucket and a concurrency cap, each sized to one second of its rate,
so a cell shows its binding limit within a second or two. Generation time
grows with completion length, which is how long completions also fill the
concurrency cap.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from dataclasses import dataclass

from bench.common import BENCH_DECISION_DEADLINE_MS, reset_state
from bench.fake_provider import FakeProvider
from llmquota import Limiter, Policy, RateLimited, Settings

TENANT = "grid"
INPUT_TOKENS = 100
POLICY = Policy(
    tokens_per_minute=1_200_000,  # 20,000 tokens a second
    token_burst=20_000,
    requests_per_minute=6_000,  # 100 requests a second
    request_burst=100,
    max_in_flight=24,
)
PROVIDER = FakeProvider(first_token_s=0.05, tokens_per_second=2_000.0)
KINDS = ("none", "tokens", "requests", "concurrency")


@dataclass(frozen=True)
class Cell:
    rate_per_s: int
    completion_tokens: int
    sent: int
    refused: Counter[str]
    first_refusal: str

    @property
    def binding(self) -> str:
        """The limit that refused most requests in the cell ("none" if nothing was refused).

        The first refusal alone is a coin toss where two limits drain at once.
        """
        if not self.refused:
            return "none"
        return max(KINDS[1:], key=lambda kind: self.refused[kind])


async def run_cell(dsn: str, rate_per_s: int, completion_tokens: int, seconds: float) -> Cell:
    await reset_state(dsn)
    settings = Settings(
        pool_max_size=10, decision_deadline_ms=BENCH_DECISION_DEADLINE_MS, _env_file=None
    )  # type: ignore[call-arg]
    limiter = await Limiter.connect(dsn, settings)
    await limiter.store.put_policy("tenant", TENANT, None, POLICY)
    refused: Counter[str] = Counter()
    first: list[str] = []
    tasks: list[asyncio.Task[None]] = []

    async def request() -> None:
        try:
            reservation = await limiter.admit(
                tenant=TENANT,
                model="gpt-4o",
                input_tokens=INPUT_TOKENS,
                max_tokens=completion_tokens,
            )
        except RateLimited as refusal:
            refused[refusal.limit] += 1
            if not first:
                first.append(refusal.limit)
            return
        usage = await PROVIDER.complete(INPUT_TOKENS, completion_tokens)
        await reservation.settle(input_tokens=usage.input_tokens, output_tokens=usage.output_tokens)

    loop = asyncio.get_running_loop()
    began = loop.time()
    sent = round(rate_per_s * seconds)
    try:
        for n in range(sent):
            # Open loop: arrivals on schedule, whatever the answers.
            await asyncio.sleep(max(0.0, began + n / rate_per_s - loop.time()))
            tasks.append(asyncio.create_task(request()))
        await asyncio.gather(*tasks)
    finally:
        await limiter.close()
    return Cell(rate_per_s, completion_tokens, sent, refused, first[0] if first else "none")
