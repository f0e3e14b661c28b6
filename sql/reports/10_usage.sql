-- Usage and cost: per day, per calendar month (invoice lines), top tenants.
--
-- requests counts resolved reservations ('usage' rows, expired ones too);
-- tokens add every row: usage, late usage of an expired reservation (whose
-- 'usage' row carries zero tokens, so nothing is counted twice) and signed
-- adjustments. A response cache hit is a request too (its 'usage' row, zero
-- tokens), and its price, if its policy sets one, is in cost_usd: on an
-- invoice line, beside its model's tokens at the line's unit price.

CREATE OR REPLACE FUNCTION reporting.usage_daily(
    p_from date, p_to date, p_tenant text DEFAULT NULL
) RETURNS TABLE (
    day             date,
    tenant          text,
    route           text,
    model           text,
    requests        bigint,
    input_tokens    bigint,
    output_tokens   bigint,
    total_tokens    bigint,
    cost_usd        numeric,
    unpriced_tokens bigint
)
LANGUAGE sql STABLE
AS $$
    SELECT e.day_utc, e.tenant, e.route, e.model,
           count(*) FILTER (WHERE e.entry_kind = 'usage'),
           sum(e.input_tokens)::bigint,
           sum(e.output_tokens)::bigint,
           sum(e.total_tokens)::bigint,
           trim_scale(coalesce(sum(e.cost_usd), 0)),
           coalesce(sum(e.total_tokens) FILTER (WHERE e.cost_usd IS NULL), 0)::bigint
      FROM reporting.ledger_entries AS e
     WHERE e.recorded_at >= reporting.utc_start(p_from)
       AND e.recorded_at < reporting.utc_start(p_to)
       AND (p_tenant IS NULL OR e.tenant = p_tenant)
     GROUP BY e.day_utc, e.tenant, e.route, e.model
     ORDER BY e.day_utc, e.tenant, e.route NULLS FIRST, e.model NULLS FIRST
$$;
COMMENT ON FUNCTION reporting.usage_daily(date, date, text) IS
    'usage and cost by UTC day, tenant, route and model';

CREATE OR REPLACE FUNCTION reporting.invoice_monthly(
    p_from date, p_to date, p_tenant text DEFAULT NULL
) RETURNS TABLE (
    month                  date,
    tenant                 text,
    route                  text,
    model                  text,
    input_usd_per_million  numeric,
    output_usd_per_million numeric,
    requests               bigint,
    input_tokens           bigint,
    output_tokens          bigint,
    total_tokens           bigint,
    cost_usd               numeric,
    amount_usd             numeric
)
LANGUAGE sql STABLE
AS $$
    -- One line per price: a price change inside the month splits the line,
    -- so each line is quantity times one unit price. amount_usd is the line
    -- rounded to the cent; a line with no price has no amount.
    SELECT date_trunc('month', e.day_utc)::date, e.tenant, e.route, e.model,
           e.input_usd_per_million, e.output_usd_per_million,
           count(*) FILTER (WHERE e.entry_kind = 'usage'),
           sum(e.input_tokens)::bigint,
           sum(e.output_tokens)::bigint,
           sum(e.total_tokens)::bigint,
           trim_scale(sum(e.cost_usd)),
           round(sum(e.cost_usd), 2)
      FROM reporting.ledger_entries AS e
     WHERE e.recorded_at >= reporting.utc_start(p_from)
       AND e.recorded_at < reporting.utc_start(p_to)
       AND (p_tenant IS NULL OR e.tenant = p_tenant)
     GROUP BY date_trunc('month', e.day_utc), e.tenant, e.route, e.model,
              e.price_effective_from, e.input_usd_per_million, e.output_usd_per_million
     ORDER BY 1, 2, 3 NULLS FIRST, 4 NULLS FIRST, e.price_effective_from NULLS FIRST
$$;
COMMENT ON FUNCTION reporting.invoice_monthly(date, date, text) IS
    'invoice lines: usage and cost by calendar month (UTC), tenant, route, model and unit price';

CREATE OR REPLACE FUNCTION reporting.top_tenants(
    p_from date, p_to date, p_tenant text DEFAULT NULL
) RETURNS TABLE (
    rank            bigint,
    tenant          text,
    requests        bigint,
    total_tokens    bigint,
    cost_usd        numeric,
    unpriced_tokens bigint
)
LANGUAGE sql STABLE
AS $$
    SELECT rank() OVER (ORDER BY coalesce(sum(e.cost_usd), 0) DESC),
           e.tenant,
           count(*) FILTER (WHERE e.entry_kind = 'usage'),
           sum(e.total_tokens)::bigint,
           trim_scale(coalesce(sum(e.cost_usd), 0)),
           coalesce(sum(e.total_tokens) FILTER (WHERE e.cost_usd IS NULL), 0)::bigint
      FROM reporting.ledger_entries AS e
     WHERE e.recorded_at >= reporting.utc_start(p_from)
       AND e.recorded_at < reporting.utc_start(p_to)
       AND (p_tenant IS NULL OR e.tenant = p_tenant)
     GROUP BY e.tenant
     ORDER BY 1, 2
$$;
COMMENT ON FUNCTION reporting.top_tenants(date, date, text) IS
    'tenants ranked by cost over the period (add LIMIT n for the top n)';
