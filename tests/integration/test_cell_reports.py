"""Finance over a database of cells: prices in every cell, reports over all of them.

Each cell keeps its tenants' ledger and its own report functions; the
database's own `reporting` schema reads the cell of the session that calls
it, so a cell's service and finance's SQL at a cell's DSN read `reporting`
as in one deployment. At the database's own DSN, `llmquota report` runs a
report in every cell and merges the answers (finance/cell_reports.py),
`prices set` and `prices import` write every cell, and a command about one
tenant goes to the tenant's cell. Also run on CI's Citus leg, the cells on
the two workers.
"""

from __future__ import annotations

import asyncio
import json
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

import asyncpg
import pytest

from llmquota.admission.cells import CellLimiters
from llmquota.config import Settings
from llmquota.domain.cells import cell_of
from llmquota.domain.policy import Policy
from llmquota.store.cells import build_cells, in_cell
from tests.support import APP_ROLE, dsn_as, run_cli

pytestmark = pytest.mark.citus

CELLS = 2
# Two tenants in each cell (cell_of), each with its own usage.
USAGE = {
    "tenant-00": (100, 10),
    "tenant-01": (200, 20),
    "tenant-04": (300, 30),
    "tenant-05": (400, 6),
}


@pytest.fixture
async def books(empty_database_dsn: str, settings: Settings) -> str:
    """Cells with a price for gpt-4o, and one settled request per tenant."""
    await asyncio.to_thread(build_cells, empty_database_dsn, CELLS)
    assert sorted(cell_of(t, CELLS) for t in USAGE) == [1, 1, 2, 2]
    priced = await asyncio.to_thread(
        run_cli, "prices", "set", "--model", "gpt-4o", "--input-per-million", "2",
        "--output-per-million", "8", "--set-by", "finance", dsn=empty_database_dsn,
    )  # fmt: skip
    assert len(priced.stdout.splitlines()) == CELLS  # one version in each cell
    async with await CellLimiters.connect(
        dsn_as(empty_database_dsn, APP_ROLE), settings, rebalance_seconds=None
    ) as cells:
        for tenant, (used_in, used_out) in USAGE.items():
            limiter = cells.for_tenant(tenant)
            await limiter.store.put_policy(
                "tenant", tenant, None, Policy(tokens_per_minute=60, token_burst=10_000)
            )
            admitted = await limiter.admit(
                tenant=tenant, model="gpt-4o", input_tokens=used_in, max_tokens=100
            )
            await admitted.settle(input_tokens=used_in, output_tokens=used_out)
    return empty_database_dsn


def _period() -> list[str]:
    today = datetime.now(UTC).date()
    return ["--from", today.isoformat(), "--to", (today + timedelta(days=1)).isoformat()]


async def _report(dsn: str, name: str, *more: str, check: bool = True) -> Any:
    done = await asyncio.to_thread(
        run_cli, "report", name, *_period(), "--format", "json", *more, dsn=dsn, check=check
    )
    return json.loads(done.stdout) if done.returncode == 0 else done


def _cost(used_in: int, used_out: int) -> Decimal:
    return (Decimal(used_in) * 2 + Decimal(used_out) * 8) / 1_000_000


async def test_a_report_at_the_databases_dsn_covers_every_cell(books: str) -> None:
    rows = await _report(books, "usage_daily")
    assert [(r["tenant"], r["input_tokens"], r["output_tokens"]) for r in rows] == [
        (tenant, used_in, used_out) for tenant, (used_in, used_out) in sorted(USAGE.items())
    ]
    assert [Decimal(r["cost_usd"]) for r in rows] == [
        _cost(*USAGE[tenant]) for tenant in sorted(USAGE)
    ]
    # The same rows as each cell's own report at its DSN, together.
    per_cell = [await _report(in_cell(books, f"cell_{k}"), "usage_daily") for k in (1, 2)]
    assert sorted(per_cell[0] + per_cell[1], key=lambda r: r["tenant"]) == rows
    assert {r["tenant"] for r in per_cell[0]} == {"tenant-00", "tenant-01"}


async def test_totals_add_up_and_ranks_are_drawn_again_over_every_cell(books: str) -> None:
    [day] = await _report(books, "reconciliation_daily")
    assert (day["model"], day["requests"]) == ("gpt-4o", len(USAGE))
    assert day["input_tokens"] == sum(used_in for used_in, _ in USAGE.values())
    assert Decimal(day["cost_usd"]) == sum(_cost(*u) for u in USAGE.values())
    ranked = await _report(books, "top_tenants")
    by_cost = sorted(USAGE, key=lambda t: _cost(*USAGE[t]), reverse=True)
    assert [(r["rank"], r["tenant"]) for r in ranked] == list(enumerate(by_cost, start=1))


