-- API keys: revocation, which must never leave the service without an admin key.
--
-- Repeatable script (functions only); the tables are migration 0018's.

-- Revoke key $1 of tenant $2 (NULL: an admin key), at the database's
-- clock. Returns 'revoked' (or already revoked: idempotent), 'unknown' (no
-- such key of that kind), or 'last_admin_key': the key is the last admin key
-- that stays usable (not revoked, never expiring) and $3 (another admin key is
-- configured outside the database: LLMQUOTA_ADMIN_KEY) is false; nothing is
-- changed then. The advisory lock serialises admin revocations, so two
-- concurrent revocations of the last two admin keys cannot both see the other
-- one as the survivor (each statement of a PL/pgSQL function in READ
-- COMMITTED takes a new snapshot, after the lock is held).
CREATE OR REPLACE FUNCTION lq_revoke_key(p_key_id bigint, p_tenant text,
                                         p_admin_elsewhere boolean)
RETURNS text
LANGUAGE plpgsql
AS $$
DECLARE
    p_admin constant boolean := p_tenant IS NULL;
    v_revoked timestamptz;
BEGIN
    IF p_admin AND NOT p_admin_elsewhere THEN
        PERFORM pg_advisory_xact_lock(hashtext('lq_revoke_admin_key'));
    END IF;
    SELECT revoked_at INTO v_revoked
      FROM api_keys
     WHERE key_id = p_key_id AND tenant IS NOT DISTINCT FROM p_tenant
       FOR UPDATE;
    IF NOT FOUND THEN
        RETURN 'unknown';
    END IF;
    IF v_revoked IS NOT NULL THEN
        RETURN 'revoked';
    END IF;
    IF p_admin AND NOT p_admin_elsewhere AND NOT EXISTS (
        SELECT 1 FROM api_keys
         WHERE tenant IS NULL AND key_id <> p_key_id
           AND revoked_at IS NULL AND expires_at IS NULL) THEN
        RETURN 'last_admin_key';
    END IF;
    UPDATE api_keys
       SET revoked_at = clock_timestamp(), previous_hash = NULL, previous_expires_at = NULL
     WHERE key_id = p_key_id;
    RETURN 'revoked';
END
$$;
