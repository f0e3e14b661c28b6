-- Oversubscription of the provider ceilings (issue 24).
--
-- Seed 001's rule of thumb: the sum of the per-tenant limits that can reach a
-- provider ceiling should not exceed 2-3x the ceiling, and what to track is
-- the p95 count of tenants active at once, not the count of tenants. For each
-- ceiling, tokens and requests per minute alike, the figures below say how
-- far that holds. `GET /v1/ceilings/{c}/oversubscription` and `llmquota report
-- oversubscription` run reporting.oversubscription with the service's rule
-- (LLMQUOTA_OVERSUBSCRIPTION_WARN_RATIO, _CRITICAL_RATIO); the view
-- reporting.ceiling_oversubscription is the same over the last 7 days with
-- the default rule (warn above 2x, critical above 3x).
--
-- Who reaches a ceiling. Every tenant that is not suspended: a request names
--   its model itself (fallback lists only add models), so any tenant may send
--   a model the ceiling matches. A tenant layer is what admission needs to
--   know a tenant at all. Its routes do not change the figure: a route's
--   limit only narrows the part of its traffic on that route, and a request
--   may name another route or none.
-- With what. The tenant layer's effective tokens_per_minute
--   (requests_per_minute): its own policy's figure where it set one, else its
--   plan's (plans.sql materializes them into the layer), at most the
--   ceiling's own figure: a tenant can never pass more than the whole ceiling
--   through it, and one without a limit of that kind counts as the whole
--   ceiling. A ceiling without a token (request) rate has no token (request)
--   figures here.
-- Active tenants. A tenant is active on a ceiling in a minute (UTC) when a
--   'usage' ledger row of a model the ceiling matches was recorded for it in
--   that minute: one row per resolved reservation, settled, cancelled, in
--   error or expired (late rows and adjustments are not traffic). Only
--   minutes with activity on the ceiling count: the question is how many
--   tenants share it when it is in use, and the idle minutes of nights and
--   weekends would pull p50 and p95 towards 0 and make a busy hour look safe.
--   p50 and p95 are nearest-rank (percentile_disc: the smallest count that
--   at least that share of the active minutes do not exceed), so each is a
--   count that really happened; with no active minute all three are 0.
-- Effective. What the p95 count of tenants could ask of the ceiling at once,
--   taking the worst case, the ones with the largest figures: the sum of the
--   p95 largest reach figures of today's tenants (all of them, when fewer),
--   over the ceiling. A mean or median limit times the count would let one
--   unlimited tenant disappear into the average.
-- Ratios: sum / ceiling, rounded to two decimals half away from zero
--   (numeric round): 250000 / 90000 = 2.777... reads 2.78.
-- Verdict: 'critical' when a sum exceeds p_critical_above times its ceiling,
--   else 'warn' when it exceeds p_warn_above times it, else 'ok'; the worse of
--   tokens and requests. Compared exactly (sum > k * ceiling in numeric), not
--   on the rounded ratio. The effective ratio informs and does not vote: the
--   rule is the seed's, on the sum of the limits.
--
-- Cost: one pass over the period's ledger rows (the monthly partitions it
-- touches), joined to the few ceilings by their patterns; nothing is locked.

-- The provider ceilings as configured (PUT /v1/ceilings/{c}).
CREATE OR REPLACE VIEW reporting.provider_ceilings AS
SELECT c.ceiling,
       c.models,
       c.tokens_per_minute,
       c.token_burst,
       c.requests_per_minute,
       c.request_burst,
       c.max_in_flight
  FROM public.limit_layers AS c
 WHERE c.scope = 'ceiling';
COMMENT ON VIEW reporting.provider_ceilings IS
    'each provider ceiling: the models it matches (names and * globs) and its limits';

-- One row per ceiling and tenant that can reach it (see the header): the
-- tenant's own effective limits (NULL: none of that kind) and what it can
-- take of the ceiling (reach_*: the limit, at most the ceiling's; NULL when
-- the ceiling has no rate of that kind).
CREATE OR REPLACE VIEW reporting.ceiling_tenant_limits AS
SELECT c.ceiling,
       l.tenant,
       l.plan,
       l.tokens_per_minute AS tenant_tokens_per_minute,
       l.requests_per_minute AS tenant_requests_per_minute,
       -- least() skips a NULL: a tenant without a limit reaches the whole ceiling
       CASE WHEN c.tokens_per_minute IS NOT NULL
            THEN least(l.tokens_per_minute, c.tokens_per_minute) END AS reach_tokens_per_minute,
       CASE WHEN c.requests_per_minute IS NOT NULL
            THEN least(l.requests_per_minute, c.requests_per_minute) END AS reach_requests_per_minute
  FROM public.limit_layers AS c
  JOIN public.limit_layers AS l ON l.scope = 'tenant' AND l.route IS NULL
  JOIN public.tenants AS t ON t.tenant = l.tenant
 WHERE c.scope = 'ceiling'
   AND t.suspended_at IS NULL;
