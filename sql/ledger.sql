-- The usage ledger: what finance bills from.
--
-- usage_ledger (created by migration 0002) is partitioned by month on
-- recorded_at, in UTC, with a DEFAULT partition underneath as the last safety
-- net. lq_finish (admission.sql) appends to it in the same transaction that
-- settles or expires a reservation; `llmquota ledger adjust` appends signed
-- corrections. Nothing ever changes or removes a row:
--
--   * lq_ledger_refuse_change, a trigger on the table and on every partition,
--     refuses UPDATE, DELETE and TRUNCATE, whoever asks;
--   * the application role has only SELECT and INSERT on it (roles.sql).
--
-- Exactly once: every row that belongs to a reservation also writes a receipt
-- (reservation_id, entry_kind) into ledger_receipts, whose PRIMARY KEY refuses
-- a second one. A unique constraint on the partitioned table itself would have
-- to include the partition key (recorded_at), and two writes of the same event
-- a millisecond apart differ in recorded_at, so it would prove nothing. The
-- receipt is written by a trigger, in the same statement as the ledger row, so
-- the guarantee holds for every writer, not only for lq_finish.
--
-- Every function here that changes the schema or touches the receipts runs as
-- its owner (SECURITY DEFINER, with a fixed search_path): the application role
-- needs no privilege on the partitions or on ledger_receipts.
--
-- Nobody but the owner writes a ledger row directly (issue 20). The app role
-- has SELECT only on usage_ledger, credit_ledger, model_prices and the
-- export's bookkeeping; every row is written by a SECURITY DEFINER function
-- that sets entry_id, xact_id and recorded_at itself (their defaults: the
-- identity, pg_current_xact_id(), clock_timestamp()). Before, the app role
-- could INSERT with OVERRIDING SYSTEM VALUE or a back-dated recorded_at: one
-- row below the export's cursor was never exported though every report
-- counted it, and a duplicate entry_id stopped every export. The writers:
-- lq_finish (settlements, expiries, late settles; lq_record_outage_admissions
-- goes through it), lq_credit_topup and lq_credit_apply (quotas.sql),
-- lq_ledger_adjust, lq_set_price and lq_export_ledger here; roles.sql makes
-- those of the other scripts SECURITY DEFINER without touching their bodies.


-- Refuse UPDATE, DELETE and TRUNCATE on the ledger. Corrections are new rows.
CREATE OR REPLACE FUNCTION lq_ledger_refuse_change()
RETURNS trigger
LANGUAGE plpgsql
AS $$
BEGIN
    RAISE EXCEPTION 'usage_ledger is append-only: % on % is refused', TG_OP, TG_TABLE_NAME
        USING ERRCODE = 'insufficient_privilege',
              HINT = 'Record a correction as a new row: llmquota ledger adjust --tenant T --tokens N --reason ...';
END
$$;


-- Write the receipt of a reservation's ledger row. Its primary key makes a
-- second 'usage' (or 'late') row for one reservation fail the whole
-- statement: the transaction that tried rolls back, and nothing is counted
-- twice. Adjustments belong to no reservation and need no receipt.
CREATE OR REPLACE FUNCTION lq_ledger_receipt()
RETURNS trigger
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, public
AS $$
BEGIN
    IF NEW.reservation_id IS NOT NULL THEN
        INSERT INTO ledger_receipts (reservation_id, entry_kind, entry_id, recorded_at)
        VALUES (NEW.reservation_id, NEW.entry_kind, NEW.entry_id, NEW.recorded_at);
    END IF;
    RETURN NULL;
END
$$;


-- The schema the ledger is in: public, or a cell's (docs/scaling.md). Its
-- partitions go beside it. Unpinned, so the name resolves under the pin of
-- the partition function that asks.
CREATE OR REPLACE FUNCTION lq_ledger_home()
RETURNS name
LANGUAGE sql STABLE
AS $$
    SELECT n.nspname FROM pg_class AS c JOIN pg_namespace AS n ON n.oid = c.relnamespace
     WHERE c.oid = 'usage_ledger'::regclass
