"""Connections for the short jobs (the CLI, finance), and the driver's errors.

The admission service runs on the Store's pool; a CLI command or a finance
job runs a few statements over one connection of its own, never taking a
pooled connection from admissions. Either way driver errors that mean "the
database is not answering" become StoreUnavailable here, and nothing above
the store names the driver: `Connection`, `Row` and `DatabaseError` are the
words they use instead.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TypeAlias

import asyncpg

from llmquota.domain.errors import RefusedValue, StoreUnavailable

Connection: TypeAlias = asyncpg.Connection
Row: TypeAlias = asyncpg.Record
# A statement the database refused (constraint, privilege, syntax), as opposed
# to a database that did not answer.
DatabaseError: TypeAlias = asyncpg.PostgresError

# Errors that say the database did not answer, as opposed to refusing a statement.
UNAVAILABLE: tuple[type[BaseException], ...] = (
    OSError,
    TimeoutError,
    asyncpg.exceptions.PostgresConnectionError,
    asyncpg.exceptions.CannotConnectNowError,
    asyncpg.exceptions.AdminShutdownError,
    asyncpg.exceptions.QueryCanceledError,
    asyncpg.exceptions.LockNotAvailableError,
    asyncpg.exceptions.InterfaceError,
    asyncpg.exceptions.ConnectionDoesNotExistError,
)


@contextlib.contextmanager
def translate_errors() -> Iterator[None]:
    """Turn driver errors into ours: 'not answering' into StoreUnavailable, a
    refused value into RefusedValue; anything else is a bug and stays as it is."""
    try:
        yield
    except UNAVAILABLE as exc:
        raise unavailable(exc) from exc
    except asyncpg.exceptions.DataError as exc:
        raise refused_value(exc) from exc


def translated(exc: Exception) -> Exception:
    """The error translate_errors would raise for `exc`."""
    if isinstance(exc, UNAVAILABLE):
        return unavailable(exc)
    if isinstance(exc, asyncpg.exceptions.DataError):
        return refused_value(exc)
    return exc


def refused_value(exc: BaseException) -> RefusedValue:
    """A data exception as the caller may see it: the SQLSTATE, not the server's text."""
    sqlstate = getattr(exc, "sqlstate", None) or "22000"
    return RefusedValue(f"the database refused a value of this request (SQLSTATE {sqlstate})")


def unavailable(exc: BaseException) -> StoreUnavailable:
    """The error a caller sees for a database that did not answer."""
    return StoreUnavailable(f"database unavailable: {exc.__class__.__name__}: {exc}")


async def open_connection(
    dsn: str,
    *,
    statement_timeout_ms: int,
    lock_timeout_ms: int,
    application_name: str = "llmquota",
) -> asyncpg.Connection:
    """One connection (for a CLI command) carrying the statement and lock timeouts."""
    with translate_errors():
        connection: asyncpg.Connection = await asyncpg.connect(
            dsn,
            server_settings={
                "statement_timeout": str(statement_timeout_ms),
                "lock_timeout": str(lock_timeout_ms),
                "application_name": application_name,
            },
        )
    return connection
