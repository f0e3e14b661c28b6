"""Calendar quotas, prepaid credits, webhooks and the alert outbox.

- `quotas`: a tenant's (or one route's) budget per calendar day or month in
  an IANA time zone, in tokens and/or cost, over some models (names and `*`
  globs, kept as given and as LIKE patterns), with alert fractions.
- `quota_windows`: one row per quota and calendar window, the row admission
  and settlement update (reserved and charged, tokens and cost). It keeps the
  quota's tenant and name, so a deleted quota's past windows stay reportable.
- `credit_accounts` and `credit_ledger`: a prepaid balance and the append-only
  ledger it is derived from (top-ups, charges, adjustments); `llmquota audit`
  recomputes the balance from the ledger.
- `webhooks`, `alert_outbox`, `alert_deliveries`, `alert_delivery_attempts`:
  an alert is one outbox row per (type, subject, threshold, window), so it
  fires at most once per window; each matching webhook gets a delivery row
  that the delivery loop claims, and every attempt is recorded.

Frozen (migrations/README.md): the trigger function the credit ledger's
append-only triggers run is a copy as of this revision; sql/quotas.sql owns
today's body.

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-01
"""

from llmquota.store.migration_support import execute_script

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None

FUNCTIONS = r"""
-- Refuse UPDATE, DELETE and TRUNCATE on the credit ledger: corrections are new rows.
CREATE OR REPLACE FUNCTION lq_credit_ledger_refuse_change()
RETURNS trigger
LANGUAGE plpgsql
AS $$
BEGIN
    RAISE EXCEPTION 'credit_ledger is append-only: % on % is refused', TG_OP, TG_TABLE_NAME
        USING ERRCODE = 'insufficient_privilege',
              HINT = 'Record a correction as a new adjustment row.';
END
$$;
"""

