"""Money as answers show it (domain/money.py): at most 6 decimal places."""

from __future__ import annotations

from decimal import Decimal

import pytest

from llmquota.domain.money import money_text


@pytest.mark.parametrize(
    ("amount", "shown"),
    [
        (Decimal("0.01996000000000000000"), "0.01996"),  # the 402 of issue 22
        (Decimal("0.0200"), "0.02"),
        (Decimal("1200.000000"), "1200"),
        (Decimal("0.0000004"), "0"),
        (Decimal("0.0000005"), "0"),  # half to even
        (Decimal("0.0000015"), "0.000002"),
        (Decimal("-0.25"), "-0.25"),
        (Decimal("-0.0000001"), "0"),
        (Decimal("123456789.1234567"), "123456789.123457"),
    ],
)
def test_money_is_a_decimal_string_of_at_most_6_places(amount: Decimal, shown: str) -> None:
    assert money_text(amount) == shown
