"""A sharded global layer: its budget split over K rows.

The global layer is one row every admission batch locks, so batches queue
behind it whatever the cores. With `shards` K > 1 its limits are split over K
rows of scope 'global' (`shard` 0 .. K-1; each holds its share of every
rate, burst and in-flight bound, and the shares sum to the policy's figures),
and a request takes its tenant's shard (lq_tenant_shard). A shard short of
room for its part of a batch makes the statement decide again with every
shard locked and pooled (see lq_admit in sql/admission.sql).

- `limit_layers.shard`: the shard a global row is, 0 for every other row.
- `limit_layers.shards`: how many shards the global layer has (the same on
  each of its rows, so the admission that locks a row knows which tenants
  map to it); 1 for every other row.
- The layer key becomes (scope, tenant, route, ceiling, shard).

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-01
"""

from llmquota.store.migration_support import execute_script

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None

SCHEMA = r"""
ALTER TABLE limit_layers
    DROP CONSTRAINT limit_layers_key,
    ADD COLUMN shard smallint NOT NULL DEFAULT 0,
    ADD COLUMN shards smallint NOT NULL DEFAULT 1,
    ADD CONSTRAINT limit_layers_shard_check
        CHECK (shards BETWEEN 1 AND 64 AND shard >= 0 AND shard < shards
               AND (scope = 'global' OR shards = 1)),
    ADD CONSTRAINT limit_layers_key
        UNIQUE NULLS NOT DISTINCT (scope, tenant, route, ceiling, shard);
COMMENT ON COLUMN limit_layers.shard IS
    'which share of the global layer this row holds (0 for every other layer)';
COMMENT ON COLUMN limit_layers.shards IS
    'how many rows the global layer is split over (1 for every other layer)';
"""


def upgrade() -> None:
    execute_script(SCHEMA)


def downgrade() -> None:
    execute_script(
        """
        -- The functions that read the new columns go with them; the
        -- scripts re-create today's bodies on the next upgrade.
        DROP FUNCTION IF EXISTS lq_admit(text[], text[], text[], bigint[], bigint[], boolean[],
            integer[], text[], text[], integer, smallint[], boolean[], boolean[], integer[],
            text[], bigint[], bigint[]);
        DROP FUNCTION IF EXISTS lq_admit_decide(text[], text[], text[], bigint[], bigint[],
            boolean[], integer[], text[], text[], integer, smallint[], boolean[], boolean[],
            integer[], text[], bigint[], bigint[], boolean);
        DROP FUNCTION IF EXISTS lq_put_global(bigint, bigint, bigint, bigint, integer, integer,
            text, smallint);
        DROP FUNCTION IF EXISTS lq_tenant_shard(text, smallint);
        DROP FUNCTION IF EXISTS lq_record_outage_admissions(uuid[], text[], text[], text[],
            bigint[], bigint[], boolean[], integer[], text[], text[], bigint[], text[]);
        DROP VIEW IF EXISTS global_layer;
        DELETE FROM schema_repeatables
         WHERE name IN ('admission.sql', 'reliability.sql', 'global_layer.sql');
        -- One row again: the shards' balances and permits pooled into shard 0,
        -- and the open reservations of the other shards moved onto it, so
        -- that their settlement gives the permits back where they now are.
        UPDATE reservations AS r
           SET layer_ids = array_replace(r.layer_ids, g.layer_id, keep.layer_id)
          FROM limit_layers AS g,
               (SELECT layer_id FROM limit_layers WHERE scope = 'global' AND shard = 0) AS keep
         WHERE g.scope = 'global' AND g.shard > 0 AND r.state = 'active'
           AND r.layer_ids @> ARRAY[g.layer_id];
        UPDATE limit_layers AS l
           SET tokens_per_minute = s.tpm, token_burst = s.tburst,
               requests_per_minute = s.rpm, request_burst = s.rburst,
               max_in_flight = s.max_if, in_flight = s.in_flight,
               tokens = least(s.tburst, s.tokens), requests = least(s.rburst, s.requests),
               refilled_at = s.refilled_at
          FROM (SELECT sum(tokens_per_minute)::bigint AS tpm, sum(token_burst)::bigint AS tburst,
                       sum(requests_per_minute)::bigint AS rpm,
                       sum(request_burst)::bigint AS rburst,
                       sum(max_in_flight)::integer AS max_if, sum(in_flight)::integer AS in_flight,
                       sum(tokens) AS tokens, sum(requests) AS requests,
                       max(refilled_at) AS refilled_at
                  FROM limit_layers WHERE scope = 'global') AS s
         WHERE l.scope = 'global' AND l.shard = 0;
        DELETE FROM limit_layers WHERE scope = 'global' AND shard > 0;
        ALTER TABLE limit_layers
            DROP CONSTRAINT limit_layers_key,
            DROP CONSTRAINT limit_layers_shard_check,
            DROP COLUMN shard,
            DROP COLUMN shards,
            ADD CONSTRAINT limit_layers_key
                UNIQUE NULLS NOT DISTINCT (scope, tenant, route, ceiling);
        """
    )
