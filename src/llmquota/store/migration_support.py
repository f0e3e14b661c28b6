"""Helpers the alembic migrations use.

SQLAlchemy's asyncpg dialect prepares every statement, and a prepared
statement cannot hold several commands or a dollar-quoted function body next
to others. Scripts therefore go to the asyncpg connection underneath, whose
plain `execute` uses the simple query protocol, inside the migration's
transaction: one statement at a time (sqlfiles.sql_statements), since Citus
passes a CREATE INDEX on a distributed table to its worker as the whole
string it came in, which the worker refuses when it holds several (a cell
upgraded in place runs its revisions against distributed tables).
"""

from __future__ import annotations

from alembic import op
from sqlalchemy.util import await_only

from llmquota.store.sqlfiles import sql_statements


def execute_script(sql: str) -> None:
    """Run a multi-statement SQL script in the current migration transaction.

    SQLAlchemy's asyncpg adapter sends its BEGIN lazily, before the first
    statement it runs itself, and the script goes to the driver underneath:
    without one statement through SQLAlchemy first, each of the script's
    would commit on its own, and a revision that failed half-way would leave
    half its changes behind an alembic_version that does not name it (and a
    setting made for the transaction would last one statement).
    """
    bind = op.get_bind()
    bind.exec_driver_sql("SELECT 1")
    raw = bind.connection.driver_connection
    if raw is None:
        raise RuntimeError("no driver connection for the migration")
    if not raw.is_in_transaction():
        raise RuntimeError("the migration's transaction has not begun")
    lock_timeout: str = await_only(raw.fetchval("SELECT current_setting('lock_timeout')"))
    for statement in (*lock_timeout_for_workers(lock_timeout), *sql_statements(sql)):
        await_only(raw.execute(statement))


def lock_timeout_for_workers(lock_timeout: str) -> tuple[str, str]:
    """The statements that give this transaction's Citus worker connections
    the session's `lock_timeout` too (llmquota.store.lock_patience).

    Citus sends a DDL statement to a worker over connections of its own,
    which a session's settings do not reach; a SET LOCAL does, with
    citus.propagate_set_commands = 'local', to each connection the
    transaction opens after it. A cell's service locks its tables on the
    worker only, so that is where a migration's wait must be bounded. On
    PostgreSQL without Citus the first is a placeholder setting, and the
    second sets what the session had.
    """
    quoted = lock_timeout.replace("'", "''")
    return (
        "SET LOCAL citus.propagate_set_commands = 'local'",
        f"SET LOCAL lock_timeout = '{quoted}'",
    )
