-- Learned output reservations: the settle-time statistics.
--
-- One row of output_estimates per (tenant, route, model) holds a histogram
-- of the output tokens its completions used, with log-spaced buckets and
-- exponential decay. lq_finish feeds it the settlements that ended 'ok', in
-- its own transaction, with one call to lq_record_output_samples; admission
-- never reads it (each worker caches it, see admission/estimates.py).
-- The arithmetic is domain/output_estimates.py's, and tests compare them.


-- Every sample loses half its weight after this many seconds.
CREATE OR REPLACE FUNCTION lq_output_half_life_seconds()
RETURNS double precision
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$
    SELECT 3600.0::double precision
$$;


-- The lower bound of every bucket, ascending: 0, then for each power of two
-- 2^e (e = 0 .. 23) eight equal steps of 2^e / 8, in integer arithmetic (the
-- steps below 8 coincide and count once). Bucket i (1-based, as
-- width_bucket numbers them) holds the counts from bounds[i] to
-- bounds[i + 1] - 1.
CREATE OR REPLACE FUNCTION lq_output_bucket_bounds()
RETURNS bigint[]
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$
    SELECT array_agg(DISTINCT b.bound ORDER BY b.bound)
      FROM (SELECT 0::bigint AS bound
            UNION ALL
            SELECT ((8 + s)::bigint << e) >> 3
              FROM generate_series(0, 23) AS e, generate_series(0, 7) AS s) AS b
$$;


-- Counts per bucket of a list of (1-based) bucket numbers, up to the highest;
-- NULL for none. A loop over the list: settlement calls this once per
-- (tenant, route, model) it settles, and a join of the buckets with a series
-- cost four times as much.
CREATE OR REPLACE FUNCTION lq_output_bucket_counts(p_buckets integer[])
RETURNS double precision[]
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
AS $$
DECLARE
    highest integer := (SELECT max(b) FROM unnest(p_buckets) AS b);
    counts  double precision[];
    b       integer;
BEGIN
    IF highest IS NULL THEN
        RETURN NULL;
    END IF;
    counts := array_fill(0::double precision, ARRAY[highest]);
    FOREACH b IN ARRAY p_buckets LOOP
        counts[b] := counts[b] + 1;
    END LOOP;
    RETURN counts;
END
$$;


-- The factor a weight keeps after p_elapsed seconds: halved every half-life,
-- 0 past 60 of them (older weight is forgotten).
CREATE OR REPLACE FUNCTION lq_output_decay(p_elapsed double precision)
RETURNS double precision
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$
    SELECT CASE WHEN greatest(p_elapsed, 0) / lq_output_half_life_seconds() > 60 THEN 0
                ELSE power(2.0::double precision,
                           -greatest(p_elapsed, 0) / lq_output_half_life_seconds())
           END
$$;


-- A histogram decayed for p_elapsed seconds (lq_output_decay), plus new
-- counts, bucket by bucket; a weight under 1e-9 becomes 0, so no product can
-- underflow. NULL for no bucket at all. A loop: settlement calls this once per
-- histogram row it adds to, and the same arithmetic as one SQL query over a
-- series of the buckets (array_agg ordered by bucket) took 28 us a call
-- against 11 (BENCHMARKS.md, issue 25, seventh part).
CREATE OR REPLACE FUNCTION lq_output_merge(
    p_weights double precision[],
    p_elapsed double precision,
    p_counts  double precision[]
) RETURNS double precision[]
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
AS $$
DECLARE
    factor double precision := lq_output_decay(p_elapsed);
    size   integer := greatest(cardinality(p_weights), cardinality(p_counts));
    merged double precision[];
    kept   double precision;
BEGIN
    IF coalesce(size, 0) = 0 THEN
        RETURN NULL;
    END IF;
    merged := array_fill(0::double precision, ARRAY[size]);
    FOR i IN 1 .. size LOOP
        kept := coalesce(p_weights[i], 0) * factor;
        merged[i] := CASE WHEN kept < 1e-9 THEN 0 ELSE kept END + coalesce(p_counts[i], 0);
    END LOOP;
    RETURN merged;
END
$$;


-- Record settled output token counts: one sample each for the histogram of
-- its (tenant, route, model). Called by lq_finish after it locked the
-- reservations and the layers; the histogram rows are locked last (the
-- fourth class of admission.sql's locking order), in (tenant, route, model)
-- order: the INSERT takes the rows in the order of its sorted input, so two
-- settlements never wait for each other's rows in opposite orders. Each key
-- appears once per statement (the samples are counted per bucket first), and
-- ON CONFLICT DO UPDATE re-reads a row another transaction changed before
-- adding to it: concurrent settlements never lose a sample.
CREATE OR REPLACE FUNCTION lq_record_output_samples(
    p_tenants text[],
    p_routes  text[],   -- NULL: no route
    p_models  text[],
    p_outputs bigint[]
) RETURNS void
LANGUAGE plpgsql
AS $$
DECLARE
    bounds bigint[] := lq_output_bucket_bounds();
    now_ts timestamptz := clock_timestamp();
BEGIN
    IF coalesce(cardinality(p_tenants), 0) = 0 THEN
        RETURN;
    END IF;
    INSERT INTO output_estimates AS e (tenant, route, model, weights, samples, updated_at)
    SELECT s.tenant, s.route, s.model, lq_output_bucket_counts(s.buckets), s.samples, now_ts
      FROM (SELECT u.t AS tenant, coalesce(u.r, '') AS route, u.m AS model,
                   array_agg(width_bucket(greatest(u.o, 0), bounds)) AS buckets,
                   count(*) AS samples
              FROM unnest(p_tenants, p_routes, p_models, p_outputs) AS u(t, r, m, o)
             WHERE u.t IS NOT NULL AND u.m IS NOT NULL AND u.o IS NOT NULL
             GROUP BY u.t, coalesce(u.r, ''), u.m
             ORDER BY u.t, coalesce(u.r, ''), u.m) AS s
    -- excluded.updated_at is now_ts: the clause names no variable, which
    -- Citus cannot carry into an INSERT ... SELECT's conflict clause (cells)
    ON CONFLICT (tenant, route, model) DO UPDATE
       SET weights = lq_output_merge(e.weights,
                                     extract(epoch FROM excluded.updated_at - e.updated_at)
                                         ::double precision,
                                     excluded.weights),
           -- A histogram that decayed to nothing starts counting again.
           -- (Some weight is left when the largest one is, decayed: see lq_output_merge.)
           samples = excluded.samples + CASE
               WHEN (SELECT max(w) FROM unnest(e.weights) AS w)
                    * lq_output_decay(extract(epoch FROM excluded.updated_at - e.updated_at)
                                          ::double precision)
                    >= 1e-9
               THEN e.samples ELSE 0 END,
           updated_at = greatest(e.updated_at, excluded.updated_at);
END
$$;
