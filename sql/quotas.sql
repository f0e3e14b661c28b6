-- Calendar quotas, prepaid credits and the alert outbox: the helpers that
-- admission and settlement call inside their own transaction.
--
-- Nothing here commits or opens a transaction: every function runs in the
-- caller's, so an alert row exists exactly when the change that crossed its
-- threshold commits, and vanishes with it on a rollback.
--
-- Lock order, after admission.sql's (idempotency keys, reservations, then
-- limit_layers by layer_id): quota_windows rows by (quota_id, window_start),
-- then credit_accounts by tenant, then alert_outbox (its unique index). An
-- alert never locks anything but its own new rows.
--
-- Time: p_at is the caller's moment (admission passes its clock_timestamp();
-- tests pass explicit timestamps), never read here behind the caller's back,
-- except for created_at defaults and projections made "now".


-- The calendar window of a quota holding the moment p_at: [window_start,
-- window_end) in the quota's time zone. A day is midnight to midnight local
-- time, so 23 or 25 hours at a DST change; a month is the first of the month
-- to the first of the next, 28 to 31 days. STABLE, not IMMUTABLE: the zone
-- rules come from the server's time zone database.
CREATE OR REPLACE FUNCTION lq_quota_window(
    p_period   text,
    p_timezone text,
    p_at       timestamptz,
    OUT window_start timestamptz,
    OUT window_end   timestamptz
)
LANGUAGE plpgsql STABLE
AS $$
DECLARE
    local_start timestamp;
BEGIN
    IF p_period NOT IN ('day', 'month') THEN
        RAISE EXCEPTION 'quota period must be day or month, not %', p_period
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    local_start := date_trunc(p_period, p_at AT TIME ZONE p_timezone);
    window_start := local_start AT TIME ZONE p_timezone;
    -- Local calendar arithmetic, then back to an instant: a local midnight
    -- that DST skips resolves as PostgreSQL resolves any skipped local time.
    window_end := (local_start + CASE p_period WHEN 'day' THEN interval '1 day'
                                               ELSE interval '1 month' END)
                  AT TIME ZONE p_timezone;
END
$$;


-- When usage reaches the limit at the window's average rate so far; p_at
-- itself once reached; NULL without usage or elapsed time to project from.
CREATE OR REPLACE FUNCTION lq_projected_exhaustion(
    p_usage        numeric,
    p_limit        numeric,
    p_window_start timestamptz,
    p_at           timestamptz
) RETURNS timestamptz
LANGUAGE sql IMMUTABLE
AS $$
    SELECT CASE
               WHEN p_usage >= p_limit THEN p_at
               WHEN p_usage <= 0 OR p_at <= p_window_start THEN NULL
               ELSE p_at + (p_at - p_window_start) * ((p_limit - p_usage) / p_usage)::float8
           END
$$;


-- Put one alert into the outbox, at most once per (type, subject, threshold,
-- window_start), and one delivery per webhook that takes it (the tenant's,
-- and those of every tenant). Returns the new event id, or NULL when the
-- alert had fired already.
--
-- Concurrency: the unique index alert_outbox_once decides. A second caller
-- inserting the same key waits for the first's transaction: if it commits,
-- ON CONFLICT DO NOTHING makes the second a no-op; if it rolls back, the
-- second inserts. So exactly one committed alert, whatever the concurrency,
-- and none for a change that rolled back.
CREATE OR REPLACE FUNCTION lq_fire_alert(
    p_type                    text,
    p_tenant                  text,
    p_subject                 text,
    p_threshold               numeric,
    p_window_start            timestamptz,
    p_window_end              timestamptz,
    p_usage                   numeric,
    p_limit                   numeric,
    p_projected_exhaustion_at timestamptz,
    p_payload                 jsonb DEFAULT '{}'
) RETURNS uuid
LANGUAGE plpgsql
AS $$
DECLARE
    fired uuid;
BEGIN
    INSERT INTO alert_outbox (event_type, tenant, subject, threshold, window_start, window_end,
                              usage, limit_value, projected_exhaustion_at, payload)
    VALUES (p_type, p_tenant, p_subject, p_threshold, p_window_start, p_window_end,
            p_usage, p_limit, p_projected_exhaustion_at, coalesce(p_payload, '{}'))
    ON CONFLICT ON CONSTRAINT alert_outbox_once DO NOTHING
    RETURNING event_id INTO fired;
    IF fired IS NOT NULL THEN
        INSERT INTO alert_deliveries (event_id, webhook)
        SELECT fired, w.name
          FROM webhooks AS w
         WHERE w.tenant IS NULL OR w.tenant = p_tenant
         ORDER BY w.name;
    END IF;
    RETURN fired;