async def test_a_report_that_does_not_add_up_runs_for_one_tenant_in_its_cell(books: str) -> None:
    refused = await _report(books, "reservation_accuracy", check=False)
    assert refused.returncode == 2
    assert "report reservation_accuracy does not add up over cells" in refused.stderr
    [one] = await _report(books, "reservation_accuracy", "--tenant", "tenant-04")
    assert one["reservations"] == 1
    # Any report for one tenant: its cell's answer.
    [usage] = await _report(books, "usage_daily", "--tenant", "tenant-05")
    assert (usage["tenant"], usage["input_tokens"]) == ("tenant-05", 400)


async def test_reporting_at_a_cells_dsn_reads_that_cell_and_the_databases_dsn_is_told_where(
    books: str,
) -> None:
    # What names `reporting` (finance's SQL, the console, the oversubscription
    # endpoint) reads the session's cell.
    connection = await asyncpg.connect(in_cell(books, "cell_2"))
    try:
        tenants = await connection.fetch(
            "SELECT DISTINCT tenant FROM reporting.ledger_entries ORDER BY 1"
        )
        assert [r["tenant"] for r in tenants] == ["tenant-04", "tenant-05"]
        top = await connection.fetch(
            "SELECT tenant FROM reporting.top_tenants(current_date, current_date + 1)"
        )
        assert [r["tenant"] for r in top] == ["tenant-05", "tenant-04"]
    finally:
        await connection.close()
    outside = await asyncpg.connect(books)
    try:
        with pytest.raises(asyncpg.InvalidSchemaNameError, match="reads one cell"):
            await outside.fetch("SELECT * FROM reporting.ledger_entries")
    finally:
        await outside.close()


async def test_prices_are_kept_alike_and_one_cells_rows_are_not_exported_as_the_databases(
    books: str,
) -> None:
    listed = json.loads(
        (await asyncio.to_thread(run_cli, "prices", "list", "--format", "json", dsn=books)).stdout
    )
    assert [(p["model"], Decimal(p["input_usd_per_million"])) for p in listed] == [("gpt-4o", 2)]
    refused = await asyncio.to_thread(run_cli, "ledger", "export", dsn=books, check=False)
    assert refused.returncode == 2
    assert "this database holds 2 cells: run this command at a cell's DSN" in refused.stderr
    exported = await asyncio.to_thread(run_cli, "ledger", "export", dsn=in_cell(books, "cell_1"))
    assert len(exported.stdout.splitlines()) == 2
    # An adjustment names its tenant: it goes to the tenant's cell.
    await asyncio.to_thread(
        run_cli, "ledger", "adjust", "--tenant", "tenant-04", "--tokens", "-20",
        "--reason", "refund", "--model", "gpt-4o", dsn=books,
    )  # fmt: skip
    again = await asyncio.to_thread(run_cli, "ledger", "export", dsn=in_cell(books, "cell_2"))
    assert [json.loads(line)["entry_kind"] for line in again.stdout.splitlines()] == [
        "usage",
        "usage",
        "adjustment",
    ]


async def test_building_again_keeps_what_finance_made_on_reporting(books: str) -> None:
    # The database-level reporting schema is brought up to date in place by
    # every `migrate --cells`: a view an analyst made on it survives.
    connection = await asyncpg.connect(books)
    try:
        await connection.execute(
            "CREATE VIEW public.finance_totals AS"
            " SELECT tenant, sum(total_tokens) AS tokens FROM reporting.ledger_entries"
            " GROUP BY tenant"
        )
    finally:
        await connection.close()
    again = await asyncio.to_thread(run_cli, "migrate", "--cells", "2", dsn=books)
    assert "database holds 2 cells" in again.stdout
    cell = await asyncpg.connect(in_cell(books, "cell_1"))
    try:
        totals = await cell.fetch("SELECT tenant FROM public.finance_totals ORDER BY 1")
        assert [r["tenant"] for r in totals] == ["tenant-00", "tenant-01"]
    finally:
        await cell.close()


# An older release's database-level reports: usage_daily with another result,
# and a report and a view the cells no longer have.
OLDER_REPORTS = (
    "DROP FUNCTION reporting.usage_daily(date, date, text)",
    "CREATE FUNCTION reporting.usage_daily(p_from date, p_to date, p_tenant text DEFAULT NULL)"
    " RETURNS TABLE (stale integer) LANGUAGE sql AS 'SELECT 1'",
    "CREATE FUNCTION reporting.retired_report() RETURNS SETOF integer LANGUAGE plpgsql"
    " AS 'BEGIN RETURN QUERY EXECUTE format(''SELECT 1'', reporting.session_reports()); END'",
    "CREATE VIEW reporting.retired_view AS SELECT 1 AS x",
    "CREATE TRIGGER read_only INSTEAD OF INSERT OR UPDATE OR DELETE ON reporting.retired_view"
    " FOR EACH ROW EXECUTE FUNCTION reporting.read_only()",
)
USAGE_DAILY_RESULT = (
    "SELECT pg_get_function_result('reporting.usage_daily(date, date, text)'::regprocedure)"
)


