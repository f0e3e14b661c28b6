"""Money as every answer shows it: a decimal string, at most 6 decimal places.

Pure. Balances and costs are numeric in PostgreSQL, where a price per
million tokens times a token count carries 20 decimal places; a person (and
a JSON client) gets the amount to the millionth of the currency unit,
without trailing zeros: "0.01996", "0.02", "1200". A JSON number is never
used: it would have lost cents before anyone read it.
"""

from __future__ import annotations

from decimal import ROUND_HALF_EVEN, Decimal

MONEY_PLACES = Decimal("0.000001")


def money_text(amount: Decimal) -> str:
    """`amount` rounded to 6 decimal places (half to even), without trailing zeros."""
    rounded = amount.quantize(MONEY_PLACES, rounding=ROUND_HALF_EVEN)
    text = format(rounded.normalize(), "f")
    return "0" if text in ("-0", "0") else text
