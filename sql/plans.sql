-- Plans (tiers) and provider ceilings: the administration side.
--
-- A tenant layer keeps two things: `own_policy`, the fields its own policy
-- set (a jsonb object of only those), and `plan`. Its limit columns are the
-- effective ones, what lq_admit reads: each field from the tenant's own
-- policy where it set it, else from the plan. A token (request) rate and its
-- burst travel together: a tenant that sets tokens_per_minute takes its own
-- token_burst (default: the rate), never the plan's. Whenever a tenant's
-- policy or its plan changes, lq_materialize_layers recomputes the effective
-- columns, so admission never joins plans on its hot path.
--
-- A provider ceiling is a limit_layers row of scope 'ceiling' (see migration
-- 0008); these functions only write it.


-- Recompute the effective limits of tenant layers from their own policy and
-- their plan, in one statement, with the same balance rule as put_policy: the
-- balance refills under the old rules up to now, then is clamped to the new
-- capacity; a limit that did not exist before starts full. Every layer
-- changed gets the call's new policy_version (one for all: it is the clock
-- and the version read once into variables, not a volatile call per row,
-- which Citus refuses in an UPDATE). The layers are locked in layer_id order
-- first, the order admission locks them in, so a plan change over many
-- tenants cannot deadlock with a batch of admissions.
CREATE OR REPLACE FUNCTION lq_materialize_layers(p_layer_ids bigint[])
RETURNS integer
LANGUAGE plpgsql
AS $$
DECLARE
    now_ts  timestamptz;
    version bigint;
    changed integer;
BEGIN
    PERFORM 1 FROM limit_layers
      WHERE layer_id = ANY (p_layer_ids)
      ORDER BY layer_id
        FOR UPDATE;
    now_ts := clock_timestamp();
    version := nextval('policy_version_seq');

    UPDATE limit_layers AS l
       SET tokens_per_minute   = e.tpm,
           token_burst         = e.tburst,
           requests_per_minute = e.rpm,
           request_burst       = e.rburst,
           max_in_flight       = e.max_if,
           lease_seconds       = e.lease,
           failure_mode        = e.failure_mode,
           priority            = e.priority,
           fallback_models     = e.fallback_models,
           prepaid             = e.prepaid,
           output_estimate     = e.output_estimate,
           request_cost        = e.request_cost,
           uses_concurrency    = e.uses_concurrency,
           cache               = e.cache,
           admission           = e.admission,
           policy_version      = version,
           tokens = lq_rebalanced(l.tokens, l.tokens_per_minute, l.token_burst, l.refilled_at,
                                   e.tpm, e.tburst, now_ts),
           requests = lq_rebalanced(l.requests, l.requests_per_minute, l.request_burst,
                                     l.refilled_at, e.rpm, e.rburst, now_ts),
           refilled_at = greatest(l.refilled_at, now_ts)
      FROM (SELECT x.layer_id,
                   CASE WHEN own ? 'tokens_per_minute' THEN (own ->> 'tokens_per_minute')::bigint
                        ELSE p.tokens_per_minute END AS tpm,
                   CASE WHEN own ? 'tokens_per_minute'
                        THEN coalesce((own ->> 'token_burst')::bigint,
                                      (own ->> 'tokens_per_minute')::bigint)
                        ELSE p.token_burst END AS tburst,
                   CASE WHEN own ? 'requests_per_minute' THEN (own ->> 'requests_per_minute')::bigint
                        ELSE p.requests_per_minute END AS rpm,
                   CASE WHEN own ? 'requests_per_minute'
                        THEN coalesce((own ->> 'request_burst')::bigint,
                                      (own ->> 'requests_per_minute')::bigint)
                        ELSE p.request_burst END AS rburst,
                   coalesce((own ->> 'max_in_flight')::integer, p.max_in_flight) AS max_if,
                   coalesce((own ->> 'lease_seconds')::integer, p.lease_seconds, 120) AS lease,
                   coalesce(own ->> 'failure_mode', p.failure_mode, 'closed') AS failure_mode,
                   coalesce(p.priority, 1::smallint) AS priority,
                   CASE WHEN own ? 'fallback_models'
                        THEN ARRAY(SELECT jsonb_array_elements_text(own -> 'fallback_models'))
                        ELSE coalesce(p.fallback_models, '{}') END AS fallback_models,
                   coalesce((own ->> 'prepaid')::boolean, p.prepaid, false) AS prepaid,
                   -- the output reservation strategy (learned estimates): own else plan's
                   coalesce(own -> 'output_estimate', p.output_estimate) AS output_estimate,
                   -- what one call counts as (weighted request cost): the tenant's own only
                   (own ->> 'request_cost')::integer AS request_cost,
                   (own ->> 'uses_concurrency')::boolean AS uses_concurrency,
                   -- the response cache (proxy mode): own else plan's, as output_estimate.
                   -- A JSON null counts as unset: limit_layers_cache_mode refuses a
                   -- cache without a mode, and null is no cache at all.
                   coalesce(nullif(own -> 'cache', 'null'::jsonb), p.cache) AS cache,
                   -- how its requests are admitted (allotments): own else plan's
                   coalesce(own ->> 'admission', p.admission) AS admission
              FROM limit_layers AS x
                   CROSS JOIN LATERAL (SELECT coalesce(x.own_policy, '{}'::jsonb) AS own) AS o
                   LEFT JOIN plans AS p ON p.plan = x.plan
             WHERE x.layer_id = ANY (p_layer_ids)
               AND x.scope = 'tenant') AS e
     WHERE l.layer_id = e.layer_id;
    GET DIAGNOSTICS changed = ROW_COUNT;
    RETURN changed;
