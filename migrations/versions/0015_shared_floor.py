"""Shared layers forget like the limits they mirror: a floor at minus the burst.

- `usage_ledger.forgiven_tokens`: the most of a settlement's usage that one
  shared layer (the global layer, or a provider ceiling) did not take
  because it stood at minus its burst (lq_shared_forgiven in
  sql/admission.sql). The row keeps the full figures (billing truth); this
  column flags what the shared layers stopped counting.
- Data: a shared layer's balance below minus its burst (a debt that one
  settlement ran up before this revision) is raised to it, so that a ceiling
  that went to -9,989,999 admits again within a minute, not a day.

Revision ID: 0015
Revises: 0014
Create Date: 2026-12-02
"""

from llmquota.store.migration_support import execute_script

revision = "0015"
down_revision = "0014"
branch_labels = None
depends_on = None

SCHEMA = r"""
ALTER TABLE usage_ledger
    ADD COLUMN forgiven_tokens bigint NOT NULL DEFAULT 0
        CONSTRAINT usage_ledger_forgiven CHECK (forgiven_tokens >= 0);
COMMENT ON COLUMN usage_ledger.forgiven_tokens IS
    'tokens of this usage that a shared layer (global or a provider ceiling) was not debited '
    'because its balance stood at minus its burst: the most any one such layer forgave';

UPDATE limit_layers
   SET tokens = -token_burst
 WHERE scope IN ('global', 'ceiling') AND tokens < -token_burst;
"""


def upgrade() -> None:
    execute_script(SCHEMA)


def downgrade() -> None:
    execute_script(
        """
        -- lq_finish writes the column: it goes with it (migrations/README.md);
        -- the forgiven debts stay forgiven.
        DROP FUNCTION IF EXISTS lq_finish(uuid[], text[], text[], bigint[], bigint[], text[]);
        DELETE FROM schema_repeatables WHERE name = 'admission.sql';
        ALTER TABLE usage_ledger DROP COLUMN IF EXISTS forgiven_tokens;
        """
    )
