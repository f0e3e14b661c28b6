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
    app_dsn: str, limiter: Limiter, db: asyncpg.Connection
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

    consumed = await asyncio.to_thread(_read_then_kill, app_dsn, 0, LINES_BEFORE_KILL)
    assert [line["id"] for line in consumed] == list(range(1, LINES_BEFORE_KILL + 1))

    # A settlement's transaction is open (its row has the lower entry_id) while
    # a later one commits; the restarted consumer must not skip the open one.
    holder = await asyncpg.connect(app_dsn)
    try:
        transaction = holder.transaction()
        await transaction.start()
        assert await holder.fetchval(SETTLE, open_one.reservation_id) == "settled"
        await later_one.settle(input_tokens=2, output_tokens=5)
        consumed += await asyncio.to_thread(_export_all, app_dsn, consumed[-1]["id"])
        assert len(consumed) == ADJUSTMENTS  # the committed settle waits behind the open one
        await transaction.commit()
    finally:
        await holder.close()
    consumed += await asyncio.to_thread(_export_all, app_dsn, consumed[-1]["id"])

    ledger = await db.fetch("SELECT entry_id, reservation_id FROM usage_ledger")
    assert len(ledger) == ADJUSTMENTS + 2
    assert [line["id"] for line in consumed] == list(range(1, len(ledger) + 1))
    assert sorted(line["entry_id"] for line in consumed) == sorted(r["entry_id"] for r in ledger)
    settled = {line["reservation_id"]: line["entry_id"] for line in consumed[-2:]}
    assert settled[str(open_one.reservation_id)] < settled[str(later_one.reservation_id)]
    assert sum(line["output_tokens"] for line in consumed) == sum(range(1, ADJUSTMENTS + 1)) + 8
    # Caught up: nothing more, and a bad cursor is refused.
    assert await asyncio.to_thread(_export_all, app_dsn, len(ledger)) == []
    bad = await asyncio.to_thread(
        run_cli, "ledger", "export", "--after-id", "-1", dsn=app_dsn, check=False
    )
    assert bad.returncode == 2
    assert "--after-id" in bad.stderr


async def test_adjust_appends_a_signed_row_and_refuses_bad_input(
    app_dsn: str, limiter: Limiter, db: asyncpg.Connection
) -> None:
    await limiter.store.ensure_tenant("acme")
    # A correction takes back only what was recorded: 2000 output tokens first.
    used = await limiter.admit(tenant="acme", model="gpt-4o", input_tokens=0, max_tokens=2000)
    await used.settle(input_tokens=0, output_tokens=2000)
    result = await asyncio.to_thread(
        run_cli, "ledger", "adjust", "--tenant", "acme", "--tokens", "-1200",
        "--reason", "provider credit for the 2025-03-04 outage", "--model", "gpt-4o",
        dsn=app_dsn,
    )  # fmt: skip
    printed = json.loads(result.stdout)
    assert (printed["tenant"], printed["output_tokens"], printed["model"]) == (
        "acme", -1200, "gpt-4o",
    )  # fmt: skip
    row = await db.fetchrow("SELECT * FROM usage_ledger WHERE entry_kind = 'adjustment'")
    assert (row["entry_kind"], row["outcome"], row["input_tokens"], row["output_tokens"]) == (
        "adjustment", "adjustment", 0, -1200,
    )  # fmt: skip
    assert row["reason"] == "provider credit for the 2025-03-04 outage"
    assert row["entry_id"] == printed["entry_id"]

    via_env = await asyncio.to_thread(
        run_cli, "ledger", "adjust", dsn=app_dsn,
        env={"LLMQUOTA_ADJUST_TENANT": "acme", "LLMQUOTA_ADJUST_TOKENS": "40",
             "LLMQUOTA_ADJUST_REASON": "from the environment",
             "LLMQUOTA_ADJUST_TOKEN_TYPE": "input"},
    )  # fmt: skip
    assert json.loads(via_env.stdout)["input_tokens"] == 40

    not_ascii = "not a whole number in ASCII digits"
    refused = {
        ("--tenant", "nobody", "--tokens", "5", "--reason", "x"): "unknown tenant",
        ("--tenant", "acme", "--tokens", "5", "--reason", "  "): "reason is required",
        ("--tenant", "acme", "--tokens", "0", "--reason", "x"): "non-zero",
        ("--tenant", "acme", "--tokens", "5"): "--reason",
        ("--tenant", "acme", "--tokens", "many", "--reason", "x"): not_ascii,
        # int() takes each of these as a number; the CLI does not.
        ("--tenant", "acme", "--tokens", "\u0661\u0662\u0663", "--reason", "x"): not_ascii,
        ("--tenant", "acme", "--tokens", "\uff11\uff12\uff13", "--reason", "x"): not_ascii,
        ("--tenant", "acme", "--tokens", "+7", "--reason", "x"): not_ascii,
        ("--tenant", "acme", "--tokens", "1_000", "--reason", "x"): not_ascii,
        ("--tenant", "acme", "--tokens", " 12 ", "--reason", "x"): not_ascii,
        ("--tenant", "acme", "--tokens", "", "--reason", "x"): not_ascii,
        # A real correction's bound, not 10^12 a row; nor more than was recorded.
        ("--tenant", "acme", "--tokens", "1000000000000", "--reason", "x"): "between",
        ("--tenant", "acme", "--tokens", "-801", "--reason", "x"): "cannot take back more",
    }
    for args, message in refused.items():
        result = await asyncio.to_thread(
            run_cli, "ledger", "adjust", *args, dsn=app_dsn, check=False
        )
        assert result.returncode == 2, (args, result.stderr)
        assert message in result.stderr, (args, result.stderr)
    assert await db.fetchval("SELECT count(*) FROM usage_ledger") == 3
    for after_id in ("\uff11", "+1", " 1"):
        bad = await asyncio.to_thread(
            run_cli, "ledger", "export", "--after-id", after_id, dsn=app_dsn, check=False
        )
        assert bad.returncode == 2 and not_ascii in bad.stderr, (after_id, bad.stderr)


