"""A cell's billing export on Citus never skips a row, wherever its INSERT was planned.

The export numbers ledger rows in (xact_id, entry_id) order up to the oldest
transaction still running (lq_export_ledger, sql/ledger.sql), which is sound
only if every row's xact_id and that horizon are transaction ids of one node.
A cell's ledger is on a worker, and delegated calls write and export there.
But a call inside a transaction block is not delegated: the coordinator runs
it, and evaluated the column's default, pg_current_xact_id(), itself. Such a
row carried the coordinator's transaction id, another count than the
worker's. Once the worker's ids had run past the coordinator's (a busy cell
runs every admission there, the coordinator next to nothing), the row was
below what the export had already numbered when it committed, and was never
exported. Now a trigger stamps each row on its node
(sql/cells_queries.sql, stamp_ledger_rows_on_their_node), and an export the
coordinator would run with its own horizon is refused.
"""

from __future__ import annotations

import asyncio
from urllib.parse import urlsplit

import asyncpg
import pytest

from llmquota.admission.limiter import Limiter
from llmquota.finance.ledger import LedgerStore
from llmquota.store.cells import build_cells, in_cell
from tests.citus.nodes import CitusNodes
from tests.conftest import dsn_with_database

pytestmark = pytest.mark.citus_only

SETTLE = (
    "SELECT status FROM lq_finish(ARRAY[$1::uuid], ARRAY['settle'], ARRAY[NULL::text],"
    " ARRAY[$2::bigint], ARRAY[$3::bigint], ARRAY['ok'])"
)
# Transaction ids the cell's node is made to run ahead of the coordinator by.
AHEAD = 50


async def _cell_on_a_node_ahead(empty_database_dsn: str, cluster: CitusNodes) -> str:
    """The DSN of a cell whose node's transaction ids run AHEAD past the coordinator's."""
    cells = await asyncio.to_thread(build_cells, empty_database_dsn, 2)
    cell = cells[-1]
    database = urlsplit(empty_database_dsn).path.lstrip("/")
    host, port = (cell.node or "").rsplit(":", 1)
    node = await asyncpg.connect(
        dsn_with_database(f"postgresql://{cluster.user}@{host}:{port}/postgres", database)
    )
    coordinator = await asyncpg.connect(empty_database_dsn)
    try:
        behind = int(await coordinator.fetchval("SELECT pg_current_xact_id()::text::bigint"))
        at = int(await node.fetchval("SELECT pg_current_xact_id()::text::bigint"))
        # One transaction id per loop: a DO block outside a transaction may COMMIT.
        await node.execute(
            "DO $$ BEGIN FOR i IN 1.." + str(max(0, behind - at) + AHEAD) + " LOOP "
            "PERFORM pg_current_xact_id(); COMMIT; END LOOP; END $$"
        )
        assert int(await node.fetchval("SELECT pg_current_xact_id()::text::bigint")) > (
            int(await coordinator.fetchval("SELECT pg_current_xact_id()::text::bigint"))
            + AHEAD // 2
        )
    finally:
        await node.close()
        await coordinator.close()
    return in_cell(empty_database_dsn, cell.name)


async def test_a_row_settled_inside_a_transaction_block_is_exported_after_those_before_it(
    empty_database_dsn: str, cluster: CitusNodes
) -> None:
    dsn = await _cell_on_a_node_ahead(empty_database_dsn, cluster)
    limiter = await Limiter.connect(dsn)
    block = await asyncpg.connect(dsn)
    exporter = await asyncpg.connect(dsn)
    try:
        for tenant in ("acme", "beta"):
            await limiter.store.ensure_tenant(tenant)
        before, inside = [
            await limiter.admit(tenant=t, model="gpt-4o", input_tokens=1, max_tokens=10)
            for t in ("acme", "beta")
        ]
        await before.settle(input_tokens=1, output_tokens=2)  # a call of its own: on the node

        transaction = block.transaction()
        await transaction.start()
        # Inside a transaction block: the coordinator runs lq_finish and sends its INSERT.
        assert await block.fetchval(SETTLE, inside.reservation_id, 1, 3) == "settled"
        store = LedgerStore(exporter)
        first = [e async for e in store.export(0, limit=None, page_rows=10, number_limit=10)]
        await transaction.commit()
        second = [e async for e in store.export(1, limit=None, page_rows=10, number_limit=10)]

        assert [(e.export_id, e.reservation_id) for e in first] == [(1, before.reservation_id)]
        # Stamped with the node's id, which is after the first row's: not
        # below the export's cursor, where it would never be numbered.
        assert [(e.export_id, e.reservation_id) for e in second] == [(2, inside.reservation_id)]
        ids = await exporter.fetch(
            "SELECT reservation_id, xact_id::text::bigint AS xact FROM usage_ledger ORDER BY xact"
        )
        assert [r["reservation_id"] for r in ids] == [before.reservation_id, inside.reservation_id]
    finally:
        await exporter.close()
        await block.close()
        await limiter.close()


async def test_an_export_inside_a_transaction_block_is_refused_and_numbers_nothing(
    empty_database_dsn: str, cluster: CitusNodes
) -> None:
    dsn = await _cell_on_a_node_ahead(empty_database_dsn, cluster)
    limiter = await Limiter.connect(dsn)
    connection = await asyncpg.connect(dsn)
    try:
        await limiter.store.ensure_tenant("acme")
        held = await limiter.admit(tenant="acme", model="gpt-4o", input_tokens=1, max_tokens=10)
        await held.settle(input_tokens=1, output_tokens=2)

        with pytest.raises(asyncpg.FeatureNotSupportedError, match="node that holds the ledger"):
            async with connection.transaction():
                await connection.fetch("SELECT * FROM lq_export_ledger(0, 10, 10)")
        assert await connection.fetchval("SELECT last_export_id FROM ledger_export_state") == 0
        assert await connection.fetchval("SELECT count(*) FROM ledger_export_positions") == 0

        store = LedgerStore(connection)
        exported = [e async for e in store.export(0, limit=None, page_rows=10, number_limit=10)]
        assert [(e.export_id, e.reservation_id) for e in exported] == [(1, held.reservation_id)]
    finally:
        await connection.close()
        await limiter.close()
