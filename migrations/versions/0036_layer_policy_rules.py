"""A layer's policy rules checked when its policy is written, not at every debit.

PostgreSQL checks every CHECK constraint of a table on every row an UPDATE
writes, whatever columns it sets, and reads each constraint's expression
from its stored text again in every statement that writes the table. On
`limit_layers` that was 32 constraints, 27 KB of node text, read again by
every admission and every settlement, which only ever set the four balance
columns (`tokens`, `requests`, `in_flight`, `refilled_at`): about 0.08 ms of
a lone admission's 0.5 ms of server CPU, and more of a settlement's
(BENCHMARKS.md, issue 25's eleventh part).

The 27 rules that name no balance column are now checked by one function,
`lq_layer_policy_rules`, run by two triggers: before each row an INSERT
writes (`limit_layers_policy_rules_on_insert`), where a CHECK tested it,
so an upsert's proposed row is refused before any conflict is looked at;
and after each row an UPDATE writes when it sets any column but the four
balances (`limit_layers_policy_rules_on_update`: an AFTER trigger, since
a BEFORE UPDATE row trigger makes PostgreSQL fetch and lock every row an
UPDATE writes before it looks at the trigger's columns). Only a policy
write pays for them. A rule that fails raises what its CHECK raised
(SQLSTATE 23514, the same message, the rule's name as the constraint's;
the DETAIL's failing row is PL/pgSQL's rendering of it), and the
statement, as with a CHECK, changes nothing. One order differs: an UPDATE
that breaks a rule and a unique or foreign key too is refused by the key,
which PostgreSQL checks before the AFTER trigger runs (it checked CHECKs
first). The five rules that name a balance stay CHECK constraints: a debit
is checked against them as before.

The rules are the table's, frozen here as its CHECKs were (no repeatable
script owns them); a new rule or a changed one is a new revision. The
trigger's column list is every column but the balances: a column added
later must be added to it (tests/integration/test_layer_policy_rules.py
fails until it is).

Revision ID: 0036
Revises: 0035
Create Date: 2026-12-07
"""

from llmquota.store.migration_support import execute_script

revision = "0036"
down_revision = "0035"
branch_labels = None
depends_on = None

