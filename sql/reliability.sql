-- Reliability: recording what workers admitted on their own during a store
-- outage, and the audit that recomputes the books from the journal.
--
-- Same locking discipline as admission.sql: advisory idempotency locks, then
-- reservation rows (id order), then limit_layers rows (layer_id order).
-- Time comes from the database clock alone.


-- Record a batch of reservations that workers admitted during an outage
-- (failure mode open or local), exactly once per reservation_id.
--
-- The worker generated each reservation_id itself and journaled it; it calls
-- this when the store answers again, and may call it more than once for the
-- same ids (a crash between commit and forgetting its journal, a spool file
-- replayed by another worker). The reservation_id is the idempotency anchor:
-- a second call finds the row and changes nothing.
--
-- A recorded reservation is an ordinary active reservation from then on,
-- holding on every layer lq_admit would have reserved it on, so that its
-- settlement (lq_finish, or lq_finish_outage for a settle journaled too)
-- bills it like any other:
--   - limit layers: global, tenant, route, the API key's (p_key_ids: the key
--     that asked, NULL: none), and every provider ceiling whose
--     models match (the provider counted this usage too). Each gets its
--     reserved tokens, the requests it counts as and its permit (the route's
--     or tenant's request_cost and uses_concurrency), with no limit check: the
--     work was already admitted, and a balance may go negative, to be repaid
--     by refill, exactly like a settlement that used more than it reserved;
--     a shared layer (global or ceiling) never below minus its burst, which
--     lq_credit_layers enforces for every debit;
--   - calendar quotas (lq_matching_quotas): the reserved tokens and maximum
--     cost, in the window holding the journaled admission time;
--   - a prepaid balance (a prepaid tenant layer): its maximum cost held, so
--     the balance may end below zero by what was used; the next admission is
--     then refused (402) until a top-up.
-- created_at is the journaled admission time (p_admitted_at, the worker's
-- clock: the only one there was; never later than the database clock, NULL
-- for a journal written before it was recorded: now). The lease starts now.
--
-- recorded per request: true when this call wrote it, false when it existed.
-- p_admitted_at is new: the old signature goes first.
DROP FUNCTION IF EXISTS lq_record_outage_admissions(uuid[], text[], text[], text[], bigint[],
    bigint[], boolean[], integer[], text[], text[], bigint[], text[]);
-- p_key_ids was added (limits per API key).
DROP FUNCTION IF EXISTS lq_record_outage_admissions(uuid[], text[], text[], text[], bigint[],
    bigint[], boolean[], integer[], text[], text[], bigint[], text[], timestamptz[]);
CREATE OR REPLACE FUNCTION lq_record_outage_admissions(
    p_ids              uuid[],
    p_tenants          text[],
    p_routes           text[],
    p_models           text[],
    p_input_tokens     bigint[],
    p_max_tokens       bigint[],
    p_input_estimated  boolean[],
    p_lease_seconds    integer[],
    p_idempotency_keys text[],
    p_request_hashes   text[],
    p_policy_versions  bigint[],
    p_modes            text[],
    p_admitted_at      timestamptz[],
    p_key_ids          bigint[] DEFAULT NULL
) RETURNS TABLE (ord integer, recorded boolean)
LANGUAGE plpgsql
AS $$
DECLARE
    n          integer := coalesce(cardinality(p_ids), 0);
    now_ts     timestamptz;
    inserted   uuid[];
    b          record;
    quota_sets text[] := '{}';
    costs      numeric[] := '{}';
    held       record;
    credits    record;
BEGIN
    IF n = 0 THEN
        RETURN;
    END IF;

    -- (1) The idempotency keys, locked exactly as lq_admit locks them, so no
    -- admission can take a key between our check below and our insert.
    PERFORM lq_lock_idempotency_keys(p_tenants, p_idempotency_keys);
    -- (1b) No global policy change meanwhile (lq_put_global holds this lock
    -- exclusively): the global rows placed below are still there when they
    -- are debited, and a change that follows moves these reservations too.
    PERFORM pg_advisory_xact_lock_shared(hashtextextended('llmquota.global_layer', 0));

    now_ts := clock_timestamp();

    -- (2a) What each request holds, worked out first: its quotas and its
    -- maximum cost one statement each, then its layers (as lq_admit would
    -- reserve it on) and what one call of it counts as. Citus runs no
    -- function that reads tables inside a statement on a cell's tables, and
    -- deparses an INSERT whose SELECT reads them into an invalid statement on
    -- a schema's single-shard table. (Arrays of arrays travel as the text of
    -- each: an array of arrays must be rectangular.)
    FOR i IN 1 .. n LOOP
        quota_sets[i] := ARRAY(SELECT q.quota_id
                                 FROM lq_matching_quotas(p_tenants[i], p_routes[i], p_models[i],
                                                         p_key_ids[i]) AS q)::text;
        costs[i] := lq_cost(p_models[i], p_input_tokens[i], p_max_tokens[i],
                            least(coalesce(p_admitted_at[i], now_ts), now_ts));
    END LOOP;
    SELECT array_agg(x.layer_ids ORDER BY x.ord) AS layer_ids,
           array_agg(x.prepaid ORDER BY x.ord) AS prepaid,
           array_agg(x.lease_seconds ORDER BY x.ord) AS lease_seconds,
           array_agg(x.request_cost ORDER BY x.ord) AS request_cost,
           array_agg(x.permits ORDER BY x.ord) AS permits,
           array_agg(x.key_held ORDER BY x.ord) AS key_held
      INTO held
      FROM (SELECT u.ord,
                   ARRAY(SELECT l.layer_id
                           FROM limit_layers AS l
                          WHERE (l.scope = 'global' AND l.tenant IS NULL AND l.route IS NULL
                                 AND l.shard = lq_tenant_shard(u.tenant, l.shards))
                             OR (l.scope = 'tenant' AND l.tenant = u.tenant AND l.route IS NULL)
                             OR (l.scope = 'route' AND l.tenant = u.tenant AND l.route = u.route)
                             OR (l.scope = 'key' AND l.api_key_id = u.key_id)
                             OR (l.scope = 'ceiling' AND u.model LIKE ANY (l.model_patterns))
                          ORDER BY l.layer_id)::text AS layer_ids,
                   coalesce(tl.prepaid, false) AS prepaid,
                   coalesce(u.lease, rl.lease_seconds, tl.lease_seconds, 120) AS lease_seconds,
                   -- what one call counts as, as lq_admit decides it: the route's,
                   -- else the tenant's, else one request and one permit
                   coalesce(rl.request_cost, tl.request_cost, 1) AS request_cost,
                   CASE WHEN coalesce(rl.uses_concurrency, tl.uses_concurrency, true)
                        THEN 1 ELSE 0 END AS permits,
                   -- does another reservation hold the idempotency key already?
                   holder.reservation_id IS NOT NULL AS key_held
              FROM unnest(p_tenants, p_routes, p_models, p_key_ids, p_lease_seconds,
                          p_idempotency_keys) WITH ORDINALITY
                   AS u(tenant, route, model, key_id, lease, idem, ord)
                   LEFT JOIN limit_layers AS tl
                     ON tl.scope = 'tenant' AND tl.tenant = u.tenant AND tl.route IS NULL
                   LEFT JOIN limit_layers AS rl
                     ON rl.scope = 'route' AND rl.tenant = u.tenant AND rl.route = u.route
                   LEFT JOIN reservations AS holder
                     ON holder.tenant = u.tenant AND holder.idempotency_key = u.idem) AS x;

    -- (2) Insert the reservations in id order (two workers replaying the same
    -- spool insert the same ids in the same order, so the second waits for
    -- the first instead of deadlocking), each belonging to the layers and
    -- quotas that exist for it now. ON CONFLICT on the id makes a replay a
    -- no-op. An idempotency key some other reservation already holds is
    -- dropped rather than let the unique index refuse the row: usage is never
    -- lost for the sake of a key.
    WITH req AS (
        SELECT u.*,
               least(coalesce(u.admitted_at, now_ts), now_ts) AS at,
               row_number() OVER (PARTITION BY u.tenant, u.idem ORDER BY u.id) AS key_rank
          FROM unnest(p_ids, p_tenants, p_routes, p_models, p_input_tokens, p_max_tokens,
                      p_input_estimated, p_idempotency_keys, p_request_hashes,
                      p_policy_versions, p_modes, p_admitted_at, quota_sets, costs,
                      held.layer_ids, held.prepaid, held.lease_seconds, held.request_cost,
                      held.permits, held.key_held)
               AS u(id, tenant, route, model, input_tokens, max_tokens, input_estimated,
                    idem, request_hash, policy_version, mode, admitted_at, quota_set, money,
                    layer_set, prepaid, lease_seconds, request_cost, permits, key_held)
    ), ins AS (
        INSERT INTO reservations (reservation_id, tenant, route, model, layer_ids,
                                  input_tokens, input_estimated, max_tokens, reserved_tokens,
                                  policy_version, created_at, lease_seconds, lease_expires_at,
                                  idempotency_key, request_hash, outage_mode, quota_ids,
                                  reserved_cost, credit_reserved, request_cost, permits)
        SELECT p.id, p.tenant, p.route, p.model, p.layer_set::bigint[],
               p.input_tokens, p.input_estimated, p.max_tokens, p.input_tokens + p.max_tokens,
               p.policy_version, p.at, p.lease_seconds,
               now_ts + make_interval(secs => p.lease_seconds),
               CASE WHEN p.idem IS NOT NULL AND p.key_rank = 1 AND NOT p.key_held
                    THEN p.idem END,
               p.request_hash, p.mode, p.quota_set::bigint[], p.money,
               -- an unpriced model holds nothing; lq_finish then charges 0
               CASE WHEN p.prepaid THEN coalesce(p.money, 0) END,
               p.request_cost, p.permits
          FROM req AS p
         ORDER BY p.id
        ON CONFLICT (reservation_id) DO NOTHING
        RETURNING reservation_id
    )
    SELECT array_agg(ins.reservation_id) INTO inserted FROM ins;

    IF inserted IS NULL THEN
        RETURN QUERY
        SELECT o.i::integer, false FROM generate_series(1, n) AS o(i);
        RETURN;
    END IF;

    -- (3) Debit the layers of the rows written now (and only those): tokens,
    -- the requests each counts as and its permit (request_cost, permits).
    -- lq_credit_layers locks the layers in layer_id order, after the
    -- reservation rows above.
    -- (Read, then credited: Citus runs no function that reads tables inside
    -- a statement on a cell's tables.)
    SELECT array_agg(l.layer_id) AS layer_ids,
           array_agg(-rs.reserved_tokens::double precision) AS tokens,
           array_agg(-rs.request_cost::double precision) AS requests,
           array_agg(-rs.permits::integer) AS permits
      INTO credits
      FROM reservations AS rs
           CROSS JOIN LATERAL unnest(rs.layer_ids) AS l(layer_id)
     WHERE rs.reservation_id = ANY (inserted);
    PERFORM lq_credit_layers(credits.layer_ids, credits.tokens, credits.requests,
                             credits.permits);

    -- (4) The quota windows and prepaid balances, in the lock order of
    -- quotas.sql (windows by quota and window start, then accounts by
    -- tenant), as lq_admit reserves them; alerts for the thresholds the
    -- reservation crosses fire in the window of the admission, once.
    FOR b IN SELECT rs.created_at, rs.reserved_tokens, rs.reserved_cost, q.qid
               FROM reservations AS rs
                    CROSS JOIN LATERAL unnest(rs.quota_ids) AS q(qid)
              WHERE rs.reservation_id = ANY (inserted)
                AND EXISTS (SELECT 1 FROM quotas AS x WHERE x.quota_id = q.qid)
              ORDER BY q.qid, rs.created_at, rs.reservation_id LOOP
        PERFORM lq_quota_apply(b.qid, b.created_at, b.reserved_tokens, 0,
                               coalesce(b.reserved_cost, 0), 0);
    END LOOP;
    FOR b IN SELECT rs.tenant, sum(rs.credit_reserved) AS held
               FROM reservations AS rs
              WHERE rs.reservation_id = ANY (inserted) AND rs.credit_reserved IS NOT NULL
              GROUP BY rs.tenant
              ORDER BY rs.tenant LOOP
        PERFORM lq_credit_apply(b.tenant, NULL, b.held, NULL);
    END LOOP;

    RETURN QUERY
    SELECT o.i::integer, p_ids[o.i] = ANY (inserted)
      FROM generate_series(1, n) AS o(i);
END
$$;


-- Settle or release reservations recorded from an outage journal, at the
-- moment the journal says the usage happened (p_used_at, the worker's clock
-- at the settle), then exactly as lq_finish does anything else.
--
-- The moment is written to usage_at of each outage reservation not settled
-- yet (never later than the database clock, never before its admission), and
-- lq_finish charges its quotas in the window holding it and prices it then:
-- a journal replayed after midnight still charges yesterday's daily quota,
-- and fires that window's alerts, once (alert_outbox_once). A replay of a
-- settlement that already happened changes nothing (the row is no longer
-- active; lq_finish answers 'replayed'). The reservations are locked in id
-- order first, as lq_finish locks them, so this adds no lock of its own.
--
-- The result is lq_finish's: lq_finish_result rows (migration 0032).
--
-- Serving path: the ledger rows get lq_finish's rule, the reservation's
-- journaled path else primary. A failure mode admits only the requested
-- model (admission/fallback.py) and lq_record_outage_admissions journals no
-- path, so these rows say primary: a request that waited for room before a
-- failure mode admitted it, or that the proxy handed to a second deployment
-- during the outage, is not told apart (docs/operations.md).
DROP FUNCTION IF EXISTS lq_finish_outage(uuid[], text[], text[], bigint[], bigint[], text[],
    timestamptz[]);
CREATE OR REPLACE FUNCTION lq_finish_outage(
    p_ids           uuid[],
    p_actions       text[],
    p_callers       text[],
    p_input_tokens  bigint[],
    p_output_tokens bigint[],
    p_outcomes      text[],
    p_used_at       timestamptz[]
) RETURNS SETOF lq_finish_result
LANGUAGE plpgsql
AS $$
DECLARE
    now_ts timestamptz;
BEGIN
    PERFORM 1 FROM reservations AS rs
      WHERE rs.reservation_id = ANY (p_ids)
      ORDER BY rs.reservation_id
        FOR UPDATE;
    now_ts := clock_timestamp();
    UPDATE reservations AS rs
       SET usage_at = greatest(least(u.used_at, now_ts), rs.created_at)
      FROM unnest(p_ids, p_callers, p_used_at) AS u(id, caller, used_at)
     WHERE rs.reservation_id = u.id
       AND rs.state IN ('active', 'expired')   -- expired: a late settle, charged at it too
       AND rs.charged_tokens IS NULL
       AND rs.outage_mode IS NOT NULL
       AND u.used_at IS NOT NULL
       AND (u.caller IS NULL OR u.caller = rs.tenant);
    RETURN QUERY
    SELECT * FROM lq_finish(p_ids, p_actions, p_callers, p_input_tokens, p_output_tokens,
                            p_outcomes);
END
$$;


-- The audit's check of relayed output (issue 20): a reservation whose output
-- the proxy relayed to its client (reservations.relayed_at, marked by the
-- heartbeat at the first relayed text) must end with its usage in the ledger.
-- One row per reservation that is finished (settled, expired or released)
-- yet whose ledger rows ('usage' and 'late') hold no output token: expected
-- at least 1, actual 0. A stream that lost its lease shows here until its
-- late settle lands; a settle journaled during an outage, until the journal
-- is replayed.
CREATE OR REPLACE FUNCTION lq_audit_relayed()
RETURNS TABLE (check_name text, subject text, expected bigint, actual bigint)
LANGUAGE plpgsql STABLE
AS $$
#variable_conflict use_column
BEGIN
    RETURN QUERY
    SELECT 'relayed_output', rs.reservation_id::text, 1::bigint,
           coalesce(sum(g.output_tokens), 0)::bigint
      FROM reservations AS rs
      LEFT JOIN usage_ledger AS g
             ON g.reservation_id = rs.reservation_id
            AND g.entry_kind IN ('usage', 'late')
            AND g.recorded_at >= rs.created_at
     WHERE rs.relayed_at IS NOT NULL
       AND rs.state <> 'active'
     GROUP BY rs.reservation_id
    HAVING coalesce(sum(g.output_tokens), 0) = 0;
END
$$;


-- The audit: recompute the books from the journal (reservations, the usage
-- ledger, the credit ledger) and return one row per discrepancy; no row
-- means no drift.
--
-- Each check is one function lq_audit_<what>() returning rows of
-- (check_name, subject, expected, actual), and lq_audit() is their list: a
-- new check is one function here and one RETURN QUERY line in lq_audit.
-- Every check is STABLE, and so is lq_audit, so the whole report reads the
-- snapshot of the one query that calls it: it is consistent even while
-- admissions and settlements run. Money is compared exactly (numeric) and
-- shown in millionths of the currency.
--
--   in_flight              a layer's in_flight counter against the active
--                          reservations that hold a permit on it
--   reservation_layers     an active reservation names only layers that
--                          exist (also after the global layer was resharded)
--   over_capacity          a token balance above its burst
--   requests_over_capacity a request balance above its burst
--   global_shard_rows      a sharded global layer has exactly `shards` rows
--   global_shard_share     each shard's rates, bursts and in-flight bound are
--                          its exact share (lq_shard_share) of the layer's
--                          sum, so the shares sum to the policy exactly
--   usage_rows             'usage' ledger rows of a reservation: 1 once it is
--                          settled or expired, 0 while active or when released
--   late_rows              'late' ledger rows: 1 for a settle after expiry
--   charged_tokens         a settled reservation's charge against its figures
--   refunded_tokens        reserved - charged, clamped at zero, on time
--   ledger_tokens          the 'usage' row of a settle carries its figures
--   credit_balance         a prepaid balance against the sum of its
--                          credit_ledger rows (top-ups, charges, adjustments)
--   credit_balance_after   each credit_ledger row's balance_after against the
--                          running sum of the tenant's rows up to it
--   credit_reserved        what a prepaid account holds against the
--                          credit_reserved of its active reservations
--   quota_reserved_tokens  a quota window's reserved tokens (and cost)
--   quota_reserved_cost    against the active reservations admitted in it
--   quota_charged_tokens   a quota window's charged tokens (and cost) against
--   quota_charged_cost     the usage ledger's rows recorded in it for the
--                          reservations that counted against the quota
--   relayed_output         a reservation whose output the proxy relayed ended
--                          with no output token in the ledger (lq_audit_relayed)
--   credit_charge          what credits charged for a month's usage against
--                          the invoice of the same usage (lq_audit_credit_charges,
--                          quotas.sql)
--   export_skipped         a ledger row (this and last month) at or below the
--                          export's cursor without an export id: never exported


-- The billing export skipped no row: every ledger row at or below the
-- export's cursor, in its (xact_id, entry_id) order (lq_export_ledger), has
-- its export id. A row that committed after the cursor had passed its place
-- would sit below it, never numbered: what a row stamped with another
-- node's transaction id did on Citus before the cells' ledger trigger
-- (docs/scaling.md, "The billing export of a cell"). Expected 1 export id,
-- actual 0, per such row. Rows of this and the previous month (UTC), as the
-- credit charges are checked: a skip happens at the cursor, which follows
-- the ledger closely, and the audit must not read all history.
CREATE OR REPLACE FUNCTION lq_audit_export()
RETURNS TABLE (check_name text, subject text, expected bigint, actual bigint)
LANGUAGE plpgsql STABLE
AS $$
#variable_conflict use_column
DECLARE
    since constant timestamptz := (date_trunc('month', clock_timestamp() AT TIME ZONE 'UTC')
                                   - interval '1 month') AT TIME ZONE 'UTC';
BEGIN
    RETURN QUERY
    SELECT 'export_skipped', format('ledger entry %s', l.entry_id), 1::bigint, 0::bigint
      FROM ledger_export_state AS st
      JOIN usage_ledger AS l ON (l.xact_id, l.entry_id) <= (st.last_xact_id, st.last_entry_id)
     WHERE l.recorded_at >= since
       AND NOT EXISTS (SELECT FROM ledger_export_positions AS p WHERE p.entry_id = l.entry_id);
END
$$;


-- A layer's permits in flight against the active reservations holding them
-- (a reservation of a call that takes no permit, uses_concurrency false, holds 0).
CREATE OR REPLACE FUNCTION lq_audit_in_flight()
RETURNS TABLE (check_name text, subject text, expected bigint, actual bigint)
LANGUAGE plpgsql STABLE
AS $$
#variable_conflict use_column
BEGIN
    RETURN QUERY
    WITH held AS (
        SELECT l.layer_id, sum(rs.permits) AS permits
          FROM reservations AS rs
               CROSS JOIN LATERAL unnest(rs.layer_ids) AS l(layer_id)
         WHERE rs.state = 'active'
         GROUP BY l.layer_id
    )
    SELECT 'in_flight', format('layer %s (%s %s %s)', ll.layer_id, ll.scope,
                               coalesce(ll.tenant, '-'), coalesce(ll.route, '-')),
           coalesce(h.permits, 0), ll.in_flight::bigint
      FROM limit_layers AS ll
           LEFT JOIN held AS h ON h.layer_id = ll.layer_id
     WHERE ll.in_flight <> coalesce(h.permits, 0);
END
$$;


-- An active reservation whose layers are gone gives its permit and tokens
-- back to nothing when it finishes: the layer it was counted on never sees
-- them again. Expected: the layers it names; actual: those that exist.
CREATE OR REPLACE FUNCTION lq_audit_reservation_layers()
RETURNS TABLE (check_name text, subject text, expected bigint, actual bigint)
LANGUAGE plpgsql STABLE
AS $$
#variable_conflict use_column
BEGIN
    RETURN QUERY
    SELECT 'reservation_layers', rs.reservation_id::text,
           cardinality(rs.layer_ids)::bigint, count(ll.layer_id)
      FROM reservations AS rs
           CROSS JOIN LATERAL unnest(rs.layer_ids) AS l(layer_id)
           LEFT JOIN limit_layers AS ll ON ll.layer_id = l.layer_id
     WHERE rs.state = 'active'
     GROUP BY rs.reservation_id, rs.layer_ids
    HAVING count(ll.layer_id) <> cardinality(rs.layer_ids);
END
$$;


-- Balances within their bursts (the schema forbids more; this says so
-- should a constraint ever be lost).
CREATE OR REPLACE FUNCTION lq_audit_capacity()
RETURNS TABLE (check_name text, subject text, expected bigint, actual bigint)
LANGUAGE plpgsql STABLE
AS $$
#variable_conflict use_column
BEGIN
    RETURN QUERY
    SELECT 'over_capacity', format('layer %s', ll.layer_id),
           ll.token_burst, ceil(ll.tokens)::bigint
      FROM limit_layers AS ll
     WHERE ll.tokens > ll.token_burst
    UNION ALL
    SELECT 'requests_over_capacity', format('layer %s', ll.layer_id),
           ll.request_burst, ceil(ll.requests)::bigint
      FROM limit_layers AS ll
     WHERE ll.requests > ll.request_burst;
END
$$;


-- The global layer's rows are the exact split of one policy (global_layer.sql):
-- `shards` rows, numbered 0 .. shards - 1, each holding lq_shard_share of
-- the rows' sum of every rate, burst and in-flight bound.
CREATE OR REPLACE FUNCTION lq_audit_global_shards()
RETURNS TABLE (check_name text, subject text, expected bigint, actual bigint)
LANGUAGE plpgsql STABLE
AS $$
#variable_conflict use_column
BEGIN
    RETURN QUERY
    WITH g AS (
        SELECT l.*,
               sum(l.tokens_per_minute) OVER () AS sum_tpm,
               sum(l.token_burst) OVER () AS sum_tburst,
               sum(l.requests_per_minute) OVER () AS sum_rpm,
               sum(l.request_burst) OVER () AS sum_rburst,
               sum(l.max_in_flight) OVER () AS sum_max_if
          FROM limit_layers AS l
         WHERE l.scope = 'global'
    ), share AS (
        SELECT g.shard, g.shards, f.field, f.value,
               lq_shard_share(f.total::bigint, g.shard, g.shards) AS want
          FROM g
               CROSS JOIN LATERAL (VALUES
                   ('tokens_per_minute', g.tokens_per_minute, g.sum_tpm),
                   ('token_burst', g.token_burst, g.sum_tburst),
                   ('requests_per_minute', g.requests_per_minute, g.sum_rpm),
                   ('request_burst', g.request_burst, g.sum_rburst),
                   ('max_in_flight', g.max_in_flight::bigint, g.sum_max_if)
               ) AS f(field, value, total)
    )
    SELECT 'global_shard_rows', 'global layer', max(g.shards)::bigint, count(*)
      FROM g
    HAVING count(*) <> max(g.shards) OR min(g.shards) <> max(g.shards)
    UNION ALL
    SELECT 'global_shard_share', format('global shard %s of %s %s', s.shard, s.shards, s.field),
           s.want, s.value
      FROM share AS s
     WHERE s.value IS DISTINCT FROM s.want;
END
$$;


-- The ledger rows each reservation must have, and a settlement's figures.
-- The ledger is read in one pass, pruned to the partitions no older than
-- the oldest reservation on record. A response cache hit's row (serving_path
-- 'cache', written by sql/cache.sql) carries an id of its own that no
-- reservation has: it is no reservation's book, and is left out.
CREATE OR REPLACE FUNCTION lq_audit_reservation_books()
RETURNS TABLE (check_name text, subject text, expected bigint, actual bigint)
LANGUAGE plpgsql STABLE
AS $$
#variable_conflict use_column
BEGIN
    RETURN QUERY
    WITH ledger AS (
        SELECT g.reservation_id,
               count(*) FILTER (WHERE g.entry_kind = 'usage') AS usage_rows,
               count(*) FILTER (WHERE g.entry_kind = 'late') AS late_rows,
               max(g.input_tokens) FILTER (WHERE g.entry_kind = 'usage') AS usage_input,
               max(g.output_tokens) FILTER (WHERE g.entry_kind = 'usage') AS usage_output
          FROM usage_ledger AS g
         WHERE g.reservation_id IS NOT NULL
           AND g.serving_path IS DISTINCT FROM 'cache'
           AND g.recorded_at >= (SELECT min(r.created_at) FROM reservations AS r)
         GROUP BY g.reservation_id
    ), books AS (
        SELECT rs.*,
               coalesce(l.usage_rows, 0) AS usage_rows,
               coalesce(l.late_rows, 0) AS late_rows,
               l.usage_input, l.usage_output
          FROM reservations AS rs
               LEFT JOIN ledger AS l ON l.reservation_id = rs.reservation_id
    )
    SELECT 'usage_rows', b.reservation_id::text,
           CASE WHEN b.state IN ('settled', 'expired') THEN 1 ELSE 0 END, b.usage_rows
      FROM books AS b
     WHERE b.usage_rows <> CASE WHEN b.state IN ('settled', 'expired') THEN 1 ELSE 0 END
    UNION ALL
    SELECT 'late_rows', b.reservation_id::text,
           CASE WHEN b.state = 'expired' AND b.charged_tokens IS NOT NULL THEN 1 ELSE 0 END,
           b.late_rows
      FROM books AS b
     WHERE b.late_rows
           <> CASE WHEN b.state = 'expired' AND b.charged_tokens IS NOT NULL THEN 1 ELSE 0 END
    UNION ALL
    SELECT 'charged_tokens', b.reservation_id::text,
           b.settled_input_tokens + b.settled_output_tokens, b.charged_tokens
      FROM books AS b
     WHERE b.charged_tokens IS DISTINCT FROM
           CASE WHEN b.state = 'settled' OR b.late
                THEN b.settled_input_tokens + b.settled_output_tokens END
    UNION ALL
    SELECT 'refunded_tokens', b.reservation_id::text,
           greatest(b.reserved_tokens - b.charged_tokens, 0), b.refunded_tokens
      FROM books AS b
     WHERE b.state = 'settled'
       AND b.refunded_tokens IS DISTINCT FROM greatest(b.reserved_tokens - b.charged_tokens, 0)
    UNION ALL
    SELECT 'ledger_tokens', b.reservation_id::text,
           b.settled_input_tokens + b.settled_output_tokens, b.usage_input + b.usage_output
      FROM books AS b
     WHERE b.state = 'settled'
       AND (b.usage_input, b.usage_output)
           IS DISTINCT FROM (b.settled_input_tokens, b.settled_output_tokens);
