"""Key lifecycle: labels, scopes, expiry, revocation, rotation; tenant suspension.

- `api_keys` gains `prefix` (the first characters of the secret, shown at
  creation, so an operator can tell keys apart without the secret), `label`,
  `scopes` (what a tenant key may do: `admit`, `read`), `expires_at`,
  `revoked_at` (revocation keeps the row, for the audit of who had access),
  and `previous_hash` / `previous_expires_at`: a rotated key's old secret,
  valid until its grace ends.
- `api_key_uses` holds `last_used_at` apart from `api_keys`, so that noting a
  use (at most once a minute per key per worker) neither fires the
  `api_keys_announce` trigger of 0014 (which would make every worker look the
  key up again) nor locks the key's row against a revocation.
- `tenants` gains `suspended_at`; a change of it announces `tenants:<name>`,
  so every worker drops that tenant's keys from its cache and sees the
  suspension at their next use.
- A change of `previous_hash` announces the old secret's digest too (0014
  names `key_hash` only), so revoking or re-rotating a key in its grace period
  reaches the workers that cached the old secret.

Revision ID: 0018
Revises: 0017
Create Date: 2026-12-02
"""

from llmquota.store.migration_support import execute_script

revision = "0018"
down_revision = "0017"
branch_labels = None
depends_on = None

SCHEMA = r"""
ALTER TABLE api_keys
    ADD COLUMN prefix text,
    ADD COLUMN label text,
    ADD COLUMN scopes text[] NOT NULL DEFAULT ARRAY['admit', 'read']::text[]
        CHECK (scopes <@ ARRAY['admit', 'read']::text[] AND cardinality(scopes) > 0),
    ADD COLUMN expires_at timestamptz,
    ADD COLUMN revoked_at timestamptz,
    ADD COLUMN previous_hash bytea UNIQUE,
    ADD COLUMN previous_expires_at timestamptz,
    ADD CHECK ((previous_hash IS NULL) = (previous_expires_at IS NULL));
CREATE INDEX api_keys_tenant ON api_keys (tenant);

CREATE TABLE api_key_uses (
    key_id        bigint PRIMARY KEY REFERENCES api_keys ON DELETE CASCADE,
    last_used_at  timestamptz NOT NULL
);

ALTER TABLE tenants ADD COLUMN suspended_at timestamptz;

CREATE FUNCTION lq_notify_key_change() RETURNS trigger
LANGUAGE plpgsql
AS $$
BEGIN
    IF TG_TABLE_NAME = 'tenants' THEN
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

CREATE TRIGGER api_keys_announce_previous
    AFTER UPDATE OR DELETE ON api_keys
    FOR EACH ROW EXECUTE FUNCTION lq_notify_key_change();
CREATE TRIGGER tenants_announce_suspension
    AFTER UPDATE OF suspended_at ON tenants
    FOR EACH ROW EXECUTE FUNCTION lq_notify_key_change();
"""


def upgrade() -> None:
    execute_script(SCHEMA)


def downgrade() -> None:
    execute_script(
        """
        DROP TRIGGER IF EXISTS tenants_announce_suspension ON tenants;
        DROP TRIGGER IF EXISTS api_keys_announce_previous ON api_keys;
        DROP FUNCTION IF EXISTS lq_notify_key_change();
        ALTER TABLE tenants DROP COLUMN IF EXISTS suspended_at;
        DROP TABLE IF EXISTS api_key_uses;
        DROP INDEX IF EXISTS api_keys_tenant;
        ALTER TABLE api_keys
            DROP COLUMN IF EXISTS previous_expires_at,
            DROP COLUMN IF EXISTS previous_hash,
            DROP COLUMN IF EXISTS revoked_at,
            DROP COLUMN IF EXISTS expires_at,
            DROP COLUMN IF EXISTS scopes,
            DROP COLUMN IF EXISTS label,
            DROP COLUMN IF EXISTS prefix;
        """
    )