END
$$;


-- Fire every threshold a change of usage crossed upwards: those t with
-- p_before < t * p_limit <= p_after. Returns how many alerts this call put
-- into the outbox (a threshold that fired before in the window counts 0).
-- A change downwards (a refund) fires nothing, and a threshold stays fired
-- for the window: usage that dips and rises again does not repeat it.
-- (A provider ceiling's crossings are not fired here: each worker's detector
-- alerts on them once per episode, lq_ceiling_episode_step below, off the
-- admission path.)
CREATE OR REPLACE FUNCTION lq_fire_crossed(
    p_type         text,
    p_tenant       text,
    p_subject      text,
    p_thresholds   numeric[],
    p_window_start timestamptz,
    p_window_end   timestamptz,
    p_before       numeric,
    p_after        numeric,
    p_limit        numeric,
    p_at           timestamptz,
    p_payload      jsonb DEFAULT '{}'
) RETURNS integer
LANGUAGE plpgsql
AS $$
DECLARE
    fired integer := 0;
    t     numeric;
BEGIN
    IF p_limit IS NULL OR p_limit <= 0 OR p_after <= p_before THEN
        RETURN 0;
    END IF;
    FOREACH t IN ARRAY coalesce(p_thresholds, '{}') LOOP
        IF p_before < t * p_limit AND t * p_limit <= p_after THEN
            IF lq_fire_alert(p_type, p_tenant, p_subject, t, p_window_start, p_window_end,
                             p_after, p_limit,
                             lq_projected_exhaustion(p_after, p_limit, p_window_start, p_at),
                             p_payload) IS NOT NULL THEN
                fired := fired + 1;
            END IF;
        END IF;
    END LOOP;
    RETURN fired;
END
$$;


-- One sample's step of a provider ceiling's alert episode (the state rows
-- of ceiling_alert_episodes, migration 0023): the state after a sample of
-- utilization p_utilization at p_sampled_at, given the state before it.
--   * No episode open (p_episode_start NULL): utilization at or above the
--     threshold opens one at the sample's time (the caller fires its alert).
--   * An episode open, utilization below threshold - hysteresis (or the
--     bucket idle, utilization 0, whatever the hysteresis): the first such
--     sample starts a run (below_since); a sample of that run at least
--     p_quiet_seconds after its start ends the episode.
--   * An episode open and utilization not that low (above the threshold, or
--     a dip of less than the hysteresis): it stays open, and a run ends.
-- Pure: the caller's upsert applies it under the state row's lock, and only
-- for a sample newer than the last one applied.
CREATE OR REPLACE FUNCTION lq_ceiling_episode_step(
    p_episode_start  timestamptz,
    p_below_since    timestamptz,
    p_last_ended_at  timestamptz,
    p_utilization    double precision,
    p_threshold      numeric,
    p_hysteresis     double precision,
    p_quiet_seconds  double precision,
    p_sampled_at     timestamptz,
    OUT episode_start timestamptz,
    OUT below_since   timestamptz,
    OUT last_ended_at timestamptz
)
LANGUAGE plpgsql IMMUTABLE
AS $$
BEGIN
    last_ended_at := p_last_ended_at;
    below_since := NULL;
    IF p_episode_start IS NULL THEN
        episode_start := CASE WHEN p_utilization >= p_threshold::double precision
                              THEN p_sampled_at END;
    ELSIF p_utilization < p_threshold::double precision - p_hysteresis
          OR p_utilization <= 0 THEN
        below_since := coalesce(p_below_since, p_sampled_at);
        IF p_sampled_at - below_since >= make_interval(secs => p_quiet_seconds) THEN
            episode_start := NULL;
            below_since := NULL;
            last_ended_at := p_sampled_at;
        ELSE
            episode_start := p_episode_start;
        END IF;
    ELSE
        episode_start := p_episode_start;
    END IF;
END
$$;


