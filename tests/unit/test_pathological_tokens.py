"""Counting never fails and never runs away: pathological text is counted in
pieces, and past the CPU budget the rest is bounded from above."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Iterator

import pytest

from llmquota.admission.counting import TokenCounter
from llmquota.config import Settings
from llmquota.domain.tokens import (
    PIECE_CHARS,
    CpuBudget,
    count_messages,
    encoded_length,
    get_encoding,
)

MEGABYTE_OF = {
    "spaces": " " * 1_000_100,
    "newlines": "\n" * 1_000_000,
    "digits": "7" * 1_000_000,
    "punctuation": "!?" * 500_000,
    "one huge word": "a" * 1_000_000,
}


def _prose(words: int, seed: int = 7) -> str:
    rng = random.Random(seed)
    vocabulary = ["the", "contract", "Zürich", "数据", "1234567", "foo_bar", "\n\n", "!!!", "x"]
    return " ".join(rng.choice(vocabulary) for _ in range(words))


@pytest.mark.parametrize("name", sorted(MEGABYTE_OF))
def test_a_megabyte_of_one_character_class_is_counted(name: str) -> None:
    text = MEGABYTE_OF[name]
    count = count_messages([{"role": "user", "content": text}], "gpt-4o")
    assert 0 < count.tokens <= len(text.encode()) + 10
    assert count.estimated  # cut inside a run: the figure may be a token or two high


def test_whole_text_that_tiktoken_refuses_is_the_reason_for_pieces() -> None:
    with pytest.raises(ValueError, match="backtracking"):
        get_encoding("o200k_base").encode(MEGABYTE_OF["spaces"], disallowed_special=())


def test_pieces_of_prose_add_up_to_the_whole_within_a_few_tokens() -> None:
    encoding = get_encoding("o200k_base")
    text = _prose(100_000)
    exact = len(encoding.encode(text, disallowed_special=()))
    pieced, _ = encoded_length(encoding, text, CpuBudget())
    # Never under; over by at most one token per cut.
    assert exact <= pieced <= exact + len(text) // PIECE_CHARS + 1


def test_text_under_a_piece_is_exact() -> None:
    count = count_messages([{"role": "user", "content": _prose(500)}], "gpt-4o")
    assert not count.estimated


class _FakeClock:
    """A thread clock that advances one second per reading."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


def test_past_the_budget_the_rest_is_bounded_by_its_bytes() -> None:
    encoding = get_encoding("o200k_base")
    text = _prose(50_000)
    exact = len(encoding.encode(text, disallowed_special=()))
    # The budget allows two pieces, then the rest is bounded, never encoded.
    budget = CpuBudget(seconds=2.5, clock=_FakeClock())
    tokens, estimated = encoded_length(encoding, text, budget)
    assert estimated
    assert exact < tokens <= len(text.encode())


@pytest.fixture
def counter() -> Iterator[TokenCounter]:
    settings = Settings(_env_file=None)  # type: ignore[call-arg]
    counter = TokenCounter(settings)
    yield counter
    counter.close()


async def test_a_big_prompt_is_counted_off_the_event_loop(counter: TokenCounter) -> None:
    """While a megabyte is counted, the loop keeps turning (the thread pool has
    the work, and tiktoken releases the GIL while it encodes)."""
    request_body = {
        "tenant": "big",
        "model": "gpt-4o",
        "max_tokens": 1,
        "messages": [{"role": "user", "content": _prose(250_000)}],
    }
    # The encoding first, whatever ran before: building one holds the GIL
    # (tiktoken's CoreBPE) for about 0.15 s, once per process, and that stall
    # was measured here when this test ran alone. Then the same count on the
    # loop, to measure what a count there stalls it for.
    count_messages([{"role": "user", "content": "warm"}], "gpt-4o")
    started = time.perf_counter()
    inline = counter.prepare(**request_body)  # type: ignore[arg-type]
    on_loop_seconds = time.perf_counter() - started

    lags: list[float] = []
    counting = True

    async def ticker() -> None:
        while counting:
            asked = time.perf_counter()
            await asyncio.sleep(0.005)
            lags.append(time.perf_counter() - asked - 0.005)

    ticks = asyncio.create_task(ticker())
    request = await counter.prepare_off_loop(**request_body)  # type: ignore[arg-type]
    counting = False
    await ticks
    assert request.input_tokens > 100_000 and inline.input_tokens > 100_000
    # The loop never stalled for a third of what counting on it would have:
    # a count on the loop stalls it for all of that.
    print(
        f"FIGURE counting off the loop: slowest loop turn {max(lags) * 1000:.1f} ms, "
        f"the count on the loop {on_loop_seconds * 1000:.0f} ms"
    )
    assert max(lags) < on_loop_seconds / 3, (max(lags), on_loop_seconds)


class _CountingClock(_FakeClock):
    """The fake clock, counting its readings."""

    def __init__(self) -> None:
        super().__init__()
        self.readings = 0

    def __call__(self) -> float:
        self.readings += 1
        return super().__call__()


def test_many_short_parts_past_the_budget_are_bounded_too() -> None:
    """The budget holds across parts: a thousand short messages are not a way
    around it (each part under a piece used to be encoded unchecked)."""
    messages = [{"role": "user", "content": _prose(2_000)} for _ in range(1_000)]
    exact = count_messages(messages, "gpt-4o")
    clock = _CountingClock()
    # A second per reading: the start, then one per part; 2.5 s allow two.
    bounded = count_messages(messages, "gpt-4o", budget=CpuBudget(seconds=2.5, clock=clock))
    assert bounded.estimated and not exact.estimated
    assert bounded.tokens > exact.tokens  # bounded by bytes, never an undercount
    assert clock.readings > 1_000  # every part asked


def test_an_unlimited_budget_never_reads_the_clock() -> None:
    clock = _CountingClock()
    text = _prose(50_000)
    budget = CpuBudget(clock=clock)
    tokens, _estimated = encoded_length(get_encoding("o200k_base"), text, budget)
    assert tokens > 0
    assert clock.readings == 0
