-- Named statements of quotas, credits, webhooks and alert delivery (the
-- AlertStore's). The helpers admission and settlement will call in their
-- own transaction are functions in quotas.sql; these are the administration
-- around them and the delivery loop's claim and record.

-- put_quota --
-- Create or replace a quota of a tenant, a route or a key (see lq_put_quota);
-- no row when key $12 is not the tenant's or is revoked.
SELECT * FROM lq_put_quota($1::text, $2::text, $3::text, $4::text, $5::text, $6::bigint,
                            $7::numeric, $8::text[], $9::text[], $10::numeric[], $11::text,
                            $12::bigint)

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
-- Create or replace a webhook (see lq_put_webhook); created: whether it is new.
SELECT * FROM lq_put_webhook($1::text, $2::text, $3::text, $4::text)

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
-- Claim up to $1 due deliveries for this loop for $2 seconds, at most $3 of
-- one webhook in flight counting the loop's own ($4/$5) (see lq_claim_deliveries).
SELECT * FROM lq_claim_deliveries($1::integer, $2::float8, $3::integer, $4::text[],
                                   $5::integer[])

-- record_delivery --
-- Record attempt $3 of delivering event $1 to webhook $2 (see
-- lq_record_delivery); updated: whether the delivery row changed.
SELECT * FROM lq_record_delivery($1::uuid, $2::text, $3::integer, $4::integer, $5::text,
                                  $6::boolean, $7::float8, $8::integer)

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
-- Forget the episode state the detector no longer watches (see
-- lq_prune_ceiling_alert_states).
SELECT * FROM lq_prune_ceiling_alert_states($1::text[], $2::text[], $3::numeric[],
                                             $4::timestamptz)
