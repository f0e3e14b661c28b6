"""Learned output reservations: the policy field and the settle-time histograms.

- `limit_layers.output_estimate` (tenant and route layers) and
  `plans.output_estimate`: the policy's output reservation strategy, a jsonb
  object (`{"strategy": "max_tokens" | "learned" | "fixed", ...}`), NULL for
  the default (max_tokens). A tenant layer's is the effective one: its own
  (in `own_policy`) else its plan's.
- `output_estimates`: one row per (tenant, route, model) with the decayed
  histogram of the output tokens its settled completions used
  (`weights[i]`: bucket i's weight as of `updated_at`, buckets as
  lq_output_bucket_bounds() in sql/estimates.sql), and `samples`, the
  samples recorded since the histogram last decayed to nothing. `route`
  is '' for requests without one (a route name is never empty).

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-01
"""

from llmquota.store.migration_support import execute_script

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None

SCHEMA = r"""
ALTER TABLE limit_layers
    ADD COLUMN output_estimate jsonb
        CHECK (output_estimate IS NULL OR output_estimate ? 'strategy'),
    ADD CONSTRAINT limit_layers_output_estimate_scope_check
        CHECK (output_estimate IS NULL OR scope IN ('tenant', 'route'));
ALTER TABLE plans
    ADD COLUMN output_estimate jsonb
        CHECK (output_estimate IS NULL OR output_estimate ? 'strategy');

CREATE TABLE output_estimates (
    tenant      text NOT NULL,
    route       text NOT NULL,
    model       text NOT NULL,
    weights     double precision[] NOT NULL,
    samples     bigint NOT NULL CHECK (samples > 0),
    updated_at  timestamptz NOT NULL,
    PRIMARY KEY (tenant, route, model)
);
CREATE INDEX output_estimates_updated_at ON output_estimates (updated_at);
COMMENT ON TABLE output_estimates IS
    'decayed histograms of settled output tokens per (tenant, route, model); '
    'route is empty for requests without one';
"""


def upgrade() -> None:
    execute_script(SCHEMA)


def downgrade() -> None:
    execute_script(
        """
        -- The functions that read the new columns and table go with them.
        DROP FUNCTION IF EXISTS lq_admit(text[], text[], text[], bigint[], bigint[], boolean[],
            integer[], text[], text[], integer, smallint[], boolean[], boolean[], integer[],
            text[], bigint[], bigint[]);
        DROP FUNCTION IF EXISTS lq_put_plan(text, smallint, bigint, bigint, bigint, bigint,
            integer, integer, text, text[], boolean, jsonb);
        DROP FUNCTION IF EXISTS lq_record_output_samples(text[], text[], text[], bigint[]);
        DROP FUNCTION IF EXISTS lq_output_merge(double precision[], double precision,
            double precision[]);
        DROP FUNCTION IF EXISTS lq_output_bucket_counts(integer[]);
        DROP FUNCTION IF EXISTS lq_output_decay(double precision);
        DROP FUNCTION IF EXISTS lq_output_bucket_bounds();
        DROP FUNCTION IF EXISTS lq_output_half_life_seconds();
        -- lq_finish and lq_materialize_layers read them too: today's bodies
        -- come back with the scripts, which the next upgrade re-applies.
        DROP FUNCTION IF EXISTS lq_sweep(integer);
        DROP FUNCTION IF EXISTS lq_finish(uuid[], text[], text[], bigint[], bigint[], text[]);
        DROP FUNCTION IF EXISTS lq_put_tenant_policy(text, text, jsonb);
        DROP FUNCTION IF EXISTS lq_materialize_layers(bigint[]);
        DELETE FROM schema_repeatables
         WHERE name IN ('admission.sql', 'plans.sql', 'estimates.sql');
        DROP TABLE IF EXISTS output_estimates;
        ALTER TABLE plans DROP COLUMN output_estimate;
        ALTER TABLE limit_layers
            DROP CONSTRAINT limit_layers_output_estimate_scope_check,
            DROP COLUMN output_estimate;
        """
    )
