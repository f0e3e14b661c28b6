"""Helpers the alembic migrations use.

SQLAlchemy's asyncpg dialect prepares every statement, and a prepared
statement cannot hold several commands or a dollar-quoted function body next
to others. Scripts therefore go to the asyncpg connection underneath, whose
plain `execute` uses the simple query protocol, inside the migration's
transaction.
"""

from __future__ import annotations

from alembic import op
from sqlalchemy.util import await_only


def execute_script(sql: str) -> None:
    """Run a multi-statement SQL script in the current migration transaction."""
    raw = op.get_bind().connection.driver_connection
    if raw is None:
        raise RuntimeError("no driver connection for the migration")
    await_only(raw.execute(sql))
