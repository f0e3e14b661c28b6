-- Named statements the store runs. Each block: a header line with the name,
-- a comment saying what it does, then one statement with $n parameters.
-- The hot transitions (admit, settle, release, expire) are functions in
-- admission.sql; these call them or do the small things around them.

-- admit --
-- Decide a batch of admission requests in arrival order (see lq_admit), by
-- the deadline $18, with the reservation ids $19, the requests' key layers
-- $20, their explicit fallbacks' output reserves $21, the serving path
-- each journals ($22: queued after waiting) and the deployments of each
-- candidate model ($23-$26: request position, model, deployment, rule). database_now is the
-- database's clock once the batch is decided: the worker's deadlines are
-- stated on it (store/clock.py).
SELECT a.*, clock_timestamp() AS database_now
  FROM lq_admit($1::text[], $2::text[], $3::text[], $4::bigint[], $5::bigint[],
                $6::boolean[], $7::integer[], $8::text[], $9::text[], $10::integer,
                $11::smallint[], $12::boolean[], $13::boolean[], $14::integer[],
                $15::text[], $16::bigint[], $17::bigint[], $18::timestamptz,
                $19::uuid[], $20::bigint[], $21::bigint[], $22::text[], $23::integer[],
                $24::text[], $25::text[], $26::text[]) AS a

-- admit_without_flush --
-- The same batch decision, committed without waiting for the WAL flush
-- (LLMQUOTA_ADMISSION_SYNCHRONOUS_COMMIT=false). set_config(..., true) lasts
-- until the end of this statement's own transaction and synchronous_commit is
-- read only at its commit, so where in the plan it runs does not matter.
-- Settlement and the ledger are other statements and always wait. A crash can
-- forget the last admissions (their debits and reservations), never a ledger row.
SELECT a.*, clock_timestamp() AS database_now
  FROM (SELECT set_config('synchronous_commit', 'off', true)) AS unflushed,
       lq_admit($1::text[], $2::text[], $3::text[], $4::bigint[], $5::bigint[],
                $6::boolean[], $7::integer[], $8::text[], $9::text[], $10::integer,
                $11::smallint[], $12::boolean[], $13::boolean[], $14::integer[],
                $15::text[], $16::bigint[], $17::bigint[], $18::timestamptz,
                $19::uuid[], $20::bigint[], $21::bigint[], $22::text[], $23::integer[],
                $24::text[], $25::text[], $26::text[]) AS a

-- finish --
-- Settle, release or expire a batch of reservations (see lq_finish); $7-$9:
-- where each settlement's figures came from, and $10 how it was served
-- (NULL: as the reservation journaled it), for its ledger row.
SELECT * FROM lq_finish($1::uuid[], $2::text[], $3::text[], $4::bigint[], $5::bigint[], $6::text[],
                        $7::text[], $8::numeric[], $9::numeric[], $10::text[])

-- sweep --
-- Expire up to $1 reservations whose lease ran out (see lq_sweep).
SELECT * FROM lq_sweep($1::integer)

-- heartbeat --
-- Extend a live lease and bump its generation (see lq_heartbeat): $1 the
-- reservation, $2 the caller's tenant (NULL: any), $3 seconds (NULL: its own
-- lease), $4 the generation the caller holds (NULL: any), $5 output relayed.
SELECT * FROM lq_heartbeat($1::uuid, $2::text, $3::integer, $4::integer, $5::boolean)

-- put_policy --
-- Create or replace the policy of a route (see lq_put_policy); no row when
-- the If-Match list $13 does not match.
SELECT * FROM lq_put_policy($1::text, $2::text, $3::text, $4::bigint, $5::bigint, $6::bigint,
                             $7::bigint, $8::integer, $9::integer, $10::text, $11::text[],
                             $12::jsonb, $13::text[], $14::integer, $15::boolean, $16::jsonb,
                             $17::text)

-- put_global_policy --
-- Create or replace the global policy, split over $8 shards (NULL: as many
-- as now); its new policy_version (see lq_put_global). $9 is the If-Match
-- list (NULL: none): policy_version NULL and precondition_met false when it
-- does not match (see lq_put_global_if_match).
SELECT * FROM lq_put_global_if_match($1::bigint, $2::bigint, $3::bigint, $4::bigint,
                                     $5::integer, $6::integer, $7::text, $8::smallint,
                                     $9::text[])

