-- Building cells: `llmquota migrate --cells K` (store/cells.py; docs/scaling.md,
-- "Cells").
--
-- A cell is a whole copy of the schema in a schema of its own, cell_1 ...
-- cell_K, in one database. On Citus each cell is a distributed schema: every
-- table of a cell lives on one node, and a call of one of its functions is
-- sent to that node whole, so an admission is a single-node statement. Seven
-- frozen revisions name `public` or `reporting`, so a cell is migrated as
-- `public` and then renamed; the statements below do the renaming and what it
-- asks for. Named blocks, as in queries.sql.

-- cells --
-- The cells of this database, in order, with the number of cells each was
-- built one of (seal_cell writes it on the schema).
SELECT n.nspname AS cell,
       substring(obj_description(n.oid, 'pg_namespace') FROM 'one of ([0-9]+)')::integer
           AS built_for
  FROM pg_namespace AS n
 WHERE n.nspname ~ '^cell_[0-9]+$'
 ORDER BY substr(n.nspname, 6)::integer

-- public_state --
-- What `public` holds: a deployment (or is there a `reporting` schema other
-- than the one reporting_over_cells makes), the mark of a cell being built
-- in it (mark_public), the extensions installed in it; and the connection's
-- own schema.
SELECT to_regclass('public.alembic_version') IS NOT NULL
       OR (to_regnamespace('reporting') IS NOT NULL
           AND obj_description(to_regnamespace('reporting'), 'pg_namespace')
               IS DISTINCT FROM 'llmquota reporting over cells') AS deployment,
       obj_description('public'::regnamespace, 'pg_namespace') AS mark,
       ARRAY(SELECT e.extname::text FROM pg_extension AS e
              WHERE e.extnamespace = 'public'::regnamespace ORDER BY e.extname) AS extensions,
       current_schema() AS schema

-- mark_public --
-- Say on `public`, before a cell is migrated in it, which cell it is
-- becoming: a build stopped before seal_cell is then resumed, not refused.
DO $$
BEGIN
    EXECUTE format('COMMENT ON SCHEMA public IS %L',
                   format('llmquota %s of %s, being built', current_setting('llmquota.cell'),
                          current_setting('llmquota.cells')));
END
$$

-- is_citus --
-- Is this database a Citus coordinator's?
SELECT EXISTS (SELECT FROM pg_extension WHERE extname = 'citus')

-- name_the_cell --
-- The cell that mark_public and seal_cell name, and how many cells the
-- database is built for, for this transaction.
SELECT set_config('llmquota.cell', $1::text, true),
       set_config('llmquota.cells', $2::integer::text, true)

-- seal_cell --
-- Rename the freshly migrated `public` to the cell (and `reporting` to
-- cell_k_reporting), say on it how many cells it is one of, give the
-- database a new, empty `public` as PostgreSQL makes it, and hand back what
-- an extension keeps in `public` (Citus's citus_tables and citus_schemas
-- views). Then pin_cell, in the same transaction.
DO $$
DECLARE
    cell      name := current_setting('llmquota.cell');
    reporting name := cell || '_reporting';
    member    record;
BEGIN
    EXECUTE format('ALTER SCHEMA public RENAME TO %I', cell);
    EXECUTE format('ALTER SCHEMA reporting RENAME TO %I', reporting);
    EXECUTE format('COMMENT ON SCHEMA %I IS %L', cell,
                   'llmquota cell, one of ' || current_setting('llmquota.cells'));
    CREATE SCHEMA public AUTHORIZATION pg_database_owner;
    GRANT USAGE ON SCHEMA public TO PUBLIC;
    FOR member IN SELECT c.oid::regclass AS relation,
                         CASE c.relkind WHEN 'v' THEN 'VIEW' WHEN 'm' THEN 'MATERIALIZED VIEW'
                                        WHEN 'S' THEN 'SEQUENCE' ELSE 'TABLE' END AS kind
                    FROM pg_class AS c
                    JOIN pg_depend AS d ON d.classid = 'pg_class'::regclass AND d.objid = c.oid
                   WHERE c.relnamespace = cell::regnamespace AND d.deptype = 'e'
    LOOP
        EXECUTE format('ALTER %s %s SET SCHEMA public', member.kind, member.relation);
    END LOOP;
    FOR member IN SELECT p.oid::regprocedure AS routine
                    FROM pg_proc AS p
                    JOIN pg_depend AS d ON d.classid = 'pg_proc'::regclass AND d.objid = p.oid
                   WHERE p.pronamespace = cell::regnamespace AND d.deptype = 'e'
    LOOP
        EXECUTE format('ALTER ROUTINE %s SET SCHEMA public', member.routine);
    END LOOP;
