"""The migrations: up from nothing, down to nothing, and up again to the same schema."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator

import asyncpg
import pytest
from alembic.script import ScriptDirectory

from llmquota.store import migrate
from llmquota.store.lock_patience import LockPatience
from tests.conftest import _admin, dsn_with_database
from tests.support import fetch_value

SCHEMA_SNAPSHOT = """
SELECT 'column' AS kind, table_schema || '.' || table_name || '.' || column_name AS name,
       data_type || coalesce(' default ' || column_default, '') || ' ' || is_nullable AS detail
  FROM information_schema.columns
 WHERE table_schema NOT IN ('pg_catalog', 'information_schema')
UNION ALL
SELECT 'index', schemaname || '.' || indexname, indexdef
  FROM pg_indexes
 WHERE schemaname NOT IN ('pg_catalog', 'information_schema')
UNION ALL
SELECT 'constraint', conrelid::regclass::text || '.' || conname, pg_get_constraintdef(oid)
  FROM pg_constraint
 WHERE connamespace NOT IN ('pg_catalog'::regnamespace, 'information_schema'::regnamespace)
UNION ALL
SELECT 'function', p.oid::regprocedure::text, md5(pg_get_functiondef(p.oid))
  FROM pg_proc AS p
 WHERE p.pronamespace NOT IN ('pg_catalog'::regnamespace, 'information_schema'::regnamespace)
UNION ALL
SELECT 'trigger', tgrelid::regclass::text || '.' || tgname, pg_get_triggerdef(oid)
  FROM pg_trigger
 WHERE NOT tgisinternal
UNION ALL
SELECT 'view', schemaname || '.' || viewname, md5(definition)
  FROM pg_views
 WHERE schemaname NOT IN ('pg_catalog', 'information_schema')
ORDER BY 1, 2, 3
"""


async def _snapshot(dsn: str) -> list[tuple[str, str, str]]:
    connection = await asyncpg.connect(dsn)
    try:
        rows = await connection.fetch(SCHEMA_SNAPSHOT)
    finally:
        await connection.close()
    return [(r["kind"], r["name"], r["detail"]) for r in rows]


@pytest.fixture
def empty_dsn(server_dsn: str) -> Iterator[str]:
    name = f"llmquota_migration_{os.getpid()}"
    asyncio.run(
        _admin(server_dsn, f'DROP DATABASE IF EXISTS "{name}"', f'CREATE DATABASE "{name}"')
    )
    yield dsn_with_database(server_dsn, name)
    asyncio.run(_admin(server_dsn, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


def test_revisions_form_one_line(server_dsn: str) -> None:
    script = ScriptDirectory.from_config(migrate.alembic_config(server_dsn))
    assert len(script.get_heads()) == 1
    assert len(script.get_bases()) == 1


def test_downgrade_to_nothing_and_upgrade_again_gives_the_same_schema(empty_dsn: str) -> None:
    migrate.upgrade(empty_dsn)
    first = asyncio.run(_snapshot(empty_dsn))
    assert (
        "function",
        "lq_admit(text[],text[],text[],bigint[],bigint[],boolean[],integer[],text[],text[],integer,"
        "smallint[],boolean[],boolean[],integer[],text[],bigint[],bigint[],"
        "timestamp with time zone,uuid[],bigint[],bigint[],text[],integer[],text[],text[],text[])",
    ) in {(kind, name) for kind, name, _ in first}

    migrate.downgrade(empty_dsn, "base")
    leftover = [row for row in asyncio.run(_snapshot(empty_dsn)) if "alembic_version" not in row[1]]
    assert leftover == []

    migrate.upgrade(empty_dsn)
    assert asyncio.run(_snapshot(empty_dsn)) == first


def test_a_revision_that_fails_half_way_changes_nothing(empty_dsn: str) -> None:
    """Each revision is one transaction, the first of a run and those after it
    alike: from 0034, 0035 applies, then 0036 creates a function and two
    triggers and drops 27 constraints, one of which is already gone, so its
    last statement fails; 0036 then leaves nothing behind."""
    migrate.upgrade(empty_dsn, "0034")
    asyncio.run(
        _admin(empty_dsn, "ALTER TABLE limit_layers DROP CONSTRAINT limit_layers_upstream_ceiling")
    )

    with pytest.raises(asyncpg.UndefinedObjectError, match="limit_layers_upstream_ceiling"):
        migrate.upgrade(empty_dsn)

    assert asyncio.run(fetch_value(empty_dsn, "SELECT version_num FROM alembic_version")) == "0035"
    assert asyncio.run(fetch_value(empty_dsn, "SELECT to_regproc('lq_layer_policy_rules')")) is None
    triggers = (
        "SELECT count(*) FROM pg_trigger WHERE tgname LIKE 'limit\\_layers\\_policy\\_rules%'"
    )
    assert asyncio.run(fetch_value(empty_dsn, triggers)) == 0
    checks = (
        "SELECT count(*) FROM pg_constraint"
        " WHERE conrelid = 'limit_layers'::regclass AND contype = 'c'"
    )
    assert asyncio.run(fetch_value(empty_dsn, checks)) == 31  # 0035's 32, less the one dropped


async def test_0036_waits_for_a_debit_between_its_lock_and_its_update(empty_dsn: str) -> None:
    """A live admission locks its layers' rows, then updates them in a later
    statement. 0036, migrating meanwhile, takes the whole table first: it waits
    for the admission's transaction and then runs; neither is aborted as a
    deadlock (as when it took a weaker lock for the trigger first, then asked
    for a stronger one while the debit waited on the weaker)."""
    await asyncio.to_thread(migrate.upgrade, empty_dsn, "0035")
    debit = await asyncpg.connect(empty_dsn)
    try:
        await debit.execute(
            "INSERT INTO limit_layers (scope, tokens_per_minute, token_burst, tokens)"
            " VALUES ('global', 600, 600, 600)"
        )
        async with debit.transaction():
            await debit.execute("SELECT * FROM limit_layers FOR UPDATE")
            # Without a bound on its wait (test_lock_patience.py has those):
            # a timeout would roll it back and hide a deadlock behind a retry.
            unbounded = LockPatience(timeout_ms=0, attempts=1)
            migrating = asyncio.create_task(
                asyncio.to_thread(migrate.upgrade, empty_dsn, patience=unbounded)
            )
            await asyncio.sleep(1.5)  # the migration queues on the table
            assert not migrating.done()
            await debit.execute("UPDATE limit_layers SET tokens = tokens - 100")
        await migrating
        assert await debit.fetchval("SELECT tokens FROM limit_layers") == 500
        assert await debit.fetchval("SELECT version_num FROM alembic_version") == "0036"
    finally:
        await debit.close()
