"""Provider ceilings alert on pressure: thresholds per ceiling, one state row per threshold.

- `limit_layers` gains, for ceiling layers:
  - `alert_at`: the utilization fractions that alert (NULL: each step of the
    shedding ladder; empty: none), increasing, each in (0, 1];
  - `alert_hysteresis`: how far below a threshold utilization must fall
    before an episode can end (NULL: LLMQUOTA_CEILING_ALERT_HYSTERESIS);
  - `alert_quiet_seconds`: for how long it must stay there (NULL:
    LLMQUOTA_CEILING_ALERT_QUIET_SECONDS).
  No CHECK guards them: a CHECK on limit_layers is evaluated by every UPDATE
  of the table, and admission updates it in every batch; the admin service
  validates them (llmquota.domain.plans.Ceiling), as it does the ladder.
- `ceiling_alert_episodes`: one row per (ceiling, dimension, threshold), the
  state the detector of every worker (llmquota.admin.ceiling_alerts) moves
  with one guarded upsert: `episode_start` is the start of the episode open
  now (NULL: none), `below_since` when utilization was first seen below
  threshold minus hysteresis in a run of such samples, `sampled_at` the
  database clock of the newest sample applied (an older one changes
  nothing), `last_ended_at` when the last episode ended. The episode's
  alert is the `alert_outbox` row of
  (ceiling.utilization, subject, threshold, episode_start), written in the
  same statement that opened it.

Revision ID: 0023
Revises: 0022
Create Date: 2026-12-03
"""

from llmquota.store.migration_support import execute_script

revision = "0023"
down_revision = "0022"
branch_labels = None
depends_on = None

SCHEMA = r"""
ALTER TABLE limit_layers
    ADD COLUMN alert_at numeric[],
    ADD COLUMN alert_hysteresis double precision,
    ADD COLUMN alert_quiet_seconds double precision;

CREATE TABLE ceiling_alert_episodes (
    ceiling         text NOT NULL CHECK (ceiling ~ '^[A-Za-z0-9._:-]{1,128}$'),
    dimension       text NOT NULL CHECK (dimension IN ('tokens', 'requests')),
    threshold       numeric NOT NULL CHECK (threshold > 0 AND threshold <= 1),
    -- The hysteresis and quiet time of the newest sample (the ceiling's or
    -- the worker's defaults), so that the upsert's EXCLUDED row carries them.
    hysteresis      double precision NOT NULL CHECK (hysteresis >= 0 AND hysteresis < 1),
    quiet_seconds   double precision NOT NULL CHECK (quiet_seconds >= 0),
    episode_start   timestamptz,
    below_since     timestamptz,
    last_ended_at   timestamptz,
    sampled_at      timestamptz NOT NULL,
    utilization     double precision NOT NULL,
    PRIMARY KEY (ceiling, dimension, threshold),
    CONSTRAINT ceiling_alert_episodes_below CHECK (below_since IS NULL OR episode_start IS NOT NULL)
);
"""

DOWNGRADE = r"""
-- lq_put_ceiling writes the columns that go (migrations/README.md): it goes
-- with them, and plans.sql is applied again by the next upgrade to head.
DROP FUNCTION IF EXISTS lq_put_ceiling(text, text[], bigint, bigint, bigint, bigint, integer,
    double precision[], smallint[], bigint[], numeric[], double precision, double precision);
DELETE FROM schema_repeatables WHERE name = 'plans.sql';
DROP TABLE IF EXISTS ceiling_alert_episodes;
ALTER TABLE limit_layers
    DROP COLUMN alert_at,
    DROP COLUMN alert_hysteresis,
    DROP COLUMN alert_quiet_seconds;
"""


def upgrade() -> None:
    execute_script(SCHEMA)


def downgrade() -> None:
    execute_script(DOWNGRADE)
