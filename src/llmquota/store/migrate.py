"""Applying the alembic migrations from code (`llmquota migrate`, `serve`, tests)."""

from __future__ import annotations

import asyncio
import concurrent.futures

from alembic import command
from alembic.config import Config

from llmquota.resources import migrations_dir
from llmquota.store.database import sqlalchemy_url


def alembic_config(dsn: str) -> Config:
    """An alembic Config for this package's migrations against `dsn`."""
    config = Config()
    config.set_main_option("script_location", str(migrations_dir()))
    # ConfigParser interpolation: a literal % in a password must be doubled.
    config.set_main_option("sqlalchemy.url", sqlalchemy_url(dsn).replace("%", "%%"))
    return config


def downgrade(dsn: str, revision: str) -> None:
    """Migrate the database down to `revision` ("base": nothing)."""
    command.downgrade(alembic_config(dsn), revision)


def upgrade(dsn: str, revision: str = "head") -> None:
    """Migrate the database to `revision`.

    alembic's env.py runs its own event loop; when called from inside a
    running loop (an async caller) it runs on a worker thread instead.
    """
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        command.upgrade(alembic_config(dsn), revision)
        return
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        pool.submit(command.upgrade, alembic_config(dsn), revision).result()
