"""Durable usage ledger: monthly partitions, receipts, prices, export, roles, reporting.

The 0001 ledger table is replaced by one partitioned by month; its rows are
carried over with their ids, and the id sequence continues where it was.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-30
"""

from llmquota.store.migration_support import execute_script
from llmquota.store.sqlfiles import report_scripts, script

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

# Partitions created ahead of the current month (the sweeper keeps this up).
MONTHS_AHEAD = 3

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
-- reason. Append-only (see sql/ledger.sql), partitioned by UTC month.
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

CREATE TABLE usage_ledger_0002 (
    entry_id         bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    reservation_id   uuid,
    entry_kind       text NOT NULL CHECK (entry_kind IN ('usage', 'late', 'adjustment')),
    tenant           text NOT NULL,
    route            text,
    model            text,
    input_tokens     bigint NOT NULL,
    output_tokens    bigint NOT NULL,
    reserved_tokens  bigint NOT NULL,
    outcome          text NOT NULL CHECK (outcome IN ('ok', 'error', 'cancelled',
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
DROP FUNCTION lq_export_ledger, lq_detach_ledger_partition, lq_ensure_ledger_partitions,
              lq_create_ledger_partition,
              lq_ledger_receipt, lq_ledger_refuse_change;

ALTER TABLE usage_ledger_0002 RENAME TO usage_ledger;
ALTER TABLE usage_ledger RENAME CONSTRAINT usage_ledger_0002_pkey TO usage_ledger_pkey;
ALTER TABLE usage_ledger
    RENAME CONSTRAINT usage_ledger_0002_reservation_id_entry_kind_key
    TO usage_ledger_reservation_id_entry_kind_key;
ALTER SEQUENCE usage_ledger_0002_entry_id_seq RENAME TO usage_ledger_entry_id_seq;
CREATE INDEX usage_ledger_tenant_time ON usage_ledger (tenant, recorded_at);

-- Privileges as 0001 left them. The roles themselves stay: they belong to the
-- server, and other databases may use them.
GRANT EXECUTE ON ALL FUNCTIONS IN SCHEMA public TO PUBLIC;
REVOKE ALL ON ALL TABLES IN SCHEMA public FROM llmquota_app, llmquota_reporting;
REVOKE ALL ON ALL SEQUENCES IN SCHEMA public FROM llmquota_app, llmquota_reporting;
REVOKE ALL ON ALL FUNCTIONS IN SCHEMA public FROM llmquota_app, llmquota_reporting;
REVOKE ALL ON SCHEMA public FROM llmquota_app;
"""


def upgrade() -> None:
    execute_script(script("ledger.sql"))
    execute_script(SCHEMA)
    execute_script(CARRY_OVER.format(months_ahead=MONTHS_AHEAD))
    # lq_finish's ledger insert is unchanged in shape; its comments now point
    # at the receipts. Re-applied so the database matches the file.
    execute_script(script("admission.sql"))
    for report in report_scripts():
        execute_script(report)
    execute_script(script("roles.sql"))


def downgrade() -> None:
    execute_script(DOWNGRADE)
