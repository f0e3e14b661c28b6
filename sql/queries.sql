-- Named statements the store runs. Each block: a header line with the name,
-- a comment saying what it does, then one statement with $n parameters.
-- The hot transitions (admit, settle, release, expire) are functions in
-- admission.sql; these call them or do the small things around them.

-- admit --
-- Decide a batch of admission requests in arrival order (see lq_admit).
SELECT * FROM lq_admit($1::text[], $2::text[], $3::text[], $4::bigint[], $5::bigint[],
                       $6::boolean[], $7::integer[], $8::text[], $9::text[], $10::integer,
                       $11::smallint[], $12::boolean[], $13::boolean[], $14::integer[],
                       $15::text[], $16::bigint[], $17::bigint[])

-- admit_without_flush --
-- The same batch decision, committed without waiting for the WAL flush
-- (LLMQUOTA_ADMISSION_SYNCHRONOUS_COMMIT=false). set_config(..., true) lasts
-- until the end of this statement's own transaction and synchronous_commit is
-- read only at its commit, so where in the plan it runs does not matter.
-- Settlement and the ledger are other statements and always wait. A crash can
-- forget the last admissions (their debits and reservations), never a ledger row.
SELECT a.*
  FROM (SELECT set_config('synchronous_commit', 'off', true)) AS unflushed,
       lq_admit($1::text[], $2::text[], $3::text[], $4::bigint[], $5::bigint[],
                $6::boolean[], $7::integer[], $8::text[], $9::text[], $10::integer,
                $11::smallint[], $12::boolean[], $13::boolean[], $14::integer[],
                $15::text[], $16::bigint[], $17::bigint[]) AS a

-- finish --
-- Settle, release or expire a batch of reservations (see lq_finish).
SELECT * FROM lq_finish($1::uuid[], $2::text[], $3::text[], $4::bigint[], $5::bigint[], $6::text[])

-- sweep --
-- Expire up to $1 reservations whose lease ran out (see lq_sweep).
SELECT * FROM lq_sweep($1::integer)