END
$$;


-- Prepaid accounts against the credit ledger they are derived from: the
-- balance is the sum of the tenant's rows, each row's balance_after the
-- running sum up to it (entry_id order is the order the account lock let
-- them in), and what the account holds is what its active reservations hold.
CREATE OR REPLACE FUNCTION lq_audit_credits()
RETURNS TABLE (check_name text, subject text, expected bigint, actual bigint)
LANGUAGE plpgsql STABLE
AS $$
#variable_conflict use_column
BEGIN
    RETURN QUERY
    SELECT 'credit_balance', format('tenant %s (millionths)', ca.tenant),
           round(coalesce(cl.total, 0) * 1000000)::bigint, round(ca.balance * 1000000)::bigint
      FROM credit_accounts AS ca
           LEFT JOIN (SELECT l.tenant, sum(l.amount) AS total
                        FROM credit_ledger AS l
                       GROUP BY l.tenant) AS cl ON cl.tenant = ca.tenant
     WHERE ca.balance <> coalesce(cl.total, 0)
    UNION ALL
    SELECT 'credit_balance_after', format('tenant %s entry %s (millionths)', r.tenant, r.entry_id),
           round(r.running * 1000000)::bigint, round(r.balance_after * 1000000)::bigint
      FROM (SELECT l.tenant, l.entry_id, l.balance_after,
                   sum(l.amount) OVER (PARTITION BY l.tenant ORDER BY l.entry_id) AS running
              FROM credit_ledger AS l) AS r
     WHERE r.balance_after <> r.running
    UNION ALL
    SELECT 'credit_reserved', format('tenant %s (millionths)', ca.tenant),
           round(coalesce(h.held, 0) * 1000000)::bigint, round(ca.reserved * 1000000)::bigint
      FROM credit_accounts AS ca
           LEFT JOIN (SELECT rs.tenant, sum(rs.credit_reserved) AS held
                        FROM reservations AS rs
                       WHERE rs.state = 'active' AND rs.credit_reserved IS NOT NULL
                       GROUP BY rs.tenant) AS h ON h.tenant = ca.tenant
     WHERE ca.reserved <> coalesce(h.held, 0);
