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
    now_ts timestamptz;
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
    now_ts := clock_timestamp();
    UPDATE api_keys
       SET revoked_at = now_ts, previous_hash = NULL, previous_expires_at = NULL
     WHERE key_id = p_key_id;
    RETURN 'revoked';
END
$$;


-- The service's other writes of keys: functions, not statements of
-- queries.sql, because they stamp rows with the database clock or a policy
-- version, read once into a variable here, on the node that holds the rows
-- (in a cell on Citus the call runs whole on the cell's node, and Citus
-- refuses a volatile function inside a modification of a distributed table).

-- Store a key's digest for a tenant (NULL: an admin key) with its prefix,
-- label, scopes and expiry, registering the tenant if it is new (as
-- ensure_tenant does). The expiry must be in the future by the database's
-- clock: no row otherwise, and no tenant registered either. With p_limited,
-- the key's own limits in the same call: its layer (starting full) and its
-- models (p_models as written, p_model_patterns as LIKE patterns).
CREATE OR REPLACE FUNCTION lq_insert_api_key(
    p_key_hash bytea, p_tenant text, p_prefix text, p_label text, p_scopes text[],
    p_expires_at timestamptz, p_tokens_per_minute bigint, p_token_burst bigint,
    p_requests_per_minute bigint, p_request_burst bigint, p_max_in_flight integer,
    p_models text[], p_model_patterns text[], p_limited boolean
) RETURNS TABLE (key_id bigint, tenant text, prefix text, label text, scopes text[],
                 created_at timestamptz, expires_at timestamptz, revoked_at timestamptz,
                 models text[], last_used_at timestamptz, tokens_per_minute bigint,
                 token_burst bigint, requests_per_minute bigint, request_burst bigint,
                 max_in_flight integer)
LANGUAGE plpgsql
AS $$
#variable_conflict use_column
DECLARE
    k api_keys;
    l limit_layers;
BEGIN
    IF p_expires_at <= clock_timestamp() THEN
        RETURN;
    END IF;
    IF p_tenant IS NOT NULL THEN
        PERFORM lq_ensure_tenant(p_tenant);
    END IF;
    INSERT INTO api_keys (key_hash, tenant, prefix, label, scopes, expires_at, models)
    VALUES (p_key_hash, p_tenant, p_prefix, p_label, p_scopes, p_expires_at, p_models)
    RETURNING * INTO k;
    IF p_limited AND p_tenant IS NOT NULL THEN
        INSERT INTO limit_layers (scope, tenant, api_key_id, tokens_per_minute, token_burst,
                                  requests_per_minute, request_burst, max_in_flight,
                                  allowed_models, tokens, requests)
        VALUES ('key', p_tenant, k.key_id, p_tokens_per_minute, p_token_burst,
                p_requests_per_minute, p_request_burst, p_max_in_flight, p_model_patterns,
                p_token_burst, p_request_burst)
        RETURNING * INTO l;
    END IF;
    RETURN QUERY
    SELECT k.key_id, k.tenant, k.prefix, k.label, k.scopes, k.created_at, k.expires_at,
           k.revoked_at, k.models, NULL::timestamptz, l.tokens_per_minute, l.token_burst,
           l.requests_per_minute, l.request_burst, l.max_in_flight;
END
$$;


-- Give key p_key_id (of tenant p_tenant; an admin key when p_admin) the new
-- digest and prefix; the old secret stays valid for p_grace_seconds (none
-- when 0). A revoked or expired key is not rotated: `rotated` false then. No
-- row: no such key of that kind.
CREATE OR REPLACE FUNCTION lq_rotate_api_key(
    p_key_id bigint, p_tenant text, p_admin boolean, p_key_hash bytea, p_prefix text,
    p_grace_seconds integer
) RETURNS TABLE (rotated boolean, key_id bigint, tenant text, prefix text, label text,
                 scopes text[], created_at timestamptz, expires_at timestamptz,
                 revoked_at timestamptz, last_used_at timestamptz, models text[],
                 tokens_per_minute bigint, token_burst bigint, requests_per_minute bigint,
                 request_burst bigint, max_in_flight integer)
LANGUAGE plpgsql
AS $$
#variable_conflict use_column
DECLARE
    now_ts constant timestamptz := clock_timestamp();
    -- Worked out here, not in the UPDATE: Citus refuses a CASE whose branches
    -- call a function that is not immutable (timestamptz + interval is stable).
    grace_until constant timestamptz :=
        CASE WHEN p_grace_seconds > 0 THEN now_ts + make_interval(secs => p_grace_seconds) END;
    usable boolean;
    k api_keys;
