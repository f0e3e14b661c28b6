"""A small ledger whose reports were worked out by hand (see the comments).

Prices, per million tokens (input / output):
  gpt-4o    2.50 / 10.00 from 2025-01-01, then 2.00 / 8.00 from 2025-03-15
  claude-3  3.00 / 15.00 from 2025-01-01
  mystery   no price (unpriced)

Ledger rows in 2025 (UTC; tokens in / out; reserved) and their cost in USD:
  acme r1   03-10 10:00     chat  gpt-4o   ok      1000/500     2000  .0025+.005 = .0075
  acme r2   03-10 23:59:59  chat  gpt-4o   ok      3000/1000    5000  .0075+.01  = .0175
  acme r3   03-20 12:00     chat  gpt-4o   ok     10000/2000   12000  .02+.016   = .036
  acme r4   03-20 13:00     summ  claude-3 error    200/0       4200  .0006
  acme r5   03-21 09:00     summ  claude-3 expired    0/0       8000  0
  acme r5   03-22 08:00     summ  claude-3 late    1500/2500       0  .0045+.0375 = .042
  acme adj  03-25 12:00     -     gpt-4o   adjust     0/-1000      0  -.008
  beta r6   03-11 00:00     -     claude-3 ok    100000/20000 150000  .3+.3 = .6
  beta r7   03-11 05:00     -     mystery  ok        50/50       200  unpriced
  beta r10  03-28 10:00     -     gpt-4o   expired    0/0        500  0 (never settled)
  beta r8   03-31 23:00     -     gpt-4o   cancel   400/100     1000  .0008+.0008 = .0016
  beta r9   04-01 01:00     -     gpt-4o   ok   1000000/1000000 3e6  2+8 = 10
  gamma r11 02-28 23:59:59.999999 gpt-4o   ok   1000000/0       1e6  2.5 (February)
(summ = summarize, cancel = cancelled, adjust = adjustment)
"""

from __future__ import annotations

import uuid
from datetime import UTC, date, datetime
from decimal import Decimal as D
from typing import Any

import asyncpg

# fmt: off
MARCH = (date(2025, 3, 1), date(2025, 4, 1))
MARCH_APRIL = (date(2025, 3, 1), date(2025, 5, 1))
EMPTY = (date(2024, 1, 1), date(2024, 2, 1))

PRICES = [
    ("gpt-4o", datetime(2025, 1, 1, tzinfo=UTC), D("2.50"), D("10.00")),
    ("gpt-4o", datetime(2025, 3, 15, tzinfo=UTC), D("2.00"), D("8.00")),
    ("claude-3", datetime(2025, 1, 1, tzinfo=UTC), D("3.00"), D("15.00")),
]

R = {name: uuid.UUID(int=i) for i, name in enumerate(
    ["r1", "r2", "r3", "r4", "r5", "r6", "r7", "r8", "r9", "r10", "r11"], start=1
)}


def _at(month: int, day: int, hour: int = 0, minute: int = 0, *rest: int) -> datetime:
    return datetime(2025, month, day, hour, minute, *rest, tzinfo=UTC)


# (reservation, kind, tenant, route, model, in, out, reserved, outcome, recorded_at, reason)
ROWS: list[tuple[Any, ...]] = [
    ("r1", "usage", "acme", "chat", "gpt-4o", 1000, 500, 2000, "ok", _at(3, 10, 10)),
    ("r2", "usage", "acme", "chat", "gpt-4o", 3000, 1000, 5000, "ok", _at(3, 10, 23, 59, 59)),
    ("r3", "usage", "acme", "chat", "gpt-4o", 10000, 2000, 12000, "ok", _at(3, 20, 12)),
    ("r4", "usage", "acme", "summarize", "claude-3", 200, 0, 4200, "error", _at(3, 20, 13)),
    ("r5", "usage", "acme", "summarize", "claude-3", 0, 0, 8000, "expired", _at(3, 21, 9)),
    ("r5", "late", "acme", "summarize", "claude-3", 1500, 2500, 0, "late", _at(3, 22, 8)),
    (None, "adjustment", "acme", None, "gpt-4o", 0, -1000, 0, "adjustment", _at(3, 25, 12)),
    ("r6", "usage", "beta", None, "claude-3", 100000, 20000, 150000, "ok", _at(3, 11)),
    ("r7", "usage", "beta", None, "mystery", 50, 50, 200, "ok", _at(3, 11, 5)),
    ("r10", "usage", "beta", None, "gpt-4o", 0, 0, 500, "expired", _at(3, 28, 10)),
    ("r8", "usage", "beta", None, "gpt-4o", 400, 100, 1000, "cancelled", _at(3, 31, 23)),
    ("r9", "usage", "beta", None, "gpt-4o", 1000000, 1000000, 3000000, "ok", _at(4, 1, 1)),
    ("r11", "usage", "gamma", None, "gpt-4o", 1000000, 0, 1000000, "ok",
     _at(2, 28, 23, 59, 59, 999999)),
]


