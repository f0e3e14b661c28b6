"""Composite types for what lq_finish collects before it writes.

lq_finish (sql/admission.sql) gathers, per reservation it finishes, a credit
to its layers, a ledger row to append and a change to its quotas and prepaid
balance, then applies each kind in one statement. It kept each as parallel
arrays, one per field (20 of them), appended field by field in four places.
One array of rows per kind says the same in a line per append:

- `lq_layer_credit`: what one reservation gives back to (or, negative, takes
  from) every layer it debited; `shared` is the global layer's share, which
  never takes more than lq_shared_charge_cap.
- `lq_ledger_entry`: one usage_ledger row to append, named by its field.
- `lq_budget_change`: the quotas and prepaid credit one reservation held,
  and how they finish (settle, late, release, expire).

`place` is the reservation's place in lq_finish's array of the reservations
it finishes.

Revision ID: 0029
Revises: 0028
Create Date: 2026-12-05
"""

from llmquota.store.migration_support import execute_script

revision = "0029"
down_revision = "0028"
branch_labels = None
depends_on = None

SCHEMA = r"""
CREATE TYPE lq_layer_credit AS (
    place     integer,
    tokens    double precision,
    shared    double precision,
    requests  double precision,
    permits   integer
);

CREATE TYPE lq_ledger_entry AS (
    place            integer,
    entry_kind       text,      -- usage | late
    input_tokens     bigint,
    output_tokens    bigint,
    reserved_tokens  bigint,
    outcome          text,
    excess_tokens    bigint,
    usage_source     text,
    reported_input   numeric,
    reported_output  numeric,
    serving_path     text
);

CREATE TYPE lq_budget_change AS (
    place          integer,
    mode           text,        -- settle | late | release | expire
    input_tokens   bigint,
    output_tokens  bigint
);
"""

DOWNGRADE = r"""
-- lq_finish is declared over these types: it goes with them, and the next
-- upgrade to head applies admission.sql again (migrations/README.md).
DELETE FROM schema_repeatables WHERE name = 'admission.sql';
DROP FUNCTION IF EXISTS lq_finish(uuid[], text[], text[], bigint[], bigint[], text[],
                                  text[], numeric[], numeric[], text[]);
DROP TYPE lq_budget_change;
DROP TYPE lq_ledger_entry;
DROP TYPE lq_layer_credit;
"""


def upgrade() -> None:
    execute_script(SCHEMA)


def downgrade() -> None:
    execute_script(DOWNGRADE)
