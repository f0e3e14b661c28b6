"""Weighted request cost: what one call counts as on request rates and concurrency.

- `limit_layers` gains, for tenant and route layers:
  - `request_cost`: how many requests one call of that tenant (route) counts
    as on every request-rate limit it meets (0: none; NULL: the tenant's,
    else 1);
  - `uses_concurrency`: whether a call takes an in-flight permit (NULL: the
    tenant's, else true).
  No CHECK guards them, as 0023 says of its columns: the admin service
  validates them (llmquota.domain.policy.Policy).
- `reservations` gains what the admission decided, so that a release,
  settlement or expiry gives back exactly what it took whatever the policy
  says by then: `request_cost` (the requests debited; a release gives them
  back) and `permits` (1 or 0: the permit it holds on each of its layers).
  Rows written before hold 1 and 1, as every admission did.

Revision ID: 0024
Revises: 0023
Create Date: 2026-12-03
"""

from llmquota.store.migration_support import execute_script

revision = "0024"
down_revision = "0023"
branch_labels = None
depends_on = None

SCHEMA = r"""
ALTER TABLE limit_layers
    ADD COLUMN request_cost integer,
    ADD COLUMN uses_concurrency boolean;

ALTER TABLE reservations
    ADD COLUMN request_cost integer NOT NULL DEFAULT 1,
    ADD COLUMN permits smallint NOT NULL DEFAULT 1;
"""

DOWNGRADE = r"""
-- The functions of these scripts read the columns that go (migrations/README.md):
-- the next upgrade to head applies them again.
DELETE FROM schema_repeatables
 WHERE name IN ('admission.sql', 'reliability.sql', 'plans.sql');
ALTER TABLE reservations
    DROP COLUMN request_cost,
    DROP COLUMN permits;
ALTER TABLE limit_layers
    DROP COLUMN request_cost,
    DROP COLUMN uses_concurrency;
"""


def upgrade() -> None:
    execute_script(SCHEMA)


def downgrade() -> None:
    execute_script(DOWNGRADE)