$$;


-- Create the partition for one calendar month (UTC) unless it exists.
--
-- status: exists | created | default_holds_rows | busy
--
-- The partition is built as a plain table with a CHECK constraint matching
-- its bounds, then ATTACHed: ATTACH takes only SHARE UPDATE EXCLUSIVE on
-- usage_ledger, which does not conflict with the settlements inserting into
-- it, so settling never waits for this. ATTACH does take the DEFAULT
-- partition exclusively to prove it holds no row of the new month; a report
-- reading it makes us wait, for at most lock_timeout, and then give up
-- ('busy') until the next sweeper run, rather than queue settlements behind us.
--
-- If the DEFAULT partition already holds rows of that month (the sweeper did
-- not run for months), the month stays in the DEFAULT partition: inserts keep
-- working, and docs/operations.md says how to move such rows by hand.
CREATE OR REPLACE FUNCTION lq_create_ledger_partition(p_month date)
RETURNS text
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, public
SET lock_timeout = '500ms'
AS $$
DECLARE
    month_start timestamptz := date_trunc('month', p_month)::timestamp AT TIME ZONE 'UTC';
    month_end   timestamptz := (date_trunc('month', p_month) + interval '1 month')::timestamp
                               AT TIME ZONE 'UTC';
    part        text := 'usage_ledger_' || to_char(p_month, 'YYYY_MM');
    home        name := lq_ledger_home();  -- its partitions go beside it
BEGIN
    IF EXISTS (SELECT 1
                 FROM pg_inherits AS i
                 JOIN pg_class AS c ON c.oid = i.inhrelid
                WHERE i.inhparent = 'usage_ledger'::regclass
                  AND c.relname = part) THEN
        RETURN 'exists';
    END IF;
    IF to_regclass(format('%I.%I', home, part)) IS NOT NULL THEN
        -- A detached (archived) partition still has the name: leave it alone;
        -- the month's new rows go to the DEFAULT partition.
        RETURN 'exists';
    END IF;
    IF EXISTS (SELECT 1 FROM usage_ledger_default
                WHERE recorded_at >= month_start AND recorded_at < month_end) THEN
        RAISE WARNING 'usage_ledger: rows of % are in the DEFAULT partition; % not created',
            to_char(p_month, 'YYYY-MM'), part;
        RETURN 'default_holds_rows';
    END IF;
    BEGIN
        EXECUTE format('CREATE TABLE %1$I.%2$I (LIKE %1$I.usage_ledger INCLUDING DEFAULTS INCLUDING CONSTRAINTS)',
                       home, part);
        EXECUTE format('ALTER TABLE %I.%I ADD CONSTRAINT %I CHECK (recorded_at >= %L AND recorded_at < %L)',
                       home, part, part || '_bounds', month_start, month_end);
        -- Row triggers are cloned from usage_ledger on ATTACH; a TRUNCATE
        -- trigger is not, so each partition gets its own.
        EXECUTE format('CREATE TRIGGER usage_ledger_no_truncate BEFORE TRUNCATE ON %I.%I '
                       'FOR EACH STATEMENT EXECUTE FUNCTION lq_ledger_refuse_change()', home, part);
        EXECUTE format('ALTER TABLE %1$I.usage_ledger ATTACH PARTITION %1$I.%2$I FOR VALUES FROM (%3$L) TO (%4$L)',
                       home, part, month_start, month_end);
    EXCEPTION WHEN lock_not_available THEN
        RAISE WARNING 'usage_ledger: % not created, a lock was busy; the next run retries', part;
        RETURN 'busy';
    END;
    RETURN 'created';
END
$$;