-- put_tenant_policy --
-- Set a tenant's own policy ($3, the fields it sets, as a JSON object) and its
-- plan ($2), registering the tenant; its new policy_version, or NULL when the
-- plan does not exist (see lq_put_tenant_policy). $4 is the If-Match list
-- (NULL: none): precondition_met false (and nothing written) when it does not match.
SELECT * FROM lq_put_tenant_policy_if_match($1::text, $2::text, $3::jsonb, $4::text[])

-- put_plan --
-- Create or replace a plan and recompute every tenant on it, in one
-- transaction; how many tenants changed (see lq_put_plan). $13 is the If-Match
-- list (NULL: none; see lq_named_precondition): precondition_met false and
-- nothing written when it does not match. $14: the plan's response cache
-- (NULL: none), $15 its admission (NULL: exact), which its tenants take where
-- they set none.
SELECT * FROM lq_put_plan_if_match($1::text, $2::smallint, $3::bigint, $4::bigint,
                                   $5::bigint, $6::bigint, $7::integer, $8::integer,
                                   $9::text, $10::text[], $11::boolean, $12::jsonb,
                                   $14::jsonb, $15::text, $13::text[])

-- get_plans --
-- One plan ($1), or every plan ($1 NULL), with how many tenants are on each.
SELECT p.plan, p.priority, p.tokens_per_minute, p.token_burst, p.requests_per_minute,
       p.request_burst, p.max_in_flight, p.lease_seconds, p.failure_mode, p.fallback_models,
       p.prepaid, p.output_estimate::text AS output_estimate, p.cache::text AS cache,
       p.admission, lq_plan_version(p.updated_at) AS version,
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
-- $11 is the If-Match list, as put_plan's; $12 to $14 the alert settings, $15
-- the ladder's queue steps, $16 the deployment it is scoped to.
SELECT * FROM lq_put_ceiling_if_match($1::text, $2::text[], $3::bigint, $4::bigint,
                                      $5::bigint, $6::bigint, $7::integer, $8::float8[],
                                      $9::smallint[], $10::bigint[], $12::numeric[],
                                      $13::float8, $14::float8, $15::integer[], $16::text,
                                      $11::text[])

-- get_ceilings --
-- One ceiling ($1), or every one ($1 NULL), refilled to now (read only), with
-- its utilization: the share of its token burst in use (1 - balance / burst).
-- Every row's balances are of one moment of the database clock, read_at (the
-- ceiling alert detector orders its samples by it). max_in_flight is the
-- policy's: in a cell, the slice's cap less the permits the rebalancer moved
-- in (migration 0035), so that summed over the cells it is the whole.
WITH clock AS (
    SELECT clock_timestamp() AS ts
)
SELECT l.ceiling, l.models, l.tokens_per_minute, l.token_burst, l.requests_per_minute,
       l.request_burst, l.max_in_flight - l.in_flight_moved AS max_in_flight, l.shed_above,
       l.shed_admit, l.shed_small, l.shed_queue_ms, l.alert_at, l.alert_hysteresis,
       l.alert_quiet_seconds, l.upstream, l.policy_version, l.in_flight,
       lq_refilled(l.tokens, l.tokens_per_minute, l.token_burst, l.refilled_at, c.ts) AS tokens,
       lq_refilled(l.requests, l.requests_per_minute, l.request_burst, l.refilled_at, c.ts)
           AS requests,
       c.ts AS read_at
  FROM limit_layers AS l, clock AS c
 WHERE l.scope = 'ceiling'
   AND ($1::text IS NULL OR l.ceiling = $1::text)
 ORDER BY l.ceiling

-- ceiling_oversubscription --
-- How oversubscribed one ceiling ($4), or every one ($4 NULL), is over the
-- last $1 days: the sum of the tenant limits that can reach it against it,
-- the tenants active per minute and the verdict of the rule (warn above $2,
-- critical above $3 times the ceiling). reporting.oversubscription in
-- sql/reports/60_oversubscription.sql defines every figure; it reads the
-- period's ledger rows and locks nothing. No row: no such ceiling.
SELECT * FROM reporting.oversubscription($1::integer, $2::numeric, $3::numeric, $4::text)

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
-- The provider refused model $1 (429): the ceilings bounding deployment $3
-- admit nothing for $2 seconds (see lq_cool_down_ceilings); their names.
SELECT * FROM lq_cool_down_ceilings($1::text, $2::float8, $3::text, $4::boolean)

