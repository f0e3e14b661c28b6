"""Limits of one API key: a layer of scope 'key', decided with the others.

A key may carry its own tokens, requests and in-flight limits (as LiteLLM's
virtual keys do) and a list of the models it may name. The limits are one
more row of `limit_layers`, of scope 'key', so that admission locks, refills,
decides and debits it in the same statement as the global, tenant, route and
ceiling layers, all or nothing, and settlement and the sweeper (which work
from a reservation's `layer_ids`) need nothing new.

- `limit_layers.api_key_id` names the key (NULL for every other scope; the
  row goes when its key row does). The layer key gains it, so one tenant may
  have a layer per key.
- `limit_layers.allowed_models`: the key's model globs as LIKE patterns, so
  that a fallback the statement picks from a tenant's or route's default list
  is one the key may use. NULL: any model.
- `api_keys.models`: the globs as the operator wrote them, listed with the
  key and checked (403 naming the model) before admission.
- `quotas.api_key_id`: a calendar quota of one key (over all its tenant's
  routes), counted only by that key's requests; one quota of a name per
  tenant, route and key.

Revision ID: 0021
Revises: 0020
Create Date: 2026-12-03
"""

from llmquota.store.migration_support import execute_script

revision = "0021"
down_revision = "0020"
branch_labels = None
depends_on = None

SCHEMA = r"""
ALTER TABLE limit_layers
    ADD COLUMN api_key_id bigint REFERENCES api_keys ON DELETE CASCADE,
    ADD COLUMN allowed_models text[],
    DROP CONSTRAINT limit_layers_scope_check,
    ADD CONSTRAINT limit_layers_scope_check
        CHECK (scope IN ('global', 'tenant', 'route', 'ceiling', 'key')),
    ADD CONSTRAINT limit_layers_api_key_check CHECK ((scope = 'key') = (api_key_id IS NOT NULL)),
    ADD CONSTRAINT limit_layers_allowed_models_check
        CHECK (allowed_models IS NULL OR scope = 'key'),
    DROP CONSTRAINT limit_layers_key,
    ADD CONSTRAINT limit_layers_key
        UNIQUE NULLS NOT DISTINCT (scope, tenant, route, ceiling, shard, api_key_id);
CREATE UNIQUE INDEX limit_layers_api_key ON limit_layers (api_key_id) WHERE api_key_id IS NOT NULL;
COMMENT ON COLUMN limit_layers.api_key_id IS 'the API key whose limits a layer of scope key holds';
COMMENT ON COLUMN limit_layers.allowed_models IS
    'a key layer''s allowed models as LIKE patterns (NULL: any model)';

ALTER TABLE api_keys ADD COLUMN models text[];
COMMENT ON COLUMN api_keys.models IS 'the model names and globs the key may use (NULL: any)';

ALTER TABLE quotas
    ADD COLUMN api_key_id bigint REFERENCES api_keys ON DELETE CASCADE,
    ADD CONSTRAINT quotas_key_or_route CHECK (api_key_id IS NULL OR route IS NULL);
COMMENT ON COLUMN quotas.api_key_id IS 'a quota of one API key (NULL: of the tenant or route)';
DROP INDEX quotas_scope_name;
CREATE UNIQUE INDEX quotas_scope_name
    ON quotas (tenant, (coalesce(route, '')), (coalesce(api_key_id, 0)), name);
"""


def upgrade() -> None:
    execute_script(SCHEMA)


def downgrade() -> None:
    execute_script(
        """
        DELETE FROM quotas WHERE api_key_id IS NOT NULL;
        DROP INDEX IF EXISTS quotas_scope_name;
        ALTER TABLE quotas DROP COLUMN IF EXISTS api_key_id;
        CREATE UNIQUE INDEX quotas_scope_name ON quotas (tenant, (coalesce(route, '')), name);
        ALTER TABLE api_keys DROP COLUMN IF EXISTS models;
        DELETE FROM limit_layers WHERE scope = 'key';
        DROP INDEX IF EXISTS limit_layers_api_key;
        ALTER TABLE limit_layers
            DROP CONSTRAINT limit_layers_key,
            DROP CONSTRAINT limit_layers_allowed_models_check,
            DROP CONSTRAINT limit_layers_api_key_check,
            DROP CONSTRAINT limit_layers_scope_check,
            DROP COLUMN allowed_models,
            DROP COLUMN api_key_id,
            ADD CONSTRAINT limit_layers_scope_check
                CHECK (scope IN ('global', 'tenant', 'route', 'ceiling')),
            ADD CONSTRAINT limit_layers_key
                UNIQUE NULLS NOT DISTINCT (scope, tenant, route, ceiling, shard);
        """
    )
