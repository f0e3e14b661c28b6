"""Upstream usage is never dropped: where a settlement's figures came from.

- `usage_ledger.usage_source`: `reported` (as the caller or the upstream
  reported them), `clamped` (an upstream reported more than the settle
  limit: settled at that limit) or `counted` (an upstream reported nothing
  usable: the relayed text counted with tiktoken). NULL on rows without
  settled figures (an expiry, an adjustment) and on rows older than this
  revision.
- `usage_ledger.reported_input_tokens`, `reported_output_tokens`: the
  upstream's own figure, in full, where it differs from the settled one (a
  clamped or a negative report); NULL otherwise. numeric, because a provider
  can report a figure no bigint holds, and the ledger keeps what it said.
- `reservations.relayed_at`: when the proxy first relayed output of this
  reservation to its client (marked by a heartbeat), so the audit can tell a
  reservation whose text went out but whose usage never landed.

Nullable columns without a default: adding them to the partitioned ledger
(and to each partition, which PostgreSQL does) rewrites nothing.

Revision ID: 0016
Revises: 0015
Create Date: 2026-12-02
"""

from llmquota.store.migration_support import execute_script

revision = "0016"
down_revision = "0015"
branch_labels = None
depends_on = None

SCHEMA = r"""
ALTER TABLE usage_ledger
    ADD COLUMN usage_source text
        CONSTRAINT usage_ledger_usage_source
        CHECK (usage_source IN ('reported', 'counted', 'clamped')),
    ADD COLUMN reported_input_tokens numeric
        CONSTRAINT usage_ledger_reported_input_whole
        CHECK (reported_input_tokens = trunc(reported_input_tokens)),
    ADD COLUMN reported_output_tokens numeric
        CONSTRAINT usage_ledger_reported_output_whole
        CHECK (reported_output_tokens = trunc(reported_output_tokens));
COMMENT ON COLUMN usage_ledger.usage_source IS
    'where the figures came from: reported, clamped (an upstream figure above the settle '
    'limit, settled at it) or counted (an unusable upstream figure, replaced by tiktoken)';
COMMENT ON COLUMN usage_ledger.reported_input_tokens IS
    'the upstream''s own input figure where it differs from the settled one';
COMMENT ON COLUMN usage_ledger.reported_output_tokens IS
    'the upstream''s own output figure where it differs from the settled one';

ALTER TABLE reservations ADD COLUMN relayed_at timestamptz;
COMMENT ON COLUMN reservations.relayed_at IS
    'when the proxy first relayed output of this reservation to its client';
"""


def upgrade() -> None:
    execute_script(SCHEMA)


def downgrade() -> None:
    execute_script(
        """
        -- The functions and views that read the columns go with them; the
        -- scripts re-create today's bodies on the next upgrade.
        DROP FUNCTION IF EXISTS lq_audit();
        DROP FUNCTION IF EXISTS lq_audit_relayed();
        DROP FUNCTION IF EXISTS lq_sweep(integer);
        DROP FUNCTION IF EXISTS lq_finish(uuid[], text[], text[], bigint[], bigint[], text[],
            text[], numeric[], numeric[]);
        DROP FUNCTION IF EXISTS lq_export_ledger(bigint, integer, integer);
        DROP VIEW IF EXISTS reporting.ledger_entries CASCADE;
        DELETE FROM schema_repeatables
         WHERE name IN ('admission.sql', 'ledger.sql', 'reliability.sql')
            OR name LIKE 'reports/%';
        ALTER TABLE reservations DROP COLUMN IF EXISTS relayed_at;
        ALTER TABLE usage_ledger
            DROP COLUMN IF EXISTS reported_output_tokens,
            DROP COLUMN IF EXISTS reported_input_tokens,
            DROP COLUMN IF EXISTS usage_source;
        """
    )