END
$$;


-- Each calendar quota window against what made it: reserved = the active
-- reservations admitted in the window that counted against the quota (their
-- quota_ids), charged = the usage ledger's 'usage' and 'late' rows recorded
-- in the window for such reservations, tokens and cost (the price in force
-- then, as lq_finish charged it). Settlement charges the window it happens
-- in: the ledger row's instant, or for usage replayed from an outage journal
-- the journal's (reservations.usage_at).
--
-- Only windows that can still be recomputed are checked: a window of a
-- deleted quota (quota_id NULL) keeps what it had, and a window ending before
-- the oldest reservation on record, or holding a ledger row whose
-- reservation was purged since (`purge_finished`), has lost what it was made
-- of. The ledger is read by its (tenant, recorded_at) index, window by window.
-- A response cache hit's row (serving_path 'cache') never had a reservation
-- and charges no quota: it is left out, or it would read as a purged
-- reservation and switch the window's charged check off.
CREATE OR REPLACE FUNCTION lq_audit_quota_windows()
RETURNS TABLE (check_name text, subject text, expected bigint, actual bigint)
LANGUAGE plpgsql STABLE
AS $$
#variable_conflict use_column
DECLARE
    entries bigint[];
    models  text[];
    inputs  bigint[];
    outputs bigint[];
    ats     timestamptz[];
    costs   numeric[];
