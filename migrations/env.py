"""Alembic environment: runs migrations over SQLAlchemy's asyncpg driver.

The URL comes from the config (set by `llmquota migrate`) or, for a plain
`alembic` call from a checkout, from LLMQUOTA_DATABASE_URL.
"""

from __future__ import annotations

import asyncio
import os

from alembic import context
from sqlalchemy.engine import Connection
from sqlalchemy.ext.asyncio import create_async_engine

from llmquota.store.database import sqlalchemy_url


def _url() -> str:
    configured = context.config.get_main_option("sqlalchemy.url")
    if configured:
        return configured
    dsn = os.environ.get("LLMQUOTA_DATABASE_URL")
    if not dsn:
        raise RuntimeError("set LLMQUOTA_DATABASE_URL or use `llmquota migrate`")
    return sqlalchemy_url(dsn)


def _run(connection: Connection) -> None:
    context.configure(connection=connection, transaction_per_migration=True)
    with context.begin_transaction():
        context.run_migrations()


async def _main() -> None:
    engine = create_async_engine(_url())
    async with engine.connect() as connection:
        await connection.run_sync(_run)
        await connection.commit()
    await engine.dispose()


if context.is_offline_mode():
    raise RuntimeError("offline SQL generation is not supported; run against a database")
asyncio.run(_main())