-- What an alert's subject says a quota belongs to: its route, `key=<id>` for
-- a key's quota (no route name has a `=`), `*` for the tenant's own. The
-- subject is what makes an alert once per threshold and window.
-- (Its arguments are columns, not the quotas row: a function of a table's
-- row type would keep a downgrade from dropping the table.)
CREATE OR REPLACE FUNCTION lq_quota_subject_scope(p_route text, p_key_id bigint)
RETURNS text
LANGUAGE sql IMMUTABLE
AS $$
    SELECT coalesce(p_route, 'key=' || p_key_id, '*')
$$;


-- The quotas a request of (tenant, route, model), asked with API key p_key_id,
-- counts against: the tenant's own, its route's and its key's, whose models
-- (LIKE patterns) match or are empty (every model). In quota_id order: the
-- order their windows are locked.
-- p_key_id was added (quotas per API key): the old signature goes.
DROP FUNCTION IF EXISTS lq_matching_quotas(text, text, text);
-- PL/pgSQL: Citus plans no SQL function over a distributed table (a cell's
-- quotas) called with parameters.
CREATE OR REPLACE FUNCTION lq_matching_quotas(p_tenant text, p_route text, p_model text,
                                              p_key_id bigint)
RETURNS SETOF quotas
LANGUAGE plpgsql STABLE
AS $$
BEGIN
    RETURN QUERY
    SELECT q.*
      FROM quotas AS q
     WHERE q.tenant = p_tenant
       AND coalesce(q.route, '') IN ('', coalesce(p_route, ''))
       AND (q.api_key_id IS NULL OR q.api_key_id = p_key_id)
       AND (cardinality(q.model_patterns) = 0 OR p_model LIKE ANY (q.model_patterns))
     ORDER BY q.quota_id;
END
$$;


-- The window row of a quota holding p_at, created if new, locked FOR UPDATE
-- until the caller's transaction ends. Two transactions creating the same
-- window meet on quota_windows_once: the second waits, then finds the row.
CREATE OR REPLACE FUNCTION lq_quota_window_row(p_quota_id bigint, p_at timestamptz)
RETURNS quota_windows
LANGUAGE plpgsql
AS $$
DECLARE
    q   quotas;
    w   record;
    row quota_windows;
BEGIN
    SELECT * INTO q FROM quotas WHERE quota_id = p_quota_id;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'no quota %', p_quota_id USING ERRCODE = 'no_data_found';
    END IF;
    w := lq_quota_window(q.period, q.timezone, p_at);
    INSERT INTO quota_windows (quota_id, tenant, route, quota_name, window_start, window_end)
    VALUES (q.quota_id, q.tenant, q.route, q.name, w.window_start, w.window_end)
    ON CONFLICT ON CONSTRAINT quota_windows_once DO NOTHING;
    SELECT * INTO row FROM quota_windows
     WHERE quota_id = p_quota_id AND window_start = w.window_start
       FOR UPDATE;
    RETURN row;
END
$$;


-- Apply signed changes to the window of a quota holding p_at, and fire
-- every alert threshold the change crossed (tokens and cost apart), in the
-- caller's transaction. Usage of a window = reserved + charged.
--
-- Admission: (quota, now, +reserved tokens, 0, +reserved cost, 0) once it
-- decided to admit. Settlement: lq_quota_settle below. Reserved amounts are
-- clamped at zero rather than fail a settlement (a refund of more than the
-- window holds would be a bug upstream, never a reason to lose the usage).
CREATE OR REPLACE FUNCTION lq_quota_apply(
    p_quota_id        bigint,
    p_at              timestamptz,
    p_reserved_tokens bigint,
    p_charged_tokens  bigint,
    p_reserved_cost   numeric,
    p_charged_cost    numeric
) RETURNS quota_windows
LANGUAGE plpgsql
AS $$
DECLARE
    now_ts constant timestamptz := clock_timestamp();
    q      quotas;
    before quota_windows;
    after  quota_windows;
    info   jsonb;
