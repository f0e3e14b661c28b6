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
from typing import Any, TypeAlias

import asyncpg

from llmquota.domain.errors import InvalidRequest, RefusedValue, StoreUnavailable

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
def translate_errors(*, own_refusals: bool = False) -> Iterator[None]:
    """Turn driver errors into ours: 'not answering' into StoreUnavailable, a
    refused value into RefusedValue; anything else is a bug and stays as it is.

    own_refusals: the statement calls our own functions, whose
    invalid_parameter_value refusals (RAISE ... USING ERRCODE) are written
    for the operator (the finance commands): they become InvalidRequest with
    the function's message instead of a bare SQLSTATE.
    """
    try:
        yield
    except UNAVAILABLE as exc:
        raise unavailable(exc) from exc
    except asyncpg.exceptions.InvalidParameterValueError as exc:
        if own_refusals:
            raise InvalidRequest(exc.args[0] if exc.args else str(exc)) from exc
        raise refused_value(exc) from exc
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


# Citus (docs/scaling.md) hides its shards from every query that reads
# pg_class, by a filter that calls relation_is_a_known_shard() on each row.
# asyncpg's type introspection, run once per connection for the composite and
# array types of our statements, reads pg_class in correlated subqueries: with
# the filter it took 0.5 to 0.8 s on a coordinator with no shard at all (2 ms
# without), so a new connection's first decision passed the 250 ms deadline,
# was cancelled with its connection, and the next one started cold again:
# every request a 503 (issue 26). Our sessions never list tables, so hiding
# buys them nothing. Elsewhere it is an unused placeholder setting. Behind a
# transaction pooler it is the role's to carry (docs/operations.md).
CITUS_SESSION_SETTINGS = {"citus.override_table_visibility": "off"}


def session_options(
    *,
    statement_timeout_ms: int,
    lock_timeout_ms: int,
    transaction_pooler: bool,
    application_name: str = "llmquota",
    extra: dict[str, str] | None = None,
) -> dict[str, Any]:
    """asyncpg's connection arguments for a direct server or a transaction pooler.

    Direct: the timeouts travel as startup parameters, and statements are
    prepared once per connection and cached. Behind a pooler in transaction
    mode (PgBouncer, `pool_mode = transaction`) a session is lent for one
    transaction at a time, so nothing may live in it: PgBouncer refuses
    startup parameters other than a few (application_name is one of them),
    and Debian's PgBouncer 1.18 does not track prepared statements (1.21's
    `max_prepared_statements` does), so a named statement prepared on one
    server connection would be executed on another. There the statement cache
    is off (asyncpg then uses the unnamed statement, parsed and executed within
    one exchange), and the timeouts are the role's (`ALTER ROLE ... SET`, see
    docs/operations.md), which no pooled session can lose.
    """
    if transaction_pooler:
        return {
            "server_settings": {"application_name": application_name},
            "statement_cache_size": 0,
        }
    return {
        "server_settings": {
            "statement_timeout": str(statement_timeout_ms),
            "lock_timeout": str(lock_timeout_ms),
            "application_name": application_name,
            **CITUS_SESSION_SETTINGS,
            **(extra or {}),
        }
    }


async def open_connection(
    dsn: str,
    *,
    statement_timeout_ms: int,
    lock_timeout_ms: int,
    application_name: str = "llmquota",
    transaction_pooler: bool = False,
) -> asyncpg.Connection:
    """One connection (for a CLI command) carrying the statement and lock timeouts."""
    options = session_options(
        statement_timeout_ms=statement_timeout_ms,
        lock_timeout_ms=lock_timeout_ms,
        transaction_pooler=transaction_pooler,
        application_name=application_name,
    )
    with translate_errors():
        connection: asyncpg.Connection = await asyncpg.connect(dsn, **options)
    return connection
