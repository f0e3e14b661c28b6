"""Durable usage ledger: monthly partitions, receipts, prices, export.

The 0001 ledger table is replaced by one partitioned by month; its rows are
carried over with their ids, and the id sequence continues where it was.

Frozen (see migrations/README.md): the tables, and a copy of the four
functions this revision needs itself, as they were when it was written: the
two trigger functions its triggers run and the two that create its monthly
partitions. sql/ledger.sql, a repeatable script, replaces them with today's
bodies (and adds the export and archival functions); the reporting schema
(sql/reports/) and the grants (sql/roles.sql) are repeatable too.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-30
"""

from llmquota.store.migration_support import execute_script

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

# Partitions created ahead of the current month (the sweeper keeps this up).
MONTHS_AHEAD = 3

# The functions 0002's own DDL and data step run, frozen as of this revision:
# a verbatim copy of sql/ledger.sql's, long lines and all.
FUNCTIONS = r"""
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
"""  # noqa: E501

SCHEMA = r"""
-- The 0001 table steps aside (its names are wanted by the new one).
ALTER TABLE usage_ledger RENAME TO usage_ledger_0001;
ALTER TABLE usage_ledger_0001 RENAME CONSTRAINT usage_ledger_pkey TO usage_ledger_0001_pkey;
ALTER TABLE usage_ledger_0001
    RENAME CONSTRAINT usage_ledger_reservation_id_entry_kind_key TO usage_ledger_0001_once;
ALTER INDEX usage_ledger_tenant_time RENAME TO usage_ledger_0001_tenant_time;
ALTER SEQUENCE usage_ledger_entry_id_seq RENAME TO usage_ledger_0001_entry_id_seq;

-- What was really used: one 'usage' row per resolved reservation (settled, or
-- expired with zero known usage and the reserved amount), a 'late' row when
-- usage arrives after the lease expired, and signed 'adjustment' rows with a
-- reason. Append-only (the triggers below), partitioned by UTC month.
CREATE TABLE usage_ledger (
    entry_id         bigint GENERATED ALWAYS AS IDENTITY,
    recorded_at      timestamptz NOT NULL DEFAULT clock_timestamp(),
    -- The inserting transaction, for the gap-free export (lq_export_ledger).
    xact_id          xid8 NOT NULL DEFAULT pg_current_xact_id(),
    reservation_id   uuid,
    entry_kind       text NOT NULL,
    tenant           text NOT NULL,
    route            text,
    model            text,
    input_tokens     bigint NOT NULL,
    output_tokens    bigint NOT NULL,
    reserved_tokens  bigint NOT NULL,
    outcome          text NOT NULL,
    policy_version   bigint,
    reason           text,
    PRIMARY KEY (entry_id, recorded_at),
    CONSTRAINT usage_ledger_entry_kind CHECK (entry_kind IN ('usage', 'late', 'adjustment')),
    CONSTRAINT usage_ledger_reserved CHECK (reserved_tokens >= 0),
    CONSTRAINT usage_ledger_outcome CHECK (
        (entry_kind = 'usage' AND outcome IN ('ok', 'error', 'cancelled', 'expired'))
        OR (entry_kind = 'late' AND outcome = 'late')
        OR (entry_kind = 'adjustment' AND outcome = 'adjustment')),
    -- Usage is never negative; only an adjustment may take tokens back.
    CONSTRAINT usage_ledger_signed_only_adjustments CHECK (
        entry_kind = 'adjustment' OR (input_tokens >= 0 AND output_tokens >= 0)),
    CONSTRAINT usage_ledger_reservation CHECK (
        (entry_kind = 'adjustment') = (reservation_id IS NULL)),
    CONSTRAINT usage_ledger_reason CHECK (
        (entry_kind = 'adjustment') = (reason IS NOT NULL) AND length(reason) BETWEEN 1 AND 1000)
) PARTITION BY RANGE (recorded_at);
COMMENT ON TABLE usage_ledger IS
    'append-only usage ledger, partitioned by UTC month; corrections are adjustment rows';

-- The last safety net: a row whose month has no partition still lands.
CREATE TABLE usage_ledger_default PARTITION OF usage_ledger DEFAULT;
CREATE TRIGGER usage_ledger_no_truncate BEFORE TRUNCATE ON usage_ledger_default
    FOR EACH STATEMENT EXECUTE FUNCTION lq_ledger_refuse_change();

CREATE INDEX usage_ledger_tenant_time ON usage_ledger (tenant, recorded_at);
-- The export numbers rows in (xact_id, entry_id) order.
CREATE INDEX usage_ledger_export_order ON usage_ledger (xact_id, entry_id);

-- One receipt per reservation and kind of entry: the unique constraint that
-- makes a second ledger row for the same event impossible (written by the
-- lq_ledger_receipt trigger in the same statement as the ledger row).
CREATE TABLE ledger_receipts (
    reservation_id  uuid NOT NULL,
    entry_kind      text NOT NULL CHECK (entry_kind IN ('usage', 'late')),
    entry_id        bigint NOT NULL,
    recorded_at     timestamptz NOT NULL,
    PRIMARY KEY (reservation_id, entry_kind)
);

CREATE TRIGGER usage_ledger_append_only
    BEFORE UPDATE OR DELETE ON usage_ledger
    FOR EACH ROW EXECUTE FUNCTION lq_ledger_refuse_change();
CREATE TRIGGER usage_ledger_no_truncate
    BEFORE TRUNCATE ON usage_ledger
    FOR EACH STATEMENT EXECUTE FUNCTION lq_ledger_refuse_change();
CREATE TRIGGER usage_ledger_receipt
    AFTER INSERT ON usage_ledger
    FOR EACH ROW EXECUTE FUNCTION lq_ledger_receipt();

-- Prices per million tokens; the row in force for a usage is the latest
-- effective_from at or before its recorded_at.
CREATE TABLE model_prices (
    model                   text NOT NULL CHECK (length(model) BETWEEN 1 AND 200),
    effective_from          timestamptz NOT NULL,
    input_usd_per_million   numeric(14, 6) NOT NULL CHECK (input_usd_per_million >= 0),
    output_usd_per_million  numeric(14, 6) NOT NULL CHECK (output_usd_per_million >= 0),
    set_at                  timestamptz NOT NULL DEFAULT clock_timestamp(),
    PRIMARY KEY (model, effective_from)
);

-- The export's gapless numbering of ledger rows (see lq_export_ledger).
CREATE TABLE ledger_export_positions (
    export_id    bigint PRIMARY KEY,
    entry_id     bigint NOT NULL UNIQUE,
    recorded_at  timestamptz NOT NULL,
    xact_id      xid8 NOT NULL
);
CREATE TABLE ledger_export_state (
    singleton       boolean PRIMARY KEY DEFAULT true CHECK (singleton),
    last_export_id  bigint NOT NULL DEFAULT 0,
    last_xact_id    xid8 NOT NULL DEFAULT '0',
    last_entry_id   bigint NOT NULL DEFAULT 0
);
INSERT INTO ledger_export_state DEFAULT VALUES;
"""

