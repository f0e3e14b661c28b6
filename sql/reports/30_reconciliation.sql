-- Ledger totals per model and UTC day, to hold against the provider's invoice.

CREATE OR REPLACE FUNCTION reporting.reconciliation_daily(
    p_from date, p_to date, p_tenant text DEFAULT NULL
) RETURNS TABLE (
    day                     date,
    model                   text,
    requests                bigint,
    input_tokens            bigint,
    output_tokens           bigint,
    total_tokens            bigint,
    cost_usd                numeric,
    unpriced_tokens         bigint,
    expired_reservations    bigint,
    expired_reserved_tokens bigint,
    late_tokens             bigint,
    adjustment_tokens       bigint
)
LANGUAGE sql STABLE
AS $$
    -- total_tokens is what the ledger knows was used (late usage and
    -- adjustments included). Expired reservations carry no known usage: the
    -- provider may still have served them, up to expired_reserved_tokens,
    -- which is the margin to expect between this and the invoice until their
    -- late settles (late_tokens, on the day they arrive) come in. A response
    -- cache hit (serving_path 'cache') never reached the provider: its row,
    -- and its price, are not part of what the invoice is held against.
    SELECT e.day_utc, e.model,
           count(*) FILTER (WHERE e.entry_kind = 'usage'),
           sum(e.input_tokens)::bigint,
           sum(e.output_tokens)::bigint,
           sum(e.total_tokens)::bigint,
           trim_scale(coalesce(sum(e.cost_usd), 0)),
           coalesce(sum(e.total_tokens) FILTER (WHERE e.cost_usd IS NULL), 0)::bigint,
           count(*) FILTER (WHERE e.outcome = 'expired'),
           coalesce(sum(e.reserved_tokens) FILTER (WHERE e.outcome = 'expired'), 0)::bigint,
           coalesce(sum(e.total_tokens) FILTER (WHERE e.entry_kind = 'late'), 0)::bigint,
           coalesce(sum(e.total_tokens) FILTER (WHERE e.entry_kind = 'adjustment'), 0)::bigint
      FROM reporting.ledger_entries AS e
     WHERE e.recorded_at >= reporting.utc_start(p_from)
       AND e.recorded_at < reporting.utc_start(p_to)
       AND (p_tenant IS NULL OR e.tenant = p_tenant)
       AND e.serving_path IS DISTINCT FROM 'cache'
     GROUP BY e.day_utc, e.model
     ORDER BY e.day_utc, e.model NULLS FIRST
$$;
COMMENT ON FUNCTION reporting.reconciliation_daily(date, date, text) IS
    'ledger totals per UTC day and model, with expired reservations, late usage and adjustments, for the provider invoice';
