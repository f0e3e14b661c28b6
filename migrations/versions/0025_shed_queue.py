"""A queue step in the shedding ladder: requests a step sheds may wait for room.

- `limit_layers` gains, for provider ceilings, `shed_queue_ms`: parallel to
  `shed_above` (migration 0008), the milliseconds a request that step sheds
  may wait for room instead of an immediate 429 (NULL in a step, or a NULL
  array: none, the 429 at once). The admin service validates it
  (llmquota.domain.plans.ShedStep), as 0008 says of the other ladder arrays.

Revision ID: 0025
Revises: 0024
Create Date: 2026-12-03
"""

from llmquota.store.migration_support import execute_script

revision = "0025"
down_revision = "0024"
branch_labels = None
depends_on = None

SCHEMA = r"""
ALTER TABLE limit_layers
    ADD COLUMN shed_queue_ms integer[];
"""

DOWNGRADE = r"""
-- The functions of these scripts read the column that goes (migrations/README.md):
-- the next upgrade to head applies them again.
DELETE FROM schema_repeatables WHERE name IN ('plans.sql', 'queries.sql');
ALTER TABLE limit_layers
    DROP COLUMN shed_queue_ms;
"""


def upgrade() -> None:
    execute_script(SCHEMA)


def downgrade() -> None:
    execute_script(DOWNGRADE)
