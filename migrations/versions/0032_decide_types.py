"""Composite types for the steps of lq_admit_decide: a layer, a request, a verdict.

lq_admit_decide (sql/admission.sql) kept what it read and decided as 104
parallel arrays, one per field: 21 per locked layer, 32 per result, 14 per
quota, and more per request and candidate, each indexed by position and
filled field by field. Its steps are now functions over rows of these types
(one array of rows per kind, a row per layer or request), so each step is a
page that names what it reads:

- `lq_locked_layer`: a layer the batch locked, with its running balances.
- `lq_admit_request`: one request of the batch, with the places of its
  layers among the locked ones and what it counts as (requests, permits).
- `lq_admit_candidate`: a model a request may be admitted as, on one
  deployment: the requested model first, then its fallbacks.
- `lq_model_ceiling`: a provider ceiling a candidate model matches.
- `lq_capacity_verdict`: what a candidate's layers say of it (step 5).
- `lq_quota_hold`, `lq_credit_hold`, `lq_model_price`: the calendar quotas,
  prepaid balances and prices a batch reserves money against.
- `lq_budget_verdict`: what its quotas and prepaid balance say.
- `lq_finish_result`: what lq_finish answers per request (the columns it
  returned as a table before), so that it keeps one row per request instead
  of 11 parallel arrays.

The result per request is lq_admit_result (migration 0031); an admitted
request's journal row is a `reservations` row.

Revision ID: 0032
Revises: 0031
Create Date: 2026-12-05
"""

from llmquota.store.migration_support import execute_script

revision = "0032"
down_revision = "0031"
branch_labels = None
depends_on = None

SCHEMA = r"""
CREATE TYPE lq_locked_layer AS (
    layer_id            bigint,
    key                 text,     -- g/<shard> t/<tenant> r/<tenant>/<route> k/<key id> c/<ceiling>
    scope               text,
    ceiling             text,
    tokens_per_minute   bigint,
    token_burst         bigint,
    requests_per_minute bigint,
    request_burst       bigint,
    max_in_flight       integer,
    lease_seconds       integer,
    policy_version      bigint,
    tokens              double precision,   -- running: refilled, then debited
    requests            double precision,
    in_flight           integer,
    refilled_at         timestamptz,
    shards              smallint,
    priority            smallint,
    plan                text,
    fallback_models     text[],
    allowed_models      text[],
    shed_above          double precision[],
    shed_admit          smallint[],
    shed_small          bigint[],
    prepaid             boolean,
    request_cost        integer,
    uses_concurrency    boolean
);

CREATE TYPE lq_admit_request AS (
    ord              integer,
    tenant           text,
    route            text,
    model            text,
    input_tokens     bigint,
    max_tokens       bigint,
    output_reserve   bigint,
    input_estimated  boolean,
    lease_seconds    integer,
    idempotency_key  text,
    request_hash     text,
    priority         smallint,   -- requested, NULL: the tenant's
    priority_any     boolean,
    degrade          boolean,
    reservation_id   uuid,
    key_id           bigint,
    serving_path     text,
    -- its layers' places in the locked layers (NULL: none)
    global_at        integer,
    tenant_at        integer,
    route_at         integer,
    key_at           integer,
    request_cost     integer,    -- requests it takes from each request rate
    permits          integer,    -- 1 or 0
    -- its explicit fallbacks and deployments: places in the batch's arrays
    alt_from         integer,
    alt_count        integer,
    up_from          integer,
    up_count         integer
);

CREATE TYPE lq_admit_candidate AS (
    model           text,
    input_tokens    bigint,
    output_reserve  bigint,     -- NULL: max_tokens
    upstream        text,       -- the deployment tried (NULL: none named)
    fallback        boolean     -- not the requested model
);

CREATE TYPE lq_model_ceiling AS (
    model     text,
    layer_id  bigint,
    upstream  text              -- the deployment it is scoped to (NULL: every one)
);

CREATE TYPE lq_capacity_verdict AS (
    too_large_at      integer,          -- the smallest token burst below the cost
    too_many_at       integer,          -- a request burst below its request cost
    token_wait_ms     bigint,           -- the longest wait for tokens (-1: none)
    token_wait_at     integer,
    wait_ms           bigint,           -- the longest wait of any kind (-1: none)
    kind              text,             -- and what it waits for
    scope             text,
    reason            text,             -- capacity | shed
    ceiling           text,
    utilization       double precision,
    room              double precision, -- the most output that fits now
    blocked           boolean           -- a request or permit is lacking
);

CREATE TYPE lq_quota_hold AS (
    quota_id        bigint,
    name            text,
    tenant          text,
    route           text,
    api_key_id      bigint,
    model_patterns  text[],
    tokens          bigint,
    cost            numeric,
    blocks          boolean,
    window_end      timestamptz,
    timezone        text,
    used_tokens     numeric,    -- running: reserved + charged, and this batch
    used_cost       numeric,
    added_tokens    bigint,     -- what this batch adds
    added_cost      numeric
);

CREATE TYPE lq_credit_hold AS (
    tenant     text,
    available  numeric,         -- running: balance - reserved, less this batch
    added      numeric
);

CREATE TYPE lq_model_price AS (
    model       text,
    input_usd   numeric,        -- per million tokens
    output_usd  numeric
);

CREATE TYPE lq_finish_result AS (
    ord                      integer,
    status                   text,
    state                    text,
    tenant                   text,
    charged_tokens           bigint,
    refunded_tokens          bigint,
    late                     boolean,
    excess_tokens            bigint,   -- settled above lq_shared_charge_cap; 0 otherwise
    -- not debited from the global layer / from provider ceilings because
    -- they stood at their floor (lq_shared_forgiven); 0 otherwise
    forgiven_global_tokens   bigint,
    forgiven_ceiling_tokens  bigint,
    -- the reservation's model (the one admitted) and its tenant's plan now:
    -- the settling worker labels its metrics with them, whichever worker
    -- admitted the reservation
    model                    text,
    plan                     text
);

CREATE TYPE lq_budget_verdict AS (
    refusal     text,           -- quota_exceeded | credits_exhausted | unpriced_model
    quota_at    integer,        -- the quota that refused
    quotas      integer[],      -- every quota it counts against
    money       numeric,        -- its most cost: input and max_tokens at their prices
    available   numeric,        -- the prepaid balance it met
    room        double precision  -- the most output its token quotas leave
);
"""

