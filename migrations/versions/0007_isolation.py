"""Isolation: settlements above the possible maximum are flagged; outage ids are signed.

- `usage_ledger.excess_tokens`: what a settlement reported above the
  request's possible maximum (lq_shared_charge_cap). The ledger keeps the full
  figures (billing truth); this column flags the part that shared layers
  were not charged.
- `outage_id_key`: one random 32-byte key that every worker loads. A
  reservation id a worker makes during an outage carries a MAC under it, so
  an id in that format that no worker made (a made-up one) is told apart
  from a real one that is not recorded yet: 404, not 503 forever.

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-01
"""

from llmquota.store.migration_support import execute_script

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None

SCHEMA = r"""
ALTER TABLE usage_ledger
    ADD COLUMN excess_tokens bigint NOT NULL DEFAULT 0
        CONSTRAINT usage_ledger_excess CHECK (excess_tokens >= 0);
COMMENT ON COLUMN usage_ledger.excess_tokens IS
    'tokens settled above the request''s possible maximum (counted input with tolerance '
    'plus max_tokens): charged to the tenant''s own layers, not to shared ones';

CREATE TABLE outage_id_key (
    singleton  boolean PRIMARY KEY DEFAULT true CHECK (singleton),
    key        bytea NOT NULL CHECK (octet_length(key) = 32)
);
COMMENT ON TABLE outage_id_key IS
    'the key under which workers sign the reservation ids they make during an outage';
-- gen_random_uuid() is cryptographically random (122 bits each).
INSERT INTO outage_id_key (key)
VALUES (uuid_send(gen_random_uuid()) || uuid_send(gen_random_uuid()));
"""


def upgrade() -> None:
    execute_script(SCHEMA)


def downgrade() -> None:
    execute_script(
        """
        DROP TABLE IF EXISTS outage_id_key;
        -- lq_finish writes the column: it goes with it (migrations/README.md).
        DROP FUNCTION IF EXISTS lq_finish(uuid[], text[], text[], bigint[], bigint[], text[]);
        ALTER TABLE usage_ledger DROP COLUMN IF EXISTS excess_tokens;
        """
    )