END
$$

-- pin_cell --
-- Pin the cell's functions to it (after seal_cell, and after an upgrade in
-- place has made some of them again; every step can run again): a function
-- that named `public` in its search_path now names the cell, and
-- so does every PL/pgSQL or volatile SQL function, so that it resolves names
-- in the cell whatever the caller's path (on Citus it runs on the cell's
-- node, under that node's). Stable and immutable SQL functions (the refill
-- arithmetic, the tenant's shard) stay unpinned: a pin keeps the planner
-- from inlining a function into the statement that calls it, and those it
-- can inline are then that statement, resolved under its function's pin.
-- But not one that calls another function of ours (lq_...): where it is not
-- inlined (a conflict clause Citus runs on a worker) it would look that name
-- up under the worker's path, and not find it. (On Citus a SQL function
-- that reads a table is refused inside another statement either way:
-- lq_batch_layers and the audit's checks are PL/pgSQL for that.)
-- On Citus, the functions that force generic plans stop doing so: Citus
-- cannot plan a statement with parameters generically.
DO $$
DECLARE
    cell      name := current_setting('llmquota.cell');
    reporting name := cell || '_reporting';
    citus     boolean := EXISTS (SELECT FROM pg_extension WHERE extname = 'citus');
    f         record;
BEGIN
    FOR f IN SELECT p.oid::regprocedure AS routine, l.lanname AS language,
                    EXISTS (SELECT FROM unnest(p.proconfig) AS c(setting)
                             WHERE c.setting LIKE 'search_path=%') AS pinned,
                    EXISTS (SELECT FROM unnest(p.proconfig) AS c(setting)
                             WHERE c.setting LIKE 'plan_cache_mode=%') AS generic,
                    p.provolatile = 'v' AS volatile,
                    p.prosrc ~ '\mlq_\w+\s*\(' AS calls_ours
               FROM pg_proc AS p
               JOIN pg_language AS l ON l.oid = p.prolang
              WHERE p.pronamespace = cell::regnamespace AND p.prokind = 'f'
    LOOP
        IF f.pinned OR f.language <> 'sql' OR f.volatile OR f.calls_ours THEN
            EXECUTE format('ALTER FUNCTION %s SET search_path = pg_catalog, %I', f.routine, cell);
        END IF;
        IF citus AND f.generic THEN
            EXECUTE format('ALTER FUNCTION %s RESET plan_cache_mode', f.routine);
        END IF;
    END LOOP;
    -- The finance reports name `reporting` and `public` in their bodies
    -- (views bind what they read when made, and followed the renames;
    -- functions read their text at each call): each is made again naming
    -- the cell's schemas.
    FOR f IN SELECT p.oid, l.lanname = 'sql' AND p.proretset AS report
               FROM pg_proc AS p
               JOIN pg_language AS l ON l.oid = p.prolang
              WHERE p.pronamespace = reporting::regnamespace AND p.prokind = 'f'
    LOOP
        EXECUTE regexp_replace(regexp_replace(pg_get_functiondef(f.oid),
                                              '\mreporting\.', reporting || '.', 'g'),
                               '\mpublic\.', cell || '.', 'g');
        -- Citus plans no SQL function over distributed tables called with
        -- parameters: there a report is the same query in PL/pgSQL. And a
        -- worker runs its part as the session's role, which a view's owner
        -- rights do not reach: it runs as its owner, as the views do.
        IF citus AND f.report THEN
            EXECUTE format('CREATE OR REPLACE FUNCTION %s(%s) RETURNS %s LANGUAGE plpgsql '
                           'STABLE SECURITY DEFINER SET search_path = pg_catalog, %I, %I AS %L',
                           f.oid::regproc, pg_get_function_arguments(f.oid),
                           pg_get_function_result(f.oid), cell, reporting,
                           E'#variable_conflict use_column\nBEGIN\nRETURN QUERY '
                           || rtrim((SELECT p.prosrc FROM pg_proc AS p WHERE p.oid = f.oid),
                                    E' \n;')
                           || E';\nEND');
        END IF;
    END LOOP;
    -- Each view's rows, read as the view's owner: what the reporting schema
    -- over the cells reads (reporting_over_cells). On Citus a worker checks
    -- the session's role against the tables under a view; a function of the
    -- owner's is how the read-only role reads them there.
    FOR f IN SELECT c.relname AS name FROM pg_class AS c
              WHERE c.relnamespace = reporting::regnamespace AND c.relkind = 'v'
    LOOP
        EXECUTE format('CREATE OR REPLACE FUNCTION %I.%I() RETURNS SETOF %I.%I LANGUAGE sql STABLE '
                       'SECURITY DEFINER SET search_path = pg_catalog AS %L',
                       reporting, 'rows_of_' || f.name, reporting, f.name,
                       format('SELECT * FROM %I.%I', reporting, f.name));
        EXECUTE format('REVOKE EXECUTE ON FUNCTION %I.%I() FROM PUBLIC', reporting,
                       'rows_of_' || f.name);
        EXECUTE format('GRANT EXECUTE ON FUNCTION %I.%I() TO llmquota_reporting, llmquota_app',
                       reporting, 'rows_of_' || f.name);
    END LOOP;
    -- A month's ledger partition is a table of the cell, which Citus
    -- distributes when it is made, triggers and all (distribute_schema).
    IF citus THEN
        EXECUTE format('ALTER FUNCTION %I.lq_create_ledger_partition(date) '
                       'SET citus.enable_unsafe_triggers = on', cell);
    END IF;
