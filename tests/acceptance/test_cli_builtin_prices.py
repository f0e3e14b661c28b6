"""`llmquota prices import --builtin` as a subprocess on a real database.

The shipped table (src/llmquota/finance/builtin_prices.csv) becomes price
versions set by 'llmquota builtin'; a second import writes nothing; a model
the operator priced (by name or by a glob) keeps the operator's price; and a
request's cost is computed from a builtin price.
"""

from __future__ import annotations

from decimal import Decimal as D

import asyncpg
import pytest

from llmquota.admission.limiter import Limiter
from llmquota.domain.errors import InvalidRequest
from llmquota.finance.builtin_prices import load_builtin_prices
from tests.support import run_cli

VERSIONS = (
    "SELECT model, effective_from, input_usd_per_million, output_usd_per_million, set_at,"
    " set_by, backdate_reason FROM model_prices ORDER BY model, effective_from, set_at"
)
MONTH_START = "SELECT date_trunc('month', now() AT TIME ZONE 'UTC') AT TIME ZONE 'UTC'"


def summary(stdout: str) -> str:
    return stdout.splitlines()[-1]


async def test_import_adds_each_model_in_force_from_this_month_and_a_second_adds_nothing(
    app_dsn: str, db: asyncpg.Connection
) -> None:
    table = load_builtin_prices()
    models = {p.model for p in table}
    # Every row of the table is dated before this month: per model only the
    # latest row is in force anywhere from now on, the others are superseded.
    first = run_cli("prices", "import", "--builtin", dsn=app_dsn)
    assert summary(first.stdout) == (
        f"builtin prices: {len(table)} rows: added {len(models)}, unchanged 0, operator 0, "
        f"superseded {len(table) - len(models)}"
    )
    assert len(models) == 50 and len(table) == 53
    versions = await db.fetch(VERSIONS)
    month_start = await db.fetchval(MONTH_START)
    assert len(versions) == 50
    assert {v["set_by"] for v in versions} == {"llmquota builtin"}
    assert {v["effective_from"] for v in versions} == {month_start}  # never a closed month
    by_model = {v["model"]: v for v in versions}
    # The latest price of a model the table repriced: gpt-4o 5/15 then 2.50/10.
    assert (by_model["gpt-4o"]["input_usd_per_million"],
            by_model["gpt-4o"]["output_usd_per_million"]) == (D("2.5"), D("10"))  # fmt: skip
    assert (by_model["o3"]["input_usd_per_million"],
            by_model["o3"]["output_usd_per_million"]) == (D("2"), D("8"))  # fmt: skip
    assert "in force from 2024-10-02" in by_model["gpt-4o"]["backdate_reason"]

    second = run_cli("prices", "import", "--builtin", dsn=app_dsn)
    assert summary(second.stdout) == (
        "builtin prices: 53 rows: added 0, unchanged 50, operator 0, superseded 3"
    )
    assert await db.fetch(VERSIONS) == versions  # not one version more, none changed


