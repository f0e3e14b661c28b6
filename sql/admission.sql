-- Admission, settlement, release and expiry.
--
-- Each function is one statement from the client: one round trip, one
-- transaction, all or nothing. Each takes arrays so that a caller can decide
-- a whole batch of requests at once; a batch of one is the ordinary case.
--
-- Locking discipline (the reason concurrent transitions never deadlock):
--   1. advisory locks on idempotency keys, in hash order (admission only);
--   2. reservation rows, in reservation_id order (never waited on by admission);
--   3. limit_layers rows, in layer_id order;
--   4. output_estimates rows, in (tenant, route, model) order (settlement
--      only, see estimates.sql).
-- A transaction only ever waits for a lock of a later class, or of the same
-- class further along the same order, so no cycle can form. That holds
-- across statements too: a transaction holding layers never waits for one
-- it sees only now (lq_lock_layers, lq_admit_decide's (3): SKIP LOCKED, and
-- a lock taken without waiting cannot close a cycle).
--
-- Time comes from the database clock alone: clock_timestamp() read after the
-- locks are held, never earlier than a layer's last refill.
--
-- How the file reads: the small functions both sides share; lq_admit_decide
-- and then its steps (lq_admit_at_once, the fast path; lq_lock_layers ...
-- lq_persist_layers), numbered as its body numbers them, each over rows of
-- migration 0032's types; lq_admit_in_time and lq_admit, which calls it;
-- the price functions; lq_finish and then its steps; lq_sweep.

-- The balance of a bucket after refilling it for the time since its last refill.
-- Refill is continuous at per_minute / 60 per second and never passes burst.
CREATE OR REPLACE FUNCTION lq_refilled(
    balance double precision,
    per_minute bigint,
    burst bigint,
    refilled_at timestamptz,
    now_ts timestamptz
) RETURNS double precision
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$
    SELECT CASE
        WHEN per_minute IS NULL THEN NULL
        ELSE least(burst::double precision,
                   balance + greatest(0, extract(epoch FROM now_ts - refilled_at))
                             * per_minute / 60.0)
    END
$$;


-- The balance of a bucket whose limits change: refilled under the old rules
-- up to now_ts, then clamped to the new capacity. A limit that did not exist
-- before starts full; a limit that is removed has no balance.
CREATE OR REPLACE FUNCTION lq_rebalanced(
    balance        double precision,
    old_per_minute bigint,
    old_burst      bigint,
    refilled_at    timestamptz,
    new_per_minute bigint,
    new_burst      bigint,
    now_ts         timestamptz
) RETURNS double precision
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$
    SELECT CASE
        WHEN new_per_minute IS NULL THEN NULL
        WHEN balance IS NULL THEN new_burst::double precision
        ELSE least(new_burst::double precision,
                   lq_refilled(balance, old_per_minute, old_burst, refilled_at, now_ts))
    END
$$;


-- Credit (or debit, when negative) layers, clamped to capacity, and free
-- in-flight permits. The rows are locked in layer_id order before any is
-- changed. Settlement, release and expiry all end here, so "a balance never
-- exceeds its capacity" is enforced in exactly one place. So is "a shared
-- layer (global, ceiling) never goes below minus its burst": a debit beyond
-- it is forgiven (settlement asks lq_shared_forgiven first how much, and
-- whose, so it never reaches this clamp).
--
-- A sharded global layer is credited as one: every global row is locked (in
-- the same order), the credit is added to their refilled sum, clamped to
-- their summed burst and split back by burst, as lq_admit splits a pooled
-- batch. Crediting only the row a reservation names would clamp a give-back
-- larger than that row's headroom while the others have room.
CREATE OR REPLACE FUNCTION lq_credit_layers(
    p_layer_ids      bigint[],
    p_token_credit   double precision[],
    p_request_credit double precision[],
    p_permits_freed  integer[]
) RETURNS void
LANGUAGE plpgsql
-- Generic plans: each statement inside is planned once per session and probes
-- indexes whatever the batch size. (Custom plans were re-planned on every call,
-- and for a batch of many distinct tenants chose a hash join over a sequential
-- scan of limit_layers: twice the time of the whole statement.)
SET plan_cache_mode = force_generic_plan
AS $$
DECLARE
    now_ts  timestamptz;
    sharded boolean;
BEGIN
    IF coalesce(cardinality(p_layer_ids), 0) = 0 THEN
        RETURN;
    END IF;

    -- Lock every touched layer (and every global row, sharded), in layer_id
    -- order, before changing any.
    sharded := EXISTS (SELECT 1 FROM limit_layers AS g
                        WHERE g.layer_id = ANY (p_layer_ids) AND g.scope = 'global'
                          AND g.shards > 1);
    PERFORM 1
       FROM limit_layers AS l
      WHERE l.layer_id = ANY (p_layer_ids) OR (sharded AND l.scope = 'global')
      ORDER BY l.layer_id
        FOR UPDATE;

    now_ts := clock_timestamp();

    IF sharded THEN
        WITH credit AS (
            SELECT sum(u.tokens) AS tokens, sum(u.requests) AS requests
              FROM unnest(p_layer_ids, p_token_credit, p_request_credit)
                   AS u(layer_id, tokens, requests)
              JOIN limit_layers AS g ON g.layer_id = u.layer_id AND g.scope = 'global'
        ), pool AS (
            SELECT greatest(-sum(g.token_burst), least(sum(g.token_burst),
                         sum(lq_refilled(g.tokens, g.tokens_per_minute, g.token_burst,
                                         g.refilled_at, now_ts)) + min(c.tokens))) AS tokens,
                   greatest(-sum(g.request_burst), least(sum(g.request_burst),
                         sum(lq_refilled(g.requests, g.requests_per_minute, g.request_burst,
                                         g.refilled_at, now_ts)) + min(c.requests))) AS requests,
                   sum(g.token_burst) AS tburst, sum(g.request_burst) AS rburst
              FROM limit_layers AS g, credit AS c
             WHERE g.scope = 'global'
        )
        UPDATE limit_layers AS l
           SET tokens = least(l.token_burst, p.tokens * l.token_burst / p.tburst),
               requests = least(l.request_burst, p.requests * l.request_burst / p.rburst),
               refilled_at = greatest(l.refilled_at, now_ts)
          FROM pool AS p
         WHERE l.scope = 'global';
    END IF;

    -- (greatest() skips its NULL floor: a tenant's or route's own debt is
    -- its own, unbounded)
    UPDATE limit_layers AS l
       SET tokens      = CASE WHEN sharded AND l.scope = 'global' THEN l.tokens  -- done above
                              ELSE greatest(CASE WHEN l.scope IN ('global', 'ceiling')
                                                 THEN -l.token_burst END,
                                            least(l.token_burst::double precision,
                                                  lq_refilled(l.tokens, l.tokens_per_minute,
                                                              l.token_burst, l.refilled_at,
                                                              now_ts)
                                                  + c.tokens)) END,
           requests    = CASE WHEN sharded AND l.scope = 'global' THEN l.requests
                              ELSE greatest(CASE WHEN l.scope IN ('global', 'ceiling')
                                                 THEN -l.request_burst END,
                                            least(l.request_burst::double precision,
                                                  lq_refilled(l.requests, l.requests_per_minute,
                                                              l.request_burst, l.refilled_at,
                                                              now_ts)
                                                  + c.requests)) END,
           in_flight   = l.in_flight - c.permits,
           refilled_at = greatest(l.refilled_at, now_ts)
      -- One reservation list may name a layer many times: sum per layer.
      FROM (SELECT u.layer_id,
                   sum(u.tokens)   AS tokens,
                   sum(u.requests) AS requests,
                   sum(u.permits)::integer AS permits
              FROM unnest(p_layer_ids, p_token_credit, p_request_credit, p_permits_freed)
                   AS u(layer_id, tokens, requests, permits)
             GROUP BY u.layer_id) AS c
     WHERE l.layer_id = c.layer_id;
END
$$;


-- Shared layers forget like the limits they mirror: a provider's per-minute
-- limit forgets usage after a minute, so a mirror of it that remembered a
-- 10^7-token overshoot would lock every tenant out of it for a day. The
-- global layer (its shards pooled as one, when sharded) and every provider
-- ceiling stop at minus their burst; beyond it the usage is still debited in
-- full to the tenant's own layers and recorded in full in the ledger. So
-- after any one settlement a request that fits a shared layer is admitted
-- again within (burst + its cost) / refill rate.
--
-- Settlement asks this how much of each debit the floor forgives, and of
-- which reservation: it takes the entries lq_credit_layers is about to get
-- (one per credit and layer, in the caller's order) and returns each one's
-- forgiven tokens (0 for a credit, a tenant or route layer, or a debit that
-- fits); lq_finish adds them to the credits, so no debit takes a shared
-- layer below its floor and what was forgiven is known per reservation. The
-- entries are applied in order, one by one, as separate calls would apply
-- them: a batch forgives exactly what its requests one by one would (a
-- debit beyond the floor and then a refund is not the same as their sum).
-- lq_credit_layers clamps at the floor as well, for every other debit
-- (outage recording) and as the invariant's one place.
--
-- Locks exactly the rows lq_credit_layers will lock, in the same layer_id
-- order (class 3 of the header), so that no other transaction can move a
-- balance between this reading and that write; lq_credit_layers then finds
-- them held. (It reads the clock again: the balance it writes is minus the
-- burst plus the refill of the microseconds in between.)
CREATE OR REPLACE FUNCTION lq_shared_forgiven(
    p_layer_ids    bigint[],
    p_token_credit double precision[]
) RETURNS double precision[]
LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan
AS $$
DECLARE
    n        integer := coalesce(cardinality(p_layer_ids), 0);
    forgiven double precision[] := array_fill(0::double precision, ARRAY[n]);
    sharded  boolean;
    now_ts   timestamptz;
    -- one running balance per pool: a layer_id, or 0 for all the shards of
    -- a sharded global layer (layer ids start at 1)
    pools    bigint[] := '{}';
    balance  double precision[] := '{}';
    burst    double precision[] := '{}';
    b_now    double precision;
    b_burst  double precision;
    e        record;
    j        integer;
BEGIN
    IF n = 0 THEN
        RETURN forgiven;
    END IF;
    sharded := EXISTS (SELECT 1 FROM limit_layers AS g
                        WHERE g.layer_id = ANY (p_layer_ids) AND g.scope = 'global'
                          AND g.shards > 1);
    PERFORM 1
       FROM limit_layers AS l
      WHERE l.layer_id = ANY (p_layer_ids) OR (sharded AND l.scope = 'global')
      ORDER BY l.layer_id
        FOR UPDATE;
    now_ts := clock_timestamp();

    FOR e IN SELECT u.o, u.credit,
                    CASE WHEN sharded AND l.scope = 'global' THEN 0 ELSE l.layer_id END AS pool
               FROM unnest(p_layer_ids, p_token_credit) WITH ORDINALITY AS u(layer_id, credit, o)
               JOIN limit_layers AS l ON l.layer_id = u.layer_id
              WHERE l.scope IN ('global', 'ceiling') AND l.tokens_per_minute IS NOT NULL
              ORDER BY u.o LOOP
        j := array_position(pools, e.pool);
        IF j IS NULL THEN
            pools := pools || e.pool;
            j := cardinality(pools);
            -- Two queries, each by an index: one WHERE choosing its condition
            -- by a CASE is planned once (generic) as a scan of every layer.
            IF e.pool = 0 THEN
                SELECT sum(lq_refilled(g.tokens, g.tokens_per_minute, g.token_burst,
                                       g.refilled_at, now_ts)),
                       sum(g.token_burst)
                  INTO b_now, b_burst
                  FROM limit_layers AS g
                 WHERE g.scope = 'global';
            ELSE
                SELECT lq_refilled(g.tokens, g.tokens_per_minute, g.token_burst,
                                   g.refilled_at, now_ts),
                       g.token_burst
                  INTO b_now, b_burst
                  FROM limit_layers AS g
                 WHERE g.layer_id = e.pool;
            END IF;
            balance := balance || b_now;
            burst := burst || b_burst;
        END IF;
        IF e.credit >= 0 THEN
            balance[j] := least(burst[j], balance[j] + e.credit);
        ELSE
            -- never more than the debit itself: a balance already below the
            -- floor (before migration 0015) is not credited by a debit
            forgiven[e.o] := least(-e.credit, greatest(0, -burst[j] - (balance[j] + e.credit)));
            balance[j] := balance[j] + e.credit + forgiven[e.o];
        END IF;
    END LOOP;
    RETURN forgiven;
END
$$;


-- Take the transaction-scoped advisory lock of every (tenant, idempotency key)
-- in a batch, in hash order: two transactions sharing keys wait for each
-- other instead of both deciding the same key, and never deadlock. Called
-- first, before any row lock (the first class of the locking order above).
CREATE OR REPLACE FUNCTION lq_lock_idempotency_keys(p_tenants text[], p_keys text[])
RETURNS void
LANGUAGE sql
AS $$
    SELECT pg_advisory_xact_lock(h)
      FROM (SELECT DISTINCT hashtextextended(u.t || '/' || u.k, 0) AS h
              FROM unnest(p_tenants, p_keys) AS u(t, k)
             WHERE u.k IS NOT NULL) AS keys
     ORDER BY h;
$$;


-- A ceiling's model list as LIKE patterns: `*` matches any run of characters,
-- every other character only itself ('%', '_' and '\' are escaped).
CREATE OR REPLACE FUNCTION lq_model_patterns(p_models text[])
RETURNS text[]
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$
    SELECT coalesce(array_agg(replace(replace(replace(replace(m, '\', '\\'), '%', '\%'),
                                              '_', '\_'), '*', '%') ORDER BY o), '{}')
      FROM unnest(p_models) WITH ORDINALITY AS u(m, o)
$$;


-- The lowest balance a request of priority rank p_priority may leave in a
-- ceiling: the shedding ladder read as floors. A step (above, admit) that does
-- not admit the priority forbids taking utilization past `above`, that is the
-- balance below (1 - above) * burst; the highest such floor binds. 0 when no
-- step sheds this priority. The small-request exemption is decided apart.
CREATE OR REPLACE FUNCTION lq_shed_floor(
    p_burst    bigint,
    p_above    double precision[],
    p_admit    smallint[],
    p_small    bigint[],
    p_priority smallint,
    p_cost     bigint
) RETURNS double precision
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$
    SELECT coalesce(max((1 - s.above) * p_burst), 0)
      FROM unnest(p_above, p_admit, p_small) AS s(above, admit, small)
     WHERE (s.admit >> p_priority) & 1 = 0              -- this step sheds the priority
       AND (s.small IS NULL OR p_cost >= s.small)       -- and the request is not small
$$;


-- The global shard a tenant's requests take: a hash of its name modulo the
-- shard count. Any spread is correct (the shards' bursts sum to the global
-- one and a short shard borrows); the hash only has to be the same for
-- every statement at one time, which hashtext is within a server version.
CREATE OR REPLACE FUNCTION lq_tenant_shard(p_tenant text, p_shards smallint)
RETURNS smallint
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$
    SELECT ((hashtext(p_tenant) & 2147483647) % p_shards)::smallint
$$;


-- A request's effective priority: its tenant's (its plan's), lowered by the
-- request if it asks for less, or set by it when an admin asked (p_any).
-- Ranks as domain/vocabulary.py stores them: low 0 .. critical 3, so a
-- request lowers its tenant's with least(). The fast path (3a) and step (5)
-- of lq_admit_decide both answer it.
CREATE OR REPLACE FUNCTION lq_priority(p_requested smallint, p_any boolean, p_tenants smallint)
RETURNS smallint
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$
    SELECT CASE WHEN p_requested IS NULL THEN p_tenants
                WHEN coalesce(p_any, false) THEN p_requested
                ELSE least(p_requested, p_tenants) END
$$;


-- The layers a batch touches, ceilings apart: the global layer (of a sharded
-- one, the shards of the batch's tenants, or all of them with p_all_shards),
-- each request's tenant layer and its route's when that has a policy. Index
-- probes on (scope, tenant, route, ceiling, shard), never a scan; a statement
-- of its own, whose ids the callers then lock (on Citus, cells, a SQL
-- function reading a table is refused inside another statement, and a query
-- on a table inside one that reads it too). Plus the layers of the requests' API
-- keys (p_key_ids: the key that asked, per request; NULL: none, or the admin),
-- probed by the key (a key without limits has no layer).
-- lq_admit_at_once (the fast path, 3a) locks this set, or more, by a WHERE
-- of its own, and lq_lock_layers (3) counts on that (it then waits for no
-- layer): a layer added here is added there.
-- p_key_ids was added (limits per API key): the old signature goes.
DROP FUNCTION IF EXISTS lq_batch_layers(text[], text[], boolean);
CREATE OR REPLACE FUNCTION lq_batch_layers(p_tenants text[], p_routes text[],
                                           p_all_shards boolean, p_key_ids bigint[])
RETURNS SETOF bigint
LANGUAGE plpgsql STABLE
AS $$
BEGIN
    RETURN QUERY
    SELECT g.layer_id FROM limit_layers AS g
     WHERE g.scope = 'global' AND g.tenant IS NULL AND g.route IS NULL AND g.ceiling IS NULL
       AND (g.shards = 1 OR p_all_shards
            OR g.shard = ANY (SELECT lq_tenant_shard(u.t, g.shards) FROM unnest(p_tenants) AS u(t)))
    UNION
    SELECT t.layer_id
      FROM unnest(p_tenants) AS u(t)
      JOIN limit_layers AS t
        ON t.scope = 'tenant' AND t.tenant = u.t AND t.route IS NULL AND t.ceiling IS NULL
    UNION
    SELECT r.layer_id
      FROM unnest(p_tenants, p_routes) AS u(t, r)
      JOIN limit_layers AS r
        ON r.scope = 'route' AND r.tenant = u.t AND r.route = u.r AND r.ceiling IS NULL
    UNION
    SELECT k.layer_id FROM limit_layers AS k
     WHERE k.api_key_id = ANY (p_key_ids) AND k.scope = 'key';
END
$$;


-- Decide a batch of admission requests, exactly as if they were applied one
-- by one in array order, and debit every layer of each admitted request.
--
-- The layers of a request: the global layer, its tenant's, its route's (when
-- it names one that has a policy), its API key's (p_key_ids: the key that
-- asked, when it has limits) and every provider ceiling whose models match the model. A
-- key layer's allowed_models also bound the fallbacks a default list offers. A ceiling with a shedding ladder also refuses a request
-- that would take it below its priority's floor (lq_shed_floor).
--
-- Weighted request cost: a call takes request_cost requests from every
-- request-rate limit it meets (0: none) and one permit from every
-- max_in_flight, or none when uses_concurrency is false: its route layer's,
-- else its tenant layer's, else 1 and true. A call that counts as more
-- requests than a layer's request_burst is too_large (limit_kind
-- 'requests'). The reservation journals both (request_cost, permits), and
-- lq_finish gives back exactly those.
--
-- Degradation: a request may come with fallback models (p_alt_*: explicit,
-- each with its own input count and output reserve), else its route's or its
-- tenant's (plan's) default list applies, with the requested model's input
-- count and output reserve. When
-- p_degrade is not false and the requested model is refused, each fallback
-- is tried in order against every layer it would touch, and the first that
-- fits is admitted: `model` names it, `degraded` is true, and limit_kind,
-- limit_scope, reason and ceiling describe the refusal the requested model
-- got. With p_degrade false, alt_models lists the fallbacks that would fit.
--
-- Deployments: a model may be served by several deployments (upstreams in
-- UPSTREAMS_FILE), and a provider ceiling may be scoped to one of them
-- (limit_layers.upstream). The caller names each candidate model's
-- deployments (p_up_*: request position, model, deployment, in its order,
-- and the routing rule), and each candidate model is then tried on each of
-- them in turn before the next model: a ceiling counts for a deployment when
-- its models match and its upstream is NULL or that deployment. The rule
-- 'least_utilized' tries first the deployment whose own (scoped) token
-- ceilings would have the most room left, as a share of their burst (none:
-- the most); 'order' (anything else) keeps the caller's order. A candidate
-- model with no deployment named is one candidate that every matching
-- ceiling bounds, scoped or not, as before scoping existed. `upstream`
-- names the deployment admitted, and the reservation journals it.
--
-- Serving path: each reservation journals how it came to be admitted
-- (reservations.serving_path), for the ledger row its settlement or expiry
-- writes (lq_finish): 'fallback_model' when a fallback was admitted,
-- 'second_deployment' when the requested model was admitted on a deployment
-- after the first it was tried on, else the caller's p_serving_paths ('queued': the request waited for room
-- first), else NULL (primary). Written in the journaling INSERT itself, so
-- it costs no statement of its own.
--
-- Priority: the tenant layer's (its plan's; normal without one). A request
-- may lower it (p_priorities); only with p_priority_any (an admin) may it
-- raise it.
--
-- status per request:
--   admitted             reserved; reservation_id and lease_expires_at are set
--   replayed             idempotency_key seen before with the same request_hash
--   idempotency_conflict idempotency_key seen before with another request
--   rate_limited         some layer lacks tokens, requests or permits, or a
--                        ceiling sheds this priority: limit_kind, limit_scope,
--                        reason ('capacity' or 'shed') and retry_after_ms name
--                        the longest wait; alt_max_tokens the largest
--                        max_tokens that would fit now
--   too_large            reserved tokens exceed some layer's token_burst (or its
--                        request_cost the request_burst, limit_kind 'requests'):
--                        it can never fit, and capacity names that burst
--   unknown_tenant       no such tenant
-- Nothing is debited unless every layer passes, and a refusal writes
-- nothing (6): a layer's refill is a function of the clock.
--
-- binding_* (the X-TokenLimit-* headers): the binding token layer's rate,
-- burst and balance after the decision: on a refusal the token layer that
-- refused the requested model (its burst too small, else the longest wait
-- for tokens), otherwise the token layer with the least left; a replay's is
-- its tenant layer (nothing was decided).
--
-- A sharded global layer (migration 0012): each request's global layer is its
-- tenant's shard, and only the batch's shards are locked. Without p_pool,
-- when some shard lacks room for the most its requests of this batch could
-- take (every candidate model counted at its largest), nothing is decided:
-- SQLSTATE LQ001 says so, and lq_admit decides again with p_pool, which locks
-- every shard; the fast path (3a) still debits each request's own shard when
-- every shard has room, and otherwise (5) pools them into one layer for the
-- batch (the exact loop, then the pooled balance is split back over the
-- shards by their burst). So a request is refused by the global layer only
-- when all shards together lack room, and the shards together never hold
-- more than the policy's burst.
DROP FUNCTION IF EXISTS lq_admit(text[], text[], text[], bigint[], bigint[], boolean[],
                                 integer[], text[], text[], integer);
