"""Changes announced by the database: LISTEN on one channel, over a connection of its own.

Every statement that changes what a worker caches (a policy, a plan, a
provider ceiling, a quota, a key) makes its table's trigger send a NOTIFY on
CHANNEL (migrations/versions/0014_change_notifications.py). NOTIFY is
transactional: it is delivered when the change commits, and only then, so a
worker that drops or reloads its copy on the message never reads the old
policy after the new one is committed, however many workers there are.

A LISTEN lives in a session, so it needs a connection of its own, to the
server itself: a transaction pooler (PgBouncer in transaction mode) lends a
session for one transaction only and drops what it listens to. When the
connection is lost (the server restarted, pg_terminate_backend, a network
cut), messages sent meanwhile are lost too: the listener reconnects with
backoff (RECONNECT_MIN_SECONDS doubling up to RECONNECT_MAX_SECONDS) and
then reports `None`, "anything may have changed", so the caches resync. A
session that goes quiet is checked every KEEPALIVE_SECONDS with a round trip
bounded by KEEPALIVE_TIMEOUT_SECONDS, so a hung one is replaced too. The
periodic refresh of each cache stays the safety net under all of this.

In a cell on Citus (`llmquota migrate --cells`), the triggers fire on the
worker that holds the cell's tables, and a NOTIFY reaches only that server's
sessions: the listener asks where the cell is and listens there, with the
DSN's user, password and database. A cell moved to another node is found
again at the next reconnect; until then the periodic refresh covers it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

import asyncpg

from llmquota.store.cells import node_of_this_cell
from llmquota.store.connection import UNAVAILABLE

log = logging.getLogger(__name__)

CHANNEL = "llmquota_changes"
RECONNECT_MIN_SECONDS = 0.1
RECONNECT_MAX_SECONDS = 5.0
CONNECT_TIMEOUT_SECONDS = 5.0
KEEPALIVE_SECONDS = 5.0
KEEPALIVE_TIMEOUT_SECONDS = 2.0


class ChangeListener:
    """Calls `on_change(payload)` for every message on CHANNEL, and
    `on_change(None)` each time it starts (again) to listen."""

    def __init__(self, dsn: str, on_change: Callable[[str | None], None]) -> None:
        self._dsn = dsn
        self._on_change = on_change
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Start listening in the background (returns at once)."""
        if self._task is None:
            self._task = asyncio.ensure_future(self._run())

    async def close(self) -> None:
        """Stop listening and close the connection."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _run(self) -> None:
        backoff = RECONNECT_MIN_SECONDS
        while True:
            try:
                await self._listen_once()
                backoff = RECONNECT_MIN_SECONDS  # it listened: the next loss retries soon
            except (*UNAVAILABLE, OSError, asyncpg.PostgresError) as exc:
                log.info("change listener: %s: %s; reconnecting", type(exc).__name__, exc)
            except Exception:
                # Not an outage (a bug, a DSN asyncpg refuses): say so, keep trying.
                log.exception("change listener failed; reconnecting")
            await asyncio.sleep(backoff)
            backoff = min(2 * backoff, RECONNECT_MAX_SECONDS)

    async def _listen_once(self) -> None:
        """Connect, LISTEN, report a resync, and deliver messages until the session is lost."""
        connection = await self._connect()
        try:
            node = await node_of_this_cell(connection)
        except BaseException:
            connection.terminate()
            raise
        if node is not None:
            connection.terminate()
            connection = await self._connect(*node)
        lost = asyncio.Event()
        connection.add_termination_listener(lambda _: lost.set())
        try:
            await connection.add_listener(CHANNEL, self._notified)
            self._on_change(None)  # what changed while nobody listened is unknown
            while not lost.is_set():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(lost.wait(), KEEPALIVE_SECONDS)
                if not lost.is_set():
                    await connection.execute("SELECT 1", timeout=KEEPALIVE_TIMEOUT_SECONDS)
        finally:
            connection.terminate()

    async def _connect(
        self, host: str | None = None, port: int | None = None
    ) -> asyncpg.Connection:
        """A session of the DSN's, or of its user and database on another node
        (`host`, `port`: where a Citus cell announces its changes)."""
        connection: asyncpg.Connection = await asyncpg.connect(
            self._dsn,
            host=host,
            port=port,
            timeout=CONNECT_TIMEOUT_SECONDS,
            server_settings={"application_name": "llmquota-listener"},
        )
        return connection

    def _notified(self, _connection: object, _pid: int, _channel: str, payload: object) -> None:
        try:
            self._on_change(str(payload))
        except Exception:
            log.exception("change listener: handling %r failed", payload)