# fmt: on


async def load(db: asyncpg.Connection) -> None:
    """Write the prices and rows (as the table owner, with their own times)."""
    await db.executemany(
        "INSERT INTO model_prices (model, effective_from, input_usd_per_million,"
        " output_usd_per_million) VALUES ($1, $2, $3, $4)",
        PRICES,
    )
    # March gets a partition of its own; the other months fall to DEFAULT.
    assert await db.fetchval("SELECT lq_create_ledger_partition('2025-03-01')") == "created"
    await db.executemany(
        "INSERT INTO usage_ledger (reservation_id, entry_kind, tenant, route, model, input_tokens,"
        " output_tokens, reserved_tokens, outcome, policy_version, recorded_at, reason)"
        " VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, 7, $10, $11)",
        [
            (
                R[r] if r else None,
                kind,
                *rest,
                "billing correction" if kind == "adjustment" else None,
            )
            for r, kind, *rest in ROWS
        ],
    )


# fmt: off
USAGE_DAILY_COLUMNS = (
    "day", "tenant", "route", "model", "requests", "input_tokens", "output_tokens",
    "total_tokens", "cost_usd", "unpriced_tokens",
)
USAGE_DAILY_MARCH = [
    (date(2025, 3, 10), "acme", "chat", "gpt-4o", 2, 4000, 1500, 5500, D("0.025"), 0),
    (date(2025, 3, 11), "beta", None, "claude-3", 1, 100000, 20000, 120000, D("0.6"), 0),
    (date(2025, 3, 11), "beta", None, "mystery", 1, 50, 50, 100, D("0"), 100),
    (date(2025, 3, 20), "acme", "chat", "gpt-4o", 1, 10000, 2000, 12000, D("0.036"), 0),
    (date(2025, 3, 20), "acme", "summarize", "claude-3", 1, 200, 0, 200, D("0.0006"), 0),
    (date(2025, 3, 21), "acme", "summarize", "claude-3", 1, 0, 0, 0, D("0"), 0),
    (date(2025, 3, 22), "acme", "summarize", "claude-3", 0, 1500, 2500, 4000, D("0.042"), 0),
    (date(2025, 3, 25), "acme", None, "gpt-4o", 0, 0, -1000, -1000, D("-0.008"), 0),
    (date(2025, 3, 28), "beta", None, "gpt-4o", 1, 0, 0, 0, D("0"), 0),
    (date(2025, 3, 31), "beta", None, "gpt-4o", 1, 400, 100, 500, D("0.0016"), 0),
]

INVOICE_MONTHLY_MARCH_APRIL = [
    # acme: the adjustment (no route) first, then chat at the old and the new
    # gpt-4o price, then summarize (r4 + r5's late usage: 0.0006 + 0.042).
    (date(2025, 3, 1), "acme", None, "gpt-4o", D("2.000000"), D("8.000000"),
     0, 0, -1000, -1000, D("-0.008"), D("-0.01")),
    (date(2025, 3, 1), "acme", "chat", "gpt-4o", D("2.500000"), D("10.000000"),
     2, 4000, 1500, 5500, D("0.025"), D("0.03")),
    (date(2025, 3, 1), "acme", "chat", "gpt-4o", D("2.000000"), D("8.000000"),
     1, 10000, 2000, 12000, D("0.036"), D("0.04")),
    (date(2025, 3, 1), "acme", "summarize", "claude-3", D("3.000000"), D("15.000000"),
     2, 1700, 2500, 4200, D("0.0426"), D("0.04")),
    (date(2025, 3, 1), "beta", None, "claude-3", D("3.000000"), D("15.000000"),
     1, 100000, 20000, 120000, D("0.6"), D("0.60")),
    (date(2025, 3, 1), "beta", None, "gpt-4o", D("2.000000"), D("8.000000"),
     2, 400, 100, 500, D("0.0016"), D("0.00")),
    (date(2025, 3, 1), "beta", None, "mystery", None, None, 1, 50, 50, 100, None, None),
    (date(2025, 4, 1), "beta", None, "gpt-4o", D("2.000000"), D("8.000000"),
     1, 1000000, 1000000, 2000000, D("10"), D("10.00")),
]

