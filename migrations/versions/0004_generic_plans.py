"""Group admission: the admission functions plan their statements generically.

Batches of many distinct tenants made the custom plans inside lq_admit choose
a sequential scan of limit_layers; `SET plan_cache_mode = force_generic_plan`
on lq_admit, lq_finish and lq_credit_layers keeps them on index probes and
saves re-planning on every call. The function bodies are unchanged.

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-30
"""

from alembic import op

from llmquota.store.migration_support import execute_script
from llmquota.store.sqlfiles import script

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None

FUNCTIONS = ("lq_admit", "lq_finish", "lq_credit_layers")


def upgrade() -> None:
    execute_script(script("admission.sql"))


def downgrade() -> None:
    for name in FUNCTIONS:
        op.execute(f"ALTER FUNCTION {name} RESET plan_cache_mode")
