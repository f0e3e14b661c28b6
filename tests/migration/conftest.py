"""Fixtures of the migration tests: empty databases on the test server."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator

import pytest

from tests.conftest import _admin, dsn_with_database


@pytest.fixture
def fresh_dsn(server_dsn: str) -> Iterator[str]:
    """An empty database (no migration applied), dropped afterwards."""
    name = f"llmquota_fresh_{uuid.uuid4().hex[:12]}"
    asyncio.run(_admin(server_dsn, f'CREATE DATABASE "{name}"'))
    yield dsn_with_database(server_dsn, name)
    asyncio.run(_admin(server_dsn, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


@pytest.fixture
def second_fresh_dsn(server_dsn: str) -> Iterator[str]:
    """Another empty database, for comparing two ways to the same revision."""
    name = f"llmquota_fresh_{uuid.uuid4().hex[:12]}"
    asyncio.run(_admin(server_dsn, f'CREATE DATABASE "{name}"'))
    yield dsn_with_database(server_dsn, name)
    asyncio.run(_admin(server_dsn, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
