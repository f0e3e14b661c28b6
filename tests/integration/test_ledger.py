"""The usage ledger: exactly once, append-only, and only what each role may do.

Real PostgreSQL, the real admission functions, really concurrent settles.
"""

from __future__ import annotations

import asyncio
import random
import uuid

import asyncpg
import pytest

from llmquota.admission.limiter import Limiter, Reservation, Settlement
from llmquota.config import Settings
from llmquota.domain.errors import UnknownTenant
from llmquota.finance.ledger import LedgerStore
from tests.support import APP_ROLE, dsn_as

RESERVATIONS = 200
SETTLES_PER_RESERVATION = 5  # 1,000 settle calls in all
SHORT_LEASE_SECONDS = 1


async def _admit(limiter: Limiter, n: int, lease_seconds: int) -> list[Reservation]:
    return [
        await limiter.admit(
            tenant="acme",
            route="chat",
            model="gpt-4o",
            input_tokens=100 + i,
            max_tokens=1_000,
            lease_seconds=lease_seconds,
        )
        for i in range(n)
    ]


async def test_concurrent_settles_racing_the_sweeper_write_each_reservation_once(
    limiter: Limiter, db: asyncpg.Connection
) -> None:
    await limiter.store.ensure_tenant("acme")
    # Half the leases run out before the settles start: the sweeper and the
    # settles race to expire them, and every settle of those is a late one.
    short = await _admit(limiter, RESERVATIONS // 2, SHORT_LEASE_SECONDS)
    long = await _admit(limiter, RESERVATIONS // 2, 600)
    await asyncio.sleep(SHORT_LEASE_SECONDS + 0.2)

    reservations = short + long
    usage = {r.reservation_id: (r.input_tokens, 37 + i % 500) for i, r in enumerate(reservations)}
    calls = [r.reservation_id for r in reservations for _ in range(SETTLES_PER_RESERVATION)]
    random.Random(7).shuffle(calls)

    settling = True

    async def sweeper() -> int:
        expired = 0
        while settling:
            expired += (await limiter.sweep(batch_size=7)).expired
            await asyncio.sleep(0)
        return expired

    async def settle(reservation_id: uuid.UUID) -> tuple[uuid.UUID, Settlement]:
        input_tokens, output_tokens = usage[reservation_id]
        result = await limiter.settle(
            reservation_id, input_tokens=input_tokens, output_tokens=output_tokens
        )
        return reservation_id, result

    sweepers = [asyncio.create_task(sweeper()) for _ in range(3)]
    results = await asyncio.gather(*(settle(rid) for rid in calls))
    settling = False
    await asyncio.gather(*sweepers)

    assert len(results) == RESERVATIONS * SETTLES_PER_RESERVATION == 1_000
    # Every repeat got the first answer back.
    answers: dict[uuid.UUID, set[Settlement]] = {}
    for rid, settlement in results:
        answers.setdefault(rid, set()).add(settlement)
    assert all(len(a) == 1 for a in answers.values())
    short_ids = {r.reservation_id for r in short}
    assert {rid for rid, a in answers.items() if next(iter(a)).late} == short_ids

    kinds = dict(
        await db.fetch("SELECT entry_kind, count(*) FROM usage_ledger GROUP BY entry_kind")
    )
    assert kinds == {"usage": RESERVATIONS, "late": RESERVATIONS // 2}
    assert (
        await db.fetchval("SELECT count(DISTINCT reservation_id) FROM usage_ledger") == RESERVATIONS
    )
    outcomes = dict(
        await db.fetch(
            "SELECT outcome, count(*) FROM usage_ledger WHERE entry_kind = 'usage' GROUP BY 1"
        )
    )
    assert outcomes == {"ok": RESERVATIONS // 2, "expired": RESERVATIONS // 2}
    # Tokens: the ledger holds exactly what was charged, each token once.
    charged = sum(i + o for i, o in usage.values())
    assert await db.fetchval("SELECT sum(input_tokens + output_tokens) FROM usage_ledger") == (
        charged
    )
    assert await db.fetchval("SELECT sum(charged_tokens) FROM reservations") == charged
    # Expired rows carry the reserved amount and zero known usage.
    assert await db.fetchval(
        "SELECT sum(reserved_tokens) FROM usage_ledger WHERE outcome = 'expired'"
    ) == sum(r.reserved_tokens for r in short)
    assert await db.fetchval("SELECT count(*) FROM ledger_receipts") == RESERVATIONS * 3 // 2
    totals = await limiter.store.tenant_usage(
        "acme",
        await db.fetchval("SELECT now() - interval '1 hour'"),
        await db.fetchval("SELECT now() + interval '1 hour'"),
    )
    assert totals.requests == RESERVATIONS
    assert totals.input_tokens + totals.output_tokens == charged


async def test_a_second_row_for_the_same_event_is_refused_by_the_receipt(
    limiter: Limiter, db: asyncpg.Connection
) -> None:
    await limiter.store.ensure_tenant("acme")
    (held,) = await _admit(limiter, 1, 600)
    await held.settle(input_tokens=10, output_tokens=20)

    # Even the table's owner cannot write the same event twice.
    with pytest.raises(asyncpg.UniqueViolationError, match="ledger_receipts_pkey"):
        await db.execute(
            "INSERT INTO usage_ledger (reservation_id, entry_kind, tenant, model, input_tokens,"
            " output_tokens, reserved_tokens, outcome)"
            " VALUES ($1, 'usage', 'acme', 'gpt-4o', 10, 20, 1100, 'ok')",
            held.reservation_id,
        )
    assert await db.fetchval("SELECT count(*) FROM usage_ledger") == 1


async def test_update_delete_and_truncate_are_refused_by_trigger(
    limiter: Limiter, db: asyncpg.Connection
) -> None:
    await limiter.store.ensure_tenant("acme")
    (held,) = await _admit(limiter, 1, 600)
    await held.settle(input_tokens=10, output_tokens=20)
    partition = await db.fetchval("SELECT tableoid::regclass::text FROM usage_ledger")
    assert partition.startswith("usage_ledger_2")  # a month partition, not the default

    # The connection is the owner (a superuser): privileges do not stop it,
    # the trigger does, on the table and on each partition.
    for statement in (
        "UPDATE usage_ledger SET output_tokens = 0",
        "DELETE FROM usage_ledger",
        f"UPDATE {partition} SET input_tokens = 0",
        f"DELETE FROM {partition}",
        "TRUNCATE usage_ledger",
        f"TRUNCATE {partition}",
        "TRUNCATE usage_ledger_default",
    ):
        with pytest.raises(asyncpg.InsufficientPrivilegeError, match="append-only"):
            await db.execute(statement)
    row = await db.fetchrow("SELECT input_tokens, output_tokens FROM usage_ledger")
    assert (row["input_tokens"], row["output_tokens"]) == (10, 20)


async def test_the_app_role_appends_but_cannot_change_the_ledger(
    database_dsn: str, settings: Settings, db: asyncpg.Connection
) -> None:
    # The whole service path works as llmquota_app...
    app = await Limiter.connect(dsn_as(database_dsn, APP_ROLE), settings)
    try:
        await app.store.ensure_tenant("acme")
        reservation = await app.admit(
            tenant="acme", model="gpt-4o", input_tokens=5, max_tokens=50, lease_seconds=600
        )
        await reservation.settle(input_tokens=5, output_tokens=7)
        report = await app.sweep()
        assert report.expired == 0
    finally:
        await app.close()
    connection = await asyncpg.connect(dsn_as(database_dsn, APP_ROLE))
    try:
        store = LedgerStore(connection)
        adjustment = await store.adjust(tenant="acme", tokens=-3, reason="provider credit")
        assert adjustment.output_tokens == -3
        with pytest.raises(UnknownTenant):
            await store.adjust(tenant="nobody", tokens=3, reason="typo")
        exported = [e async for e in store.export(0, limit=None, page_rows=10, number_limit=10)]
        assert [e.export_id for e in exported] == [1, 2]
        # It may run the reports too (it is a member of llmquota_reporting).
        totals = await connection.fetchrow(
            "SELECT sum(total_tokens) AS tokens, sum(requests) AS requests"
            " FROM reporting.usage_daily((now() AT TIME ZONE 'UTC')::date - 1,"
            " (now() AT TIME ZONE 'UTC')::date + 1)"
        )
        assert (totals["tokens"], totals["requests"]) == (9, 1)
        partition = await db.fetchval("SELECT min(tableoid::regclass::text) FROM usage_ledger")

        # ...but no statement that changes or removes a billed row.
        for statement in (
            "UPDATE usage_ledger SET output_tokens = 0",
            "DELETE FROM usage_ledger",
            "TRUNCATE usage_ledger",
            f"DELETE FROM {partition}",
            f"INSERT INTO {partition} OVERRIDING SYSTEM VALUE SELECT * FROM usage_ledger",
            "DELETE FROM ledger_receipts",
            "DROP TABLE usage_ledger_default",
        ):
            with pytest.raises(asyncpg.InsufficientPrivilegeError):
                await connection.execute(statement)
    finally:
        await connection.close()
    assert await db.fetchval("SELECT count(*) FROM usage_ledger") == 2
    assert await db.fetchval("SELECT sum(input_tokens + output_tokens) FROM usage_ledger") == 9


async def test_expiry_then_late_settle_counts_the_usage_once(
    limiter: Limiter, db: asyncpg.Connection
) -> None:
    await limiter.store.ensure_tenant("acme")
    (held,) = await _admit(limiter, 1, SHORT_LEASE_SECONDS)
    await asyncio.sleep(SHORT_LEASE_SECONDS + 0.2)
    assert (await limiter.sweep()).expired == 1
    settlement = await held.settle(input_tokens=100, output_tokens=250)
    assert settlement.late

    rows = await db.fetch(
        "SELECT entry_kind, outcome, input_tokens, output_tokens, reserved_tokens"
        " FROM usage_ledger ORDER BY entry_id"
    )
    assert [tuple(r) for r in rows] == [
        ("usage", "expired", 0, 0, held.reserved_tokens),
        ("late", "late", 100, 250, 0),
    ]
    now = await db.fetchval("SELECT now()")
    totals = await limiter.store.tenant_usage("acme", now.replace(year=now.year - 1), now)
    assert (totals.requests, totals.input_tokens, totals.output_tokens) == (1, 100, 250)
