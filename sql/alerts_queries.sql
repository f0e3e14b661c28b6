-- Named statements of quotas, credits, webhooks and alert delivery (the
-- AlertStore's). The helpers admission and settlement will call in their
-- own transaction are functions in quotas.sql; these are the administration
-- around them and the delivery loop's claim and record.

-- put_quota --
-- Create or replace a quota of a tenant ($2 and $12 NULL), of one of its
-- routes, or of one of its keys ($12: not revoked; no row otherwise).
-- created: whether the row is new (xmax = 0 only for a freshly inserted row).
INSERT INTO quotas AS q (tenant, route, name, period, timezone, tokens, cost, models,
                         model_patterns, alerts, enforce, api_key_id)
SELECT $1::text, $2::text, $3::text, $4::text, $5::text, $6::bigint, $7::numeric, $8::text[],
       $9::text[], $10::numeric[], $11::text, $12::bigint
 WHERE $12::bigint IS NULL
    OR EXISTS (SELECT 1 FROM api_keys AS k
                WHERE k.key_id = $12::bigint AND k.tenant = $1::text AND k.revoked_at IS NULL)
ON CONFLICT (tenant, (coalesce(route, '')), (coalesce(api_key_id, 0)), name) DO UPDATE
   SET period = EXCLUDED.period, timezone = EXCLUDED.timezone, tokens = EXCLUDED.tokens,
       cost = EXCLUDED.cost, models = EXCLUDED.models, model_patterns = EXCLUDED.model_patterns,
       alerts = EXCLUDED.alerts, enforce = EXCLUDED.enforce, updated_at = clock_timestamp()
RETURNING q.quota_id, (q.xmax = 0) AS created

-- list_quotas --
-- A tenant's quotas ($2 and $5 NULL and $3 false: all, its routes' and keys'
-- too; else those of route $2, of key $5, or of the tenant itself when $3),
-- optionally one ($4), with the current window's usage (zero when the window
-- has no row yet).
SELECT q.quota_id, q.tenant, q.route, q.api_key_id, q.name, q.period, q.timezone, q.tokens,
       q.cost, q.models, q.alerts, q.enforce, q.created_at, q.updated_at,
       cw.window_start, cw.window_end,
       coalesce(w.reserved_tokens + w.charged_tokens, 0) AS usage_tokens,
       coalesce(w.reserved_cost + w.charged_cost, 0) AS usage_cost
  FROM quotas AS q
       CROSS JOIN LATERAL lq_quota_window(q.period, q.timezone, clock_timestamp()) AS cw
       LEFT JOIN quota_windows AS w
              ON w.quota_id = q.quota_id AND w.window_start = cw.window_start
 WHERE q.tenant = $1::text
   AND ($2::text IS NULL OR q.route = $2::text)
   AND ($5::bigint IS NULL OR q.api_key_id = $5::bigint)
   AND (NOT $3::boolean OR (q.route IS NULL AND q.api_key_id IS NULL))
   AND ($4::text IS NULL OR q.name = $4::text)
 ORDER BY q.route NULLS FIRST, q.api_key_id NULLS FIRST, q.name

-- delete_quota --
-- Delete one quota (of key $4, when given); its windows stay (quota_id set
-- NULL) for the reports.
DELETE FROM quotas
 WHERE tenant = $1::text AND coalesce(route, '') = coalesce($2::text, '') AND name = $3::text
   AND coalesce(api_key_id, 0) = coalesce($4::bigint, 0)
RETURNING quota_id

-- credit_topup --
-- Add credit once per reference (see lq_credit_topup).
SELECT * FROM lq_credit_topup($1::text, $2::numeric, $3::text)

-- credit_account --
-- A tenant's balance and reserved credit (no row: never topped up).
SELECT balance, reserved, funded_at, funded_balance
  FROM credit_accounts
 WHERE tenant = $1::text

-- credit_topups --
-- A tenant's last $2 top-ups, newest first.
SELECT entry_id, amount, reference, recorded_at, balance_after
  FROM credit_ledger
 WHERE tenant = $1::text AND entry_kind = 'topup'
 ORDER BY recorded_at DESC, entry_id DESC
 LIMIT $2::integer

