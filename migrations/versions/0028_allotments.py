"""Allotments: slices of a layer's room that a worker decides from in memory.

- `limit_layers` gains `admission`: 'allotted' opts a tenant's (or a
  route's) requests into allotted admission (sql/allotments.sql,
  admission/allotments.py); NULL or 'exact': every request is decided by
  lq_admit, as before. A route's own setting wins over its tenant's.
- `allotments`: one row per slice a worker holds. Its tokens and requests
  were debited from every layer in `layer_ids` when it was taken, exactly
  as an admission debits them, so what the layers hold plus what the
  allotments hold never exceeds capacity plus refill. A worker moves room
  from here to the reservations it admitted (lq_allot_journal); what is
  left goes back to the layers when the worker returns the slice, or when
  the sweeper finds it past `expires_at` (a worker that died).
- `reservations` gains `allotment_id`: the slice an admission was decided
  from (NULL: decided by lq_admit). Settlement treats both alike.

Revision ID: 0028
Revises: 0027
Create Date: 2026-12-05
"""

from llmquota.store.migration_support import execute_script

revision = "0028"
down_revision = "0027"
branch_labels = None
depends_on = None

SCHEMA = r"""
ALTER TABLE limit_layers
    ADD COLUMN admission text,
    ADD CONSTRAINT limit_layers_admission
        CHECK (admission IS NULL OR (admission IN ('exact', 'allotted')
                                     AND scope IN ('tenant', 'route')));

CREATE TABLE allotments (
    allotment_id    uuid PRIMARY KEY,
    tenant          text NOT NULL,
    route           text,
    model           text NOT NULL,
    api_key_id      bigint,
    -- every layer the slice was debited from, in layer_id order
    layer_ids       bigint[] NOT NULL,
    -- the largest policy_version among them when it was taken
    policy_version  bigint NOT NULL,
    lease_seconds   integer NOT NULL CHECK (lease_seconds BETWEEN 1 AND 86400),
    -- the room still held: debited from the layers, not yet any reservation's
    tokens          bigint NOT NULL CHECK (tokens >= 0),
    requests        bigint NOT NULL CHECK (requests >= 0),
    holder          text NOT NULL,
    created_at      timestamptz NOT NULL,
    expires_at      timestamptz NOT NULL
);
-- The sweeper's scan: oldest deadline first.
CREATE INDEX allotments_expiry ON allotments (expires_at);

ALTER TABLE reservations
    ADD COLUMN allotment_id uuid;
"""

DOWNGRADE = r"""
-- The functions of these scripts read the columns that go (migrations/README.md):
-- the next upgrade to head applies them again.
DELETE FROM schema_repeatables
 WHERE name IN ('admission.sql', 'plans.sql', 'queries.sql', 'allotments.sql');
DROP FUNCTION IF EXISTS lq_allot(uuid, text, text, text, bigint, bigint, bigint,
                                 double precision, bigint, text, integer, boolean);
DROP FUNCTION IF EXISTS lq_allot_journal(uuid[], uuid[], bigint[], boolean[], bigint[],
                                         bigint[], integer[], text[], integer);
DROP FUNCTION IF EXISTS lq_allot_orphans(text, text, text, bigint, uuid[], bigint[],
                                         boolean[], bigint[], bigint[], integer[], text[]);
DROP FUNCTION IF EXISTS lq_allot_sweep(integer);
DROP FUNCTION IF EXISTS lq_allot_return(uuid[], boolean);
ALTER TABLE reservations DROP COLUMN allotment_id;
DROP TABLE allotments;
ALTER TABLE limit_layers
    DROP CONSTRAINT limit_layers_admission,
    DROP COLUMN admission;
"""


def upgrade() -> None:
    execute_script(SCHEMA)


def downgrade() -> None:
    execute_script(DOWNGRADE)
