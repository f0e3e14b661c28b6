"""One function takes the idempotency-key locks for lq_admit and outage recording.

lq_admit and lq_record_outage_admissions both locked (tenant, key) pairs
with the same statement; it is now lq_lock_idempotency_keys, so the two can
never drift apart in how (or in what order) they lock. lq_finish's `expire`
on a finished reservation now answers 'conflict' instead of 'not_due'.

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-30
"""

from llmquota.store.migration_support import execute_script
from llmquota.store.sqlfiles import script

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    execute_script(script("admission.sql"))
    execute_script(script("reliability.sql"))
    # A new function: roles.sql grants it to the application role.
    execute_script(script("roles.sql"))


def downgrade() -> None:
    # The function bodies in the files are the only ones there are: nothing to
    # restore. lq_lock_idempotency_keys stays (revision 0001's downgrade drops it).
    pass
