-- Usage by how it was served (issue 23): primary, cache, fallback_model,
-- queued or second_deployment, per tenant over the period.
--
-- The serving path is the ledger row's (usage_ledger.serving_path): lq_finish
-- writes it for settlements, late settles and expiries, the response cache
-- for its hits. A row without one (adjustments, and rows recorded before
-- revision 0026) counts as primary, so the paths of a tenant add up to its
-- totals in usage_daily. requests counts 'usage' rows (resolved
-- reservations and cache hits), as usage_daily does.

CREATE OR REPLACE FUNCTION reporting.usage_by_serving_path(
    p_from date, p_to date, p_tenant text DEFAULT NULL
) RETURNS TABLE (
    tenant              text,
    serving_path        text,
    requests            bigint,
    input_tokens        bigint,
    output_tokens       bigint,
    saved_input_tokens  bigint,
    saved_output_tokens bigint,
    cost_usd            numeric,
    saved_cost_usd      numeric
)
LANGUAGE sql STABLE
AS $$
    -- cost_usd is ledger_entries' (a cache hit's own price included);
    -- saved_cost_usd is what the tokens a cache hit saved would have cost at
    -- its model's prices in force then (0 where the model had none): the
    -- provider bill the cache avoided.
    SELECT e.tenant, coalesce(e.serving_path, 'primary'),
           count(*) FILTER (WHERE e.entry_kind = 'usage'),
           sum(e.input_tokens)::bigint,
           sum(e.output_tokens)::bigint,
           coalesce(sum(e.saved_input_tokens), 0)::bigint,
           coalesce(sum(e.saved_output_tokens), 0)::bigint,
           trim_scale(coalesce(sum(e.cost_usd), 0)),
           trim_scale(coalesce(sum((coalesce(e.saved_input_tokens, 0) * e.input_usd_per_million
                                    + coalesce(e.saved_output_tokens, 0)
                                      * e.output_usd_per_million) * 0.000001), 0))
      FROM reporting.ledger_entries AS e
     WHERE e.recorded_at >= reporting.utc_start(p_from)
       AND e.recorded_at < reporting.utc_start(p_to)
       AND (p_tenant IS NULL OR e.tenant = p_tenant)
     GROUP BY e.tenant, coalesce(e.serving_path, 'primary')
     ORDER BY 1, 2
$$;
COMMENT ON FUNCTION reporting.usage_by_serving_path(date, date, text) IS
    'usage and cost by tenant and serving path (primary, cache, fallback_model, queued, second_deployment), with what cache hits saved';
