"""What to settle when an upstream (a provider behind the proxy) reports usage.

Pure. A provider's `usage` is data from outside: it can be absurd (10^8
tokens), a string ("42", "many"), negative, or missing. None of that may
make a settlement fail or settle nothing, because the text was relayed and
the provider bills it. So each side (input, output) is resolved on its own:

- an integer in [0, MAX_TOKEN_COUNT] is settled as reported;
- an integer above MAX_TOKEN_COUNT is settled at MAX_TOKEN_COUNT (the most a
  settlement takes, the limit every other entry point refuses beyond) and
  the provider's own figure is kept beside it in the ledger;
- anything else (missing, not an integer, negative) is replaced by our own
  count: the admission's counted input, or tiktoken on the relayed output.

The ledger row says which happened (`usage_source`): `counted` if either
side was counted, else `clamped` if either side was clamped, else
`reported`. A side's as-reported figure is kept only where it differs from
what was settled and is an integer (a clamped or a negative one): a string
is not a figure, and a figure equal to the settled one says nothing new.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from llmquota.domain.records import FinishRequest
from llmquota.domain.validation import MAX_TOKEN_COUNT
from llmquota.domain.vocabulary import UsageSource


@dataclass(frozen=True, slots=True)
class UpstreamUsage:
    """The figures to settle, where they came from, and the provider's own where kept."""

    input_tokens: int
    output_tokens: int
    source: UsageSource
    reported_input_tokens: int | None = None
    reported_output_tokens: int | None = None

    def onto(self, settle: FinishRequest) -> FinishRequest:
        """`settle` carrying where its figures came from, for its ledger row."""
        return dataclasses.replace(
            settle,
            usage_source=self.source,
            reported_input_tokens=self.reported_input_tokens,
            reported_output_tokens=self.reported_output_tokens,
        )


@dataclass(frozen=True, slots=True)
class _Side:
    tokens: int
    source: UsageSource
    reported: int | None


def _integer(value: object) -> int | None:
    """`value` if it is a JSON integer (a bool is not), else None."""
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _resolve(reported: object, count: Callable[[], int], at_least: int = 0) -> _Side:
    figure = _integer(reported)
    if figure is None or figure < 0:
        counted = min(max(count(), at_least), MAX_TOKEN_COUNT)
        return _Side(counted, "counted", figure)
    if figure > MAX_TOKEN_COUNT:
        return _Side(MAX_TOKEN_COUNT, "clamped", figure)
    if figure < at_least:
        # The provider reported less than was relayed (a stream cut short
        # after its last usage): what reached the client is what was produced.
        return _Side(at_least, "counted", figure)
    return _Side(figure, "reported", None)


def resolve_usage(
    reported_input: object,
    reported_output: object,
    *,
    counted_input: int,
    count_output: Callable[[], int],
    complete: bool = True,
) -> UpstreamUsage:
    """The settlement of an upstream answer.

    `reported_*`: the provider's figures as they came (None: not reported).
    `counted_input`: what admission counted; `count_output`: tiktoken on the
    relayed text, called only when needed. `complete` False (an error or a
    cancellation mid-answer): the output settled is at least what was
    counted, whatever the provider reported before it stopped.
    """
    counted_input = min(max(counted_input, 0), MAX_TOKEN_COUNT)
    input_side = _resolve(reported_input, lambda: counted_input)
    if complete:
        output_side = _resolve(reported_output, count_output)
    else:
        counted_output = min(count_output(), MAX_TOKEN_COUNT)
        output_side = _resolve(reported_output, lambda: counted_output, counted_output)
    sources = (input_side.source, output_side.source)
    source: UsageSource = (
        "counted" if "counted" in sources else "clamped" if "clamped" in sources else "reported"
    )
    return UpstreamUsage(
        input_tokens=input_side.tokens,
        output_tokens=output_side.tokens,
        source=source,
        reported_input_tokens=input_side.reported,
        reported_output_tokens=output_side.reported,
    )
