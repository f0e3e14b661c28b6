"""`llmquota audit`: recompute the counters from the journal, report drift."""

from __future__ import annotations

import asyncio

import asyncpg

from llmquota.admission.limiter import Limiter
from tests.faults.conftest import PYTHON, put, worker_env


async def audit_cli(dsn: str) -> tuple[int, str]:
    process = await asyncio.create_subprocess_exec(
        PYTHON,
        "-m",
        "llmquota.cli",
        "audit",
        env=worker_env(LLMQUOTA_DATABASE_URL=dsn),
        stdout=asyncio.subprocess.PIPE,
    )
    out, _ = await process.communicate()
    return int(process.returncode or 0), out.decode()


async def test_audit_finds_no_drift_then_exactly_the_drift_injected(
    limiter: Limiter, database_dsn: str, db: asyncpg.Connection
) -> None:
    await put(limiter, "tenant", "acme", tokens_per_minute=60_000, max_in_flight=10)
    held = [
        await limiter.admit(tenant="acme", model="m", input_tokens=5, max_tokens=5)
        for _ in range(4)
    ]
    await held[0].settle(input_tokens=5, output_tokens=2)
    await held[1].release()

    code, out = await audit_cli(database_dsn)
    assert code == 0, out
    assert "journal: active=2 reserved_tokens=20 finished=2" in out
    assert out.strip().endswith("no drift")

    # A permit counter that lost track, and a settlement whose figures were edited.
    await db.execute("UPDATE limit_layers SET in_flight = in_flight + 1 WHERE tenant = 'acme'")
    await db.execute(
        "UPDATE reservations SET charged_tokens = 99 WHERE reservation_id = $1",
        held[0].reservation_id,
    )
    code, out = await audit_cli(database_dsn)
    assert code == 1
    drift = sorted(line for line in out.splitlines() if line.startswith("DRIFT"))
    assert drift == [
        f"DRIFT charged_tokens {held[0].reservation_id}: expected 7, found 99",
        "DRIFT in_flight layer 1 (tenant acme -): expected 2, found 3",
        f"DRIFT refunded_tokens {held[0].reservation_id}: expected 0, found 3",
    ]
    assert out.strip().endswith("drift: 3")

    # Put the books right again (the autouse audit checks them after the test).
    await db.execute("UPDATE limit_layers SET in_flight = in_flight - 1 WHERE tenant = 'acme'")
    await db.execute(
        "UPDATE reservations SET charged_tokens = 7 WHERE reservation_id = $1",
        held[0].reservation_id,
    )
    for r in held[2:]:
        await r.release()
