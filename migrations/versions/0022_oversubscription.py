"""The oversubscription report's views stand on columns of older revisions.

The report (issue 24) is repeatable code: sql/reports/60_oversubscription.sql
defines the views reporting.provider_ceilings, ceiling_tenant_limits,
ceiling_activity and ceiling_oversubscription and the function
reporting.oversubscription. Its views read columns that revisions 0008 (the
ceiling columns of limit_layers, `plan`) and 0018 (`tenants.suspended_at`)
added, and the downgrades of those revisions, frozen, drop them without
knowing of these views: PostgreSQL would refuse (a view depends on the
column). So this revision's downgrade drops the report first and forgets its
script's checksum, as migrations/README.md says a migration does with an
object a repeatable script owns; the next upgrade to head applies the script
again. The upgrade changes no table.

Revision ID: 0022
Revises: 0021
Create Date: 2026-12-03
"""

from llmquota.store.migration_support import execute_script

revision = "0022"
down_revision = "0021"
branch_labels = None
depends_on = None

DOWNGRADE = r"""
-- The view over the function first, then the function over the views.
DROP VIEW IF EXISTS reporting.ceiling_oversubscription;
DROP FUNCTION IF EXISTS reporting.oversubscription(integer, numeric, numeric, text);
DROP VIEW IF EXISTS reporting.ceiling_activity, reporting.ceiling_tenant_limits,
    reporting.provider_ceilings;
-- Forget the script, so the next upgrade to head re-creates its objects.
DELETE FROM schema_repeatables WHERE name = 'reports/60_oversubscription.sql';
"""


def upgrade() -> None:
    pass


def downgrade() -> None:
    execute_script(DOWNGRADE)
