"""Plans carry `admission`: the way their tenants' requests are decided.

`plans.admission` ('exact' or 'allotted'; NULL: exact) is what a tenant on
the plan takes where its own policy sets none, as it takes the plan's
response cache and output estimate (lq_materialize_layers in sql/plans.sql);
a route's own setting still wins over its tenant's.

Revision ID: 0030
Revises: 0029
Create Date: 2026-12-05
"""

from llmquota.store.migration_support import execute_script

revision = "0030"
down_revision = "0029"
branch_labels = None
depends_on = None

SCHEMA = r"""
ALTER TABLE plans
    ADD COLUMN admission text
        CONSTRAINT plans_admission CHECK (admission IS NULL
                                          OR admission IN ('exact', 'allotted'));
"""

DOWNGRADE = r"""
-- The functions of these scripts read the column that goes (migrations/README.md):
-- the next upgrade to head applies them again.
DELETE FROM schema_repeatables WHERE name IN ('plans.sql', 'queries.sql');
DROP FUNCTION IF EXISTS lq_put_plan(text, smallint, bigint, bigint, bigint, bigint, integer,
                                    integer, text, text[], boolean, jsonb, jsonb, text);
DROP FUNCTION IF EXISTS lq_materialize_layers(bigint[]);
ALTER TABLE plans DROP COLUMN admission;
"""


def upgrade() -> None:
    execute_script(SCHEMA)


def downgrade() -> None:
    execute_script(DOWNGRADE)