DOWNGRADE = r"""
-- The steps of lq_admit_decide are declared over these types: they go with
-- them (CASCADE). lq_admit_decide itself uses them only in its body, so it
-- stays, and fails until 0031's downgrade drops it or the next upgrade to
-- head applies admission.sql again (migrations/README.md).
DELETE FROM schema_repeatables WHERE name = 'admission.sql';
-- Steps declared over older types only go too, so that the downgrades of
-- those types' revisions can drop them: two of lq_admit_decide's (0031's
-- types) and lq_finish's three (0029's).
DROP FUNCTION IF EXISTS lq_admit_at_once(lq_admit_batch, boolean);
DROP FUNCTION IF EXISTS lq_without_refusal(lq_admit_result);
DROP FUNCTION IF EXISTS lq_finish_layers(lq_layer_credit[], reservations[]);
DROP FUNCTION IF EXISTS lq_finish_budgets(lq_budget_change[], reservations[], timestamptz);
DROP FUNCTION IF EXISTS lq_finish_ledger(lq_ledger_entry[], reservations[], double precision[],
                                         timestamptz);
-- lq_finish and lq_finish_outage (reliability.sql) return lq_finish_result:
-- they go first (the next upgrade to head creates all three again).
DELETE FROM schema_repeatables WHERE name = 'reliability.sql';
DROP FUNCTION IF EXISTS lq_finish(uuid[], text[], text[], bigint[], bigint[], text[], text[],
                                  numeric[], numeric[], text[]);
DROP FUNCTION IF EXISTS lq_finish_outage(uuid[], text[], text[], bigint[], bigint[], text[],
                                         timestamptz[]);
DROP TYPE lq_finish_result;
DROP TYPE lq_budget_verdict CASCADE;
DROP TYPE lq_model_price CASCADE;
DROP TYPE lq_credit_hold CASCADE;
DROP TYPE lq_quota_hold CASCADE;
DROP TYPE lq_capacity_verdict CASCADE;
DROP TYPE lq_model_ceiling CASCADE;
DROP TYPE lq_admit_candidate CASCADE;
DROP TYPE lq_admit_request CASCADE;
DROP TYPE lq_locked_layer CASCADE;
"""


def upgrade() -> None:
    execute_script(SCHEMA)


def downgrade() -> None:
    execute_script(DOWNGRADE)