END
$$

-- stamp_ledger_rows_on_their_node --
-- On Citus, each ledger row of the cell carries the id of the transaction
-- that wrote it on the cell's node, whoever sent the INSERT. The column's
-- default, pg_current_xact_id(), is not enough there: a statement the
-- coordinator plans itself (a function call Citus does not delegate, as
-- inside a transaction block) has its defaults evaluated on the
-- coordinator, whose transaction ids are another count than the node's.
-- The billing export's horizon is the node's (lq_export_ledger, ledger.sql),
-- so such a row could be numbered after rows that committed later, or,
-- once the node's ids had run past the coordinator's, never. A trigger runs
-- where the row is stored, in the node's own transaction, so the ids every
-- row carries and the horizon the export takes are of one count. Made on
-- every build (CREATE OR REPLACE), so a cell built before it gains it.
DO $$
DECLARE
    cell name := current_setting('llmquota.cell');
BEGIN
    PERFORM set_config('citus.enable_unsafe_triggers', 'on', true);
    EXECUTE format('CREATE OR REPLACE FUNCTION %I.lq_ledger_stamp_xact() RETURNS trigger '
                   'LANGUAGE plpgsql SET search_path = pg_catalog AS %L', cell,
                   E'BEGIN\n    NEW.xact_id := pg_current_xact_id();\n    RETURN NEW;\nEND');
    EXECUTE format('CREATE OR REPLACE TRIGGER usage_ledger_xact BEFORE INSERT ON %I.usage_ledger '
                   'FOR EACH ROW EXECUTE FUNCTION %I.lq_ledger_stamp_xact()', cell, cell);
END
$$

-- distribute_schema --
-- Make the cell a distributed schema (Citus): each of its tables a
-- single-shard table, all on one node. Its triggers (the ledger's append-only
-- guard, its receipts, change notices) then run on that node, beside the
-- rows they guard, which is what citus.enable_unsafe_triggers allows.
SELECT set_config('citus.enable_unsafe_triggers', 'on', true),
       citus_schema_distribute($1::regnamespace)