BEGIN
    SELECT ak.revoked_at IS NULL AND (ak.expires_at IS NULL OR ak.expires_at > now_ts)
      INTO usable
      FROM api_keys AS ak
     WHERE ak.key_id = p_key_id
       AND CASE WHEN p_admin THEN ak.tenant IS NULL ELSE ak.tenant = p_tenant END
       FOR UPDATE;
    IF NOT FOUND THEN
        RETURN;
    END IF;
    IF usable THEN
        UPDATE api_keys AS ak
           SET previous_hash = CASE WHEN p_grace_seconds > 0 THEN ak.key_hash END,
               previous_expires_at = grace_until,
               key_hash = p_key_hash,
               prefix = p_prefix
         WHERE ak.key_id = p_key_id
        RETURNING * INTO k;
    END IF;
    RETURN QUERY
    SELECT usable, k.key_id, k.tenant, k.prefix, k.label, k.scopes, k.created_at,
           k.expires_at, k.revoked_at, u.last_used_at, k.models, l.tokens_per_minute,
           l.token_burst, l.requests_per_minute, l.request_burst, l.max_in_flight
      FROM (SELECT 1) AS one
      LEFT JOIN api_key_uses AS u ON u.key_id = k.key_id
      LEFT JOIN limit_layers AS l ON l.api_key_id = k.key_id;
END
$$;


-- Replace the limits of key p_key_id of tenant p_tenant (models p_models as
-- written, p_model_patterns as LIKE patterns), creating its layer on first
-- use. As lq_put_policy: the balance refills under the old rules up to now,
-- then is clamped to the new capacity; a limit that did not exist before
-- starts full. Writing the key row announces it (api_keys_announce): every
-- worker looks the key up again and sees its layer and models. A revoked key
-- keeps its row; its limits can still be read, not changed: no row then, as
-- for no such key. The conflict clause reads the clock and the version from
-- the proposed row, taken under lq_lock_policy_key, as lq_put_policy's does.
CREATE OR REPLACE FUNCTION lq_put_key_limits(
    p_key_id bigint, p_tenant text, p_tokens_per_minute bigint, p_token_burst bigint,
    p_requests_per_minute bigint, p_request_burst bigint, p_max_in_flight integer,
    p_models text[], p_model_patterns text[]
) RETURNS TABLE (layer_id bigint)
LANGUAGE plpgsql
AS $$
#variable_conflict use_column
BEGIN
    PERFORM lq_lock_policy_key('key', p_tenant, NULL, NULL, p_key_id);
    UPDATE api_keys AS k
       SET models = p_models
     WHERE k.key_id = p_key_id AND k.tenant = p_tenant AND k.revoked_at IS NULL;
    IF NOT FOUND THEN
        RETURN;
    END IF;
    RETURN QUERY
    INSERT INTO limit_layers AS l (scope, tenant, api_key_id, tokens_per_minute, token_burst,
                                   requests_per_minute, request_burst, max_in_flight,
                                   allowed_models, tokens, requests, policy_version,
                                   refilled_at)
    VALUES ('key', p_tenant, p_key_id, p_tokens_per_minute, p_token_burst,
            p_requests_per_minute, p_request_burst, p_max_in_flight, p_model_patterns,
            p_token_burst, p_request_burst, nextval('policy_version_seq'), clock_timestamp())
    ON CONFLICT (scope, tenant, route, ceiling, shard, api_key_id) DO UPDATE
       SET tokens_per_minute   = excluded.tokens_per_minute,
           token_burst         = excluded.token_burst,
           requests_per_minute = excluded.requests_per_minute,
           request_burst       = excluded.request_burst,
           max_in_flight       = excluded.max_in_flight,
           allowed_models      = excluded.allowed_models,
           policy_version      = excluded.policy_version,
           tokens = lq_rebalanced(l.tokens, l.tokens_per_minute, l.token_burst, l.refilled_at,
                                  excluded.tokens_per_minute, excluded.token_burst,
                                  excluded.refilled_at),
           requests = lq_rebalanced(l.requests, l.requests_per_minute, l.request_burst,
                                    l.refilled_at, excluded.requests_per_minute,
                                    excluded.request_burst, excluded.refilled_at),
           refilled_at = greatest(l.refilled_at, excluded.refilled_at)
    RETURNING l.layer_id;
END
$$;


-- Store an admin key's digest unless an admin key exists already; its id,
-- or no row. A function for the reason lq_ensure_tenant is one.
CREATE OR REPLACE FUNCTION lq_insert_first_admin_key(p_key_hash bytea, p_prefix text)
RETURNS TABLE (key_id bigint)
LANGUAGE plpgsql
AS $$
#variable_conflict use_column
BEGIN
    IF EXISTS (SELECT 1 FROM api_keys WHERE tenant IS NULL) THEN
        RETURN;
    END IF;
    RETURN QUERY
    INSERT INTO api_keys (key_hash, tenant, prefix, label)
    VALUES (p_key_hash, NULL, p_prefix, 'generated at first start')
    RETURNING api_keys.key_id;
END
$$;


-- Remember that key p_key_id was used now (a worker calls this at most once a
-- minute per key; api_key_uses is apart from api_keys so this fires no
-- announcement and takes no lock a revocation would wait on).
CREATE OR REPLACE FUNCTION lq_note_key_use(p_key_id bigint)
RETURNS void
LANGUAGE plpgsql
AS $$
BEGIN
    IF EXISTS (SELECT 1 FROM api_keys WHERE key_id = p_key_id) THEN
        INSERT INTO api_key_uses AS u (key_id, last_used_at)
        VALUES (p_key_id, clock_timestamp())
        ON CONFLICT (key_id) DO UPDATE
           SET last_used_at = greatest(u.last_used_at, excluded.last_used_at);
    END IF;
END
$$;
