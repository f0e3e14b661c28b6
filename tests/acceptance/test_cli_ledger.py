"""`llmquota ledger` and `llmquota prices` as subprocesses on a real database."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from typing import Any

import asyncpg

from llmquota.admission.limiter import Limiter
from tests.support import run_cli

ADJUSTMENTS = 60
LINES_BEFORE_KILL = 23
PAGE_ROWS = "5"

SETTLE = (
    "SELECT status FROM lq_finish(ARRAY[$1::uuid], ARRAY['settle'], ARRAY[NULL::text],"
    " ARRAY[2::bigint], ARRAY[3::bigint], ARRAY['ok'])"
)


def _read_then_kill(dsn: str, after_id: int, lines: int) -> list[dict[str, Any]]:
    """Start an export, read `lines` lines, then kill -9 it mid-stream."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLMQUOTA_")}
    env |= {"LLMQUOTA_DATABASE_URL": dsn, "LLMQUOTA_EXPORT_PAGE_ROWS": PAGE_ROWS}
    with subprocess.Popen(
        [sys.executable, "-m", "llmquota.cli", "ledger", "export", "--after-id", str(after_id)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=env,
    ) as process:
        assert process.stdout is not None
        consumed = [json.loads(process.stdout.readline()) for _ in range(lines)]
        process.kill()
        process.wait(timeout=30)
    assert process.returncode == -9
    return consumed


def _export_all(dsn: str, after_id: int) -> list[dict[str, Any]]:
    result = run_cli(
        "ledger", "export", "--after-id", str(after_id), dsn=dsn,
        env={"LLMQUOTA_EXPORT_PAGE_ROWS": PAGE_ROWS},
    )  # fmt: skip
    return [json.loads(line) for line in result.stdout.splitlines()]


async def test_an_export_killed_mid_stream_resumes_and_gets_every_row_once(
    database_dsn: str, limiter: Limiter, db: asyncpg.Connection
) -> None:
    await limiter.store.ensure_tenant("acme")
    await limiter.store.ensure_tenant("beta")
    await db.execute(
        "INSERT INTO usage_ledger (entry_kind, tenant, input_tokens, output_tokens,"
        " reserved_tokens, outcome, reason)"
        " SELECT 'adjustment', 'acme', 0, g, 0, 'adjustment', 'fixture ' || g"
        " FROM generate_series(1, $1) AS g",
        ADJUSTMENTS,
    )
    open_one = await limiter.admit(tenant="acme", model="gpt-4o", input_tokens=2, max_tokens=9)
    later_one = await limiter.admit(tenant="beta", model="gpt-4o", input_tokens=2, max_tokens=9)

    consumed = await asyncio.to_thread(_read_then_kill, database_dsn, 0, LINES_BEFORE_KILL)
    assert [line["id"] for line in consumed] == list(range(1, LINES_BEFORE_KILL + 1))

    # A settlement's transaction is open (its row has the lower entry_id) while
    # a later one commits; the restarted consumer must not skip the open one.
    holder = await asyncpg.connect(database_dsn)
    try:
        transaction = holder.transaction()
        await transaction.start()
        assert await holder.fetchval(SETTLE, open_one.reservation_id) == "settled"
        await later_one.settle(input_tokens=2, output_tokens=5)
        consumed += await asyncio.to_thread(_export_all, database_dsn, consumed[-1]["id"])
        assert len(consumed) == ADJUSTMENTS  # the committed settle waits behind the open one
        await transaction.commit()
    finally:
        await holder.close()
    consumed += await asyncio.to_thread(_export_all, database_dsn, consumed[-1]["id"])

    ledger = await db.fetch("SELECT entry_id, reservation_id FROM usage_ledger")
    assert len(ledger) == ADJUSTMENTS + 2
    assert [line["id"] for line in consumed] == list(range(1, len(ledger) + 1))
    assert sorted(line["entry_id"] for line in consumed) == sorted(r["entry_id"] for r in ledger)
    settled = {line["reservation_id"]: line["entry_id"] for line in consumed[-2:]}
    assert settled[str(open_one.reservation_id)] < settled[str(later_one.reservation_id)]
    assert sum(line["output_tokens"] for line in consumed) == sum(range(1, ADJUSTMENTS + 1)) + 8
    # Caught up: nothing more, and a bad cursor is refused.
    assert await asyncio.to_thread(_export_all, database_dsn, len(ledger)) == []
    bad = await asyncio.to_thread(
        run_cli, "ledger", "export", "--after-id", "-1", dsn=database_dsn, check=False
    )
    assert bad.returncode == 2
    assert "--after-id" in bad.stderr


async def test_adjust_appends_a_signed_row_and_refuses_bad_input(
    database_dsn: str, limiter: Limiter, db: asyncpg.Connection
) -> None:
    await limiter.store.ensure_tenant("acme")
    result = await asyncio.to_thread(
        run_cli, "ledger", "adjust", "--tenant", "acme", "--tokens", "-1200",
        "--reason", "provider credit for the 2025-03-04 outage", "--model", "gpt-4o",
        dsn=database_dsn,
    )  # fmt: skip
    printed = json.loads(result.stdout)
    assert (printed["tenant"], printed["output_tokens"], printed["model"]) == (
        "acme", -1200, "gpt-4o",
    )  # fmt: skip
    row = await db.fetchrow("SELECT * FROM usage_ledger")
    assert (row["entry_kind"], row["outcome"], row["input_tokens"], row["output_tokens"]) == (
        "adjustment", "adjustment", 0, -1200,
    )  # fmt: skip
    assert row["reason"] == "provider credit for the 2025-03-04 outage"
    assert row["entry_id"] == printed["entry_id"]

    via_env = await asyncio.to_thread(
        run_cli, "ledger", "adjust", dsn=database_dsn,
        env={"LLMQUOTA_ADJUST_TENANT": "acme", "LLMQUOTA_ADJUST_TOKENS": "40",
             "LLMQUOTA_ADJUST_REASON": "from the environment",
             "LLMQUOTA_ADJUST_TOKEN_TYPE": "input"},
    )  # fmt: skip
    assert json.loads(via_env.stdout)["input_tokens"] == 40

    refused = {
        ("--tenant", "nobody", "--tokens", "5", "--reason", "x"): "unknown tenant",
        ("--tenant", "acme", "--tokens", "5", "--reason", "  "): "reason is required",
        ("--tenant", "acme", "--tokens", "0", "--reason", "x"): "non-zero",
        ("--tenant", "acme", "--tokens", "5"): "--reason",
        ("--tenant", "acme", "--tokens", "many", "--reason", "x"): "invalid int",
    }
    for args, message in refused.items():
        result = await asyncio.to_thread(
            run_cli, "ledger", "adjust", *args, dsn=database_dsn, check=False
        )
        assert result.returncode == 2, (args, result.stderr)
        assert message in result.stderr, (args, result.stderr)
    assert await db.fetchval("SELECT count(*) FROM usage_ledger") == 2


async def test_prices_set_and_list(database_dsn: str, db: asyncpg.Connection) -> None:
    first = await asyncio.to_thread(
        run_cli, "prices", "set", "--model", "gpt-4o", "--input-per-million", "2.50",
        "--output-per-million", "10", "--effective-from", "2025-01-01", dsn=database_dsn,
    )  # fmt: skip
    assert first.stdout.startswith("set: gpt-4o from 2025-01-01T00:00:00+00:00")
    again = await asyncio.to_thread(
        run_cli, "prices", "set", "--model", "gpt-4o", "--input-per-million", "2.25",
        "--output-per-million", "9.5", "--effective-from", "2025-01-01", dsn=database_dsn,
    )  # fmt: skip
    assert again.stdout.startswith("replaced:")
    now = await asyncio.to_thread(
        run_cli, "prices", "set", "--model", "gpt-4o", "--input-per-million", "2",
        "--output-per-million", "8", dsn=database_dsn,
    )  # fmt: skip
    assert now.returncode == 0
    rows = await db.fetch(
        "SELECT effective_from, input_usd_per_million, output_usd_per_million,"
        " effective_from > now() - interval '1 minute' AS recent"
        " FROM model_prices ORDER BY effective_from"
    )
    assert [(str(r[1]), str(r[2]), r[3]) for r in rows] == [
        ("2.250000", "9.500000", False),
        ("2.000000", "8.000000", True),
    ]
    listed = await asyncio.to_thread(run_cli, "prices", "list", "--format", "csv", dsn=database_dsn)
    assert listed.stdout.splitlines()[1] == "gpt-4o,2025-01-01T00:00:00+00:00,2.250000,9.500000"

    refused = {
        ("--input-per-million", "-1", "--output-per-million", "1"): "between 0 and",
        ("--input-per-million", "NaN", "--output-per-million", "1"): "between 0 and",
        ("--input-per-million", "abc", "--output-per-million", "1"): "decimal number",
        ("--input-per-million", "0.0000001", "--output-per-million", "1"): "decimal places",
        ("--input-per-million", "1", "--output-per-million", "1",
         "--effective-from", "2025-13-01"): "effective-from",
        ("--input-per-million", "1", "--output-per-million", "1",
         "--effective-from", "2025-01-01T00:00:00"): "UTC offset",
    }  # fmt: skip
    for args, message in refused.items():
        result = await asyncio.to_thread(
            run_cli, "prices", "set", "--model", "m", *args, dsn=database_dsn, check=False
        )
        assert result.returncode == 2, (args, result.stderr)
        assert message in result.stderr, (args, result.stderr)
    assert await db.fetchval("SELECT count(*) FROM model_prices") == 2


def test_help_names_the_environment_variable_of_every_new_flag() -> None:
    for command, flags in {
        ("ledger", "export"): ["--after-id", "--limit"],
        ("ledger", "adjust"): ["--tenant", "--tokens", "--reason", "--model", "--route",
                               "--token-type"],
        ("prices", "set"): ["--model", "--input-per-million", "--output-per-million",
                            "--effective-from"],
        ("report",): ["--from", "--to", "--tenant", "--format"],
        ("sweep",): ["--heartbeat-file"],
    }.items():  # fmt: skip
        text = subprocess.run(
            [sys.executable, "-m", "llmquota.cli", *command, "--help"],
            capture_output=True, text=True, check=True,
            env={"COLUMNS": "200", "PATH": os.environ.get("PATH", "")},
        ).stdout  # fmt: skip
        # One block per option: its line and the indented lines that continue it.
        blocks: list[str] = []
        for line in text.splitlines():
            if line.startswith("  -"):
                blocks.append(line)
            elif blocks and line.startswith("    "):
                blocks[-1] += " " + line.strip()
        for flag in flags:
            block = next(b for b in blocks if b.strip().startswith(flag))
            assert "env LLMQUOTA_" in block, (command, flag, block)