-- put_webhook --
-- Create or replace a webhook; created: whether it is new.
INSERT INTO webhooks AS w (name, url, secret, tenant)
VALUES ($1::text, $2::text, $3::text, $4::text)
ON CONFLICT (name) DO UPDATE
   SET url = EXCLUDED.url, secret = EXCLUDED.secret, tenant = EXCLUDED.tenant,
       updated_at = clock_timestamp()
RETURNING (w.xmax = 0) AS created, w.created_at, w.updated_at

-- list_webhooks --
-- Webhooks (one when $1 is given), without their secrets.
SELECT name, url, tenant, created_at, updated_at
  FROM webhooks
 WHERE $1::text IS NULL OR name = $1::text
 ORDER BY name

-- delete_webhook --
-- Delete a webhook; its pending deliveries go with it.
DELETE FROM webhooks WHERE name = $1::text RETURNING name

-- fire_alert --
-- Put one alert into the outbox unless it fired already (see lq_fire_alert).
SELECT lq_fire_alert($1::text, $2::text, $3::text, $4::numeric, $5::timestamptz,
                     $6::timestamptz, $7::numeric, $8::numeric, $9::timestamptz,
                     $10::jsonb) AS event_id

-- list_alerts --
-- A tenant's last $2 alerts, newest first, with how their deliveries stand.
SELECT o.event_id, o.event_type, o.tenant, o.subject, o.threshold, o.window_start,
       o.window_end, o.usage, o.limit_value, o.projected_exhaustion_at, o.payload, o.created_at,
       count(d.webhook) AS deliveries,
       count(d.delivered_at) AS delivered,
       count(d.gave_up_at) AS gave_up
  FROM alert_outbox AS o
       LEFT JOIN alert_deliveries AS d ON d.event_id = o.event_id
 WHERE o.tenant = $1::text
 GROUP BY o.event_id
 ORDER BY o.created_at DESC, o.event_id
 LIMIT $2::integer

-- recent_alerts --
-- Every tenant's last $1 alerts, newest first, with how their deliveries
-- stand (list_alerts of alerts_queries.sql, for all tenants).
SELECT o.event_id, o.event_type, o.tenant, o.subject, o.threshold, o.window_start,
       o.window_end, o.usage, o.limit_value, o.projected_exhaustion_at, o.payload, o.created_at,
       count(d.webhook) AS deliveries,
       count(d.delivered_at) AS delivered,
       count(d.gave_up_at) AS gave_up
  FROM alert_outbox AS o
       LEFT JOIN alert_deliveries AS d ON d.event_id = o.event_id
 GROUP BY o.event_id
 ORDER BY o.created_at DESC, o.event_id
 LIMIT $1::integer

