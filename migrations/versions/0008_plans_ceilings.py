"""Plans (tiers with a priority) and provider ceilings with a shedding ladder.

- `plans`: named sets of limits with a priority (low, normal, high, critical)
  and a default fallback-model list. A tenant naming a plan takes every field
  its own policy does not set from it.
- `limit_layers` gains:
  - `plan` (tenant layers): the plan the tenant is on; RESTRICT, so a plan in
    use cannot be deleted (409);
  - `own_policy` (tenant layers): the fields the tenant's policy set itself,
    so a plan change can recompute the effective limits;
  - `priority` (tenant layers): the effective priority rank, 0 low .. 3
    critical, from the plan (1, normal, without one);
  - `fallback_models` (tenant and route layers): the default degradation list;
  - `ceiling`, `models`, `model_patterns`, `shed_above`, `shed_admit`,
    `shed_small` (ceiling layers): a provider ceiling is one more layer of the
    same table, so settlement, release, expiry, the sweeper and the audit
    treat it like any other. `model_patterns` are the `models` as LIKE
    patterns; a step s of the ladder is (`shed_above[s]`, `shed_admit[s]`: a
    bit mask of admitted priority ranks, `shed_small[s]`: the small-request
    exemption or NULL).
- The layer key becomes (scope, tenant, route, ceiling), NULLS NOT DISTINCT.

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-01
"""

from llmquota.store.migration_support import execute_script

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None

SCHEMA = r"""
CREATE TABLE plans (
    plan                 text PRIMARY KEY CHECK (plan ~ '^[A-Za-z0-9._:-]{1,128}$'),
    priority             smallint NOT NULL DEFAULT 1 CHECK (priority BETWEEN 0 AND 3),
    tokens_per_minute    bigint CHECK (tokens_per_minute > 0),
    token_burst          bigint CHECK (token_burst > 0),
    requests_per_minute  bigint CHECK (requests_per_minute > 0),
    request_burst        bigint CHECK (request_burst > 0),
    max_in_flight        integer CHECK (max_in_flight > 0),
    lease_seconds        integer CHECK (lease_seconds BETWEEN 1 AND 86400),
    failure_mode         text CHECK (failure_mode IN ('closed', 'open', 'local')),
    fallback_models      text[] NOT NULL DEFAULT '{}',
    updated_at           timestamptz NOT NULL DEFAULT now()
);
COMMENT ON TABLE plans IS
    'tiers: limits a tenant takes where its own policy is silent, '
    'and a priority (0 low .. 3 critical)';

ALTER TABLE limit_layers
    DROP CONSTRAINT limit_layers_scope_check,
    DROP CONSTRAINT limit_layers_check,
    DROP CONSTRAINT limit_layers_scope_tenant_route_key,
    ADD COLUMN plan text REFERENCES plans ON DELETE RESTRICT,
    ADD COLUMN own_policy jsonb,
    ADD COLUMN priority smallint NOT NULL DEFAULT 1 CHECK (priority BETWEEN 0 AND 3),
    ADD COLUMN fallback_models text[] NOT NULL DEFAULT '{}',
    ADD COLUMN ceiling text CHECK (ceiling ~ '^[A-Za-z0-9._:-]{1,128}$'),
    ADD COLUMN models text[],
    ADD COLUMN model_patterns text[],
    ADD COLUMN shed_above double precision[],
    ADD COLUMN shed_admit smallint[],
    ADD COLUMN shed_small bigint[],
    ADD CONSTRAINT limit_layers_scope_check
        CHECK (scope IN ('global', 'tenant', 'route', 'ceiling')),
    ADD CONSTRAINT limit_layers_shared_check
        CHECK ((scope IN ('global', 'ceiling')) = (tenant IS NULL)),
    ADD CONSTRAINT limit_layers_ceiling_layer_check
        CHECK ((scope = 'ceiling') = (ceiling IS NOT NULL AND model_patterns IS NOT NULL)),
    ADD CONSTRAINT limit_layers_plan_check CHECK (plan IS NULL OR scope = 'tenant'),
    ADD CONSTRAINT limit_layers_ladder_check
        CHECK (cardinality(shed_above) IS NOT DISTINCT FROM cardinality(shed_admit)
               AND cardinality(shed_above) IS NOT DISTINCT FROM cardinality(shed_small)),
    ADD CONSTRAINT limit_layers_key
        UNIQUE NULLS NOT DISTINCT (scope, tenant, route, ceiling);
CREATE INDEX limit_layers_plan ON limit_layers (plan) WHERE plan IS NOT NULL;
CREATE INDEX limit_layers_ceilings ON limit_layers (layer_id) WHERE scope = 'ceiling';
"""


def upgrade() -> None:
    execute_script(SCHEMA)


def downgrade() -> None:
    execute_script(
        """
        -- The admission functions read the new columns: they go with them.
        DROP FUNCTION IF EXISTS lq_admit(text[], text[], text[], bigint[], bigint[], boolean[],
            integer[], text[], text[], integer, smallint[], boolean[], boolean[], integer[],
            text[], bigint[]);
        DROP FUNCTION IF EXISTS lq_put_ceiling(text, text[], bigint, bigint, bigint, bigint,
            integer, double precision[], smallint[], bigint[]);
        DROP FUNCTION IF EXISTS lq_put_plan(text, smallint, bigint, bigint, bigint, bigint,
            integer, integer, text, text[]);
        DROP FUNCTION IF EXISTS lq_put_tenant_policy(text, text, jsonb);
        DROP FUNCTION IF EXISTS lq_materialize_layers(bigint[]);
        DROP FUNCTION IF EXISTS lq_shed_floor(bigint, double precision[], smallint[], bigint[],
            smallint, bigint);
        DROP FUNCTION IF EXISTS lq_model_patterns(text[]);
        -- Forget those scripts, so the next upgrade to head re-creates them.
        DELETE FROM schema_repeatables WHERE name IN ('admission.sql', 'plans.sql');
        DELETE FROM limit_layers WHERE scope = 'ceiling';
        DROP INDEX IF EXISTS limit_layers_plan;
        DROP INDEX IF EXISTS limit_layers_ceilings;
        ALTER TABLE limit_layers
            DROP CONSTRAINT limit_layers_key,
            DROP CONSTRAINT limit_layers_scope_check,
            DROP CONSTRAINT limit_layers_shared_check,
            DROP COLUMN plan, DROP COLUMN own_policy, DROP COLUMN priority,
            DROP COLUMN fallback_models, DROP COLUMN ceiling, DROP COLUMN models,
            DROP COLUMN model_patterns, DROP COLUMN shed_above, DROP COLUMN shed_admit,
            DROP COLUMN shed_small,
            ADD CONSTRAINT limit_layers_scope_check
                CHECK (scope IN ('global', 'tenant', 'route')),
            ADD CONSTRAINT limit_layers_check CHECK ((scope = 'global') = (tenant IS NULL)),
            ADD CONSTRAINT limit_layers_scope_tenant_route_key
                UNIQUE NULLS NOT DISTINCT (scope, tenant, route);
        DROP TABLE IF EXISTS plans;
        """
    )