-- The result gained quota, resets_at and credit_balance (a changed result
-- type needs the old function gone first).
-- p_output_reserve was added (learned output reservations).
DROP FUNCTION IF EXISTS lq_admit(text[], text[], text[], bigint[], bigint[], boolean[],
                                 integer[], text[], text[], integer, smallint[], boolean[],
                                 boolean[], integer[], text[], bigint[]);
-- p_reservation_ids was added (the worker names the ids, see lq_admit).
DROP FUNCTION IF EXISTS lq_admit_decide(text[], text[], text[], bigint[], bigint[], boolean[],
                                        integer[], text[], text[], integer, smallint[], boolean[],
                                        boolean[], integer[], text[], bigint[], bigint[], boolean);
-- p_key_ids was added (limits per API key), and the result gained the binding
-- token layer's figures (binding_*).
DROP FUNCTION IF EXISTS lq_admit_decide(text[], text[], text[], bigint[], bigint[], boolean[],
                                        integer[], text[], text[], integer, smallint[], boolean[],
                                        boolean[], integer[], text[], bigint[], bigint[], boolean,
                                        uuid[]);
-- p_alt_outputs (each explicit fallback's own output reserve; a caller
-- that does not send it reserves max_tokens for its fallbacks) and
-- p_serving_paths (the path each reservation journals) were added.
DROP FUNCTION IF EXISTS lq_admit_decide(text[], text[], text[], bigint[], bigint[], boolean[],
                                        integer[], text[], text[], integer, smallint[], boolean[],
                                        boolean[], integer[], text[], bigint[], bigint[], boolean,
                                        uuid[], bigint[]);
-- p_up_* (deployments) were added, and the result gained upstream.
DROP FUNCTION IF EXISTS lq_admit_decide(text[], text[], text[], bigint[], bigint[], boolean[],
                                        integer[], text[], text[], integer, smallint[], boolean[],
                                        boolean[], integer[], text[], bigint[], bigint[], boolean,
                                        uuid[], bigint[], bigint[], text[]);
-- The batch became one lq_admit_batch and the result lq_admit_result
-- (migration 0031): the positional signature goes.
DROP FUNCTION IF EXISTS lq_admit_decide(text[], text[], text[], bigint[], bigint[], boolean[],
                                        integer[], text[], text[], integer, smallint[], boolean[],
                                        boolean[], integer[], text[], bigint[], bigint[], boolean,
                                        uuid[], bigint[], bigint[], text[], integer[], text[],
                                        text[], text[]);
CREATE OR REPLACE FUNCTION lq_admit_decide(
    p_batch lq_admit_batch,  -- the requests, one array per field
    p_pool  boolean          -- lock every global shard and pool them
) RETURNS SETOF lq_admit_result
LANGUAGE plpgsql
-- Generic plans: each statement inside (and inside its steps) is planned once
-- per session and probes indexes whatever the batch size. (Custom plans were
-- re-planned on every call, and for a batch of many distinct tenants chose a
-- hash join over a sequential scan of limit_layers: twice the time of the
-- whole statement.)
SET plan_cache_mode = force_generic_plan
AS $$
DECLARE
    n          integer := coalesce(cardinality(p_batch.tenants), 0);
    now_ts     timestamptz;
    models     text[];               -- (2) every model a candidate may name
    ceilings   lq_model_ceiling[];   -- (2) and the ceilings each matches
    fast_held  boolean := false;     -- (3a) ran, did not fit, holds the batch's layers
    layers     lq_locked_layer[];    -- (3) the locked layers, in layer_id order; running
    refilled   lq_locked_layer[];    -- (4) as refilled, before pooling and debits
    layer_ids  bigint[];
    shards     smallint;             -- the global layer's shard count
    pooled     boolean;
    prepaid    boolean;              -- some tenant of the batch is prepaid
    requests   lq_admit_request[];
    has_quotas boolean;
    quotas     lq_quota_hold[];      -- (4b) with their running usage
    prices     lq_model_price[];
    credits    lq_credit_hold[];
    results    lq_admit_result[] := '{}';   -- per request, in order
    journal    reservations[] := '{}';      -- (7) the admitted ones' rows
    -- Idempotency keys admitted earlier in this batch ('tenant/key'), and by which request.
    b_key      text[] := '{}';
    b_ord      integer[] := '{}';
    -- Nothing written by this transaction before this statement: a batch that
    -- admits nothing may then commit without waiting for a WAL flush (6).
    fresh_xact boolean := pg_current_xact_id_if_assigned() IS NULL
                          AND transaction_timestamp() = statement_timestamp();
    -- (5) one request at a time
    rq         lq_admit_request;
    res        lq_admit_result;
    ten        lq_locked_layer;      -- its tenant layer
    layer      lq_locked_layer;
    prio       smallint;
    cands      lq_admit_candidate[];
    cand       lq_admit_candidate;
    own        integer[];            -- its own layers (global, tenant, route, key): places in `layers`
    at         integer[];            -- and a candidate's (its own and its ceilings')
    cost       bigint;
    cap        lq_capacity_verdict;
    bud        lq_budget_verdict;
    lease      integer;
    fits       text[];               -- fallbacks that would fit (not degrading)
    refused_at integer[];            -- the requested model's layers, refused,
    refused_j  integer;              -- and the token layer that refused it
    rs         reservations;
    k          integer;
    c          integer;
    j          integer;
    x          integer;
