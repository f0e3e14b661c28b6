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
    """Run a multi-statement SQL script in the current migration transaction."""
    raw = op.get_bind().connection.driver_connection
    if raw is None:
        raise RuntimeError("no driver connection for the migration")
    for statement in sql_statements(sql):
        await_only(raw.execute(statement))