-- heartbeat --
-- Extend a live lease by $3 seconds (default: the reservation's own lease) and
-- bump its generation (the fencing token). $4, when given, is the generation
-- the caller holds: a stale one extends nothing. No row: no such reservation
-- for this caller. A row with a NULL lease_expires_at: it exists but is
-- finished, its lease ran out, or the caller's generation is stale.
WITH target AS (
    SELECT rs.reservation_id, rs.state, rs.lease_generation,
           rs.state = 'active' AND rs.lease_expires_at > clock_timestamp() AS lease_live
      FROM reservations AS rs
     WHERE rs.reservation_id = $1::uuid
       AND ($2::text IS NULL OR rs.tenant = $2::text)
), extended AS (
    UPDATE reservations AS rs
       SET lease_expires_at = clock_timestamp()
                              + make_interval(secs => coalesce($3::integer, rs.lease_seconds)),
           lease_generation = rs.lease_generation + 1
      FROM target
     WHERE rs.reservation_id = target.reservation_id
       AND rs.state = 'active'
       AND rs.lease_expires_at > clock_timestamp()
       AND ($4::integer IS NULL OR rs.lease_generation = $4::integer)
    RETURNING rs.lease_expires_at, rs.lease_generation
)
SELECT target.state, target.lease_live, target.lease_generation AS current_generation,
       extended.lease_expires_at, extended.lease_generation
  FROM target LEFT JOIN extended ON true

-- put_policy --
-- Create or replace the policy of a route (a tenant's goes through
-- put_tenant_policy, for its plan; the global layer's through
-- put_global_policy). The balance refills under the old rules up to now,
-- then is clamped to the new capacity; a limit that did not exist before
-- starts full.
INSERT INTO limit_layers AS l (scope, tenant, route, tokens_per_minute, token_burst,
                               requests_per_minute, request_burst, max_in_flight,
                               lease_seconds, failure_mode, fallback_models, tokens, requests,
                               output_estimate)
VALUES ($1::text, $2::text, $3::text, $4::bigint, $5::bigint, $6::bigint, $7::bigint,
        $8::integer, $9::integer, $10::text, $11::text[], $5::bigint, $7::bigint, $12::jsonb)
ON CONFLICT (scope, tenant, route, ceiling, shard) DO UPDATE
   SET tokens_per_minute   = excluded.tokens_per_minute,
       token_burst         = excluded.token_burst,
       requests_per_minute = excluded.requests_per_minute,
       request_burst       = excluded.request_burst,
       max_in_flight       = excluded.max_in_flight,
       lease_seconds       = excluded.lease_seconds,
       failure_mode        = excluded.failure_mode,
       fallback_models     = excluded.fallback_models,
       output_estimate     = excluded.output_estimate,
       policy_version      = nextval('policy_version_seq'),
       tokens = lq_rebalanced(l.tokens, l.tokens_per_minute, l.token_burst, l.refilled_at,
                               excluded.tokens_per_minute, excluded.token_burst,
                               clock_timestamp()),
       requests = lq_rebalanced(l.requests, l.requests_per_minute, l.request_burst,
                                 l.refilled_at, excluded.requests_per_minute,
                                 excluded.request_burst, clock_timestamp()),
       refilled_at = greatest(l.refilled_at, clock_timestamp())
RETURNING l.policy_version

-- put_global_policy --
-- Create or replace the global policy, split over $8 shards (NULL: as many
-- as now); its new policy_version (see lq_put_global).
SELECT lq_put_global($1::bigint, $2::bigint, $3::bigint, $4::bigint, $5::integer, $6::integer,
                     $7::text, $8::smallint) AS policy_version

-- put_tenant_policy --
-- Set a tenant's own policy ($3, the fields it sets, as a JSON object) and its
-- plan ($2), registering the tenant; its new policy_version, or NULL when the
-- plan does not exist (see lq_put_tenant_policy).
SELECT lq_put_tenant_policy($1::text, $2::text, $3::jsonb) AS policy_version

-- put_plan --
-- Create or replace a plan and recompute every tenant on it, in one
-- transaction; how many tenants changed (see lq_put_plan).
SELECT lq_put_plan($1::text, $2::smallint, $3::bigint, $4::bigint, $5::bigint, $6::bigint,
                   $7::integer, $8::integer, $9::text, $10::text[], $11::boolean,
                   $12::jsonb) AS tenants

-- get_plans --
-- One plan ($1), or every plan ($1 NULL), with how many tenants are on each.
SELECT p.plan, p.priority, p.tokens_per_minute, p.token_burst, p.requests_per_minute,
       p.request_burst, p.max_in_flight, p.lease_seconds, p.failure_mode, p.fallback_models,
       p.prepaid, p.output_estimate::text AS output_estimate,
       (SELECT count(*) FROM limit_layers AS l WHERE l.plan = p.plan)::bigint AS tenants
  FROM plans AS p
 WHERE $1::text IS NULL OR p.plan = $1::text
 ORDER BY p.plan

-- delete_plan --
-- Delete a plan no tenant is on: 'deleted', 'in_use' or 'not_found'. A tenant
-- joining it meanwhile makes the DELETE fail on the foreign key instead.
WITH users AS (
    SELECT count(*) AS n FROM limit_layers WHERE plan = $1::text
), gone AS (
    DELETE FROM plans
     WHERE plan = $1::text AND (SELECT n FROM users) = 0
    RETURNING 1
)
SELECT CASE WHEN EXISTS (SELECT 1 FROM gone) THEN 'deleted'
            WHEN (SELECT n FROM users) > 0 THEN 'in_use'
            ELSE 'not_found' END AS status

-- put_ceiling --
-- Create or replace a provider ceiling; its policy_version (see lq_put_ceiling).
SELECT lq_put_ceiling($1::text, $2::text[], $3::bigint, $4::bigint, $5::bigint, $6::bigint,
                      $7::integer, $8::float8[], $9::smallint[], $10::bigint[]) AS policy_version

-- get_ceilings --
-- One ceiling ($1), or every one ($1 NULL), refilled to now (read only), with
-- its utilization: the share of its token burst in use (1 - balance / burst).
SELECT ceiling, models, tokens_per_minute, token_burst, requests_per_minute, request_burst,
       max_in_flight, shed_above, shed_admit, shed_small, policy_version, in_flight,
       lq_refilled(tokens, tokens_per_minute, token_burst, refilled_at, clock_timestamp())
           AS tokens,
       lq_refilled(requests, requests_per_minute, request_burst, refilled_at, clock_timestamp())
           AS requests
  FROM limit_layers
 WHERE scope = 'ceiling'
   AND ($1::text IS NULL OR ceiling = $1::text)
 ORDER BY ceiling

-- tenant_utilization --
-- The share of each tenant's token burst in use now, 1 - balance / burst
-- (above 1 while settlements have overdrawn it), the most utilized first, at
-- most $1 tenants: the per-tenant gauge, when enabled (read only).
SELECT tenant,
       1 - lq_refilled(tokens, tokens_per_minute, token_burst, refilled_at, clock_timestamp())
           / token_burst AS utilization
  FROM limit_layers
 WHERE scope = 'tenant' AND tokens_per_minute IS NOT NULL AND token_burst > 0
 ORDER BY utilization DESC, tenant
 LIMIT $1::integer

-- cool_down_ceilings --
-- The provider refused model $1 (429): every ceiling matching it is emptied
-- and debited the refill of $2 seconds, so that it admits nothing for that
-- long and then refills at its own rate. Locked in layer_id order, the
-- admission's order. The names of the ceilings cooled down.
WITH locked AS (
    SELECT l.layer_id
      FROM limit_layers AS l
     WHERE l.scope = 'ceiling'
       AND l.tokens_per_minute IS NOT NULL
       AND $1::text LIKE ANY (l.model_patterns)
     ORDER BY l.layer_id
       FOR UPDATE
)
UPDATE limit_layers AS l
   SET tokens = least(lq_refilled(l.tokens, l.tokens_per_minute, l.token_burst, l.refilled_at,
                                  greatest(l.refilled_at, clock_timestamp())), 0)
                - l.tokens_per_minute / 60.0 * $2::float8,
       refilled_at = greatest(l.refilled_at, clock_timestamp())
  FROM locked
 WHERE l.layer_id = locked.layer_id
RETURNING l.ceiling

-- delete_ceiling --
-- Delete a provider ceiling; one row when it existed. Reservations admitted
-- through it settle as before: the credit to a layer that is gone is dropped.
DELETE FROM limit_layers WHERE scope = 'ceiling' AND ceiling = $1::text RETURNING layer_id

-- get_policy --
-- One layer's policy, or no row; the global layer's summed over its shards.
SELECT tokens_per_minute, token_burst, requests_per_minute, request_burst,
       max_in_flight, lease_seconds, failure_mode, policy_version, plan, fallback_models,
       prepaid, own_policy::text AS own_policy, output_estimate::text AS output_estimate,
       shards
  FROM limit_layers
 WHERE scope = $1::text AND scope <> 'global'
   AND tenant IS NOT DISTINCT FROM $2::text
   AND route IS NOT DISTINCT FROM $3::text
UNION ALL
SELECT tokens_per_minute, token_burst, requests_per_minute, request_burst,
       max_in_flight, lease_seconds, failure_mode, policy_version, NULL, '{}'::text[],
       false, NULL, NULL, shards
  FROM global_layer
 WHERE $1::text = 'global'

-- ensure_tenant --
-- Register a tenant (with an empty tenant layer: no limits of its own yet).
WITH new_tenant AS (
    INSERT INTO tenants (tenant) VALUES ($1::text)
    ON CONFLICT DO NOTHING
    RETURNING tenant
)
INSERT INTO limit_layers (scope, tenant)
SELECT 'tenant', tenant FROM new_tenant

-- tenant_exists --
-- Whether a tenant is registered.
SELECT EXISTS (SELECT 1 FROM tenants WHERE tenant = $1::text)

-- insert_api_key --
-- Store a key's digest for a tenant (NULL: an admin key).
INSERT INTO api_keys (key_hash, tenant) VALUES ($1::bytea, $2::text) RETURNING key_id

-- insert_first_admin_key --
-- Store an admin key's digest unless an admin key exists already.
INSERT INTO api_keys (key_hash, tenant)
SELECT $1::bytea, NULL
 WHERE NOT EXISTS (SELECT 1 FROM api_keys WHERE tenant IS NULL)
RETURNING key_id

-- find_api_key --
-- The key with this digest: its tenant, or NULL tenant for an admin key.
SELECT key_id, tenant FROM api_keys WHERE key_hash = $1::bytea

-- layer_status --
-- The global layer (summed over its shards) and every layer of one tenant,
-- refilled to now (read only).
SELECT scope, tenant, route, plan, tokens_per_minute, token_burst, requests_per_minute,
       request_burst, max_in_flight, lease_seconds, failure_mode, policy_version, in_flight,
       tokens, requests
  FROM global_layer
UNION ALL
(SELECT scope, tenant, route, plan, tokens_per_minute, token_burst, requests_per_minute,
        request_burst, max_in_flight, lease_seconds, failure_mode, policy_version, in_flight,
        lq_refilled(tokens, tokens_per_minute, token_burst, refilled_at, clock_timestamp()),
        lq_refilled(requests, requests_per_minute, request_burst, refilled_at,
                    clock_timestamp())
   FROM limit_layers
  WHERE scope IN ('tenant', 'route') AND tenant = $1::text
  ORDER BY layer_id)

-- tenant_usage --
-- Ledger totals for one tenant over [from, to): requests are reservations
-- with any ledger row; tokens are what was really used.
SELECT count(DISTINCT reservation_id) AS requests,
       coalesce(sum(input_tokens), 0)::bigint AS input_tokens,
       coalesce(sum(output_tokens), 0)::bigint AS output_tokens
  FROM usage_ledger
 WHERE tenant = $1::text
   AND recorded_at >= $2::timestamptz
   AND recorded_at < $3::timestamptz

-- purge_finished --
-- Delete up to $2 reservations finished longer ago than $1 seconds (their
-- ledger rows stay); idempotency keys live as long as their reservation.
WITH purged AS (
    DELETE FROM reservations
     WHERE reservation_id IN (
           SELECT reservation_id
             FROM reservations
            WHERE state <> 'active'
              AND finished_at < clock_timestamp() - make_interval(secs => $1::integer)
            LIMIT $2::integer
              FOR UPDATE SKIP LOCKED)
    RETURNING 1
)
SELECT count(*) AS purged FROM purged

-- ensure_ledger_partitions --
-- Create the ledger's monthly partitions for this month and $1 months ahead
-- (see lq_ensure_ledger_partitions); one row per month with what was done.
SELECT partition_name, status FROM lq_ensure_ledger_partitions($1::integer)

-- outage_id_key --
-- The key workers sign the reservation ids they make during an outage with
-- (see domain/outage_ids.py); one row, made by migration 0007.
SELECT key FROM outage_id_key

-- policy_snapshot --
-- Every layer's policy, for the per-worker cache that outlives an outage.
-- Provider ceilings are not in it: an admission decided without the database
-- passes the global, tenant and route layers only (RELIABILITY.md). The
-- snapshot version is (max policy_version, layer count): a policy change takes
-- the next policy_version and a deleted tenant lowers the count. When it
-- equals the caller's ($1, $2) only the version row comes back (the columns of
-- the layer are NULL); otherwise up to $3 layers, in layer_id order.
WITH version AS (
    SELECT coalesce(max(policy_version), 0)::bigint AS snapshot_version,
           count(*) FILTER (WHERE shard = 0)::bigint AS layer_count
      FROM limit_layers
     WHERE scope <> 'ceiling'
)
SELECT v.snapshot_version, v.layer_count, l.scope, l.tenant, l.route, l.tokens_per_minute,
       l.token_burst, l.requests_per_minute, l.request_burst, l.max_in_flight,
       l.lease_seconds, l.failure_mode, l.policy_version, l.output_estimate
  FROM version AS v
       LEFT JOIN LATERAL (
           -- the global layer summed over its shards, then the others
           SELECT g.layer_id, g.scope, g.tenant, g.route, g.tokens_per_minute, g.token_burst,
                  g.requests_per_minute, g.request_burst, g.max_in_flight, g.lease_seconds,
                  g.failure_mode, g.policy_version, NULL::text AS output_estimate
             FROM global_layer AS g
            WHERE (v.snapshot_version, v.layer_count)
                  IS DISTINCT FROM ($1::bigint, $2::bigint)
           UNION ALL
           (SELECT ll.layer_id, ll.scope, ll.tenant, ll.route, ll.tokens_per_minute,
                   ll.token_burst, ll.requests_per_minute, ll.request_burst, ll.max_in_flight,
                   ll.lease_seconds, ll.failure_mode, ll.policy_version,
                   ll.output_estimate::text
              FROM limit_layers AS ll
             WHERE ll.scope IN ('tenant', 'route')
               AND (v.snapshot_version, v.layer_count)
                   IS DISTINCT FROM ($1::bigint, $2::bigint)
             ORDER BY ll.layer_id
             LIMIT $3::integer - (SELECT count(*) FROM global_layer)::integer)) AS l ON true