BEGIN
    before := lq_quota_window_row(p_quota_id, p_at);
    UPDATE quota_windows AS w
       SET reserved_tokens = greatest(w.reserved_tokens + coalesce(p_reserved_tokens, 0), 0),
           charged_tokens  = greatest(w.charged_tokens + coalesce(p_charged_tokens, 0), 0),
           reserved_cost   = greatest(w.reserved_cost + coalesce(p_reserved_cost, 0), 0),
           charged_cost    = greatest(w.charged_cost + coalesce(p_charged_cost, 0), 0),
           updated_at      = now_ts
     WHERE w.window_id = before.window_id
    RETURNING w.* INTO after;
    SELECT * INTO q FROM quotas WHERE quota_id = p_quota_id;
    info := jsonb_build_object('quota', q.name, 'route', q.route, 'enforce', q.enforce)
            || CASE WHEN q.api_key_id IS NULL THEN '{}'::jsonb
                    ELSE jsonb_build_object('key_id', q.api_key_id) END;
    IF q.tokens IS NOT NULL THEN
        PERFORM lq_fire_crossed('quota.threshold', q.tenant,
                                format('quota:%s:%s:%s:tokens', q.tenant,
                                       lq_quota_subject_scope(q.route, q.api_key_id), q.name),
                                q.alerts, after.window_start, after.window_end,
                                before.reserved_tokens + before.charged_tokens,
                                after.reserved_tokens + after.charged_tokens,
                                q.tokens, p_at, info || '{"unit": "tokens"}');
    END IF;
    IF q.cost IS NOT NULL THEN
        PERFORM lq_fire_crossed('quota.threshold', q.tenant,
                                format('quota:%s:%s:%s:cost', q.tenant,
                                       lq_quota_subject_scope(q.route, q.api_key_id), q.name),
                                q.alerts, after.window_start, after.window_end,
                                before.reserved_cost + before.charged_cost,
                                after.reserved_cost + after.charged_cost,
                                q.cost, p_at, info || '{"unit": "cost"}');
    END IF;
    RETURN after;
END
$$;


-- Settle a quota's share of one reservation: take its reservation off the
-- window it was reserved in (the one holding p_reserved_at) and charge the
-- actual usage to the window the settlement happens in (holding p_at). A
-- reservation open across a window boundary thus charges the new window:
-- usage counts when it is known, as the ledger records it. The older window
-- is locked first, so two settlements never lock the same pair crosswise.
CREATE OR REPLACE FUNCTION lq_quota_settle(
    p_quota_id        bigint,
    p_reserved_at     timestamptz,
    p_reserved_tokens bigint,
    p_reserved_cost   numeric,
    p_at              timestamptz,
    p_charged_tokens  bigint,
    p_charged_cost    numeric
) RETURNS void
LANGUAGE plpgsql
AS $$
DECLARE
    q quotas;
BEGIN
    SELECT * INTO q FROM quotas WHERE quota_id = p_quota_id;
    IF NOT FOUND THEN
        RETURN;  -- deleted meanwhile: its windows keep what they had
    END IF;
    IF (lq_quota_window(q.period, q.timezone, p_reserved_at)).window_start
       = (lq_quota_window(q.period, q.timezone, p_at)).window_start THEN
        PERFORM lq_quota_apply(p_quota_id, p_at, -p_reserved_tokens, p_charged_tokens,
                               -p_reserved_cost, p_charged_cost);
    ELSE
        PERFORM lq_quota_apply(p_quota_id, p_reserved_at, -p_reserved_tokens, 0,
                               -p_reserved_cost, 0);
        PERFORM lq_quota_apply(p_quota_id, p_at, 0, p_charged_tokens, 0, p_charged_cost);
    END IF;
END
$$;


-- Add prepaid credit once per (tenant, reference). The account row is
-- locked first, so two top-ups of one tenant queue; the second of the same
-- reference then finds the first's ledger row (each statement of PL/pgSQL
-- reads a fresh snapshot) and adds nothing. The unique constraint
-- credit_ledger_reference_once is the backstop.
--
-- applied: true when this call added the amount; false when the reference
-- was used before (amount is then the first top-up's, for the caller to
-- compare). The credit alerts' window restarts at every top-up: it is "the
-- balance since the last top-up", of the available balance it left.
CREATE OR REPLACE FUNCTION lq_credit_topup(p_tenant text, p_amount numeric, p_reference text)
RETURNS TABLE (entry_id bigint, applied boolean, amount numeric, balance numeric,
               reserved numeric, recorded_at timestamptz)
LANGUAGE plpgsql
AS $$
DECLARE
    now_ts  constant timestamptz := clock_timestamp();
    account credit_accounts;
    earlier credit_ledger;
    entry   credit_ledger;