SCHEMA = r"""
-- First the table, whole: a session of the service that has locked a
-- layer's row and has yet to update it would otherwise wait for this
-- transaction's next lock while it waits for theirs (a deadlock, one of the
-- two aborted).
LOCK TABLE limit_layers IN ACCESS EXCLUSIVE MODE;

-- The rules a layer's policy keeps, each by the name its CHECK had. A rule
-- that is NULL holds, as a CHECK's does (the row is left out by NOT). Of
-- several broken, the first by name (in bytes, as PostgreSQL orders CHECKs)
-- is named. The relation is named as the table, also on a Citus shard.
CREATE FUNCTION lq_layer_policy_rules() RETURNS trigger
LANGUAGE plpgsql
SET search_path = pg_catalog
AS $$
DECLARE
    broken text;
BEGIN
    SELECT rule.name INTO broken
      FROM (VALUES
        -- what the layer's scope asks of the row
        ('limit_layers_scope_check',
         NEW.scope IN ('global', 'tenant', 'route', 'ceiling', 'key')),
        ('limit_layers_shared_check',
         (NEW.scope IN ('global', 'ceiling')) = (NEW.tenant IS NULL)),
        ('limit_layers_check1', (NEW.scope = 'route') = (NEW.route IS NOT NULL)),
        ('limit_layers_api_key_check', (NEW.scope = 'key') = (NEW.api_key_id IS NOT NULL)),
        ('limit_layers_ceiling_layer_check',
         (NEW.scope = 'ceiling') = (NEW.ceiling IS NOT NULL AND NEW.model_patterns IS NOT NULL)),
        ('limit_layers_shard_check',
         NEW.shards BETWEEN 1 AND 64 AND NEW.shard >= 0 AND NEW.shard < NEW.shards
         AND (NEW.scope = 'global' OR NEW.shards = 1)),
        ('limit_layers_plan_check', NEW.plan IS NULL OR NEW.scope = 'tenant'),
        ('limit_layers_allowed_models_check', NEW.allowed_models IS NULL OR NEW.scope = 'key'),
        ('limit_layers_upstream_ceiling', NEW.upstream IS NULL OR NEW.scope = 'ceiling'),
        ('limit_layers_admission',
         NEW.admission IS NULL
         OR (NEW.admission IN ('exact', 'allotted') AND NEW.scope IN ('tenant', 'route'))),
        ('limit_layers_cache_scope_check', NEW.cache IS NULL OR NEW.scope IN ('tenant', 'route')),
        ('limit_layers_output_estimate_scope_check',
         NEW.output_estimate IS NULL OR NEW.scope IN ('tenant', 'route')),
        -- names
        ('limit_layers_route_check', NEW.route ~ '^[A-Za-z0-9._:-]{1,128}$'),
        ('limit_layers_ceiling_check', NEW.ceiling ~ '^[A-Za-z0-9._:-]{1,128}$'),
        -- rates and their bursts, both or neither
        ('limit_layers_tokens_per_minute_check', NEW.tokens_per_minute > 0),
        ('limit_layers_token_burst_check', NEW.token_burst > 0),
        ('limit_layers_check2', (NEW.tokens_per_minute IS NULL) = (NEW.token_burst IS NULL)),
        ('limit_layers_requests_per_minute_check', NEW.requests_per_minute > 0),
        ('limit_layers_request_burst_check', NEW.request_burst > 0),
        ('limit_layers_check3', (NEW.requests_per_minute IS NULL) = (NEW.request_burst IS NULL)),
        -- the cap on permits: the policy's own share, moves aside (0035)
        ('limit_layers_max_in_flight_check', NEW.max_in_flight - NEW.in_flight_moved > 0),
        -- options
        ('limit_layers_lease_seconds_check', NEW.lease_seconds >= 1 AND NEW.lease_seconds <= 86400),
        ('limit_layers_priority_check', NEW.priority >= 0 AND NEW.priority <= 3),
        ('limit_layers_failure_mode_check', NEW.failure_mode IN ('closed', 'open', 'local')),
        ('limit_layers_ladder_check',
         cardinality(NEW.shed_above) IS NOT DISTINCT FROM cardinality(NEW.shed_admit)
         AND cardinality(NEW.shed_above) IS NOT DISTINCT FROM cardinality(NEW.shed_small)),
        ('limit_layers_cache_mode', NEW.cache IS NULL OR NEW.cache ? 'mode'),
        ('limit_layers_output_estimate_check',
         NEW.output_estimate IS NULL OR NEW.output_estimate ? 'strategy')
      ) AS rule (name, holds)
     WHERE NOT rule.holds
     ORDER BY rule.name COLLATE "C"
     LIMIT 1;
    IF broken IS NOT NULL THEN
        RAISE EXCEPTION 'new row for relation "limit_layers" violates check constraint "%"',
                        broken
              USING ERRCODE = 'check_violation', CONSTRAINT = broken,
                    TABLE = 'limit_layers', SCHEMA = TG_TABLE_SCHEMA,
                    DETAIL = format('Failing row contains %s.', NEW);
    END IF;
    RETURN NEW;  -- the row as it came (an AFTER trigger's answer is not read)
END
$$;

-- A cell upgraded in place on Citus has its tables distributed already:
-- their triggers run on the cell's node, beside the rows (as on a cell
-- built new, sql/cells_queries.sql). Elsewhere a setting nothing reads.
SELECT set_config('citus.enable_unsafe_triggers', 'on', true);

CREATE TRIGGER limit_layers_policy_rules_on_insert
    BEFORE INSERT ON limit_layers
    FOR EACH ROW EXECUTE FUNCTION lq_layer_policy_rules();
-- Every column but the four balances a debit sets (tokens, requests,
-- in_flight, refilled_at): an admission or a settlement fires nothing.
CREATE TRIGGER limit_layers_policy_rules_on_update
    AFTER UPDATE OF
        admission, alert_at, alert_hysteresis, alert_quiet_seconds, allowed_models,
        api_key_id, cache, ceiling, failure_mode, fallback_models, in_flight_moved,
        layer_id, lease_seconds, max_in_flight, model_patterns, models, output_estimate,
        own_policy, plan, policy_version, prepaid, priority, request_burst, request_cost,
        requests_per_minute, route, scope, shard, shards, shed_above, shed_admit,
        shed_queue_ms, shed_small, tenant, token_burst, tokens_per_minute, upstream,
        uses_concurrency
    ON limit_layers
    FOR EACH ROW EXECUTE FUNCTION lq_layer_policy_rules();

-- (one constraint a statement: Citus takes no ALTER TABLE with several)
ALTER TABLE limit_layers DROP CONSTRAINT limit_layers_admission;
ALTER TABLE limit_layers DROP CONSTRAINT limit_layers_allowed_models_check;
ALTER TABLE limit_layers DROP CONSTRAINT limit_layers_api_key_check;
ALTER TABLE limit_layers DROP CONSTRAINT limit_layers_cache_mode;
ALTER TABLE limit_layers DROP CONSTRAINT limit_layers_cache_scope_check;
ALTER TABLE limit_layers DROP CONSTRAINT limit_layers_ceiling_check;
ALTER TABLE limit_layers DROP CONSTRAINT limit_layers_ceiling_layer_check;
ALTER TABLE limit_layers DROP CONSTRAINT limit_layers_check1;
ALTER TABLE limit_layers DROP CONSTRAINT limit_layers_check2;
ALTER TABLE limit_layers DROP CONSTRAINT limit_layers_check3;
ALTER TABLE limit_layers DROP CONSTRAINT limit_layers_failure_mode_check;
ALTER TABLE limit_layers DROP CONSTRAINT limit_layers_ladder_check;
ALTER TABLE limit_layers DROP CONSTRAINT limit_layers_lease_seconds_check;
ALTER TABLE limit_layers DROP CONSTRAINT limit_layers_max_in_flight_check;
ALTER TABLE limit_layers DROP CONSTRAINT limit_layers_output_estimate_check;
ALTER TABLE limit_layers DROP CONSTRAINT limit_layers_output_estimate_scope_check;
ALTER TABLE limit_layers DROP CONSTRAINT limit_layers_plan_check;
ALTER TABLE limit_layers DROP CONSTRAINT limit_layers_priority_check;
ALTER TABLE limit_layers DROP CONSTRAINT limit_layers_request_burst_check;
ALTER TABLE limit_layers DROP CONSTRAINT limit_layers_requests_per_minute_check;
ALTER TABLE limit_layers DROP CONSTRAINT limit_layers_route_check;
ALTER TABLE limit_layers DROP CONSTRAINT limit_layers_scope_check;
ALTER TABLE limit_layers DROP CONSTRAINT limit_layers_shard_check;
ALTER TABLE limit_layers DROP CONSTRAINT limit_layers_shared_check;
ALTER TABLE limit_layers DROP CONSTRAINT limit_layers_token_burst_check;
ALTER TABLE limit_layers DROP CONSTRAINT limit_layers_tokens_per_minute_check;
ALTER TABLE limit_layers DROP CONSTRAINT limit_layers_upstream_ceiling;
"""

