"""In-flight permits moved between the slices of shared layers in cells.

A database of cells splits a shared layer's `max_in_flight` (the global
layer's, a provider ceiling's) into one slice per cell, as it splits its
tokens and requests. Until now only room moved between the slices (0034):
a cell whose tenants were busy refused at its own slice of the permits
while another cell's sat unused. The rebalancer now moves permits too,
debit then credit as it moves room:

- `limit_layers.in_flight_moved`: the permits the rebalancer moved into this
  row (negative: lent to other cells). `max_in_flight` is the slice's cap,
  moves included, so admission reads it as before; the policy's own share
  is `max_in_flight - in_flight_moved`, and a policy write keeps what was
  moved (sql/global_layer.sql, sql/plans.sql). A share lowered below what a
  cell lent leaves it a cap of zero or less: it admits nothing until the
  borrowers give permits back, so the cells never cap more than the
  policy. The check on `max_in_flight` is therefore on the share.
- `budget_transfers.permits`: what a move took from its sender, and
  `layer_id` the sender's row it was taken from. A permit does not refill
  as room does, so a permit move is delivered while that row exists (a
  ceiling deleted takes its debts with it, and its moves are not
  delivered: a recreated ceiling starts from its share).

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
ALTER TABLE limit_layers DROP CONSTRAINT limit_layers_max_in_flight_check;
ALTER TABLE limit_layers ADD CONSTRAINT limit_layers_max_in_flight_check
    CHECK (max_in_flight - in_flight_moved > 0);
-- (Citus takes no CHECK in an ADD COLUMN on a distributed table: named, apart.)
ALTER TABLE budget_transfers ADD COLUMN permits integer NOT NULL DEFAULT 0;
ALTER TABLE budget_transfers ADD CONSTRAINT budget_transfers_permits_check
    CHECK (permits >= 0);
ALTER TABLE budget_transfers ADD COLUMN layer_id bigint;
"""

# Going back returns every slice to its share, which is exact only when no
# permit is lent anywhere: a cell's own downgrade cannot see the others, so
# it refuses while this cell has lent, borrowed or is sending permits.
DOWNGRADE = r"""
DO $$
BEGIN
    IF EXISTS (SELECT 1 FROM limit_layers WHERE in_flight_moved <> 0)
       OR EXISTS (SELECT 1 FROM budget_transfers
                   WHERE direction = 'out' AND permits > 0 AND delivered_at IS NULL) THEN
        RAISE EXCEPTION USING ERRCODE = 'object_in_use',
              MESSAGE = 'permits are moved between this cell and others: back at its share '
                        'alone, the cells would cap another total than the policy';
    END IF;
END
$$;
DELETE FROM schema_repeatables WHERE name IN ('global_layer.sql', 'plans.sql', 'roles.sql');
DROP VIEW IF EXISTS global_layer;
DROP FUNCTION IF EXISTS lq_shared_permits();
DROP FUNCTION IF EXISTS lq_send_permits(uuid, text, text, integer, integer);
DROP FUNCTION IF EXISTS lq_receive_permits(uuid, text, text, integer);
DROP FUNCTION IF EXISTS lq_undelivered_permits(integer);
ALTER TABLE limit_layers DROP CONSTRAINT limit_layers_max_in_flight_check;
ALTER TABLE limit_layers DROP COLUMN in_flight_moved;
ALTER TABLE limit_layers ADD CONSTRAINT limit_layers_max_in_flight_check
    CHECK (max_in_flight > 0);
DELETE FROM budget_transfers WHERE permits > 0;
ALTER TABLE budget_transfers DROP COLUMN layer_id;
ALTER TABLE budget_transfers DROP COLUMN permits;
"""


def upgrade() -> None:
    execute_script(SCHEMA)


def downgrade() -> None:
    execute_script(DOWNGRADE)
