"""Alembic environment: runs migrations over SQLAlchemy's asyncpg driver.

The URL comes from the config (set by `llmquota migrate`) or, for a plain
`alembic` call from a checkout, from LLMQUOTA_DATABASE_URL. asyncpg itself
connects to it, as the service does, so the same libpq-style URLs work for
both: several hosts with `target_session_attrs=read-write` (a primary and its
standbys, the first that takes writes is used), and the embedded server's
`?host=/socket/dir`. SQLAlchemy's URL parser reads neither of the first two.

What a versioned migration may contain, and what belongs to the repeatable
scripts of sql/ instead, is in README.md next to this file. In short: the
files in versions/ are frozen table changes and never read sql/; functions,
views and grants are re-applied from sql/ by `llmquota migrate` after the
versioned migrations (`llmquota.store.migrate.apply_repeatables`). A plain
`alembic upgrade head` does only the versioned part.

The migrations run under a session advisory lock (the one the repeatable step
takes too), so two `llmquota migrate` at once do not race: the second waits,
then finds the database at head. `llmquota migrate` bounds each statement's
wait for a table lock (the config's LOCK_TIMEOUT_OPTION; store/migrate.py's
LockPatience says why); a plain `alembic` call waits as long as it takes.
"""

from __future__ import annotations

import asyncio
import os

import asyncpg
from alembic import context
from sqlalchemy import text
from sqlalchemy.engine import Connection
from sqlalchemy.ext.asyncio import create_async_engine
from sqlalchemy.pool import NullPool

from llmquota.store.migrate import DSN_OPTION, LOCK_TIMEOUT_OPTION, MIGRATION_LOCK


def _dsn() -> str:
    configured = context.config.get_main_option(DSN_OPTION)
    if configured:
        return configured
    dsn = os.environ.get("LLMQUOTA_DATABASE_URL")
    if not dsn:
        raise RuntimeError("set LLMQUOTA_DATABASE_URL or use `llmquota migrate`")
    return dsn


def _run(connection: Connection) -> None:
    # A session lock outlives the transactions below; it is released when the
    # connection closes (NullPool: really closes), also after a failure.
    connection.execute(
        text("SELECT pg_advisory_lock(hashtextextended(:key, 0))"), {"key": MIGRATION_LOCK}
    )
    lock_timeout_ms = context.config.get_main_option(LOCK_TIMEOUT_OPTION)
    if lock_timeout_ms is not None:
        # Set after the advisory lock (waiting for another migrate is queueing,
        # not a stall), for the session: every revision's statements.
        connection.execute(
            text("SELECT set_config('lock_timeout', :ms, false)"), {"ms": lock_timeout_ms}
        )
    connection.commit()
    context.configure(connection=connection, transaction_per_migration=True)
    with context.begin_transaction():
        context.run_migrations()


async def _main() -> None:
    dsn = _dsn()

    async def connect() -> asyncpg.Connection:
        return await asyncpg.connect(dsn)

    engine = create_async_engine("postgresql+asyncpg://", poolclass=NullPool, async_creator=connect)
    try:
        async with engine.connect() as connection:
            await connection.run_sync(_run)
            await connection.commit()
    finally:
        await engine.dispose()


if context.is_offline_mode():
    raise RuntimeError("offline SQL generation is not supported; run against a database")
asyncio.run(_main())