BEGIN
    IF n = 0 THEN
        RETURN;
    END IF;
    -- Every request names a model (the API and the library check it before).
    IF array_position(p_batch.models, NULL) IS NOT NULL THEN
        RAISE EXCEPTION 'request % names no model', array_position(p_batch.models, NULL)
              USING ERRCODE = '22004';
    END IF;

    -- (1) Serialize requests that share an idempotency key, so that the
    -- second one sees the first one's committed reservation below.
    IF cardinality(array_remove(p_batch.idempotency_keys, NULL)) > 0 THEN
        PERFORM lq_lock_idempotency_keys(p_batch.tenants, p_batch.idempotency_keys);
    END IF;

    -- (2) The candidate models and the ceilings they match. Without any
    -- ceiling there is nothing to find: skipped (a ceiling created meanwhile
    -- applies from the next statement on).
    IF EXISTS (SELECT 1 FROM limit_layers AS l WHERE l.scope = 'ceiling') THEN
        models := lq_batch_models(p_batch, NULL);
        ceilings := lq_model_ceilings(models);
    END IF;

    -- (3a) No ceiling, quota or idempotency key: the fast path, when it fits.
    has_quotas := EXISTS (SELECT 1 FROM quotas AS q WHERE q.tenant = ANY (p_batch.tenants));
    IF NOT has_quotas AND ceilings IS NULL
       AND coalesce(cardinality(array_remove(p_batch.idempotency_keys, NULL)), 0) = 0 THEN
        RETURN QUERY SELECT * FROM lq_admit_at_once(p_batch, p_pool);
        IF FOUND THEN
            RETURN;
        END IF;
        fast_held := true;
    END IF;

    -- (3) Lock every layer any request touches, in layer_id order (after
    -- the fast path, without waiting: see there).
    layers := lq_lock_layers(p_batch, p_pool, ceilings, NOT fast_held);

    -- (4) The clock, read once the locks are held, never before the latest
    -- refill, so elapsed time is never negative; every locked layer refilled
    -- to it. A sharded global layer decided pooled stands as its first row.
    SELECT greatest(clock_timestamp(), max(l.refilled_at)),
           max(l.shards) FILTER (WHERE l.scope = 'global'),
           coalesce(bool_or(l.prepaid), false),
           array_agg(l.layer_id)
      INTO now_ts, shards, prepaid, layer_ids
      FROM unnest(layers) AS l;
    layers := lq_refill_layers(layers, now_ts);
    refilled := layers;
    pooled := coalesce(p_pool AND shards > 1, false);
    IF pooled THEN
        layers := lq_pool_global(layers);
    END IF;
    requests := lq_admit_requests(p_batch, layers, pooled);
    IF shards > 1 AND NOT pooled THEN
        IF lq_shard_short(p_batch, layers, requests) THEN
            RAISE EXCEPTION USING ERRCODE = 'LQ001',
                  MESSAGE = 'a global shard lacks room for this batch: decide it pooled';
        END IF;
    END IF;

    -- (4b) Budgets beyond tokens, only for a batch that has any: quota
    -- windows, then prices, then prepaid balances (the lock order of
    -- quotas.sql, after the layers).
    IF has_quotas THEN
        quotas := lq_lock_quotas(p_batch.tenants, now_ts);
    END IF;
    IF (has_quotas OR prepaid) AND models IS NULL THEN
        models := lq_batch_models(p_batch, layers);
    END IF;
    IF has_quotas OR prepaid THEN
        prices := lq_model_prices(models, now_ts);
    END IF;
    IF prepaid THEN
        credits := lq_lock_credits(p_batch.tenants);
    END IF;

    -- (5) Decide each request in order against the running balances.
    FOR k IN 1 .. n LOOP
        rq := requests[k];
        res := NULL;
        res.ord := k;
        res.degraded := false;
        res.alt_models := '{}';
        <<decide>>
        BEGIN
            IF rq.tenant_at IS NULL THEN
                res.status := 'unknown_tenant';
                EXIT decide;
            END IF;
            ten := layers[rq.tenant_at];
            res.tenant_tokens_per_minute := ten.tokens_per_minute;
            res.tenant_token_burst := ten.token_burst;
            res.tenant_requests_per_minute := ten.requests_per_minute;
            res.tenant_request_burst := ten.request_burst;
            res.plan := ten.plan;
            res.model := rq.model;
            res.input_tokens := rq.input_tokens;
            prio := lq_priority(rq.priority, rq.priority_any, ten.priority);
            res.priority := prio;

            -- Idempotency: a key admitted before (committed, or earlier in
            -- this batch) decides nothing.
            IF rq.idempotency_key IS NOT NULL THEN
                j := b_ord[array_position(b_key, rq.tenant || '/' || rq.idempotency_key)];
                res := lq_replay(res, rq, ten, results[j], requests[j].request_hash);
                EXIT decide WHEN res.status IS NOT NULL;
            END IF;

            -- Each candidate in turn; the first that fits every layer and
            -- budget is admitted (a fallback only when degrading).
            own := array_remove(ARRAY[rq.global_at, rq.tenant_at, rq.route_at, rq.key_at], NULL);
            cands := lq_admit_candidates(p_batch, rq, layers, layer_ids, models, ceilings);
            fits := '{}';
            refused_j := NULL;
            FOR c IN 1 .. cardinality(cands) LOOP
                cand := cands[c];
                -- A fallback the request's key may not use is never tried (the
                -- requested model was checked before admission: 403).
                CONTINUE WHEN cand.fallback AND rq.key_at IS NOT NULL
                          AND layers[rq.key_at].allowed_models IS NOT NULL
                          AND NOT cand.model LIKE ANY (layers[rq.key_at].allowed_models);
                at := CASE WHEN ceilings IS NULL THEN own
                           ELSE lq_candidate_layers(own, cand, ceilings, layer_ids) END;
                -- The output reserved is the policy's estimate for this candidate
                -- (see admission/estimates.py), at most max_tokens; the reservation
                -- keeps max_tokens itself for lq_shared_charge_cap.
                cost := cand.input_tokens + coalesce(cand.output_reserve, rq.max_tokens);
                cap := lq_capacity_verdict(layers, at, cost, cand.input_tokens, rq.request_cost,
                                           rq.permits, prio, p_batch.concurrency_retry_ms);
                bud := NULL;
                IF cap.too_large_at IS NULL AND cap.too_many_at IS NULL AND cap.wait_ms < 0
                   AND (has_quotas OR ten.prepaid) THEN
                    bud := lq_budget_verdict(rq, cand, cost, ten.prepaid, quotas, prices, credits);
                END IF;

                IF cap.too_large_at IS NULL AND cap.too_many_at IS NULL AND cap.wait_ms < 0
                   AND bud.refusal IS NULL THEN
                    IF cand.fallback AND rq.degrade IS NOT DISTINCT FROM false THEN
                        -- Not degrading: only say that this fallback would fit now.
                        IF NOT cand.model = ANY (fits) THEN
                            fits := fits || cand.model;
                        END IF;
                        CONTINUE;
                    END IF;
                    -- Every layer and budget passes: debit them all, and journal it.
                    rs := NULL;
                    rs.layer_ids := '{}';
                    rs.policy_version := 0;
                    FOREACH j IN ARRAY at LOOP
                        layer := layers[j];
                        IF layer.tokens_per_minute IS NOT NULL THEN
                            layer.tokens := layer.tokens - cost;
                        END IF;
                        IF layer.requests_per_minute IS NOT NULL THEN
                            layer.requests := layer.requests - rq.request_cost;
                        END IF;
                        layer.in_flight := layer.in_flight + rq.permits;
                        layers[j] := layer;
                        rs.layer_ids := rs.layer_ids || layer.layer_id;
                        rs.policy_version := greatest(rs.policy_version, layer.policy_version);
                    END LOOP;
                    rs.quota_ids := '{}';
                    FOREACH x IN ARRAY coalesce(bud.quotas, '{}') LOOP
                        quotas[x].used_tokens := quotas[x].used_tokens + cost;
                        quotas[x].used_cost := quotas[x].used_cost + coalesce(bud.money, 0);
                        quotas[x].added_tokens := quotas[x].added_tokens + cost;
                        quotas[x].added_cost := quotas[x].added_cost + coalesce(bud.money, 0);
                        rs.quota_ids := rs.quota_ids || quotas[x].quota_id;
                    END LOOP;
                    rs.reserved_cost := bud.money;
                    IF ten.prepaid THEN
                        -- No credit account yet (never topped up): only a request
                        -- of cost 0 passes (available 0), and it holds nothing.
                        -- The hold is still recorded (0), so settlement charges
                        -- whatever the provider reports, creating the account.
                        FOR x IN 1 .. coalesce(cardinality(credits), 0) LOOP
                            IF credits[x].tenant = rq.tenant THEN
                                credits[x].available := credits[x].available - bud.money;
                                credits[x].added := credits[x].added + bud.money;
                            END IF;
                        END LOOP;
                        rs.credit_reserved := bud.money;
                    END IF;
                    IF NOT cand.fallback AND c > 1 THEN
                        -- the requested model, admitted: no refusal to report
                        res := lq_without_refusal(res);
                    END IF;
                    res.status := 'admitted';
                    res.reservation_id := coalesce(rq.reservation_id, gen_random_uuid());
                    res.reserved_tokens := cost;
                    res.lease_generation := 1;
                    res.model := cand.model;
                    res.input_tokens := cand.input_tokens;
                    res.degraded := cand.fallback;
                    res.upstream := cand.upstream;
                    lease := coalesce(rq.lease_seconds,
                                      layers[coalesce(rq.route_at, rq.tenant_at)].lease_seconds);
                    res.lease_expires_at := now_ts + make_interval(secs => lease);
                    rs := lq_journal_row(rs, rq, res, now_ts, lease,
                                         CASE WHEN cand.fallback THEN 'fallback_model'
                                              WHEN c > 1 AND cand.upstream IS NOT NULL
                                                   AND p_batch.up_rules[rq.up_from]
                                                       IS DISTINCT FROM 'least_utilized'
                                              THEN 'second_deployment'
                                              ELSE rq.serving_path END);
                    journal[cardinality(journal) + 1] := rs;
                    IF rq.idempotency_key IS NOT NULL THEN
                        b_key := b_key || (rq.tenant || '/' || rq.idempotency_key);
                        b_ord := b_ord || k;
                    END IF;
                    EXIT;
                ELSIF c = 1 OR (NOT cand.fallback AND res.status = 'too_large'
                                AND cap.too_large_at IS NULL AND cap.too_many_at IS NULL) THEN
                    -- The requested model's refusal: what a 429 (or a degraded 201)
                    -- says. On several deployments, its first's, unless that one
                    -- can never fit it and another only lacks room now.
                    refused_at := at;
                    refused_j := coalesce(cap.too_large_at, cap.token_wait_at);
                    res := lq_refusal(res, cost, rq.max_tokens, cap, bud, layers, quotas, now_ts);
                END IF;
            END LOOP;
            res.alt_models := fits;
            IF res.status <> 'admitted' THEN
                at := refused_at;   -- remaining: the requested model's layers
            END IF;

            res := lq_remaining(res, layers, at, rq.tenant_at,
                                CASE WHEN res.status <> 'admitted' THEN refused_j END);
        END decide;
        results[k] := res;
    END LOOP;

    -- (6) Persist the layers the batch changed (pooled: the balance split
    -- back over the shards first). A batch that admits nothing, in a
    -- transaction of its own, writes nothing and commits without waiting
    -- for the WAL flush (there is nothing to lose).
    IF pooled THEN
        layers := lq_unpool_global(layers, refilled);
    END IF;
    PERFORM lq_persist_layers(layers, refilled, now_ts);
    IF fresh_xact AND cardinality(journal) = 0 THEN
        PERFORM set_config('synchronous_commit', 'off', true);
    END IF;

    -- (6b) What the batch reserved on each quota window and prepaid balance,
    -- in the lock order of (4b); each crossing of an alert threshold fires
    -- in this transaction (see quotas.sql).
    FOR x IN 1 .. coalesce(cardinality(quotas), 0) LOOP
        IF quotas[x].added_tokens <> 0 OR quotas[x].added_cost <> 0 THEN
            PERFORM lq_quota_apply(quotas[x].quota_id, now_ts, quotas[x].added_tokens, 0,
                                   quotas[x].added_cost, 0);
        END IF;
    END LOOP;
    FOR x IN 1 .. coalesce(cardinality(credits), 0) LOOP
        IF credits[x].added <> 0 THEN
            PERFORM lq_credit_apply(credits[x].tenant, NULL, credits[x].added, NULL);
        END IF;
    END LOOP;

    -- (7) Journal the admitted reservations, so a dead worker's can be swept.
    INSERT INTO reservations SELECT * FROM unnest(journal);

    RETURN QUERY SELECT * FROM unnest(results);
END
$$;


-- (3a) The fast path, one statement: when no request of the batch touches a
-- provider ceiling or a quota and none has an idempotency key (fallbacks do
-- not matter: where every request fits, each is admitted as asked, as (5)
-- would), this statement locks the batch's layers (every global shard with
-- p_pool; in layer_id order), refills them to one clock read once all are
-- locked, and, when every tenant is known, none is prepaid, no locked layer
-- weighs its calls (request_cost, uses_concurrency: every call here is one
-- request and one permit, the journal's defaults) and every layer has room
-- for everything the batch asks of it, admits every request in order, as the
-- one-by-one decision of (5) would. Each request's figures are then running
-- sums per layer (a window over the requests in array order), so debiting the
-- layers, journaling the reservations and answering need no loop. `fits`
-- checks exactly the conditions of (5) (too large, tokens, requests,
-- permits) against those running sums; when any fails, nothing here writes
-- or returns, the locks stay held, and lq_admit_decide's (3) onwards decides
-- (never waiting for a lock again: see lq_lock_layers). The property test of
-- batched == one by one covers both paths.
-- This statement locks the set lq_batch_layers names, or more, by a WHERE of
-- its own, and lq_lock_layers counts on that: a layer added there is added
-- here.
CREATE OR REPLACE FUNCTION lq_admit_at_once(p_batch lq_admit_batch, p_pool boolean)
RETURNS SETOF lq_admit_result
LANGUAGE plpgsql
AS $$
DECLARE
    -- The batch's fields, by the names the statement uses (p_batch.x reads
    -- the composite again on every use; a local array is read in place).
    p_tenants          text[] := p_batch.tenants;
    p_routes           text[] := p_batch.routes;
    p_models           text[] := p_batch.models;
    p_input_tokens     bigint[] := p_batch.input_tokens;
    p_max_tokens       bigint[] := p_batch.max_tokens;
    p_input_estimated  boolean[] := p_batch.input_estimated;
    p_lease_seconds    integer[] := p_batch.lease_seconds;
    p_request_hashes   text[] := p_batch.request_hashes;
    p_priorities       smallint[] := p_batch.priorities;
    p_priority_any     boolean[] := p_batch.priority_any;
    p_output_reserve   bigint[] := p_batch.output_reserve;
    p_reservation_ids  uuid[] := p_batch.reservation_ids;
    p_key_ids          bigint[] := p_batch.key_ids;
    p_serving_paths    text[] := p_batch.serving_paths;
    p_up_ord           integer[] := p_batch.up_ord;
    p_up_models        text[] := p_batch.up_models;
    p_up_names         text[] := p_batch.up_names;
    n                  integer := coalesce(cardinality(p_tenants), 0);
    -- as in lq_capacity_verdict
    epsilon            constant double precision := 1e-6;
BEGIN
    RETURN QUERY
    WITH locked AS MATERIALIZED (
        SELECT ll.layer_id, ll.scope, ll.tenant, ll.route, ll.shard, ll.shards,
               ll.tokens_per_minute AS tpm, ll.token_burst AS tburst,
               ll.requests_per_minute AS rpm, ll.request_burst AS rburst,
               ll.max_in_flight AS max_if, ll.lease_seconds AS lease,
               ll.policy_version AS version, ll.tokens, ll.requests, ll.in_flight,
               ll.refilled_at, ll.priority, ll.plan, ll.prepaid, ll.api_key_id,
               ll.request_cost, ll.uses_concurrency
          FROM limit_layers AS ll
         -- one bitmap of index scans on the layer key: the global rows (of
         -- a sharded layer, the batch's shards), the batch's tenants, and
         -- the routes named (a route of a batch tenant named by another
         -- request is locked too, and only refilled)
         WHERE ll.ceiling IS NULL
           AND ((ll.scope = 'global' AND ll.tenant IS NULL AND ll.route IS NULL
                 AND (ll.shards = 1 OR p_pool
                      OR ll.shard = ANY (SELECT lq_tenant_shard(u.t, ll.shards)
                                           FROM unnest(p_tenants) AS u(t))))
                OR (ll.scope = 'tenant' AND ll.tenant = ANY (p_tenants) AND ll.route IS NULL)
                OR (ll.scope = 'route' AND ll.tenant = ANY (p_tenants)
                    AND ll.route = ANY (p_routes))
                OR (ll.api_key_id = ANY (p_key_ids) AND ll.scope = 'key'))
         ORDER BY ll.layer_id
           FOR UPDATE
    ), clock AS (
        -- read once every row is locked (the aggregate consumes them all)
        SELECT greatest(clock_timestamp(), max(l.refilled_at)) AS ts,
               coalesce(bool_or(l.prepaid), false) AS prepaid,
               -- a weighted call (request_cost, uses_concurrency) is left to (5)
               coalesce(bool_or(l.request_cost IS NOT NULL OR l.uses_concurrency IS NOT NULL),
                        false) AS weighted
          FROM locked AS l
    ), layer AS (
        SELECT l.*, c.ts,
               lq_refilled(l.tokens, l.tpm, l.tburst, l.refilled_at, c.ts) AS tokens_now,
               lq_refilled(l.requests, l.rpm, l.rburst, l.refilled_at, c.ts) AS requests_now
          FROM locked AS l, clock AS c
    ), req AS (
        SELECT u.o::integer AS k, u.t, u.r, u.inp + coalesce(u.res, u.mx) AS cost
          FROM unnest(p_tenants, p_routes, p_input_tokens, p_max_tokens, p_output_reserve)
               WITH ORDINALITY AS u(t, r, inp, mx, res, o)
    ), ups AS (
        -- the deployment each request goes to: the first named for its
        -- model (no ceiling here to choose by)
        SELECT d.o AS k, (array_agg(d.name ORDER BY d.i))[1] AS name
          FROM unnest(p_up_ord, p_up_models, p_up_names) WITH ORDINALITY AS d(o, m, name, i)
         WHERE d.m = p_models[d.o]
         GROUP BY d.o
    ), pairs AS (
        -- each request with each of its layers: pos 1 global, 2 tenant, 3 route,
        -- 4 its key's
        SELECT q.k, q.cost, 1 AS pos, l.layer_id
          FROM req AS q JOIN layer AS l
            ON l.scope = 'global' AND l.shard = lq_tenant_shard(q.t, l.shards)
        UNION ALL
        SELECT q.k, q.cost, 2, l.layer_id
          FROM req AS q JOIN layer AS l ON l.scope = 'tenant' AND l.tenant = q.t
        UNION ALL
        SELECT q.k, q.cost, 3, l.layer_id
          FROM req AS q JOIN layer AS l
            ON l.scope = 'route' AND l.tenant = q.t AND l.route = q.r
        UNION ALL
        SELECT q.k, q.cost, 4, l.layer_id
          FROM req AS q JOIN layer AS l
            ON l.scope = 'key' AND l.api_key_id = p_key_ids[q.k]
    ), running AS (
        SELECT p.k, p.pos, p.cost, l.layer_id, l.tpm, l.tburst, l.rpm, l.rburst, l.max_if,
               l.lease, l.version, l.in_flight, l.priority, l.plan, l.ts, l.tokens_now,
               l.requests_now, sum(p.cost) OVER w AS tok_used, count(*) OVER w AS req_used
          FROM pairs AS p JOIN layer AS l USING (layer_id)
        WINDOW w AS (PARTITION BY p.layer_id ORDER BY p.k)
    ), fits AS (
        SELECT coalesce(bool_and(
                   (r.tpm IS NULL
                    OR (r.cost <= r.tburst AND r.tokens_now - r.tok_used + epsilon >= 0))
                   AND (r.rpm IS NULL OR r.requests_now - r.req_used + epsilon >= 0)
                   AND (r.max_if IS NULL OR r.in_flight + r.req_used <= r.max_if)), false)
               AND count(*) FILTER (WHERE r.pos = 2) = n   -- every tenant known
               -- every request has its global shard, unless there is no global
               -- layer (a shard count changed meanwhile leaves one unlocked)
               AND (count(*) FILTER (WHERE r.pos = 1) = n
                    OR NOT EXISTS (SELECT 1 FROM limit_layers AS g WHERE g.scope = 'global'))
               AND NOT (SELECT c.prepaid OR c.weighted FROM clock AS c) AS ok
          FROM running AS r
    ), decided AS (
        SELECT r.k, min(r.cost) AS cost, min(r.ts) AS ts,
               coalesce(p_reservation_ids[r.k], gen_random_uuid()) AS id,
               coalesce(p_lease_seconds[r.k], min(r.lease) FILTER (WHERE r.pos = 3),
                        min(r.lease) FILTER (WHERE r.pos = 2)) AS lease,
               array_agg(r.layer_id ORDER BY r.pos) AS ids,
               max(r.version) AS version,
               min(r.tokens_now - r.tok_used) AS rem_tok,
               min(r.requests_now - r.req_used) AS rem_req,
               min(r.max_if - r.in_flight - r.req_used) AS rem_if,
               min(r.tpm) FILTER (WHERE r.pos = 2) AS t_tpm,
               min(r.tburst) FILTER (WHERE r.pos = 2) AS t_tburst,
               min(r.tokens_now - r.tok_used) FILTER (WHERE r.pos = 2) AS t_tokens,
               min(r.rpm) FILTER (WHERE r.pos = 2) AS t_rpm,
               min(r.rburst) FILTER (WHERE r.pos = 2) AS t_rburst,
               min(r.requests_now - r.req_used) FILTER (WHERE r.pos = 2) AS t_requests,
               min(r.priority) FILTER (WHERE r.pos = 2) AS t_priority,
               min(r.plan) FILTER (WHERE r.pos = 2) AS t_plan,
               -- the binding token layer: the least left, the first in
               -- layer order on a tie, as (5) finds it
               (array_agg(r.tpm ORDER BY r.tokens_now - r.tok_used, r.pos)
                    FILTER (WHERE r.tpm IS NOT NULL))[1] AS b_tpm,
               (array_agg(r.tburst ORDER BY r.tokens_now - r.tok_used, r.pos)
                    FILTER (WHERE r.tpm IS NOT NULL))[1] AS b_tburst,
               min(r.tokens_now - r.tok_used) FILTER (WHERE r.tpm IS NOT NULL) AS b_tokens
          FROM running AS r, fits
         WHERE fits.ok
         GROUP BY r.k
    ), debited AS (
        -- every locked layer: its refill state, less what the batch takes
        UPDATE limit_layers AS ll
           SET tokens = l.tokens_now - CASE WHEN l.tpm IS NULL THEN 0
                                            ELSE coalesce(d.tokens, 0) END,
               requests = l.requests_now - CASE WHEN l.rpm IS NULL THEN 0
                                                ELSE coalesce(d.requests, 0) END,
               in_flight = l.in_flight + coalesce(d.requests, 0)::integer,
               refilled_at = l.ts
          FROM fits, layer AS l
               LEFT JOIN (SELECT p.layer_id, sum(p.cost) AS tokens, count(*) AS requests
                            FROM pairs AS p GROUP BY p.layer_id) AS d USING (layer_id)
         -- by key, not by the locked version's ctid: that version may be
         -- newer than this statement's snapshot (committed while we waited
         -- for its lock), and the UPDATE finds it from the visible one
         WHERE fits.ok AND ll.layer_id = l.layer_id
    ), journal AS (
        -- the requested model only (this path never degrades): its
        -- serving path is the caller's (queued), NULL for primary
        INSERT INTO reservations (reservation_id, tenant, route, model, layer_ids,
                                  input_tokens, input_estimated, max_tokens, reserved_tokens,
                                  policy_version, created_at, lease_seconds, lease_expires_at,
                                  idempotency_key, request_hash, serving_path, upstream)
        SELECT d.id, p_tenants[d.k], p_routes[d.k], p_models[d.k], d.ids,
               p_input_tokens[d.k], p_input_estimated[d.k], p_max_tokens[d.k], d.cost,
               d.version, d.ts, d.lease, d.ts + make_interval(secs => d.lease),
               NULL, p_request_hashes[d.k], p_serving_paths[d.k], u.name
          FROM decided AS d LEFT JOIN ups AS u USING (k)
    )
    SELECT d.k, 'admitted'::text, d.id, d.cost, d.ts + make_interval(secs => d.lease), 1,
           NULL::text, NULL::text, NULL::bigint, NULL::bigint,
           floor(d.rem_tok)::bigint, floor(d.rem_req)::bigint, d.rem_if::integer,
           d.t_tpm, d.t_tburst, d.t_tokens, d.t_rpm, d.t_rburst, d.t_requests,
           p_models[d.k], p_input_tokens[d.k], false, NULL::text, NULL::text,
           NULL::double precision,
           lq_priority(p_priorities[d.k], p_priority_any[d.k], d.t_priority),
           d.t_plan, NULL::bigint, '{}'::text[], NULL::text, NULL::timestamptz,
           NULL::text, NULL::numeric, d.b_tpm, d.b_tburst, d.b_tokens, u.name
      FROM decided AS d LEFT JOIN ups AS u USING (k)
     ORDER BY d.k;