BEGIN
    -- The ledger rows a checked window charges, priced apart (lq_costs says
    -- why) at the moment the usage happened (as `charged` below reads it).
    SELECT array_agg(g.entry_id), array_agg(g.model), array_agg(g.input_tokens),
           array_agg(g.output_tokens), array_agg(coalesce(rs.usage_at, g.recorded_at))
      INTO entries, models, inputs, outputs, ats
      FROM usage_ledger AS g
           JOIN reservations AS rs ON rs.reservation_id = g.reservation_id
     WHERE g.entry_kind IN ('usage', 'late')
       AND EXISTS (SELECT 1 FROM quota_windows AS w
                    WHERE w.quota_id = ANY (rs.quota_ids) AND w.tenant = g.tenant
                      AND coalesce(rs.usage_at, g.recorded_at) >= w.window_start
                      AND coalesce(rs.usage_at, g.recorded_at) < w.window_end);
    costs := lq_costs(models, inputs, outputs, ats);
    RETURN QUERY
    WITH win AS (
        SELECT w.*
          FROM quota_windows AS w
         WHERE w.quota_id IS NOT NULL
           AND w.window_end > (SELECT min(r.created_at) FROM reservations AS r)
    ), held AS (
        SELECT w.window_id, sum(rs.reserved_tokens) AS tokens,
               sum(coalesce(rs.reserved_cost, 0)) AS cost
          FROM reservations AS rs
               CROSS JOIN LATERAL unnest(rs.quota_ids) AS q(quota_id)
               JOIN win AS w
                 ON w.quota_id = q.quota_id
                AND rs.created_at >= w.window_start AND rs.created_at < w.window_end
         WHERE rs.state = 'active'
         GROUP BY w.window_id
    ), charged AS (
        SELECT w.window_id,
               sum(g.input_tokens + g.output_tokens)
                   FILTER (WHERE w.quota_id = ANY (rs.quota_ids)) AS tokens,
               sum(coalesce(pc.cost, 0))
                   FILTER (WHERE w.quota_id = ANY (rs.quota_ids)) AS cost,
               bool_or(rs.reservation_id IS NULL) AS purged
          FROM win AS w
               JOIN usage_ledger AS g
                 ON g.tenant = w.tenant AND g.entry_kind IN ('usage', 'late')
                AND g.serving_path IS DISTINCT FROM 'cache'
               LEFT JOIN reservations AS rs ON rs.reservation_id = g.reservation_id
               LEFT JOIN unnest(entries, costs) AS pc(entry_id, cost)
                      ON pc.entry_id = g.entry_id
         -- the moment the usage happened: the settle's, or the journal's for
         -- usage replayed after an outage (usage_at, which lq_finish charges)
         WHERE coalesce(rs.usage_at, g.recorded_at) >= w.window_start
           AND coalesce(rs.usage_at, g.recorded_at) < w.window_end
         GROUP BY w.window_id
    ), books AS (
        SELECT w.window_id, w.reserved_tokens, w.reserved_cost, w.charged_tokens, w.charged_cost,
               format('quota %s (%s %s %s) window %s', w.quota_id, w.tenant,
                      coalesce(w.route, '-'), w.quota_name, w.window_start) AS subject,
               coalesce(h.tokens, 0) AS held_tokens, coalesce(h.cost, 0) AS held_cost,
               coalesce(c.tokens, 0) AS ledger_tokens, coalesce(c.cost, 0) AS ledger_cost,
               coalesce(c.purged, false) AS purged
          FROM win AS w
               LEFT JOIN held AS h ON h.window_id = w.window_id
               LEFT JOIN charged AS c ON c.window_id = w.window_id
    )
    SELECT 'quota_reserved_tokens', b.subject, b.held_tokens::bigint, b.reserved_tokens
      FROM books AS b
     WHERE b.reserved_tokens <> b.held_tokens
    UNION ALL
    SELECT 'quota_reserved_cost', b.subject || ' (millionths)',
           round(b.held_cost * 1000000)::bigint, round(b.reserved_cost * 1000000)::bigint
      FROM books AS b
     WHERE b.reserved_cost <> b.held_cost
    UNION ALL
    SELECT 'quota_charged_tokens', b.subject, b.ledger_tokens::bigint, b.charged_tokens
      FROM books AS b
     WHERE NOT b.purged AND b.charged_tokens <> b.ledger_tokens
    UNION ALL
    SELECT 'quota_charged_cost', b.subject || ' (millionths)',
           round(b.ledger_cost * 1000000)::bigint, round(b.charged_cost * 1000000)::bigint
      FROM books AS b
     WHERE NOT b.purged AND b.charged_cost <> b.ledger_cost;