# Back to 0035: the CHECKs as 0035 left them (every row already keeps them).
DOWNGRADE = r"""
SELECT set_config('citus.enable_unsafe_triggers', 'on', true);  -- as above
DROP TRIGGER limit_layers_policy_rules_on_update ON limit_layers;
DROP TRIGGER limit_layers_policy_rules_on_insert ON limit_layers;
DROP FUNCTION lq_layer_policy_rules();
ALTER TABLE limit_layers ADD CONSTRAINT limit_layers_admission
    CHECK (admission IS NULL
           OR (admission IN ('exact', 'allotted') AND scope IN ('tenant', 'route')));
ALTER TABLE limit_layers ADD CONSTRAINT limit_layers_allowed_models_check
    CHECK (allowed_models IS NULL OR scope = 'key');
ALTER TABLE limit_layers ADD CONSTRAINT limit_layers_api_key_check
    CHECK ((scope = 'key') = (api_key_id IS NOT NULL));
ALTER TABLE limit_layers ADD CONSTRAINT limit_layers_cache_mode
    CHECK (cache IS NULL OR cache ? 'mode');
ALTER TABLE limit_layers ADD CONSTRAINT limit_layers_cache_scope_check
    CHECK (cache IS NULL OR scope IN ('tenant', 'route'));
ALTER TABLE limit_layers ADD CONSTRAINT limit_layers_ceiling_check
    CHECK (ceiling ~ '^[A-Za-z0-9._:-]{1,128}$');
ALTER TABLE limit_layers ADD CONSTRAINT limit_layers_ceiling_layer_check
    CHECK ((scope = 'ceiling') = (ceiling IS NOT NULL AND model_patterns IS NOT NULL));
ALTER TABLE limit_layers ADD CONSTRAINT limit_layers_check1
    CHECK ((scope = 'route') = (route IS NOT NULL));
ALTER TABLE limit_layers ADD CONSTRAINT limit_layers_check2
    CHECK ((tokens_per_minute IS NULL) = (token_burst IS NULL));
ALTER TABLE limit_layers ADD CONSTRAINT limit_layers_check3
    CHECK ((requests_per_minute IS NULL) = (request_burst IS NULL));
ALTER TABLE limit_layers ADD CONSTRAINT limit_layers_failure_mode_check
    CHECK (failure_mode IN ('closed', 'open', 'local'));
ALTER TABLE limit_layers ADD CONSTRAINT limit_layers_ladder_check
    CHECK (NOT (cardinality(shed_above) IS DISTINCT FROM cardinality(shed_admit))
           AND NOT (cardinality(shed_above) IS DISTINCT FROM cardinality(shed_small)));
ALTER TABLE limit_layers ADD CONSTRAINT limit_layers_lease_seconds_check
    CHECK (lease_seconds >= 1 AND lease_seconds <= 86400);
ALTER TABLE limit_layers ADD CONSTRAINT limit_layers_max_in_flight_check
    CHECK (max_in_flight - in_flight_moved > 0);
ALTER TABLE limit_layers ADD CONSTRAINT limit_layers_output_estimate_check
    CHECK (output_estimate IS NULL OR output_estimate ? 'strategy');
ALTER TABLE limit_layers ADD CONSTRAINT limit_layers_output_estimate_scope_check
    CHECK (output_estimate IS NULL OR scope IN ('tenant', 'route'));
ALTER TABLE limit_layers ADD CONSTRAINT limit_layers_plan_check
    CHECK (plan IS NULL OR scope = 'tenant');
ALTER TABLE limit_layers ADD CONSTRAINT limit_layers_priority_check
    CHECK (priority >= 0 AND priority <= 3);
ALTER TABLE limit_layers ADD CONSTRAINT limit_layers_request_burst_check
    CHECK (request_burst > 0);
ALTER TABLE limit_layers ADD CONSTRAINT limit_layers_requests_per_minute_check
    CHECK (requests_per_minute > 0);
ALTER TABLE limit_layers ADD CONSTRAINT limit_layers_route_check
    CHECK (route ~ '^[A-Za-z0-9._:-]{1,128}$');
ALTER TABLE limit_layers ADD CONSTRAINT limit_layers_scope_check
    CHECK (scope IN ('global', 'tenant', 'route', 'ceiling', 'key'));
ALTER TABLE limit_layers ADD CONSTRAINT limit_layers_shard_check
    CHECK (shards BETWEEN 1 AND 64 AND shard >= 0 AND shard < shards
           AND (scope = 'global' OR shards = 1));
ALTER TABLE limit_layers ADD CONSTRAINT limit_layers_shared_check
    CHECK ((scope IN ('global', 'ceiling')) = (tenant IS NULL));
ALTER TABLE limit_layers ADD CONSTRAINT limit_layers_token_burst_check
    CHECK (token_burst > 0);
ALTER TABLE limit_layers ADD CONSTRAINT limit_layers_tokens_per_minute_check
    CHECK (tokens_per_minute > 0);
ALTER TABLE limit_layers ADD CONSTRAINT limit_layers_upstream_ceiling
    CHECK (upstream IS NULL OR scope = 'ceiling');
"""


def upgrade() -> None:
    execute_script(SCHEMA)


def downgrade() -> None:
    execute_script(DOWNGRADE)