END
$$;


-- lq_admit_decide's steps (above, in the order it takes them), each a
-- function over the rows of migration 0032's types. They run inside its one
-- statement, with its plan_cache_mode, and lock only what their comment
-- says. PL/pgSQL, so that each statement inside is planned once per session
-- (a SQL function with a query is planned again on every call before 18).

-- (2) Every model a candidate of the batch may name: requested, explicit
-- fallbacks, and the default lists of the batch's tenants and routes. Those
-- lists are policy, read here without a lock; a default model added after
-- this read is not tried in this statement (lq_admit_candidates skips it),
-- so the ceilings locked for these models cover every candidate tried.
-- p_layers: the locked layers to read the default lists from; NULL: read
-- them from the table (before the locks).
CREATE OR REPLACE FUNCTION lq_batch_models(p_batch lq_admit_batch, p_layers lq_locked_layer[])
RETURNS text[]
LANGUAGE plpgsql STABLE
AS $$
BEGIN
    IF p_layers IS NOT NULL THEN
        RETURN (SELECT array_agg(DISTINCT x.m)
                  FROM (SELECT unnest(p_batch.models)
                        UNION ALL
                        SELECT unnest(p_batch.alt_models)
                        UNION ALL
                        SELECT unnest(l.fallback_models) FROM unnest(p_layers) AS l) AS x(m)
                 WHERE x.m IS NOT NULL);
    END IF;
    RETURN (SELECT array_agg(DISTINCT m.model)
              FROM (SELECT unnest(p_batch.models) AS model
                    UNION ALL
                    SELECT unnest(p_batch.alt_models)
                    UNION ALL
                    SELECT unnest(d.fallback_models)
                      FROM unnest(p_batch.tenants, p_batch.routes) AS u(t, r)
                      JOIN limit_layers AS d
                        ON d.scope IN ('tenant', 'route') AND d.tenant = u.t
                       AND d.route IS NOT DISTINCT FROM (CASE WHEN d.scope = 'route' THEN u.r END)
                       AND d.ceiling IS NULL) AS m
             WHERE m.model IS NOT NULL);
END
$$;

-- (2) The provider ceilings each of those models matches, in layer_id order
-- (ceilings are few: a scan of the partial index over them).
CREATE OR REPLACE FUNCTION lq_model_ceilings(p_models text[])
RETURNS lq_model_ceiling[]
LANGUAGE plpgsql STABLE
AS $$
BEGIN
    RETURN (SELECT array_agg(ROW(m.model, c.layer_id, c.upstream)::lq_model_ceiling
                             ORDER BY c.layer_id)
              FROM limit_layers AS c
              JOIN unnest(p_models) AS m(model) ON m.model LIKE ANY (c.model_patterns)
             WHERE c.scope = 'ceiling');
END
$$;

-- (3) A limit_layers row as the decision keeps it.
CREATE OR REPLACE FUNCTION lq_locked_layer_of(x limit_layers)
RETURNS lq_locked_layer
LANGUAGE sql IMMUTABLE
AS $$
    SELECT ROW(x.layer_id,
               CASE x.scope WHEN 'global' THEN 'g/' || x.shard
                            WHEN 'tenant' THEN 't/' || x.tenant
                            WHEN 'ceiling' THEN 'c/' || x.ceiling
                            WHEN 'key' THEN 'k/' || x.api_key_id
                            ELSE 'r/' || x.tenant || '/' || x.route END,
               x.scope, x.ceiling, x.tokens_per_minute, x.token_burst, x.requests_per_minute,
               x.request_burst, x.max_in_flight, x.lease_seconds, x.policy_version, x.tokens,
               x.requests, x.in_flight, x.refilled_at, x.shards, x.priority, x.plan,
               x.fallback_models, x.allowed_models,
               CASE WHEN x.scope = 'ceiling' THEN x.shed_above END,
               CASE WHEN x.scope = 'ceiling' THEN x.shed_admit END,
               CASE WHEN x.scope = 'ceiling' THEN x.shed_small END,
               x.prepaid, x.request_cost, x.uses_concurrency)::lq_locked_layer
$$;

-- (3) Lock every layer any request of the batch touches (lq_batch_layers,
-- and the ceilings of its models), in layer_id order. FOR UPDATE re-reads a
-- row changed by a transaction we waited for, so the balances are the
-- latest committed ones. The ids are read first, in a statement of their
-- own (lq_batch_layers says why); a layer committed between that read and
-- the lock is not locked, as one committed after the read would not be.
--
-- p_wait false (after the fast path): SKIP LOCKED, never waiting. That path
-- did not fit and still holds its layers, and the snapshot the ids are read
-- in is newer than its: a layer committed in between (a new tenant, route or key
-- layer, the global shard a new shard count gives a tenant, a layer whose
-- layer_id was drawn before another's but committed after it) may sort below
-- one it holds. Waiting for that layer would wait for a lower layer_id while
-- holding a higher one, out of the order above, and a transaction locking in
-- order could deadlock with this one (PostgreSQL fails one of them). Not
-- waiting loses nothing the fast path saw: it locked every layer of this set
-- that its snapshot saw (the set, lq_batch_layers', is within its WHERE,
-- whose routes are a superset; and it runs only without ceilings), and a
-- lock of our own never blocks us. A layer it did not see is locked if free;
-- one another transaction holds is left out, and the batch is decided as if
-- that layer had been created just after it (it was committed after the
-- batch began; linearizable, the batch first): a tenant's layer left out
-- makes its requests unknown_tenant, a route or key layer left out does not
-- bind, and a global shard left out is not counted (unpooled, its requests
-- lack their shard: LQ001, and lq_admit decides again pooled once the
-- subtransaction's rollback released these locks; pooled, the batch pools
-- the shards it holds). A lock taken without waiting cannot close a cycle.
-- Written twice, so that no path pays for it: releasing the fast path's
-- locks to lock again in order would need a subtransaction around it on
-- every call; one statement with both lock modes (a UNION ALL) costs each
-- call starting both. (tests/unit/test_lock_order_sql.py keeps the two
-- alike.) Each row is rebuilt as a limit_layers value rather than taken
-- whole: on Citus (cells) the statement runs on the shard's table, whose
-- row type is the shard's own.
CREATE OR REPLACE FUNCTION lq_lock_layers(p_batch lq_admit_batch, p_pool boolean,
                                          p_ceilings lq_model_ceiling[], p_wait boolean)
RETURNS lq_locked_layer[]
LANGUAGE plpgsql
AS $$
DECLARE
    ids bigint[] := ARRAY(SELECT b.layer_id
                            FROM lq_batch_layers(p_batch.tenants, p_batch.routes, p_pool,
                                                 p_batch.key_ids) AS b(layer_id)
                          UNION
                          SELECT c.layer_id FROM unnest(p_ceilings) AS c);
BEGIN
    IF p_wait THEN
    RETURN (SELECT array_agg(lq_locked_layer_of(x.row))
              FROM (SELECT ROW(ll.*)::limit_layers AS row
                      FROM limit_layers AS ll
                     WHERE ll.layer_id = ANY (ids)
                     ORDER BY ll.layer_id
                       FOR UPDATE) AS x);
    ELSE
    RETURN (SELECT array_agg(lq_locked_layer_of(x.row))
              FROM (SELECT ROW(ll.*)::limit_layers AS row
                      FROM limit_layers AS ll
                     WHERE ll.layer_id = ANY (ids)
                     ORDER BY ll.layer_id
                       FOR UPDATE SKIP LOCKED) AS x);
    END IF;
END
$$;

-- (4) Every locked layer refilled to the statement's clock reading.
CREATE OR REPLACE FUNCTION lq_refill_layers(p_layers lq_locked_layer[], p_now timestamptz)
RETURNS lq_locked_layer[]
LANGUAGE plpgsql IMMUTABLE
AS $$
DECLARE
    j integer;
    l lq_locked_layer;
BEGIN
    FOR j IN 1 .. coalesce(cardinality(p_layers), 0) LOOP
        l := p_layers[j];
        l.tokens := lq_refilled(l.tokens, l.tokens_per_minute, l.token_burst, l.refilled_at, p_now);
        l.requests := lq_refilled(l.requests, l.requests_per_minute, l.request_burst,
                                  l.refilled_at, p_now);
        p_layers[j] := l;
    END LOOP;
    RETURN p_layers;
END
$$;

-- (4) A sharded global layer pooled (lq_admit decided it again with every
-- shard locked): the first of its locked rows stands for all of them, with
-- their figures summed; lq_unpool_global splits them back.
CREATE OR REPLACE FUNCTION lq_pool_global(p_layers lq_locked_layer[])
RETURNS lq_locked_layer[]
LANGUAGE plpgsql IMMUTABLE
AS $$
DECLARE
    gi integer;
    j  integer;
    g  lq_locked_layer;
BEGIN
    FOR j IN 1 .. cardinality(p_layers) LOOP
        CONTINUE WHEN p_layers[j].scope <> 'global';
        IF gi IS NULL THEN
            gi := j;
            g := p_layers[j];
            CONTINUE;
        END IF;
        g.tokens := g.tokens + p_layers[j].tokens;
        g.tokens_per_minute := g.tokens_per_minute + p_layers[j].tokens_per_minute;
        g.token_burst := g.token_burst + p_layers[j].token_burst;
        g.requests := g.requests + p_layers[j].requests;
        g.requests_per_minute := g.requests_per_minute + p_layers[j].requests_per_minute;
        g.request_burst := g.request_burst + p_layers[j].request_burst;
        g.max_in_flight := g.max_in_flight + p_layers[j].max_in_flight;
        g.in_flight := g.in_flight + p_layers[j].in_flight;
    END LOOP;
    p_layers[gi] := g;
    RETURN p_layers;
END
$$;

-- (6) The pooled global balance back to the shards (p_unpooled: the layers
-- before pooling), in proportion to each one's own burst and never above
-- it. The first row keeps its own permits and the batch's, which its id
-- journals.
CREATE OR REPLACE FUNCTION lq_unpool_global(p_layers lq_locked_layer[],
                                            p_unpooled lq_locked_layer[])
RETURNS lq_locked_layer[]
LANGUAGE plpgsql IMMUTABLE
AS $$
DECLARE
    gi integer;
    j  integer;
    g  lq_locked_layer;
    others integer := 0;
BEGIN
    FOR j IN 1 .. cardinality(p_layers) LOOP
        CONTINUE WHEN p_layers[j].scope <> 'global';
        IF gi IS NULL THEN
            gi := j;
            g := p_layers[j];
        END IF;
        p_layers[j].tokens := least(p_unpooled[j].token_burst,
                                    g.tokens * p_unpooled[j].token_burst / g.token_burst);
        p_layers[j].requests := least(p_unpooled[j].request_burst,
                                      g.requests * p_unpooled[j].request_burst / g.request_burst);
        IF j <> gi THEN
            others := others + p_unpooled[j].in_flight;
        END IF;
    END LOOP;
    p_layers[gi].in_flight := g.in_flight - others;
    RETURN p_layers;
END
$$;

-- (4) The batch's requests, each with the places of its global (shard, or
-- the pooled first row), tenant, route and key layer among the locked ones,
-- what it counts as (its route's request_cost and uses_concurrency, else its
-- tenant's, else one request and one permit), and where its explicit
-- fallbacks and deployments are in the batch's arrays (grouped by request).
CREATE OR REPLACE FUNCTION lq_admit_requests(p_batch lq_admit_batch, p_layers lq_locked_layer[],
                                             p_pooled boolean)
RETURNS lq_admit_request[]
LANGUAGE plpgsql STABLE
AS $$
DECLARE
    keys   text[] := ARRAY(SELECT l.key FROM unnest(p_layers) AS l);
    -- (scalar arrays: a subscript of an array of rows in a query reads it
    -- from the start)
    rcost  integer[] := ARRAY(SELECT l.request_cost FROM unnest(p_layers) AS l);
    uconc  boolean[] := ARRAY(SELECT l.uses_concurrency FROM unnest(p_layers) AS l);
    shards smallint := (SELECT max(l.shards) FROM unnest(p_layers) AS l WHERE l.scope = 'global');
    gi     integer;
BEGIN
    IF p_pooled THEN
        gi := (SELECT min(l.ordinality) FROM unnest(p_layers) WITH ORDINALITY AS l
                WHERE l.scope = 'global');
    ELSIF coalesce(shards, 1) = 1 THEN
        gi := array_position(keys, 'g/0');
    END IF;
    RETURN (
        SELECT array_agg(ROW(u.o, u.t, u.r, u.m, u.inp, u.mx, u.res, u.est, u.lease, u.idem,
                             u.hash, u.prio, u.prio_any, u.degrade, u.rid, u.kid, u.path,
                             p.gi, p.ti, p.ri, p.ki,
                             coalesce(rcost[p.ri], rcost[p.ti], 1),
                             CASE WHEN coalesce(uconc[p.ri], uconc[p.ti], true) THEN 1 ELSE 0 END,
                             a.first, coalesce(a.count, 0), d.first, coalesce(d.count, 0)
                             )::lq_admit_request ORDER BY u.o)
          FROM unnest(p_batch.tenants, p_batch.routes, p_batch.models, p_batch.input_tokens,
                      p_batch.max_tokens, p_batch.output_reserve, p_batch.input_estimated,
                      p_batch.lease_seconds, p_batch.idempotency_keys, p_batch.request_hashes,
                      p_batch.priorities, p_batch.priority_any, p_batch.degrade,
                      p_batch.reservation_ids, p_batch.key_ids, p_batch.serving_paths)
               WITH ORDINALITY AS u(t, r, m, inp, mx, res, est, lease, idem, hash, prio,
                                    prio_any, degrade, rid, kid, path, o)
         CROSS JOIN LATERAL (
               SELECT CASE WHEN shards > 1 AND NOT p_pooled
                           THEN array_position(keys, 'g/' || lq_tenant_shard(u.t, shards))
                           ELSE gi END AS gi,
                      array_position(keys, 't/' || u.t) AS ti,
                      CASE WHEN u.r IS NOT NULL
                           THEN array_position(keys, 'r/' || u.t || '/' || u.r) END AS ri,
                      CASE WHEN u.kid IS NOT NULL
                           THEN array_position(keys, 'k/' || u.kid) END AS ki) AS p
          LEFT JOIN (SELECT f.o, min(f.i)::integer AS first, count(*)::integer AS count
                       FROM unnest(p_batch.alt_ord) WITH ORDINALITY AS f(o, i)
                      GROUP BY f.o) AS a ON a.o = u.o
          LEFT JOIN (SELECT f.o, min(f.i)::integer AS first, count(*)::integer AS count
                       FROM unnest(p_batch.up_ord) WITH ORDINALITY AS f(o, i)
                      GROUP BY f.o) AS d ON d.o = u.o);
END
$$;

-- (4) Sharded, not pooled: whether some global shard lacks room for the
-- most its requests could take (each at its largest candidate). Then
-- nothing is decided and lq_admit decides again, pooled. A shard not locked
-- (the shard count changed under this statement) counts as lacking.
CREATE OR REPLACE FUNCTION lq_shard_short(p_batch lq_admit_batch, p_layers lq_locked_layer[],
                                          p_requests lq_admit_request[])
RETURNS boolean
LANGUAGE plpgsql STABLE
AS $$
DECLARE
    epsilon constant double precision := 1e-6;
BEGIN
    RETURN EXISTS (
        SELECT 1
          FROM (SELECT q.global_at AS gi, sum(q.cost) AS tokens, sum(q.request_cost) AS requests,
                       sum(q.permits) AS permits, max(q.cost) AS largest
                  FROM (SELECT v.global_at, v.request_cost, v.permits,
                               greatest(v.input_tokens + coalesce(v.output_reserve, v.max_tokens),
                                        a.cost) AS cost
                          FROM unnest(p_requests) AS v
                          LEFT JOIN (SELECT w.o,
                                            max(w.inp + coalesce(w.res, p_batch.max_tokens[w.o]))
                                                AS cost
                                       FROM unnest(p_batch.alt_ord, p_batch.alt_inputs,
                                                   p_batch.alt_outputs) AS w(o, inp, res)
                                      GROUP BY w.o) AS a ON a.o = v.ord
                         WHERE v.tenant_at IS NOT NULL) AS q
                 GROUP BY q.global_at) AS d
          LEFT JOIN LATERAL (SELECT (p_layers[d.gi]).*) AS g ON true
         WHERE d.gi IS NULL
            OR (g.tokens_per_minute IS NOT NULL
                AND (d.largest > g.token_burst OR g.tokens + epsilon < d.tokens))
            OR (g.requests_per_minute IS NOT NULL AND g.requests + epsilon < d.requests)
            OR (g.max_in_flight IS NOT NULL AND g.in_flight + d.permits > g.max_in_flight));
END
$$;

-- (4b) The calendar quotas of the batch's tenants, read FOR SHARE (a quota
-- deleted meanwhile is simply not there), their current windows created if
-- new and locked, in quota_id order: the lock order of quotas.sql, after
-- the layers. Each with its running usage (reserved + charged).
CREATE OR REPLACE FUNCTION lq_lock_quotas(p_tenants text[], p_now timestamptz)
RETURNS lq_quota_hold[]
LANGUAGE plpgsql
AS $$
DECLARE
    qid bigint;
