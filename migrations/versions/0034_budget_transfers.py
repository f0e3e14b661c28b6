"""A journal of budget moved between the slices of shared layers in cells.

A database of cells (`llmquota migrate --cells K`, docs/scaling.md) splits
each shared layer (the global layer, each provider ceiling) into K slices,
one per cell, so that no admission touches two nodes. A rebalancer
(admission/rebalancer.py) moves unused room from a slice that has it to one
that is short: it debits the sender in one transaction and credits the
receiver in the next. Both cells journal the move under the same
`transfer_id`:

- the sender an 'out' row, written with the debit; `delivered_at` is set
  once the receiver has acknowledged it. A row left undelivered (the
  rebalancer died between the two, or the receiver was down) is delivered
  again by the next round: until then the room is stranded, never created.
- the receiver an 'in' row, written with the credit, whose key makes a
  second delivery of the same transfer a no-op.

`tokens` and `requests` are what left the sender (the receiver's slice is
clamped at its burst, as every credit is). The rebalancer prunes the journal
(lq_prune_budget_transfers): a move is kept a day, an 'in' row two (longer
than any 'out' row that could still deliver it, whatever the two nodes'
clocks say), so a move is never credited twice.

Revision ID: 0034
Revises: 0033
Create Date: 2026-12-06
"""

from llmquota.store.migration_support import execute_script

revision = "0034"
down_revision = "0033"
branch_labels = None
depends_on = None

SCHEMA = r"""
CREATE TABLE budget_transfers (
    transfer_id  uuid NOT NULL,
    direction    text NOT NULL CHECK (direction IN ('out', 'in')),
    -- the shared layer moved: a provider ceiling's name, NULL for the global layer
    ceiling      text,
    -- the other cell's schema
    peer         text NOT NULL,
    tokens       double precision NOT NULL CHECK (tokens >= 0),
    requests     double precision NOT NULL CHECK (requests >= 0),
    moved_at     timestamptz NOT NULL,
    -- 'out' rows: when the receiver acknowledged the credit
    delivered_at timestamptz,
    PRIMARY KEY (transfer_id, direction),
    CHECK (direction = 'out' OR delivered_at IS NULL)
);
-- The rebalancer's scan for moves still to deliver.
CREATE INDEX budget_transfers_undelivered ON budget_transfers (moved_at)
    WHERE direction = 'out' AND delivered_at IS NULL;
-- Its pruning of old moves (lq_prune_budget_transfers).
CREATE INDEX budget_transfers_moved_at ON budget_transfers (moved_at);
"""

DOWNGRADE = r"""
DELETE FROM schema_repeatables WHERE name IN ('global_layer.sql', 'roles.sql');
DROP FUNCTION IF EXISTS lq_shared_rooms();
DROP FUNCTION IF EXISTS lq_send_budget(uuid, text, text, double precision, double precision,
                                       double precision, double precision);
DROP FUNCTION IF EXISTS lq_receive_budget(uuid, text, text, double precision, double precision);
DROP FUNCTION IF EXISTS lq_confirm_budget(uuid);
DROP FUNCTION IF EXISTS lq_undelivered_budget(integer);
DROP FUNCTION IF EXISTS lq_prune_budget_transfers(integer);
DROP TABLE budget_transfers;
"""


def upgrade() -> None:
    execute_script(SCHEMA)


def downgrade() -> None:
    execute_script(DOWNGRADE)
