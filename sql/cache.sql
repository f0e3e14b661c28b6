-- The response cache of proxy mode (issue 23; src/llmquota/domain/response_cache.py
-- says what a key, a context and a signature are).
--
-- response_cache (migration 0026) holds answers the proxy may serve again,
-- per tenant and route ('' for none), endpoint and model. Three statements
-- touch it, each one round trip:
--
--   lq_cache_serve   finds an answer (the exact key, else the nearest
--                    embedding of the same context) and, in the same
--                    transaction, writes the hit's ledger row: a request
--                    served from the cache is on the books exactly once,
--                    with 0 tokens charged and what it saved;
--   lq_cache_store   keeps a fresh answer, and the namespace (tenant and
--                    route) within its max_entries (the oldest go first);
--   lq_cache_sweep   deletes expired entries in bounded batches (the sweeper).
--
-- Lock order: a cache entry is never locked together with a limit layer or a
-- reservation, so these statements take no place in admission.sql's order.
-- lq_cache_store takes its tenant's row (FOR KEY SHARE: lq_delete_tenant,
-- which locks it FOR UPDATE first, waits for it, or it for the delete), then
-- serialises one namespace's stores behind a transaction-scoped advisory
-- lock, so that its bound is exact under concurrency. lq_cache_serve reads
-- and appends the hit's ledger row; a hit the operator prices also locks
-- the cost quotas' windows (quota_id order) and then the tenant's prepaid
-- account, admission.sql's order for those, holding no layer.
--
-- Time is the database's clock, as everywhere: an entry is live while
-- expires_at > clock_timestamp().