BEGIN
    FOR qid IN SELECT q.quota_id FROM quotas AS q
                WHERE q.tenant = ANY (p_tenants)
                ORDER BY q.quota_id
                  FOR SHARE LOOP
        PERFORM lq_quota_window_row(qid, p_now);
    END LOOP;
    RETURN (SELECT array_agg(ROW(q.quota_id, q.name, q.tenant, q.route, q.api_key_id,
                                 q.model_patterns, q.tokens, q.cost, q.enforce = 'block',
                                 w.window_end, q.timezone,
                                 w.reserved_tokens + w.charged_tokens,
                                 w.reserved_cost + w.charged_cost, 0, 0)::lq_quota_hold
                             ORDER BY q.quota_id)
              FROM quotas AS q
              JOIN quota_windows AS w
                ON w.quota_id = q.quota_id
               AND w.window_start = (lq_quota_window(q.period, q.timezone, p_now)).window_start
             WHERE q.tenant = ANY (p_tenants));
END
$$;

-- (4b) The prices in force of the candidate models (NULL: none).
CREATE OR REPLACE FUNCTION lq_model_prices(p_models text[], p_now timestamptz)
RETURNS lq_model_price[]
LANGUAGE plpgsql STABLE
AS $$
BEGIN
    RETURN (SELECT array_agg(ROW(m.model, pr.input_usd_per_million,
                                 pr.output_usd_per_million)::lq_model_price)
              FROM unnest(p_models) AS m(model)
              LEFT JOIN LATERAL lq_price_at(m.model, p_now) AS pr ON true);
END
$$;

-- (4b) The prepaid balances of the batch's tenants, locked in tenant order
-- (after the quota windows), each with what is available.
CREATE OR REPLACE FUNCTION lq_lock_credits(p_tenants text[])
RETURNS lq_credit_hold[]
LANGUAGE plpgsql
AS $$
BEGIN
    RETURN (SELECT array_agg(ROW(a.tenant, a.balance - a.reserved, 0)::lq_credit_hold
                             ORDER BY a.tenant)
              FROM (SELECT ca.tenant, ca.balance, ca.reserved
                      FROM credit_accounts AS ca
                     WHERE ca.tenant = ANY (p_tenants)
                     ORDER BY ca.tenant
                       FOR UPDATE) AS a);
END
$$;

-- (5) The candidates of a request, in the order they are tried: the
-- requested model, then its explicit fallbacks (each with its own input
-- count and output reserve: a degraded admission reserves what the model it
-- admits is expected to use), or else its route's or its tenant's default
-- list (models read in (2) only: p_models), with the requested model's input
-- and output reserve. Each candidate model on each of its deployments, in
-- turn: the model's rule orders them, least_utilized by the room its scoped
-- token ceilings would have left (a share of the burst, at the running
-- balances), none scoped counting as the most.
CREATE OR REPLACE FUNCTION lq_admit_candidates(p_batch lq_admit_batch, rq lq_admit_request,
                                               p_layers lq_locked_layer[], p_layer_ids bigint[],
                                               p_models text[], p_ceilings lq_model_ceiling[])
RETURNS lq_admit_candidate[]
LANGUAGE plpgsql STABLE
AS $$
DECLARE
    c      lq_admit_candidate[] := ARRAY[ROW(rq.model, rq.input_tokens, rq.output_reserve,
                                             NULL, false)::lq_admit_candidate];
    last   integer := rq.alt_from + rq.alt_count - 1;
    upto   integer := rq.up_from + rq.up_count - 1;
    routes text[] := CASE WHEN rq.route_at IS NOT NULL
                          THEN p_layers[rq.route_at].fallback_models END;
