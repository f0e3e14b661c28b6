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
BEGIN
    IF EXISTS (SELECT 1
                 FROM pg_inherits AS i
                 JOIN pg_class AS c ON c.oid = i.inhrelid
                WHERE i.inhparent = 'public.usage_ledger'::regclass
                  AND c.relname = part) THEN
        RETURN 'exists';
    END IF;
    IF to_regclass('public.' || quote_ident(part)) IS NOT NULL THEN
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
        EXECUTE format('CREATE TABLE public.%I (LIKE public.usage_ledger INCLUDING DEFAULTS INCLUDING CONSTRAINTS)', part);
        EXECUTE format('ALTER TABLE public.%I ADD CONSTRAINT %I CHECK (recorded_at >= %L AND recorded_at < %L)',
                       part, part || '_bounds', month_start, month_end);
        -- Row triggers are cloned from usage_ledger on ATTACH; a TRUNCATE
        -- trigger is not, so each partition gets its own.
        EXECUTE format('CREATE TRIGGER usage_ledger_no_truncate BEFORE TRUNCATE ON public.%I '
                       'FOR EACH STATEMENT EXECUTE FUNCTION lq_ledger_refuse_change()', part);
        EXECUTE format('ALTER TABLE public.usage_ledger ATTACH PARTITION public.%I FOR VALUES FROM (%L) TO (%L)',
                       part, month_start, month_end);
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
-- Sweepers on several hosts may run this at once: one takes the advisory
-- lock and does the work, the others skip it (nothing is left undone: the
-- one holding the lock creates every missing month).
--
-- status per month: exists | created | default_holds_rows | busy | too_close
CREATE OR REPLACE FUNCTION lq_ensure_ledger_partitions(
    p_months_ahead integer,
    p_at           timestamptz DEFAULT NULL
) RETURNS TABLE (partition_name text, status text)
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, public
AS $$
DECLARE
    this_month  date := date_trunc('month', coalesce(p_at, clock_timestamp()) AT TIME ZONE 'UTC')::date;
    month       date;
    -- A named limit: partitions further ahead than this are a typo.
    max_months_ahead constant integer := 120;
    -- A month starting sooner than this may see rows while we attach it.
    attach_margin constant interval := interval '1 hour';
BEGIN
    IF p_months_ahead IS NULL OR p_months_ahead NOT BETWEEN 1 AND max_months_ahead THEN
        RAISE EXCEPTION 'months ahead must be between 1 and %, not %', max_months_ahead, p_months_ahead
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF NOT pg_try_advisory_xact_lock(hashtextextended('llmquota.usage_ledger.partitions', 0)) THEN
        RETURN;
    END IF;
    FOR i IN 1 .. p_months_ahead LOOP
        month := (this_month + make_interval(months => i))::date;
        partition_name := 'usage_ledger_' || to_char(month, 'YYYY_MM');
        IF month::timestamp AT TIME ZONE 'UTC' < clock_timestamp() + attach_margin
           AND to_regclass('public.' || quote_ident(partition_name)) IS NULL THEN
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
BEGIN
    IF month_end > clock_timestamp() THEN
        RAISE EXCEPTION '% is not in the past: only finished months can be archived', part
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF NOT EXISTS (SELECT 1
                     FROM pg_inherits AS i
                     JOIN pg_class AS c ON c.oid = i.inhrelid
                    WHERE i.inhparent = 'public.usage_ledger'::regclass
                      AND c.relname = part) THEN
        RAISE EXCEPTION 'no attached partition %', part USING ERRCODE = 'undefined_table';
    END IF;
    IF p_require_exported THEN
        EXECUTE format('SELECT count(*) FROM public.%I AS l
                         WHERE NOT EXISTS (SELECT 1 FROM ledger_export_positions AS p
                                            WHERE p.entry_id = l.entry_id)', part)
           INTO unexported;
        IF unexported > 0 THEN
            RAISE EXCEPTION '% has % rows the billing export has not numbered yet', part, unexported
                USING ERRCODE = 'object_not_in_prerequisite_state',
                      HINT = 'Run llmquota ledger export until it catches up, then retry.';
        END IF;
    END IF;
    EXECUTE format('ALTER TABLE public.usage_ledger DETACH PARTITION public.%I', part);
    RETURN part;
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
    reason           text
)
LANGUAGE plpgsql
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
    -- least everything that had finished by now.
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
           l.policy_version, l.reason
      FROM ledger_export_positions AS p
      JOIN usage_ledger AS l
        ON l.entry_id = p.entry_id AND l.recorded_at = p.recorded_at
     WHERE p.export_id > p_after_export_id
     ORDER BY p.export_id
     LIMIT p_limit;
END
$$;
