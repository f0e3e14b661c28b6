"""The maintenance leader's lock: a session-level advisory lock on a connection of its own.

One process among all the workers and replicas on a database holds the
lock MAINTENANCE_LOCK_NAME, and only while its session lives: PostgreSQL frees a
session lock when the session ends, however it ends (the process killed with
-9, the network cut, pg_terminate_backend), so the next `pg_try_advisory_lock`
of another process succeeds. The lock never waits: pg_try_advisory_lock
answers at once, true or false.

A session lock lives in a session, so it needs a connection to the server
itself: behind a transaction pooler (PgBouncer in transaction mode) the
session is lent for one transaction only, and the lock would stay with a
server connection other clients then use. The caller passes a direct DSN.
"""

from __future__ import annotations

import asyncio
import contextlib

import asyncpg

from llmquota.store.connection import UNAVAILABLE

# The lock's name; its key is hashtextextended(name, 0), as the other named
# advisory locks of llmquota (sql/global_layer.sql, sql/ledger.sql) take theirs.
MAINTENANCE_LOCK_NAME = "llmquota.maintenance"
CONNECT_TIMEOUT_SECONDS = 5.0


class LeaderLock:
    """Takes, checks and gives up the maintenance lock over one dedicated connection."""

    def __init__(self, dsn: str, name: str = MAINTENANCE_LOCK_NAME) -> None:
        self._dsn = dsn
        self._name = name
        self._connection: asyncpg.Connection | None = None
        # Set the moment the session is gone (the driver's termination callback).
        self.lost = asyncio.Event()

    @property
    def held(self) -> bool:
        """True while the lock was taken and its session has not been seen to end."""
        return self._connection is not None and not self.lost.is_set()

    async def try_acquire(self) -> bool:
        """Take the lock if nobody holds it; False when another session does or
        the database does not answer (the caller tries again later)."""
        if self.held:
            return True
        await self.release()
        try:
            connection: asyncpg.Connection = await asyncpg.connect(
                self._dsn,
                timeout=CONNECT_TIMEOUT_SECONDS,
                server_settings={"application_name": "llmquota-maintenance"},
            )
        except (*UNAVAILABLE, asyncpg.PostgresError):
            return False
        try:
            taken = bool(
                await connection.fetchval(
                    "SELECT pg_try_advisory_lock(hashtextextended($1::text, 0))",
                    self._name,
                    timeout=CONNECT_TIMEOUT_SECONDS,
                )
            )
        except (*UNAVAILABLE, asyncpg.PostgresError):
            connection.terminate()
            return False
        if not taken:
            await _close(connection)
            return False
        self.lost = asyncio.Event()
        connection.add_termination_listener(lambda _: self.lost.set())
        self._connection = connection
        return True

    async def check(self, timeout_seconds: float) -> bool:
        """One round trip on the lock's session: is it still ours? A session
        that does not answer within `timeout_seconds` counts as lost (and is
        dropped, so PostgreSQL frees the lock for another)."""
        connection = self._connection
        if connection is None or self.lost.is_set():
            return False
        try:
            await connection.execute("SELECT 1", timeout=timeout_seconds)
        except (*UNAVAILABLE, asyncpg.PostgresError):
            self.lost.set()
            connection.terminate()
            return False
        return True

    async def release(self) -> None:
        """Give the lock up (closing the session frees it) and forget the connection."""
        connection, self._connection = self._connection, None
        if connection is not None:
            await _close(connection)


async def _close(connection: asyncpg.Connection) -> None:
    """Close politely, within a second; a session that will not close is cut."""
    try:
        await asyncio.wait_for(connection.close(), 1.0)
    except (*UNAVAILABLE, asyncpg.PostgresError):
        connection.terminate()
    with contextlib.suppress(Exception):
        connection.terminate()