COMMENT ON VIEW reporting.ceiling_tenant_limits IS
    'each tenant that can reach each provider ceiling, its tokens and requests per minute and '
    'what it can take of the ceiling (at most all of it)';

-- Every 'usage' ledger row of a model a ceiling matches, with its UTC minute:
-- the tenants active on each ceiling. Filter on recorded_at, so that only the
-- period's partitions are read.
CREATE OR REPLACE VIEW reporting.ceiling_activity AS
SELECT c.ceiling,
       u.tenant,
       u.model,
       u.recorded_at,
       date_bin('1 minute', u.recorded_at, timestamptz '2000-01-01 00:00:00+00') AS minute
  FROM public.usage_ledger AS u
  JOIN public.limit_layers AS c
    ON c.scope = 'ceiling' AND u.model LIKE ANY (c.model_patterns)
 WHERE u.entry_kind = 'usage'
   -- a response cache hit never reached the provider: no activity at its ceiling
   AND u.serving_path IS DISTINCT FROM 'cache';
COMMENT ON VIEW reporting.ceiling_activity IS
    'each resolved reservation of a model a provider ceiling matches (not a cache hit): ceiling, tenant, UTC minute';

-- The report, over the last p_days days up to now (p_days >= 1; the callers
-- check it), of every ceiling or of ceiling p_ceiling alone.
CREATE OR REPLACE FUNCTION reporting.oversubscription(
    p_days           integer DEFAULT 7,
    p_warn_above     numeric DEFAULT 2,
    p_critical_above numeric DEFAULT 3,
    p_ceiling        text DEFAULT NULL
) RETURNS TABLE (
    ceiling                        text,
    period_start                   timestamptz,
    period_end                     timestamptz,
    tenants                        bigint,
    tenants_without_token_limit    bigint,
    tenants_without_request_limit  bigint,
    tokens_per_minute              bigint,
    sum_tenant_tokens_per_minute   bigint,
    ratio                          numeric,
    requests_per_minute            bigint,
    sum_tenant_requests_per_minute bigint,
    requests_ratio                 numeric,
    active_minutes                 bigint,
    active_tenants_p50             bigint,
    active_tenants_p95             bigint,
    active_tenants_max             bigint,
    effective_tokens_per_minute    bigint,
    effective_ratio                numeric,
    effective_requests_per_minute  bigint,
    effective_requests_ratio       numeric,
    verdict                        text
)
LANGUAGE sql STABLE
AS $$
    WITH period AS (
        SELECT now() - make_interval(days => p_days) AS since, now() AS until
    ), ceilings AS (
        SELECT c.*
          FROM reporting.provider_ceilings AS c
         WHERE p_ceiling IS NULL OR c.ceiling = p_ceiling
    ), per_minute AS (
        -- Tenants active on each ceiling in each minute with any activity.
        -- The period is written out, not read from `period`: a bound the
        -- planner sees as an expression of now() lets it skip the ledger's
        -- partitions outside the period (a join to a CTE would not).
        SELECT a.ceiling, a.minute, count(DISTINCT a.tenant) AS active
          FROM reporting.ceiling_activity AS a
         WHERE a.recorded_at >= now() - make_interval(days => p_days)
           AND a.recorded_at < now()
           AND (p_ceiling IS NULL OR a.ceiling = p_ceiling)
         GROUP BY a.ceiling, a.minute
    ), active AS (
        SELECT m.ceiling,
               count(*) AS minutes,
               percentile_disc(0.5) WITHIN GROUP (ORDER BY m.active) AS p50,
               percentile_disc(0.95) WITHIN GROUP (ORDER BY m.active) AS p95,
               max(m.active) AS most
          FROM per_minute AS m
         GROUP BY m.ceiling
    ), ranked AS (
        -- each ceiling's tenants, largest reach first (ties by name: which
        -- of two equal figures is counted does not change a sum)
        SELECT r.ceiling, r.tenant, r.reach_tokens_per_minute, r.reach_requests_per_minute,
               r.tenant_tokens_per_minute, r.tenant_requests_per_minute,
               row_number() OVER (PARTITION BY r.ceiling
                                  ORDER BY r.reach_tokens_per_minute DESC NULLS LAST, r.tenant)
                   AS token_rank,
               row_number() OVER (PARTITION BY r.ceiling
                                  ORDER BY r.reach_requests_per_minute DESC NULLS LAST, r.tenant)
                   AS request_rank
          FROM reporting.ceiling_tenant_limits AS r
         WHERE p_ceiling IS NULL OR r.ceiling = p_ceiling
    ), sums AS (
        SELECT c.ceiling,
               count(r.tenant) AS tenants,
               count(r.tenant) FILTER (WHERE r.tenant_tokens_per_minute IS NULL)
                   AS without_tokens,
               count(r.tenant) FILTER (WHERE r.tenant_requests_per_minute IS NULL)
                   AS without_requests,
               sum(r.reach_tokens_per_minute) AS tokens,
               sum(r.reach_requests_per_minute) AS requests,
               sum(r.reach_tokens_per_minute) FILTER (WHERE r.token_rank <= a.p95)
                   AS effective_tokens,
               sum(r.reach_requests_per_minute) FILTER (WHERE r.request_rank <= a.p95)
                   AS effective_requests
          FROM ceilings AS c
               LEFT JOIN ranked AS r ON r.ceiling = c.ceiling
               LEFT JOIN active AS a ON a.ceiling = c.ceiling
         GROUP BY c.ceiling
    ), figures AS (
        SELECT c.ceiling, c.tokens_per_minute AS tpm, c.requests_per_minute AS rpm,
               s.tenants,
               CASE WHEN c.tokens_per_minute IS NOT NULL THEN s.without_tokens END
                   AS without_tokens,
               CASE WHEN c.requests_per_minute IS NOT NULL THEN s.without_requests END
                   AS without_requests,
               CASE WHEN c.tokens_per_minute IS NOT NULL THEN coalesce(s.tokens, 0) END AS tokens,
               CASE WHEN c.requests_per_minute IS NOT NULL THEN coalesce(s.requests, 0) END
                   AS requests,
               CASE WHEN c.tokens_per_minute IS NOT NULL THEN coalesce(s.effective_tokens, 0) END
                   AS effective_tokens,
               CASE WHEN c.requests_per_minute IS NOT NULL
                    THEN coalesce(s.effective_requests, 0) END AS effective_requests,
               coalesce(a.minutes, 0) AS minutes,
               coalesce(a.p50, 0) AS p50,
               coalesce(a.p95, 0) AS p95,
               coalesce(a.most, 0) AS most
          FROM ceilings AS c
               JOIN sums AS s ON s.ceiling = c.ceiling
               LEFT JOIN active AS a ON a.ceiling = c.ceiling
    )
    SELECT f.ceiling, p.since, p.until, f.tenants, f.without_tokens, f.without_requests,
           f.tpm, f.tokens::bigint, round(f.tokens / f.tpm, 2),
           f.rpm, f.requests::bigint, round(f.requests / f.rpm, 2),
           f.minutes, f.p50, f.p95, f.most,
           f.effective_tokens::bigint, round(f.effective_tokens / f.tpm, 2),
           f.effective_requests::bigint, round(f.effective_requests / f.rpm, 2),
           -- NULL (a ceiling without that rate) is never above: the CASE skips it
           CASE WHEN f.tokens > p_critical_above * f.tpm
                  OR f.requests > p_critical_above * f.rpm THEN 'critical'
                WHEN f.tokens > p_warn_above * f.tpm
                  OR f.requests > p_warn_above * f.rpm THEN 'warn'
                ELSE 'ok' END
      FROM figures AS f
           CROSS JOIN period AS p
     ORDER BY f.ceiling
$$;
COMMENT ON FUNCTION reporting.oversubscription(integer, numeric, numeric, text) IS
    'per provider ceiling over the last p_days: the sum of the tenant limits that can reach it '
    'against it, tenants active per minute (p50, p95, max), the effective ratio and a verdict';

-- The report over the last 7 days with the default rule, for BI tools.
CREATE OR REPLACE VIEW reporting.ceiling_oversubscription AS
SELECT o.*
  FROM reporting.oversubscription(7, 2, 3) AS o;
COMMENT ON VIEW reporting.ceiling_oversubscription IS
    'reporting.oversubscription over the last 7 days, warn above 2x and critical above 3x';
