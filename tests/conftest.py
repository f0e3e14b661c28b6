"""Test fixtures: a real PostgreSQL, one migrated template, a fresh database per test.

The server is LLMQUOTA_DATABASE_URL when set (CI's PostgreSQL 15 matrix),
otherwise an embedded PostgreSQL in a temporary directory. The migrations run
once into a template database; each test gets `CREATE DATABASE ... TEMPLATE`
of it, which is fast, isolated and real.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import shutil
import tempfile
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import asyncpg
import pytest

from llmquota.admission.limiter import Limiter
from llmquota.config import Settings
from llmquota.store import migrate
from llmquota.store.database import open_database

_counter = itertools.count()


def dsn_with_database(dsn: str, database: str) -> str:
    """The same server, another database."""
    parts = urlsplit(dsn)
    return urlunsplit(parts._replace(path="/" + database))


async def _admin(dsn: str, *statements: str) -> None:
    connection = await asyncpg.connect(dsn)
    try:
        for statement in statements:
            await connection.execute(statement)
    finally:
        await connection.close()


@pytest.fixture(scope="session")
def server_dsn() -> Iterator[str]:
    """A DSN to the test server's maintenance database.

    The embedded server's directory is our own, not pytest's tmp_path: pytest
    prunes old basetemp directories, including those of a concurrent session.
    """
    url = os.environ.get("LLMQUOTA_DATABASE_URL")
    if url:
        with open_database(database_url=url) as handle:
            yield handle.dsn
        return
    root = Path(tempfile.mkdtemp(prefix="llmquota-test-pg-"))
    try:
        with open_database(data_dir=root / "data") as handle:
            yield handle.dsn
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="session")
def template_database(server_dsn: str) -> Iterator[str]:
    """Name of a database migrated to head, used as the template for each test."""
    name = f"llmquota_template_{os.getpid()}"
    asyncio.run(
        _admin(server_dsn, f'DROP DATABASE IF EXISTS "{name}"', f'CREATE DATABASE "{name}"')
    )
    migrate.upgrade(dsn_with_database(server_dsn, name))
    yield name
    asyncio.run(_admin(server_dsn, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


@pytest.fixture
async def database_dsn(server_dsn: str, template_database: str) -> AsyncIterator[str]:
    """A fresh, migrated database for one test."""
    name = f"llmquota_test_{os.getpid()}_{next(_counter)}_{uuid.uuid4().hex[:6]}"
    await _admin(server_dsn, f'CREATE DATABASE "{name}" TEMPLATE "{template_database}"')
    yield dsn_with_database(server_dsn, name)
    await _admin(server_dsn, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture
async def twin_dsn(server_dsn: str, template_database: str) -> AsyncIterator[str]:
    """A second fresh database from the same template (batched vs one-by-one tests)."""
    name = f"llmquota_twin_{uuid.uuid4().hex[:12]}"
    await _admin(server_dsn, f'CREATE DATABASE "{name}" TEMPLATE "{template_database}"')
    yield dsn_with_database(server_dsn, name)
    await _admin(server_dsn, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture
def settings() -> Settings:
    """Settings for tests: a pool wide enough for the concurrency tests.

    The decision deadline is out of the way: these tests fire dozens of
    admissions at one row on a shared 2-core machine, where queueing for a
    connection can pass 250 ms, and they are about what PostgreSQL decides.
    The deadline and the failure modes are proven in tests/faults.
    """
    return Settings(  # type: ignore[call-arg]
        pool_min_size=1, pool_max_size=20, decision_deadline_ms=60_000, _env_file=None
    )


@pytest.fixture
async def limiter(database_dsn: str, settings: Settings) -> AsyncIterator[Limiter]:
    """A Limiter on a fresh database."""
    lim = await Limiter.connect(database_dsn, settings)
    yield lim
    await lim.close()


@pytest.fixture
async def db(database_dsn: str) -> AsyncIterator[asyncpg.Connection]:
    """A plain connection to the test database, for inspecting and shifting state."""
    connection = await asyncpg.connect(database_dsn)
    yield connection
    await connection.close()