-- record_outage_admissions --
-- Record reservations admitted during an outage, once each (see
-- lq_record_outage_admissions).
SELECT * FROM lq_record_outage_admissions($1::uuid[], $2::text[], $3::text[], $4::text[],
                                          $5::bigint[], $6::bigint[], $7::boolean[],
                                          $8::integer[], $9::text[], $10::text[],
                                          $11::bigint[], $12::text[])

-- audit --
-- Every discrepancy between the counters and the journal (see lq_audit).
SELECT * FROM lq_audit() ORDER BY check_name, subject

-- audit_summary --
-- What the journal holds now: reservations in each state, the tokens held by
-- active ones, and the ledger's size.
SELECT (SELECT count(*) FROM reservations WHERE state = 'active') AS active,
       (SELECT coalesce(sum(reserved_tokens), 0)::bigint
          FROM reservations WHERE state = 'active') AS reserved_tokens,
       (SELECT count(*) FROM reservations WHERE state <> 'active') AS finished,
       (SELECT count(*) FROM reservations WHERE outage_mode IS NOT NULL) AS outage_admissions,
       (SELECT count(*) FROM usage_ledger) AS ledger_rows

-- output_histograms --
-- The learned output histograms (see estimates.sql) changed after $1 (NULL:
-- all), of one tenant ($2) and model ($3) when given, at most $4, in key
-- order. The first column is the database clock now, also when no row
-- matches (the histogram columns are then NULL): the next refresh asks from
-- there. updated_epoch is updated_at in seconds since the epoch.
SELECT clock_timestamp() AS read_at, h.tenant, h.route, h.model, h.weights, h.samples,
       h.updated_at, extract(epoch FROM h.updated_at)::double precision AS updated_epoch
  FROM (SELECT 1) AS one
       LEFT JOIN LATERAL (
           SELECT e.*
             FROM output_estimates AS e
            WHERE ($1::timestamptz IS NULL OR e.updated_at > $1::timestamptz)
              AND ($2::text IS NULL OR e.tenant = $2::text)
              AND ($3::text IS NULL OR e.model = $3::text)
            ORDER BY e.tenant, e.route, e.model
            LIMIT $4::integer) AS h ON true