-- delete_ceiling --
-- Delete a provider ceiling; one row when it existed. Open reservations
-- admitted through it stop naming it (a give-back to a layer that is gone
-- would be dropped anyway), so every open reservation's layers exist
-- (lq_audit_reservation_layers), and they settle as before.
WITH gone AS (
    DELETE FROM limit_layers WHERE scope = 'ceiling' AND ceiling = $1::text RETURNING layer_id
), unnamed AS (
    UPDATE reservations AS r
       SET layer_ids = array_remove(r.layer_ids, g.layer_id)
      FROM gone AS g
     WHERE r.layer_ids @> ARRAY[g.layer_id]
       AND (r.state = 'active' OR (r.state = 'expired' AND r.charged_tokens IS NULL))
)
SELECT layer_id FROM gone

-- get_policy --
-- One layer's policy, or no row; the global layer's summed over its shards.
-- A tenant's output_estimate and cache are its effective ones (its own, else
-- its plan's; own_policy says which it set itself); the global layer has neither.
-- Its max_in_flight is the policy's: in a cell, the slice's cap less the
-- permits the rebalancer moved in (migration 0035), so that summed over the
-- cells it is the whole.
SELECT tokens_per_minute, token_burst, requests_per_minute, request_burst,
       max_in_flight, lease_seconds, failure_mode, policy_version, plan, fallback_models,
       prepaid, own_policy::text AS own_policy, output_estimate::text AS output_estimate,
       shards, request_cost, uses_concurrency, cache::text AS cache, admission
  FROM limit_layers
 WHERE scope = $1::text AND scope <> 'global'
   AND tenant IS NOT DISTINCT FROM $2::text
   AND route IS NOT DISTINCT FROM $3::text
UNION ALL
SELECT tokens_per_minute, token_burst, requests_per_minute, request_burst,
       max_in_flight - in_flight_moved, lease_seconds, failure_mode, policy_version, NULL,
       '{}'::text[], false, NULL, NULL, shards, NULL::integer, NULL::boolean, NULL::text,
       NULL::text
  FROM global_layer
 WHERE $1::text = 'global'

-- ensure_tenant --
-- Register a tenant, with an empty tenant layer: no limits of its own yet
-- (see lq_ensure_tenant).
SELECT lq_ensure_tenant($1::text)

-- tenant_exists --
-- Whether a tenant is registered.
SELECT EXISTS (SELECT 1 FROM tenants WHERE tenant = $1::text)

-- insert_api_key --
-- Store a key's digest, registering its tenant if new, with its own limits
-- when $14 (see lq_insert_api_key); no row when the expiry $6 has passed.
SELECT * FROM lq_insert_api_key($1::bytea, $2::text, $3::text, $4::text, $5::text[],
                                 $6::timestamptz, $7::bigint, $8::bigint, $9::bigint,
                                 $10::bigint, $11::integer, $12::text[], $13::text[],
                                 $14::boolean)

-- insert_first_admin_key --
-- Store an admin key's digest unless an admin key exists already (see
-- lq_insert_first_admin_key).
SELECT * FROM lq_insert_first_admin_key($1::bytea, $2::text)

-- find_api_key --
-- The usable key with this digest (its current secret, or its previous one
-- within the rotation's grace; neither revoked nor expired): its tenant (NULL
-- for an admin key), scopes, whether the tenant is suspended, and for how many
-- seconds more this secret is valid by the database's clock (NULL: no end),
-- and the models it may name (NULL: any).
SELECT k.key_id, k.tenant, k.scopes, t.suspended_at IS NOT NULL AS suspended,
       extract(epoch FROM least(k.expires_at,
                                CASE WHEN k.key_hash = $1::bytea THEN NULL
                                     ELSE k.previous_expires_at END)
                          - clock_timestamp())::float8 AS valid_seconds,
       k.models
  FROM api_keys AS k
  LEFT JOIN tenants AS t ON t.tenant = k.tenant
 WHERE (k.key_hash = $1::bytea
        OR (k.previous_hash = $1::bytea AND k.previous_expires_at > clock_timestamp()))
   AND k.revoked_at IS NULL
   AND (k.expires_at IS NULL OR k.expires_at > clock_timestamp())

