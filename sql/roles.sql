-- Database roles and what each may do. A repeatable script (see
-- migrations/README.md): `llmquota migrate` applies it last, whenever it or
-- any script before it changed, so every statement here can be repeated and
-- may name any table at head.
--
--   llmquota_app        the service (API, sweeper, CLI): reads and writes the
--                       admission tables; on the ledgers, the prices and the
--                       export's bookkeeping only SELECT: their rows are
--                       written by SECURITY DEFINER functions that set ids
--                       and times themselves (see ledger.sql's header).
--   llmquota_reporting  finance: reads the reporting schema and nothing else;
--                       no privilege on any admission table, and no advisory
--                       lock (it could otherwise hold the service's).
--
-- Roles belong to the whole server, not to one database: they are created
-- only if missing (many databases on one server run this), and never
-- dropped by a downgrade. They can log in but have no password: the operator
-- sets one (ALTER ROLE llmquota_reporting PASSWORD '...'), see
-- docs/operations.md. The tables stay owned by the role that runs the
-- migrations.

DO $$
DECLARE
    wanted text;
BEGIN
    FOREACH wanted IN ARRAY ARRAY['llmquota_app', 'llmquota_reporting'] LOOP
        IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = wanted) THEN
            BEGIN
                EXECUTE format('CREATE ROLE %I LOGIN', wanted);
            EXCEPTION WHEN duplicate_object OR unique_violation THEN
                NULL;  -- created meanwhile by a migration of another database
            END;
        END IF;
    END LOOP;
END
$$;

-- The service: the admission tables in full; the ledgers, the prices and the
-- export's bookkeeping read only (the REVOKEs take back what earlier
-- releases granted).
GRANT USAGE ON SCHEMA public TO llmquota_app;
GRANT SELECT, INSERT, UPDATE, DELETE ON tenants, limit_layers, reservations, api_keys, plans,
    allotments TO llmquota_app;