-- Make sure the partitions of the p_months_ahead months after this one
-- exist. Every sweeper run calls this, so a month's partition exists long
-- before its first row. p_at shifts "now" (tests, back-filling); NULL is the
-- database clock.
--
-- Never the current month, nor a month starting within the next hour: ATTACH
-- of a month that is receiving rows would race them. A row routed to the
-- DEFAULT partition while the new partition is being attached fails its
-- partition check ("new row ... violates partition constraint"), and a
-- settlement must never fail. Such a month stays in the DEFAULT partition
-- (nothing is lost; see docs/operations.md). The migrations create the
-- current month themselves, while nobody can write to the new table.
--
-- Sweepers on several hosts may run this at once: they queue on the
-- advisory lock, and the second finds every month the first created. The
-- wait is bounded (lock_timeout, 1 s: shorter than the service's statement
-- timeout, so the answer names the lock): a lock that stays busy fails the
-- call (lock_not_available, so the sweeper reports it and retries) instead
-- of returning no row as if nothing were missing. Only the service role may
-- take advisory locks at all (roles.sql), so no other role can hold it.
--
-- status per month: exists | created | default_holds_rows | busy | too_close
CREATE OR REPLACE FUNCTION lq_ensure_ledger_partitions(
    p_months_ahead integer,
    p_at           timestamptz DEFAULT NULL
) RETURNS TABLE (partition_name text, status text)
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, public
SET lock_timeout = '1s'
AS $$
DECLARE
    this_month  date := date_trunc('month', coalesce(p_at, clock_timestamp()) AT TIME ZONE 'UTC')::date;
    month       date;
    -- A named limit: partitions further ahead than this are a typo.
    max_months_ahead constant integer := 120;
    -- A month starting sooner than this may see rows while we attach it.
    attach_margin constant interval := interval '1 hour';
    home        name := lq_ledger_home();
BEGIN
    IF p_months_ahead IS NULL OR p_months_ahead NOT BETWEEN 1 AND max_months_ahead THEN
        RAISE EXCEPTION 'months ahead must be between 1 and %, not %', max_months_ahead, p_months_ahead
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    BEGIN
        PERFORM pg_advisory_xact_lock(hashtextextended('llmquota.usage_ledger.partitions', 0));
    EXCEPTION WHEN lock_not_available THEN
        RAISE EXCEPTION 'usage_ledger: the partition lock stayed busy; no partition was checked'
            USING ERRCODE = 'lock_not_available';
    END;
    FOR i IN 1 .. p_months_ahead LOOP
        month := (this_month + make_interval(months => i))::date;
        partition_name := 'usage_ledger_' || to_char(month, 'YYYY_MM');
        IF month::timestamp AT TIME ZONE 'UTC' < clock_timestamp() + attach_margin
           AND to_regclass(format('%I.%I', home, partition_name)) IS NULL THEN
            status := 'too_close';
        ELSE
            status := lq_create_ledger_partition(month);
        END IF;
        RETURN NEXT;
    END LOOP;
END
$$;


-- Detach one past month's partition for archival (then pg_dump and drop it;
-- see docs/operations.md). Only the table's owner can: the service role
-- cannot ALTER the ledger. Refused for this month or a later one, and, unless
-- p_require_exported is false, while any of its rows has no export id yet (a
-- billing consumer would never see it).
--
-- The DEFAULT partition rules out DETACH ... CONCURRENTLY, so this takes an
-- ACCESS EXCLUSIVE lock on usage_ledger for the few milliseconds the catalog
-- change needs. lock_timeout bounds how long settlements could queue behind
-- it if a long report holds the table: it gives up after 1 s, to be retried.
-- The admission tables are not touched.
CREATE OR REPLACE FUNCTION lq_detach_ledger_partition(
    p_month            date,
    p_require_exported boolean DEFAULT true
) RETURNS text
LANGUAGE plpgsql
SET search_path = pg_catalog, public
SET lock_timeout = '1s'
AS $$
DECLARE
    month_start timestamptz := date_trunc('month', p_month)::timestamp AT TIME ZONE 'UTC';
    month_end   timestamptz := (date_trunc('month', p_month) + interval '1 month')::timestamp
                               AT TIME ZONE 'UTC';
    part        text := 'usage_ledger_' || to_char(p_month, 'YYYY_MM');
    unexported  bigint;
    home        name := lq_ledger_home();  -- its partitions go beside it
