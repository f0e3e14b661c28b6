"""`llmquota report oversubscription` as a subprocess, as the read-only reporting role.

The account and ledger of tests/oversubscription_fixture.py, whose figures
were worked out by hand: the same numbers as the REST report and the view,
printed as every report prints (numerics as written: decimals are text in
JSON and CSV).
"""

from __future__ import annotations

import asyncio
import csv
import io
import json
from typing import Any

import asyncpg
import pytest

from llmquota.admin.service import AdminService
from llmquota.admission.limiter import Limiter
from llmquota.domain.plans import Ceiling
from tests import oversubscription_fixture as fx
from tests.support import REPORTING_ROLE, dsn_as, run_cli


async def _cli(dsn: str, *args: str, check: bool = True) -> Any:
    env = {"LLMQUOTA_REPORTING_DATABASE_URL": dsn_as(dsn, REPORTING_ROLE)}
    return await asyncio.to_thread(run_cli, "report", *args, dsn=dsn, env=env, check=check)


def _printed(expected: dict[str, Any]) -> dict[str, Any]:
    """The fixture's figures as the CLI's JSON writes them: decimals as text."""
    return {k: str(v) if k.endswith("ratio") else v for k, v in expected.items()}


@pytest.fixture
async def account(limiter: Limiter, db: asyncpg.Connection) -> None:
    await fx.set_up_limits(AdminService(limiter.store), db)
    await fx.seed_ledger(db)


async def test_the_report_prints_the_hand_computed_figures_of_every_ceiling(
    limiter: Limiter, database_dsn: str, account: None
) -> None:
    # a second ceiling nobody used, whose report reads zero activity
    await AdminService(limiter.store).put_ceiling(
        "anthropic", Ceiling(models=["claude-*"], tokens_per_minute=1_000_000)
    )
    rows = json.loads((await _cli(database_dsn, "oversubscription", "--format", "json")).stdout)
    assert [r["ceiling"] for r in rows] == ["anthropic", fx.CEILING]
    anthropic, openai = rows
    assert {k: openai[k] for k in fx.EXPECTED_7_DAYS} == _printed(fx.EXPECTED_7_DAYS)
    # 50 x 5,000 = 250,000 of 1,000,000; claude-3-5-sonnet's 20 tenants in one minute
    assert (anthropic["ratio"], anthropic["verdict"]) == ("0.25", "ok")
    assert anthropic["requests_ratio"] is None
    assert (anthropic["active_minutes"], anthropic["active_tenants_max"]) == (2, 20)

    nine = await _cli(
        database_dsn, "oversubscription", "--days", "9", "--ceiling", fx.CEILING, "--format", "csv"
    )
    (row,) = list(csv.DictReader(io.StringIO(nine.stdout)))
    expected = {k: str(v) for k, v in fx.EXPECTED_9_DAYS.items()}
    assert {k: row[k] for k in expected} == expected


async def test_the_table_names_the_verdict(database_dsn: str, account: None) -> None:
    table = (await _cli(database_dsn, "oversubscription")).stdout.splitlines()
    assert table[0].split()[:3] == ["ceiling", "verdict", "tenants"]
    assert table[2].split()[:3] == [fx.CEILING, "warn", "50"]
    assert table[-1] == "(1 row)"


async def test_the_list_names_the_report(database_dsn: str) -> None:
    listing = json.loads((await _cli(database_dsn, "--list", "--format", "json")).stdout)
    names = [r["report"] for r in listing]
    assert "oversubscription" in names
    assert names == sorted(names)


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (("oversubscription", "--days", "0"), "days: a whole number of days from 1 to 366"),
        (("oversubscription", "--days", "367"), "from 1 to 366"),
        (("oversubscription", "--ceiling", "no-such"), "unknown ceiling 'no-such'"),
        (("oversubscription", "--ceiling", "bad name!"), "--ceiling"),
        (("oversubscription", "--from", "2026-01-01"), "--from, --to and --tenant"),
        (("usage_daily", "--days", "3"), "--days and --ceiling are the oversubscription"),
    ],
)
async def test_bad_flags_exit_2_with_one_line(
    database_dsn: str, account: None, args: tuple[str, ...], says: str
) -> None:
    result = await _cli(database_dsn, *args, check=False)
    assert result.returncode == 2, result.stderr
    assert result.stdout == ""
    assert says in result.stderr
    assert result.stderr.count("\n") == 1


async def test_days_must_be_ascii_digits(database_dsn: str) -> None:
    result = await _cli(database_dsn, "oversubscription", "--days", "seven", check=False)
    assert result.returncode == 2
    assert "whole number" in result.stderr
