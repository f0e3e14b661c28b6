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
-- A recorded reservation is an ordinary active reservation from then on: it
-- holds a permit on every layer it belongs to, its reserved tokens and one
-- request are debited from those layers now (with no limit check: the work
-- was already admitted, and a balance may go negative, to be repaid by
-- refill, exactly like a settlement that used more than it reserved), and
-- its lease starts now on the database clock. Settling or releasing it then
-- goes through lq_finish, which writes its ledger row exactly once.
--
-- recorded per request: true when this call wrote it, false when it existed.
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
    p_modes            text[]
) RETURNS TABLE (ord integer, recorded boolean)
LANGUAGE plpgsql
AS $$
DECLARE
    n        integer := coalesce(cardinality(p_ids), 0);
    now_ts   timestamptz;
    inserted uuid[];
BEGIN
    IF n = 0 THEN
        RETURN;
    END IF;

    -- (1) The idempotency keys, locked exactly as lq_admit locks them, so no
    -- admission can take a key between our check below and our insert.
    PERFORM lq_lock_idempotency_keys(p_tenants, p_idempotency_keys);

    now_ts := clock_timestamp();

    -- (2) Insert the reservations in id order (two workers replaying the same
    -- spool insert the same ids in the same order, so the second waits for
    -- the first instead of deadlocking), each belonging to the layers that
    -- exist for it now. ON CONFLICT on the id makes a replay a no-op.
    -- An idempotency key some other reservation already holds is dropped
    -- rather than let the unique index refuse the row: usage is never lost
    -- for the sake of a key.
    WITH req AS (
        SELECT u.*,
               row_number() OVER (PARTITION BY u.tenant, u.idem ORDER BY u.id) AS key_rank
          FROM unnest(p_ids, p_tenants, p_routes, p_models, p_input_tokens, p_max_tokens,
                      p_input_estimated, p_lease_seconds, p_idempotency_keys,
                      p_request_hashes, p_policy_versions, p_modes)
               AS u(id, tenant, route, model, input_tokens, max_tokens, input_estimated,
                    lease, idem, request_hash, policy_version, mode)
    ), placed AS (
        SELECT req.*,
               ARRAY(SELECT l.layer_id
                       FROM limit_layers AS l
                      WHERE (l.scope = 'global' AND l.tenant IS NULL AND l.route IS NULL
                             AND l.shard = lq_tenant_shard(req.tenant, l.shards))
                         OR (l.scope = 'tenant' AND l.tenant = req.tenant AND l.route IS NULL)
                         OR (l.scope = 'route' AND l.tenant = req.tenant AND l.route = req.route)
                      ORDER BY l.layer_id) AS layer_ids,
               coalesce(req.lease,
                        (SELECT l.lease_seconds FROM limit_layers AS l
                          WHERE l.scope = 'route' AND l.tenant = req.tenant
                            AND l.route = req.route),
                        (SELECT l.lease_seconds FROM limit_layers AS l
                          WHERE l.scope = 'tenant' AND l.tenant = req.tenant
                            AND l.route IS NULL),
                        120) AS lease_seconds
          FROM req
    ), ins AS (
        INSERT INTO reservations (reservation_id, tenant, route, model, layer_ids,
                                  input_tokens, input_estimated, max_tokens, reserved_tokens,
                                  policy_version, created_at, lease_seconds, lease_expires_at,
                                  idempotency_key, request_hash, outage_mode)
        SELECT p.id, p.tenant, p.route, p.model, p.layer_ids,
               p.input_tokens, p.input_estimated, p.max_tokens, p.input_tokens + p.max_tokens,
               p.policy_version, now_ts, p.lease_seconds,
               now_ts + make_interval(secs => p.lease_seconds),
               CASE WHEN p.idem IS NOT NULL AND p.key_rank = 1
                         AND NOT EXISTS (SELECT 1 FROM reservations AS r
                                          WHERE r.tenant = p.tenant
                                            AND r.idempotency_key = p.idem)
                    THEN p.idem END,
               p.request_hash, p.mode
          FROM placed AS p
         ORDER BY p.id
        ON CONFLICT (reservation_id) DO NOTHING
        RETURNING reservation_id
    )
    SELECT array_agg(ins.reservation_id) INTO inserted FROM ins;

    -- (3) Debit the layers of the rows written now (and only those): tokens,
    -- one request and one permit each. lq_credit_layers locks the layers in
    -- layer_id order, after the reservation rows above.
    IF inserted IS NOT NULL THEN
        PERFORM lq_credit_layers(array_agg(l.layer_id),
                                 array_agg(-rs.reserved_tokens::double precision),
                                 array_agg(-1::double precision),
                                 array_agg(-1))
           FROM reservations AS rs
                CROSS JOIN LATERAL unnest(rs.layer_ids) AS l(layer_id)
          WHERE rs.reservation_id = ANY (inserted);
    END IF;

    RETURN QUERY
    SELECT o.i::integer, coalesce(p_ids[o.i] = ANY (inserted), false)
      FROM generate_series(1, n) AS o(i);