SCHEMA = r"""
CREATE TABLE quotas (
    quota_id        bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    tenant          text NOT NULL REFERENCES tenants ON DELETE CASCADE,
    -- NULL: the tenant's quota, over all its routes.
    route           text CHECK (route ~ '^[A-Za-z0-9._:-]{1,128}$'),
    name            text NOT NULL CHECK (name ~ '^[A-Za-z0-9._:-]{1,128}$'),
    period          text NOT NULL CHECK (period IN ('day', 'month')),
    -- An IANA name; the service checks it against its zone database.
    timezone        text NOT NULL DEFAULT 'UTC' CHECK (timezone ~ '^[A-Za-z0-9_+/-]{1,64}$'),
    tokens          bigint CHECK (tokens > 0),
    cost            numeric CHECK (cost > 0),
    -- As given (names and globs); empty: every model.
    models          text[] NOT NULL DEFAULT '{}',
    -- The same as LIKE patterns (`*` -> `%`, LIKE's own characters escaped).
    model_patterns  text[] NOT NULL DEFAULT '{}',
    alerts          numeric[] NOT NULL DEFAULT '{0.5,0.8,0.95,1.0}',
    enforce         text NOT NULL DEFAULT 'block' CHECK (enforce IN ('block', 'alert_only')),
    created_at      timestamptz NOT NULL DEFAULT clock_timestamp(),
    updated_at      timestamptz NOT NULL DEFAULT clock_timestamp(),
    CONSTRAINT quotas_some_limit CHECK (tokens IS NOT NULL OR cost IS NOT NULL),
    CONSTRAINT quotas_patterns CHECK (cardinality(models) = cardinality(model_patterns)),
    CONSTRAINT quotas_alerts CHECK (cardinality(alerts) <= 20)
);
-- One quota of a name per tenant, and per route ('' is the tenant's own:
-- no route name is empty). Admission finds a request's quotas by this index.
CREATE UNIQUE INDEX quotas_scope_name ON quotas (tenant, (coalesce(route, '')), name);

CREATE TABLE quota_windows (
    window_id        bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    -- NULL once the quota is deleted: its windows stay for the reports.
    quota_id         bigint REFERENCES quotas ON DELETE SET NULL,
    tenant           text NOT NULL,
    route            text,
    quota_name       text NOT NULL,
    window_start     timestamptz NOT NULL,
    window_end       timestamptz NOT NULL,
    reserved_tokens  bigint NOT NULL DEFAULT 0 CHECK (reserved_tokens >= 0),
    charged_tokens   bigint NOT NULL DEFAULT 0 CHECK (charged_tokens >= 0),
    reserved_cost    numeric NOT NULL DEFAULT 0 CHECK (reserved_cost >= 0),
    charged_cost     numeric NOT NULL DEFAULT 0 CHECK (charged_cost >= 0),
    updated_at       timestamptz NOT NULL DEFAULT clock_timestamp(),
    CONSTRAINT quota_windows_order CHECK (window_end > window_start),
    CONSTRAINT quota_windows_once UNIQUE (quota_id, window_start)
);
CREATE INDEX quota_windows_tenant_start ON quota_windows (tenant, window_start);

CREATE TABLE credit_accounts (
    tenant          text PRIMARY KEY REFERENCES tenants ON DELETE CASCADE,
    -- The sum of the tenant's credit_ledger amounts (lq_audit checks it).
    balance         numeric NOT NULL DEFAULT 0,
    -- Held by open reservations; available = balance - reserved.
    reserved        numeric NOT NULL DEFAULT 0 CHECK (reserved >= 0),
    alerts          numeric[] NOT NULL DEFAULT '{0.5,0.8,0.95,1.0}',
    -- The credit alerts' window: from the last top-up, of the balance it left.
    funded_at       timestamptz,
    funded_balance  numeric NOT NULL DEFAULT 0,
    updated_at      timestamptz NOT NULL DEFAULT clock_timestamp()
);

CREATE TABLE credit_ledger (
    entry_id        bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    recorded_at     timestamptz NOT NULL DEFAULT clock_timestamp(),
    tenant          text NOT NULL,
    entry_kind      text NOT NULL CHECK (entry_kind IN ('topup', 'charge', 'adjustment')),
    -- Signed: a top-up adds, a charge takes, an adjustment either way.
    amount          numeric NOT NULL,
    balance_after   numeric NOT NULL,
    reference       text CHECK (length(reference) BETWEEN 1 AND 255),
    reservation_id  uuid,
    reason          text CHECK (length(reason) BETWEEN 1 AND 1000),
    CONSTRAINT credit_ledger_topup CHECK (
        entry_kind <> 'topup' OR (amount > 0 AND reference IS NOT NULL)),
    CONSTRAINT credit_ledger_charge CHECK (
        (entry_kind = 'charge') = (reservation_id IS NOT NULL) AND
        (entry_kind <> 'charge' OR amount <= 0)),
    CONSTRAINT credit_ledger_adjustment CHECK ((entry_kind = 'adjustment') = (reason IS NOT NULL)),
    -- A reference adds once; a reservation is charged once.
    CONSTRAINT credit_ledger_reference_once UNIQUE (tenant, reference),
    CONSTRAINT credit_ledger_charge_once UNIQUE (reservation_id)
);
CREATE INDEX credit_ledger_tenant_time ON credit_ledger (tenant, recorded_at);
CREATE TRIGGER credit_ledger_append_only
    BEFORE UPDATE OR DELETE ON credit_ledger
    FOR EACH ROW EXECUTE FUNCTION lq_credit_ledger_refuse_change();
CREATE TRIGGER credit_ledger_no_truncate
    BEFORE TRUNCATE ON credit_ledger
    FOR EACH STATEMENT EXECUTE FUNCTION lq_credit_ledger_refuse_change();

CREATE TABLE webhooks (
    name        text PRIMARY KEY CHECK (name ~ '^[A-Za-z0-9._:-]{1,128}$'),
    url         text NOT NULL CHECK (url ~ '^https?://' AND length(url) <= 2048),
    -- The HMAC key of the signature header; never shown again.
    secret      text NOT NULL CHECK (octet_length(secret) BETWEEN 16 AND 1024),
    -- NULL: every tenant's alerts.
    tenant      text REFERENCES tenants ON DELETE CASCADE,
    created_at  timestamptz NOT NULL DEFAULT clock_timestamp(),
    updated_at  timestamptz NOT NULL DEFAULT clock_timestamp()
);

CREATE TABLE alert_outbox (
    event_id                 uuid PRIMARY KEY DEFAULT gen_random_uuid(),
    event_type               text NOT NULL CHECK (
        event_type IN ('quota.threshold', 'credits.threshold', 'ceiling.utilization')),
    -- NULL for what no tenant owns (a provider ceiling).
    tenant                   text,
    -- What crossed: a quota and its unit, a credit account, a ceiling.
    subject                  text NOT NULL CHECK (length(subject) BETWEEN 1 AND 512),
    threshold                numeric NOT NULL CHECK (threshold > 0 AND threshold <= 1),
    window_start             timestamptz NOT NULL,
    window_end               timestamptz,
    usage                    numeric NOT NULL,
    limit_value              numeric NOT NULL CHECK (limit_value > 0),
    projected_exhaustion_at  timestamptz,
    payload                  jsonb NOT NULL DEFAULT '{}',
    created_at               timestamptz NOT NULL DEFAULT clock_timestamp(),
    -- The promise: one alert per threshold per window, whatever the concurrency.
    CONSTRAINT alert_outbox_once UNIQUE (event_type, subject, threshold, window_start)
);
CREATE INDEX alert_outbox_tenant_time ON alert_outbox (tenant, created_at);

CREATE TABLE alert_deliveries (
    event_id         uuid NOT NULL REFERENCES alert_outbox ON DELETE CASCADE,
    webhook          text NOT NULL REFERENCES webhooks ON DELETE CASCADE,
    attempts         integer NOT NULL DEFAULT 0 CHECK (attempts >= 0),
    -- Due from then; a claim moves it past the claim's lease.
    next_attempt_at  timestamptz NOT NULL DEFAULT clock_timestamp(),
    delivered_at     timestamptz,
    gave_up_at       timestamptz,
    last_attempt_at  timestamptz,
    last_status      integer,
    last_error       text,
    created_at       timestamptz NOT NULL DEFAULT clock_timestamp(),
    PRIMARY KEY (event_id, webhook)
);
-- The delivery loop's claim reads only what is still due.
CREATE INDEX alert_deliveries_due ON alert_deliveries (next_attempt_at)
    WHERE delivered_at IS NULL AND gave_up_at IS NULL;

CREATE TABLE alert_delivery_attempts (
    event_id      uuid NOT NULL,
    webhook       text NOT NULL,
    attempt       integer NOT NULL CHECK (attempt >= 1),
    attempted_at  timestamptz NOT NULL DEFAULT clock_timestamp(),
    status        integer,
    error         text,
    duration_ms   integer,
    PRIMARY KEY (event_id, webhook, attempt),
    FOREIGN KEY (event_id, webhook) REFERENCES alert_deliveries ON DELETE CASCADE
);
"""