END
$$;


-- Set a tenant's own policy and plan (registering the tenant if new), then
-- its effective limits. The plan row is read FOR SHARE: a concurrent change
-- of that plan waits for this transaction, or this one for it, and the one
-- that runs second sees the other's commit, so no tenant keeps a plan's old
-- figures. Returns the new policy_version; NULL when the plan does not exist.
CREATE OR REPLACE FUNCTION lq_put_tenant_policy(p_tenant text, p_plan text, p_own jsonb)
RETURNS bigint
LANGUAGE plpgsql
AS $$
DECLARE
    layer   bigint;
    version bigint;
BEGIN
    IF p_plan IS NOT NULL THEN
        PERFORM 1 FROM plans WHERE plan = p_plan FOR SHARE;
        IF NOT FOUND THEN
            RETURN NULL;
        END IF;
    END IF;
    INSERT INTO tenants (tenant) VALUES (p_tenant) ON CONFLICT DO NOTHING;
    INSERT INTO limit_layers AS l (scope, tenant, own_policy, plan)
    VALUES ('tenant', p_tenant, p_own, p_plan)
    ON CONFLICT (scope, tenant, route, ceiling, shard, api_key_id) DO UPDATE
       SET own_policy = excluded.own_policy,
           plan = excluded.plan
    RETURNING l.layer_id INTO layer;
    PERFORM lq_materialize_layers(ARRAY[layer]);
    SELECT policy_version INTO version FROM limit_layers WHERE layer_id = layer;
    RETURN version;
END
$$;


-- Create or replace a plan and, in the same transaction, recompute every
-- tenant on it: a plan change reaches all its tenants at once, each with a
-- new policy_version. Returns how many tenants were changed.
-- p_output_estimate was added (learned output reservations), then p_cache
-- (migration 0026: the response cache its tenants take where they set none),
-- then p_admission (migration 0030: allotted or exact admission).
-- The older signatures are dropped: beside the new one, a call with fewer
-- arguments would be ambiguous.
DROP FUNCTION IF EXISTS lq_put_plan(text, smallint, bigint, bigint, bigint, bigint, integer,
                                    integer, text, text[]);
DROP FUNCTION IF EXISTS lq_put_plan(text, smallint, bigint, bigint, bigint, bigint, integer,
                                    integer, text, text[], boolean, jsonb);
DROP FUNCTION IF EXISTS lq_put_plan(text, smallint, bigint, bigint, bigint, bigint, integer,
                                    integer, text, text[], boolean, jsonb, jsonb);
CREATE OR REPLACE FUNCTION lq_put_plan(
    p_plan            text,
    p_priority        smallint,
    p_tpm             bigint,
    p_tburst          bigint,
    p_rpm             bigint,
    p_rburst          bigint,
    p_max_in_flight   integer,
    p_lease_seconds   integer,
    p_failure_mode    text,
    p_fallback_models text[],
    p_prepaid         boolean,
    p_output_estimate jsonb DEFAULT NULL,  -- NULL: max_tokens
    p_cache           jsonb DEFAULT NULL,  -- NULL: no response cache
    p_admission       text DEFAULT NULL    -- NULL: exact
) RETURNS integer
LANGUAGE plpgsql
AS $$
DECLARE
    members bigint[];