-- list_api_keys --
-- Every key of tenant $1 (admin keys when $2), revoked ones too, oldest first,
-- with its own limits.
SELECT k.key_id, k.tenant, k.prefix, k.label, k.scopes, k.created_at, k.expires_at,
       k.revoked_at, u.last_used_at, k.models, l.tokens_per_minute, l.token_burst,
       l.requests_per_minute, l.request_burst, l.max_in_flight
  FROM api_keys AS k
  LEFT JOIN api_key_uses AS u USING (key_id)
  LEFT JOIN limit_layers AS l ON l.api_key_id = k.key_id
 WHERE CASE WHEN $2::boolean THEN k.tenant IS NULL ELSE k.tenant = $1::text END
 ORDER BY k.key_id

-- revoke_api_key --
-- Revoke key $1 of tenant $2 (NULL: an admin key; see lq_revoke_key):
-- 'revoked', 'unknown' or 'last_admin_key'.
SELECT lq_revoke_key($1::bigint, $2::text, $3::boolean) AS outcome

-- rotate_api_key --
-- Give key $1 (of tenant $2; an admin key when $3) the new digest $4 and
-- prefix $5, the old one valid $6 seconds more (see lq_rotate_api_key).
SELECT * FROM lq_rotate_api_key($1::bigint, $2::text, $3::boolean, $4::bytea, $5::text,
                                 $6::integer)

-- put_key_limits --
-- Replace the limits of key $1 of tenant $2 (see lq_put_key_limits); no row:
-- no such key, or revoked.
SELECT * FROM lq_put_key_limits($1::bigint, $2::text, $3::bigint, $4::bigint, $5::bigint,
                                 $6::bigint, $7::integer, $8::text[], $9::text[])

-- note_key_use --
-- Remember that key $1 was used now (see lq_note_key_use).
SELECT lq_note_key_use($1::bigint)

