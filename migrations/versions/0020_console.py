"""The console's tables: per-minute decision counts and console sessions.

The console (issue 24) charts decisions per minute by outcome and reason. No
worker can know them from its own traffic, so each worker counts its
decisions in memory and adds them to `decision_counts` every few seconds with
one upsert (store/console.py): one row per (minute, tenant, outcome, reason),
the sum over every worker. The primary key leads with the minute, so the
chart's "last hour" and the pruning of minutes older than two days are range
scans of it.

A console session is a row of `console_sessions`: the browser holds an opaque
random token, the table its SHA-256 only, with the CSRF token of the
session's forms and the admin key it was opened with (NULL: the configured
LLMQUOTA_ADMIN_KEY), so that every worker knows every session and signing out
or revoking that key ends it.

Revision ID: 0020
Revises: 0019
Create Date: 2026-12-02
"""

from llmquota.store.migration_support import execute_script

revision = "0020"
down_revision = "0019"
branch_labels = None
depends_on = None

SCHEMA = r"""
CREATE TABLE decision_counts (
    minute    timestamptz NOT NULL,
    tenant    text        NOT NULL,
    outcome   text        NOT NULL,
    reason    text        NOT NULL,
    decisions bigint      NOT NULL CHECK (decisions >= 0),
    PRIMARY KEY (minute, tenant, outcome, reason)
);

CREATE TABLE console_sessions (
    token_digest bytea       PRIMARY KEY,
    csrf_token   text        NOT NULL,
    key_id       bigint      REFERENCES api_keys (key_id) ON DELETE CASCADE,
    created_at   timestamptz NOT NULL DEFAULT now(),
    expires_at   timestamptz NOT NULL
);
CREATE INDEX console_sessions_expires ON console_sessions (expires_at);
"""

DOWNGRADE = r"""
DROP TABLE IF EXISTS console_sessions;
DROP TABLE IF EXISTS decision_counts;
"""


def upgrade() -> None:
    execute_script(SCHEMA)


def downgrade() -> None:
    execute_script(DOWNGRADE)