TOP_TENANTS_MARCH = [
    # beta: 0.6 + 0.0016 (+ 100 unpriced); acme: 0.025 + 0.036 + 0.0426 - 0.008
    (1, "beta", 4, 120600, D("0.6016"), 100),
    (2, "acme", 5, 20700, D("0.0956"), 0),
]
TOP_TENANTS_MARCH_APRIL = [
    (1, "beta", 5, 2120600, D("10.6016"), 100),
    (2, "acme", 5, 20700, D("0.0956"), 0),
]

ACCURACY_MARCH = [
    # (route, model, reservations, unsettled expired, reserved, charged, p50, p95, unused)
    (None, "claude-3", 1, 0, 150000, 120000, D("0.8000"), D("0.8000"), 30000),
    # r8 1000 -> 500; r10 expired and never settled
    (None, "gpt-4o", 2, 1, 1000, 500, D("0.5000"), D("0.5000"), 500),
    (None, "mystery", 1, 0, 200, 100, D("0.5000"), D("0.5000"), 100),
    # ratios 0.75, 0.8, 1.0: p50 0.8; p95 = 0.8 + 0.9 * (1.0 - 0.8) = 0.98
    ("chat", "gpt-4o", 3, 0, 19000, 17500, D("0.8000"), D("0.9800"), 1500),
    # ratios 200/4200 = 0.047619 and (late) 4000/8000 = 0.5:
    # p50 = 0.273810, p95 = 0.047619 + 0.95 * 0.452381 = 0.477381
    ("summarize", "claude-3", 2, 0, 12200, 4200, D("0.2738"), D("0.4774"), 8000),
]

RECONCILIATION_MARCH = [
    # (day, model, requests, in, out, total, cost, unpriced, expired, expired reserved,
    #  late tokens, adjustment tokens)
    (date(2025, 3, 10), "gpt-4o", 2, 4000, 1500, 5500, D("0.025"), 0, 0, 0, 0, 0),
    (date(2025, 3, 11), "claude-3", 1, 100000, 20000, 120000, D("0.6"), 0, 0, 0, 0, 0),
    (date(2025, 3, 11), "mystery", 1, 50, 50, 100, D("0"), 100, 0, 0, 0, 0),
    (date(2025, 3, 20), "claude-3", 1, 200, 0, 200, D("0.0006"), 0, 0, 0, 0, 0),
    (date(2025, 3, 20), "gpt-4o", 1, 10000, 2000, 12000, D("0.036"), 0, 0, 0, 0, 0),
    (date(2025, 3, 21), "claude-3", 1, 0, 0, 0, D("0"), 0, 1, 8000, 0, 0),
    (date(2025, 3, 22), "claude-3", 0, 1500, 2500, 4000, D("0.042"), 0, 0, 0, 4000, 0),
    (date(2025, 3, 25), "gpt-4o", 0, 0, -1000, -1000, D("-0.008"), 0, 0, 0, 0, -1000),
    (date(2025, 3, 28), "gpt-4o", 1, 0, 0, 0, D("0"), 0, 1, 500, 0, 0),
    (date(2025, 3, 31), "gpt-4o", 1, 400, 100, 500, D("0.0016"), 0, 0, 0, 0, 0),
]

EXPIRED_MARCH = [
    (_at(3, 21, 9), "acme", "summarize", "claude-3", R["r5"], 8000, 7,
     _at(3, 22, 8), 1500, 2500, D("0.042"), None),
    (_at(3, 28, 10), "beta", None, "gpt-4o", R["r10"], 500, 7, None, None, None, None, None),
]
# fmt: on
