-- Allotments: a worker takes a slice of its layers' room in one statement and
-- decides a tenant's requests from it in memory (admission/allotments.py).
--
-- A slice is a real debit. lq_allot takes it from every layer a request of
-- its (tenant, route, model, API key) passes, exactly as an admission of
-- that many tokens and requests would, so the room the layers hold plus the
-- room every allotment holds never exceeds capacity plus refill: nothing
-- decided from a slice can exceed what lq_admit would have allowed over the
-- same interval. The worker moves room from the slice to the reservations it
-- admitted (lq_allot_journal, batched); settlement, release and expiry of
-- those reservations are lq_finish's, as for any other. What a slice still
-- holds goes back, clamped at capacity (lq_credit_layers), when the worker
-- returns it (lq_allot_return) or, for a worker that died, when the sweeper
-- finds it past its expiry (lq_allot_sweep).
--
-- Which requests: a tenant (or route) whose policy says admission
-- 'allotted', whose layers have no max_in_flight, no weighted calls and no
-- prepaid credit, with no calendar quota and no provider ceiling matching
-- the model. Everything else is decided exactly: a permit is held per live
-- request and given back per request, a quota and a credit balance are
-- charged by price, and a ceiling carries a shedding ladder and chooses
-- deployments per request; none of them splits into idle slices without
-- denying the room to everyone else for the slice's lifetime.
--
-- Lock order (admission.sql's classes): limit_layers rows in layer_id order,
-- then allotment rows. lq_allot and lq_allot_return lock layers first;
-- lq_allot_journal locks only allotment rows (and writes new reservations).


-- Take a slice, or top one up: at most p_tokens tokens and p_requests
-- requests, and never more than p_share of any layer's room, so that the
-- slices shrink as the layers' room does. Statuses:
--   allotted  granted_tokens and granted_requests were added to the slice
--   low       less than p_min_tokens (or one request) could be granted:
--             the layers are near their limits, decide exactly
--   exact     the request's layers are not decided from slices (see above)
--   unknown   the tenant has no policy
--   stale     the slice was taken under other layers or policies, or it is
--             a top-up of a slice that is gone (the sweeper returned it
--             while its worker was away: what the worker thinks it holds
--             went back to the layers): return it and take a new one
-- room_tokens and room_requests are the tightest layer's balances after the
-- grant (NULL: no such limit); the tenant_* columns and plan are its tenant
-- layer's, the binding_* ones those of its token layer with the least left
-- (as lq_admit answers them for the X-TokenLimit-* headers).
CREATE OR REPLACE FUNCTION lq_allot(
    p_allotment_id uuid,
    p_tenant       text,
    p_route        text,
    p_model        text,
    p_key_id       bigint,
    p_tokens       bigint,
    p_requests     bigint,
    p_share        double precision,
    p_min_tokens   bigint,
    p_holder       text,
    p_hold_seconds integer,
    p_top_up       boolean   -- the worker holds this slice already (it was granted)
) RETURNS TABLE (
    status                     text,
    granted_tokens             bigint,
    granted_requests           bigint,
    lease_seconds              integer,
    room_tokens                double precision,
    room_requests              double precision,
    tenant_tokens_per_minute   bigint,
    tenant_token_burst         bigint,
    tenant_tokens              double precision,
    tenant_requests_per_minute bigint,
    tenant_request_burst       bigint,
    tenant_requests            double precision,
    plan                       text,
    binding_tokens_per_minute  bigint,   -- the token layer with the least left
    binding_token_burst        bigint,
    binding_tokens             double precision,
    now_ts                     timestamptz
)
LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan
AS $$
DECLARE
    ids        bigint[];
    v_now      timestamptz;
    v_status   text;
    v_version  bigint;
    v_lease    integer;
    v_room_t   double precision;
    v_room_r   double precision;
    v_min_burst bigint;
    v_grant_t  bigint := 0;
    v_grant_r  bigint := 0;
    t          limit_layers%ROWTYPE;
    bl         limit_layers%ROWTYPE;
BEGIN
    SELECT array_agg(b.id ORDER BY b.id) INTO ids
      FROM lq_batch_layers(ARRAY[p_tenant], ARRAY[p_route], false, ARRAY[p_key_id]) AS b(id);

    -- (1) Lock the layers in layer_id order, then read the clock.
    PERFORM 1 FROM limit_layers AS l WHERE l.layer_id = ANY (ids) ORDER BY l.layer_id FOR UPDATE;
    SELECT greatest(clock_timestamp(), max(l.refilled_at)) INTO v_now
      FROM limit_layers AS l WHERE l.layer_id = ANY (ids);
    SELECT * INTO t FROM limit_layers AS l
     WHERE l.layer_id = ANY (ids) AND l.scope = 'tenant';

    -- (2) Is this request's admission allotted at all?
    IF t.layer_id IS NULL THEN
        v_status := 'unknown';
    ELSIF coalesce((SELECT r.admission FROM limit_layers AS r
                     WHERE r.layer_id = ANY (ids) AND r.scope = 'route'), t.admission,
                   'exact') <> 'allotted'
       OR EXISTS (SELECT 1 FROM limit_layers AS l
                   WHERE l.layer_id = ANY (ids)
                     AND (l.max_in_flight IS NOT NULL OR l.request_cost IS NOT NULL
                          OR l.uses_concurrency IS NOT NULL OR l.prepaid))
       OR EXISTS (SELECT 1 FROM quotas AS q WHERE q.tenant = p_tenant)
       OR EXISTS (SELECT 1 FROM limit_layers AS c
                   WHERE c.scope = 'ceiling'
                     AND p_model LIKE ANY (c.model_patterns)) THEN
        v_status := 'exact';
    END IF;

    IF v_status IS NULL THEN
        SELECT max(l.policy_version),
               coalesce(min(l.lease_seconds) FILTER (WHERE l.scope = 'route'), t.lease_seconds),
               min(lq_refilled(l.tokens, l.tokens_per_minute, l.token_burst, l.refilled_at, v_now)),
               min(lq_refilled(l.requests, l.requests_per_minute, l.request_burst,
                               l.refilled_at, v_now)),
               min(l.token_burst)
          INTO v_version, v_lease, v_room_t, v_room_r, v_min_burst
          FROM limit_layers AS l WHERE l.layer_id = ANY (ids);
        IF EXISTS (SELECT 1 FROM allotments AS a
                    WHERE a.allotment_id = p_allotment_id
                      AND (a.layer_ids <> ids OR a.policy_version <> v_version))
           OR (p_top_up AND NOT EXISTS (SELECT 1 FROM allotments AS a
                                         WHERE a.allotment_id = p_allotment_id)) THEN
            v_status := 'stale';
        END IF;
    END IF;

    -- (3) The grant: what was asked, at most p_share of the tightest room.
    IF v_status IS NULL THEN
        v_grant_t := CASE WHEN v_room_t IS NULL THEN p_tokens
                          ELSE least(p_tokens, floor(greatest(v_room_t, 0) * p_share)::bigint) END;
        v_grant_r := CASE WHEN v_room_r IS NULL THEN p_requests
                          ELSE least(p_requests, floor(greatest(v_room_r, 0) * p_share)::bigint) END;
        IF v_grant_t < p_min_tokens OR v_grant_r < 1
           OR p_min_tokens > coalesce(v_min_burst, p_min_tokens) THEN
            v_status := 'low';
            v_grant_t := 0;
            v_grant_r := 0;
        END IF;
    END IF;

    -- (4) Debit every layer and hold the grant in the slice.
    IF v_status IS NULL THEN
        UPDATE limit_layers AS l
           SET tokens = lq_refilled(l.tokens, l.tokens_per_minute, l.token_burst,
                                    l.refilled_at, v_now) - v_grant_t,
               requests = lq_refilled(l.requests, l.requests_per_minute, l.request_burst,
                                      l.refilled_at, v_now) - v_grant_r,
               refilled_at = v_now
         WHERE l.layer_id = ANY (ids);
        INSERT INTO allotments AS a (allotment_id, tenant, route, model, api_key_id, layer_ids,
                                     policy_version, lease_seconds, tokens, requests, holder,
                                     created_at, expires_at)
        VALUES (p_allotment_id, p_tenant, p_route, p_model, p_key_id, ids, v_version, v_lease,
                v_grant_t, v_grant_r, p_holder, v_now,
                v_now + make_interval(secs => p_hold_seconds))
        ON CONFLICT (allotment_id) DO UPDATE
           SET tokens = a.tokens + excluded.tokens,
               requests = a.requests + excluded.requests,
               expires_at = greatest(a.expires_at, excluded.expires_at);
        v_status := 'allotted';
        v_room_t := v_room_t - v_grant_t;
        v_room_r := v_room_r - v_grant_r;
        SELECT * INTO t FROM limit_layers AS l WHERE l.layer_id = t.layer_id;
        SELECT * INTO bl FROM limit_layers AS l
         WHERE l.layer_id = ANY (ids) AND l.tokens_per_minute IS NOT NULL
         ORDER BY l.tokens, l.layer_id LIMIT 1;
    END IF;

    RETURN QUERY
    SELECT v_status, v_grant_t, v_grant_r, v_lease, v_room_t, v_room_r,
           t.tokens_per_minute, t.token_burst, t.tokens,
           t.requests_per_minute, t.request_burst, t.requests, t.plan,
           bl.tokens_per_minute, bl.token_burst, bl.tokens, v_now;
END
$$;


-- Journal what a worker admitted from its slices: each admission becomes a
-- reservation (state active, the slice's layers, one request, no permit),
-- and its tokens and request move from the slice to it. One statement per
-- flush; the slices are locked (their rows only, never a layer). Returns,
-- per slice named, how many of its admissions were journaled: none when the
-- slice is gone (the sweeper returned it: its worker was away past its
-- expiry), and the worker then journals them with lq_allot_orphans.
-- A journaled slice's expiry moves to p_hold_seconds from now. The clock is
-- read once into a variable (Citus refuses a volatile call in an UPDATE).
CREATE OR REPLACE FUNCTION lq_allot_journal(
    p_allotment_ids   uuid[],
    p_reservation_ids uuid[],
    p_input_tokens    bigint[],
    p_input_estimated boolean[],
    p_max_tokens      bigint[],
    p_reserved        bigint[],
    p_lease_seconds   integer[],  -- NULL entries: the slice's
    p_upstreams       text[],     -- the deployment each goes to (NULL: none named)
    p_hold_seconds    integer
) RETURNS TABLE (allotment_id uuid, journaled integer)
LANGUAGE plpgsql
AS $$
#variable_conflict use_column
DECLARE
    now_ts constant timestamptz := clock_timestamp();
BEGIN
    RETURN QUERY
    WITH entry AS (
        -- (an admission journaled already, by a write whose answer was lost, is
        -- not journaled again)
        SELECT u.*
          FROM unnest(p_allotment_ids, p_reservation_ids, p_input_tokens, p_input_estimated,
                      p_max_tokens, p_reserved, p_lease_seconds, p_upstreams)
               AS u(aid, rid, input, estimated, max_tokens, reserved, lease, upstream)
         WHERE NOT EXISTS (SELECT 1 FROM reservations AS r WHERE r.reservation_id = u.rid)
    ), moved AS (
        UPDATE allotments AS a
           SET tokens = a.tokens - s.tokens,
               requests = a.requests - s.requests,
               expires_at = greatest(a.expires_at,
                                     now_ts + make_interval(secs => p_hold_seconds))
          FROM (SELECT e.aid, sum(e.reserved) AS tokens, count(*) AS requests
                  FROM entry AS e GROUP BY e.aid) AS s
         WHERE a.allotment_id = s.aid
        RETURNING a.allotment_id, a.tenant, a.route, a.model, a.layer_ids, a.policy_version,
                  a.lease_seconds
    ), written AS (
        INSERT INTO reservations (reservation_id, tenant, route, model, layer_ids, input_tokens,
                                  input_estimated, max_tokens, reserved_tokens, policy_version,
                                  created_at, lease_seconds, lease_expires_at, request_cost,
                                  permits, allotment_id, upstream)
        SELECT e.rid, m.tenant, m.route, m.model, m.layer_ids, e.input, e.estimated,
               e.max_tokens, e.reserved, m.policy_version, now_ts,
               coalesce(e.lease, m.lease_seconds),
               now_ts + make_interval(secs => coalesce(e.lease, m.lease_seconds)),
               1, 0, m.allotment_id, e.upstream
          FROM entry AS e JOIN moved AS m ON m.allotment_id = e.aid
        RETURNING reservations.allotment_id
    )
    SELECT s.aid, (SELECT count(*) FROM written AS w WHERE w.allotment_id = s.aid)::integer
      FROM (SELECT DISTINCT u.aid FROM unnest(p_allotment_ids) AS u(aid)) AS s;
END
$$;


-- Journal admissions whose slice is gone (returned by the sweeper while
-- its worker was away): their room went back to the layers, so it is
-- debited again now, from the layers a request of (tenant, route, API key)
-- passes today, as an outage replay debits (lq_credit_layers with a
-- negative credit: a shared layer stops at minus its burst, a tenant's own
-- debt is its own), and each becomes a reservation as lq_allot_journal's.
-- Returns how many were journaled (a reservation id already journaled is
-- not written twice).
CREATE OR REPLACE FUNCTION lq_allot_orphans(
    p_tenant          text,
    p_route           text,
    p_model           text,
    p_key_id          bigint,
    p_reservation_ids uuid[],
    p_input_tokens    bigint[],
    p_input_estimated boolean[],
    p_max_tokens      bigint[],
    p_reserved        bigint[],
    p_lease_seconds   integer[],
    p_upstreams       text[]
) RETURNS integer
LANGUAGE plpgsql
AS $$
DECLARE
    now_ts   constant timestamptz := clock_timestamp();
    ids      bigint[];
    v_lease  integer;
    v_version bigint;
    v_tokens bigint;
    v_count  integer;
BEGIN
    SELECT array_agg(b.id ORDER BY b.id) INTO ids
      FROM lq_batch_layers(ARRAY[p_tenant], ARRAY[p_route], false, ARRAY[p_key_id]) AS b(id);
    SELECT coalesce(min(l.lease_seconds) FILTER (WHERE l.scope = 'route'),
                    min(l.lease_seconds) FILTER (WHERE l.scope = 'tenant'), 120),
           coalesce(max(l.policy_version), 0)
      INTO v_lease, v_version
      FROM limit_layers AS l WHERE l.layer_id = ANY (ids);

    WITH written AS (
        INSERT INTO reservations (reservation_id, tenant, route, model, layer_ids, input_tokens,
                                  input_estimated, max_tokens, reserved_tokens, policy_version,
                                  created_at, lease_seconds, lease_expires_at, request_cost,
                                  permits, upstream)
        SELECT u.rid, p_tenant, p_route, p_model, coalesce(ids, '{}'), u.input, u.estimated,
               u.max_tokens, u.reserved, v_version, now_ts,
               coalesce(u.lease, v_lease),
               now_ts + make_interval(secs => coalesce(u.lease, v_lease)), 1, 0,
               u.upstream
          FROM unnest(p_reservation_ids, p_input_tokens, p_input_estimated, p_max_tokens,
                      p_reserved, p_lease_seconds, p_upstreams)
               AS u(rid, input, estimated, max_tokens, reserved, lease, upstream)
        ON CONFLICT (reservation_id) DO NOTHING
        RETURNING reserved_tokens
    )
    SELECT coalesce(sum(w.reserved_tokens), 0), count(*) INTO v_tokens, v_count FROM written AS w;

    IF v_count > 0 AND ids IS NOT NULL THEN
        PERFORM lq_credit_layers(ids,
                                 array_fill(-v_tokens::double precision, ARRAY[cardinality(ids)]),
                                 array_fill(-v_count::double precision, ARRAY[cardinality(ids)]),
                                 array_fill(0, ARRAY[cardinality(ids)]));
    END IF;
    RETURN v_count;
END
$$;


-- Give back what slices still hold, clamped at capacity, and forget them.
-- p_expired_only: only those past their expiry (the sweeper's call; a slice
-- journaled meanwhile was renewed and stays). The layers are locked first
-- (every global row too when the global layer is sharded, as
-- lq_credit_layers locks them), then the slices.
CREATE OR REPLACE FUNCTION lq_allot_return(p_allotment_ids uuid[], p_expired_only boolean)
RETURNS TABLE (returned integer, tokens bigint, requests bigint)
LANGUAGE plpgsql
AS $$
DECLARE
    now_ts  constant timestamptz := clock_timestamp();
    ids     bigint[];
    sharded boolean;
    r_layer bigint[];
    r_tok   double precision[];
    r_req   double precision[];
    n       integer;
    tok     bigint;
    req     bigint;
BEGIN
    SELECT array_agg(DISTINCT x.id) INTO ids
      FROM allotments AS a, unnest(a.layer_ids) AS x(id)
     WHERE a.allotment_id = ANY (p_allotment_ids);
    sharded := EXISTS (SELECT 1 FROM limit_layers AS g
                        WHERE g.layer_id = ANY (ids) AND g.scope = 'global' AND g.shards > 1);
    PERFORM 1 FROM limit_layers AS l
      WHERE l.layer_id = ANY (ids) OR (sharded AND l.scope = 'global')
      ORDER BY l.layer_id
        FOR UPDATE;

    WITH gone AS (
        DELETE FROM allotments AS a
         WHERE a.allotment_id = ANY (p_allotment_ids)
           AND (NOT p_expired_only OR a.expires_at <= now_ts)
        RETURNING a.layer_ids, a.tokens, a.requests
    ), per_layer AS (
        SELECT x.id, g.tokens, g.requests FROM gone AS g, unnest(g.layer_ids) AS x(id)
    )
    SELECT (SELECT count(*) FROM gone)::integer,
           (SELECT coalesce(sum(g.tokens), 0) FROM gone AS g)::bigint,
           (SELECT coalesce(sum(g.requests), 0) FROM gone AS g)::bigint,
           (SELECT array_agg(p.id) FROM per_layer AS p),
           (SELECT array_agg(p.tokens::double precision) FROM per_layer AS p),
           (SELECT array_agg(p.requests::double precision) FROM per_layer AS p)
      INTO n, tok, req, r_layer, r_tok, r_req;

    IF r_layer IS NOT NULL THEN
        PERFORM lq_credit_layers(r_layer, r_tok, r_req,
                                 array_fill(0, ARRAY[cardinality(r_layer)]));
    END IF;
    RETURN QUERY SELECT n, tok, req;
END
$$;


-- The sweeper's part: return up to p_limit slices past their expiry (a
-- worker that died, or was away longer than it holds a slice).
-- The slices are read first, then returned by another statement: Citus
-- refuses a statement on a cell's tables that calls a function running
-- statements of its own.
CREATE OR REPLACE FUNCTION lq_allot_sweep(p_limit integer)
RETURNS TABLE (returned integer, tokens bigint, requests bigint)
LANGUAGE plpgsql
AS $$
DECLARE
    due uuid[];
BEGIN
    due := ARRAY(SELECT a.allotment_id FROM allotments AS a
                  WHERE a.expires_at <= clock_timestamp()
                  ORDER BY a.expires_at
                  LIMIT p_limit);
    RETURN QUERY SELECT r.returned, r.tokens, r.requests FROM lq_allot_return(due, true) AS r;
END
$$;
