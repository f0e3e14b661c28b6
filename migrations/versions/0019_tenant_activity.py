"""An index for a tenant's latest reservation: GET /v1/tenants shows last_activity_at.

The tenant directory (issue 22) shows, for each tenant of a page, when its
latest reservation was admitted. Without an index that is a scan of every
reservation per tenant; with (tenant, created_at) it is one backward step of
the index. Nothing else changes: no data moves, no function is frozen here.

Revision ID: 0019
Revises: 0017
Create Date: 2026-12-02
"""

from llmquota.store.migration_support import execute_script

revision = "0019"
down_revision = "0018"
branch_labels = None
depends_on = None

SCHEMA = r"""
CREATE INDEX reservations_tenant_created ON reservations (tenant, created_at);
"""

DOWNGRADE = r"""
DROP INDEX IF EXISTS reservations_tenant_created;
"""


def upgrade() -> None:
    execute_script(SCHEMA)


def downgrade() -> None:
    execute_script(DOWNGRADE)
