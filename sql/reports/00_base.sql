-- The reporting schema: what a finance analyst reads, from psql or a BI tool.
--
-- Views here run with their owner's rights (the role that ran the
-- migrations), so the read-only llmquota_reporting role can read them without
-- any privilege on the admission tables. The report functions in the other
-- files are plain SQL functions over these views (SECURITY INVOKER, so the
-- planner can inline them and prune ledger partitions by date).
--
-- Every report function takes (p_from date, p_to date, p_tenant text DEFAULT
-- NULL): the half-open period [p_from, p_to) in UTC days, and optionally one
-- tenant. `llmquota report --list` lists exactly the functions of that shape
-- here, with their comments.
--
-- Money: prices are numeric per million tokens; a cost is
-- (input_tokens * input price + output_tokens * output price) * 0.000001,
-- exact numeric arithmetic, priced at the model_prices row in force when the
-- usage was recorded. Usage of a model with no price then is "unpriced": it
-- adds nothing to cost_usd and is counted in unpriced_tokens. A row may also
-- carry a price of its own (price_usd: a response cache hit's, set by the
-- operator's cache policy), added to cost_usd; a hit's tokens are 0, so it
-- costs that price alone (a priced hit of an unpriced model is not unpriced).

CREATE SCHEMA IF NOT EXISTS reporting;
COMMENT ON SCHEMA reporting IS 'llmquota finance reports: views and set-returning functions over the usage ledger';

-- The start of a UTC day as a timestamptz.
CREATE OR REPLACE FUNCTION reporting.utc_start(p_day date)
RETURNS timestamptz
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$ SELECT p_day::timestamp AT TIME ZONE 'UTC' $$;

-- Model prices, as maintained by `llmquota prices set`.
CREATE OR REPLACE VIEW reporting.model_prices AS
SELECT model, effective_from, input_usd_per_million, output_usd_per_million, set_at, set_by,
       backdate_reason
  FROM public.model_prices;
COMMENT ON VIEW reporting.model_prices IS
    'every version of the price per million tokens of each model (a name or a * glob), from effective_from on';

-- Every ledger row with the price in force when it was recorded and its cost.
CREATE OR REPLACE VIEW reporting.ledger_entries AS
SELECT l.entry_id,
       l.recorded_at,
       (l.recorded_at AT TIME ZONE 'UTC')::date AS day_utc,
       l.entry_kind,
       l.outcome,
       l.tenant,
       l.route,
       l.model,
       l.reservation_id,
       l.input_tokens,
       l.output_tokens,
       l.input_tokens + l.output_tokens AS total_tokens,
       l.reserved_tokens,
       l.policy_version,
       l.reason,
       p.effective_from AS price_effective_from,
       p.input_usd_per_million,
       p.output_usd_per_million,
       CASE WHEN l.price_usd IS NULL
            THEN (l.input_tokens * p.input_usd_per_million
                  + l.output_tokens * p.output_usd_per_million) * 0.000001
            ELSE coalesce((l.input_tokens * p.input_usd_per_million
                           + l.output_tokens * p.output_usd_per_million) * 0.000001, 0)
                 + l.price_usd END AS cost_usd,
       -- where the figures came from (reported | clamped | counted), and an
       -- upstream's own where they differ (revision 0016; appended last, as
       -- CREATE OR REPLACE VIEW requires)
       l.usage_source,
       l.reported_input_tokens,
       l.reported_output_tokens,
       -- how the request was served (primary, cache, fallback_model, queued,
       -- second_deployment; NULL on adjustments and rows before revision
       -- 0026), and a cache hit's tokens the provider would have billed and
       -- its own price (appended last, as CREATE OR REPLACE VIEW requires)
       l.serving_path,
       l.saved_input_tokens,
       l.saved_output_tokens,
       l.price_usd
  FROM public.usage_ledger AS l
  LEFT JOIN LATERAL (
        -- lq_price_at's rule (admission.sql), written out: the view runs
        -- functions with the reader's rights, and the reporting role runs
        -- none of the service's. The exact name, else the longest `*` glob
        -- matching (escaped as lq_model_patterns escapes); its latest
        -- effective_from at or before the row, then its latest version.
        SELECT mp.effective_from, mp.input_usd_per_million, mp.output_usd_per_million
          FROM public.model_prices AS mp
         WHERE (mp.model = l.model
                OR (strpos(mp.model, '*') > 0
                    AND l.model LIKE replace(replace(replace(replace(mp.model, '\', '\\'),
                                                             '%', '\%'), '_', '\_'), '*', '%')))
           AND mp.effective_from <= l.recorded_at
         ORDER BY mp.model = l.model DESC, length(mp.model) DESC, mp.effective_from DESC,
                  mp.set_at DESC
         LIMIT 1) AS p ON true;
COMMENT ON VIEW reporting.ledger_entries IS
    'every ledger row (usage, late, adjustment) with the price in force when recorded, its cost in USD and how it was served';

-- One row per resolved reservation (its 'usage' ledger row), with what it
-- really used: the settled tokens, or for an expired reservation the tokens a
-- late settle reported (NULL while none did). The late row is found through
-- its receipt, so no extra index is needed on the settle path. A response
-- cache hit's row is no reservation (nothing was reserved or sent): left out.
CREATE OR REPLACE VIEW reporting.reservation_outcomes AS
SELECT u.reservation_id,
       u.recorded_at,
       u.day_utc,
       u.tenant,
       u.route,
       u.model,
       u.policy_version,
       u.outcome,
       u.reserved_tokens,
       CASE WHEN u.outcome = 'expired' THEN lt.total_tokens ELSE u.total_tokens END
           AS charged_tokens,
       lt.recorded_at AS late_recorded_at,
       lt.input_tokens AS late_input_tokens,
       lt.output_tokens AS late_output_tokens,
       lt.cost_usd AS late_cost_usd,
       u.usage_source,
       lt.usage_source AS late_usage_source
  FROM reporting.ledger_entries AS u
  LEFT JOIN public.ledger_receipts AS rc
         ON rc.reservation_id = u.reservation_id AND rc.entry_kind = 'late'
  LEFT JOIN reporting.ledger_entries AS lt
         ON lt.entry_id = rc.entry_id AND lt.recorded_at = rc.recorded_at
 WHERE u.entry_kind = 'usage'
   AND u.serving_path IS DISTINCT FROM 'cache';
COMMENT ON VIEW reporting.reservation_outcomes IS
    'one row per resolved reservation: reserved vs charged tokens, and its late settle if any';
