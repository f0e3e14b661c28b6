"""When outage usage happened: the moment a worker journaled it, for billing.

A reservation a worker admitted on its own during a store outage reaches the
database later, when the journal is replayed (lq_record_outage_admissions,
then lq_finish_outage in sql/reliability.sql). Its calendar quotas must be
charged in the window the usage happened, not the one the replay falls in,
and its cost priced as it was then. `created_at` takes the journaled moment
of the admission; this column holds the journaled moment of the settlement.

- `reservations.usage_at`: when the usage of an outage reservation happened
  (the worker's clock at its settle, never later than the database clock at
  replay); NULL for every other reservation, whose usage counts when
  lq_finish settles it.

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-02
"""

from llmquota.store.migration_support import execute_script

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None

SCHEMA = r"""
ALTER TABLE reservations ADD COLUMN usage_at timestamptz;
COMMENT ON COLUMN reservations.usage_at IS
    'when the usage of an outage reservation happened, by the worker journal; NULL otherwise';
"""


def upgrade() -> None:
    execute_script(SCHEMA)


def downgrade() -> None:
    execute_script(
        """
        -- The functions that read the column go with it; the scripts
        -- re-create today's bodies on the next upgrade.
        DROP FUNCTION IF EXISTS lq_finish_outage(uuid[], text[], text[], bigint[], bigint[],
            text[], timestamptz[]);
        DROP FUNCTION IF EXISTS lq_record_outage_admissions(uuid[], text[], text[], text[],
            bigint[], bigint[], boolean[], integer[], text[], text[], bigint[], text[],
            timestamptz[]);
        DROP FUNCTION IF EXISTS lq_finish(uuid[], text[], text[], bigint[], bigint[], text[]);
        DELETE FROM schema_repeatables WHERE name IN ('admission.sql', 'reliability.sql');
        ALTER TABLE reservations DROP COLUMN usage_at;
        """
    )
