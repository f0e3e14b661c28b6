"""The billing export never skips a row that commits out of entry_id order."""

from __future__ import annotations

import uuid

import asyncpg
import pytest

from llmquota.admission.limiter import Limiter
from llmquota.finance.ledger import LedgerEntry, LedgerStore

# Also run on a Citus coordinator by CI's Citus leg (pyproject.toml's markers).
pytestmark = pytest.mark.citus

SETTLE = (
    "SELECT status FROM lq_finish(ARRAY[$1::uuid], ARRAY['settle'], ARRAY[NULL::text],"
    " ARRAY[$2::bigint], ARRAY[$3::bigint], ARRAY['ok'])"
)


async def _export(store: LedgerStore, after: int) -> list[LedgerEntry]:
    return [e async for e in store.export(after, limit=None, page_rows=2, number_limit=2)]


async def test_rows_committed_out_of_id_order_are_exported_once_in_gapless_order(
    limiter: Limiter, app_dsn: str, db: asyncpg.Connection
) -> None:
    # One tenant each: settlements of one tenant queue on its layer's row lock.
    tenants = ("acme", "beta", "gamma", "delta")
    for tenant in tenants:
        await limiter.store.ensure_tenant(tenant)
    held = [
        await limiter.admit(tenant=tenant, model="gpt-4o", input_tokens=1, max_tokens=10)
        for tenant in tenants
    ]
    older = await asyncpg.connect(app_dsn)
    younger = await asyncpg.connect(app_dsn)
    store = LedgerStore(db)
    try:
        # `older` takes its transaction id first, by writing where the ledger
        # is (on Citus a cell's node: pg_current_xact_id() would take the
        # coordinator's); `younger` then writes the lower entry_id and stays
        # open while `older` writes a higher one and commits. By entry_id the
        # committed row comes after an invisible one; by transaction it comes
        # before. A cursor on entry_id would move past the open row and never
        # return to it.
        older_tx = older.transaction()
        await older_tx.start()
        assert await older.fetchval(SETTLE, held[3].reservation_id, 1, 1) == "settled"
        younger_tx = younger.transaction()
        await younger_tx.start()
        assert await younger.fetchval(SETTLE, held[0].reservation_id, 1, 2) == "settled"
        assert await older.fetchval(SETTLE, held[1].reservation_id, 1, 3) == "settled"
        await older_tx.commit()
        older_ids = [
            await db.fetchval(
                "SELECT entry_id FROM usage_ledger WHERE reservation_id = $1", h.reservation_id
            )
            for h in (held[3], held[1])
        ]
        first_id = max(older_ids)

        first = await _export(store, 0)
        assert [(e.export_id, e.entry_id) for e in first] == [(1, older_ids[0]), (2, first_id)]

        # Committed later while `younger` is still open: held back, not skipped.
        await held[2].settle(input_tokens=1, output_tokens=4)
        assert await _export(store, 2) == []

        await younger_tx.commit()
        second = await _export(store, 2)
        second_id = await db.fetchval(
            "SELECT entry_id FROM usage_ledger WHERE reservation_id = $1", held[0].reservation_id
        )
        assert second_id < first_id  # the lower entry_id, exported after the higher one
    finally:
        await older.close()
        await younger.close()

    exported = first + second
    assert [e.export_id for e in exported] == [1, 2, 3, 4]
    assert sorted(e.entry_id for e in exported) == sorted(
        r["entry_id"] for r in await db.fetch("SELECT entry_id FROM usage_ledger")
    )
    assert {e.reservation_id for e in exported} == {h.reservation_id for h in held}
    # Asking again from any cursor gives the same rows with the same ids.
    again = await _export(store, 0)
    assert [(e.export_id, e.entry_id) for e in again] == [
        (e.export_id, e.entry_id) for e in exported
    ]
    assert isinstance(again[0].reservation_id, uuid.UUID)
    assert again[0].to_json()["id"] == 1


@pytest.mark.constructs_drift
async def test_the_audit_finds_a_ledger_row_the_export_passed_without_numbering(
    limiter: Limiter, db: asyncpg.Connection
) -> None:
    # How a row is skipped: its transaction commits after the export's cursor
    # passed its place (a row stamped with another node's transaction id did,
    # in a Citus cell). Built here by the owner moving the cursor past it.
    await limiter.store.ensure_tenant("acme")
    held = [
        await limiter.admit(tenant="acme", model="gpt-4o", input_tokens=1, max_tokens=10)
        for _ in range(2)
    ]
    for h in held:
        await h.settle(input_tokens=1, output_tokens=2)
    store = LedgerStore(db)
    exported = [e async for e in store.export(0, limit=None, page_rows=10, number_limit=10)]
    assert len(exported) == 2
    assert await db.fetch("SELECT * FROM lq_audit() WHERE check_name = 'export_skipped'") == []

    late = await limiter.admit(tenant="acme", model="gpt-4o", input_tokens=1, max_tokens=10)
    await late.settle(input_tokens=1, output_tokens=2)
    row = await db.fetchrow(
        "SELECT entry_id, xact_id FROM usage_ledger WHERE reservation_id = $1", late.reservation_id
    )
    await db.execute(
        "UPDATE ledger_export_state SET last_xact_id = $1, last_entry_id = $2",
        row["xact_id"],
        row["entry_id"],
    )
    assert [e async for e in store.export(2, limit=None, page_rows=10, number_limit=10)] == []
    findings = await db.fetch("SELECT * FROM lq_audit() WHERE check_name = 'export_skipped'")
    assert [(f["subject"], f["expected"], f["actual"]) for f in findings] == [
        (f"ledger entry {row['entry_id']}", 1, 0)
    ]