BEGIN
    IF p_amount IS NULL OR p_amount <= 0 THEN
        RAISE EXCEPTION 'a top-up must be positive' USING ERRCODE = 'invalid_parameter_value';
    END IF;
    INSERT INTO credit_accounts (tenant) VALUES (p_tenant) ON CONFLICT (tenant) DO NOTHING;
    SELECT * INTO account FROM credit_accounts AS a WHERE a.tenant = p_tenant FOR UPDATE;
    SELECT * INTO earlier FROM credit_ledger AS l
     WHERE l.tenant = p_tenant AND l.reference = p_reference AND l.entry_kind = 'topup';
    IF FOUND THEN
        RETURN QUERY SELECT earlier.entry_id, false, earlier.amount, account.balance,
                            account.reserved, earlier.recorded_at;
        RETURN;
    END IF;
    INSERT INTO credit_ledger (tenant, entry_kind, amount, balance_after, reference)
    VALUES (p_tenant, 'topup', p_amount, account.balance + p_amount, p_reference)
    RETURNING * INTO entry;
    UPDATE credit_accounts AS a
       SET balance = entry.balance_after,
           funded_at = entry.recorded_at,
           funded_balance = entry.balance_after - a.reserved,
           updated_at = now_ts
     WHERE a.tenant = p_tenant
    RETURNING * INTO account;
    RETURN QUERY SELECT entry.entry_id, true, entry.amount, account.balance, account.reserved,
                        entry.recorded_at;
END
$$;


-- Change a prepaid account in the caller's transaction: p_reserved_delta
-- (admission: +maximum cost; settlement or release: -what was reserved),
-- and on settlement p_charge, the actual cost, written to the credit ledger
-- once per reservation (a repeat changes neither ledger nor balance). Fires
-- the credits.threshold alerts the change crossed, as fractions of the
-- balance the last top-up left. The balance may go negative by what a
-- settlement used beyond its reservation; the next admission then refuses.
CREATE OR REPLACE FUNCTION lq_credit_apply(
    p_tenant         text,
    p_reservation_id uuid,
    p_reserved_delta numeric,
    p_charge         numeric
) RETURNS credit_accounts
LANGUAGE plpgsql
AS $$
DECLARE
    now_ts  constant timestamptz := clock_timestamp();
    before  credit_accounts;
    after   credit_accounts;
    charged numeric := 0;
BEGIN
    INSERT INTO credit_accounts (tenant) VALUES (p_tenant) ON CONFLICT (tenant) DO NOTHING;
    SELECT * INTO before FROM credit_accounts WHERE tenant = p_tenant FOR UPDATE;
    IF p_charge IS NOT NULL AND p_reservation_id IS NOT NULL THEN
        INSERT INTO credit_ledger (tenant, entry_kind, amount, balance_after, reservation_id)
        VALUES (p_tenant, 'charge', -p_charge, before.balance - p_charge, p_reservation_id)
        ON CONFLICT ON CONSTRAINT credit_ledger_charge_once DO NOTHING;
        IF FOUND THEN
            charged := p_charge;
        END IF;
    END IF;
    UPDATE credit_accounts AS a
       SET reserved = greatest(a.reserved + coalesce(p_reserved_delta, 0), 0),
           balance = a.balance - charged,
           updated_at = now_ts
     WHERE a.tenant = p_tenant
    RETURNING * INTO after;
    IF before.funded_at IS NOT NULL THEN
        PERFORM lq_fire_crossed('credits.threshold', p_tenant, 'credits:' || p_tenant,
                                after.alerts, after.funded_at, NULL,
                                before.funded_balance - (before.balance - before.reserved),
                                after.funded_balance - (after.balance - after.reserved),
                                after.funded_balance, now_ts,
                                '{"unit": "credits"}');
    END IF;
    RETURN after;
END
$$;


