-- Named statements of the ledger's finance side: adjustments, prices, the
-- billing export and the reports. None of them runs on the admission path,
-- and none takes a lock an admission or a settlement waits for: the ledger
-- is only appended to and read (MVCC), the export serializes on its own
-- state row, and prices are only appended to. Every write goes through a
-- SECURITY DEFINER function of ledger.sql: the app role may not write these
-- tables itself.

-- adjust_ledger --
-- Append a signed correction for an existing tenant; no row: no such tenant
-- (see lq_ledger_adjust: the app role cannot insert ledger rows itself).
SELECT * FROM lq_ledger_adjust($1::text, $2::text, $3::text, $4::bigint, $5::bigint, $6::text)

-- export_ledger --
-- Number newly final ledger rows (up to $3) and return up to $2 rows after
-- export id $1, in export id order (see lq_export_ledger).
SELECT * FROM lq_export_ledger($1::bigint, $2::integer, $3::integer)

-- set_price --
-- Set a new version of a model's prices per million tokens from $2 on (NULL:
-- now, by the database clock), set by $5; $6 says why when $2 is in the
-- past (see lq_set_price). superseded is true when a version with the same
-- start existed.
SELECT * FROM lq_set_price($1::text, $2::timestamptz, $3::numeric, $4::numeric, $5::text,
                           $6::text)

-- import_builtin_prices --
-- The shipped price table (model, in force from, input, output per million
-- tokens), row k of each array one price; one outcome per row (see
-- lq_import_builtin_prices in sql/ledger.sql).
SELECT * FROM lq_import_builtin_prices($1::text[], $2::timestamptz[], $3::numeric[],
                                       $4::numeric[])

-- list_prices --
-- Every version of every price, or of one model's ($1), oldest first.
SELECT model, effective_from, input_usd_per_million, output_usd_per_million, set_at, set_by,
       backdate_reason
  FROM model_prices
 WHERE $1::text IS NULL OR model = $1::text
 ORDER BY model, effective_from, set_at

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
