"""Issue 20: prices are append-only versions an invoice can be traced to.

Set through `LedgerStore` as llmquota_app (the role `llmquota prices set`
runs as): every change is a new version with who set it; one taking effect
in the past needs a reason and never reaches into a closed month, so a
closed month's invoice stays what it was; a `*` glob prices every model it
matches, the exact name first.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from datetime import datetime, timedelta
from decimal import Decimal as D

import asyncpg
import pytest

from llmquota.admission.limiter import Limiter
from llmquota.domain.errors import InvalidRequest
from llmquota.finance.ledger import LedgerStore


@pytest.fixture
async def prices(app_dsn: str) -> AsyncIterator[LedgerStore]:
    connection = await asyncpg.connect(app_dsn)
    yield LedgerStore(connection)
    await connection.close()


async def _clock(db: asyncpg.Connection) -> tuple[datetime, datetime]:
    """(now, the start of this UTC month), by the database clock."""
    row = await db.fetchrow(
        "SELECT clock_timestamp() AS now,"
        " date_trunc('month', clock_timestamp() AT TIME ZONE 'UTC') AT TIME ZONE 'UTC' AS month"
    )
    return row["now"], row["month"]


async def test_a_change_is_a_new_version_and_none_is_ever_edited(
    prices: LedgerStore, db: asyncpg.Connection
) -> None:
    now, _ = await _clock(db)
    tomorrow = now + timedelta(days=1)
    _, superseded = await prices.set_price(
        model="gpt-4o", input_usd_per_million=D("2.50"), output_usd_per_million=D("10"),
        set_by="alice", effective_from=tomorrow,
    )  # fmt: skip
    assert superseded is False
    _, superseded = await prices.set_price(
        model="gpt-4o", input_usd_per_million=D("2.00"), output_usd_per_million=D("8"),
        set_by="bob", effective_from=tomorrow,
    )  # fmt: skip
    assert superseded is True
    history = await prices.prices("gpt-4o")
    assert [(p.input_usd_per_million, p.set_by) for p in history] == [
        (D("2.50"), "alice"),
        (D("2.00"), "bob"),
    ]
    assert history[0].set_at < history[1].set_at
    # The later version is the one in force; the earlier stays on record.
    cost = await db.fetchval(
        "SELECT lq_cost('gpt-4o', 1000000, 1000000, $1)", tomorrow + timedelta(hours=1)
    )
    assert cost == D("10")
    roles = await db.fetch("SELECT set_by_role FROM model_prices ORDER BY set_at")
    assert [r["set_by_role"] for r in roles] == ["llmquota_app", "llmquota_app"]
    # Not even the owner edits a version.
    for statement in (
        "UPDATE model_prices SET input_usd_per_million = 0",
        "DELETE FROM model_prices",
        "TRUNCATE model_prices",
    ):
        with pytest.raises(asyncpg.InsufficientPrivilegeError, match="append-only"):
            await db.execute(statement)
    assert await db.fetchval("SELECT count(*) FROM model_prices") == 2


async def test_a_change_in_the_past_needs_a_reason_and_stays_in_this_month(
    prices: LedgerStore, db: asyncpg.Connection
) -> None:
    now, month = await _clock(db)
    earlier_today = max(month, now - timedelta(minutes=5))
    args = {"model": "gpt-4o", "input_usd_per_million": D("1"), "output_usd_per_million": D("2")}
    with pytest.raises(InvalidRequest, match="in the past"):
        await prices.set_price(**args, set_by="alice", effective_from=earlier_today)
    with pytest.raises(InvalidRequest, match="closed month"):
        await prices.set_price(
            **args, set_by="alice", effective_from=month - timedelta(seconds=1),
            backdate_reason="fix",
        )  # fmt: skip
    with pytest.raises(InvalidRequest, match="2000-01-01 or later"):
        await prices.set_price(
            **args, set_by="alice", effective_from=datetime.fromisoformat("0001-01-01T00:00Z"),
            backdate_reason="fix",
        )  # fmt: skip
    # Past the store's check, the function refuses -infinity (what asyncpg
    # sends for 0001-01-01) itself.
    with pytest.raises(asyncpg.InvalidParameterValueError, match="not between"):
        await db.fetch("SELECT * FROM lq_set_price('gpt-4o', '-infinity', 1, 1, 'x', 'fix')")
    with pytest.raises(InvalidRequest, match="nothing to backdate"):
        await prices.set_price(
            **args, set_by="alice", effective_from=now + timedelta(days=1), backdate_reason="x"
        )
    with pytest.raises(InvalidRequest, match="not between"):
        await prices.set_price(
            **args, set_by="alice", effective_from=datetime.fromisoformat("9999-01-01T00:00Z")
        )
    with pytest.raises(InvalidRequest, match="who set it"):
        await prices.set_price(**args, set_by=" ")
    assert await db.fetchval("SELECT count(*) FROM model_prices") == 0

    price, _ = await prices.set_price(
        **args, set_by="alice", effective_from=earlier_today,
        backdate_reason="provider repriced on the 1st",
    )  # fmt: skip
    assert (price.effective_from, price.set_by, price.backdate_reason) == (
        earlier_today,
        "alice",
        "provider repriced on the 1st",
    )
    assert price.set_at > price.effective_from


async def test_a_closed_month_invoice_does_not_change(
    prices: LedgerStore, db: asyncpg.Connection, reporting_dsn: str
) -> None:
    _, month = await _clock(db)
    last_month = month - timedelta(days=10)
    # Set-up as the owner: a price from 2020 and a row of last month.
    await db.execute(
        "INSERT INTO model_prices (model, effective_from, input_usd_per_million,"
        " output_usd_per_million, set_by) VALUES ('gpt-4o', '2020-01-01', 2.50, 10, 'setup')"
    )
    await db.execute(
        "INSERT INTO usage_ledger (reservation_id, entry_kind, tenant, model, input_tokens,"
        " output_tokens, reserved_tokens, outcome, recorded_at)"
        " VALUES ($1, 'usage', 'acme', 'gpt-4o', 1000000, 100000, 2000000, 'ok', $2)",
        uuid.uuid4(),
        last_month,
    )
    finance = await asyncpg.connect(reporting_dsn)
    try:
        invoice = "SELECT cost_usd FROM reporting.invoice_monthly($1::date, $2::date)"
        period = ((month - timedelta(days=20)).date().replace(day=1), month.date())
        assert await finance.fetchval(invoice, *period) == D("3.5")  # 2.50 + 0.1 * 10
        await prices.set_price(
            model="gpt-4o", input_usd_per_million=D("100"), output_usd_per_million=D("100"),
            set_by="mallory", effective_from=month, backdate_reason="reprice the month",
        )  # fmt: skip
        await prices.set_price(
            model="gpt-4o", input_usd_per_million=D("0.01"), output_usd_per_million=D("0.01"),
            set_by="mallory",
        )  # fmt: skip
        with pytest.raises(InvalidRequest, match="closed month"):
            await prices.set_price(
                model="gpt-4o", input_usd_per_million=D("0"), output_usd_per_million=D("0"),
                set_by="mallory", effective_from=last_month, backdate_reason="free",
            )  # fmt: skip
        assert await finance.fetchval(invoice, *period) == D("3.5")
    finally:
        await finance.close()


async def test_a_glob_price_prices_every_model_it_matches_the_exact_name_first(
    prices: LedgerStore, limiter: Limiter, db: asyncpg.Connection
) -> None:
    for model, price in (("gpt-4o*", "1"), ("gpt-4o-m*", "2"), ("gpt-4o-mini-x", "3"),
                         ("a_b*", "4")):  # fmt: skip
        await prices.set_price(
            model=model, input_usd_per_million=D(price), output_usd_per_million=D(price),
            set_by="alice",
        )  # fmt: skip
    await limiter.store.ensure_tenant("acme")
    for model in ("gpt-4o", "gpt-4o-2024", "gpt-4o-mini", "gpt-4o-mini-x", "aXb", "a_b-1"):
        reservation = await limiter.admit(
            tenant="acme", model=model, input_tokens=500_000, max_tokens=600_000,
            lease_seconds=600,
        )  # fmt: skip
        await reservation.settle(input_tokens=500_000, output_tokens=500_000)
    rows = await db.fetch("SELECT model, cost_usd FROM reporting.ledger_entries ORDER BY entry_id")
    # One million tokens each: the cost is the matched price per million.
    assert [(r["model"], r["cost_usd"]) for r in rows] == [
        ("gpt-4o", D("1")),  # the glob matches the bare name too
        ("gpt-4o-2024", D("1")),
        ("gpt-4o-mini", D("2")),  # the longer glob
        ("gpt-4o-mini-x", D("3")),  # the exact name
        ("aXb", None),  # `_` is a literal underscore, not LIKE's any-character
        ("a_b-1", D("4")),
    ]
    # Credits and quotas price through lq_cost: the same rule.
    costs = await db.fetch(
        "SELECT m, lq_cost(m, 500000, 500000, clock_timestamp()) AS c"
        " FROM unnest(ARRAY['gpt-4o-2024', 'gpt-4o-mini', 'gpt-4o-mini-x', 'aXb']) AS m"
    )
    assert [r["c"] for r in costs] == [D("1"), D("2"), D("3"), None]
