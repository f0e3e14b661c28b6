"""An asyncpg pool whose statements can carry a deadline.

A database that stops answering (packets dropped, not refused) must not hold
a request hostage, so a statement with a deadline runs in a task of its own:
the caller waits for its answer at most the deadline and then gets
StoreTimeout, while the task is cancelled and its connection terminated
(never reused: the statement's fate is unknown and the socket may be hung)
in the background, without the caller waiting for that clean-up.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import asyncpg

from llmquota.domain.errors import StoreTimeout
from llmquota.store.connection import (
    UNAVAILABLE,
    Connection,
    DatabaseError,
    Row,
    session_options,
    translate_errors,
    translated,
    unavailable,
)
from llmquota.store.deadline import within_store_deadline

log = logging.getLogger(__name__)

# How long close() lets the pool shut down gracefully before cutting it.
POOL_CLOSE_TIMEOUT_SECONDS = 5.0
# How long a connection may take to reset on its way back to the pool before
# it is terminated instead.
RELEASE_TIMEOUT_SECONDS = 1.0
# How often a backend checks, during a long statement, that its client is still
# there (PostgreSQL 14+); a client that gave up on its deadline frees its locks.
CLIENT_CONNECTION_CHECK_MS = 1_000


async def _no_reset(connection: asyncpg.Connection) -> None:
    """Pool release: there is no session state to reset (see DeadlinePool.connect).

    asyncpg still rolls back a transaction left open before calling this.
    """


async def _warn_without_role_timeouts(pool: asyncpg.Pool) -> None:
    """Behind a pooler the timeouts are the role's; say so when they are missing."""
    row = await pool.fetchrow(
        "SELECT current_setting('statement_timeout') AS statement_timeout,"
        " current_setting('lock_timeout') AS lock_timeout"
    )
    unset = [name for name in ("statement_timeout", "lock_timeout") if row[name] == "0"]
    if unset:
        log.warning(
            "behind a transaction pooler, %s must be set on the role "
            "(ALTER ROLE ... SET, see docs/operations.md); the server has none",
            " and ".join(unset),
        )


# A statement's arguments, or what makes them once a connection is held.
Arguments = tuple[Any, ...] | Callable[[], tuple[Any, ...]]


def _bound(args: Arguments) -> tuple[Any, ...]:
    return args() if callable(args) else args


class DeadlinePool:
    """A pool of sessions carrying the statement and lock timeouts."""

    def __init__(self, pool: asyncpg.Pool) -> None:
        self._pool = pool
        # Statements whose caller stopped waiting; kept referenced until done.
        self._abandoned: set[asyncio.Task[None]] = set()

    @classmethod
    async def connect(
        cls,
        dsn: str,
        *,
        min_size: int,
        max_size: int,
        statement_timeout_ms: int,
        lock_timeout_ms: int,
        transaction_pooler: bool = False,
    ) -> DeadlinePool:
        """Open the pool (behind a transaction pooler: see session_options)."""
        options = session_options(
            statement_timeout_ms=statement_timeout_ms,
            lock_timeout_ms=lock_timeout_ms,
            transaction_pooler=transaction_pooler,
            extra={"client_connection_check_interval": str(CLIENT_CONNECTION_CHECK_MS)},
        )
        # A session holds nothing of ours between statements: advisory locks are
        # all transaction-scoped, no LISTEN, no cursor outlives its statement,
        # every SET is a function's own or set_config(..., true), and the
        # timeouts are startup parameters (or the role's), which RESET keeps.
        # asyncpg's reset (pg_advisory_unlock_all, CLOSE ALL, UNLISTEN *,
        # RESET ALL) would cost a round trip per release, that is per batch,
        # and behind a pooler undo what its own connect_query set.
        with translate_errors():
            pool = await asyncpg.create_pool(
                dsn, min_size=min_size, max_size=max_size, reset=_no_reset, **options
            )
            if transaction_pooler:
                await _warn_without_role_timeouts(pool)
        return cls(pool)

    async def close(self) -> None:
        """Close every connection; cut them if the server does not answer."""
        if self._abandoned:
            await asyncio.wait(set(self._abandoned), timeout=2 * RELEASE_TIMEOUT_SECONDS)
        closing = asyncio.ensure_future(self._pool.close())
        done, _ = await asyncio.wait({closing}, timeout=POOL_CLOSE_TIMEOUT_SECONDS)
        if not done:
            log.warning("database did not answer while closing; terminating connections")
            closing.cancel()
            self._pool.terminate()
        elif closing.exception() is not None:
            self._pool.terminate()

    @contextlib.asynccontextmanager
    async def acquire(self) -> AsyncIterator[Connection]:
        """A pooled connection for the block."""
        with translate_errors():
            async with self._pool.acquire() as connection:
                yield connection

    async def fetch(
        self, sql: str, args: Arguments, *, deadline_seconds: float | None = None
    ) -> list[Row]:
        """Run a statement; its rows, or StoreTimeout once the deadline (if any) passes.

        `args` may be a callable, called once a connection is held, right
        before the statement is sent: for an argument that must be as late as
        it can be (the admission statement's own deadline)."""
        if deadline_seconds is None:
            async with self.acquire() as connection:
                rows: list[Row] = await connection.fetch(sql, *_bound(args))
                return rows
        return await self._fetch_within(deadline_seconds, sql, args)

    async def _fetch_within(self, deadline_seconds: float, sql: str, args: Arguments) -> list[Row]:
        """Run a statement; its answer, or StoreTimeout once the deadline passes."""
        answer: asyncio.Future[list[Row]] = asyncio.get_running_loop().create_future()
        worker = asyncio.ensure_future(self._answer(answer, sql, args))
        self._abandoned.add(worker)
        worker.add_done_callback(self._abandoned.discard)
        try:
            return await within_store_deadline(
                asyncio.shield(answer),
                deadline_seconds,
                lambda: StoreTimeout(
                    f"database gave no answer within {deadline_seconds * 1000:.0f} ms"
                ),
            )
        finally:
            if not answer.done():
                # Timed out or the caller was cancelled: stop the statement, and
                # let nobody set an answer nobody will read.
                answer.cancel()
                worker.cancel()

    async def _answer(self, answer: asyncio.Future[list[Row]], sql: str, args: Arguments) -> None:
        """Run `sql` and put its rows (or its error) into `answer` as soon as they exist.

        The answer is set before the connection goes back to the pool, so a
        hang during that clean-up cannot turn a decision that was made into
        a timeout; the clean-up itself is bounded by RELEASE_TIMEOUT_SECONDS.
        """
        try:
            connection = await self._pool.acquire()
        except UNAVAILABLE as exc:
            if not answer.done():
                answer.set_exception(unavailable(exc))
            return
        try:
            rows: list[Row] = await connection.fetch(sql, *_bound(args))
        except asyncio.CancelledError:
            connection.terminate()
            raise
        except Exception as exc:
            if not answer.done():
                answer.set_exception(translated(exc))
        else:
            if not answer.done():
                answer.set_result(rows)
        finally:
            try:
                await self._pool.release(connection, timeout=RELEASE_TIMEOUT_SECONDS)
            except (*UNAVAILABLE, DatabaseError):
                # A release that timed out has handed the connection back (cut)
                # already; then there is nothing left to terminate.
                with contextlib.suppress(asyncpg.InterfaceError):
                    connection.terminate()
