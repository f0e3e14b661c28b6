"""The serving-path chain: a response cache, and the path each ledger row was served by.

- `limit_layers.cache` (tenant and route layers) and `plans.cache`: the
  policy's response cache (`{"mode": "exact" | "semantic", ...}`, validated
  by llmquota.domain.response_cache.CachePolicy), NULL for none. A tenant
  layer's is the effective one: its own (in `own_policy`) else its plan's,
  as output_estimate (0011).
- `response_cache`: the answers the proxy may serve again, per tenant and
  route ('' for none), endpoint and model. `exact_key` is the SHA-256 of the
  request's answer-changing members; `context_key`, `embedding` and
  `signature` serve semantic lookups (the embedding scaled to length 1, its
  SimHash). Rows expire at `expires_at` (the sweeper deletes them) and a
  tenant keeps at most its policy's `max_entries` per route (the oldest go
  first). Hits are counted in the ledger, not here: a counter on the entry
  would make every hit of a popular answer wait for the one before.
- `usage_ledger.serving_path`: how the request was served (primary, cache,
  fallback_model, queued, second_deployment); NULL on adjustments and on
  rows older than this revision. A cache hit's row charges 0 tokens and
  says what the provider would have billed in `saved_input_tokens` and
  `saved_output_tokens`, and the hit's price, when the policy sets one, in
  `price_usd`.
- `reservations.serving_path`: the path known when the reservation was
  taken (fallback_model, queued), which its settlement writes to the ledger
  unless the settler names another (second_deployment); NULL: primary.

Nullable columns without a default: adding them to the partitioned ledger
rewrites nothing.

Revision ID: 0026
Revises: 0025
Create Date: 2026-12-04
"""

from llmquota.store.migration_support import execute_script

revision = "0026"
down_revision = "0025"
branch_labels = None
depends_on = None

SCHEMA = r"""
ALTER TABLE limit_layers
    ADD COLUMN cache jsonb
        CONSTRAINT limit_layers_cache_mode CHECK (cache IS NULL OR cache ? 'mode'),
    ADD CONSTRAINT limit_layers_cache_scope_check
        CHECK (cache IS NULL OR scope IN ('tenant', 'route'));
ALTER TABLE plans
    ADD COLUMN cache jsonb
        CONSTRAINT plans_cache_mode CHECK (cache IS NULL OR cache ? 'mode');

CREATE TABLE response_cache (
    entry_id     bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    tenant       text NOT NULL,
    route        text NOT NULL,
    endpoint     text NOT NULL,
    model        text NOT NULL,
    exact_key    bytea NOT NULL CHECK (length(exact_key) = 32),
    context_key  bytea CHECK (length(context_key) = 32),
    embedding    real[],
    signature    bigint,
    answer       bytea NOT NULL,
    input_tokens  bigint NOT NULL CHECK (input_tokens >= 0),
    output_tokens bigint NOT NULL CHECK (output_tokens >= 0),
    created_at   timestamptz NOT NULL,
    expires_at   timestamptz NOT NULL,
    CONSTRAINT response_cache_semantic CHECK (
        (embedding IS NULL) = (signature IS NULL)
        AND (embedding IS NULL OR context_key IS NOT NULL))
);
CREATE UNIQUE INDEX response_cache_exact
    ON response_cache (tenant, route, endpoint, model, exact_key);
CREATE INDEX response_cache_context
    ON response_cache (tenant, route, endpoint, model, context_key)
    WHERE embedding IS NOT NULL;
CREATE INDEX response_cache_age ON response_cache (tenant, route, created_at);
CREATE INDEX response_cache_expiry ON response_cache (expires_at);
COMMENT ON TABLE response_cache IS
    'answers the proxy serves again (the policy''s cache), per tenant; route is empty for none';

ALTER TABLE usage_ledger
    ADD COLUMN serving_path text
        CONSTRAINT usage_ledger_serving_path
        CHECK (serving_path IN ('primary', 'cache', 'fallback_model', 'queued',
                                'second_deployment')),
    ADD COLUMN saved_input_tokens bigint
        CONSTRAINT usage_ledger_saved_input CHECK (saved_input_tokens >= 0),
    ADD COLUMN saved_output_tokens bigint
        CONSTRAINT usage_ledger_saved_output CHECK (saved_output_tokens >= 0),
    ADD COLUMN price_usd numeric
        CONSTRAINT usage_ledger_price CHECK (price_usd >= 0);
COMMENT ON COLUMN usage_ledger.serving_path IS
    'how the request was served: primary, cache, fallback_model, queued or second_deployment';
COMMENT ON COLUMN usage_ledger.saved_input_tokens IS
    'a cache hit: the input tokens the provider would have billed';
COMMENT ON COLUMN usage_ledger.saved_output_tokens IS
    'a cache hit: the output tokens the provider would have billed';
COMMENT ON COLUMN usage_ledger.price_usd IS
    'a price set by the operator for this row (a cache hit''s), beside the model''s per token';

ALTER TABLE reservations
    ADD COLUMN serving_path text
        CONSTRAINT reservations_serving_path
        CHECK (serving_path IN ('fallback_model', 'queued', 'second_deployment'));
"""

DOWNGRADE = r"""
-- The functions and views of these scripts read what goes (migrations/README.md):
-- the next upgrade to head applies them again.
DROP FUNCTION IF EXISTS lq_audit();
DROP FUNCTION IF EXISTS lq_audit_reservation_books();
DROP FUNCTION IF EXISTS lq_audit_quota_windows();
DROP VIEW IF EXISTS reporting.ledger_entries CASCADE;
-- (reports/60_oversubscription.sql reads serving_path since issue 23's deployments)
DROP VIEW IF EXISTS reporting.ceiling_activity CASCADE;
DELETE FROM schema_repeatables
 WHERE name IN ('admission.sql', 'ledger.sql', 'reliability.sql', 'plans.sql', 'queries.sql',
                'cache.sql')
    OR name LIKE 'reports/%';
DROP TABLE response_cache;
ALTER TABLE reservations DROP COLUMN serving_path;
ALTER TABLE usage_ledger
    DROP COLUMN price_usd,
    DROP COLUMN saved_output_tokens,
    DROP COLUMN saved_input_tokens,
    DROP COLUMN serving_path;
ALTER TABLE plans DROP COLUMN cache;
ALTER TABLE limit_layers
    DROP CONSTRAINT limit_layers_cache_scope_check,
    DROP COLUMN cache;
"""


def upgrade() -> None:
    execute_script(SCHEMA)


def downgrade() -> None:
    execute_script(DOWNGRADE)
