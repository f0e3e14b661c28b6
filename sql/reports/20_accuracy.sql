-- How well reservations predicted usage, by route and model.

CREATE OR REPLACE FUNCTION reporting.reservation_accuracy(
    p_from date, p_to date, p_tenant text DEFAULT NULL
) RETURNS TABLE (
    route              text,
    model              text,
    reservations       bigint,
    unsettled_expired  bigint,
    reserved_tokens    bigint,
    charged_tokens     bigint,
    ratio_p50          numeric,
    ratio_p95          numeric,
    held_unused_tokens bigint
)
LANGUAGE sql STABLE
AS $$
    -- Over reservations resolved in the period whose real usage is known
    -- (settled, or expired and then settled late): reserved and charged
    -- tokens, the median and 95th percentile of charged / reserved per
    -- reservation (1 = perfect, below 1 = over-reserved), and the tokens that
    -- were held but not used. An expired reservation nobody settled has no
    -- known usage: it is only counted in unsettled_expired.
    SELECT o.route, o.model,
           count(*),
           count(*) FILTER (WHERE o.charged_tokens IS NULL),
           coalesce(sum(o.reserved_tokens) FILTER (WHERE o.charged_tokens IS NOT NULL), 0)::bigint,
           coalesce(sum(o.charged_tokens), 0)::bigint,
           round(percentile_cont(0.5) WITHIN GROUP (
                     ORDER BY o.charged_tokens::double precision / o.reserved_tokens)
                 FILTER (WHERE o.charged_tokens IS NOT NULL AND o.reserved_tokens > 0)
                 ::numeric, 4),
           round(percentile_cont(0.95) WITHIN GROUP (
                     ORDER BY o.charged_tokens::double precision / o.reserved_tokens)
                 FILTER (WHERE o.charged_tokens IS NOT NULL AND o.reserved_tokens > 0)
                 ::numeric, 4),
           coalesce(sum(greatest(o.reserved_tokens - o.charged_tokens, 0)), 0)::bigint
      FROM reporting.reservation_outcomes AS o
     WHERE o.recorded_at >= reporting.utc_start(p_from)
       AND o.recorded_at < reporting.utc_start(p_to)
       AND (p_tenant IS NULL OR o.tenant = p_tenant)
     GROUP BY o.route, o.model
     ORDER BY o.route NULLS FIRST, o.model
$$;
COMMENT ON FUNCTION reporting.reservation_accuracy(date, date, text) IS
    'reserved vs charged tokens by route and model: p50/p95 of charged/reserved, tokens held but unused';