BEGIN
    IF month_end > clock_timestamp() THEN
        RAISE EXCEPTION '% is not in the past: only finished months can be archived', part
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF NOT EXISTS (SELECT 1
                     FROM pg_inherits AS i
                     JOIN pg_class AS c ON c.oid = i.inhrelid
                    WHERE i.inhparent = 'usage_ledger'::regclass
                      AND c.relname = part) THEN
        RAISE EXCEPTION 'no attached partition %', part USING ERRCODE = 'undefined_table';
    END IF;
    IF p_require_exported THEN
        EXECUTE format('SELECT count(*) FROM %I.%I AS l
                         WHERE NOT EXISTS (SELECT 1 FROM ledger_export_positions AS p
                                            WHERE p.entry_id = l.entry_id)', home, part)
           INTO unexported;
        IF unexported > 0 THEN
            RAISE EXCEPTION '% has % rows the billing export has not numbered yet', part, unexported
                USING ERRCODE = 'object_not_in_prerequisite_state',
                      HINT = 'Run llmquota ledger export until it catches up, then retry.';
        END IF;
    END IF;
    EXECUTE format('ALTER TABLE %1$I.usage_ledger DETACH PARTITION %1$I.%2$I', home, part);
    RETURN part;
END
$$;


-- Is the ledger stored on the node this runs on? Always, but on Citus for a
-- cell's ledger (a distributed schema's table, on one worker) read from
-- anywhere else, such as the coordinator. Unpinned, so usage_ledger resolves
-- under the pin of the caller; Citus's catalogs are only read where the
-- extension is.
CREATE OR REPLACE FUNCTION lq_ledger_is_local()
RETURNS boolean
LANGUAGE plpgsql STABLE
AS $$
BEGIN
    -- Two statements: PL/pgSQL plans the second only where it runs.
    IF to_regclass('pg_catalog.pg_dist_partition') IS NULL THEN
        RETURN true;
    END IF;
    RETURN NOT EXISTS (SELECT FROM pg_dist_partition
                        WHERE logicalrelid = 'usage_ledger'::regclass)
        OR EXISTS (SELECT FROM pg_dist_shard AS s
                     JOIN pg_dist_placement AS p USING (shardid)
                    WHERE s.logicalrelid = 'usage_ledger'::regclass
                      AND p.groupid = (SELECT groupid FROM pg_dist_local_group));
END
$$;


-- The billing export: ledger rows in a gapless order, after a cursor.
--
-- Why not simply "entry_id > cursor ORDER BY entry_id": entry_id comes from a
-- sequence when the row is inserted, not when it commits. Transaction A can
-- take id 7 and still be open when transaction B takes id 8 and commits; a
-- reader then sees 8 but not 7, moves its cursor past 8, and never sees 7.
-- Waiting for "no transaction older than the snapshot" is not enough either,
-- because xids and entry_ids are handed out in different orders: A may hold
-- the lower entry_id yet the younger xid.
--
-- What we do: each row carries xact_id, the inserting transaction's id
-- (pg_current_xact_id(), 64-bit, never wraps). pg_snapshot_xmin of our
-- snapshot is the oldest transaction still running: every transaction with a
-- smaller id has finished, so its rows are visible now and none will ever be
-- added to it; every row not yet visible belongs to a transaction with an id
-- at or above that horizon. So rows in (xact_id, entry_id) order are final
-- below the horizon. The export numbers them in that order with a gapless
-- export_id (ledger_export_positions), remembering the last (xact_id,
-- entry_id) numbered; a row that commits later has a larger xact_id than any
-- numbered row and is numbered after them. A consumer pages by export_id:
-- ids are 1, 2, 3, ... with no gaps, and resuming after the last id it
-- processed returns every row once.
--
-- A long-running transaction anywhere on the server holds the horizon back:
-- the export then waits (returns fewer rows), it never skips.
--
-- Exporters serialize on the single ledger_export_state row; settlement never
-- touches it, so admission never waits for an export.
--
-- SECURITY DEFINER: the app role can neither number a row nor move the
-- cursor itself (an UPDATE of ledger_export_state skipped every row below
-- it), and no role but the owner can insert a row the horizon reasoning
-- does not hold for (its own xact_id or entry_id).
-- The result gained usage_source and the as-reported figures (revision
-- 0016), then serving_path, a cache hit's saved tokens and a row's own price
-- (revision 0026): a changed result type needs the old function gone first.
DROP FUNCTION IF EXISTS lq_export_ledger(bigint, integer, integer);
CREATE OR REPLACE FUNCTION lq_export_ledger(
    p_after_export_id bigint,
    p_limit           integer,
    p_number_limit    integer
) RETURNS TABLE (
    export_id        bigint,
    entry_id         bigint,
    recorded_at      timestamptz,
    entry_kind       text,
    tenant           text,
    route            text,
    model            text,
    reservation_id   uuid,
    input_tokens     bigint,
    output_tokens    bigint,
    reserved_tokens  bigint,
    outcome          text,
    policy_version   bigint,
    reason           text,
    usage_source     text,
    reported_input_tokens  numeric,
    reported_output_tokens numeric,
    serving_path     text,
    saved_input_tokens  bigint,
    saved_output_tokens bigint,
    price_usd        numeric
)
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, public
AS $$
DECLARE
    st       record;
    horizon  xid8;
    numbered integer;