BEGIN
    PERFORM lq_lock_policy_key('plan', NULL, NULL, p_plan, NULL);
    INSERT INTO plans AS p (plan, priority, tokens_per_minute, token_burst, requests_per_minute,
                            request_burst, max_in_flight, lease_seconds, failure_mode,
                            fallback_models, prepaid, output_estimate, cache, admission,
                            updated_at)
    VALUES (p_plan, p_priority, p_tpm, p_tburst, p_rpm, p_rburst, p_max_in_flight,
            p_lease_seconds, p_failure_mode, p_fallback_models, p_prepaid, p_output_estimate,
            p_cache, p_admission, clock_timestamp())
    ON CONFLICT (plan) DO UPDATE
       SET priority = excluded.priority,
           tokens_per_minute = excluded.tokens_per_minute,
           token_burst = excluded.token_burst,
           requests_per_minute = excluded.requests_per_minute,
           request_burst = excluded.request_burst,
           max_in_flight = excluded.max_in_flight,
           lease_seconds = excluded.lease_seconds,
           failure_mode = excluded.failure_mode,
           fallback_models = excluded.fallback_models,
           prepaid = excluded.prepaid,
           output_estimate = excluded.output_estimate,
           cache = excluded.cache,
           admission = excluded.admission,
           updated_at = excluded.updated_at;
    -- A new statement: it sees every tenant that joined the plan and committed
    -- while this transaction waited for the plan row.
    SELECT array_agg(layer_id ORDER BY layer_id) INTO members
      FROM limit_layers
     WHERE plan = p_plan AND scope = 'tenant';
    RETURN coalesce(lq_materialize_layers(members), 0);
END
$$;


