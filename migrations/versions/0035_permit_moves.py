"""In-flight permits moved between the slices of shared layers in cells.

A database of cells splits a shared layer's `max_in_flight` (the global
layer's, a provider ceiling's) into one slice per cell, as it splits its
tokens and requests. Until now only room moved between the slices (0034):
a cell whose tenants were busy refused at its own slice of the permits
while another cell's sat unused. The rebalancer now moves permits too,
debit then credit as it moves room:

- `limit_layers.in_flight_moved`: the permits the rebalancer moved into this
  row (negative: lent to other cells). `max_in_flight` includes them, so
  admission reads the slice's cap as before; the policy's own share is
  `max_in_flight - in_flight_moved`, and a policy write keeps what was moved
  (sql/global_layer.sql, sql/plans.sql).
- `budget_transfers.permits`: what a move took from its sender. A permit
  does not refill as room does, so a permit move is never given up: it
  stays in the journal until its receiver has it.

Revision ID: 0035
Revises: 0034
Create Date: 2026-12-07
"""

from llmquota.store.migration_support import execute_script

revision = "0035"
down_revision = "0034"
branch_labels = None
depends_on = None

SCHEMA = r"""
ALTER TABLE limit_layers ADD COLUMN in_flight_moved integer NOT NULL DEFAULT 0;
COMMENT ON COLUMN limit_layers.in_flight_moved IS 'permits the rebalancer moved into this
slice of a shared layer (negative: lent to other cells); max_in_flight includes them';
ALTER TABLE budget_transfers
    ADD COLUMN permits integer NOT NULL DEFAULT 0 CHECK (permits >= 0);
"""

DOWNGRADE = r"""
DELETE FROM schema_repeatables WHERE name IN ('global_layer.sql', 'plans.sql', 'roles.sql');
DROP FUNCTION IF EXISTS lq_shared_permits();
DROP FUNCTION IF EXISTS lq_send_permits(uuid, text, text, integer, integer);
DROP FUNCTION IF EXISTS lq_receive_permits(uuid, text, text, integer);
DROP FUNCTION IF EXISTS lq_undelivered_permits(integer);
UPDATE limit_layers SET max_in_flight = max_in_flight - in_flight_moved
 WHERE in_flight_moved <> 0;
ALTER TABLE limit_layers DROP COLUMN in_flight_moved;
DELETE FROM budget_transfers WHERE permits > 0;
ALTER TABLE budget_transfers DROP COLUMN permits;
"""


def upgrade() -> None:
    execute_script(SCHEMA)


def downgrade() -> None:
    execute_script(DOWNGRADE)