-- claim_deliveries --
-- Claim up to $1 due deliveries for this loop: each claimed row is locked
-- (SKIP LOCKED: another loop takes other rows, never waits for these), its
-- attempt counted, and moved $2 seconds ahead, so that no loop claims it
-- again while this one sends. If this loop dies, the delivery is due again
-- when that lease passes: at least once, and the event id lets a receiver
-- drop the repeat.
-- At most $3 deliveries of one webhook are in flight in this loop: $4/$5
-- are the webhooks it is sending to now and how many each, and a webhook
-- gets only the oldest of its due rows that fit the rest. So a receiver
-- that answers slowly holds a few of the loop's slots, never the batch.
WITH ranked AS (
    SELECT d.event_id, d.webhook,
           row_number() OVER (PARTITION BY d.webhook ORDER BY d.next_attempt_at) AS nth
      FROM alert_deliveries AS d
     WHERE d.delivered_at IS NULL
       AND d.gave_up_at IS NULL
       AND d.next_attempt_at <= clock_timestamp()
), fitting AS (
    SELECT r.event_id, r.webhook
      FROM ranked AS r
           LEFT JOIN unnest($4::text[], $5::integer[]) AS busy(webhook, in_flight)
                  ON busy.webhook = r.webhook
     WHERE r.nth <= $3::integer - coalesce(busy.in_flight, 0)
), due AS (
    -- The due conditions again on the locked row: another loop may have
    -- claimed it since `ranked` read it.
    SELECT d.event_id, d.webhook
      FROM alert_deliveries AS d
           JOIN fitting AS f ON f.event_id = d.event_id AND f.webhook = d.webhook
     WHERE d.delivered_at IS NULL
       AND d.gave_up_at IS NULL
       AND d.next_attempt_at <= clock_timestamp()
     ORDER BY d.next_attempt_at
     LIMIT $1::integer
       FOR UPDATE OF d SKIP LOCKED
), claimed AS (
    UPDATE alert_deliveries AS d
       SET attempts = d.attempts + 1,
           next_attempt_at = clock_timestamp() + make_interval(secs => $2::float8),
           last_attempt_at = clock_timestamp()
      FROM due
     WHERE d.event_id = due.event_id AND d.webhook = due.webhook
    RETURNING d.event_id, d.webhook, d.attempts, d.created_at
)
SELECT c.event_id, c.webhook, c.attempts, w.url, w.secret,
       extract(epoch FROM clock_timestamp() - c.created_at)::float8 AS age_seconds,
       o.event_type, o.tenant, o.subject, o.threshold, o.window_start, o.window_end, o.usage,
       o.limit_value, o.projected_exhaustion_at, o.payload
  FROM claimed AS c
       JOIN webhooks AS w ON w.name = c.webhook
       JOIN alert_outbox AS o ON o.event_id = c.event_id

-- record_delivery --
-- Record one attempt ($3, the attempt number the claim gave): delivered ($6),
-- due again in $7 seconds, or given up ($7 NULL). Only the holder of the
-- latest claim changes the delivery (a loop whose lease ran out and was
-- overtaken changes nothing); every attempt gets its row either way.
-- updated: whether the delivery row changed.
WITH updated AS (
    UPDATE alert_deliveries AS d
       SET delivered_at = CASE WHEN $6::boolean THEN clock_timestamp() END,
           gave_up_at = CASE WHEN NOT $6::boolean AND $7::float8 IS NULL
                             THEN clock_timestamp() END,
           next_attempt_at = CASE WHEN NOT $6::boolean AND $7::float8 IS NOT NULL
                                  THEN clock_timestamp() + make_interval(secs => $7::float8)
                                  ELSE d.next_attempt_at END,
           last_status = $4::integer,
           last_error = $5::text
     WHERE d.event_id = $1::uuid
       AND d.webhook = $2::text
       AND d.attempts = $3::integer
       AND d.delivered_at IS NULL
       AND d.gave_up_at IS NULL
    RETURNING 1
), attempt AS (
    INSERT INTO alert_delivery_attempts (event_id, webhook, attempt, status, error, duration_ms)
    SELECT $1::uuid, $2::text, $3::integer, $4::integer, $5::text, $8::integer
     WHERE EXISTS (SELECT 1 FROM alert_deliveries AS d
                    WHERE d.event_id = $1::uuid AND d.webhook = $2::text)
    ON CONFLICT DO NOTHING
    RETURNING 1
)
SELECT EXISTS (SELECT 1 FROM updated) AS updated

