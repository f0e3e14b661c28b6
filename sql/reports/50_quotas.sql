-- Calendar quotas and prepaid credits, for finance.
--
-- Quota windows carry their quota's name, tenant and route themselves, so a
-- deleted quota's past windows stay here. Usage of a window is what is
-- reserved and not yet settled plus what settlements in it charged.

CREATE OR REPLACE VIEW reporting.quota_windows AS
SELECT w.tenant,
       w.route,
       w.quota_name,
       q.period,
       q.timezone,
       w.window_start,
       w.window_end,
       q.tokens AS tokens_limit,
       q.cost AS cost_limit,
       q.enforce,
       w.reserved_tokens,
       w.charged_tokens,
       w.reserved_tokens + w.charged_tokens AS usage_tokens,
       w.reserved_cost,
       w.charged_cost,
       w.reserved_cost + w.charged_cost AS usage_cost,
       w.quota_id IS NULL AS quota_deleted,
       w.updated_at
  FROM public.quota_windows AS w
  LEFT JOIN public.quotas AS q ON q.quota_id = w.quota_id;
COMMENT ON VIEW reporting.quota_windows IS
    'one row per quota and calendar window: limits, reserved and charged tokens and cost';

-- Every prepaid credit movement: top-ups, charges, adjustments.
CREATE OR REPLACE VIEW reporting.credit_entries AS
SELECT l.entry_id, l.recorded_at, l.tenant, l.entry_kind, l.amount, l.balance_after,
       l.reference, l.reservation_id, l.reason
  FROM public.credit_ledger AS l;
COMMENT ON VIEW reporting.credit_entries IS
    'the prepaid credit ledger: top-ups (by reference), charges (by reservation), adjustments';

-- Balances as the accounts hold them, beside the ledger's sum (equal unless
-- `llmquota audit` reports credit_balance drift).
CREATE OR REPLACE VIEW reporting.credit_balances AS
SELECT a.tenant,
       a.balance,
       a.reserved,
       a.balance - a.reserved AS available,
       coalesce(s.total, 0) AS ledger_balance,
       s.topped_up,
       s.charged,
       s.last_topup_at,
       a.updated_at
  FROM public.credit_accounts AS a
  LEFT JOIN (SELECT l.tenant,
                    sum(l.amount) AS total,
                    coalesce(sum(l.amount) FILTER (WHERE l.entry_kind = 'topup'), 0) AS topped_up,
                    coalesce(-sum(l.amount) FILTER (WHERE l.entry_kind = 'charge'), 0) AS charged,
                    max(l.recorded_at) FILTER (WHERE l.entry_kind = 'topup') AS last_topup_at
               FROM public.credit_ledger AS l
              GROUP BY l.tenant) AS s ON s.tenant = a.tenant;
COMMENT ON VIEW reporting.credit_balances IS
    'prepaid balance, reserved and available per tenant, with the ledger sum it derives from';

-- Quota usage per tenant, quota and window: the windows whose first day, in
-- the quota's own time zone, falls in the period [p_from, p_to). A window is
-- a local calendar day or month, so it is picked by its local start date:
-- Berlin's day of 2026-03-29 starts at 2026-03-28 23:00 UTC and belongs to
-- the 29th, Auckland's December to December (picking by the UTC date, as
-- this did first, listed such windows under the day before, or the wrong
-- month). A deleted quota's windows have lost their zone; their local start
-- date is taken as the UTC date twelve hours after the start, right for
-- every offset from -11:59 to +12:00.
--
-- charged_* is exactly what the usage ledger holds for the quota's tenant,
-- route and models in the window: each settlement's (and each late
-- settle's) tokens, priced at the model's price in force when it was
-- recorded (tests/acceptance/test_quota_report.py recomputes it from the
-- ledger). usage_* adds what open reservations hold. Ledger adjustments
-- (`llmquota ledger adjust`) are no quota's usage and are not counted.
CREATE OR REPLACE FUNCTION reporting.quota_usage(
    p_from date, p_to date, p_tenant text DEFAULT NULL
) RETURNS TABLE (
    tenant          text,
    route           text,
    quota_name      text,
    window_start    timestamptz,
    window_end      timestamptz,
    tokens_limit    bigint,
    usage_tokens    bigint,
    charged_tokens  bigint,
    cost_limit      numeric,
    usage_cost      numeric,
    charged_cost    numeric
)
LANGUAGE sql STABLE
AS $$
    SELECT w.tenant, w.route, w.quota_name, w.window_start, w.window_end,
           w.tokens_limit, w.usage_tokens, w.charged_tokens,
           w.cost_limit, trim_scale(w.usage_cost), trim_scale(w.charged_cost)
      FROM reporting.quota_windows AS w
     -- Local midnight of a date D is between D - 14 h and D + 12 h in UTC
     -- (offsets -12:00 to +14:00): a range on window_start for the index,
     -- then the exact local date.
     WHERE w.window_start >= reporting.utc_start(p_from) - interval '14 hours'
       AND w.window_start < reporting.utc_start(p_to) + interval '12 hours'
       AND (CASE WHEN w.timezone IS NULL
                 THEN ((w.window_start + interval '12 hours') AT TIME ZONE 'UTC')::date
                 ELSE (w.window_start AT TIME ZONE w.timezone)::date END) >= p_from
       AND (CASE WHEN w.timezone IS NULL
                 THEN ((w.window_start + interval '12 hours') AT TIME ZONE 'UTC')::date
                 ELSE (w.window_start AT TIME ZONE w.timezone)::date END) < p_to
       AND (p_tenant IS NULL OR w.tenant = p_tenant)
     ORDER BY w.tenant, w.quota_name, w.route NULLS FIRST, w.window_start
$$;
COMMENT ON FUNCTION reporting.quota_usage(date, date, text) IS
    'quota usage per tenant, quota and calendar window (windows whose local first day is in the period)';