END
$$;


-- The audit: every check above, in one snapshot (STABLE: each RETURN QUERY
-- reads the snapshot of the query that called lq_audit). A new check is one
-- line here.
CREATE OR REPLACE FUNCTION lq_audit()
RETURNS TABLE (check_name text, subject text, expected bigint, actual bigint)
LANGUAGE plpgsql STABLE
AS $$
BEGIN
    RETURN QUERY SELECT * FROM lq_audit_in_flight();
    RETURN QUERY SELECT * FROM lq_audit_reservation_layers();
    RETURN QUERY SELECT * FROM lq_audit_capacity();
    RETURN QUERY SELECT * FROM lq_audit_global_shards();
    RETURN QUERY SELECT * FROM lq_audit_reservation_books();
    RETURN QUERY SELECT * FROM lq_audit_credits();
    RETURN QUERY SELECT * FROM lq_audit_quota_windows();
    RETURN QUERY SELECT * FROM lq_audit_relayed();
    RETURN QUERY SELECT * FROM lq_audit_credit_charges();
    RETURN QUERY SELECT * FROM lq_audit_export();
END
$$;


-- Extend a live lease by p_seconds (NULL: the reservation's own lease) and
-- bump its generation (the fencing token). p_generation, when given, is the
-- generation the caller holds: a stale one extends nothing. No row: no such
-- reservation for this caller (p_tenant NULL: any). A row with a NULL
-- lease_expires_at: it exists but is finished, its lease ran out, or the
-- caller's generation is stale. p_relayed: the proxy relayed output of it to
-- its client, remembered (once) for the audit (reservations.relayed_at). A
-- function, not a statement, so that the clock is read once into a variable
-- on the node that holds the reservation (Citus refuses a volatile function
-- inside an UPDATE of a distributed table).
CREATE OR REPLACE FUNCTION lq_heartbeat(
    p_reservation_id uuid, p_tenant text, p_seconds integer, p_generation integer,
    p_relayed boolean
) RETURNS TABLE (state text, lease_live boolean, current_generation integer,
                 lease_expires_at timestamptz, lease_generation integer)
LANGUAGE plpgsql
AS $$
#variable_conflict use_column
DECLARE
    now_ts timestamptz;
BEGIN
    -- The row first, then the clock: a heartbeat that waited for another's
    -- lock extends from when it runs.
    PERFORM 1 FROM reservations AS rs WHERE rs.reservation_id = p_reservation_id FOR UPDATE;
    now_ts := clock_timestamp();
    RETURN QUERY
    WITH target AS (
        SELECT rs.reservation_id, rs.state, rs.lease_generation,
               rs.state = 'active' AND rs.lease_expires_at > now_ts AS lease_live
          FROM reservations AS rs
         WHERE rs.reservation_id = p_reservation_id
           AND (p_tenant IS NULL OR rs.tenant = p_tenant)
    ), extended AS (
        UPDATE reservations AS rs
           SET lease_expires_at = now_ts
                                  + make_interval(secs => coalesce(p_seconds, rs.lease_seconds)),
               lease_generation = rs.lease_generation + 1,
               relayed_at = CASE WHEN p_relayed THEN coalesce(rs.relayed_at, now_ts)
                                 ELSE rs.relayed_at END
          FROM target
         WHERE rs.reservation_id = target.reservation_id
           AND rs.state = 'active'
           AND rs.lease_expires_at > now_ts
           AND (p_generation IS NULL OR rs.lease_generation = p_generation)
        RETURNING rs.lease_expires_at, rs.lease_generation
    )
    SELECT target.state, target.lease_live, target.lease_generation,
           extended.lease_expires_at, extended.lease_generation
      FROM target LEFT JOIN extended ON true;
END
$$;


-- Delete up to p_limit reservations finished longer ago than p_retention_seconds
-- (their ledger rows stay); idempotency keys live as long as their
-- reservation. The clock is read once into a variable, as lq_heartbeat's.
CREATE OR REPLACE FUNCTION lq_purge_finished(p_retention_seconds integer, p_limit integer)
RETURNS bigint
LANGUAGE plpgsql
AS $$
DECLARE
    cutoff constant timestamptz := clock_timestamp()
                                   - make_interval(secs => p_retention_seconds);
    purged bigint;
BEGIN
    DELETE FROM reservations
     WHERE reservation_id IN (
           SELECT reservation_id
             FROM reservations
            WHERE state <> 'active'
              AND finished_at < cutoff
            LIMIT p_limit
              FOR UPDATE SKIP LOCKED);
    GET DIAGNOSTICS purged = ROW_COUNT;
    RETURN purged;
END
$$;
