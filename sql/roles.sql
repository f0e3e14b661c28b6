-- Database roles and what each may do. A repeatable script (see
-- migrations/README.md): `llmquota migrate` applies it last, whenever it or
-- any script before it changed, so every statement here can be repeated and
-- may name any table at head.
--
--   llmquota_app        the service (API, sweeper, CLI): reads and writes the
--                       admission tables; on the ledger only SELECT and
--                       INSERT, so it cannot change or remove a billed row.
--   llmquota_reporting  finance: reads the reporting schema and nothing else;
--                       no privilege on any admission table.
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

-- The service: the admission tables in full, the ledger append-only.
GRANT USAGE ON SCHEMA public TO llmquota_app;
GRANT SELECT, INSERT, UPDATE, DELETE ON tenants, limit_layers, reservations, api_keys
    TO llmquota_app;
GRANT SELECT, INSERT ON usage_ledger TO llmquota_app;
GRANT SELECT, INSERT, UPDATE, DELETE ON output_estimates TO llmquota_app;
REVOKE UPDATE, DELETE, TRUNCATE ON usage_ledger FROM llmquota_app;
GRANT SELECT, INSERT, UPDATE ON model_prices TO llmquota_app;
GRANT SELECT, INSERT ON ledger_export_positions TO llmquota_app;
GRANT SELECT, UPDATE ON ledger_export_state TO llmquota_app;
GRANT SELECT ON alembic_version TO llmquota_app;
GRANT SELECT ON outage_id_key TO llmquota_app;
GRANT SELECT ON global_layer TO llmquota_app;
-- Quotas, credits and alerts. The credit ledger is append-only like the usage
-- ledger; delivery rows are updated by the delivery loop.
GRANT SELECT, INSERT, UPDATE, DELETE ON quotas, quota_windows, credit_accounts, webhooks,
    alert_deliveries TO llmquota_app;
GRANT SELECT, INSERT ON credit_ledger, alert_outbox, alert_delivery_attempts TO llmquota_app;
REVOKE UPDATE, DELETE, TRUNCATE ON credit_ledger FROM llmquota_app;
GRANT USAGE, SELECT ON ALL SEQUENCES IN SCHEMA public TO llmquota_app;

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