async def test_prices_are_versions_set_by_someone_and_backdated_only_with_a_reason(
    app_dsn: str, db: asyncpg.Connection
) -> None:
    clock = await db.fetchrow(
        "SELECT to_char(date_trunc('month', now() AT TIME ZONE 'UTC') + interval '1 month',"
        " 'YYYY-MM-DD') AS next_month, to_char(now() AT TIME ZONE 'UTC', 'YYYY-MM-DD') AS today"
    )
    next_month, today = clock["next_month"], clock["today"]
    first = await asyncio.to_thread(
        run_cli, "prices", "set", "--model", "gpt-4o", "--input-per-million", "2.50",
        "--output-per-million", "10", "--effective-from", next_month, "--set-by", "alice",
        dsn=app_dsn,
    )  # fmt: skip
    assert first.stdout.startswith(f"set: gpt-4o from {next_month}T00:00:00+00:00")
    assert first.stdout.rstrip().endswith("by alice")
    again = await asyncio.to_thread(
        run_cli, "prices", "set", "--model", "gpt-4o", "--input-per-million", "2.25",
        "--output-per-million", "9.5", "--effective-from", next_month, dsn=app_dsn,
        env={"LLMQUOTA_PRICE_SET_BY": "bob"},
    )  # fmt: skip
    assert again.stdout.startswith("superseded:")
    now = await asyncio.to_thread(
        run_cli, "prices", "set", "--model", "gpt-4o*", "--input-per-million", "2",
        "--output-per-million", "8", "--set-by", "carol", dsn=app_dsn,
    )  # fmt: skip
    assert now.returncode == 0
    # Midnight today is in the past: refused, unless said why.
    past = ("prices", "set", "--model", "gpt-4o", "--input-per-million", "1",
            "--output-per-million", "1", "--effective-from", today, "--set-by", "dave")  # fmt: skip
    refused = await asyncio.to_thread(run_cli, *past, dsn=app_dsn, check=False)
    assert refused.returncode == 2 and "in the past" in refused.stderr, refused.stderr
    backdated = await asyncio.to_thread(
        run_cli, *past, "--backdate", "provider changed its list price at midnight", dsn=app_dsn
    )
    assert "(backdated: provider changed its list price at midnight)" in backdated.stdout
    rows = await db.fetch(
        "SELECT model, to_char(effective_from AT TIME ZONE 'UTC', 'YYYY-MM-DD') AS day,"
        " input_usd_per_million::text AS price, set_by, backdate_reason IS NOT NULL AS backdated"
        " FROM model_prices ORDER BY set_at"
    )
    assert [tuple(r) for r in rows] == [
        ("gpt-4o", next_month, "2.500000", "alice", False),
        ("gpt-4o", next_month, "2.250000", "bob", False),
        ("gpt-4o*", today, "2.000000", "carol", False),
        ("gpt-4o", today, "1.000000", "dave", True),
    ]
    listed = await asyncio.to_thread(
        run_cli, "prices", "list", "--model", "gpt-4o", "--format", "csv", dsn=app_dsn
    )
    lines = listed.stdout.splitlines()
    assert lines[0] == (
        "model,effective_from,input_usd_per_million,output_usd_per_million,set_at,set_by,"
        "backdate_reason"
    )
    assert [line.split(",")[5] for line in lines[1:]] == ["dave", "alice", "bob"]

    not_a_price = "decimal number"
    refused_args = {
        ("--input-per-million", "-1", "--output-per-million", "1"): not_a_price,
        ("--input-per-million", "NaN", "--output-per-million", "1"): not_a_price,
        ("--input-per-million", "abc", "--output-per-million", "1"): not_a_price,
        ("--input-per-million", "\u0661\u0662\u0663", "--output-per-million", "1"): not_a_price,
        ("--input-per-million", "\uff11\uff12\uff13", "--output-per-million", "1"): not_a_price,
        ("--input-per-million", "+7", "--output-per-million", "1"): not_a_price,
        ("--input-per-million", "1_000", "--output-per-million", "1"): not_a_price,
        ("--input-per-million", " 12 ", "--output-per-million", "1"): not_a_price,
        ("--input-per-million", "0.0000001", "--output-per-million", "1"): "decimal places",
        ("--input-per-million", "1", "--output-per-million", "1",
         "--effective-from", "2025-13-01"): "effective-from",
        ("--input-per-million", "1", "--output-per-million", "1",
         "--effective-from", "2025-01-01T00:00:00"): "UTC offset",
        ("--input-per-million", "1", "--output-per-million", "1",
         "--effective-from", ""): "effective-from is empty",
        ("--input-per-million", "1", "--output-per-million", "1",
         "--effective-from", "0001-01-01", "--backdate", "x"): "2000-01-01 or later",
        ("--input-per-million", "1", "--output-per-million", "1",
         "--effective-from", "2025-01-01", "--backdate", "x"): "closed month",
    }  # fmt: skip
    for args, message in refused_args.items():
        result = await asyncio.to_thread(
            run_cli, "prices", "set", "--model", "m", "--set-by", "eve", *args, dsn=app_dsn,
            check=False,
        )  # fmt: skip
        assert result.returncode == 2, (args, result.stderr)
        assert message in result.stderr, (args, result.stderr)
    empty_env = await asyncio.to_thread(
        run_cli, "prices", "set", "--model", "m", "--set-by", "eve", "--input-per-million", "1",
        "--output-per-million", "1", dsn=app_dsn, env={"LLMQUOTA_PRICE_EFFECTIVE_FROM": ""},
        check=False,
    )  # fmt: skip
    assert empty_env.returncode == 2 and "effective-from is empty" in empty_env.stderr
    nobody = await asyncio.to_thread(
        run_cli, "prices", "set", "--model", "m", "--input-per-million", "1",
        "--output-per-million", "1", dsn=app_dsn, check=False,
    )  # fmt: skip
    assert nobody.returncode == 2 and "--set-by" in nobody.stderr
    assert await db.fetchval("SELECT count(*) FROM model_prices") == 4


def test_help_names_the_environment_variable_of_every_new_flag() -> None:
    for command, flags in {
        ("ledger", "export"): ["--after-id", "--limit"],
        ("ledger", "adjust"): ["--tenant", "--tokens", "--reason", "--model", "--route",
                               "--token-type"],
        ("prices", "set"): ["--model", "--input-per-million", "--output-per-million",
                            "--effective-from", "--set-by", "--backdate"],
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