-- `llmquota audit`'s check of prepaid credits against the invoice: for
-- every credit charge, what the reservation's ledger rows cost at the price
-- the invoice applies to them (lq_cost at each row's recorded_at, plus a
-- price the row carries itself, a response cache hit's price_usd: the rule
-- of reporting.ledger_entries) against the amount charged, in millionths of
-- the currency, compared exactly. They differ when a price was backdated
-- over usage already charged (lq_set_price), or when a model had no price
-- at settlement and the credits held were charged instead.
--
-- Only charges of the current and the previous UTC month: older months are
-- closed, their prices can no longer change (lq_set_price refuses), so a
-- check there would find what the last audit found.
CREATE OR REPLACE FUNCTION lq_audit_credit_charges()
RETURNS TABLE (check_name text, subject text, expected bigint, actual bigint)
LANGUAGE plpgsql STABLE
AS $$
#variable_conflict use_column
DECLARE
    since constant timestamptz := (date_trunc('month', clock_timestamp() AT TIME ZONE 'UTC')
                                   - interval '1 month') AT TIME ZONE 'UTC';
    charged uuid[];
    models  text[];
    inputs  bigint[];
    outputs bigint[];
    ats     timestamptz[];
    own     numeric[];
    costs   numeric[];
BEGIN
    -- The charged reservations' ledger rows, found through their receipts
    -- (primary key on reservation_id), then by the ledger's key; priced
    -- apart (lq_costs says why).
    SELECT array_agg(rc.reservation_id), array_agg(l.model), array_agg(l.input_tokens),
           array_agg(l.output_tokens), array_agg(l.recorded_at), array_agg(l.price_usd)
      INTO charged, models, inputs, outputs, ats, own
      FROM credit_ledger AS c
           JOIN ledger_receipts AS rc ON rc.reservation_id = c.reservation_id
           JOIN usage_ledger AS l ON l.entry_id = rc.entry_id AND l.recorded_at = rc.recorded_at
     WHERE c.entry_kind = 'charge' AND c.recorded_at >= since;
    costs := lq_costs(models, inputs, outputs, ats);
    RETURN QUERY
    WITH priced AS (
        SELECT u.reservation_id,
               sum(CASE WHEN u.own IS NULL THEN u.cost
                        ELSE coalesce(u.cost, 0) + u.own END) AS cost_usd
          FROM unnest(charged, costs, own)
               AS u(reservation_id, cost, own)
         GROUP BY u.reservation_id
    )
    SELECT 'credit_charge', format('reservation %s (tenant %s, millionths)', c.reservation_id, c.tenant),
           round(coalesce(inv.cost_usd, 0) * 1000000)::bigint, round(-c.amount * 1000000)::bigint
      FROM credit_ledger AS c
           LEFT JOIN priced AS inv ON inv.reservation_id = c.reservation_id
     WHERE c.entry_kind = 'charge'
       AND c.recorded_at >= since
       AND round(coalesce(inv.cost_usd, 0) * 1000000) <> round(-c.amount * 1000000);
END
$$;


-- The service's writes of quotas, webhooks and their deliveries: functions,
-- not statements of alerts_queries.sql, because they stamp rows with the
-- database clock, read once into a variable here, on the node that holds the
-- rows (in a cell on Citus the call runs whole on the cell's node, and Citus
-- refuses a volatile function inside a modification of a distributed table).

-- Create or replace a quota of a tenant (p_route and p_key_id NULL), of one of
-- its routes, or of one of its keys (p_key_id: not revoked; no row
-- otherwise). created: whether the row is new (xmax = 0 only for a freshly
-- inserted row). The conflict clause reads the clock from the proposed row:
-- Citus loses a variable there.
CREATE OR REPLACE FUNCTION lq_put_quota(
    p_tenant text, p_route text, p_name text, p_period text, p_timezone text,
    p_tokens bigint, p_cost numeric, p_models text[], p_model_patterns text[],
    p_alerts numeric[], p_enforce text, p_key_id bigint
) RETURNS TABLE (quota_id bigint, created boolean)
LANGUAGE plpgsql
AS $$
#variable_conflict use_column
DECLARE
    now_ts constant timestamptz := clock_timestamp();
BEGIN
    IF p_key_id IS NOT NULL AND NOT EXISTS (
        SELECT 1 FROM api_keys AS k
         WHERE k.key_id = p_key_id AND k.tenant = p_tenant AND k.revoked_at IS NULL) THEN
        RETURN;
    END IF;
    RETURN QUERY
    INSERT INTO quotas AS q (tenant, route, name, period, timezone, tokens, cost, models,
                             model_patterns, alerts, enforce, api_key_id, created_at,
                             updated_at)
    VALUES (p_tenant, p_route, p_name, p_period, p_timezone, p_tokens, p_cost, p_models,
            p_model_patterns, p_alerts, p_enforce, p_key_id, now_ts, now_ts)
    ON CONFLICT (tenant, (coalesce(route, '')), (coalesce(api_key_id, 0)), name) DO UPDATE
       SET period = excluded.period, timezone = excluded.timezone, tokens = excluded.tokens,
           cost = excluded.cost, models = excluded.models,
           model_patterns = excluded.model_patterns, alerts = excluded.alerts,
           enforce = excluded.enforce, updated_at = excluded.updated_at
    RETURNING q.quota_id, (q.xmax = 0);