GRANT SELECT ON usage_ledger TO llmquota_app;
-- When each key was last used (noted at most once a minute per key per worker).
GRANT SELECT, INSERT, UPDATE, DELETE ON api_key_uses TO llmquota_app;
GRANT SELECT, INSERT, UPDATE, DELETE ON output_estimates TO llmquota_app;
GRANT SELECT, INSERT, UPDATE, DELETE ON response_cache TO llmquota_app;
REVOKE INSERT, UPDATE, DELETE, TRUNCATE ON usage_ledger FROM llmquota_app;
GRANT SELECT ON model_prices, ledger_export_positions, ledger_export_state TO llmquota_app;
-- Read by the audit (lq_audit_credit_charges finds a reservation's rows by it).
GRANT SELECT ON ledger_receipts TO llmquota_app;
REVOKE INSERT, UPDATE, DELETE, TRUNCATE ON ledger_receipts FROM llmquota_app;
REVOKE INSERT, UPDATE, DELETE, TRUNCATE ON model_prices, ledger_export_positions,
    ledger_export_state FROM llmquota_app;
GRANT SELECT ON alembic_version TO llmquota_app;
GRANT SELECT ON outage_id_key TO llmquota_app;
GRANT SELECT ON global_layer TO llmquota_app;
-- Quotas, credits and alerts. The credit ledger is append-only like the usage
-- ledger, and written the same way; delivery rows are updated by the
-- delivery loop.
GRANT SELECT, INSERT, UPDATE, DELETE ON quotas, quota_windows, credit_accounts, webhooks,
    alert_deliveries TO llmquota_app;
GRANT SELECT ON credit_ledger TO llmquota_app;
-- The console: decision counts each worker adds to (and prunes), and its
-- sessions (migration 0020).
GRANT SELECT, INSERT, UPDATE, DELETE ON decision_counts, console_sessions TO llmquota_app;
-- The provider ceilings' alert episodes, moved by every worker's detector
-- (and pruned by it) (migration 0023).
GRANT SELECT, INSERT, UPDATE, DELETE ON ceiling_alert_episodes TO llmquota_app;
-- Budget moved between cells' global slices (migration 0034), by the rebalancer.
GRANT SELECT, INSERT, UPDATE, DELETE ON budget_transfers TO llmquota_app;
GRANT SELECT, INSERT ON alert_outbox, alert_delivery_attempts TO llmquota_app;
REVOKE INSERT, UPDATE, DELETE, TRUNCATE ON credit_ledger FROM llmquota_app;
GRANT USAGE, SELECT ON ALL SEQUENCES IN SCHEMA public TO llmquota_app;
-- The ledgers' identities are the definer functions' alone: setval would let
-- the app hand out an entry_id twice (the export's positions refuse a second
-- one and stop), and nextval needs no caller but the owner's inserts.
REVOKE USAGE, UPDATE ON SEQUENCE usage_ledger_entry_id_seq, credit_ledger_entry_id_seq
    FROM llmquota_app;

-- The writers of ledger rows that other scripts own run as the owner, with
-- the search_path pinned (a definer function resolving names through the
-- caller's path could be lent the owner's rights by a planted function).
-- Done here, by name, rather than in their headers: CREATE OR REPLACE resets
-- both, and this script runs after every script that re-creates them. The
-- bodies set entry_id, xact_id and recorded_at themselves.
DO $$
DECLARE
    f regprocedure;
BEGIN
    FOR f IN SELECT p.oid::regprocedure
               FROM pg_proc AS p
              WHERE p.pronamespace = 'public'::regnamespace
                AND p.proname IN ('lq_finish', 'lq_credit_topup', 'lq_credit_apply', 'lq_cache_serve',
                                  'lq_delete_tenant')
    LOOP
        EXECUTE format('ALTER FUNCTION %s SECURITY DEFINER SET search_path = pg_catalog, public', f);
    END LOOP;
END
$$;

-- Advisory locks are the service's: the idempotency keys, the global layer's
-- policy changes, partition creation, the migrations. PostgreSQL lets PUBLIC
-- take any of them, so the read-only reporting role could hold one (policy
-- changes answered 503, migrations waited, an admission whose key it guessed
-- failed). Only the service and the owner may take one.
DO $$
DECLARE
    f regprocedure;
BEGIN
    FOR f IN SELECT p.oid::regprocedure
               FROM pg_proc AS p
              WHERE p.pronamespace = 'pg_catalog'::regnamespace
                AND p.proname LIKE 'pg\_%advisory\_%'
                -- Releasing touches only the caller's own locks, and poolers
                -- (asyncpg's reset) call pg_advisory_unlock_all for any role.
                AND p.proname NOT LIKE '%unlock%'
    LOOP
        EXECUTE format('REVOKE EXECUTE ON FUNCTION %s FROM PUBLIC', f);
        EXECUTE format('GRANT EXECUTE ON FUNCTION %s TO llmquota_app, CURRENT_USER', f);
    END LOOP;
    -- A migrating role that is not a superuser cannot revoke a built-in's
    -- privilege (PostgreSQL only warns): say so instead of seeming done.
    IF has_function_privilege('llmquota_reporting', 'pg_catalog.pg_advisory_lock(bigint)',
                              'EXECUTE') THEN
        RAISE WARNING 'llmquota_reporting can still take advisory locks; a superuser must run: REVOKE EXECUTE ON FUNCTION pg_advisory_lock(bigint) ... FROM PUBLIC (see docs/operations.md)';
    END IF;
END
$$;

-- Bounded sessions: no role's statement, lock wait or idle transaction lasts
-- forever (an idle transaction of a report held its snapshot and the
-- export's horizon back). The service sets tighter values per connection
-- (LLMQUOTA_STATEMENT_TIMEOUT_MS, LLMQUOTA_LOCK_TIMEOUT_MS); these bind a
-- session that sets none, e.g. psql with the role's password. Set only while
-- the role has no value of its own: an operator's (docs/operations.md sets
-- the app's behind PgBouncer) is kept, and the many databases of one server
-- running this do not rewrite the role each time.
DO $$
DECLARE
    wanted record;
BEGIN
    FOR wanted IN
        SELECT * FROM (VALUES
            ('llmquota_app', 'statement_timeout', '5s'),
            ('llmquota_app', 'lock_timeout', '2s'),
            ('llmquota_app', 'idle_in_transaction_session_timeout', '60s'),
            ('llmquota_reporting', 'statement_timeout', '5min'),
            ('llmquota_reporting', 'lock_timeout', '5s'),
            ('llmquota_reporting', 'idle_in_transaction_session_timeout', '60s')
        ) AS w(role_name, setting, value)
    LOOP
        IF NOT EXISTS (SELECT 1
                         FROM pg_db_role_setting AS s
                              JOIN pg_roles AS r ON r.oid = s.setrole
                              CROSS JOIN LATERAL unnest(s.setconfig) AS c(item)
                        WHERE r.rolname = wanted.role_name
                          AND s.setdatabase = 0
                          AND c.item LIKE wanted.setting || '=%') THEN
            BEGIN
                EXECUTE format('ALTER ROLE %I SET %s = %L', wanted.role_name, wanted.setting,
                               wanted.value);
            EXCEPTION WHEN insufficient_privilege THEN
                RAISE WARNING 'cannot set % of role % (needs CREATEROLE): see docs/operations.md',
                    wanted.setting, wanted.role_name;
            END;
        END IF;
    END LOOP;
END
$$;

-- Functions: nobody but the service (and the owner) runs the admission and
-- ledger functions; the SECURITY DEFINER ones would otherwise lend the
-- owner's rights to anyone who can connect.
REVOKE EXECUTE ON ALL FUNCTIONS IN SCHEMA public FROM PUBLIC;
GRANT EXECUTE ON ALL FUNCTIONS IN SCHEMA public TO llmquota_app;

-- Finance: the reporting schema, read only.
REVOKE ALL ON SCHEMA reporting FROM PUBLIC;
GRANT USAGE ON SCHEMA reporting TO llmquota_reporting;
GRANT SELECT ON ALL TABLES IN SCHEMA reporting TO llmquota_reporting;
REVOKE EXECUTE ON ALL FUNCTIONS IN SCHEMA reporting FROM PUBLIC;
GRANT EXECUTE ON ALL FUNCTIONS IN SCHEMA reporting TO llmquota_reporting;

-- The service may run the reports too (`llmquota report` with the service's
-- database URL): it is a member of the reporting role.
GRANT llmquota_reporting TO llmquota_app;

-- Archiving is the owner's job, not the service's.
REVOKE EXECUTE ON FUNCTION lq_detach_ledger_partition(date, boolean) FROM llmquota_app;
