"""resolve_usage on its own: each side reported, clamped or counted; the row's
source; the provider's figure kept only where it differs and is a figure."""

from __future__ import annotations

import pytest

from llmquota.api.proxy.wire import usage_of
from llmquota.domain.upstream_usage import UpstreamUsage, resolve_usage
from llmquota.domain.validation import MAX_TOKEN_COUNT

COUNTED_INPUT = 40
COUNTED_OUTPUT = 9


def resolve(
    reported_input: object, reported_output: object, complete: bool = True
) -> UpstreamUsage:
    return resolve_usage(
        reported_input,
        reported_output,
        counted_input=COUNTED_INPUT,
        count_output=lambda: COUNTED_OUTPUT,
        complete=complete,
    )


@pytest.mark.parametrize(
    ("reported_input", "reported_output", "expected"),
    [
        (17, 13, UpstreamUsage(17, 13, "reported")),
        (0, 0, UpstreamUsage(0, 0, "reported")),
        (MAX_TOKEN_COUNT, 13, UpstreamUsage(MAX_TOKEN_COUNT, 13, "reported")),
        (17, MAX_TOKEN_COUNT + 1, UpstreamUsage(17, MAX_TOKEN_COUNT, "clamped", None, 10**7 + 1)),
        (10**30, 10**8, UpstreamUsage(MAX_TOKEN_COUNT, MAX_TOKEN_COUNT, "clamped", 10**30, 10**8)),
        (17, "42", UpstreamUsage(17, COUNTED_OUTPUT, "counted")),
        (17, "many", UpstreamUsage(17, COUNTED_OUTPUT, "counted")),
        (17, -5, UpstreamUsage(17, COUNTED_OUTPUT, "counted", None, -5)),
        (17, 4.0, UpstreamUsage(17, COUNTED_OUTPUT, "counted")),
        (17, True, UpstreamUsage(17, COUNTED_OUTPUT, "counted")),
        (None, None, UpstreamUsage(COUNTED_INPUT, COUNTED_OUTPUT, "counted")),
        (-1, 13, UpstreamUsage(COUNTED_INPUT, 13, "counted", -1, None)),
        # Counted wins over clamped: the row's figures are not all the provider's.
        (10**8, "x", UpstreamUsage(MAX_TOKEN_COUNT, COUNTED_OUTPUT, "counted", 10**8, None)),
    ],
)
def test_each_side_is_reported_clamped_or_counted(
    reported_input: object, reported_output: object, expected: UpstreamUsage
) -> None:
    assert resolve(reported_input, reported_output) == expected


def test_output_is_counted_only_when_it_is_needed() -> None:
    calls: list[int] = []

    def count() -> int:
        calls.append(1)
        return COUNTED_OUTPUT

    resolve_usage(17, 13, counted_input=COUNTED_INPUT, count_output=count)
    assert calls == []


def test_an_answer_cut_short_settles_at_least_what_was_relayed() -> None:
    assert resolve(17, 3, complete=False) == UpstreamUsage(17, COUNTED_OUTPUT, "counted", None, 3)
    assert resolve(17, 30, complete=False) == UpstreamUsage(17, 30, "reported")
    assert resolve(17, None, complete=False) == UpstreamUsage(17, COUNTED_OUTPUT, "counted")


def test_a_count_beyond_the_limit_is_settled_at_the_limit() -> None:
    usage = resolve_usage(
        None, None, counted_input=MAX_TOKEN_COUNT * 3, count_output=lambda: MAX_TOKEN_COUNT * 2
    )
    assert usage == UpstreamUsage(MAX_TOKEN_COUNT, MAX_TOKEN_COUNT, "counted")


def test_usage_of_keeps_figures_as_reported() -> None:
    assert usage_of("openai", {"prompt_tokens": "42", "completion_tokens": -5}) == ("42", -5)
    assert usage_of("openai", None) == (None, None)
    cached = {"input_tokens": 10, "cache_read_input_tokens": 5, "output_tokens": 2}
    assert usage_of("anthropic", cached) == (15, 2)
    bad = {"input_tokens": 10, "cache_creation_input_tokens": "many", "output_tokens": 2}
    assert usage_of("anthropic", bad) == ("many", 2)
    assert usage_of("anthropic", {"input_tokens": -3, "cache_read_input_tokens": 5}) == (-3, None)