CARRY_OVER = r"""
-- Partitions for every month the old rows cover and for this month (safe
-- here: nobody can write to a table this transaction has not committed),
-- then the months ahead.
SELECT lq_create_ledger_partition(month)
  FROM (SELECT date_trunc('month', recorded_at AT TIME ZONE 'UTC')::date AS month
          FROM usage_ledger_0001
        UNION
        SELECT date_trunc('month', clock_timestamp() AT TIME ZONE 'UTC')::date) AS m;
SELECT * FROM lq_ensure_ledger_partitions({months_ahead});

-- The old rows, ids and all (the receipts trigger writes their receipts).
INSERT INTO usage_ledger (entry_id, recorded_at, reservation_id, entry_kind, tenant, route,
                          model, input_tokens, output_tokens, reserved_tokens, outcome,
                          policy_version, reason)
OVERRIDING SYSTEM VALUE
SELECT entry_id, recorded_at, reservation_id, entry_kind, tenant, route, model,
       input_tokens, output_tokens, reserved_tokens, outcome, policy_version,
       CASE WHEN entry_kind = 'adjustment' THEN 'carried over from the 0001 ledger' END
  FROM usage_ledger_0001
 ORDER BY entry_id;

-- New ids continue the old sequence exactly.
SELECT setval(pg_get_serial_sequence('usage_ledger', 'entry_id'), s.last_value, s.is_called)
  FROM usage_ledger_0001_entry_id_seq AS s;

DROP TABLE usage_ledger_0001;
"""

