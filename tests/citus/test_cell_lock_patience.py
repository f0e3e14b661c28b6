"""A cell upgraded in place bounds its wait for a lock held on the cell's node.

A cell's tables are on a worker, and its service's statements run there
(delegated calls): they never lock the coordinator's table. So the lock
that holds up a migration, and that admissions queue behind while it waits,
can be one a session on the worker holds on the shard, which the
coordinator's own lock_timeout does not bound: Citus sends the DDL over its
own connections, to which a session's settings do not pass. Each revision
and the repeatable scripts therefore set lock_timeout with SET LOCAL and
citus.propagate_set_commands = 'local' (store/migration_support.py,
store/migrate.py), which Citus sends to every worker connection of the
transaction.
"""

from __future__ import annotations

import asyncio
import time
from urllib.parse import urlsplit

import asyncpg
import pytest
from alembic import command

from llmquota.store import migrate
from llmquota.store.cells import build_cells, in_cell
from llmquota.store.lock_patience import LockPatience, MigrationLocksUnavailable
from tests.citus.nodes import CitusNodes
from tests.conftest import dsn_with_database
from tests.support import fetch_value

pytestmark = pytest.mark.citus_only


async def test_a_lock_held_on_the_cells_node_bounds_the_upgrade_and_changes_nothing(
    empty_database_dsn: str, cluster: CitusNodes
) -> None:
    cells = await asyncio.to_thread(build_cells, empty_database_dsn, 2)
    cell = cells[-1]
    config = migrate.alembic_config(in_cell(empty_database_dsn, cell.name))
    await asyncio.to_thread(command.downgrade, config, "0035")
    database = urlsplit(empty_database_dsn).path.lstrip("/")
    host, port = (cell.node or "").rsplit(":", 1)
    node = await asyncpg.connect(
        dsn_with_database(f"postgresql://{cluster.user}@{host}:{port}/postgres", database)
    )
    patience = LockPatience(timeout_ms=300, attempts=1)
    try:
        await node.execute("SET citus.override_table_visibility = off")
        shard = await node.fetchval(
            "SELECT oid::regclass::text FROM pg_class WHERE relnamespace = $1::regnamespace"
            " AND relname LIKE 'limit\\_layers\\_%' AND relkind = 'r'",
            cell.name,
        )
        assert shard is not None
        async with node.transaction():
            await node.fetchval(f"SELECT count(*) FROM {shard}")  # a report on the node
            started = time.monotonic()
            with pytest.raises(MigrationLocksUnavailable, match="within 300 ms in its one try"):
                await asyncio.wait_for(
                    asyncio.to_thread(build_cells, empty_database_dsn, 2, patience), 60
                )
            gave_up_after = time.monotonic() - started
    finally:
        await node.close()

    assert gave_up_after < 30
    at = f"SELECT version_num FROM {cell.name}.alembic_version"
    assert await fetch_value(empty_database_dsn, at) == "0035"
    upgraded = await asyncio.to_thread(build_cells, empty_database_dsn, 2, patience)
    assert upgraded[-1].status.startswith("upgraded (revision 0035 to 0036")