-- Create or replace a provider ceiling: a shared layer passed by every
-- request whose model matches one of `p_models` (names and * globs). The
-- balance rule is lq_put_policy's, its clock and version read from the
-- proposed row as there. The ladder arrays are parallel (see
-- migration 0008); the admin service validated them, and the alert
-- settings (migration 0023: NULL alert_at is the ladder's steps, NULL
-- hysteresis and quiet time the workers' settings).
-- p_alert_at, p_alert_hysteresis and p_alert_quiet_seconds were added (ceiling alerts),
-- then p_shed_queue_ms (migration 0025: each step's wait for room, NULL: none),
-- then p_upstream (migration 0027: the one deployment it bounds, NULL: every one).
DROP FUNCTION IF EXISTS lq_put_ceiling(text, text[], bigint, bigint, bigint, bigint, integer,
                                       double precision[], smallint[], bigint[]);
DROP FUNCTION IF EXISTS lq_put_ceiling(text, text[], bigint, bigint, bigint, bigint, integer,
                                       double precision[], smallint[], bigint[], numeric[],
                                       double precision, double precision);
DROP FUNCTION IF EXISTS lq_put_ceiling(text, text[], bigint, bigint, bigint, bigint, integer,
                                       double precision[], smallint[], bigint[], numeric[],
                                       double precision, double precision, integer[]);
CREATE OR REPLACE FUNCTION lq_put_ceiling(
    p_ceiling             text,
    p_models              text[],
    p_tpm                 bigint,
    p_tburst              bigint,
    p_rpm                 bigint,
    p_rburst              bigint,
    p_max_in_flight       integer,
    p_shed_above          double precision[],
    p_shed_admit          smallint[],
    p_shed_small          bigint[],
    p_alert_at            numeric[] DEFAULT NULL,
    p_alert_hysteresis    double precision DEFAULT NULL,
    p_alert_quiet_seconds double precision DEFAULT NULL,
    p_shed_queue_ms       integer[] DEFAULT NULL,
    p_upstream            text DEFAULT NULL
) RETURNS bigint
LANGUAGE plpgsql
AS $$
DECLARE
    version bigint;
BEGIN
    PERFORM lq_lock_policy_key('ceiling', NULL, NULL, p_ceiling, NULL);
    INSERT INTO limit_layers AS l (scope, ceiling, models, model_patterns, tokens_per_minute,
                                   token_burst, requests_per_minute, request_burst,
                                   max_in_flight, shed_above, shed_admit, shed_small,
                                   shed_queue_ms, alert_at, alert_hysteresis,
                                   alert_quiet_seconds, upstream, tokens, requests,
                                   policy_version, refilled_at)
    VALUES ('ceiling', p_ceiling, p_models, lq_model_patterns(p_models), p_tpm, p_tburst, p_rpm,
            p_rburst, p_max_in_flight, p_shed_above, p_shed_admit, p_shed_small,
            p_shed_queue_ms, p_alert_at, p_alert_hysteresis, p_alert_quiet_seconds,
            p_upstream, p_tburst, p_rburst, nextval('policy_version_seq'), clock_timestamp())
    ON CONFLICT (scope, tenant, route, ceiling, shard, api_key_id) DO UPDATE
       SET models = excluded.models,
           model_patterns = excluded.model_patterns,
           tokens_per_minute = excluded.tokens_per_minute,
           token_burst = excluded.token_burst,
           requests_per_minute = excluded.requests_per_minute,
           request_burst = excluded.request_burst,
           -- the new share, and the permits the rebalancer moved stay moved
           -- (lq_send_permits, sql/global_layer.sql)
           max_in_flight = excluded.max_in_flight + l.in_flight_moved,
           shed_above = excluded.shed_above,
           shed_admit = excluded.shed_admit,
           shed_small = excluded.shed_small,
           shed_queue_ms = excluded.shed_queue_ms,
           alert_at = excluded.alert_at,
           alert_hysteresis = excluded.alert_hysteresis,
           alert_quiet_seconds = excluded.alert_quiet_seconds,
           upstream = excluded.upstream,
           policy_version = excluded.policy_version,
           -- never below minus the new burst, as lq_credit_layers keeps a
           -- ceiling (a smaller burst forgives the debt beyond it)
           tokens = CASE WHEN excluded.tokens_per_minute IS NOT NULL THEN
                        greatest(-excluded.token_burst::double precision,
                                 lq_rebalanced(l.tokens, l.tokens_per_minute, l.token_burst,
                                               l.refilled_at, excluded.tokens_per_minute,
                                               excluded.token_burst, excluded.refilled_at)) END,
           requests = lq_rebalanced(l.requests, l.requests_per_minute, l.request_burst,
                                    l.refilled_at, excluded.requests_per_minute,
                                    excluded.request_burst, excluded.refilled_at),
           refilled_at = greatest(l.refilled_at, excluded.refilled_at)
    RETURNING l.policy_version INTO version;
    RETURN version;
END
$$;


-- The If-Match check of a policy write (issue 22): whether the layer's
-- current policy_version (its ETag) is one of `p_if_match` ('*': any
-- existing layer). NULL `p_if_match` is no precondition: true, nothing locked.
-- Otherwise the layer row is locked FOR UPDATE (the global layer's shards in
-- layer_id order), so the write of the same statement runs on the version
-- checked here: a concurrent write with the same ETag waits, then sees the
-- new version and fails. A tenant write names its new plan `p_plan`, locked
-- FOR SHARE first, the order lq_put_plan takes (plan, then layers).
CREATE OR REPLACE FUNCTION lq_policy_precondition(
    p_scope text, p_tenant text, p_route text, p_plan text, p_if_match text[]
) RETURNS boolean
LANGUAGE plpgsql
AS $$
DECLARE
    current bigint;
BEGIN
    IF p_if_match IS NULL THEN
        RETURN true;
    END IF;
    IF p_plan IS NOT NULL THEN
        PERFORM 1 FROM plans WHERE plan = p_plan FOR SHARE;
    END IF;
    IF p_scope = 'global' THEN
        SELECT max(s.policy_version) INTO current
          FROM (SELECT policy_version FROM limit_layers
                 WHERE scope = 'global' ORDER BY layer_id FOR UPDATE) AS s;
    ELSE
        SELECT policy_version INTO current
          FROM limit_layers
         WHERE scope = p_scope AND tenant = p_tenant
           AND route IS NOT DISTINCT FROM p_route
           FOR UPDATE;
    END IF;
    RETURN current IS NOT NULL
       AND ('*' = ANY (p_if_match) OR current::text = ANY (p_if_match));
END
$$;


-- Delete a tenant (issue 22): its layers, keys, quotas, credit account and
-- webhooks go (ON DELETE CASCADE from tenants); the usage ledger and the
-- credit ledger keep their rows (no foreign key: append-only), the credit
-- ledger with one adjustment that closes a remaining balance out. The tenant's layers are locked
-- first, in layer_id order as admission locks them, so an admission either
-- committed before (its reservation is counted) or runs after and finds no
-- tenant. Status: 'deleted', 'not_found', 'active' (with how many
-- reservations are still active) or 'precondition_failed' (If-Match, as in
-- lq_policy_precondition, against the tenant policy's version).
CREATE OR REPLACE FUNCTION lq_delete_tenant(p_tenant text, p_if_match text[])
RETURNS TABLE (status text, active bigint)
LANGUAGE plpgsql
AS $$
DECLARE
    n         bigint;
    remaining numeric;
BEGIN
    PERFORM 1 FROM tenants WHERE tenant = p_tenant FOR UPDATE;
    IF NOT FOUND THEN
        RETURN QUERY SELECT 'not_found'::text, 0::bigint;
        RETURN;
    END IF;
    PERFORM 1 FROM limit_layers WHERE tenant = p_tenant ORDER BY layer_id FOR UPDATE;
    IF NOT lq_policy_precondition('tenant', p_tenant, NULL, NULL, p_if_match) THEN
        RETURN QUERY SELECT 'precondition_failed'::text, 0::bigint;
        RETURN;
    END IF;
    SELECT count(*) INTO n FROM reservations WHERE tenant = p_tenant AND state = 'active';
    IF n > 0 THEN
        RETURN QUERY SELECT 'active'::text, n;
        RETURN;
    END IF;
    -- A prepaid balance is money, and the credit ledger keeps its rows: one
    -- adjustment takes what they sum to back to zero, under the account's
    -- lock (as a top-up or a charge takes it), before the account goes.
    PERFORM 1 FROM credit_accounts AS a WHERE a.tenant = p_tenant FOR UPDATE;
    SELECT coalesce(sum(l.amount), 0) INTO remaining FROM credit_ledger AS l
     WHERE l.tenant = p_tenant;
    IF remaining <> 0 THEN
        INSERT INTO credit_ledger (tenant, entry_kind, amount, balance_after, reason)
        VALUES (p_tenant, 'adjustment', -remaining, 0,
                'tenant deleted: its remaining balance is closed out');
    END IF;
    DELETE FROM api_keys WHERE tenant = p_tenant;
    DELETE FROM limit_layers WHERE tenant = p_tenant;
    -- Its cached answers go with it: a tenant created again under the same
    -- name is never served the old one's (cache.sql).
    DELETE FROM response_cache WHERE tenant = p_tenant;
    DELETE FROM tenants WHERE tenant = p_tenant;
    RETURN QUERY SELECT 'deleted'::text, 0::bigint;
END
$$;


-- The ETag of a plan: its updated_at in microseconds (every write of a plan
-- sets it, under the plan's row lock, so no two versions share one).
CREATE OR REPLACE FUNCTION lq_plan_version(p_updated_at timestamptz)
RETURNS bigint
LANGUAGE sql IMMUTABLE
AS $$
    SELECT floor(extract(epoch FROM p_updated_at) * 1000000)::bigint
$$;


-- The If-Match check of a plan or provider-ceiling write, as
-- lq_policy_precondition for the layers: NULL `p_if_match` is none (true,
-- nothing locked); otherwise the row is locked FOR UPDATE and its version
-- (a plan's lq_plan_version, a ceiling's policy_version) must be one of
-- `p_if_match`, or the row merely exist for '*'.
CREATE OR REPLACE FUNCTION lq_named_precondition(p_kind text, p_name text, p_if_match text[])
RETURNS boolean
LANGUAGE plpgsql
AS $$
DECLARE
    current bigint;
BEGIN
    IF p_if_match IS NULL THEN
        RETURN true;
    END IF;
    IF p_kind = 'plan' THEN
        SELECT lq_plan_version(updated_at) INTO current FROM plans WHERE plan = p_name FOR UPDATE;
    ELSE
        SELECT policy_version INTO current
          FROM limit_layers WHERE scope = 'ceiling' AND ceiling = p_name FOR UPDATE;
    END IF;
    RETURN current IS NOT NULL
       AND ('*' = ANY (p_if_match) OR current::text = ANY (p_if_match));
END
$$;


-- The service's small writes of layers and tenants. Each is a function, not a
-- statement of queries.sql, because it stamps rows with the database clock or
-- a policy version: read once into a variable here, on the node that holds
-- the rows (in a cell on Citus the call runs whole on the cell's node, and
-- Citus refuses a volatile function inside an UPDATE of a distributed table).

-- Serialize the writes of one policy (a tenant's, a route's, a ceiling's or a
-- key's layer, or a plan), its first creation included, for the rest of the
-- transaction: a write reads the clock and takes its policy version after
-- this, so the write committed last has the highest version (the policy
-- cache's snapshot is the highest version) and the latest clock (a plan's
-- ETag). A row lock could not order two first writes of one that does not
-- exist yet.
CREATE OR REPLACE FUNCTION lq_lock_policy_key(p_scope text, p_tenant text, p_route text,
                                             p_ceiling text, p_key_id bigint)
RETURNS void
LANGUAGE sql
AS $$
    SELECT pg_advisory_xact_lock(hashtextextended(
        concat_ws('/', 'llmquota.policy', p_scope, p_tenant, p_route, p_ceiling, p_key_id), 0))
$$;


-- Create or replace the policy of a route (a tenant's goes through
-- lq_put_tenant_policy, for its plan; the global layer's through lq_put_global).
-- The balance refills under the old rules up to now, then is clamped to the
-- new capacity; a limit that did not exist before starts full. p_if_match:
-- see lq_policy_precondition; no row when it does not match. p_request_cost
-- and p_uses_concurrency: what one call counts as (NULL: the tenant's);
-- p_cache: the route's own response cache (NULL: the tenant's), which rides the
-- policy_version like every other field; p_admission: how the route's
-- requests are admitted ('allotted', 'exact'; NULL: the tenant's). The
-- conflict clause reads the clock and the version from the proposed row
-- (`excluded`), not from variables: Citus loses a variable there.
CREATE OR REPLACE FUNCTION lq_put_policy(
    p_scope text, p_tenant text, p_route text, p_tokens_per_minute bigint,
    p_token_burst bigint, p_requests_per_minute bigint, p_request_burst bigint,
    p_max_in_flight integer, p_lease_seconds integer, p_failure_mode text,
    p_fallback_models text[], p_output_estimate jsonb, p_if_match text[],
    p_request_cost integer, p_uses_concurrency boolean, p_cache jsonb, p_admission text
) RETURNS TABLE (policy_version bigint)
LANGUAGE plpgsql
AS $$
#variable_conflict use_column
BEGIN
    PERFORM lq_lock_policy_key(p_scope, p_tenant, p_route, NULL, NULL);
    IF NOT coalesce(lq_policy_precondition(p_scope, p_tenant, p_route, NULL, p_if_match),
                    false) THEN
        RETURN;
    END IF;
    RETURN QUERY
    INSERT INTO limit_layers AS l (scope, tenant, route, tokens_per_minute, token_burst,
                                   requests_per_minute, request_burst, max_in_flight,
                                   lease_seconds, failure_mode, fallback_models, tokens,
                                   requests, output_estimate, request_cost, uses_concurrency,
                                   cache, admission, policy_version, refilled_at)
    VALUES (p_scope, p_tenant, p_route, p_tokens_per_minute, p_token_burst,
            p_requests_per_minute, p_request_burst, p_max_in_flight, p_lease_seconds,
            p_failure_mode, p_fallback_models, p_token_burst, p_request_burst,
            p_output_estimate, p_request_cost, p_uses_concurrency, p_cache, p_admission,
            nextval('policy_version_seq'), clock_timestamp())
    ON CONFLICT (scope, tenant, route, ceiling, shard, api_key_id) DO UPDATE
       SET tokens_per_minute   = excluded.tokens_per_minute,
           token_burst         = excluded.token_burst,
           requests_per_minute = excluded.requests_per_minute,
           request_burst       = excluded.request_burst,
           max_in_flight       = excluded.max_in_flight,
           lease_seconds       = excluded.lease_seconds,
           failure_mode        = excluded.failure_mode,
           fallback_models     = excluded.fallback_models,
           output_estimate     = excluded.output_estimate,
           request_cost        = excluded.request_cost,
           uses_concurrency    = excluded.uses_concurrency,
           cache               = excluded.cache,
           admission           = excluded.admission,
           policy_version      = excluded.policy_version,
           tokens = lq_rebalanced(l.tokens, l.tokens_per_minute, l.token_burst, l.refilled_at,
                                  excluded.tokens_per_minute, excluded.token_burst,
                                  excluded.refilled_at),
           requests = lq_rebalanced(l.requests, l.requests_per_minute, l.request_burst,
                                    l.refilled_at, excluded.requests_per_minute,
                                    excluded.request_burst, excluded.refilled_at),
           refilled_at = greatest(l.refilled_at, excluded.refilled_at)
    RETURNING l.policy_version;
END
$$;


-- The provider refused model p_model (429): every ceiling matching it that
-- bounds the deployment p_upstream (scoped to it, or unless p_scoped_only to
-- no deployment; NULL: every ceiling) is emptied and debited the refill of
-- p_seconds, so that it admits nothing for that long and then refills at its
-- own rate. Locked in layer_id order, the admission's order. The names of the
-- ceilings cooled down.
CREATE OR REPLACE FUNCTION lq_cool_down_ceilings(
    p_model text, p_seconds float8, p_upstream text, p_scoped_only boolean
) RETURNS TABLE (ceiling text)
LANGUAGE plpgsql
AS $$
#variable_conflict use_column
DECLARE
    now_ts constant timestamptz := clock_timestamp();
BEGIN
    RETURN QUERY
    WITH locked AS (
        SELECT l.layer_id
          FROM limit_layers AS l
         WHERE l.scope = 'ceiling'
           AND l.tokens_per_minute IS NOT NULL
           AND p_model LIKE ANY (l.model_patterns)
           AND (p_upstream IS NULL OR l.upstream = p_upstream
                OR (l.upstream IS NULL AND NOT p_scoped_only))
         ORDER BY l.layer_id
           FOR UPDATE
    )
    UPDATE limit_layers AS l
       SET tokens = least(lq_refilled(l.tokens, l.tokens_per_minute, l.token_burst,
                                      l.refilled_at, greatest(l.refilled_at, now_ts)), 0)
                    - l.tokens_per_minute / 60.0 * p_seconds,
           refilled_at = greatest(l.refilled_at, now_ts)
      FROM locked
     WHERE l.layer_id = locked.layer_id
    RETURNING l.ceiling;
END
$$;


-- Register a tenant, with an empty tenant layer (no limits of its own yet);
-- nothing when it exists. One function, not a statement of two inserts:
-- Citus ran such a statement as two, in a two-phase commit that a change
-- notice (the layer's trigger) cannot be part of.
CREATE OR REPLACE FUNCTION lq_ensure_tenant(p_tenant text)
RETURNS void
LANGUAGE plpgsql
AS $$
BEGIN
    INSERT INTO tenants (tenant) VALUES (p_tenant) ON CONFLICT DO NOTHING;
    IF FOUND THEN
        INSERT INTO limit_layers (scope, tenant) VALUES ('tenant', p_tenant);
    END IF;
END
$$;


-- Suspend (p_suspended) or resume tenant p_tenant; a repeat keeps the first
-- suspension's time. No row: no such tenant.
CREATE OR REPLACE FUNCTION lq_suspend_tenant(p_tenant text, p_suspended boolean)
RETURNS TABLE (tenant text, suspended_at timestamptz)
LANGUAGE plpgsql
AS $$
#variable_conflict use_column
DECLARE
    now_ts constant timestamptz := clock_timestamp();
BEGIN
    RETURN QUERY
    UPDATE tenants AS t
       SET suspended_at = CASE WHEN p_suspended THEN coalesce(t.suspended_at, now_ts) END
     WHERE t.tenant = p_tenant
    RETURNING t.tenant, t.suspended_at;
END
$$;


-- The policy writes under their If-Match preconditions (p_if_match NULL: none),
-- each one call: the check and the write run in one function, so that in a
-- cell on Citus both run on the cell's node (a statement that composed them
-- ran the write from the coordinator, statement by statement). A check that
-- fails writes nothing: precondition_met false, the result NULL.
CREATE OR REPLACE FUNCTION lq_put_global_if_match(
    p_tpm bigint, p_tburst bigint, p_rpm bigint, p_rburst bigint, p_max_if integer,
    p_lease integer, p_failure_mode text, p_shards smallint, p_if_match text[]
) RETURNS TABLE (policy_version bigint, precondition_met boolean)
LANGUAGE plpgsql
AS $$
BEGIN
    -- lq_put_global's lock first, then the check's row locks: the order a
    -- write without If-Match takes them in, so the two never deadlock.
    PERFORM pg_advisory_xact_lock(hashtextextended('llmquota.global_layer', 0));
    IF NOT coalesce(lq_policy_precondition('global', NULL, NULL, NULL, p_if_match), false) THEN
        RETURN QUERY SELECT NULL::bigint, false;
    ELSE
        RETURN QUERY SELECT lq_put_global(p_tpm, p_tburst, p_rpm, p_rburst, p_max_if, p_lease,
                                          p_failure_mode, p_shards), true;
    END IF;
END
$$;

CREATE OR REPLACE FUNCTION lq_put_tenant_policy_if_match(
    p_tenant text, p_plan text, p_own jsonb, p_if_match text[]
) RETURNS TABLE (policy_version bigint, precondition_met boolean)
LANGUAGE plpgsql
AS $$
BEGIN
    IF NOT coalesce(lq_policy_precondition('tenant', p_tenant, NULL, p_plan, p_if_match), false) THEN
        RETURN QUERY SELECT NULL::bigint, false;
    ELSE
        RETURN QUERY SELECT lq_put_tenant_policy(p_tenant, p_plan, p_own), true;
    END IF;
END
$$;

CREATE OR REPLACE FUNCTION lq_put_plan_if_match(
    p_plan text, p_priority smallint, p_tpm bigint, p_tburst bigint, p_rpm bigint,
    p_rburst bigint, p_max_in_flight integer, p_lease_seconds integer, p_failure_mode text,
    p_fallback_models text[], p_prepaid boolean, p_output_estimate jsonb, p_cache jsonb,
    p_admission text, p_if_match text[]
) RETURNS TABLE (tenants integer, precondition_met boolean)
LANGUAGE plpgsql
AS $$
BEGIN
    PERFORM lq_lock_policy_key('plan', NULL, NULL, p_plan, NULL);  -- lq_put_plan's order
    IF NOT coalesce(lq_named_precondition('plan', p_plan, p_if_match), false) THEN
        RETURN QUERY SELECT NULL::integer, false;
    ELSE
        RETURN QUERY SELECT lq_put_plan(p_plan, p_priority, p_tpm, p_tburst, p_rpm, p_rburst,
                                        p_max_in_flight, p_lease_seconds, p_failure_mode,
                                        p_fallback_models, p_prepaid, p_output_estimate,
                                        p_cache, p_admission), true;
    END IF;
END
$$;

CREATE OR REPLACE FUNCTION lq_put_ceiling_if_match(
    p_ceiling text, p_models text[], p_tpm bigint, p_tburst bigint, p_rpm bigint,
    p_rburst bigint, p_max_in_flight integer, p_shed_above double precision[],
    p_shed_admit smallint[], p_shed_small bigint[], p_alert_at numeric[],
    p_alert_hysteresis double precision, p_alert_quiet_seconds double precision,
    p_shed_queue_ms integer[], p_upstream text, p_if_match text[]
) RETURNS TABLE (policy_version bigint, precondition_met boolean)
LANGUAGE plpgsql
AS $$
BEGIN
    PERFORM lq_lock_policy_key('ceiling', NULL, NULL, p_ceiling, NULL);  -- lq_put_ceiling's order
    IF NOT coalesce(lq_named_precondition('ceiling', p_ceiling, p_if_match), false) THEN
        RETURN QUERY SELECT NULL::bigint, false;
    ELSE
        RETURN QUERY SELECT lq_put_ceiling(p_ceiling, p_models, p_tpm, p_tburst, p_rpm,
                                           p_rburst, p_max_in_flight, p_shed_above,
                                           p_shed_admit, p_shed_small, p_alert_at,
                                           p_alert_hysteresis, p_alert_quiet_seconds,
                                           p_shed_queue_ms, p_upstream), true;
    END IF;
END
$$;