-- suspended_tenants --
-- Every suspended tenant (workers keep the list with their policies, so
-- that no admission of one is decided, whoever's key asks).
SELECT tenant FROM tenants WHERE suspended_at IS NOT NULL ORDER BY tenant

-- suspend_tenant --
-- Suspend ($2 true) or resume tenant $1 (see lq_suspend_tenant). No row: no
-- such tenant.
SELECT * FROM lq_suspend_tenant($1::text, $2::boolean)

-- layer_status --
-- The global layer (summed over its shards) and every layer of one tenant,
-- refilled to now (read only), with the effective fallback models (the layer's
-- own, else its plan's), as admission uses them, and the effective response
-- cache (the console shows which layer serves answers again). Room workers
-- hold in live slices of a layer (allotted admission, allotments.sql) is room
-- left too, debited from the row but not yet any request's: `tokens` and
-- `requests` count it, and `allotted_tokens` and `allotted_requests` say how
-- much of them it is. (An expired slice's room comes back to the row when the
-- sweeper returns it.) The global layer's max_in_flight is the policy's: in a
-- cell, its cap less the permits the rebalancer moved in (migration 0035).
SELECT g.scope, g.tenant, g.route, g.plan, g.tokens_per_minute, g.token_burst,
       g.requests_per_minute, g.request_burst,
       g.max_in_flight - g.in_flight_moved AS max_in_flight, g.lease_seconds,
       g.failure_mode, g.policy_version, g.in_flight,
       g.tokens + s.tokens AS tokens, g.requests + s.requests AS requests,
       '{}'::text[] AS fallback_models, false AS prepaid, g.shards,
       NULL::integer AS request_cost, NULL::boolean AS uses_concurrency, NULL::text AS cache,
       s.tokens::bigint AS allotted_tokens, s.requests::bigint AS allotted_requests
  FROM global_layer AS g
       CROSS JOIN LATERAL (
           SELECT coalesce(sum(a.tokens), 0)::double precision AS tokens,
                  coalesce(sum(a.requests), 0)::double precision AS requests
             FROM allotments AS a
            WHERE a.expires_at > clock_timestamp()
              AND EXISTS (SELECT 1 FROM limit_layers AS shard
                           WHERE shard.scope = 'global' AND shard.layer_id = ANY (a.layer_ids))
       ) AS s
UNION ALL
(SELECT l.scope, l.tenant, l.route, l.plan, l.tokens_per_minute, l.token_burst,
        l.requests_per_minute, l.request_burst, l.max_in_flight, l.lease_seconds,
        l.failure_mode, l.policy_version, l.in_flight,
        lq_refilled(l.tokens, l.tokens_per_minute, l.token_burst, l.refilled_at,
                    clock_timestamp()) + s.tokens,
        lq_refilled(l.requests, l.requests_per_minute, l.request_burst, l.refilled_at,
                    clock_timestamp()) + s.requests,
        l.fallback_models, l.prepaid, l.shards, l.request_cost, l.uses_concurrency,
        l.cache::text, s.tokens::bigint, s.requests::bigint
   FROM limit_layers AS l
        CROSS JOIN LATERAL (
            SELECT coalesce(sum(a.tokens), 0)::double precision AS tokens,
                   coalesce(sum(a.requests), 0)::double precision AS requests
              FROM allotments AS a
             WHERE a.tenant = $1::text
               AND l.layer_id = ANY (a.layer_ids)
               AND a.expires_at > clock_timestamp()
        ) AS s
  WHERE l.scope IN ('tenant', 'route') AND l.tenant = $1::text
  ORDER BY l.layer_id)

-- tenant_usage --
-- Ledger totals for one tenant over [from, to): requests are reservations
-- (and response cache hits) with any ledger row; tokens are what was really
-- used. One pass gives the totals (the row whose serving_path is NULL, always
-- there, first) and one row per serving path with rows, a row without one
-- (an adjustment, a row older than revision 0026) counting as primary.
SELECT CASE WHEN grouping(g.path) = 0 THEN g.path END AS serving_path,
       count(DISTINCT g.reservation_id) AS requests,
       coalesce(sum(g.input_tokens), 0)::bigint AS input_tokens,
       coalesce(sum(g.output_tokens), 0)::bigint AS output_tokens,
       coalesce(sum(g.saved_input_tokens), 0)::bigint AS saved_input_tokens,
       coalesce(sum(g.saved_output_tokens), 0)::bigint AS saved_output_tokens
  FROM (SELECT coalesce(l.serving_path, 'primary') AS path, l.reservation_id,
               l.input_tokens, l.output_tokens, l.saved_input_tokens, l.saved_output_tokens
          FROM usage_ledger AS l
         WHERE l.tenant = $1::text
           AND l.recorded_at >= $2::timestamptz
           AND l.recorded_at < $3::timestamptz) AS g
 GROUP BY GROUPING SETS ((), (g.path))
 ORDER BY grouping(g.path) DESC, g.path

-- purge_finished --
-- Delete up to $2 reservations finished longer ago than $1 seconds (see
-- lq_purge_finished).
SELECT lq_purge_finished($1::integer, $2::integer) AS purged

-- ensure_ledger_partitions --
-- Create the ledger's monthly partitions for this month and $1 months ahead
-- (see lq_ensure_ledger_partitions); one row per month with what was done.
SELECT partition_name, status FROM lq_ensure_ledger_partitions($1::integer)

-- outage_id_key --
-- The key workers sign the reservation ids they make during an outage with
-- (see domain/outage_ids.py); one row, made by migration 0007.
SELECT key FROM outage_id_key

-- policy_snapshot --
-- Every layer's policy, for the per-worker cache that outlives an outage (the
-- global layer's max_in_flight the policy's, as get_policy reads it).
-- Provider ceilings are not in it: they come with the budgets
-- (outage_budgets), which have no version; nor are API keys' layers (a key's
-- own limits are not decided locally, only recorded at replay). The
-- snapshot version is (max policy_version, layer count): a policy change takes
-- the next policy_version and a deleted tenant lowers the count. When it
-- equals the caller's ($1, $2) only the version row comes back (the columns of
-- the layer are NULL); otherwise up to $3 layers, in layer_id order. The
-- response cache policy (`cache`, the tenant layer's effective one) comes
-- with them: the proxy decides whether to look an answer up from this copy,
-- without a round trip of its own; and the default `fallback_models` (the
-- tenant layer's effective list), which a worker reserves at each model's own
-- learned estimate (admission/estimates.py).
WITH version AS (
    SELECT coalesce(max(policy_version), 0)::bigint AS snapshot_version,
           count(*) FILTER (WHERE shard = 0)::bigint AS layer_count
      FROM limit_layers
     WHERE scope NOT IN ('ceiling', 'key')
)
SELECT v.snapshot_version, v.layer_count, l.scope, l.tenant, l.route, l.tokens_per_minute,
       l.token_burst, l.requests_per_minute, l.request_burst, l.max_in_flight,
       l.lease_seconds, l.failure_mode, l.policy_version, l.output_estimate, l.request_cost,
       l.uses_concurrency, l.cache, l.admission,
       -- last: a worker keeps a layer whose other columns are unchanged by
       -- their slice (store/policy_rows.py), and this one is an array
       l.fallback_models
  FROM version AS v
       LEFT JOIN LATERAL (
           -- the global layer summed over its shards, then the others
           SELECT g.layer_id, g.scope, g.tenant, g.route, g.tokens_per_minute, g.token_burst,
                  g.requests_per_minute, g.request_burst,
                  g.max_in_flight - g.in_flight_moved AS max_in_flight, g.lease_seconds,
                  g.failure_mode, g.policy_version, NULL::text AS output_estimate,
                  NULL::integer AS request_cost, NULL::boolean AS uses_concurrency,
                  NULL::text AS cache, NULL::text[] AS fallback_models,
                  NULL::text AS admission
             FROM global_layer AS g
            WHERE (v.snapshot_version, v.layer_count)
                  IS DISTINCT FROM ($1::bigint, $2::bigint)
           UNION ALL
           (SELECT ll.layer_id, ll.scope, ll.tenant, ll.route, ll.tokens_per_minute,
                   ll.token_burst, ll.requests_per_minute, ll.request_burst, ll.max_in_flight,
                   ll.lease_seconds, ll.failure_mode, ll.policy_version,
                   ll.output_estimate::text, ll.request_cost, ll.uses_concurrency,
                   ll.cache::text, ll.fallback_models, ll.admission
              FROM limit_layers AS ll
             WHERE ll.scope IN ('tenant', 'route')
               AND (v.snapshot_version, v.layer_count)
                   IS DISTINCT FROM ($1::bigint, $2::bigint)
             ORDER BY ll.layer_id
             LIMIT $3::integer - (SELECT count(*) FROM global_layer)::integer)) AS l ON true

-- outage_budgets --
-- What a worker needs besides the policies to decide `local` admissions while
-- the store is away (domain/local_budget.py), read afresh at every policy
-- refresh because it moves with every admission: one row per item, `kind`
-- saying which. 'ceiling': a provider ceiling's limits (max_in_flight the
-- policy's, as get_ceilings reads it) and models (LIKE patterns); 'quota': a blocking calendar quota, its limits and what its
-- current window used (reserved + charged; a key's quotas are not decided
-- locally, only recorded at replay); 'credits': a prepaid tenant and
-- its available balance (balance - reserved, 0 without an account),
-- 'price': a model's price in force. At most $1 rows of each kind. A
-- ceiling's `ladder`, when a step of it queues (migration 0025), is its steps
-- as [above, admit mask, small_request_tokens, queue_ms] arrays: a worker
-- reads from it how long a shed request may wait (admission/ladder_queue.py).
-- Its `upstream`: the deployment it is scoped to (migration 0027), if any.
(SELECT 'ceiling'::text AS kind, ll.ceiling AS name, NULL::text AS tenant, NULL::text AS route,
        ll.model_patterns AS patterns, ll.tokens_per_minute, ll.token_burst,
        ll.requests_per_minute, ll.request_burst,
        ll.max_in_flight - ll.in_flight_moved AS max_in_flight, ll.policy_version,
        NULL::bigint AS quota_id, NULL::bigint AS tokens_limit, NULL::numeric AS cost_limit,
        NULL::bigint AS used_tokens, NULL::numeric AS used_cost,
        NULL::timestamptz AS window_end, NULL::numeric AS available,
        NULL::numeric AS price_in, NULL::numeric AS price_out,
        CASE WHEN ll.shed_queue_ms IS NOT NULL THEN
            (SELECT jsonb_agg(jsonb_build_array(s.above, s.admit, s.small, s.queue_ms)
                              ORDER BY s.o)
               FROM unnest(ll.shed_above, ll.shed_admit, ll.shed_small, ll.shed_queue_ms)
                    WITH ORDINALITY AS s(above, admit, small, queue_ms, o)) END AS ladder,
        ll.upstream
   FROM limit_layers AS ll
  WHERE ll.scope = 'ceiling'
  ORDER BY ll.layer_id
  LIMIT $1::integer)
UNION ALL
(SELECT 'quota', q.name, q.tenant, q.route, q.model_patterns, NULL, NULL, NULL, NULL, NULL,
        NULL, q.quota_id, q.tokens, q.cost,
        coalesce(w.reserved_tokens + w.charged_tokens, 0),
        coalesce(w.reserved_cost + w.charged_cost, 0), cw.window_end, NULL, NULL, NULL, NULL,
        NULL
   FROM quotas AS q
        CROSS JOIN LATERAL lq_quota_window(q.period, q.timezone, clock_timestamp()) AS cw
        LEFT JOIN quota_windows AS w
          ON w.quota_id = q.quota_id AND w.window_start = cw.window_start
  WHERE q.enforce = 'block' AND q.api_key_id IS NULL
  ORDER BY q.quota_id
  LIMIT $1::integer)
UNION ALL
(SELECT 'credits', NULL, ll.tenant, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL,
        NULL, NULL, NULL, NULL, coalesce(ca.balance - ca.reserved, 0), NULL, NULL, NULL, NULL
   FROM limit_layers AS ll
        LEFT JOIN credit_accounts AS ca ON ca.tenant = ll.tenant
  WHERE ll.scope = 'tenant' AND ll.prepaid
  ORDER BY ll.layer_id
  LIMIT $1::integer)
UNION ALL
(SELECT DISTINCT ON (mp.model) 'price', mp.model, NULL, NULL, NULL, NULL, NULL, NULL, NULL,
        NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, mp.input_usd_per_million,
        mp.output_usd_per_million, NULL, NULL
   FROM model_prices AS mp
  WHERE mp.effective_from <= clock_timestamp()
  ORDER BY mp.model, mp.effective_from DESC
  LIMIT $1::integer)

-- record_outage_admissions --
-- Record reservations admitted during an outage, once each, $14 the layers
-- of the keys that asked (see lq_record_outage_admissions).
SELECT * FROM lq_record_outage_admissions($1::uuid[], $2::text[], $3::text[], $4::text[],
                                          $5::bigint[], $6::bigint[], $7::boolean[],
                                          $8::integer[], $9::text[], $10::text[],
                                          $11::bigint[], $12::text[], $13::timestamptz[],
                                          $14::bigint[])

-- finish_outage --
-- Settle or release reservations recorded from an outage journal, their
-- usage counted at the journaled moment $7 (see lq_finish_outage).
SELECT * FROM lq_finish_outage($1::uuid[], $2::text[], $3::text[], $4::bigint[], $5::bigint[],
                               $6::text[], $7::timestamptz[])

-- audit --
-- Every discrepancy between the counters, the journal, the ledgers and the
-- invoice (see lq_audit).
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

-- database_clock --
-- The database's clock, the one every deadline of an admission is stated on.
SELECT clock_timestamp() AS database_now

-- list_tenants --
-- One page of tenants by name after the cursor $1 (NULL: from the first),
-- at most $2, on plan $3 (NULL: any): keyset pagination on the primary key,
-- never OFFSET. status is 'suspended' while the tenant is (suspended_at,
-- migration 0018), else 'active'. last_activity_at is the newest
-- reservation's created_at, one backward step of the index reservations
-- (tenant, created_at).
SELECT t.tenant, l.plan,
       CASE WHEN t.suspended_at IS NULL THEN 'active' ELSE 'suspended' END AS status,
       (SELECT r.created_at FROM reservations AS r
         WHERE r.tenant = t.tenant
         ORDER BY r.created_at DESC LIMIT 1) AS last_activity_at
  FROM tenants AS t
       LEFT JOIN limit_layers AS l ON l.scope = 'tenant' AND l.tenant = t.tenant
 WHERE ($1::text IS NULL OR t.tenant > $1::text)
   AND ($3::text IS NULL OR l.plan = $3::text)
 ORDER BY t.tenant
 LIMIT $2::integer

-- delete_tenant --
-- Delete a tenant unless it has active reservations, in one statement (see
-- lq_delete_tenant); $2 is the If-Match list (NULL: none).
SELECT status, active FROM lq_delete_tenant($1::text, $2::text[])

-- allot --
-- Take a slice of a request's layers' room, or top one up (sql/allotments.sql).
SELECT * FROM lq_allot($1::uuid, $2::text, $3::text, $4::text, $5::bigint, $6::bigint,
                       $7::bigint, $8::double precision, $9::bigint, $10::text, $11::integer,
                       $12::boolean)

-- allot_journal --
-- Journal admissions decided from slices: per slice, how many were written.
SELECT allotment_id, journaled
  FROM lq_allot_journal($1::uuid[], $2::uuid[], $3::bigint[], $4::boolean[], $5::bigint[],
                        $6::bigint[], $7::integer[], $8::text[], $9::integer)

-- allot_orphans --
-- Journal admissions of a slice the sweeper returned (its worker was away).
SELECT lq_allot_orphans($1::text, $2::text, $3::text, $4::bigint, $5::uuid[], $6::bigint[],
                        $7::boolean[], $8::bigint[], $9::bigint[], $10::integer[],
                        $11::text[]) AS journaled

-- allot_return --
-- Give back what slices hold (a worker's own, at once).
SELECT returned, tokens, requests FROM lq_allot_return($1::uuid[], false)

-- allot_sweep --
-- Give back slices past their expiry (the sweeper's).
SELECT returned, tokens, requests FROM lq_allot_sweep($1::integer)

-- shared_rooms --
-- The room of this cell's slice of each shared layer now (sql/global_layer.sql).
SELECT ceiling, tokens, requests, token_burst, request_burst FROM lq_shared_rooms()

-- send_budget --
-- Debit this cell's slice of a shared layer for another cell, and journal it.
SELECT tokens, requests
  FROM lq_send_budget($1::uuid, $2::text, $3::text, $4::double precision,
                      $5::double precision, $6::double precision, $7::double precision)

-- receive_budget --
-- Credit a move from another cell to this cell's slice of a shared layer (once).
SELECT lq_receive_budget($1::uuid, $2::text, $3::text, $4::double precision,
                         $5::double precision) AS credited

-- confirm_budget --
-- The receiver has the move: its journal row here is delivered.
SELECT lq_confirm_budget($1::uuid)

-- undelivered_budget --
-- Moves this cell sent that no receiver has acknowledged yet, oldest first.
SELECT transfer_id, ceiling, peer, tokens, requests FROM lq_undelivered_budget($1::integer)

-- shared_permits --
-- The in-flight permits of this cell's slice of each shared layer that caps them.
SELECT ceiling, in_flight, max_in_flight, share FROM lq_shared_permits()

-- send_permits --
-- Lend free permits of this cell's slice of a shared layer to another cell, journaled.
SELECT lq_send_permits($1::uuid, $2::text, $3::text, $4::integer, $5::integer) AS permits

-- receive_permits --
-- Credit permits lent by another cell to this cell's slice of a shared layer (once).
SELECT lq_receive_permits($1::uuid, $2::text, $3::text, $4::integer) AS credited

-- undelivered_permits --
-- Permit moves this cell sent that no receiver has acknowledged yet, oldest first.
SELECT transfer_id, ceiling, peer, permits FROM lq_undelivered_permits($1::integer)

-- prune_budget_transfers --
-- Forget moves older than $1 seconds ('in' rows twice as old).
SELECT lq_prune_budget_transfers($1::integer) AS pruned
