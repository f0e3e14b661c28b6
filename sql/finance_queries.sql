-- Named statements of the ledger's finance side: adjustments, prices, the
-- billing export and the reports. None of them runs on the admission path,
-- and none takes a lock an admission or a settlement waits for: the ledger
-- is only appended to and read (MVCC), the export serializes on its own
-- state row, and prices are read by reports only.

-- adjust_ledger --
-- Append a signed correction for an existing tenant; no row: no such tenant.
INSERT INTO usage_ledger (entry_kind, tenant, route, model, input_tokens, output_tokens,
                          reserved_tokens, outcome, reason)
SELECT 'adjustment', t.tenant, $2::text, $3::text, $4::bigint, $5::bigint, 0, 'adjustment',
       $6::text
  FROM tenants AS t
 WHERE t.tenant = $1::text
RETURNING entry_id, recorded_at, tenant, route, model, input_tokens, output_tokens, reason

-- export_ledger --
-- Number newly final ledger rows (up to $3) and return up to $2 rows after
-- export id $1, in export id order (see lq_export_ledger).
SELECT * FROM lq_export_ledger($1::bigint, $2::integer, $3::integer)

-- set_price --
-- Set a model's prices per million tokens from $2 on (NULL: now, by the
-- database clock); replaces a price with the same start. replaced is true
-- when one existed.
INSERT INTO model_prices AS mp (model, effective_from, input_usd_per_million,
                                output_usd_per_million)
VALUES ($1::text, coalesce($2::timestamptz, clock_timestamp()), $3::numeric, $4::numeric)
ON CONFLICT (model, effective_from) DO UPDATE
   SET input_usd_per_million = excluded.input_usd_per_million,
       output_usd_per_million = excluded.output_usd_per_million,
       set_at = clock_timestamp()
RETURNING mp.model, mp.effective_from, mp.input_usd_per_million, mp.output_usd_per_million,
          (xmax <> 0) AS replaced

-- list_prices --
-- Every price, or one model's ($1), oldest first.
SELECT model, effective_from, input_usd_per_million, output_usd_per_million
  FROM model_prices
 WHERE $1::text IS NULL OR model = $1::text
 ORDER BY model, effective_from

-- list_reports --
-- The report functions this role may run: every set-returning function in
-- schema reporting taking (date, date, text), with its comment and columns.
SELECT p.proname AS name,
       coalesce(obj_description(p.oid, 'pg_proc'), '') AS description,
       ARRAY(SELECT a.name
               FROM unnest(p.proargnames, p.proargmodes) WITH ORDINALITY AS a(name, mode, i)
              WHERE a.mode = 't'
              ORDER BY a.i) AS columns
  FROM pg_proc AS p
  JOIN pg_namespace AS n ON n.oid = p.pronamespace
 WHERE n.nspname = 'reporting'
   AND p.prokind = 'f'
   AND p.proretset
   AND array_to_string(p.proargtypes::regtype[], ',') = 'date,date,text'
   AND has_function_privilege(p.oid, 'EXECUTE')
 ORDER BY p.proname

-- run_report --
-- One report over [$1, $2) in UTC days, optionally for tenant $3. {report}
-- is the quoted name of a function list_reports returned, never user text.
SELECT * FROM reporting.{report}($1::date, $2::date, $3::text)