-- The cosine similarity of two embeddings stored at length 1: their dot
-- product. NULL when their lengths differ (another embedding model's).
CREATE OR REPLACE FUNCTION lq_cache_cosine(p_a real[], p_b real[])
RETURNS double precision
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$
    SELECT CASE WHEN cardinality(p_a) = cardinality(p_b)
                THEN (SELECT sum(x::double precision * y)
                        FROM unnest(p_a, p_b) AS t(x, y))
           END
$$;


-- Serve a request from the cache, or nothing.
--
-- (1) The exact key: an entry of this tenant, route, endpoint and model whose
--     key is the request's, still live.
-- (2) Else, given an embedding: the live entries of the same context whose
--     SimHash is within p_max_distance bits of the request's (the prefilter:
--     at most the namespace's entries, each compared by one XOR and a bit
--     count), compared exactly by cosine; the most similar at or above
--     p_similarity wins, the newest on a tie.
-- (3) On a hit, the ledger gets the hit's row: entry_kind 'usage', outcome
--     'ok', 0 tokens charged, serving_path 'cache', the tokens the provider
--     would have billed in saved_*, and the operator's price for a hit, if
--     the policy sets one. hit_id is the row's reservation_id: a hit has no
--     reservation, and the id keeps each hit its own receipt. A priced hit
--     is charged like any other usage: to the cost of every calendar quota
--     it matches (the tenant's, its route's, its key's p_key_id) and to a
--     prepaid tenant's credits (the credit ledger's charge for hit_id, which
--     `llmquota audit` checks against the row's price). It is served only
--     within those budgets: a blocking quota the price would take past its
--     cost, or a prepaid balance below the price, makes it a miss, and
--     admission then refuses the request as it refuses any other. A lookup
--     made once the request was admitted names its reservation
--     (p_reservation_id): what that holds counts as room for the hit, as a
--     hit gives it back. A statement
--     that reaches this step past p_budget_ms (counted from its start) writes
--     nothing and answers a miss: the worker stops waiting for it a little
--     later (store/response_cache.py), and a hit it has given up on must not
--     be booked while the request goes on to the provider.
-- p_budget_ms was added: the first signature goes; then p_key_id (a priced hit
-- counts against the key's quotas) and p_reservation_id.
DROP FUNCTION IF EXISTS lq_cache_serve(text, text, text, text, bytea, bytea, real[], bigint,
                                       integer, double precision, numeric);
DROP FUNCTION IF EXISTS lq_cache_serve(text, text, text, text, bytea, bytea, real[], bigint,
                                       integer, double precision, numeric, integer);
CREATE OR REPLACE FUNCTION lq_cache_serve(
    p_tenant         text,
    p_route          text,               -- '' for none
    p_endpoint       text,
    p_model          text,
    p_exact_key      bytea,
    p_context_key    bytea,              -- NULL: exact only
    p_embedding      real[],             -- NULL: exact only
    p_signature      bigint,
    p_max_distance   integer,
    p_similarity     double precision,
    p_price_usd      numeric,            -- NULL: no price for a hit
    p_budget_ms      integer,            -- past it, book nothing (a miss)
    p_key_id         bigint DEFAULT NULL,  -- the API key that asked (its quotas)
    p_reservation_id uuid DEFAULT NULL     -- the request's own, when admitted first
) RETURNS TABLE (
    hit_id           uuid,
    entry_id         bigint,
    answer           bytea,
    input_tokens     bigint,
    output_tokens    bigint,
    similarity       double precision
)
LANGUAGE plpgsql
AS $$
DECLARE
    now_ts  timestamptz := clock_timestamp();
    found_e response_cache;
    found_id bigint;
    sim     double precision := 1.0;
    hit     uuid := gen_random_uuid();
    priced  boolean := coalesce(p_price_usd, 0) > 0;
    q       quotas;
    w       quota_windows;
    qs      bigint[] := '{}';
    prepaid boolean := false;
    avail   numeric;
    x       integer;
    -- what the request's own reservation holds (room for the hit it is for)
    own_cost   numeric := 0;
    own_credit numeric := 0;
    own_quotas bigint[] := '{}';
    used       numeric;
BEGIN
    -- (1) the exact key
    SELECT c.* INTO found_e
      FROM response_cache AS c
     WHERE c.tenant = p_tenant AND c.route = p_route
       AND c.endpoint = p_endpoint AND c.model = p_model
       AND c.exact_key = p_exact_key
       AND c.expires_at > now_ts;

    -- (2) the nearest of the same context
    IF found_e.entry_id IS NULL AND p_embedding IS NOT NULL THEN
        SELECT s.entry_id, s.cos INTO found_id, sim
          FROM (SELECT c.entry_id, c.created_at,
                       lq_cache_cosine(c.embedding, p_embedding) AS cos
                  FROM response_cache AS c
                 WHERE c.tenant = p_tenant AND c.route = p_route
                   AND c.endpoint = p_endpoint AND c.model = p_model
                   AND c.context_key = p_context_key
                   AND c.embedding IS NOT NULL
                   AND c.expires_at > now_ts
                   AND bit_count((c.signature # p_signature)::bit(64)) <= p_max_distance) AS s
         WHERE s.cos >= p_similarity
         ORDER BY s.cos DESC, s.created_at DESC
         LIMIT 1;
        IF found_id IS NOT NULL THEN
            SELECT c.* INTO found_e FROM response_cache AS c WHERE c.entry_id = found_id;
        END IF;
    END IF;
    IF found_e.entry_id IS NULL THEN
        RETURN;
    END IF;

    -- (3) a priced hit's budgets: locked, and within them, or a miss
    IF priced AND p_reservation_id IS NOT NULL THEN
        SELECT coalesce(r.reserved_cost, 0), coalesce(r.credit_reserved, 0),
               coalesce(r.quota_ids, '{}')
          INTO own_cost, own_credit, own_quotas
          FROM reservations AS r
         WHERE r.reservation_id = p_reservation_id AND r.tenant = p_tenant
           AND r.state = 'active';
    END IF;
    IF priced THEN
        FOR q IN SELECT m.* FROM lq_matching_quotas(p_tenant, nullif(p_route, ''), p_model,
                                                    p_key_id) AS m
                  WHERE m.cost IS NOT NULL LOOP
            w := lq_quota_window_row(q.quota_id, now_ts);
            used := w.reserved_cost + w.charged_cost;
            IF q.quota_id = ANY (own_quotas) THEN
                used := used - own_cost;
            END IF;
            IF q.enforce = 'block' AND used + p_price_usd > q.cost THEN
                RETURN;
            END IF;
            qs := qs || q.quota_id;
        END LOOP;
        SELECT coalesce(bool_or(l.prepaid), false) INTO prepaid
          FROM limit_layers AS l
         WHERE l.scope = 'tenant' AND l.tenant = p_tenant AND l.route IS NULL;
        IF prepaid THEN
            SELECT a.balance - a.reserved INTO avail
              FROM credit_accounts AS a WHERE a.tenant = p_tenant FOR UPDATE;
            IF coalesce(avail, 0) + coalesce(own_credit, 0) < p_price_usd THEN
                RETURN;
            END IF;
        END IF;
    END IF;
    IF clock_timestamp() > statement_timestamp() + make_interval(secs => p_budget_ms / 1000.0) THEN
        RETURN;
    END IF;

    -- (4) the ledger row and the charges, in this transaction
    INSERT INTO usage_ledger (reservation_id, entry_kind, tenant, route, model,
                              input_tokens, output_tokens, reserved_tokens, outcome,
                              serving_path, saved_input_tokens, saved_output_tokens, price_usd)
    VALUES (hit, 'usage', p_tenant, nullif(p_route, ''), p_model,
            0, 0, 0, 'ok',
            'cache', found_e.input_tokens, found_e.output_tokens, p_price_usd);
    FOR x IN 1 .. cardinality(qs) LOOP
        PERFORM lq_quota_apply(qs[x], now_ts, 0, 0, 0, p_price_usd);
    END LOOP;
    IF prepaid THEN
        PERFORM lq_credit_apply(p_tenant, hit, NULL, p_price_usd);
    END IF;
    RETURN QUERY SELECT hit, found_e.entry_id, found_e.answer,
                        found_e.input_tokens, found_e.output_tokens, sim;
END
$$;


-- Keep an answer: insert it, or refresh the entry of the same key (a newer
-- answer, a new expiry; its semantic columns come whole from one side, so an
-- answer stored without an embedding keeps the entry's own). Nothing is kept
-- for a tenant that no longer exists (a stream that ended after its tenant
-- was deleted: a tenant created again under the name must not be served
-- it). Then the namespace (tenant and route) keeps at most p_max_entries
-- entries: its expired ones go, then its oldest beyond the bound. The
-- advisory lock (per namespace, for this transaction) makes the bound exact:
-- two stores never both count the namespace before either inserted. Returns
-- how many entries the bound removed.
CREATE OR REPLACE FUNCTION lq_cache_store(
    p_tenant         text,
    p_route          text,
    p_endpoint       text,
    p_model          text,
    p_exact_key      bytea,
    p_context_key    bytea,
    p_embedding      real[],
    p_signature      bigint,
    p_answer         bytea,
    p_input_tokens   bigint,
    p_output_tokens  bigint,
    p_ttl_seconds    integer,
    p_max_entries    integer
) RETURNS integer
LANGUAGE plpgsql
AS $$
DECLARE
    now_ts  timestamptz;
    removed integer;
    expired integer;
BEGIN
    PERFORM 1 FROM tenants AS t WHERE t.tenant = p_tenant FOR KEY SHARE;
    IF NOT FOUND THEN
        RETURN 0;
    END IF;
    PERFORM pg_advisory_xact_lock(hashtextextended('lq_cache:' || p_tenant || '/' || p_route, 0));
    now_ts := clock_timestamp();
    INSERT INTO response_cache AS c (tenant, route, endpoint, model, exact_key, context_key,
                                     embedding, signature, answer, input_tokens, output_tokens,
                                     created_at, expires_at)
    VALUES (p_tenant, p_route, p_endpoint, p_model, p_exact_key, p_context_key,
            p_embedding, p_signature, p_answer, p_input_tokens, p_output_tokens,
            now_ts, now_ts + make_interval(secs => p_ttl_seconds))
    ON CONFLICT (tenant, route, endpoint, model, exact_key) DO UPDATE
       SET context_key = CASE WHEN excluded.embedding IS NULL THEN c.context_key
                              ELSE excluded.context_key END,
           embedding = CASE WHEN excluded.embedding IS NULL THEN c.embedding
                            ELSE excluded.embedding END,
           signature = CASE WHEN excluded.embedding IS NULL THEN c.signature
                            ELSE excluded.signature END,
           answer = excluded.answer,
           input_tokens = excluded.input_tokens,
           output_tokens = excluded.output_tokens,
           created_at = excluded.created_at,
           expires_at = excluded.expires_at;
    DELETE FROM response_cache AS c
     WHERE c.tenant = p_tenant AND c.route = p_route AND c.expires_at <= now_ts;
    GET DIAGNOSTICS expired = ROW_COUNT;
    -- The newest p_max_entries by the (tenant, route, created_at) index, read
    -- backwards; the rest go.
    DELETE FROM response_cache AS c
     WHERE c.entry_id IN (SELECT o.entry_id
                            FROM response_cache AS o
                           WHERE o.tenant = p_tenant AND o.route = p_route
                           ORDER BY o.created_at DESC, o.entry_id DESC
                          OFFSET p_max_entries);
    GET DIAGNOSTICS removed = ROW_COUNT;
    RETURN removed + expired;
END
$$;


-- Delete up to p_limit expired entries, the longest expired first; rows
-- another transaction holds (a hit being counted) wait for the next run.
CREATE OR REPLACE FUNCTION lq_cache_sweep(p_limit integer)
RETURNS integer
LANGUAGE plpgsql
AS $$
DECLARE
    now_ts constant timestamptz := clock_timestamp();
    removed integer;
BEGIN
    WITH doomed AS (
        SELECT c.entry_id
          FROM response_cache AS c
         WHERE c.expires_at <= now_ts
         ORDER BY c.expires_at
         LIMIT p_limit
           FOR UPDATE SKIP LOCKED
    )
    DELETE FROM response_cache AS c USING doomed AS d WHERE c.entry_id = d.entry_id;
    GET DIAGNOSTICS removed = ROW_COUNT;
    RETURN removed;
END
$$;
