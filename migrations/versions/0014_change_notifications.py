"""Changes announced: a NOTIFY on `llmquota_changes` from every table workers cache.

Each worker caches policies (with their output estimates, plans and
failure modes), and keys; a change must reach them at once, not at their
next periodic refresh (store/listener.py). NOTIFY is transactional, so a
trigger on the table, in the transaction that changes it, announces exactly
the committed changes and nothing that rolled back.

- `limit_layers`: a statement that inserts or deletes layers, or sets their
  `policy_version` (every policy, plan or ceiling change takes a new one from
  `policy_version_seq`), announces `limit_layers`. Admission and settlement
  update balances only and never name `policy_version`, so they fire nothing.
- `plans`, `quotas`: any change announces the table's name.
- `api_keys`: each row changed announces `api_keys:<hex of key_hash>`, so a
  worker drops just that key from its cache.

The trigger function `lq_notify_change` is a frozen copy here (no
repeatable script owns it): it is the triggers' own.

Revision ID: 0014
Revises: 0013
Create Date: 2026-12-02
"""

from llmquota.store.migration_support import execute_script

revision = "0014"
down_revision = "0013"
branch_labels = None
depends_on = None

SCHEMA = r"""
CREATE OR REPLACE FUNCTION lq_notify_change() RETURNS trigger
LANGUAGE plpgsql
AS $$
BEGIN
    -- Row triggers (api_keys) name the key; statement triggers the table.
    IF TG_LEVEL = 'ROW' THEN
        PERFORM pg_notify('llmquota_changes', TG_TABLE_NAME || ':' ||
                          encode(CASE WHEN TG_OP = 'DELETE' THEN OLD.key_hash
                                      ELSE NEW.key_hash END, 'hex'));
        IF TG_OP = 'UPDATE' AND OLD.key_hash IS DISTINCT FROM NEW.key_hash THEN
            PERFORM pg_notify('llmquota_changes',
                              TG_TABLE_NAME || ':' || encode(OLD.key_hash, 'hex'));
        END IF;
        RETURN NULL;
    END IF;
    PERFORM pg_notify('llmquota_changes', TG_TABLE_NAME);
    RETURN NULL;
END
$$;

CREATE TRIGGER limit_layers_announce
    AFTER INSERT OR DELETE OR UPDATE OF policy_version ON limit_layers
    FOR EACH STATEMENT EXECUTE FUNCTION lq_notify_change();
CREATE TRIGGER plans_announce
    AFTER INSERT OR UPDATE OR DELETE ON plans
    FOR EACH STATEMENT EXECUTE FUNCTION lq_notify_change();
CREATE TRIGGER quotas_announce
    AFTER INSERT OR UPDATE OR DELETE ON quotas
    FOR EACH STATEMENT EXECUTE FUNCTION lq_notify_change();
CREATE TRIGGER api_keys_announce
    AFTER INSERT OR UPDATE OR DELETE ON api_keys
    FOR EACH ROW EXECUTE FUNCTION lq_notify_change();
"""


def upgrade() -> None:
    execute_script(SCHEMA)


def downgrade() -> None:
    execute_script(
        """
        DROP TRIGGER IF EXISTS api_keys_announce ON api_keys;
        DROP TRIGGER IF EXISTS quotas_announce ON quotas;
        DROP TRIGGER IF EXISTS plans_announce ON plans;
        DROP TRIGGER IF EXISTS limit_layers_announce ON limit_layers;
        DROP FUNCTION IF EXISTS lq_notify_change();
        """
    )
