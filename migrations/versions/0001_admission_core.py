"""Admission core: tenants, limit layers, reservations, usage ledger, API keys.

Tables only: the admission functions (sql/admission.sql) are repeatable, applied
after the versioned migrations (see migrations/README.md).

Revision ID: 0001
Revises:
Create Date: 2026-11-30
"""

from alembic import op

from llmquota.store.migration_support import execute_script

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

SCHEMA = r"""
CREATE TABLE tenants (
    tenant      text PRIMARY KEY CHECK (tenant ~ '^[A-Za-z0-9._:-]{1,128}$'),
    created_at  timestamptz NOT NULL DEFAULT now()
);

-- Every policy change takes the next number, so a ledger row can say which
-- rules were in force when its reservation was admitted.
CREATE SEQUENCE policy_version_seq;

-- One row per limit layer (the global one, one per tenant, one per route that
-- has a policy). Policy and bucket state share the row so that one locked row
-- read gives an admission everything it needs.
CREATE TABLE limit_layers (
    layer_id             bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    scope                text NOT NULL CHECK (scope IN ('global', 'tenant', 'route')),
    tenant               text REFERENCES tenants ON DELETE CASCADE,
    route                text CHECK (route ~ '^[A-Za-z0-9._:-]{1,128}$'),
    -- policy: NULL means no limit of that kind at this layer
    tokens_per_minute    bigint CHECK (tokens_per_minute > 0),
    token_burst          bigint CHECK (token_burst > 0),
    requests_per_minute  bigint CHECK (requests_per_minute > 0),
    request_burst        bigint CHECK (request_burst > 0),
    max_in_flight        integer CHECK (max_in_flight > 0),
    lease_seconds        integer NOT NULL DEFAULT 120 CHECK (lease_seconds BETWEEN 1 AND 86400),
    policy_version       bigint NOT NULL DEFAULT nextval('policy_version_seq'),
    -- state: balances are fractional because refill is continuous
    tokens               double precision,
    requests             double precision,
    in_flight            integer NOT NULL DEFAULT 0 CHECK (in_flight >= 0),
    refilled_at          timestamptz NOT NULL DEFAULT now(),
    CHECK ((scope = 'global') = (tenant IS NULL)),
    CHECK ((scope = 'route') = (route IS NOT NULL)),
    CHECK ((tokens_per_minute IS NULL) = (token_burst IS NULL)),
    CHECK ((requests_per_minute IS NULL) = (request_burst IS NULL)),
    CHECK ((tokens_per_minute IS NULL) = (tokens IS NULL)),
    CHECK ((requests_per_minute IS NULL) = (requests IS NULL)),
    CHECK (tokens IS NULL OR tokens <= token_burst),
    CHECK (requests IS NULL OR requests <= request_burst),
    UNIQUE NULLS NOT DISTINCT (scope, tenant, route)
);

-- A reservation is a pending transfer with a timeout: admitted, then settled,
-- released or expired exactly once.
CREATE TABLE reservations (
    reservation_id      uuid PRIMARY KEY,
    tenant              text NOT NULL,
    route               text,
    model               text NOT NULL,
    layer_ids           bigint[] NOT NULL,
    input_tokens        bigint NOT NULL CHECK (input_tokens >= 0),
    input_estimated     boolean NOT NULL,
    max_tokens          bigint NOT NULL CHECK (max_tokens >= 0),
    reserved_tokens     bigint NOT NULL CHECK (reserved_tokens >= 0),
    policy_version      bigint NOT NULL,
    state               text NOT NULL DEFAULT 'active'
                        CHECK (state IN ('active', 'settled', 'released', 'expired')),
    lease_generation    integer NOT NULL DEFAULT 1,
    lease_seconds       integer NOT NULL CHECK (lease_seconds BETWEEN 1 AND 86400),
    created_at          timestamptz NOT NULL,
    lease_expires_at    timestamptz NOT NULL,
    finished_at         timestamptz,
    idempotency_key     text,
    request_hash        text,
    -- what settlement reported and what it did; NULL until settled
    settled_input_tokens   bigint,
    settled_output_tokens  bigint,
    outcome             text CHECK (outcome IN ('ok', 'error', 'cancelled')),
    charged_tokens      bigint,
    refunded_tokens     bigint,
    late                boolean NOT NULL DEFAULT false,
    CHECK ((state = 'active') = (finished_at IS NULL))
);
CREATE UNIQUE INDEX reservations_idempotency
    ON reservations (tenant, idempotency_key) WHERE idempotency_key IS NOT NULL;
-- The sweeper's scan: only live leases, oldest deadline first.
CREATE INDEX reservations_active_lease
    ON reservations (lease_expires_at) WHERE state = 'active';
-- Retention cleanup of finished reservations.
CREATE INDEX reservations_finished ON reservations (finished_at) WHERE state <> 'active';

-- What was really used, one row per resolved reservation ('usage'), plus a
-- 'late' row when usage arrives after the lease expired.
CREATE TABLE usage_ledger (
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
CREATE INDEX usage_ledger_tenant_time ON usage_ledger (tenant, recorded_at);

-- API keys are stored as SHA-256 digests; the key itself is shown once.
-- tenant NULL marks an admin key.
CREATE TABLE api_keys (
    key_id      bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    key_hash    bytea NOT NULL UNIQUE,
    tenant      text REFERENCES tenants ON DELETE CASCADE,
    created_at  timestamptz NOT NULL DEFAULT now()
);
"""


# Down to nothing: every llmquota function goes too, whichever the repeatable
# scripts of the day defined (they all carry the lq_ prefix).
DROP_FUNCTIONS = r"""
DO $$
DECLARE
    f regprocedure;
BEGIN
    FOR f IN SELECT p.oid::regprocedure
               FROM pg_proc AS p
              WHERE p.pronamespace = 'public'::regnamespace
                AND p.proname LIKE 'lq\_%'
    LOOP
        EXECUTE format('DROP FUNCTION %s', f);
    END LOOP;
END
$$;
"""


def upgrade() -> None:
    execute_script(SCHEMA)


def downgrade() -> None:
    execute_script(DROP_FUNCTIONS)
    for table in ("api_keys", "usage_ledger", "reservations", "limit_layers", "tenants"):
        op.execute(f"DROP TABLE IF EXISTS {table} CASCADE")
    op.execute("DROP SEQUENCE IF EXISTS policy_version_seq")
