-- The global layer, whole or sharded (migration 0012).
--
-- With `shards` K > 1 its limits are split over K rows of scope 'global':
-- shard i holds total / K of every rate, burst and in-flight bound, plus one
-- of the remainder when i < total mod K, so the shares sum to the policy's
-- figures exactly. An admission takes its tenant's shard (lq_tenant_shard in
-- admission.sql) and pools them all when its shard is short. Everything that
-- reads the global layer as a policy reads the view global_layer: the rows
-- summed back into one.
--
-- A repeatable script (see migrations/README.md).


-- Shard i's part of a total split K ways; NULL (no limit) stays NULL.
CREATE OR REPLACE FUNCTION lq_shard_share(p_total bigint, p_shard integer, p_shards integer)
RETURNS bigint
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$
    SELECT p_total / p_shards + CASE WHEN p_shard < p_total % p_shards THEN 1 ELSE 0 END
$$;


-- Create or replace the global policy, split over p_shards rows (NULL: as
-- many as now, 1 for a new layer); its new policy_version.
--
-- One policy change at a time (an advisory lock: with no global row yet,
-- row locks would not order two first calls), then the reservations that
-- name a row beyond the new count, in reservation_id order, then every
-- global row, in layer_id order (the order of admission.sql's header).
-- The balance under the old rules, refilled to now and summed over the old
-- shards, is clamped to the new burst (lq_rebalanced: a limit new to the
-- layer starts full; and never below minus it, as lq_shared_forgiven keeps
-- it) and split over the new shards in proportion to their burst. Rows
-- below the new count stay (same layer_id) and keep their permits in
-- flight. Changing the count conserves tokens: the rows beyond it are
-- deleted only after their open reservations (active, or expired and not
-- yet settled late) are moved onto the surviving row shard mod K, with
-- their permits, so that a release, settlement or expiry gives back (or
-- debits) exactly what it took, whatever sequence of counts came between.
-- (A reservation admitted on a doomed row between the two lock steps is
-- moved too; should its settlement hold it then, the deadlock detector
-- rolls one of the two back, and nothing is half done.)
-- A sharded layer has no max_in_flight: permits are counted on the row a
-- reservation names, and a count of K changing under open reservations
-- would let the rows' counts and shares disagree; so in-flight caps stay on
-- tenants, routes, ceilings and an unsharded global layer.
CREATE OR REPLACE FUNCTION lq_put_global(
    p_tpm          bigint,
    p_tburst       bigint,
    p_rpm          bigint,
    p_rburst       bigint,
    p_max_if       integer,
    p_lease        integer,
    p_failure_mode text,
    p_shards       smallint
) RETURNS bigint
LANGUAGE plpgsql
AS $$
DECLARE
    now_ts   timestamptz;
    old      record;
    k        integer;
    version  bigint;
    tokens   double precision;
    requests double precision;
    shrinks  boolean;
BEGIN
    PERFORM pg_advisory_xact_lock(hashtextextended('llmquota.global_layer', 0));
    -- Taken under the lock, so that the write committed last has the highest.
    version := nextval('policy_version_seq');
    -- The count changes only under the advisory lock held now: read unlocked.
    k := coalesce(p_shards, (SELECT max(l.shards) FROM limit_layers AS l WHERE l.scope = 'global'),
                  1);
    shrinks := EXISTS (SELECT 1 FROM limit_layers AS l WHERE l.scope = 'global' AND l.shard >= k);
    IF shrinks THEN
        -- reservations name their layers in an array (no index): read them
        -- only when the count goes down, a rare policy change
        PERFORM 1 FROM reservations AS r
          WHERE r.layer_ids && ARRAY(SELECT l.layer_id FROM limit_layers AS l
                                      WHERE l.scope = 'global' AND l.shard >= k)
            AND (r.state = 'active' OR (r.state = 'expired' AND r.charged_tokens IS NULL))
          ORDER BY r.reservation_id
            FOR UPDATE;
    END IF;
    PERFORM 1 FROM limit_layers WHERE scope = 'global' ORDER BY layer_id FOR UPDATE;
    SELECT greatest(clock_timestamp(), max(l.refilled_at)) AS at,
           sum(l.tokens_per_minute)::bigint AS tpm, sum(l.token_burst)::bigint AS tburst,
           sum(l.requests_per_minute)::bigint AS rpm, sum(l.request_burst)::bigint AS rburst,
           max(l.shards) AS shards
      INTO old
      FROM limit_layers AS l
     WHERE l.scope = 'global';
    now_ts := coalesce(old.at, clock_timestamp());
    -- the old balance, refilled shard by shard (each up to its own burst)
    SELECT sum(lq_refilled(l.tokens, l.tokens_per_minute, l.token_burst, l.refilled_at, now_ts)),
           sum(lq_refilled(l.requests, l.requests_per_minute, l.request_burst, l.refilled_at,
                           now_ts))
      INTO tokens, requests
      FROM limit_layers AS l
     WHERE l.scope = 'global';
    tokens := lq_rebalanced(tokens, old.tpm, old.tburst, now_ts, p_tpm, p_tburst, now_ts);
    requests := lq_rebalanced(requests, old.rpm, old.rburst, now_ts, p_rpm, p_rburst, now_ts);
    IF tokens IS NOT NULL THEN
        tokens := greatest(-p_tburst::double precision, tokens);
    END IF;

    IF k < 1 OR k > 64 OR least(p_tpm, p_tburst, p_rpm, p_rburst) < k
       OR (k > 1 AND p_max_if IS NOT NULL) THEN
        RAISE EXCEPTION USING ERRCODE = 'invalid_parameter_value',
              MESSAGE = 'shards must be 1 to 64, at most every rate and burst of the global '
                        'layer, and 1 with max_in_flight';
    END IF;

    -- Open reservations and their permits onto the surviving rows, then the
    -- rows beyond the count go (their balance is in `tokens` above).
    IF shrinks THEN
        UPDATE reservations AS r
           SET layer_ids = array_replace(r.layer_ids, gone.layer_id, kept.layer_id)
          FROM limit_layers AS gone
          JOIN limit_layers AS kept
            ON kept.scope = 'global' AND kept.shard = gone.shard % k
         WHERE gone.scope = 'global' AND gone.shard >= k
           AND r.layer_ids @> ARRAY[gone.layer_id]
           AND (r.state = 'active' OR (r.state = 'expired' AND r.charged_tokens IS NULL));
        UPDATE limit_layers AS l
           SET in_flight = l.in_flight + m.in_flight
          FROM (SELECT g.shard % k AS shard, sum(g.in_flight)::integer AS in_flight
                  FROM limit_layers AS g
                 WHERE g.scope = 'global' AND g.shard >= k
                 GROUP BY 1) AS m
         WHERE l.scope = 'global' AND l.shard = m.shard;
        DELETE FROM limit_layers WHERE scope = 'global' AND shard >= k;
    END IF;
    INSERT INTO limit_layers AS l (scope, shard, shards, tokens_per_minute, token_burst,
                                   requests_per_minute, request_burst, max_in_flight,
                                   lease_seconds, failure_mode, policy_version,
                                   tokens, requests, refilled_at)
    SELECT 'global', s.i, k, lq_shard_share(p_tpm, s.i, k), lq_shard_share(p_tburst, s.i, k),
           lq_shard_share(p_rpm, s.i, k), lq_shard_share(p_rburst, s.i, k),
           lq_shard_share(p_max_if, s.i, k)::integer, p_lease, p_failure_mode, version,
           least(lq_shard_share(p_tburst, s.i, k),
                 tokens * lq_shard_share(p_tburst, s.i, k) / p_tburst),
           least(lq_shard_share(p_rburst, s.i, k),
                 requests * lq_shard_share(p_rburst, s.i, k) / p_rburst),
           now_ts
      FROM generate_series(0, k - 1) AS s(i)
    ON CONFLICT (scope, tenant, route, ceiling, shard, api_key_id) DO UPDATE
       SET shards              = excluded.shards,
           tokens_per_minute   = excluded.tokens_per_minute,
           token_burst         = excluded.token_burst,
           requests_per_minute = excluded.requests_per_minute,
           request_burst       = excluded.request_burst,
           -- the new share, and the permits the rebalancer moved stay moved
           -- (lq_send_permits; kept while there is no cap, for when there is)
           max_in_flight       = excluded.max_in_flight + l.in_flight_moved,
           lease_seconds       = excluded.lease_seconds,
           failure_mode        = excluded.failure_mode,
           policy_version      = excluded.policy_version,
           tokens              = excluded.tokens,
           requests            = excluded.requests,
           refilled_at         = excluded.refilled_at;

    RETURN version;
END
$$;


-- The global layer as one: its rows summed (no row when it has no policy).
-- tokens and requests are refilled to now (read only).
CREATE OR REPLACE VIEW global_layer AS
SELECT min(l.layer_id) AS layer_id,
       'global'::text AS scope,
       NULL::text AS tenant,
       NULL::text AS route,
       NULL::text AS plan,
       sum(l.tokens_per_minute)::bigint AS tokens_per_minute,
       sum(l.token_burst)::bigint AS token_burst,
       sum(l.requests_per_minute)::bigint AS requests_per_minute,
       sum(l.request_burst)::bigint AS request_burst,
       sum(l.max_in_flight)::integer AS max_in_flight,
       max(l.lease_seconds) AS lease_seconds,
       max(l.failure_mode) AS failure_mode,
       max(l.policy_version) AS policy_version,
       sum(l.in_flight)::integer AS in_flight,
       sum(lq_refilled(l.tokens, l.tokens_per_minute, l.token_burst, l.refilled_at,
                       clock_timestamp())) AS tokens,
       sum(lq_refilled(l.requests, l.requests_per_minute, l.request_burst, l.refilled_at,
                       clock_timestamp())) AS requests,
       max(l.shards) AS shards,
       -- permits the rebalancer moved into this cell's slice (migration 0035):
       -- max_in_flight is the cap, max_in_flight - in_flight_moved the policy's
       sum(l.in_flight_moved)::integer AS in_flight_moved
  FROM limit_layers AS l
 WHERE l.scope = 'global'
HAVING count(*) > 0;



-- Budget moved between the slices of shared layers in cells (migration 0034).
--
-- In a database of cells each cell holds a slice of every shared layer (the
-- global layer, each provider ceiling), and an admission takes only from its
-- own cell's. The rebalancer (admission/rebalancer.py) moves unused room from
-- a slice that has it to one that is short, in two transactions on two
-- nodes: lq_send_budget debits the sender and journals an 'out' row,
-- lq_receive_budget credits the receiver and journals an 'in' row under the
-- same transfer_id (a second delivery is a no-op), and lq_confirm_budget
-- marks the 'out' row delivered. Stopped between the two, the room is
-- stranded in the journal until the next round delivers it: never created,
-- so the cells together never admit more than the policy. A layer is named
-- by its ceiling (NULL: the global layer); a sharded global layer's rows are
-- pooled as one, as in lq_credit_layers.


-- The room of this cell's slice of every shared layer now: its rows
-- refilled and summed (NULL for a limit it does not have).
CREATE OR REPLACE FUNCTION lq_shared_rooms()
RETURNS TABLE (ceiling text, tokens double precision, requests double precision,
               token_burst bigint, request_burst bigint)
LANGUAGE plpgsql
AS $$
DECLARE
    now_ts timestamptz := clock_timestamp();
BEGIN
    RETURN QUERY
    SELECT l.ceiling,
           sum(lq_refilled(l.tokens, l.tokens_per_minute, l.token_burst, l.refilled_at, now_ts)),
           sum(lq_refilled(l.requests, l.requests_per_minute, l.request_burst, l.refilled_at,
                           now_ts)),
           sum(l.token_burst)::bigint, sum(l.request_burst)::bigint
      FROM limit_layers AS l
     WHERE l.scope IN ('global', 'ceiling')
     GROUP BY l.ceiling
     ORDER BY l.ceiling NULLS FIRST;
END
$$;


-- Debit up to p_tokens and p_requests from this cell's slice of the shared
-- layer p_ceiling for the cell p_to, never leaving it below p_keep_tokens
-- and p_keep_requests (the share the rebalancer leaves the sender), and
-- journal the move; what was debited. Called again with the same transfer_id
-- it debits nothing more and answers what the first call did (the
-- rebalancer's retry after a lost reply).
CREATE OR REPLACE FUNCTION lq_send_budget(
    p_transfer_id   uuid,
    p_ceiling       text,
    p_to            text,
    p_tokens        double precision,
    p_requests      double precision,
    p_keep_tokens   double precision,
    p_keep_requests double precision
) RETURNS TABLE (tokens double precision, requests double precision)
LANGUAGE plpgsql
AS $$
#variable_conflict use_column
DECLARE
    layer_scope constant text := CASE WHEN p_ceiling IS NULL THEN 'global' ELSE 'ceiling' END;
    now_ts      timestamptz;
    pool        record;
    give_t      double precision;
    give_r      double precision;
BEGIN
    IF p_tokens < 0 OR p_requests < 0 THEN
        RAISE EXCEPTION USING ERRCODE = 'invalid_parameter_value',
              MESSAGE = 'a budget move is of zero or more tokens and requests';
    END IF;
    PERFORM 1 FROM limit_layers AS l
      WHERE l.scope = layer_scope AND l.ceiling IS NOT DISTINCT FROM p_ceiling
      ORDER BY l.layer_id FOR UPDATE;
    RETURN QUERY
    SELECT t.tokens, t.requests FROM budget_transfers AS t
     WHERE t.transfer_id = p_transfer_id AND t.direction = 'out';
    IF FOUND THEN
        RETURN;
    END IF;
    now_ts := clock_timestamp();
    SELECT sum(lq_refilled(l.tokens, l.tokens_per_minute, l.token_burst, l.refilled_at,
                           now_ts)) AS tokens,
           sum(lq_refilled(l.requests, l.requests_per_minute, l.request_burst, l.refilled_at,
                           now_ts)) AS requests,
           sum(l.token_burst) AS tburst, sum(l.request_burst) AS rburst
      INTO pool
      FROM limit_layers AS l
     WHERE l.scope = layer_scope AND l.ceiling IS NOT DISTINCT FROM p_ceiling;
    give_t := coalesce(least(p_tokens, greatest(0, pool.tokens - p_keep_tokens)), 0);
    give_r := coalesce(least(p_requests, greatest(0, pool.requests - p_keep_requests)), 0);
    IF give_t = 0 AND give_r = 0 THEN
        RETURN QUERY SELECT 0::double precision, 0::double precision;
        RETURN;
    END IF;
    UPDATE limit_layers AS l
       SET tokens = (pool.tokens - give_t) * l.token_burst / pool.tburst,
           requests = (pool.requests - give_r) * l.request_burst / pool.rburst,
           refilled_at = greatest(l.refilled_at, now_ts)
     WHERE l.scope = layer_scope AND l.ceiling IS NOT DISTINCT FROM p_ceiling;
    INSERT INTO budget_transfers (transfer_id, direction, ceiling, peer, tokens, requests,
                                  moved_at)
    VALUES (p_transfer_id, 'out', p_ceiling, p_to, give_t, give_r, now_ts);
    RETURN QUERY SELECT give_t, give_r;
END
$$;


-- Credit a move sent by cell p_from to this cell's slice of the shared layer
-- p_ceiling, clamped at its burst; true when credited now, false when this
-- transfer was already received (it is credited once, however often it is
-- delivered). A layer this cell no longer has takes nothing (the room is
-- dropped: never more budget, only less).
CREATE OR REPLACE FUNCTION lq_receive_budget(
    p_transfer_id uuid,
    p_ceiling     text,
    p_from        text,
    p_tokens      double precision,
    p_requests    double precision
) RETURNS boolean
LANGUAGE plpgsql
AS $$
DECLARE
    layer_scope constant text := CASE WHEN p_ceiling IS NULL THEN 'global' ELSE 'ceiling' END;
    now_ts      timestamptz;
    pool        record;
BEGIN
    PERFORM 1 FROM limit_layers AS l
      WHERE l.scope = layer_scope AND l.ceiling IS NOT DISTINCT FROM p_ceiling
      ORDER BY l.layer_id FOR UPDATE;
    now_ts := clock_timestamp();
    INSERT INTO budget_transfers (transfer_id, direction, ceiling, peer, tokens, requests,
                                  moved_at)
    VALUES (p_transfer_id, 'in', p_ceiling, p_from, p_tokens, p_requests, now_ts)
    ON CONFLICT (transfer_id, direction) DO NOTHING;
    IF NOT FOUND THEN
        RETURN false;
    END IF;
    SELECT least(sum(l.token_burst),
                 sum(lq_refilled(l.tokens, l.tokens_per_minute, l.token_burst, l.refilled_at,
                                 now_ts)) + p_tokens) AS tokens,
           least(sum(l.request_burst),
                 sum(lq_refilled(l.requests, l.requests_per_minute, l.request_burst,
                                 l.refilled_at, now_ts)) + p_requests) AS requests,
           sum(l.token_burst) AS tburst, sum(l.request_burst) AS rburst
      INTO pool
      FROM limit_layers AS l
     WHERE l.scope = layer_scope AND l.ceiling IS NOT DISTINCT FROM p_ceiling;
    UPDATE limit_layers AS l
       SET tokens = pool.tokens * l.token_burst / pool.tburst,
           requests = pool.requests * l.request_burst / pool.rburst,
           refilled_at = greatest(l.refilled_at, now_ts)
     WHERE l.scope = layer_scope AND l.ceiling IS NOT DISTINCT FROM p_ceiling;
    RETURN true;
END
$$;


-- The receiver has the move: its 'out' row is delivered.
CREATE OR REPLACE FUNCTION lq_confirm_budget(p_transfer_id uuid) RETURNS void
LANGUAGE plpgsql
AS $$
DECLARE
    now_ts timestamptz := clock_timestamp();
BEGIN
    UPDATE budget_transfers AS t
       SET delivered_at = now_ts
     WHERE t.transfer_id = p_transfer_id AND t.direction = 'out' AND t.delivered_at IS NULL;
END
$$;


-- Moves this cell sent that no receiver has acknowledged, oldest first, at
-- most p_limit: the rebalancer delivers them again before moving more.
CREATE OR REPLACE FUNCTION lq_undelivered_budget(p_limit integer)
RETURNS TABLE (transfer_id uuid, ceiling text, peer text, tokens double precision,
               requests double precision)
LANGUAGE plpgsql
AS $$
#variable_conflict use_column
BEGIN
    RETURN QUERY
    SELECT t.transfer_id, t.ceiling, t.peer, t.tokens, t.requests
      FROM budget_transfers AS t
     WHERE t.direction = 'out' AND t.delivered_at IS NULL AND t.permits = 0
     ORDER BY t.moved_at
     LIMIT p_limit;
END
$$;


-- Forget moves older than p_keep_seconds: 'out' rows (delivered, or given up:
-- a move no round could deliver for that long is room lost, never room
-- made), and 'in' rows twice as old, so that an 'out' row still being
-- delivered always finds its 'in' row whatever the two nodes' clocks say,
-- and is credited once. A move of permits is not given up (a permit does
-- not refill: given up, it would be lost for good): its 'out' row stays
-- until delivered, or until the row it debited is gone; its 'in' row is
-- kept a week of p_keep_seconds, so that a move delivered whose
-- acknowledgement was lost is credited once however long its sender was
-- away (up to that). How many rows went.
CREATE OR REPLACE FUNCTION lq_prune_budget_transfers(p_keep_seconds integer)
RETURNS bigint
LANGUAGE plpgsql
AS $$
DECLARE
    now_ts constant timestamptz := clock_timestamp();
    gone   bigint;
BEGIN
    DELETE FROM budget_transfers AS t
     WHERE t.moved_at < now_ts - make_interval(secs => p_keep_seconds)
       AND ((t.direction = 'out'
             AND (t.permits = 0 OR t.delivered_at IS NOT NULL
                  OR NOT EXISTS (SELECT 1 FROM limit_layers AS l
                                  WHERE l.layer_id = t.layer_id)))
            OR (t.direction = 'in'
                AND t.moved_at < now_ts - make_interval(
                        secs => CASE WHEN t.permits > 0 THEN 7 ELSE 2 END * p_keep_seconds)));
    GET DIAGNOSTICS gone = ROW_COUNT;
    RETURN gone;
END
$$;



-- In-flight permits moved between the slices of shared layers in cells
-- (migration 0035), as room is above: debit the sender and journal an 'out'
-- row (lq_send_permits), credit the receiver once under the same
-- transfer_id (lq_receive_permits), then lq_confirm_budget. A permit moved
-- changes the slice's cap: max_in_flight goes down in the sender and up in
-- the receiver, and in_flight_moved keeps the count, so that a policy write
-- keeps what was moved (the new share plus the moves) and admission reads
-- the cap as it always has. A sender never lends a permit in use, nor its
-- last one. Stopped between the two, the permits are in neither cell
-- (stranded, never created) until a later round delivers them. The cells'
-- caps plus the permits stranded always sum to the policy: a share lowered
-- below what a cell lent leaves that cell a cap of zero or less, and it
-- admits nothing until the borrowers give permits back. A move is
-- delivered while the sender's row it debited exists: a ceiling deleted
-- takes its debts with it, so its moves are not delivered (a recreated
-- ceiling starts from its share in every cell).


-- The permits of this cell's slice of every shared layer that caps them:
-- in flight now, the cap (moves included) and the policy's own share.
CREATE OR REPLACE FUNCTION lq_shared_permits()
RETURNS TABLE (ceiling text, in_flight integer, max_in_flight integer, share integer)
LANGUAGE plpgsql
AS $$
BEGIN
    RETURN QUERY
    SELECT l.ceiling, l.in_flight, l.max_in_flight, l.max_in_flight - l.in_flight_moved
      FROM limit_layers AS l
     WHERE l.scope IN ('global', 'ceiling') AND l.max_in_flight IS NOT NULL
     ORDER BY l.ceiling NULLS FIRST;
END
$$;


-- Lend up to p_permits of this cell's free permits of the shared layer
-- p_ceiling to the cell p_to, keeping at least p_keep free (and one
-- permit), and journal it; how many left. Called again with the same
-- transfer_id it lends nothing more and answers what the first call did.
CREATE OR REPLACE FUNCTION lq_send_permits(
    p_transfer_id uuid,
    p_ceiling     text,
    p_to          text,
    p_permits     integer,
    p_keep        integer
) RETURNS integer
LANGUAGE plpgsql
AS $$
DECLARE
    layer_scope constant text := CASE WHEN p_ceiling IS NULL THEN 'global' ELSE 'ceiling' END;
    layer       record;
    missing     boolean;
    sent        integer;
BEGIN
    IF p_permits IS NULL OR p_keep IS NULL OR p_permits < 0 OR p_keep < 0 THEN
        RAISE EXCEPTION USING ERRCODE = 'invalid_parameter_value',
              MESSAGE = 'a permit move is of zero or more permits, keeping zero or more';
    END IF;
    SELECT l.layer_id, l.in_flight, l.max_in_flight INTO layer
      FROM limit_layers AS l
     WHERE l.scope = layer_scope AND l.ceiling IS NOT DISTINCT FROM p_ceiling
       AND l.max_in_flight IS NOT NULL
     ORDER BY l.layer_id
     LIMIT 1
       FOR UPDATE;
    missing := NOT FOUND;
    SELECT t.permits INTO sent FROM budget_transfers AS t
     WHERE t.transfer_id = p_transfer_id AND t.direction = 'out';
    IF FOUND THEN
        RETURN sent;
    ELSIF missing THEN
        RETURN 0;
    END IF;
    sent := greatest(0, least(p_permits, layer.max_in_flight - layer.in_flight - p_keep,
                              layer.max_in_flight - 1));
    IF sent = 0 THEN
        RETURN 0;
    END IF;
    UPDATE limit_layers AS l
       SET max_in_flight = l.max_in_flight - sent,
           in_flight_moved = l.in_flight_moved - sent
     WHERE l.layer_id = layer.layer_id;
    INSERT INTO budget_transfers (transfer_id, direction, ceiling, peer, tokens, requests,
                                  permits, layer_id, moved_at)
    VALUES (p_transfer_id, 'out', p_ceiling, p_to, 0, 0, sent, layer.layer_id,
            clock_timestamp());
    RETURN sent;
END
$$;


-- Credit permits lent by the cell p_from to this cell's slice of the shared
-- layer p_ceiling; true when credited now, false when this transfer was
-- received before. A slice without a cap now keeps them in in_flight_moved
-- for when it has one; a cell without the layer takes nothing (never more
-- permits, only fewer).
CREATE OR REPLACE FUNCTION lq_receive_permits(
    p_transfer_id uuid,
    p_ceiling     text,
    p_from        text,
    p_permits     integer
) RETURNS boolean
LANGUAGE plpgsql
AS $$
DECLARE
    layer_scope constant text := CASE WHEN p_ceiling IS NULL THEN 'global' ELSE 'ceiling' END;
    target      bigint;
BEGIN
    SELECT l.layer_id INTO target
      FROM limit_layers AS l
     WHERE l.scope = layer_scope AND l.ceiling IS NOT DISTINCT FROM p_ceiling
     ORDER BY l.layer_id
     LIMIT 1
       FOR UPDATE;
    INSERT INTO budget_transfers (transfer_id, direction, ceiling, peer, tokens, requests,
                                  permits, moved_at)
    VALUES (p_transfer_id, 'in', p_ceiling, p_from, 0, 0, p_permits, clock_timestamp())
    ON CONFLICT (transfer_id, direction) DO NOTHING;
    IF NOT FOUND THEN
        RETURN false;
    END IF;
    UPDATE limit_layers AS l
       SET max_in_flight = l.max_in_flight + p_permits,
           in_flight_moved = l.in_flight_moved + p_permits
     WHERE l.layer_id = target;
    RETURN true;
END
$$;


-- Permit moves this cell sent that no receiver has acknowledged, oldest
-- first, at most p_limit: the rebalancer delivers them again before moving
-- more. Not those whose row is gone (a deleted ceiling's: its debt went
-- with it).
CREATE OR REPLACE FUNCTION lq_undelivered_permits(p_limit integer)
RETURNS TABLE (transfer_id uuid, ceiling text, peer text, permits integer)
LANGUAGE plpgsql
AS $$
#variable_conflict use_column
BEGIN
    RETURN QUERY
    SELECT t.transfer_id, t.ceiling, t.peer, t.permits
      FROM budget_transfers AS t
     WHERE t.direction = 'out' AND t.delivered_at IS NULL AND t.permits > 0
       AND EXISTS (SELECT 1 FROM limit_layers AS l WHERE l.layer_id = t.layer_id)
     ORDER BY t.moved_at
     LIMIT p_limit;
END
$$;