BEGIN
    -- (1) One exporter at a time numbers rows; the lock is on a row nothing
    -- else uses.
    SELECT * INTO STRICT st FROM ledger_export_state FOR UPDATE;

    -- (2) The horizon, taken after the lock: rows of transactions below it
    -- are final. The statements below take newer snapshots, which see at
    -- least everything that had finished by now. It must be the horizon of
    -- the node that holds the ledger: on Citus a cell's rows carry that
    -- node's transaction ids (cells_queries.sql,
    -- stamp_ledger_rows_on_their_node), and a call Citus did not send there
    -- (one inside a transaction block) runs on the coordinator, whose ids
    -- are another count: compared with them, a row could be skipped.
    IF NOT lq_ledger_is_local() THEN
        RAISE EXCEPTION 'the billing export must run on the node that holds the ledger'
            USING ERRCODE = 'feature_not_supported',
                  DETAIL = 'On Citus a cell''s export runs there only as a statement of its own: '
                           'Citus runs a call inside a transaction block on the coordinator.',
                  HINT = 'Call it outside BEGIN ... COMMIT (llmquota ledger export does).';
    END IF;
    horizon := pg_snapshot_xmin(pg_current_snapshot());

    -- (3) Number the next final rows, in (xact_id, entry_id) order, continuing
    -- the gapless sequence. entry_id is UNIQUE in ledger_export_positions, so
    -- a row can never be numbered twice.
    INSERT INTO ledger_export_positions AS p (export_id, entry_id, recorded_at, xact_id)
    SELECT st.last_export_id + row_number() OVER (ORDER BY n.xact_id, n.entry_id),
           n.entry_id, n.recorded_at, n.xact_id
      FROM (SELECT l.xact_id, l.entry_id, l.recorded_at
              FROM usage_ledger AS l
             WHERE (l.xact_id, l.entry_id) > (st.last_xact_id, st.last_entry_id)
               AND l.xact_id < horizon
             ORDER BY l.xact_id, l.entry_id
             LIMIT p_number_limit) AS n;
    GET DIAGNOSTICS numbered = ROW_COUNT;
    IF numbered > 0 THEN
        UPDATE ledger_export_state AS s
           SET last_export_id = p.export_id,
               last_xact_id = p.xact_id,
               last_entry_id = p.entry_id
          FROM ledger_export_positions AS p
         WHERE p.export_id = st.last_export_id + numbered;
    END IF;

    -- (4) The page after the consumer's cursor.
    RETURN QUERY
    SELECT p.export_id, l.entry_id, l.recorded_at, l.entry_kind, l.tenant, l.route, l.model,
           l.reservation_id, l.input_tokens, l.output_tokens, l.reserved_tokens, l.outcome,
           l.policy_version, l.reason,
           l.usage_source, l.reported_input_tokens, l.reported_output_tokens,
           l.serving_path, l.saved_input_tokens, l.saved_output_tokens, l.price_usd
      FROM ledger_export_positions AS p
      JOIN usage_ledger AS l
        ON l.entry_id = p.entry_id AND l.recorded_at = p.recorded_at
     WHERE p.export_id > p_after_export_id
     ORDER BY p.export_id
     LIMIT p_limit;