END
$$;


-- Create or replace a webhook; created: whether it is new. The conflict
-- clause reads the clock from the proposed row, as lq_put_quota's.
CREATE OR REPLACE FUNCTION lq_put_webhook(p_name text, p_url text, p_secret text,
                                          p_tenant text)
RETURNS TABLE (created boolean, created_at timestamptz, updated_at timestamptz)
LANGUAGE plpgsql
AS $$
#variable_conflict use_column
DECLARE
    now_ts constant timestamptz := clock_timestamp();
BEGIN
    RETURN QUERY
    INSERT INTO webhooks AS w (name, url, secret, tenant, created_at, updated_at)
    VALUES (p_name, p_url, p_secret, p_tenant, now_ts, now_ts)
    ON CONFLICT (name) DO UPDATE
       SET url = excluded.url, secret = excluded.secret, tenant = excluded.tenant,
           updated_at = excluded.updated_at
    RETURNING (w.xmax = 0), w.created_at, w.updated_at;
END
$$;


-- Claim up to p_limit due deliveries for this loop: each claimed row is locked
-- (SKIP LOCKED: another loop takes other rows, never waits for these), its
-- attempt counted, and moved p_lease_seconds ahead, so that no loop claims it
-- again while this one sends. If this loop dies, the delivery is due again
-- when that lease passes: at least once, and the event id lets a receiver
-- drop the repeat. At most p_per_webhook deliveries of one webhook are in
-- flight in this loop: p_busy_webhooks/p_busy_counts are the webhooks it is
-- sending to now and how many each, and a webhook gets only the oldest of its
-- due rows that fit the rest. So a receiver that answers slowly holds a few
-- of the loop's slots, never the batch.
CREATE OR REPLACE FUNCTION lq_claim_deliveries(
    p_limit integer, p_lease_seconds float8, p_per_webhook integer,
    p_busy_webhooks text[], p_busy_counts integer[]
) RETURNS TABLE (event_id uuid, webhook text, attempts integer, url text, secret text,
                 age_seconds float8, event_type text, tenant text, subject text,
                 threshold numeric, window_start timestamptz, window_end timestamptz,
                 usage numeric, limit_value numeric, projected_exhaustion_at timestamptz,
                 payload jsonb)
LANGUAGE plpgsql
AS $$
#variable_conflict use_column
DECLARE
    now_ts constant timestamptz := clock_timestamp();
BEGIN
    RETURN QUERY
    WITH ranked AS (
        SELECT d.event_id, d.webhook,
               row_number() OVER (PARTITION BY d.webhook ORDER BY d.next_attempt_at) AS nth
          FROM alert_deliveries AS d
         WHERE d.delivered_at IS NULL
           AND d.gave_up_at IS NULL
           AND d.next_attempt_at <= now_ts
    ), fitting AS (
        SELECT r.event_id, r.webhook
          FROM ranked AS r
               LEFT JOIN unnest(p_busy_webhooks, p_busy_counts) AS busy(webhook, in_flight)
                      ON busy.webhook = r.webhook
         WHERE r.nth <= p_per_webhook - coalesce(busy.in_flight, 0)
    ), due AS (
        -- The due conditions again on the locked row: another loop may have
        -- claimed it since `ranked` read it.
        SELECT d.event_id, d.webhook
          FROM alert_deliveries AS d
               JOIN fitting AS f ON f.event_id = d.event_id AND f.webhook = d.webhook
         WHERE d.delivered_at IS NULL
           AND d.gave_up_at IS NULL
           AND d.next_attempt_at <= now_ts
         ORDER BY d.next_attempt_at
         LIMIT p_limit
           FOR UPDATE OF d SKIP LOCKED
    ), claimed AS (
        UPDATE alert_deliveries AS d
           SET attempts = d.attempts + 1,
               next_attempt_at = now_ts + make_interval(secs => p_lease_seconds),
               last_attempt_at = now_ts
          FROM due
         WHERE d.event_id = due.event_id AND d.webhook = due.webhook
        RETURNING d.event_id, d.webhook, d.attempts, d.created_at
    )
    SELECT c.event_id, c.webhook, c.attempts, w.url, w.secret,
           extract(epoch FROM now_ts - c.created_at)::float8,
           o.event_type, o.tenant, o.subject, o.threshold, o.window_start, o.window_end,
           o.usage, o.limit_value, o.projected_exhaustion_at, o.payload
      FROM claimed AS c
           JOIN webhooks AS w ON w.name = c.webhook
           JOIN alert_outbox AS o ON o.event_id = c.event_id;