DOWNGRADE = r"""
DROP SCHEMA IF EXISTS reporting CASCADE;

-- The CHECK constraints are named as 0001 named them (index-backed ones
-- must differ from the partitioned table's until it is dropped: renamed below).
CREATE TABLE usage_ledger_0002 (
    entry_id         bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    reservation_id   uuid,
    entry_kind       text NOT NULL CONSTRAINT usage_ledger_entry_kind_check
                         CHECK (entry_kind IN ('usage', 'late', 'adjustment')),
    tenant           text NOT NULL,
    route            text,
    model            text,
    input_tokens     bigint NOT NULL,
    output_tokens    bigint NOT NULL,
    reserved_tokens  bigint NOT NULL,
    outcome          text NOT NULL CONSTRAINT usage_ledger_outcome_check
                         CHECK (outcome IN ('ok', 'error', 'cancelled',
                                            'expired', 'late', 'adjustment')),
    policy_version   bigint,
    recorded_at      timestamptz NOT NULL DEFAULT clock_timestamp(),
    UNIQUE (reservation_id, entry_kind)
);
INSERT INTO usage_ledger_0002 (entry_id, reservation_id, entry_kind, tenant, route, model,
                               input_tokens, output_tokens, reserved_tokens, outcome,
                               policy_version, recorded_at)
OVERRIDING SYSTEM VALUE
SELECT entry_id, reservation_id, entry_kind, tenant, route, model, input_tokens,
       output_tokens, reserved_tokens, outcome, policy_version, recorded_at
  FROM usage_ledger
 ORDER BY entry_id;
SELECT setval(pg_get_serial_sequence('usage_ledger_0002', 'entry_id'), last_value)
  FROM pg_sequences
 WHERE schemaname = 'public'
   AND sequencename = 'usage_ledger_entry_id_seq'
   AND last_value IS NOT NULL;

-- DROP TABLE is not an UPDATE or DELETE: the append-only triggers let it pass.
DROP TABLE usage_ledger;
DROP TABLE ledger_receipts, ledger_export_positions, ledger_export_state, model_prices;
-- This revision's functions, and the ledger functions the repeatable
-- ledger.sql added (there are none if it never ran).
DROP FUNCTION IF EXISTS lq_export_ledger, lq_detach_ledger_partition,
                        lq_ensure_ledger_partitions, lq_create_ledger_partition,
                        lq_ledger_receipt, lq_ledger_refuse_change;

ALTER TABLE usage_ledger_0002 RENAME TO usage_ledger;
ALTER TABLE usage_ledger RENAME CONSTRAINT usage_ledger_0002_pkey TO usage_ledger_pkey;
ALTER TABLE usage_ledger
    RENAME CONSTRAINT usage_ledger_0002_reservation_id_entry_kind_key
    TO usage_ledger_reservation_id_entry_kind_key;
ALTER SEQUENCE usage_ledger_0002_entry_id_seq RENAME TO usage_ledger_entry_id_seq;
CREATE INDEX usage_ledger_tenant_time ON usage_ledger (tenant, recorded_at);

-- Privileges as 0001 left them (the grants of the repeatable roles.sql,
-- where it ran). The roles themselves stay: they belong to the server, and
-- other databases may use them; where they do not exist, there is nothing to
-- revoke.
GRANT EXECUTE ON ALL FUNCTIONS IN SCHEMA public TO PUBLIC;
DO $$
DECLARE
    granted text;
BEGIN
    FOR granted IN SELECT rolname FROM pg_roles
                    WHERE rolname IN ('llmquota_app', 'llmquota_reporting') LOOP
        EXECUTE format('REVOKE ALL ON ALL TABLES IN SCHEMA public FROM %I', granted);
        EXECUTE format('REVOKE ALL ON ALL SEQUENCES IN SCHEMA public FROM %I', granted);
        EXECUTE format('REVOKE ALL ON ALL FUNCTIONS IN SCHEMA public FROM %I', granted);
        EXECUTE format('REVOKE ALL ON SCHEMA public FROM %I', granted);
    END LOOP;
END
$$;
"""


def upgrade() -> None:
    execute_script(FUNCTIONS)
    execute_script(SCHEMA)
    execute_script(CARRY_OVER.format(months_ahead=MONTHS_AHEAD))


def downgrade() -> None:
    execute_script(DOWNGRADE)