END
$$;


-- Append a signed correction for an existing tenant (`llmquota ledger
-- adjust`); no row: no such tenant. The only way an adjustment reaches the
-- ledger: the row's ids and time are the database's, never the caller's.
--
-- A correction is bounded by what a real one needs, in the database, where
-- a caller holding the app role cannot skip it: at most
-- max_adjustment_tokens either way in one row, and one that takes tokens
-- back may not take more than the tenant's net recorded tokens of that type
-- over the last lookback period (a correction undoes usage that was
-- recorded; a row of -10^12 would hide a month of any tenant's usage from
-- the invoice). finance/ledger.py checks the same figures first, for a
-- clear message.
CREATE OR REPLACE FUNCTION lq_ledger_adjust(
    p_tenant        text,
    p_route         text,
    p_model         text,
    p_input_tokens  bigint,
    p_output_tokens bigint,
    p_reason        text
) RETURNS TABLE (entry_id bigint, recorded_at timestamptz, tenant text, route text,
                 model text, input_tokens bigint, output_tokens bigint, reason text)
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, public
AS $$
DECLARE
    max_adjustment_tokens constant bigint := 1000000000;
    lookback constant interval := interval '92 days';
    net_input  numeric;
    net_output numeric;
BEGIN
    IF p_input_tokens IS NULL OR p_output_tokens IS NULL
       OR (p_input_tokens = 0 AND p_output_tokens = 0)
       OR abs(p_input_tokens) > max_adjustment_tokens
       OR abs(p_output_tokens) > max_adjustment_tokens THEN
        RAISE EXCEPTION 'an adjustment moves 1 to % tokens either way', max_adjustment_tokens
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF NOT EXISTS (SELECT 1 FROM tenants AS t WHERE t.tenant = p_tenant) THEN
        RETURN;
    END IF;
    IF p_input_tokens < 0 OR p_output_tokens < 0 THEN
        SELECT coalesce(sum(l.input_tokens), 0), coalesce(sum(l.output_tokens), 0)
          INTO net_input, net_output
          FROM usage_ledger AS l
         WHERE l.tenant = p_tenant
           AND l.recorded_at >= clock_timestamp() - lookback;
        IF net_input + p_input_tokens < 0 OR net_output + p_output_tokens < 0 THEN
            RAISE EXCEPTION 'an adjustment cannot take back more than % recorded in the last % (input %, output %)',
                p_tenant, lookback, net_input, net_output
                USING ERRCODE = 'invalid_parameter_value';
        END IF;
    END IF;
    RETURN QUERY
    INSERT INTO usage_ledger AS l (entry_kind, tenant, route, model, input_tokens,
                                   output_tokens, reserved_tokens, outcome, reason)
    VALUES ('adjustment', p_tenant, p_route, p_model, p_input_tokens, p_output_tokens, 0,
            'adjustment', p_reason)
    RETURNING l.entry_id, l.recorded_at, l.tenant, l.route, l.model, l.input_tokens,
              l.output_tokens, l.reason;
END
$$;