END
$$;


-- Record one attempt (p_attempt, the attempt number the claim gave):
-- delivered (p_delivered), due again in p_retry_seconds, or given up
-- (p_retry_seconds NULL). Only the holder of the latest claim changes the
-- delivery (a loop whose lease ran out and was overtaken changes nothing);
-- every attempt gets its row either way. updated: whether the delivery row
-- changed.
CREATE OR REPLACE FUNCTION lq_record_delivery(
    p_event_id uuid, p_webhook text, p_attempt integer, p_status integer, p_error text,
    p_delivered boolean, p_retry_seconds float8, p_duration_ms integer
) RETURNS TABLE (updated boolean)
LANGUAGE plpgsql
AS $$
#variable_conflict use_column
DECLARE
    now_ts constant timestamptz := clock_timestamp();
    -- Worked out here, not in the UPDATE: Citus refuses a CASE whose branches
    -- call a function that is not immutable (timestamptz + interval is stable).
    delivered_stamp constant timestamptz := CASE WHEN p_delivered THEN now_ts END;
    gave_up_stamp constant timestamptz :=
        CASE WHEN NOT p_delivered AND p_retry_seconds IS NULL THEN now_ts END;
    retry_at constant timestamptz :=
        CASE WHEN NOT p_delivered THEN now_ts + make_interval(secs => p_retry_seconds) END;
    changed boolean;
BEGIN
    UPDATE alert_deliveries AS d
       SET delivered_at = delivered_stamp,
           gave_up_at = gave_up_stamp,
           next_attempt_at = coalesce(retry_at, d.next_attempt_at),
           last_status = p_status,
           last_error = p_error
     WHERE d.event_id = p_event_id
       AND d.webhook = p_webhook
       AND d.attempts = p_attempt
       AND d.delivered_at IS NULL
       AND d.gave_up_at IS NULL;
    changed := FOUND;
    IF EXISTS (SELECT 1 FROM alert_deliveries AS d
                WHERE d.event_id = p_event_id AND d.webhook = p_webhook) THEN
        INSERT INTO alert_delivery_attempts (event_id, webhook, attempt, status, error,
                                             duration_ms)
        VALUES (p_event_id, p_webhook, p_attempt, p_status, p_error, p_duration_ms)
        ON CONFLICT DO NOTHING;
    END IF;
    RETURN QUERY SELECT changed;
END
$$;


-- Forget the episode state of what the detector no longer watches (a ceiling
-- deleted, a threshold or a bucket removed): the rows none of the samples
-- (p_ceilings, p_dimensions, p_thresholds) names, of a read at p_read_at
-- (NULL: the read found no ceiling; now), and that no read since has touched
-- (a worker whose read is older than another's removes nothing the newer one
-- recorded).
CREATE OR REPLACE FUNCTION lq_prune_ceiling_alert_states(
    p_ceilings text[], p_dimensions text[], p_thresholds numeric[], p_read_at timestamptz
) RETURNS TABLE (ceiling text)
LANGUAGE plpgsql
AS $$
#variable_conflict use_column
DECLARE
    read_at constant timestamptz := coalesce(p_read_at, clock_timestamp());
BEGIN
    RETURN QUERY
    DELETE FROM ceiling_alert_episodes AS e
     WHERE e.sampled_at < read_at
       AND NOT EXISTS (
               SELECT 1
                 FROM unnest(p_ceilings, p_dimensions, p_thresholds)
                      AS s(ceiling, dimension, threshold)
                WHERE s.ceiling = e.ceiling AND s.dimension = e.dimension
                  AND s.threshold = e.threshold)
    RETURNING e.ceiling;
END
$$;