END
$$;


-- Recompute the books from the journal (reservations and usage_ledger) and
-- return one row per discrepancy; no row means no drift.
--
--   in_flight        a layer's in_flight counter against the active
--                    reservations that hold a permit on it
--   usage_rows       'usage' ledger rows of a reservation: 1 once it is
--                    settled or expired, 0 while active or when released
--   late_rows        'late' ledger rows: 1 for a settle after expiry, else 0
--   charged_tokens   a settled reservation's charge against its figures
--   refunded_tokens  reserved - charged, clamped at zero, for an on-time settle
--   ledger_tokens    the 'usage' row of a settle carries the settled figures
--   over_capacity    a balance above its capacity (the schema forbids it)
--   credit_balance   a prepaid balance against the sum of its credit_ledger
--                    rows (top-ups, charges, adjustments), in millionths of
--                    the currency; compared exactly, shown rounded
--
-- STABLE: the whole report reads one snapshot, so it is consistent even
-- while admissions and settlements run.
CREATE OR REPLACE FUNCTION lq_audit()
RETURNS TABLE (check_name text, subject text, expected bigint, actual bigint)
LANGUAGE sql STABLE
AS $$
    WITH held AS (
        SELECT l.layer_id, count(*) AS permits
          FROM reservations AS rs
               CROSS JOIN LATERAL unnest(rs.layer_ids) AS l(layer_id)
         WHERE rs.state = 'active'
         GROUP BY l.layer_id
    ), ledger AS (
        -- The ledger rows of the reservations still on record, counted once
        -- in one pass; no reservation is older than the oldest created_at,
        -- so older ledger partitions are pruned rather than scanned.
        SELECT g.reservation_id,
               count(*) FILTER (WHERE g.entry_kind = 'usage') AS usage_rows,
               count(*) FILTER (WHERE g.entry_kind = 'late') AS late_rows,
               max(g.input_tokens) FILTER (WHERE g.entry_kind = 'usage') AS usage_input,
               max(g.output_tokens) FILTER (WHERE g.entry_kind = 'usage') AS usage_output
          FROM usage_ledger AS g
         WHERE g.reservation_id IS NOT NULL
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
    SELECT 'in_flight', format('layer %s (%s %s %s)', ll.layer_id, ll.scope,
                               coalesce(ll.tenant, '-'), coalesce(ll.route, '-')),
           coalesce(h.permits, 0), ll.in_flight::bigint
      FROM limit_layers AS ll
           LEFT JOIN held AS h ON h.layer_id = ll.layer_id
     WHERE ll.in_flight <> coalesce(h.permits, 0)
    UNION ALL
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
           IS DISTINCT FROM (b.settled_input_tokens, b.settled_output_tokens)
    UNION ALL
    SELECT 'over_capacity', format('layer %s', ll.layer_id),
           ll.token_burst, ceil(ll.tokens)::bigint
      FROM limit_layers AS ll
     WHERE ll.tokens > ll.token_burst
    UNION ALL
    SELECT 'credit_balance', format('tenant %s (millionths)', ca.tenant),
           round(coalesce(cl.total, 0) * 1000000)::bigint, round(ca.balance * 1000000)::bigint
      FROM credit_accounts AS ca
           LEFT JOIN (SELECT l.tenant, sum(l.amount) AS total
                        FROM credit_ledger AS l
                       GROUP BY l.tenant) AS cl ON cl.tenant = ca.tenant
     WHERE ca.balance <> coalesce(cl.total, 0)
$$;
