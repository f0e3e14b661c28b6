"""Upstream usage is never dropped (issue 20): through the official SDKs, the
fake provider reports absurd, string, negative or no usage, and the ledger
holds what was settled and where it came from.

- above the settle limit (10^8): settled at MAX_TOKEN_COUNT (10^7), the
  provider's figure kept in full in reported_*_tokens, source `clamped`;
- "42", "many", -5, or no usage at all: the relayed text counted with
  tiktoken (the input: what admission counted), source `counted`, a
  negative figure kept as reported.

Each case runs through both wire formats, streamed and not.
"""

from __future__ import annotations

from dataclasses import dataclass
from decimal import Decimal
from typing import Any

import asyncpg
import pytest

from llmquota.domain.tokens import count_text
from llmquota.domain.validation import MAX_TOKEN_COUNT
from tests.proxy.conftest import Stack, settled
from tests.proxy.fake_provider import MISSING, PROMPT_TOKENS

OPENAI_MODEL = "gpt-4o"
ANTHROPIC_MODEL = "claude-sonnet-4-5"
TEXT = " w0 w1 w2 w3 w4 w5"  # what the fake answers (6 words)
ABSURD = 10**8


@dataclass(frozen=True)
class Case:
    """What the provider reports (None: its own figure), and what must be settled."""

    name: str
    reported_input: Any
    reported_output: Any
    source: str
    missing: bool = False


CASES = [
    Case("above_the_settle_limit", ABSURD, ABSURD, "clamped"),
    Case("a_number_in_a_string", None, "42", "counted"),
    Case("a_word", None, "many", "counted"),
    Case("negative", None, -5, "counted"),
    Case("missing", None, None, "counted", missing=True),
]
FIELDS = {
    "openai": ("prompt_tokens", "completion_tokens"),
    "anthropic": ("input_tokens", "output_tokens"),
}


def steer(stack: Stack, kind: str, case: Case) -> None:
    if case.missing:
        stack.fake.usage = MISSING
        return
    names = FIELDS[kind]
    patch = {
        name: value
        for name, value in zip(names, (case.reported_input, case.reported_output), strict=True)
        if value is not None
    }
    stack.fake.usage = patch


async def call(stack: Stack, kind: str, stream: bool) -> str:
    """One request through the SDK of `kind`; the text the client received."""
    messages: Any = [{"role": "user", "content": "Say something short."}]
    if kind == "openai":
        client = stack.openai()
        if not stream:
            completion = await client.chat.completions.create(
                model=OPENAI_MODEL, messages=messages, max_tokens=50
            )
            return completion.choices[0].message.content or ""
        chunks = await client.chat.completions.create(
            model=OPENAI_MODEL, messages=messages, max_tokens=50, stream=True
        )
        return "".join([c.choices[0].delta.content or "" async for c in chunks if c.choices])
    anthropic_client = stack.anthropic()
    if not stream:
        message = await anthropic_client.messages.create(
            model=ANTHROPIC_MODEL, messages=messages, max_tokens=64
        )
        block = message.content[0]
        return block.text if block.type == "text" else ""
    # The raw events: the SDK's own accumulator would do arithmetic on a
    # usage that is not there, which is the client's business, not ours.
    events = await anthropic_client.messages.create(
        model=ANTHROPIC_MODEL, messages=messages, max_tokens=64, stream=True
    )
    pieces = []
    async for event in events:
        if event.type == "content_block_delta" and event.delta.type == "text_delta":
            pieces.append(event.delta.text)
    return "".join(pieces)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("kind", ["openai", "anthropic"])
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
async def test_upstream_usage_is_settled_clamped_or_counted_never_dropped(
    stack: Stack, db: asyncpg.Connection, case: Case, kind: str, stream: bool
) -> None:
    steer(stack, kind, case)
    assert await call(stack, kind, stream) == TEXT  # the client got the text either way

    await settled(db, 1)
    rows = await db.fetch(
        "SELECT g.input_tokens, g.output_tokens, g.outcome, g.usage_source,"
        "       g.reported_input_tokens, g.reported_output_tokens, r.input_tokens AS counted_input"
        "  FROM usage_ledger AS g JOIN reservations AS r USING (reservation_id)"
        " WHERE g.entry_kind = 'usage'"
    )
    assert len(rows) == 1, rows
    row = rows[0]
    model = OPENAI_MODEL if kind == "openai" else ANTHROPIC_MODEL
    factors = stack.app.state.limiter.settings.estimate_factors
    counted_output = count_text(TEXT, model, factors).tokens
    assert counted_output > 0
    if case.source == "clamped":
        expected = (MAX_TOKEN_COUNT, MAX_TOKEN_COUNT, Decimal(ABSURD), Decimal(ABSURD))
    elif case.missing:
        assert row["counted_input"] > 0
        expected = (row["counted_input"], counted_output, None, None)
    else:
        negative = Decimal(case.reported_output) if isinstance(case.reported_output, int) else None
        expected = (PROMPT_TOKENS, counted_output, None, negative)
    assert (
        row["input_tokens"],
        row["output_tokens"],
        row["reported_input_tokens"],
        row["reported_output_tokens"],
    ) == expected
    assert (row["outcome"], row["usage_source"]) == ("ok", case.source)
    assert await db.fetchval("SELECT state FROM reservations") == "settled"


async def test_usage_as_reported_is_marked_reported_with_no_second_figure(
    stack: Stack, db: asyncpg.Connection
) -> None:
    assert await call(stack, "openai", stream=True) == TEXT
    await settled(db, 1)
    row = await db.fetchrow(
        "SELECT output_tokens, usage_source, reported_input_tokens, reported_output_tokens"
        "  FROM usage_ledger WHERE entry_kind = 'usage'"
    )
    assert tuple(row) == (13, "reported", None, None)
