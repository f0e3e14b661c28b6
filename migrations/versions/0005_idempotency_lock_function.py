"""One function takes the idempotency-key locks for lq_admit and outage recording.

lq_admit and lq_record_outage_admissions both locked (tenant, key) pairs
with the same statement; it is now lq_lock_idempotency_keys, so the two can
never drift apart in how (or in what order) they lock. lq_finish's `expire`
on a finished reservation now answers 'conflict' instead of 'not_due'.

A change of functions only: it lives in sql/admission.sql and
sql/reliability.sql, which the repeatable step applies (see
migrations/README.md). This revision changes no table, and is kept so that
the revision numbers stay what they were.

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-30
"""

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    pass


def downgrade() -> None:
    pass
