"""Composite types for what lq_admit decides: a batch in, one row per request out.

lq_admit (sql/admission.sql) takes a batch as one array per field, so that a
worker (or pgbench) sends it in one call, and hands it to lq_admit_decide up
to twice (a sharded global layer short of room is decided again, pooled).
Its 25 arrays were written out in both functions' signatures and in each
call, and the 37 columns of a decision in both functions' results.

- `lq_admit_batch`: the batch, one array per field, each indexed by the
  request's position (the fallback and deployment arrays are flattened and
  name the position they belong to). lq_admit builds it once.
- `lq_admit_result`: what one request's decision answers, in the order the
  store reads it (store/decisions.py).

Revision ID: 0031
Revises: 0030
Create Date: 2026-12-05
"""

from llmquota.store.migration_support import execute_script

revision = "0031"
down_revision = "0030"
branch_labels = None
depends_on = None

SCHEMA = r"""
CREATE TYPE lq_admit_batch AS (
    tenants              text[],
    routes               text[],
    models               text[],
    input_tokens         bigint[],
    max_tokens           bigint[],
    input_estimated      boolean[],
    lease_seconds        integer[],
    idempotency_keys     text[],
    request_hashes       text[],
    concurrency_retry_ms integer,
    priorities           smallint[],  -- requested rank, NULL: the tenant's
    priority_any         boolean[],   -- true: may raise it (admin)
    degrade              boolean[],   -- false: never degrade
    alt_ord              integer[],   -- explicit fallbacks: request position,
    alt_models           text[],      -- model, in order,
    alt_inputs           bigint[],    -- its input count
    output_reserve       bigint[],    -- output tokens to reserve, NULL: max_tokens
    reservation_ids      uuid[],      -- the id each admission gets, NULL: a new one
    key_ids              bigint[],    -- the API key that asked, NULL: none
    alt_outputs          bigint[],    -- each explicit fallback's output reserve
    serving_paths        text[],      -- 'queued': it waited for room; NULL: as asked
    up_ord               integer[],   -- deployments: request position,
    up_models            text[],      -- the candidate model they serve,
    up_names             text[],      -- the deployment, in the caller's order,
    up_rules             text[]       -- and the model's rule ('least_utilized')
);

CREATE TYPE lq_admit_result AS (
    ord                        integer,
    status                     text,
    reservation_id             uuid,
    reserved_tokens            bigint,
    lease_expires_at           timestamptz,
    lease_generation           integer,
    limit_kind                 text,
    limit_scope                text,
    retry_after_ms             bigint,
    capacity                   bigint,
    remaining_tokens           bigint,
    remaining_requests         bigint,
    remaining_in_flight        integer,
    tenant_tokens_per_minute   bigint,
    tenant_token_burst         bigint,
    tenant_tokens              double precision,
    tenant_requests_per_minute bigint,
    tenant_request_burst       bigint,
    tenant_requests            double precision,
    model                      text,
    input_tokens               bigint,
    degraded                   boolean,
    reason                     text,
    ceiling                    text,
    utilization                double precision,
    priority                   smallint,
    plan                       text,
    alt_max_tokens             bigint,
    alt_models                 text[],
    quota                      text,
    resets_at                  timestamptz,
    quota_timezone             text,             -- the zone resets_at is shown in
    credit_balance             numeric,
    binding_tokens_per_minute  bigint,           -- the binding token layer: the one
    binding_token_burst        bigint,           -- that refused, else the one with
    binding_tokens             double precision, -- the least left after the decision
    upstream                   text              -- the deployment admitted (NULL: none)
);
"""

DOWNGRADE = r"""
-- lq_admit and lq_admit_decide are declared over these types: they go with
-- them, and the next upgrade to head applies admission.sql again
-- (migrations/README.md).
DELETE FROM schema_repeatables WHERE name = 'admission.sql';
DROP FUNCTION IF EXISTS lq_admit(text[], text[], text[], bigint[], bigint[], boolean[],
                                 integer[], text[], text[], integer, smallint[], boolean[],
                                 boolean[], integer[], text[], bigint[], bigint[], timestamptz,
                                 uuid[], bigint[], bigint[], text[], integer[], text[], text[],
                                 text[]);
DROP FUNCTION IF EXISTS lq_admit_decide(lq_admit_batch, boolean);
DROP TYPE lq_admit_result;
DROP TYPE lq_admit_batch;
"""


def upgrade() -> None:
    execute_script(SCHEMA)


def downgrade() -> None:
    execute_script(DOWNGRADE)