def upgrade() -> None:
    execute_script(FUNCTIONS)
    execute_script(SCHEMA)


def downgrade() -> None:
    execute_script(
        """
        -- The reporting views over these tables (reports/50_quotas.sql owns them).
        DROP VIEW IF EXISTS reporting.quota_windows, reporting.credit_balances,
                            reporting.credit_entries CASCADE;
        DROP FUNCTION IF EXISTS reporting.quota_usage(date, date, text);
        -- The functions that read these tables go with them (migrations/README.md).
        DROP FUNCTION IF EXISTS lq_quota_window, lq_fire_alert, lq_fire_crossed,
                                lq_quota_apply, lq_quota_window_row, lq_quota_settle,
                                lq_matching_quotas, lq_credit_topup, lq_credit_apply,
                                lq_projected_exhaustion;
        DROP TABLE IF EXISTS alert_delivery_attempts, alert_deliveries, alert_outbox, webhooks,
                             credit_ledger, credit_accounts, quota_windows, quotas;
        DROP FUNCTION IF EXISTS lq_credit_ledger_refuse_change;
        DROP FUNCTION IF EXISTS lq_audit();
        DELETE FROM schema_repeatables
         WHERE name IN ('quotas.sql', 'reliability.sql', 'reports/50_quotas.sql');
        """
    )
