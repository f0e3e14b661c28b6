"""The record of the repeatable scripts: which version of each the database runs.

`llmquota migrate`, after the versioned migrations, applies every repeatable
script of sql/ (functions, views, grants) whose SHA-256 differs from the one
recorded here, and records the new one (llmquota.store.migrate.apply_repeatables;
see migrations/README.md). An empty table means none was applied yet: the
first run applies them all.

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-01
"""

from llmquota.store.migration_support import execute_script

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None

SCHEMA = r"""
CREATE TABLE schema_repeatables (
    name        text PRIMARY KEY CHECK (name ~ '^[A-Za-z0-9_./-]+\.sql$'),
    checksum    text NOT NULL CHECK (checksum ~ '^[0-9a-f]{64}$'),
    applied_at  timestamptz NOT NULL DEFAULT clock_timestamp()
);
COMMENT ON TABLE schema_repeatables IS
    'repeatable scripts of sql/ applied by llmquota migrate: path under sql/, sha256 of the file';
"""


def upgrade() -> None:
    execute_script(SCHEMA)


def downgrade() -> None:
    # Functions and views stay (their bodies are today's); without a record,
    # the next upgrade to head applies every repeatable script again.
    execute_script("DROP TABLE IF EXISTS schema_repeatables")
