"""A fake LLM provider: no network, realistic timing.

A completion takes a time to first token plus its output at a streaming
speed, and reports usage the way providers do. Output lengths are drawn from
a seeded generator, so every strategy in a comparison sees the same requests.
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass


@dataclass(frozen=True)
class Usage:
    input_tokens: int
    output_tokens: int

    @property
    def total(self) -> int:
        return self.input_tokens + self.output_tokens


@dataclass(frozen=True)
class FakeProvider:
    """Latency = first_token_s + output_tokens / tokens_per_second."""

    first_token_s: float
    tokens_per_second: float

    def latency_s(self, output_tokens: int) -> float:
        return self.first_token_s + output_tokens / self.tokens_per_second

    async def complete(self, input_tokens: int, output_tokens: int) -> Usage:
        await asyncio.sleep(self.latency_s(output_tokens))
        return Usage(input_tokens, output_tokens)


def output_lengths(count: int, low: int, high: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randint(low, high) for _ in range(count)]
