"""Reliability: per-layer failure modes and the outage mode of a reservation.

Tables only: the outage and audit functions (sql/reliability.sql) are
repeatable, applied after the versioned migrations (see migrations/README.md).

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-30
"""

from alembic import op

from llmquota.store.migration_support import execute_script

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None

SCHEMA = r"""
-- What a layer does when PostgreSQL cannot decide in time: refuse (closed),
-- admit and count (open), or admit against a worker-local fraction of its
-- limits (local). Workers cache it with the rest of the policy.
ALTER TABLE limit_layers
    ADD COLUMN failure_mode text NOT NULL DEFAULT 'closed'
        CHECK (failure_mode IN ('closed', 'open', 'local'));

-- A reservation a worker admitted on its own during an outage, recorded when
-- the store came back: the failure mode that admitted it. NULL for the
-- reservations PostgreSQL decided itself.
ALTER TABLE reservations
    ADD COLUMN outage_mode text CHECK (outage_mode IN ('open', 'local'));
"""


def upgrade() -> None:
    execute_script(SCHEMA)


def downgrade() -> None:
    # The functions of reliability.sql read the columns about to go.
    op.execute("DROP FUNCTION IF EXISTS lq_record_outage_admissions, lq_audit")
    op.execute("ALTER TABLE reservations DROP COLUMN IF EXISTS outage_mode")
    op.execute("ALTER TABLE limit_layers DROP COLUMN IF EXISTS failure_mode")