async def test_an_operators_price_wins_by_name_or_glob_before_and_after_an_import(
    app_dsn: str, db: asyncpg.Connection
) -> None:
    run_cli(
        "prices", "set", "--model", "gpt-4o", "--input-per-million", "1",
        "--output-per-million", "2", "--set-by", "alice", dsn=app_dsn,
    )  # fmt: skip
    run_cli(
        "prices", "set", "--model", "claude-opus-*", "--input-per-million", "7",
        "--output-per-million", "7", "--set-by", "bob", dsn=app_dsn,
    )  # fmt: skip
    first = run_cli("prices", "import", "--builtin", dsn=app_dsn)
    # gpt-4o (2 rows: 1 kept back, 1 superseded) and the 6 claude-opus names.
    assert summary(first.stdout) == (
        "builtin prices: 53 rows: added 43, unchanged 0, operator 8, superseded 2"
    )
    assert "operator: gpt-4o from" in first.stdout
    assert "operator: claude-opus-4-5 from" in first.stdout
    builtin = {r["model"] for r in await db.fetch(
        "SELECT model FROM model_prices WHERE set_by = 'llmquota builtin'")}  # fmt: skip
    assert "gpt-4o" not in builtin and not any(m.startswith("claude-opus-") for m in builtin)
    assert "claude-sonnet-4-5" in builtin and "gpt-4o-mini" in builtin

    # After the import the operator prices gpt-4o-mini: theirs is in force,
    # and importing again neither adds nor changes a version.
    run_cli(
        "prices", "set", "--model", "gpt-4o-mini", "--input-per-million", "3",
        "--output-per-million", "4", "--set-by", "alice", dsn=app_dsn,
    )  # fmt: skip
    before = await db.fetch(VERSIONS)
    second = run_cli("prices", "import", "--builtin", dsn=app_dsn)
    assert summary(second.stdout) == (
        "builtin prices: 53 rows: added 0, unchanged 42, operator 9, superseded 2"
    )
    assert await db.fetch(VERSIONS) == before
    later = await db.fetchval("SELECT clock_timestamp() + interval '1 hour'")
    costs = await db.fetch(
        "SELECT m, lq_cost(m, 1000000, 1000000, $1) AS c"
        " FROM unnest(ARRAY['gpt-4o', 'gpt-4o-mini', 'claude-opus-4-5', 'claude-sonnet-4-5'])"
        " WITH ORDINALITY AS u(m, o) ORDER BY o",
        later,
    )
    assert [r["c"] for r in costs] == [D("3"), D("7"), D("14"), D("18")]


async def test_the_builtin_name_is_not_an_operators_to_take(app_dsn: str) -> None:
    result = run_cli(
        "prices", "set", "--model", "gpt-4o", "--input-per-million", "1",
        "--output-per-million", "2", "--set-by", "llmquota builtin", dsn=app_dsn, check=False,
    )  # fmt: skip
    assert result.returncode == 2
    assert "the shipped price table's" in result.stderr


async def test_a_requests_cost_is_computed_from_a_builtin_price(
    app_dsn: str, limiter: Limiter, db: asyncpg.Connection
) -> None:
    run_cli("prices", "import", "--builtin", dsn=app_dsn)
    await limiter.store.ensure_tenant("acme")
    for model in ("gpt-4o-mini", "claude-haiku-4-5", "gemini-2.5-flash"):
        reservation = await limiter.admit(
            tenant="acme", model=model, input_tokens=200_000, max_tokens=300_000,
            lease_seconds=600,
        )  # fmt: skip
        await reservation.settle(input_tokens=200_000, output_tokens=100_000)
    rows = await db.fetch("SELECT model, cost_usd FROM reporting.ledger_entries ORDER BY entry_id")
    # 0.2 M input and 0.1 M output tokens at each model's builtin price:
    assert [(r["model"], r["cost_usd"]) for r in rows] == [
        ("gpt-4o-mini", D("0.09")),  # 0.2 * 0.15 + 0.1 * 0.60
        ("claude-haiku-4-5", D("0.7")),  # 0.2 * 1 + 0.1 * 5
        ("gemini-2.5-flash", D("0.31")),  # 0.2 * 0.30 + 0.1 * 2.50
    ]


def test_a_broken_table_is_refused_whole() -> None:
    header = "model,effective_from,input_usd_per_million,output_usd_per_million\n"
    source = "# source: https://example.com/pricing\n"
    with pytest.raises(InvalidRequest, match="no `# source"):
        load_builtin_prices(header + "gpt-4o,2024-05-13,5,15\n")
    with pytest.raises(InvalidRequest, match="repeats gpt-4o from 2024-05-13"):
        load_builtin_prices(header + source + "gpt-4o,2024-05-13,5,15\ngpt-4o,2024-05-13,4,9\n")
    with pytest.raises(InvalidRequest, match="line 3: model must be ASCII letters"):
        load_builtin_prices(header + source + "gpt-*,2024-05-13,5,15\n")
    with pytest.raises(InvalidRequest, match="line 3: input must be a decimal"):
        load_builtin_prices(header + source + "gpt-4o,2024-05-13,-5,15\n")
    (one,) = load_builtin_prices(header + source + "gpt-4o,2024-05-13,5,15\n")
    assert (one.input_usd_per_million, one.output_usd_per_million) == (D(5), D(15))
    assert all(p.source.startswith("https://") for p in load_builtin_prices())
