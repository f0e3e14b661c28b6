"""Provider ceilings scoped to one deployment, and the deployment each admission chose.

- `limit_layers` gains, for provider ceilings, `upstream`: the deployment (an
  upstream's name in LLMQUOTA_UPSTREAMS_FILE) whose own limit the ceiling
  mirrors. NULL: the ceiling bounds every deployment of its models, as
  before. lq_admit charges a scoped ceiling only to requests it sends to that
  deployment, and chooses among a model's deployments in the same statement
  (sql/admission.sql).
- `reservations` gains `upstream`: the deployment lq_admit chose (NULL: the
  caller named none), journaled with the reservation.

Revision ID: 0027
Revises: 0026
Create Date: 2026-12-04
"""

from llmquota.store.migration_support import execute_script

revision = "0027"
down_revision = "0026"
branch_labels = None
depends_on = None

SCHEMA = r"""
ALTER TABLE limit_layers
    ADD COLUMN upstream text,
    ADD CONSTRAINT limit_layers_upstream_ceiling
        CHECK (upstream IS NULL OR scope = 'ceiling');
ALTER TABLE reservations
    ADD COLUMN upstream text;
"""

DOWNGRADE = r"""
-- The functions of these scripts read the columns that go (migrations/README.md):
-- the next upgrade to head applies them again.
DELETE FROM schema_repeatables WHERE name IN ('admission.sql', 'plans.sql', 'queries.sql');
ALTER TABLE reservations
    DROP COLUMN upstream;
ALTER TABLE limit_layers
    DROP CONSTRAINT limit_layers_upstream_ceiling,
    DROP COLUMN upstream;
"""


def upgrade() -> None:
    execute_script(SCHEMA)


def downgrade() -> None:
    execute_script(DOWNGRADE)