-- record_ceiling_samples --
-- Apply the ceiling alert detector's samples (domain/ceiling_alerts.py) to
-- their episodes, and put the alert of each episode this statement opens
-- into the outbox, all in this one statement's transaction: a worker killed
-- during it leaves neither, and one that committed left both.
-- $1..$9 are parallel: ceiling, dimension, threshold, utilization, usage and
-- capacity of the bucket, hysteresis, quiet seconds, and the database clock
-- of the read the sample is of.
-- Concurrency: every worker's detector runs this. The state rows are locked
-- in the samples' order, (ceiling, dimension, threshold) in every worker, so
-- two never deadlock. A sample no newer than the row's last one changes
-- nothing (the WHERE): a worker that read before another and writes after it
-- cannot undo the other's step. Two workers inserting a new row meet on its
-- key: the second waits, then updates the first's row under the same guard.
-- So an episode opens once, and its alert (lq_fire_alert: the outbox key is
-- type, subject, threshold and window_start, the episode's start) is
-- written once; what a receiver may see twice is a delivery, by event id.
WITH sample AS (
    SELECT s.*
      FROM unnest($1::text[], $2::text[], $3::numeric[], $4::float8[], $5::numeric[],
                  $6::numeric[], $7::float8[], $8::float8[], $9::timestamptz[])
           WITH ORDINALITY AS s(ceiling, dimension, threshold, utilization, usage, capacity,
                                hysteresis, quiet_seconds, sampled_at, ord)
), moved AS (
    INSERT INTO ceiling_alert_episodes AS e
           (ceiling, dimension, threshold, hysteresis, quiet_seconds, episode_start,
            below_since, last_ended_at, sampled_at, utilization)
    SELECT s.ceiling, s.dimension, s.threshold, s.hysteresis, s.quiet_seconds,
           st.episode_start, st.below_since, st.last_ended_at, s.sampled_at, s.utilization
      FROM sample AS s
           CROSS JOIN LATERAL lq_ceiling_episode_step(NULL, NULL, NULL, s.utilization,
                                                      s.threshold, s.hysteresis,
                                                      s.quiet_seconds, s.sampled_at) AS st
     ORDER BY s.ord
    ON CONFLICT (ceiling, dimension, threshold) DO UPDATE
       SET (episode_start, below_since, last_ended_at) = (
               SELECT st.episode_start, st.below_since, st.last_ended_at
                 FROM lq_ceiling_episode_step(e.episode_start, e.below_since, e.last_ended_at,
                                              EXCLUDED.utilization, EXCLUDED.threshold,
                                              EXCLUDED.hysteresis, EXCLUDED.quiet_seconds,
                                              EXCLUDED.sampled_at) AS st),
           hysteresis = EXCLUDED.hysteresis,
           quiet_seconds = EXCLUDED.quiet_seconds,
           sampled_at = EXCLUDED.sampled_at,
           utilization = EXCLUDED.utilization
     WHERE EXCLUDED.sampled_at > e.sampled_at
    RETURNING e.ceiling, e.dimension, e.threshold, e.episode_start, e.sampled_at
), fired AS (
    -- An episode this statement opened starts at its sample's time (one open
    -- before has an older start: every later sample is newer than it).
    SELECT m.ceiling, m.dimension, m.threshold, m.episode_start,
           lq_fire_alert('ceiling.utilization', NULL,
                         'ceiling:' || m.ceiling || ':' || m.dimension, m.threshold,
                         m.episode_start, NULL, s.usage, s.capacity, NULL,
                         jsonb_build_object('ceiling', m.ceiling, 'dimension', m.dimension,
                                            'utilization', round(s.utilization::numeric, 6)))
               AS event_id
      FROM moved AS m
           JOIN sample AS s
             ON s.ceiling = m.ceiling AND s.dimension = m.dimension
            AND s.threshold = m.threshold
     WHERE m.episode_start = m.sampled_at
)
SELECT f.ceiling, f.dimension, f.threshold, f.episode_start, f.event_id
  FROM fired AS f
 ORDER BY f.ceiling, f.dimension, f.threshold

-- prune_ceiling_alert_states --
-- Forget the episode state of what the detector no longer watches (a
-- ceiling deleted, a threshold or a bucket removed): the rows none of the
-- samples $1/$2/$3 names, of a read at $4 (NULL: the read found no ceiling;
-- now), and that no read since has touched (a worker whose read is older than
-- another's removes nothing the newer one recorded).
DELETE FROM ceiling_alert_episodes AS e
 WHERE e.sampled_at < coalesce($4::timestamptz, clock_timestamp())
   AND NOT EXISTS (
           SELECT 1
             FROM unnest($1::text[], $2::text[], $3::numeric[]) AS s(ceiling, dimension, threshold)
            WHERE s.ceiling = e.ceiling AND s.dimension = e.dimension
              AND s.threshold = e.threshold)
RETURNING e.ceiling
