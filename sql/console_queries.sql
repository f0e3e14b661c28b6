-- Named statements of the web console (/console): the decision counts every
-- worker adds to, the reads of its pages that the admin API has no statement
-- for, and its sessions. All run by store/console.py.

-- add_decision_counts --
-- Add one worker's counts since its last flush ($1..$5: minute, tenant,
-- outcome, reason, decisions; each key once) and prune the minutes older than
-- $6 seconds by the database's clock. One statement per flush, never one per
-- request. Concurrency: two workers adding to the same keys lock those rows;
-- each worker sends its keys sorted (and the insert follows the ORDER BY), so
-- they lock them in the same order and never deadlock. The prune touches only
-- minutes far older than any a worker still adds to.
WITH pruned AS (
    DELETE FROM decision_counts
     WHERE minute < now() - make_interval(secs => $6::float8)
)
INSERT INTO decision_counts AS d (minute, tenant, outcome, reason, decisions)
SELECT c.minute, c.tenant, c.outcome, c.reason, c.decisions
  FROM unnest($1::timestamptz[], $2::text[], $3::text[], $4::text[], $5::bigint[])
       AS c (minute, tenant, outcome, reason, decisions)
 WHERE c.minute >= now() - make_interval(secs => $6::float8)
 ORDER BY c.minute, c.tenant, c.outcome, c.reason
    ON CONFLICT (minute, tenant, outcome, reason)
    DO UPDATE SET decisions = d.decisions + EXCLUDED.decisions

-- decisions_per_minute --
-- Decisions of every worker and tenant per minute, outcome and reason since
-- minute $1 (a range scan of the primary key).
SELECT minute, outcome, reason, sum(decisions)::bigint AS decisions
  FROM decision_counts
 WHERE minute >= $1::timestamptz
 GROUP BY minute, outcome, reason
 ORDER BY minute, outcome, reason

-- tenant_refusals --
-- Refusals of tenant $1 per minute and reason since minute $2, the latest
-- first, at most $3 rows.
SELECT minute, reason, sum(decisions)::bigint AS decisions
  FROM decision_counts
 WHERE minute >= $2::timestamptz
   AND tenant = $1::text
   AND outcome = 'refused'
 GROUP BY minute, reason
 ORDER BY minute DESC, reason
 LIMIT $3::integer

-- top_tenants_today --
-- The $1 tenants that used the most tokens today (UTC), with their cost, from
-- the finance report (reporting.top_tenants: the same figures finance sees).
SELECT t.tenant, t.requests, t.total_tokens, t.cost_usd, t.unpriced_tokens
  FROM reporting.top_tenants((now() AT TIME ZONE 'UTC')::date,
                             (now() AT TIME ZONE 'UTC')::date + 1) AS t
 ORDER BY t.total_tokens DESC, t.tenant
 LIMIT $1::integer

-- open_session --
-- Open a console session of $4 seconds for the admin key $3 (NULL: the
-- configured one): the token's digest $1 and its forms' CSRF token $2. The
-- expired sessions go in the same statement.
WITH expired AS (
    DELETE FROM console_sessions WHERE expires_at < now()
)
INSERT INTO console_sessions (token_digest, csrf_token, key_id, expires_at)
VALUES ($1::bytea, $2::text, $3::bigint, now() + make_interval(secs => $4::float8))

-- find_session --
-- The CSRF token of the live session with digest $1: not expired, and its
-- admin key (when stored) neither revoked nor expired. No row: signed out.
SELECT s.csrf_token
  FROM console_sessions AS s
       LEFT JOIN api_keys AS k ON k.key_id = s.key_id
 WHERE s.token_digest = $1::bytea
   AND s.expires_at > now()
   AND (s.key_id IS NULL
        OR (k.revoked_at IS NULL AND (k.expires_at IS NULL OR k.expires_at > now())))

-- close_session --
-- Sign out: the session with digest $1 ends.
DELETE FROM console_sessions WHERE token_digest = $1::bytea
