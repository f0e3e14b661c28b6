"""Quotas and prepaid credits reserved by admission itself.

- `plans.prepaid` and `limit_layers.prepaid` (tenant layers, effective: the
  tenant's own setting, else its plan's): admission reserves a prepaid
  tenant's maximum cost against its credit balance.
- `reservations` remembers what admission reserved beyond tokens, so that
  settlement, release and expiry give back exactly that:
  - `quota_ids`: the calendar quotas it was reserved against (their window
    is the one holding `created_at`);
  - `reserved_cost`: the request's maximum cost at the prices in force at
    admission (input and output priced apart), NULL when unpriced;
  - `credit_reserved`: what was held on the prepaid balance (NULL: none).

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-01
"""

from llmquota.store.migration_support import execute_script

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None

SCHEMA = r"""
ALTER TABLE plans ADD COLUMN prepaid boolean NOT NULL DEFAULT false;
ALTER TABLE limit_layers ADD COLUMN prepaid boolean NOT NULL DEFAULT false;
ALTER TABLE reservations
    ADD COLUMN quota_ids bigint[] NOT NULL DEFAULT '{}',
    ADD COLUMN reserved_cost numeric CHECK (reserved_cost >= 0),
    ADD COLUMN credit_reserved numeric CHECK (credit_reserved >= 0);
"""


def upgrade() -> None:
    execute_script(SCHEMA)


def downgrade() -> None:
    execute_script(
        """
        -- The admission, settlement and plan functions read these columns.
        DROP FUNCTION IF EXISTS lq_admit(text[], text[], text[], bigint[], bigint[], boolean[],
            integer[], text[], text[], integer, smallint[], boolean[], boolean[], integer[],
            text[], bigint[]);
        DROP FUNCTION IF EXISTS lq_finish(uuid[], text[], text[], bigint[], bigint[], text[]);
        DROP FUNCTION IF EXISTS lq_materialize_layers(bigint[]);
        DROP FUNCTION IF EXISTS lq_put_plan(text, smallint, bigint, bigint, bigint, bigint,
            integer, integer, text, text[], boolean);
        DELETE FROM schema_repeatables WHERE name IN ('admission.sql', 'plans.sql');
        ALTER TABLE reservations
            DROP COLUMN quota_ids, DROP COLUMN reserved_cost, DROP COLUMN credit_reserved;
        ALTER TABLE limit_layers DROP COLUMN prepaid;
        ALTER TABLE plans DROP COLUMN prepaid;
        """
    )