-- cell_functions --
-- The cell's functions, as CREATE statements, in the order they were made (a
-- function's argument types and callees exist before it). Executed again on
-- the coordinator once the schema is distributed, each is created on its
-- node too. Then each pinned function is delegated (an unpinned one is only
-- ever part of its caller's statement, and its body names what only the
-- caller's pin finds), but for two kinds: a trigger's, which runs where its
-- table is, and the ledger's partition functions, which change the schema
-- (a worker refuses DDL: Citus runs it from the coordinator).
SELECT p.oid::regprocedure::text AS signature,
       pg_get_functiondef(p.oid) AS definition,
       p.prorettype <> 'trigger'::regtype
       AND p.proname NOT IN ('lq_ensure_ledger_partitions', 'lq_create_ledger_partition',
                             'lq_detach_ledger_partition')
       AND EXISTS (SELECT FROM unnest(p.proconfig) AS c(setting)
                    WHERE c.setting LIKE 'search_path=%') AS delegated
  FROM pg_proc AS p
 WHERE p.pronamespace = $1::regnamespace AND p.prokind = 'f'
 ORDER BY p.oid

-- is_distributed --
-- Is the cell a distributed schema (Citus)?
SELECT EXISTS (SELECT FROM pg_dist_schema WHERE schemaid = $1::regnamespace)

-- citus_cell_complete --
-- Is the cell a distributed schema whose functions are all delegated
-- ($2: how many cell_functions says are)? An interrupted build is not.
SELECT EXISTS (SELECT FROM pg_dist_schema WHERE schemaid = $1::regnamespace)
       AND (SELECT count(*) FROM pg_dist_object AS o
              JOIN pg_proc AS p ON o.classid = 'pg_proc'::regclass AND o.objid = p.oid
             WHERE p.pronamespace = $1::regnamespace AND o.colocationid IS NOT NULL) = $2::bigint

-- delegate_function --
-- Send each call of this function from the coordinator to the node of the
-- cell's tables, where it runs whole (Citus: create_distributed_function,
-- co-located with the cell's limit layers, no distribution argument).
SELECT create_distributed_function($1::regprocedure, colocate_with := $2::text)

-- cell_node --
-- The Citus node that holds the tables of cell $1 (NULL: of the schema this
-- session works in); no row for a schema that is not distributed.
SELECT n.nodename, n.nodeport
  FROM pg_dist_shard AS s
  JOIN pg_dist_placement AS p USING (shardid)
  JOIN pg_dist_node AS n ON n.groupid = p.groupid
 WHERE s.logicalrelid = to_regclass(quote_ident(coalesce($1::text, current_schema()))
                                    || '.limit_layers')

-- drop_reporting_over_cells --
-- Before a cell is migrated as `public` (its migrations make a `reporting`
-- schema, renamed with it), the one reporting_over_cells made goes; the end
-- of the build makes it again.
DO $$
BEGIN
    IF obj_description(to_regnamespace('reporting'), 'pg_namespace')
       = 'llmquota reporting over cells' THEN
        DROP SCHEMA reporting CASCADE;
    END IF;
END
$$

-- reporting_refused --
-- What the last reporting_over_cells of this session could not bring up to
-- date (a line each; empty or NULL: nothing).
SELECT current_setting('llmquota.reporting_refused', true)

-- reporting_over_cells --
-- A `reporting` schema for the whole database of cells, made (or brought up
-- to date, in place) at the end of every build. Each of its report
-- functions and views reads the cell of the session that calls it (a DSN
-- whose search_path names cell_k reads cell_k_reporting), so what names
-- `reporting` (finance's SQL, the console's top tenants, the
-- oversubscription endpoint) works in each cell as it does in one
-- deployment. Outside a cell it refuses with where to go instead.
-- Made from cell_1_reporting's catalog: the cells are alike. A view's rows
-- come through a function (a view cannot choose its table per session), so
-- a filter on it is not pushed into the cell's view; the report functions
-- call the cell's own, which are.
-- In place on every build of existing cells, upgrades included: what
-- finance built on it (a view over a report) is kept. A report whose result
-- changed cannot be replaced: it alone is dropped and made again; one the
-- cells no longer have is dropped. A drop that something of finance's
-- stands on is refused and that report left as it was, the rest brought up
-- to date: the refusals, one a line, are left in the session's setting
-- llmquota.reporting_refused for the build to report (store/cells.py).
DO $build$
DECLARE
    f record;
    made text;
    refused text[] := '{}';
    why text;
BEGIN
    -- On Citus these live on the coordinator alone, where reports run: Citus
    -- would otherwise make them objects of every node, and refuses to
    -- replace a function whose view others build on ("circular dependency").
    IF EXISTS (SELECT FROM pg_extension WHERE extname = 'citus') THEN
        PERFORM set_config('citus.enable_ddl_propagation', 'off', true);
    END IF;
    -- One drop: NULL once done, else why it was refused (what stands on it).
    CREATE OR REPLACE FUNCTION pg_temp.drop_unless_used(statement text) RETURNS text
    LANGUAGE plpgsql
    AS $f$
    DECLARE
        why text;
        detail text;
    BEGIN
        EXECUTE statement;
        RETURN NULL;
    EXCEPTION WHEN dependent_objects_still_exist THEN
        GET STACKED DIAGNOSTICS why = MESSAGE_TEXT, detail = PG_EXCEPTION_DETAIL;
        RETURN format('%s (%s)', why, replace(detail, E'\n', '; '));
    END
    $f$;
    CREATE SCHEMA IF NOT EXISTS reporting;
    COMMENT ON SCHEMA reporting IS 'llmquota reporting over cells';
    GRANT USAGE ON SCHEMA reporting TO llmquota_reporting, llmquota_app;
    CREATE OR REPLACE FUNCTION reporting.session_reports() RETURNS text
    LANGUAGE plpgsql STABLE
    AS $f$
    BEGIN
        IF current_schema() ~ '^cell_[0-9]+$' THEN
            RETURN quote_ident(current_schema() || '_reporting');
        END IF;
        RAISE EXCEPTION USING ERRCODE = 'invalid_schema_name',
              MESSAGE = 'reporting in a database of cells reads one cell: connect with '
                        'search_path=cell_k',
              HINT = '`llmquota report` at the database''s own DSN runs a report in every '
                     'cell and merges them';
    END
    $f$;
    COMMENT ON FUNCTION reporting.session_reports() IS
        'the reporting schema of the session''s cell (search_path=cell_k)';
    -- The views below are read only, as the cells' are: a write is refused
    -- for want of the privilege (the trigger makes PostgreSQL check it, and
    -- refuses the owner too).
    CREATE OR REPLACE FUNCTION reporting.read_only() RETURNS trigger
    LANGUAGE plpgsql
    AS $f$
    BEGIN
        RAISE EXCEPTION USING ERRCODE = 'insufficient_privilege',
              MESSAGE = format('reporting.%s is read only', TG_TABLE_NAME);
    END
    $f$;
    FOR f IN SELECT p.oid, p.proname AS name, pg_get_function_arguments(p.oid) AS arguments,
                    pg_get_function_identity_arguments(p.oid) AS identity,
                    pg_get_function_result(p.oid) AS result,
                    (SELECT string_agg('$' || i, ', ' ORDER BY i)
                       FROM generate_series(1, p.pronargs) AS i) AS parameters,
                    (SELECT string_agg('%L::' || format_type(t.type, NULL), ', '
                                       ORDER BY t.i)
                       FROM unnest(p.proargtypes::oid[]) WITH ORDINALITY AS t(type, i))
                        AS literals
               FROM pg_proc AS p
              WHERE p.pronamespace = 'cell_1_reporting'::regnamespace AND p.prokind = 'f'
                AND p.proretset AND p.proname NOT LIKE 'rows\_of\_%'
    LOOP
        -- The arguments are written into the call as literals: Citus plans no
        -- SQL function over distributed tables called with parameters.
        made := format('CREATE OR REPLACE FUNCTION reporting.%I(%s) RETURNS %s LANGUAGE plpgsql '
                       'STABLE AS $f$ BEGIN RETURN QUERY EXECUTE format(%L, '
                       'reporting.session_reports()%s); END $f$',
                       f.name, f.arguments, f.result,
                       format('SELECT * FROM %%s.%I(%s)', f.name, f.literals),
                       coalesce(', ' || f.parameters, ''));
        BEGIN
            EXECUTE made;
        EXCEPTION WHEN invalid_function_definition THEN  -- its result changed
            why := pg_temp.drop_unless_used(
                format('DROP FUNCTION reporting.%I(%s)', f.name, f.identity));
            IF why IS NOT NULL THEN
                refused := refused || why;
                CONTINUE;
            END IF;
            EXECUTE made;
        END;
        EXECUTE format('COMMENT ON FUNCTION reporting.%I(%s) IS %L', f.name, f.identity,
                       obj_description(f.oid, 'pg_proc'));
    END LOOP;
    FOR f IN SELECT c.oid, c.relname AS name
               FROM pg_class AS c
              WHERE c.relnamespace = 'cell_1_reporting'::regnamespace AND c.relkind = 'v'
    LOOP
        EXECUTE format('CREATE OR REPLACE FUNCTION reporting.%I() '
                       'RETURNS SETOF cell_1_reporting.%I '
                       'LANGUAGE plpgsql STABLE AS $f$ BEGIN RETURN QUERY EXECUTE '
                       'format(%L, reporting.session_reports()); END $f$',
                       'rows_of_' || f.name, f.name,
                       format('SELECT * FROM %%s.%I()', 'rows_of_' || f.name));
        made := format('CREATE OR REPLACE VIEW reporting.%I AS SELECT * FROM reporting.%I()',
                       f.name, 'rows_of_' || f.name);
        BEGIN
            EXECUTE made;
        EXCEPTION WHEN invalid_table_definition THEN  -- a column changed or went
            why := pg_temp.drop_unless_used(format('DROP VIEW reporting.%I', f.name));
            IF why IS NOT NULL THEN
                refused := refused || why;
                CONTINUE;
            END IF;
            EXECUTE made;
        END;
        EXECUTE format('COMMENT ON VIEW reporting.%I IS %L', f.name,
                       obj_description(f.oid, 'pg_class'));
        EXECUTE format('CREATE OR REPLACE TRIGGER read_only INSTEAD OF INSERT OR UPDATE OR DELETE '
                       'ON reporting.%I FOR EACH ROW EXECUTE FUNCTION reporting.read_only()',
                       f.name);
    END LOOP;
    -- What the cells no longer have: views first, then the functions under them;
    -- only what this block made (its views are read only by its trigger, its
    -- functions call session_reports), never an object finance put here.
    FOR f IN SELECT c.relname AS name
               FROM pg_class AS c
              WHERE c.relnamespace = 'reporting'::regnamespace AND c.relkind = 'v'
                AND to_regclass(format('cell_1_reporting.%I', c.relname)) IS NULL
                AND EXISTS (SELECT FROM pg_trigger AS t
                             WHERE t.tgrelid = c.oid AND t.tgname = 'read_only')
    LOOP  -- (a drop done adds NULL, which array_to_string below leaves out)
        refused := refused || pg_temp.drop_unless_used(format('DROP VIEW reporting.%I', f.name));
    END LOOP;
    FOR f IN SELECT p.oid::regprocedure AS routine
               FROM pg_proc AS p
              WHERE p.pronamespace = 'reporting'::regnamespace
                AND p.prosrc LIKE '%reporting.session_reports()%'
                AND NOT EXISTS (
                    SELECT FROM pg_proc AS q
                     WHERE q.pronamespace = 'cell_1_reporting'::regnamespace
                       AND q.proname = p.proname AND q.prokind = 'f' AND q.proretset
                       AND pg_get_function_identity_arguments(q.oid)
                           = pg_get_function_identity_arguments(p.oid))
                AND NOT (p.proname LIKE 'rows\_of\_%' AND to_regclass(
                    format('cell_1_reporting.%I', substr(p.proname, 9))) IS NOT NULL)
    LOOP
        refused := refused || pg_temp.drop_unless_used(format('DROP FUNCTION %s', f.routine));
    END LOOP;
    GRANT SELECT ON ALL TABLES IN SCHEMA reporting TO llmquota_reporting, llmquota_app;
    PERFORM set_config('llmquota.reporting_refused', array_to_string(refused, E'\n'), false);
    DROP FUNCTION pg_temp.drop_unless_used(text);
END
$build$
