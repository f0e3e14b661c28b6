"""Migration 0002 carries the 0001 ledger over row for row, and back."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

import asyncpg
import pytest

from llmquota.admission.limiter import Limiter
from llmquota.config import Settings
from llmquota.store import migrate
from tests.conftest import dsn_with_database

OLD_COLUMNS = (
    "entry_id, reservation_id, entry_kind, tenant, route, model, input_tokens, output_tokens,"
    " reserved_tokens, outcome, policy_version, recorded_at"
)


@pytest.fixture
async def blank_dsn(server_dsn: str) -> AsyncIterator[str]:
    """An empty database (no migrations applied) on the test server."""
    name = f"llmquota_migration_{uuid.uuid4().hex[:8]}"
    admin = await asyncpg.connect(server_dsn)
    try:
        await admin.execute(f'CREATE DATABASE "{name}"')
        yield dsn_with_database(server_dsn, name)
        await admin.execute(f'DROP DATABASE "{name}" WITH (FORCE)')
    finally:
        await admin.close()


async def _settle_one(dsn: str, tenant: str, output_tokens: int) -> uuid.UUID:
    settings = Settings(pool_min_size=1, pool_max_size=2, _env_file=None)  # type: ignore[call-arg]
    limiter = await Limiter.connect(dsn, settings)
    try:
        await limiter.store.ensure_tenant(tenant)
        held = await limiter.admit(tenant=tenant, model="gpt-4o", input_tokens=3, max_tokens=50)
        await held.settle(input_tokens=3, output_tokens=output_tokens)
        return held.reservation_id
    finally:
        await limiter.close()


async def _old_usage_row(db: asyncpg.Connection, tenant: str, output_tokens: int) -> uuid.UUID:
    """A settled reservation's ledger row as revision 0001 holds it.

    Revision 0001 has its tables only (today's functions would not match
    them), so the row is written directly, as its lq_finish wrote it.
    """
    reservation_id = uuid.uuid4()
    # A registered tenant has its (empty) tenant layer, as ensure_tenant makes it.
    await db.execute(
        "WITH t AS (INSERT INTO tenants (tenant) VALUES ($1) ON CONFLICT DO NOTHING"
        " RETURNING tenant)"
        " INSERT INTO limit_layers (scope, tenant) SELECT 'tenant', tenant FROM t",
        tenant,
    )
    await db.execute(
        "INSERT INTO usage_ledger (reservation_id, entry_kind, tenant, model, input_tokens,"
        " output_tokens, reserved_tokens, outcome, policy_version)"
        " VALUES ($1, 'usage', $2, 'gpt-4o', 3, $3, 53, 'ok', 1)",
        reservation_id,
        tenant,
        output_tokens,
    )
    return reservation_id


async def test_upgrade_carries_old_rows_and_downgrade_brings_them_back(blank_dsn: str) -> None:
    await asyncio.to_thread(migrate.upgrade, blank_dsn, "0001")
    db = await asyncpg.connect(blank_dsn)
    try:
        first = await _old_usage_row(db, "acme", 10)
        second = await _old_usage_row(db, "beta", 20)
        await db.execute(
            "INSERT INTO usage_ledger (entry_kind, tenant, input_tokens, output_tokens,"
            " reserved_tokens, outcome, recorded_at)"
            " VALUES ('adjustment', 'acme', 0, -4, 0, 'adjustment', '2025-06-15 12:00+00')"
        )
        before = [
            tuple(r) for r in await db.fetch(f"SELECT {OLD_COLUMNS} FROM usage_ledger ORDER BY 1")
        ]
        assert len(before) == 3

        # Roles already exist on this server (the template database created
        # them): the migration must take them as they are.
        await asyncio.to_thread(migrate.upgrade, blank_dsn)
        after = [
            tuple(r) for r in await db.fetch(f"SELECT {OLD_COLUMNS} FROM usage_ledger ORDER BY 1")
        ]
        assert after == before
        assert (
            await db.fetchval("SELECT reason FROM usage_ledger WHERE entry_kind = 'adjustment'")
            == "carried over from the 0001 ledger"
        )
        receipts = await db.fetch("SELECT reservation_id, entry_kind FROM ledger_receipts")
        assert {tuple(r) for r in receipts} == {(first, "usage"), (second, "usage")}
        # The June 2025 row got its own month partition.
        assert (
            await db.fetchval(
                "SELECT tableoid::regclass::text FROM usage_ledger WHERE entry_kind = 'adjustment'"
            )
            == "usage_ledger_2025_06"
        )
        with pytest.raises(asyncpg.InsufficientPrivilegeError, match="append-only"):
            await db.execute("DELETE FROM usage_ledger")

        # New ids continue the old sequence.
        third = await _settle_one(blank_dsn, "acme", 30)
        assert (
            await db.fetchval("SELECT entry_id FROM usage_ledger WHERE reservation_id = $1", third)
            == max(r[0] for r in before) + 1
        )

        await asyncio.to_thread(migrate.downgrade, blank_dsn, "0001")
        back = [
            tuple(r) for r in await db.fetch(f"SELECT {OLD_COLUMNS} FROM usage_ledger ORDER BY 1")
        ]
        assert back[:3] == before
        assert len(back) == 4
        assert await db.fetchval("SELECT to_regclass('ledger_receipts')") is None
        assert await db.fetchval("SELECT to_regnamespace('reporting')") is None

        await asyncio.to_thread(migrate.upgrade, blank_dsn)
        again = [
            tuple(r) for r in await db.fetch(f"SELECT {OLD_COLUMNS} FROM usage_ledger ORDER BY 1")
        ]
        assert again == back
    finally:
        await db.close()