-- Set a new version of a model's prices per million tokens from
-- p_effective_from on (NULL: now, by the database clock). Prices are
-- append-only (migration 0017's trigger): a change, even for the same
-- effective_from, is a new version, and the old one stays for the record.
--
-- A version that takes effect before now reprices usage already recorded,
-- which credits were charged for at the old price: refused unless the
-- caller says why (p_backdate_reason, kept in the row with who set it), and
-- refused in any case before the start of the current UTC month: the
-- invoices of a closed month do not change. lq_audit_credit_charges
-- (quotas.sql) then shows the reservations whose credit charge differs from
-- what the invoice now says.
--
-- superseded: true when an earlier version with the same effective_from
-- existed (this one replaces it from now on).
CREATE OR REPLACE FUNCTION lq_set_price(
    p_model           text,
    p_effective_from  timestamptz,
    p_input           numeric,
    p_output          numeric,
    p_set_by          text,
    p_backdate_reason text
) RETURNS TABLE (model text, effective_from timestamptz, input_usd_per_million numeric,
                 output_usd_per_million numeric, set_at timestamptz, set_by text,
                 backdate_reason text, superseded boolean)
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, public
AS $$
DECLARE
    now_ts      timestamptz := clock_timestamp();
    eff         timestamptz := coalesce(p_effective_from, now_ts);
    month_start timestamptz := date_trunc('month', now_ts AT TIME ZONE 'UTC') AT TIME ZONE 'UTC';
    -- Prices are set for the coming months, not decades: a later date is a
    -- typo, and so is one before there were LLM prices (asyncpg sends
    -- 0001-01-01 as -infinity, which priced all of history).
    max_ahead   constant interval := interval '10 years';
    min_from    constant timestamptz := '2000-01-01 00:00:00+00';
    earlier     boolean;
BEGIN
    IF p_set_by IS NULL OR length(btrim(p_set_by)) = 0 THEN
        RAISE EXCEPTION 'a price version needs who set it' USING ERRCODE = 'invalid_parameter_value';
    END IF;
    -- The builtin table's name (lq_import_builtin_prices): an operator's
    -- version under it would lose to the table instead of winning over it.
    IF btrim(p_set_by) = 'llmquota builtin' THEN
        RAISE EXCEPTION 'set-by ''llmquota builtin'' is the shipped price table''s; name yourself'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF NOT isfinite(eff) OR eff < min_from OR eff > now_ts + max_ahead THEN
        RAISE EXCEPTION 'effective-from % is not between % and the next %', eff, min_from, max_ahead
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF eff < now_ts THEN
        IF eff < month_start THEN
            RAISE EXCEPTION 'effective-from % is in a closed month (before %): its invoices do not change',
                eff, month_start
                USING ERRCODE = 'invalid_parameter_value';
        END IF;
        IF p_backdate_reason IS NULL OR length(btrim(p_backdate_reason)) = 0 THEN
            RAISE EXCEPTION 'effective-from % is in the past: it reprices recorded usage', eff
                USING ERRCODE = 'invalid_parameter_value',
                      HINT = 'Say why with --backdate REASON, or set it from now on.';
        END IF;
    ELSIF p_backdate_reason IS NOT NULL THEN
        RAISE EXCEPTION 'effective-from % is not in the past: nothing to backdate', eff
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    SELECT EXISTS (SELECT 1 FROM model_prices AS mp
                    WHERE mp.model = p_model AND mp.effective_from = eff)
      INTO earlier;
    RETURN QUERY
    INSERT INTO model_prices AS mp (model, effective_from, input_usd_per_million,
                                    output_usd_per_million, set_at, set_by, backdate_reason)
    VALUES (p_model, eff, p_input, p_output, now_ts, p_set_by, p_backdate_reason)
    RETURNING mp.model, mp.effective_from, mp.input_usd_per_million, mp.output_usd_per_million,
              mp.set_at, mp.set_by, mp.backdate_reason, earlier;
END
$$;


-- Import the price table shipped with llmquota (src/llmquota/finance/
-- builtin_prices.csv, `llmquota prices import --builtin`), in one statement.
-- Row k: model p_models[k] costs p_input[k] / p_output[k] USD per million
-- tokens from p_from[k] on. Every version written is set_by 'llmquota builtin'.
--
-- outcome of each row:
--   added      a new version was written;
--   unchanged  the version in force for the model from that moment already has
--              these prices (a second import writes nothing);
--   operator   an operator priced this model, by its name or by a glob that
--              matches it (any version not set_by 'llmquota builtin'): the
--              operator's prices win, whatever their dates, and no builtin
--              version is ever added for it;
--   superseded a later row of the table took effect before this month, so this
--              one would be in force nowhere.
--
-- In force from their dates, except never in a closed month (lq_set_price's
-- rule: a closed month's invoices do not change): a row dated before this
-- month takes effect at the start of this month, saying so in backdate_reason.
-- One import at a time (a transaction advisory lock), so two at once do not
-- both add a version.
CREATE OR REPLACE FUNCTION lq_import_builtin_prices(
    p_models text[],
    p_from   timestamptz[],
    p_input  numeric[],
    p_output numeric[]
) RETURNS TABLE (model text, declared_from timestamptz, effective_from timestamptz,
                 outcome text)
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, public
AS $$
DECLARE
    builtin     constant text := 'llmquota builtin';
    now_ts      timestamptz := clock_timestamp();
    month_start timestamptz := date_trunc('month', now_ts AT TIME ZONE 'UTC') AT TIME ZONE 'UTC';
    rec         record;
    eff         timestamptz;
    cur_in      numeric;
    cur_out     numeric;
BEGIN
    IF cardinality(p_models) IS DISTINCT FROM cardinality(p_from)
       OR cardinality(p_models) IS DISTINCT FROM cardinality(p_input)
       OR cardinality(p_models) IS DISTINCT FROM cardinality(p_output) THEN
        RAISE EXCEPTION 'the price arrays differ in length' USING ERRCODE = 'invalid_parameter_value';
    END IF;
    PERFORM pg_advisory_xact_lock(hashtextextended('llmquota.builtin_prices', 0));
    FOR rec IN
        SELECT r.m, r.f, r.i, r.o,
               r.f < max(r.f) FILTER (WHERE r.f <= month_start) OVER (PARTITION BY r.m) AS old
          FROM unnest(p_models, p_from, p_input, p_output) AS r(m, f, i, o)
         ORDER BY r.m, r.f
    LOOP
        eff := greatest(rec.f, month_start);
        model := rec.m; declared_from := rec.f; effective_from := eff;
        IF EXISTS (SELECT 1 FROM model_prices AS mp
                    WHERE mp.set_by <> builtin
                      AND (mp.model = rec.m
                           OR (strpos(mp.model, '*') > 0
                               AND rec.m LIKE (lq_model_patterns(ARRAY[mp.model]))[1]))) THEN
            outcome := 'operator';
        ELSIF rec.old THEN
            outcome := 'superseded';
        ELSE
            -- The version of this exact name in force from eff (only builtin
            -- ones exist for it, or the branch above was taken).
            SELECT mp.input_usd_per_million, mp.output_usd_per_million INTO cur_in, cur_out
              FROM model_prices AS mp
             WHERE mp.model = rec.m AND mp.effective_from <= eff
             ORDER BY mp.effective_from DESC, mp.set_at DESC
             LIMIT 1;
            IF FOUND AND cur_in = rec.i AND cur_out = rec.o THEN
                outcome := 'unchanged';
            ELSE
                INSERT INTO model_prices AS mp (model, effective_from, input_usd_per_million,
                                                output_usd_per_million, set_at, set_by,
                                                backdate_reason)
                VALUES (rec.m, eff, rec.i, rec.o, clock_timestamp(), builtin,
                        CASE WHEN eff > rec.f THEN
                            format('builtin price table: in force from %s; here from the start '
                                   'of this month, as a closed month is never repriced',
                                   to_char(rec.f AT TIME ZONE 'UTC', 'YYYY-MM-DD'))
                             WHEN eff < clock_timestamp() THEN
                            format('builtin price table: in force from %s',
                                   to_char(rec.f AT TIME ZONE 'UTC', 'YYYY-MM-DD'))
                        END);
                outcome := 'added';
            END IF;
        END IF;
        RETURN NEXT;
    END LOOP;
END
$$;
