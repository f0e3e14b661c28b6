"""Group admission: the admission functions plan their statements generically.

Batches of many distinct tenants made the custom plans inside lq_admit choose
a sequential scan of limit_layers; `SET plan_cache_mode = force_generic_plan`
on lq_admit, lq_finish and lq_credit_layers keeps them on index probes and
saves re-planning on every call.

A change of functions only: it lives in sql/admission.sql, which the
repeatable step applies (see migrations/README.md). This revision changes no
table, and is kept so that the revision numbers stay what they were.

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-30
"""

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    pass


def downgrade() -> None:
    pass