async def _upgrade_due(books: str, *statements: str) -> None:
    """`statements` at the database's DSN, and cell 2 as an older release left
    its scripts, so that the next build upgrades it."""
    connection = await asyncpg.connect(books)
    try:
        for statement in statements:
            await connection.execute(statement)
        await connection.execute("UPDATE cell_2.schema_repeatables SET checksum = repeat('0', 64)")
    finally:
        await connection.close()


async def test_an_upgrade_keeps_what_finance_made_and_replaces_only_the_changed_reports(
    books: str,
) -> None:
    connection = await asyncpg.connect(books)
    try:
        made = await connection.fetchval(USAGE_DAILY_RESULT)
    finally:
        await connection.close()
    await _upgrade_due(
        books,
        "CREATE VIEW public.finance_totals AS"
        " SELECT tenant, sum(total_tokens) AS tokens FROM reporting.ledger_entries"
        " GROUP BY tenant",
        # finance's own objects in the schema itself are theirs too
        "CREATE VIEW reporting.finance_own AS SELECT 1 AS x",
        "CREATE FUNCTION reporting.finance_days() RETURNS SETOF date LANGUAGE sql"
        " AS 'SELECT current_date'",
        *OLDER_REPORTS,
    )

    again = await asyncio.to_thread(run_cli, "migrate", "--cells", "2", dsn=books)

    assert "cell_2: upgraded (scripts " in again.stdout
    cell = await asyncpg.connect(in_cell(books, "cell_1"))
    try:
        # finance's view was kept through the upgrade, and reads as before
        totals = await cell.fetch("SELECT tenant FROM public.finance_totals ORDER BY 1")
        assert [r["tenant"] for r in totals] == ["tenant-00", "tenant-01"]
        # the changed report was made again with the cells' result, and runs
        assert await cell.fetchval(USAGE_DAILY_RESULT) == made
        today = datetime.now(UTC).date()
        rows = await cell.fetch(
            "SELECT tenant FROM reporting.usage_daily($1, $2) ORDER BY 1",
            today,
            today + timedelta(days=1),
        )
        assert [r["tenant"] for r in rows] == ["tenant-00", "tenant-01"]
        # what the cells no longer have is gone; what finance put there is not
        assert await cell.fetchval("SELECT to_regclass('reporting.retired_view')") is None
        assert await cell.fetchval("SELECT to_regproc('reporting.retired_report')") is None
        assert await cell.fetchval("SELECT x FROM reporting.finance_own") == 1
        assert await cell.fetchval("SELECT count(*) FROM reporting.finance_days()") == 1
    finally:
        await cell.close()


async def test_a_changed_report_that_finance_built_on_is_kept_and_named_and_the_rest_updated(
    books: str,
) -> None:
    await _upgrade_due(
        books,
        *OLDER_REPORTS,
        "CREATE VIEW public.finance_daily AS"
        " SELECT * FROM reporting.usage_daily(current_date, current_date + 1)",
    )

    refused = await asyncio.to_thread(run_cli, "migrate", "--cells", "2", dsn=books, check=False)

    assert refused.returncode == 2
    assert refused.stderr.startswith(
        "llmquota migrate: the 2 cells are built and the database's reporting schema is up to"
        " date but for what finance built on reports this release changes or retires: cannot"
        " drop function reporting.usage_daily(date,date,text) because other objects depend on"
        " it (view finance_daily depends on function reporting.usage_daily(date,date,text))."
    )
    assert "Traceback" not in refused.stderr
    connection = await asyncpg.connect(books)
    try:
        # finance's view and the report it stands on are as they were ...
        assert await connection.fetchval(USAGE_DAILY_RESULT) == "TABLE(stale integer)"
        assert await connection.fetchval("SELECT to_regclass('public.finance_daily')") is not None
        # ... and the rest is up to date: the retired report and view are gone
        assert await connection.fetchval("SELECT to_regclass('reporting.retired_view')") is None
        assert await connection.fetchval("SELECT to_regproc('reporting.retired_report')") is None
    finally:
        await connection.close()

    # Done as told: finance's view dropped, the build passes and the report is
    # the cells' own again. (Making the view again is finance's step; on Citus
    # it was refused, docs/scaling.md says why.)
    await _upgrade_due(books, "DROP VIEW public.finance_daily")
    again = await asyncio.to_thread(run_cli, "migrate", "--cells", "2", dsn=books)
    assert "database holds 2 cells" in again.stdout
    connection = await asyncpg.connect(books)
    try:
        assert await connection.fetchval(USAGE_DAILY_RESULT) != "TABLE(stale integer)"
    finally:
        await connection.close()
