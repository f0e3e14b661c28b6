"""Key and suspension announcements that also run on a Citus shard.

lq_notify_key_change (migration 0018) told its two tables apart by
TG_TABLE_NAME = 'tenants'. In a cell on Citus (`llmquota migrate --cells`)
the trigger fires on the table's shard, named `tenants_<shard id>`, so a
suspension took the api_keys branch and failed on a field tenants lacks:
suspending or resuming a tenant in such a cell was an error. The branch is
now taken on the table's name without a shard's suffix. What the
announcement says is unchanged ('tenants:<name>', 'api_keys:<digest>').

Revision ID: 0033
Revises: 0032
Create Date: 2026-12-06
"""

from llmquota.store.migration_support import execute_script

revision = "0033"
down_revision = "0032"
branch_labels = None
depends_on = None

BODY = r"""
CREATE OR REPLACE FUNCTION lq_notify_key_change() RETURNS trigger
LANGUAGE plpgsql
AS $$
BEGIN
    IF {tenants} THEN
        IF OLD.suspended_at IS DISTINCT FROM NEW.suspended_at THEN
            PERFORM pg_notify('llmquota_changes', 'tenants:' || NEW.tenant);
        END IF;
    ELSIF OLD.previous_hash IS NOT NULL
          AND (TG_OP = 'DELETE' OR OLD.previous_hash IS DISTINCT FROM NEW.previous_hash
               OR OLD.revoked_at IS DISTINCT FROM NEW.revoked_at) THEN
        PERFORM pg_notify('llmquota_changes', 'api_keys:' || encode(OLD.previous_hash, 'hex'));
    END IF;
    RETURN NULL;
END
$$;
"""


def upgrade() -> None:
    execute_script(BODY.format(tenants=r"TG_TABLE_NAME ~ '^tenants(_[0-9]+)?$'"))


def downgrade() -> None:
    execute_script(BODY.format(tenants="TG_TABLE_NAME = 'tenants'"))