BEGIN
    IF rq.alt_count > 0 THEN
        c := c || ARRAY(SELECT ROW(a.m, a.inp, a.res, NULL, true)::lq_admit_candidate
                          FROM unnest(p_batch.alt_models[rq.alt_from : last],
                                      p_batch.alt_inputs[rq.alt_from : last],
                                      -- (a NULL alt_outputs: every fallback's is NULL)
                                      p_batch.alt_outputs[rq.alt_from : last])
                               WITH ORDINALITY AS a(m, inp, res, o)
                         WHERE a.m IS NOT NULL
                         ORDER BY a.o);
    ELSIF routes <> '{}' OR p_layers[rq.tenant_at].fallback_models <> '{}' THEN
        c := c || ARRAY(SELECT ROW(d.m, rq.input_tokens, rq.output_reserve, NULL,
                                   true)::lq_admit_candidate
                          FROM unnest(coalesce(nullif(routes, '{}'),
                                               p_layers[rq.tenant_at].fallback_models))
                               WITH ORDINALITY AS d(m, o)
                         WHERE (p_models IS NULL OR d.m = ANY (p_models)) AND d.m <> rq.model
                         ORDER BY d.o);
    END IF;
    IF rq.up_count = 0 THEN
        RETURN c;
    END IF;
    RETURN ARRAY(
        SELECT ROW(e.model, e.input_tokens, e.output_reserve, d.up, e.fallback)::lq_admit_candidate
          FROM unnest(c) WITH ORDINALITY AS e(model, input_tokens, output_reserve, upstream,
                                              fallback, o)
          LEFT JOIN LATERAL (
               SELECT w.up, w.rule, w.i
                 FROM unnest(p_batch.up_models[rq.up_from : upto],
                             p_batch.up_names[rq.up_from : upto],
                             p_batch.up_rules[rq.up_from : upto])
                      WITH ORDINALITY AS w(model, up, rule, i)
                WHERE w.model = e.model) AS d ON true
         WHERE e.model IS NOT NULL
         ORDER BY e.o,
                  CASE WHEN d.rule = 'least_utilized' THEN
                      (SELECT min((l.tokens - e.input_tokens
                                   - coalesce(e.output_reserve, rq.max_tokens)) / l.token_burst)
                         FROM unnest(p_ceilings) AS s
                        CROSS JOIN LATERAL (
                              SELECT (p_layers[array_position(p_layer_ids, s.layer_id)]).*) AS l
                        WHERE s.model = e.model AND s.upstream = d.up
                          AND l.tokens_per_minute IS NOT NULL) END DESC NULLS FIRST,
                  d.i);
END
$$;

-- (5) The layers a candidate touches, as places among the locked layers:
-- the request's own (p_layers: global, tenant, route, key), and the
-- ceilings matching its model (those scoped to a deployment: only on that
-- deployment, or when none is named).
CREATE OR REPLACE FUNCTION lq_candidate_layers(p_layers integer[], c lq_admit_candidate,
                                               p_ceilings lq_model_ceiling[],
                                               p_layer_ids bigint[])
RETURNS integer[]
LANGUAGE plpgsql IMMUTABLE
AS $$
DECLARE
    layers integer[] := p_layers;
    x      integer;
BEGIN
    FOR x IN 1 .. coalesce(cardinality(p_ceilings), 0) LOOP
        IF p_ceilings[x].model = c.model
           AND (c.upstream IS NULL OR p_ceilings[x].upstream IS NULL
                OR p_ceilings[x].upstream = c.upstream) THEN
            layers := layers || array_position(p_layer_ids, p_ceilings[x].layer_id);
        END IF;
    END LOOP;
    RETURN layers;
END
$$;

-- (5) What a candidate's layers say of it, at their running balances: the
-- smallest token burst below its cost (it can never fit), a request burst
-- below its request cost, and otherwise the longest wait among the layers
-- lacking tokens (or whose ladder sheds its priority, p_priority), requests
-- or a permit; and the most output that fits now on top of its input.
CREATE OR REPLACE FUNCTION lq_capacity_verdict(p_layers lq_locked_layer[], p_at integer[],
                                               p_cost bigint, p_input bigint,
                                               p_request_cost integer, p_permits integer,
                                               p_priority smallint, p_retry_ms integer)
RETURNS lq_capacity_verdict
LANGUAGE plpgsql IMMUTABLE
AS $$
DECLARE
    -- A balance within this of the cost counts as enough: refill arithmetic is
    -- floating point and must not refuse a request for a billionth of a token.
    epsilon constant double precision := 1e-6;
    v       lq_capacity_verdict;
    l       lq_locked_layer;
    j       integer;
    floor_tokens double precision;
    wait_ms bigint;
BEGIN
    v.token_wait_ms := -1;
    v.wait_ms := -1;
    v.blocked := false;
    FOREACH j IN ARRAY p_at LOOP
        l := p_layers[j];
        IF l.tokens_per_minute IS NOT NULL THEN
            floor_tokens := CASE WHEN l.shed_above IS NULL THEN 0
                                 ELSE lq_shed_floor(l.token_burst, l.shed_above, l.shed_admit,
                                                    l.shed_small, p_priority, p_cost) END;
            v.room := least(coalesce(v.room, l.tokens - floor_tokens - p_input),
                            l.tokens - floor_tokens - p_input);
            IF p_cost > l.token_burst THEN
                IF v.too_large_at IS NULL OR l.token_burst < p_layers[v.too_large_at].token_burst THEN
                    v.too_large_at := j;
                END IF;
            ELSIF l.tokens + epsilon < p_cost OR l.tokens - p_cost + epsilon < floor_tokens THEN
                -- lacking tokens, or fitting only past the floor this priority may not cross
                wait_ms := greatest(1, ceil((p_cost + floor_tokens - l.tokens) * 60000.0
                                            / l.tokens_per_minute));
                IF wait_ms > v.token_wait_ms THEN
                    v.token_wait_ms := wait_ms;
                    v.token_wait_at := j;
                END IF;
                IF wait_ms > v.wait_ms THEN
                    v.wait_ms := wait_ms; v.kind := 'tokens'; v.scope := l.scope;
                    v.ceiling := l.ceiling;
                    IF l.tokens + epsilon < p_cost THEN
                        v.reason := 'capacity';
                        v.utilization := CASE WHEN l.scope = 'ceiling'
                                              THEN 1 - (l.tokens - p_cost) / l.token_burst END;
                    ELSE
                        v.reason := 'shed';
                        v.utilization := 1 - (l.tokens - p_cost) / l.token_burst;
                    END IF;
                END IF;
            END IF;
        END IF;
        IF l.requests_per_minute IS NOT NULL AND p_request_cost > l.request_burst THEN
            -- Counts as more requests than this layer ever holds.
            v.blocked := true;
            v.too_many_at := coalesce(v.too_many_at, j);
        ELSIF l.requests_per_minute IS NOT NULL AND p_request_cost > 0
              AND l.requests + epsilon < p_request_cost THEN
            v.blocked := true;
            wait_ms := greatest(1, ceil((p_request_cost - l.requests) * 60000.0
                                        / l.requests_per_minute));
            IF wait_ms > v.wait_ms THEN
                v.wait_ms := wait_ms; v.kind := 'requests'; v.scope := l.scope;
                v.reason := 'capacity'; v.ceiling := l.ceiling; v.utilization := NULL;
            END IF;
        END IF;
        IF p_permits = 1 AND l.max_in_flight IS NOT NULL AND l.in_flight >= l.max_in_flight THEN
            v.blocked := true;
            IF p_retry_ms > v.wait_ms THEN
                v.wait_ms := p_retry_ms; v.kind := 'concurrency'; v.scope := l.scope;
                v.reason := 'capacity'; v.ceiling := l.ceiling; v.utilization := NULL;
            END IF;
        END IF;
    END LOOP;
    RETURN v;
END
$$;

-- (5) Calendar quotas and prepaid credits of a candidate whose layers all
-- pass: reserved like tokens, against the running figures of (4b). Money is
-- the request's maximum: input and max_tokens, each at its price in force.
CREATE OR REPLACE FUNCTION lq_budget_verdict(rq lq_admit_request, c lq_admit_candidate,
                                             p_cost bigint, p_prepaid boolean,
                                             p_quotas lq_quota_hold[],
                                             p_prices lq_model_price[],
                                             p_credits lq_credit_hold[])
RETURNS lq_budget_verdict
LANGUAGE plpgsql IMMUTABLE
AS $$
DECLARE
    v lq_budget_verdict;
    q lq_quota_hold;
    x integer;
BEGIN
    v.quotas := '{}';
    -- (loops, not queries: this runs per candidate, and a query per call
    -- costs more than a scan of a few rows)
    FOR x IN 1 .. coalesce(cardinality(p_prices), 0) LOOP
        CONTINUE WHEN p_prices[x].model IS DISTINCT FROM c.model;
        IF p_prices[x].input_usd IS NOT NULL THEN
            v.money := (c.input_tokens * p_prices[x].input_usd
                        + rq.max_tokens * p_prices[x].output_usd) / 1000000;
        END IF;
        EXIT;
    END LOOP;
    FOR x IN 1 .. coalesce(cardinality(p_quotas), 0) LOOP
        q := p_quotas[x];
        CONTINUE WHEN q.tenant <> rq.tenant
                   OR (q.route IS NOT NULL AND q.route IS DISTINCT FROM rq.route)
                   OR (q.api_key_id IS NOT NULL AND q.api_key_id IS DISTINCT FROM rq.key_id)
                   OR NOT (q.model_patterns = '{}' OR c.model LIKE ANY (q.model_patterns));
        v.quotas := v.quotas || x;
        IF q.cost IS NOT NULL AND v.money IS NULL THEN
            v.refusal := 'unpriced_model';
            RETURN v;
        END IF;
        IF q.blocks AND q.tokens IS NOT NULL THEN
            v.room := least(coalesce(v.room, q.tokens - q.used_tokens - c.input_tokens),
                            q.tokens - q.used_tokens - c.input_tokens);
        END IF;
        IF q.blocks AND v.quota_at IS NULL
           AND ((q.tokens IS NOT NULL AND q.used_tokens + p_cost > q.tokens)
             OR (q.cost IS NOT NULL AND q.used_cost + v.money > q.cost)) THEN
            v.quota_at := x;
            v.refusal := 'quota_exceeded';
        END IF;
    END LOOP;
    IF v.refusal IS NULL AND p_prepaid THEN
        v.available := 0;
        FOR x IN 1 .. coalesce(cardinality(p_credits), 0) LOOP
            IF p_credits[x].tenant = rq.tenant THEN
                v.available := p_credits[x].available;
                EXIT;
            END IF;
        END LOOP;
        IF v.money IS NULL THEN
            v.refusal := 'unpriced_model';
        ELSIF v.available < v.money THEN
            v.refusal := 'credits_exhausted';
        END IF;
    END IF;
    RETURN v;
END
$$;

-- (6) Persist the layers the batch changed, with their refill state. A layer
-- only refilled is left as it is: refill is a function of the clock, and its
-- stored balance and refilled_at give the same balance at any later moment.
-- So a refusal writes nothing; its row locks are all it leaves.
CREATE OR REPLACE FUNCTION lq_persist_layers(p_layers lq_locked_layer[],
                                             p_refilled lq_locked_layer[], p_now timestamptz)
RETURNS void
LANGUAGE plpgsql
AS $$
DECLARE
    ids       bigint[] := '{}';
    balances  double precision[] := '{}';
    rates     double precision[] := '{}';
    permits   integer[] := '{}';
    l         lq_locked_layer;
    b         lq_locked_layer;
    j         integer;
BEGIN
    FOR j IN 1 .. coalesce(cardinality(p_layers), 0) LOOP
        l := p_layers[j];
        b := p_refilled[j];
        CONTINUE WHEN (l.tokens, l.requests, l.in_flight)
                      IS NOT DISTINCT FROM (b.tokens, b.requests, b.in_flight);
        ids := ids || l.layer_id;
        balances := balances || l.tokens;
        rates := rates || l.requests;
        permits := permits || l.in_flight;
    END LOOP;
    UPDATE limit_layers AS ll
       SET tokens = u.tokens,
           requests = u.requests,
           in_flight = u.in_flight,
           refilled_at = p_now
      FROM unnest(ids, balances, rates, permits) AS u(layer_id, tokens, requests, in_flight)
     WHERE ll.layer_id = u.layer_id;
END
$$;

-- (5) A request whose idempotency key was admitted before: replayed (the
-- same request: the first admission's answer) or a conflict (another
-- request under that key); it decides nothing, and its binding layer is its
-- tenant's. p_earlier: the admission earlier in this batch, and its request's
-- hash (NULL: none; then a committed reservation is looked up). r unchanged
-- (status NULL): the key is new.
CREATE OR REPLACE FUNCTION lq_replay(r lq_admit_result, rq lq_admit_request,
                                     p_tenant lq_locked_layer, p_earlier lq_admit_result,
                                     p_earlier_hash text)
RETURNS lq_admit_result
LANGUAGE plpgsql STABLE
AS $$
DECLARE
    prior record;
BEGIN
    IF p_earlier.ord IS NULL THEN
        SELECT b.reservation_id, b.reserved_tokens, b.lease_expires_at, b.lease_generation,
               b.request_hash, b.model, b.input_tokens, b.upstream,
               b.model IS DISTINCT FROM rq.model AS degraded
          INTO prior
          FROM reservations AS b
         WHERE b.tenant = rq.tenant AND b.idempotency_key = rq.idempotency_key;
        IF NOT FOUND THEN
            RETURN r;
        END IF;
    ELSE
        SELECT p_earlier.reservation_id, p_earlier.reserved_tokens, p_earlier.lease_expires_at,
               p_earlier.lease_generation, p_earlier_hash AS request_hash, p_earlier.model,
               p_earlier.input_tokens, p_earlier.upstream, p_earlier.degraded
          INTO prior;
    END IF;
    IF prior.request_hash IS NOT DISTINCT FROM rq.request_hash THEN
        r.status := 'replayed';
        r.reservation_id := prior.reservation_id;
        r.reserved_tokens := prior.reserved_tokens;
        r.lease_expires_at := prior.lease_expires_at;
        r.lease_generation := prior.lease_generation;
        r.model := prior.model;
        r.input_tokens := prior.input_tokens;
        r.degraded := prior.degraded;
        r.upstream := prior.upstream;
    ELSE
        r.status := 'idempotency_conflict';
    END IF;
    r.tenant_tokens := p_tenant.tokens;
    r.tenant_requests := p_tenant.requests;
    r.binding_tokens_per_minute := p_tenant.tokens_per_minute;
    r.binding_token_burst := p_tenant.token_burst;
    r.binding_tokens := p_tenant.tokens;
    RETURN r;
END
$$;

-- (5) What is left after a decision: the tightest layer of each kind, over
-- the layers of the model admitted (or of the requested model, refused), and
-- the tenant layer's balances. The binding token layer is the tightest one,
-- or on a refusal the token layer that refused (p_refused_at: too small, or
-- the longest wait for tokens).
CREATE OR REPLACE FUNCTION lq_remaining(r lq_admit_result, p_layers lq_locked_layer[],
                                        p_at integer[], p_tenant_at integer,
                                        p_refused_at integer)
RETURNS lq_admit_result
LANGUAGE plpgsql IMMUTABLE
AS $$
DECLARE
    tokens    double precision;
    requests  double precision;
    in_flight integer;
    bind      integer;
    l         lq_locked_layer;
    j         integer;
BEGIN
    FOREACH j IN ARRAY p_at LOOP
        l := p_layers[j];
        IF l.tokens_per_minute IS NOT NULL THEN
            IF tokens IS NULL OR l.tokens < tokens THEN
                bind := j;
            END IF;
            tokens := least(tokens, l.tokens);
        END IF;
        IF l.requests_per_minute IS NOT NULL THEN
            requests := least(requests, l.requests);
        END IF;
        IF l.max_in_flight IS NOT NULL THEN
            in_flight := least(in_flight, l.max_in_flight - l.in_flight);
        END IF;
    END LOOP;
    bind := coalesce(p_refused_at, bind);
    r.remaining_tokens := floor(tokens);
    r.remaining_requests := floor(requests);
    r.remaining_in_flight := in_flight;
    r.tenant_tokens := p_layers[p_tenant_at].tokens;
    r.tenant_requests := p_layers[p_tenant_at].requests;
    r.binding_tokens_per_minute := p_layers[bind].tokens_per_minute;
    r.binding_token_burst := p_layers[bind].token_burst;
    r.binding_tokens := p_layers[bind].tokens;
    RETURN r;
END
$$;

-- (5) A decision's answer without a refusal's figures: the requested model,
-- refused on one deployment, was admitted on another.
CREATE OR REPLACE FUNCTION lq_without_refusal(r lq_admit_result)
RETURNS lq_admit_result
LANGUAGE plpgsql IMMUTABLE
AS $$
BEGIN
    r.limit_kind := NULL;
    r.limit_scope := NULL;
    r.retry_after_ms := NULL;
    r.capacity := NULL;
    r.reason := NULL;
    r.ceiling := NULL;
    r.utilization := NULL;
    r.quota := NULL;
    r.resets_at := NULL;
    r.quota_timezone := NULL;
    r.credit_balance := NULL;
    r.alt_max_tokens := NULL;
    RETURN r;
END
$$;

-- (5) The requested model's refusal, as a 429 (or a degraded 201) says it:
-- the layer that can never fit it (the smallest burst), else the longest
-- wait, else its quota (retryable when the window resets), its prepaid
-- balance (until a top-up) or a model without a price; and the largest
-- max_tokens that would fit now with the same input and priority (none when
-- a request or permit is lacking). On several deployments, its first's,
-- unless that one can never fit it and another only lacks room now.
CREATE OR REPLACE FUNCTION lq_refusal(r lq_admit_result, p_cost bigint, p_max_tokens bigint,
                                      cap lq_capacity_verdict, bud lq_budget_verdict,
                                      p_layers lq_locked_layer[], p_quotas lq_quota_hold[],
                                      p_now timestamptz)
RETURNS lq_admit_result
LANGUAGE plpgsql IMMUTABLE
AS $$
DECLARE
    epsilon constant double precision := 1e-6;   -- as in lq_capacity_verdict
    room    double precision := least(cap.room, bud.room);
    q       lq_quota_hold := p_quotas[bud.quota_at];
    j       integer := coalesce(cap.too_large_at, cap.too_many_at);
BEGIN
    r := lq_without_refusal(r);
    r.reserved_tokens := p_cost;
    IF j IS NOT NULL THEN
        r.status := 'too_large';
        r.limit_kind := CASE WHEN cap.too_large_at IS NOT NULL THEN 'tokens' ELSE 'requests' END;
        r.limit_scope := p_layers[j].scope;
        r.capacity := CASE WHEN cap.too_large_at IS NOT NULL THEN p_layers[j].token_burst
                           ELSE p_layers[j].request_burst END;
        r.reason := 'capacity';
        r.ceiling := p_layers[j].ceiling;
    ELSIF cap.wait_ms >= 0 THEN
        r.status := 'rate_limited';
        r.limit_kind := cap.kind;
        r.limit_scope := cap.scope;
        r.retry_after_ms := cap.wait_ms;
        r.reason := cap.reason;
        r.ceiling := cap.ceiling;
        r.utilization := cap.utilization;
    ELSE
        r.status := bud.refusal;
        r.limit_kind := CASE bud.refusal WHEN 'quota_exceeded' THEN 'quota'
                                         WHEN 'credits_exhausted' THEN 'credits' END;
        r.limit_scope := CASE WHEN bud.quota_at IS NULL THEN 'tenant'
                              WHEN q.api_key_id IS NOT NULL THEN 'key'
                              WHEN q.route IS NULL THEN 'tenant'
                              ELSE 'route' END;
        IF bud.quota_at IS NOT NULL THEN
            r.quota := q.name;
            r.resets_at := q.window_end;
            r.quota_timezone := q.timezone;
            r.retry_after_ms := greatest(1, ceil(extract(epoch FROM q.window_end - p_now) * 1000));
        END IF;
        r.credit_balance := bud.available;
    END IF;
    IF NOT cap.blocked AND room >= 1 THEN
        r.alt_max_tokens := least(floor(room + epsilon)::bigint, p_max_tokens - 1);
        IF r.alt_max_tokens < 1 THEN
            r.alt_max_tokens := NULL;
        END IF;
    END IF;
    RETURN r;
END
$$;

-- (5) An admitted request's journal row (rs: its layers, quotas and money
-- already named). Every column is set here, those with a default too (the
-- row is inserted whole): tests/integration/test_admission_steps.py fails
-- when reservations gains a column with a default this does not set. The model and input are the admitted candidate's: a
-- fallback's usage is settled and billed as that model, and its ledger row
-- says it was served as a fallback (p_path; a fallback taken after waiting
-- is still a fallback, as the proxy's serving-path metric counts it).
CREATE OR REPLACE FUNCTION lq_journal_row(rs reservations, rq lq_admit_request,
                                          r lq_admit_result, p_now timestamptz,
                                          p_lease integer, p_path text)
RETURNS reservations
LANGUAGE plpgsql IMMUTABLE
AS $$
BEGIN
    rs.reservation_id := r.reservation_id;
    rs.tenant := rq.tenant;
    rs.route := rq.route;
    rs.model := r.model;
    rs.input_tokens := r.input_tokens;
    rs.input_estimated := rq.input_estimated;
    rs.max_tokens := rq.max_tokens;
    rs.reserved_tokens := r.reserved_tokens;
    rs.state := 'active';
    rs.lease_generation := 1;
    rs.lease_seconds := p_lease;
    rs.created_at := p_now;
    rs.lease_expires_at := r.lease_expires_at;
    rs.idempotency_key := rq.idempotency_key;
    rs.request_hash := rq.request_hash;
    rs.late := false;
    rs.request_cost := rq.request_cost;
    rs.permits := rq.permits;
    rs.serving_path := p_path;
    rs.upstream := r.upstream;
    RETURN rs;
END
$$;

-- lq_admit's look at its deadline, before it locks anything ('started') and
-- once the batch is decided ('ran'): past it, the whole statement rolls back
-- (SQLSTATE LQ002). RETURN QUERY has only queued the rows, so raising after
-- deciding still undoes every write. DETAIL: the database's clock now, so
-- that a worker whose reading of it was behind (the clock was stepped
-- forward) learns it from the refusal itself, not only from an answer it no
-- longer gets.
DROP FUNCTION IF EXISTS lq_admit_in_time(timestamptz);
CREATE OR REPLACE FUNCTION lq_admit_in_time(p_deadline timestamptz, p_when text)
RETURNS void
LANGUAGE plpgsql
AS $$
BEGIN
    IF clock_timestamp() > p_deadline THEN
        RAISE EXCEPTION 'admission statement % past its deadline', p_when
            USING ERRCODE = 'LQ002',
                  DETAIL = to_char(clock_timestamp() AT TIME ZONE 'UTC',
                                   'YYYY-MM-DD"T"HH24:MI:SS.US"+00:00"');
    END IF;
END
$$;

-- Decide a batch of admission requests: lq_admit_decide (above). With a
-- sharded global layer, a first attempt locks only the batch's shards; when
-- one lacks room (SQLSTATE LQ001) that attempt's subtransaction is rolled
-- back, which releases its row locks and undoes its writes, and the batch is
-- decided again with every shard locked and pooled, in the same layer_id
-- order (so no deadlock), in the same statement. One shard, no
-- subtransaction: a probe for shard 1 says which, and the batch is decided
-- with p_pool, so that a shard count raised since the probe is met by
-- locking every shard rather than by an LQ001 with no handler.
--
-- One decision per request: a worker that stops waiting for this statement
-- (its decision deadline passed) answers by the failure mode instead, so
-- the statement must then not also take effect. p_deadline is when the
-- worker stops waiting, on this database's clock as the worker last saw it
-- (so never later than the real moment; see store/clock.py). A statement
-- that starts past it, say one a frozen server reads from its socket when
-- it wakes, writes nothing: SQLSTATE LQ002, before any row is locked. A
-- statement that started in time and ran past it (the server froze
-- mid-way) is checked again after deciding and rolls back the same way.
-- What neither check can see, a freeze between the second check and the
-- commit, or an answer lost on the way back, leaves reservations whose ids
-- the worker named in p_reservation_ids and journaled: it releases them
-- when the database answers again (admission/abandoned.py).
-- p_deadline and p_reservation_ids were added: the old signature goes.
DROP FUNCTION IF EXISTS lq_admit(text[], text[], text[], bigint[], bigint[], boolean[],
                                 integer[], text[], text[], integer, smallint[], boolean[],
                                 boolean[], integer[], text[], bigint[], bigint[]);
-- p_key_ids was added (limits per API key), and the result gained the binding
-- token layer's figures (binding_*).
DROP FUNCTION IF EXISTS lq_admit(text[], text[], text[], bigint[], bigint[], boolean[],
                                 integer[], text[], text[], integer, smallint[], boolean[],
                                 boolean[], integer[], text[], bigint[], bigint[], timestamptz,
                                 uuid[]);
-- p_alt_outputs (each explicit fallback's own output reserve; a caller
-- that does not send it reserves max_tokens for its fallbacks) and
-- p_serving_paths (the path each reservation journals) were added.
DROP FUNCTION IF EXISTS lq_admit(text[], text[], text[], bigint[], bigint[], boolean[],
                                 integer[], text[], text[], integer, smallint[], boolean[],
                                 boolean[], integer[], text[], bigint[], bigint[], timestamptz,
                                 uuid[], bigint[]);
-- p_up_* (deployments) were added, and the result gained upstream.
DROP FUNCTION IF EXISTS lq_admit(text[], text[], text[], bigint[], bigint[], boolean[],
                                 integer[], text[], text[], integer, smallint[], boolean[],
                                 boolean[], integer[], text[], bigint[], bigint[], timestamptz,
                                 uuid[], bigint[], bigint[], text[]);
-- The result became lq_admit_result (migration 0031). The arguments are
-- those of the function created below, so the old one goes only while it
-- still returns the old columns (once; a later apply replaces it in place,
-- keeping its grants).
DO $$
DECLARE
    admit regprocedure := to_regprocedure(
        'lq_admit(text[], text[], text[], bigint[], bigint[], boolean[], integer[], text[],'
        ' text[], integer, smallint[], boolean[], boolean[], integer[], text[], bigint[],'
        ' bigint[], timestamptz, uuid[], bigint[], bigint[], text[], integer[], text[],'
        ' text[], text[])');
BEGIN
    IF admit IS NOT NULL AND pg_get_function_result(admit) <> 'SETOF lq_admit_result' THEN
        EXECUTE format('DROP FUNCTION %s', admit);
    END IF;
END
$$;
CREATE OR REPLACE FUNCTION lq_admit(
    p_tenants          text[],
    p_routes           text[],
    p_models           text[],
    p_input_tokens     bigint[],
    p_max_tokens       bigint[],
    p_input_estimated  boolean[],
    p_lease_seconds    integer[],
    p_idempotency_keys text[],
    p_request_hashes   text[],
    p_concurrency_retry_ms integer DEFAULT 1000,
    p_priorities       smallint[] DEFAULT NULL,  -- requested rank, NULL: the tenant's
    p_priority_any     boolean[] DEFAULT NULL,   -- true: may raise it (admin)
    p_degrade          boolean[] DEFAULT NULL,   -- false: never degrade
    p_alt_ord          integer[] DEFAULT NULL,   -- explicit fallbacks: request position,
    p_alt_models       text[] DEFAULT NULL,      -- model, in order,
    p_alt_inputs       bigint[] DEFAULT NULL,    -- and its input count
    p_output_reserve   bigint[] DEFAULT NULL,    -- output tokens to reserve, NULL: max_tokens
    p_deadline         timestamptz DEFAULT NULL, -- past it, write nothing (LQ002); NULL: none
    p_reservation_ids  uuid[] DEFAULT NULL,      -- the id each admission gets, NULL: a new one
    p_key_ids          bigint[] DEFAULT NULL,    -- the API key that asked, NULL: none
    p_alt_outputs      bigint[] DEFAULT NULL,    -- each explicit fallback's output reserve
                                                 -- (as p_alt_inputs), NULL: max_tokens
    p_serving_paths    text[] DEFAULT NULL,      -- 'queued': it waited for room; NULL: as asked
    p_up_ord           integer[] DEFAULT NULL,   -- deployments: request position,
    p_up_models        text[] DEFAULT NULL,      -- the candidate model they serve,
    p_up_names         text[] DEFAULT NULL,      -- the deployment, in the caller's order,
    p_up_rules         text[] DEFAULT NULL       -- and the model's rule ('least_utilized')
) RETURNS SETOF lq_admit_result
LANGUAGE plpgsql
AS $$
DECLARE
    batch lq_admit_batch := ROW(
        p_tenants, p_routes, p_models, p_input_tokens, p_max_tokens, p_input_estimated,
        p_lease_seconds, p_idempotency_keys, p_request_hashes, p_concurrency_retry_ms,
        p_priorities, p_priority_any, p_degrade, p_alt_ord, p_alt_models, p_alt_inputs,
        p_output_reserve, p_reservation_ids, p_key_ids, p_alt_outputs, p_serving_paths,
        p_up_ord, p_up_models, p_up_names, p_up_rules);
BEGIN
    PERFORM lq_admit_in_time(p_deadline, 'started');
    IF NOT EXISTS (SELECT 1 FROM limit_layers AS g
                    WHERE g.scope = 'global' AND g.tenant IS NULL AND g.route IS NULL
                      AND g.ceiling IS NULL AND g.shard = 1) THEN
        -- one shard (or none): no subtransaction, see above
        RETURN QUERY SELECT * FROM lq_admit_decide(batch, true);
    ELSE
        BEGIN
            RETURN QUERY SELECT * FROM lq_admit_decide(batch, false);
        EXCEPTION WHEN SQLSTATE 'LQ001' THEN
            RETURN QUERY SELECT * FROM lq_admit_decide(batch, true);
        END;
    END IF;
    PERFORM lq_admit_in_time(p_deadline, 'ran');
END
$$;

-- Resolve a batch of reservations: settle, release or expire each one, in
-- array order. This is the reservation state machine, in one place:
--
--   active --settle--> settled      refund reserved - charged (or debit the
--                                   excess), free the permit, ledger 'usage'
--   active --release-> released     refund everything, the request too, free
--                                   the permit; the provider was never called
--   active --expire--> expired      the lease ran out: refund the tokens, free
--                                   the permit, ledger 'usage' row with outcome
--                                   'expired' and zero known usage
--   expired --settle-> expired      a late settle: debit what was really used,
--                                   ledger 'late' row; never counted twice
--
-- An active reservation whose lease has run out is expired first, whatever
-- the action, so the result never depends on whether the sweeper ran yet:
-- a worker paused past its lease cannot act as if it still held the permit.
-- Repeating a settle with the same figures returns the first result.
--
-- Every ledger row appended here names how its request was served
-- (serving_path): the settler's p_serving_paths, else the path the
-- admission journaled (reservations.serving_path: fallback_model, queued),
-- else primary. An expiry's row takes the journaled one.
--
-- status per request: settled | released | expired | replayed | conflict |
-- not_found | not_due (expire only: the lease is still live).
-- The most a settlement may take from a shared layer (global, and any layer
-- every tenant passes): the request's possible maximum, its counted input
-- with a tolerance (providers count framing and tools a little differently:
-- a quarter more, and 64 tokens) plus max_tokens. Usage above it is still
-- charged in full to the tenant's own layers and recorded in full in the
-- ledger (as excess_tokens), but one tenant's absurd report cannot drain what
-- every tenant shares.
CREATE OR REPLACE FUNCTION lq_shared_charge_cap(input_tokens bigint, max_tokens bigint)
RETURNS bigint
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$
    SELECT ceil(input_tokens * 1.25)::bigint + 64 + max_tokens
$$;


-- The price version of p_model in force at p_at; no row: the model has none.
-- A price's model is a name or a `*` glob, matched as quotas and ceilings
-- match (lq_model_patterns). The exact name wins over any glob, a longer
-- glob over a shorter one; within the winner, the latest effective_from at
-- or before p_at, then the latest version of it (set_at: prices are
-- append-only, a change is a new version). reports/00_base.sql's
-- ledger_entries applies the same rule, so credits and invoices agree.
-- PL/pgSQL, not SQL: Citus refuses a SQL function that reads a table when it
-- is called with parameters (in a cell, model_prices is a distributed table).
CREATE OR REPLACE FUNCTION lq_price_at(p_model text, p_at timestamptz)
RETURNS TABLE (model text, effective_from timestamptz, set_at timestamptz,
               input_usd_per_million numeric, output_usd_per_million numeric)
LANGUAGE plpgsql STABLE
AS $$
BEGIN
    RETURN QUERY
    SELECT mp.model, mp.effective_from, mp.set_at, mp.input_usd_per_million,
           mp.output_usd_per_million
      FROM model_prices AS mp
     WHERE (mp.model = p_model
            OR (strpos(mp.model, '*') > 0 AND p_model LIKE (lq_model_patterns(ARRAY[mp.model]))[1]))
       AND mp.effective_from <= p_at
     ORDER BY mp.model = p_model DESC, length(mp.model) DESC, mp.effective_from DESC,
              mp.set_at DESC
     LIMIT 1;
END
$$;


-- What usage costs at the prices in force at p_at (USD; input and output
-- priced apart, per million tokens); NULL for a model without a price.
-- PL/pgSQL for lq_price_at's reason.
CREATE OR REPLACE FUNCTION lq_cost(p_model text, p_input bigint, p_output bigint, p_at timestamptz)
RETURNS numeric
LANGUAGE plpgsql STABLE
AS $$
BEGIN
    RETURN (SELECT (p_input * mp.input_usd_per_million
                    + p_output * mp.output_usd_per_million) / 1000000
              FROM lq_price_at(p_model, p_at) AS mp);
END
$$;


-- lq_cost of many rows at once (parallel arrays; NULL where a model has no
-- price). For the audits: they read the rows first and price them in a
-- statement of their own, since Citus refuses a statement on a cell's tables
-- that calls a function running statements of its own.
CREATE OR REPLACE FUNCTION lq_costs(p_models text[], p_inputs bigint[], p_outputs bigint[],
                                    p_ats timestamptz[])
RETURNS numeric[]
LANGUAGE plpgsql STABLE
AS $$
DECLARE
    costs numeric[] := '{}';
BEGIN
    FOR i IN 1 .. coalesce(cardinality(p_models), 0) LOOP
        costs := costs || lq_cost(p_models[i], p_inputs[i], p_outputs[i], p_ats[i]);
    END LOOP;
    RETURN costs;
END
$$;


-- lq_finish's result gained excess_tokens, then forgiven_global_tokens and
-- forgiven_ceiling_tokens: a changed result type needs the old function gone
-- first. (Its three trailing arguments, where an upstream's figures came
-- from, have defaults: without the DROP, the old six-argument function would
-- stay beside it and every six-argument call be ambiguous.)
DROP FUNCTION IF EXISTS lq_finish(uuid[], text[], text[], bigint[], bigint[], text[]);
-- Then p_serving_paths was added (the ledger row's serving_path) and the
-- result gained model and plan: the nine-argument function goes.
DROP FUNCTION IF EXISTS lq_finish(uuid[], text[], text[], bigint[], bigint[], text[], text[],
    numeric[], numeric[]);
-- The result became lq_finish_result (migration 0032). The arguments are
-- those of the function created below, so the old one goes only while it
-- still returns a table of its own (once; a later apply replaces it in
-- place, keeping its grants).
DO $$
DECLARE
    finish regprocedure := to_regprocedure(
        'lq_finish(uuid[], text[], text[], bigint[], bigint[], text[], text[], numeric[],'
        ' numeric[], text[])');
BEGIN
    IF finish IS NOT NULL AND pg_get_function_result(finish) <> 'SETOF lq_finish_result' THEN
        EXECUTE format('DROP FUNCTION %s', finish);
    END IF;
END
$$;
CREATE OR REPLACE FUNCTION lq_finish(
    p_ids            uuid[],
    p_actions        text[],     -- 'settle' | 'release' | 'expire'
    p_callers        text[],     -- the caller's tenant; NULL for an admin
    p_input_tokens   bigint[],   -- settle only
    p_output_tokens  bigint[],   -- settle only
    p_outcomes       text[],     -- settle only: ok | error | cancelled
    -- settle only, for the ledger row: reported | counted | clamped (NULL:
    -- reported), and an upstream's own figures where they differ from the
    -- settled ones (see domain/upstream_usage.py)
    p_usage_sources  text[] DEFAULT NULL,
    p_reported_input  numeric[] DEFAULT NULL,
    p_reported_output numeric[] DEFAULT NULL,
    -- settle only: how the request was served, when the settler knows it
    -- (the proxy's second_deployment); NULL: the reservation's journaled
    -- serving_path (fallback_model, queued), else primary
    p_serving_paths  text[] DEFAULT NULL
) RETURNS SETOF lq_finish_result   -- one per request, in order (migration 0032)
LANGUAGE plpgsql
-- Generic plans: each statement inside is planned once per session and probes
-- indexes whatever the batch size. (Custom plans were re-planned on every call,
-- and for a batch of many distinct tenants chose a hash join over a sequential
-- scan of limit_layers: twice the time of the whole statement.)
SET plan_cache_mode = force_generic_plan
AS $$
DECLARE
    n         integer := coalesce(cardinality(p_ids), 0);
    now_ts    timestamptz;
    res       reservations[];
    ids       uuid[];
    changed   boolean[];
    rec       reservations;
    i         integer;
    k         integer;
    charged   bigint;
    cap       bigint;
    -- What (2) and (3) decide, applied by (4) to (7), each entry naming its
    -- reservation by its place in res (migration 0029 declares the types):
    credits   lq_layer_credit[] := '{}';    -- to every layer it debited
    entries   lq_ledger_entry[] := '{}';    -- ledger rows to append
    changes   lq_budget_change[] := '{}';   -- its quotas and prepaid credit
    entry     lq_ledger_entry;
    -- (4) per reservation: what shared layers forgave (lq_shared_forgiven),
    -- summed by scope and at most, and its tenant layer's plan
    f_global  double precision[];
    f_ceiling double precision[];
    f_most    double precision[];
    t_plan    text[];
    -- one answer per request, in order
    results   lq_finish_result[] := '{}';
    fin       lq_finish_result;
BEGIN
    IF n = 0 THEN
        RETURN;
    END IF;

    -- (1) Lock the reservations in id order, then read them: the read's fresh
    -- snapshot sees whatever the transactions we waited for committed.
    PERFORM 1 FROM reservations AS rs
      WHERE rs.reservation_id = ANY (p_ids)
      ORDER BY rs.reservation_id
        FOR UPDATE;
    SELECT array_agg(rs ORDER BY rs.reservation_id), array_agg(rs.reservation_id ORDER BY rs.reservation_id)
      INTO res, ids
      FROM reservations AS rs
     WHERE rs.reservation_id = ANY (p_ids);
    changed := array_fill(false, ARRAY[coalesce(cardinality(ids), 0)]);
    now_ts := clock_timestamp();

    FOR k IN 1 .. n LOOP
        fin := NULL;
        fin.ord := k;
        <<finish>>
        BEGIN
            i := array_position(ids, p_ids[k]);
            IF i IS NULL THEN
                fin.status := 'not_found';
                EXIT finish;
            END IF;
            rec := res[i];
            IF p_callers[k] IS NOT NULL AND p_callers[k] <> rec.tenant THEN
                -- Another tenant's reservation is indistinguishable from none.
                fin.status := 'not_found';
                EXIT finish;
            END IF;
            fin.tenant := rec.tenant;
            fin.model := rec.model;

            -- (2) A lease that ran out is expired before anything else happens.
            IF rec.state = 'active' AND rec.lease_expires_at <= now_ts THEN
                -- everything held goes back; the ledger says it expired, unused
                credits := credits || ROW(i, rec.reserved_tokens, rec.reserved_tokens, 0,
                                          rec.permits)::lq_layer_credit;
                entries := entries || ROW(i, 'usage', 0, 0, rec.reserved_tokens, 'expired', 0,
                                          NULL, NULL, NULL,
                                          coalesce(rec.serving_path, 'primary'))::lq_ledger_entry;
                changes := changes || ROW(i, 'expire', 0, 0)::lq_budget_change;
                rec.state := 'expired';
                rec.finished_at := now_ts;
                changed[i] := true;
                IF p_actions[k] = 'expire' THEN
                    fin.status := 'expired';
                END IF;
            ELSIF p_actions[k] = 'expire' THEN
                -- A live lease is not due yet; a finished reservation has nothing to expire.
                fin.status := CASE WHEN rec.state = 'active' THEN 'not_due' ELSE 'conflict' END;
            END IF;

            -- (3) The action itself.
            IF p_actions[k] = 'settle' THEN
                charged := p_input_tokens[k] + p_output_tokens[k];
                cap := lq_shared_charge_cap(rec.input_tokens, rec.max_tokens);
                -- the settlement's ledger row, if it is one (on time, or late below)
                entry := ROW(i, 'usage', p_input_tokens[k], p_output_tokens[k],
                             rec.reserved_tokens, p_outcomes[k], greatest(charged - cap, 0),
                             coalesce(p_usage_sources[k], 'reported'),
                             p_reported_input[k], p_reported_output[k],
                             coalesce(p_serving_paths[k], rec.serving_path, 'primary'));
                IF rec.state = 'active' THEN
                    -- Refund what was reserved and not used, or debit the excess
                    -- (shared layers at most up to the cap); lq_credit_layers
                    -- clamps at capacity.
                    credits := credits || ROW(i, rec.reserved_tokens - charged,
                                              rec.reserved_tokens - least(charged, cap), 0,
                                              rec.permits)::lq_layer_credit;
                    entries := entries || entry;
                    changes := changes || ROW(i, 'settle', p_input_tokens[k],
                                              p_output_tokens[k])::lq_budget_change;
                    rec.state := 'settled';
                    rec.finished_at := now_ts;
                    rec.refunded_tokens := greatest(rec.reserved_tokens - charged, 0);
                    rec.late := false;
                    fin.status := 'settled';
                ELSIF rec.state = 'expired' AND rec.charged_tokens IS NULL THEN
                    -- Late: the expiry gave the whole reservation back, so what
                    -- was really used is debited now. The permit is already free.
                    credits := credits || ROW(i, -charged, -least(charged, cap), 0,
                                              0)::lq_layer_credit;
                    entry.entry_kind := 'late';
                    entry.reserved_tokens := 0;
                    entry.outcome := 'late';
                    entries := entries || entry;
                    changes := changes || ROW(i, 'late', p_input_tokens[k],
                                              p_output_tokens[k])::lq_budget_change;
                    rec.refunded_tokens := 0;
                    rec.late := true;
                    fin.status := 'settled';
                ELSIF rec.charged_tokens IS NOT NULL THEN
                    -- Settled before: the same figures get the first answer back.
                    fin.status := CASE
                        WHEN rec.settled_input_tokens = p_input_tokens[k]
                         AND rec.settled_output_tokens = p_output_tokens[k]
                         AND rec.outcome = p_outcomes[k]
                        THEN 'replayed' ELSE 'conflict' END;
                ELSE
                    fin.status := 'conflict';   -- released, or expired and then released
                END IF;
                IF fin.status = 'settled' THEN
                    fin.excess_tokens := greatest(charged - cap, 0);
                    rec.settled_input_tokens := p_input_tokens[k];
                    rec.settled_output_tokens := p_output_tokens[k];
                    rec.outcome := p_outcomes[k];
                    rec.charged_tokens := charged;
                    changed[i] := true;
                END IF;
            ELSIF p_actions[k] = 'release' THEN
                IF rec.state = 'active' THEN
                    -- the provider was never called: its requests go back too
                    credits := credits || ROW(i, rec.reserved_tokens, rec.reserved_tokens,
                                              rec.request_cost, rec.permits)::lq_layer_credit;
                    changes := changes || ROW(i, 'release', 0, 0)::lq_budget_change;
                    rec.state := 'released';
                    rec.finished_at := now_ts;
                    changed[i] := true;
                    fin.status := 'released';
                ELSIF rec.state = 'released' THEN
                    fin.status := 'replayed';
                ELSE
                    fin.status := 'conflict';
                END IF;
            END IF;

            res[i] := rec;
            fin.state := rec.state;
            fin.charged_tokens := rec.charged_tokens;
            fin.refunded_tokens := rec.refunded_tokens;
            fin.late := rec.late;
        END finish;
        results[k] := fin;
    END LOOP;

    -- (4) Layers: each credit to every layer its reservation debited, what
    -- shared layers forgave, and each reservation's tenant plan.
    SELECT c.forgiven_global, c.forgiven_ceiling, c.forgiven_most, c.plans
      INTO f_global, f_ceiling, f_most, t_plan
      FROM lq_finish_layers(credits, res) AS c;
    FOR k IN 1 .. n LOOP
        IF results[k].status = 'settled' THEN
            i := array_position(ids, p_ids[k]);
            results[k].forgiven_global_tokens := round(f_global[i])::bigint;
            results[k].forgiven_ceiling_tokens := round(f_ceiling[i])::bigint;
            results[k].plan := t_plan[i];
        END IF;
    END LOOP;

    -- (4b) Quotas and prepaid balances; (5) the reservations that changed;
    -- (6) the ledger rows.
    PERFORM lq_finish_budgets(changes, res, now_ts);
    PERFORM lq_finish_write_back(res, changed);
    PERFORM lq_finish_ledger(entries, res, f_most, now_ts);

    -- (7) Completions settled on time and 'ok' feed the learned output
    -- estimates (estimates.sql), whose rows are locked last, in key order.
    PERFORM lq_record_output_samples(array_agg((res[g.place]).tenant),
                                     array_agg((res[g.place]).route),
                                     array_agg((res[g.place]).model), array_agg(g.output_tokens))
       FROM unnest(entries) AS g
      WHERE g.entry_kind = 'usage' AND g.outcome = 'ok';

    RETURN QUERY SELECT * FROM unnest(results);
END
$$;


-- lq_finish's steps after its loop, in the order it takes them. Each reads
-- the reservations it finishes as lq_finish locked them (p_res, in id
-- order) and the entries its loop collected, which name a reservation by
-- its place in p_res.

-- (4) Layers: each credit goes to every layer its reservation debited; the
-- global layer gets the capped one. A provider ceiling takes the full
-- charge: it mirrors what the provider itself counts against the account,
-- and refills within its own minute. A layer's scope never changes, so
-- reading it unlocked is safe; lq_shared_forgiven and then lq_credit_layers
-- lock the layers in layer_id order, after the reservations. A debit that
-- would take a shared layer below minus its burst is forgiven beyond it
-- (lq_shared_forgiven), counted per reservation and scope and at most (for
-- its ledger row). Also each reservation's tenant layer plan, read from the
-- rows this reads anyway.
CREATE OR REPLACE FUNCTION lq_finish_layers(p_credits lq_layer_credit[], p_res reservations[],
                                            OUT forgiven_global double precision[],
                                            OUT forgiven_ceiling double precision[],
                                            OUT forgiven_most double precision[],
                                            OUT plans text[])
LANGUAGE plpgsql
AS $$
DECLARE
    -- one entry per credit and layer
    e_res     integer[];
    e_layer   bigint[];
    e_scope   text[];
    e_tokens  double precision[];
    e_reqs    double precision[];
    e_permits integer[];
    e_forgive double precision[];
    e_plan    text[];
    places    integer := coalesce(cardinality(p_res), 0);
    i         integer;
    k         integer;
BEGIN
    SELECT array_agg(c.i ORDER BY c.o, l.o), array_agg(l.layer_id ORDER BY c.o, l.o),
           array_agg(ll.scope ORDER BY c.o, l.o),
           array_agg(CASE WHEN ll.scope = 'global' THEN c.shared ELSE c.tokens END
                     ORDER BY c.o, l.o),
           array_agg(c.reqs ORDER BY c.o, l.o), array_agg(c.permits ORDER BY c.o, l.o),
           array_agg(ll.plan ORDER BY c.o, l.o)
      INTO e_res, e_layer, e_scope, e_tokens, e_reqs, e_permits, e_plan
      FROM unnest(p_credits) WITH ORDINALITY AS c(i, tokens, shared, reqs, permits, o)
           CROSS JOIN LATERAL unnest((p_res[c.i]).layer_ids) WITH ORDINALITY AS l(layer_id, o)
           JOIN limit_layers AS ll ON ll.layer_id = l.layer_id;
    e_forgive := lq_shared_forgiven(e_layer, e_tokens);
    forgiven_global := array_fill(0::double precision, ARRAY[places]);
    forgiven_ceiling := forgiven_global;
    forgiven_most := forgiven_global;
    plans := array_fill(NULL::text, ARRAY[places]);
    FOR k IN 1 .. coalesce(cardinality(e_res), 0) LOOP
        IF e_scope[k] = 'tenant' THEN
            plans[e_res[k]] := e_plan[k];
        END IF;
        IF e_forgive[k] > 0 THEN
            i := e_res[k];
            e_tokens[k] := e_tokens[k] + e_forgive[k];
            IF e_scope[k] = 'global' THEN
                forgiven_global[i] := forgiven_global[i] + e_forgive[k];
            ELSE
                forgiven_ceiling[i] := forgiven_ceiling[i] + e_forgive[k];
            END IF;
            forgiven_most[i] := greatest(forgiven_most[i], e_forgive[k]);
        END IF;
    END LOOP;
    PERFORM lq_credit_layers(e_layer, e_tokens, e_reqs, e_permits);
END
$$;

-- (4b) The calendar quotas and the prepaid balance the reservations held:
-- each gives back what it reserved, and a settlement charges what was used
-- (tokens, and money at the prices in force now) to the window it happens
-- in (a window boundary crossed while the reservation was open takes the
-- charge in the new window; see lq_quota_settle). In the lock order of
-- quotas.sql, after the layers: windows by quota and window, then credit
-- accounts by tenant. Usage a worker admitted during an outage counts at the
-- moment its journal says it happened (usage_at, set by lq_finish_outage in
-- reliability.sql), not at the replay.
CREATE OR REPLACE FUNCTION lq_finish_budgets(p_changes lq_budget_change[], p_res reservations[],
                                             p_now timestamptz)
RETURNS void
LANGUAGE plpgsql
AS $$
DECLARE
    b     record;
    rec   reservations;
    money numeric;
BEGIN
    FOR b IN SELECT u.i, u.mode, u.in_tok, u.out_tok, q.qid
               FROM unnest(p_changes) WITH ORDINALITY AS u(i, mode, in_tok, out_tok, o),
                    unnest((p_res[u.i]).quota_ids) AS q(qid)
              ORDER BY q.qid, (p_res[u.i]).created_at, u.o LOOP
        rec := p_res[b.i];
        money := CASE WHEN b.mode IN ('settle', 'late')
                      THEN coalesce(lq_cost(rec.model, b.in_tok, b.out_tok,
                                            coalesce(rec.usage_at, p_now)), 0) ELSE 0 END;
        IF b.mode = 'late' THEN
            -- the expiry gave the reservation back already
            PERFORM lq_quota_apply(b.qid, coalesce(rec.usage_at, p_now), 0,
                                   b.in_tok + b.out_tok, 0, money);
        ELSE
            PERFORM lq_quota_settle(b.qid, rec.created_at, rec.reserved_tokens,
                                    coalesce(rec.reserved_cost, 0),
                                    coalesce(rec.usage_at, p_now),
                                    b.in_tok + b.out_tok, money);
        END IF;
    END LOOP;
    FOR b IN SELECT u.i, u.mode, u.in_tok, u.out_tok
               FROM unnest(p_changes) WITH ORDINALITY AS u(i, mode, in_tok, out_tok, o)
              WHERE (p_res[u.i]).credit_reserved IS NOT NULL
              ORDER BY (p_res[u.i]).tenant, u.o LOOP
        rec := p_res[b.i];
        money := NULL;
        IF b.mode IN ('settle', 'late') THEN
            -- priced now; a price removed since admission charges what was held
            money := coalesce(lq_cost(rec.model, b.in_tok, b.out_tok,
                                      coalesce(rec.usage_at, p_now)),
                              rec.credit_reserved);
        END IF;
        PERFORM lq_credit_apply(rec.tenant, rec.reservation_id,
                                CASE WHEN b.mode = 'late' THEN 0 ELSE -rec.credit_reserved END,
                                money);
    END LOOP;
END
$$;

-- (5) Write back the reservations that changed (p_changed, by place).
CREATE OR REPLACE FUNCTION lq_finish_write_back(p_res reservations[], p_changed boolean[])
RETURNS void
LANGUAGE plpgsql
AS $$
BEGIN
    UPDATE reservations AS rs
       SET state = u.state,
           finished_at = u.finished_at,
           settled_input_tokens = u.settled_input_tokens,
           settled_output_tokens = u.settled_output_tokens,
           outcome = u.outcome,
           charged_tokens = u.charged_tokens,
           refunded_tokens = u.refunded_tokens,
           late = u.late
      FROM unnest(p_res) WITH ORDINALITY AS u
     WHERE rs.reservation_id = u.reservation_id
       AND p_changed[u.ordinality::integer];
END
$$;

-- (6) Append the ledger rows, stamped with p_now (the month partition is
-- picked from it; the DEFAULT partition takes a month with none), each with
-- how its request was served (its serving_path, from lq_finish's (2) and
-- (3)). The ledger's receipt trigger writes (reservation_id, entry_kind)
-- into ledger_receipts in this same statement, and its primary key makes a
-- second row for the same event impossible, not merely unlikely: the whole
-- call would fail and roll back (see ledger.sql). What a shared layer
-- forgave (p_forgiven_most, by place) belongs to the settlement's row, not
-- to the expiry's (which credits, never debits).
CREATE OR REPLACE FUNCTION lq_finish_ledger(p_entries lq_ledger_entry[], p_res reservations[],
                                            p_forgiven_most double precision[],
                                            p_now timestamptz)
RETURNS void
LANGUAGE plpgsql
AS $$
BEGIN
    INSERT INTO usage_ledger (reservation_id, entry_kind, tenant, route, model,
                              input_tokens, output_tokens, reserved_tokens, outcome,
                              policy_version, excess_tokens, forgiven_tokens, recorded_at,
                              usage_source, reported_input_tokens, reported_output_tokens,
                              serving_path)
    SELECT (p_res[g.place]).reservation_id, g.entry_kind, (p_res[g.place]).tenant,
           (p_res[g.place]).route, (p_res[g.place]).model, g.input_tokens, g.output_tokens,
           g.reserved_tokens, g.outcome, (p_res[g.place]).policy_version, g.excess_tokens,
           CASE WHEN g.outcome = 'expired' THEN 0
                ELSE round(p_forgiven_most[g.place])::bigint END,
           p_now, g.usage_source, g.reported_input, g.reported_output, g.serving_path
      FROM unnest(p_entries) AS g;
END
$$;


-- The sweeper's step: expire up to p_limit reservations whose lease ran out.
-- SKIP LOCKED lets several sweepers (and settlements in flight) work side by
-- side: a row another transaction holds is simply someone else's to finish.
CREATE OR REPLACE FUNCTION lq_sweep(p_limit integer)
RETURNS TABLE (expired integer, tokens_returned bigint)
LANGUAGE plpgsql
AS $$
DECLARE
    due    uuid[];
    lapsed uuid[];
BEGIN
    SELECT array_agg(d.reservation_id ORDER BY d.reservation_id)
      INTO due
      FROM (SELECT rs.reservation_id
              FROM reservations AS rs
             WHERE rs.state = 'active'
               AND rs.lease_expires_at <= clock_timestamp()
             ORDER BY rs.lease_expires_at
             LIMIT p_limit
               FOR UPDATE SKIP LOCKED) AS d;
    IF due IS NULL THEN
        RETURN QUERY SELECT 0, 0::bigint;
        RETURN;
    END IF;

    -- Finished first, then counted by another statement: Citus refuses a
    -- statement on a cell's tables that calls a function running statements
    -- of its own (lq_finish beside a join with reservations).
    SELECT array_agg(due[f.ord]) INTO lapsed
      FROM lq_finish(due,
                     array_fill('expire'::text, ARRAY[cardinality(due)]),
                     array_fill(NULL::text, ARRAY[cardinality(due)]),
                     array_fill(NULL::bigint, ARRAY[cardinality(due)]),
                     array_fill(NULL::bigint, ARRAY[cardinality(due)]),
                     array_fill(NULL::text, ARRAY[cardinality(due)])) AS f
     WHERE f.status = 'expired';
    RETURN QUERY
    SELECT count(*)::integer, coalesce(sum(rs.reserved_tokens), 0)::bigint
      FROM reservations AS rs
     WHERE rs.reservation_id = ANY (lapsed);
END
$$;
