"""Model prices become append-only versions, each saying who set it and why.

Until now `prices set` on an existing (model, effective_from) overwrote the
row, so an invoice for the same usage could change and change back with no
trace. From this revision:

- `model_prices` keeps every version: the key is (model, effective_from,
  set_at), and the version in force for a moment is the latest
  effective_from at or before it, then the latest set_at (lq_price_at in
  sql/admission.sql). A trigger refuses UPDATE, DELETE and TRUNCATE, whoever
  asks; a correction is a new version.
- `set_by` (the operator the caller named; by default the database role)
  and `set_by_role` (the database role that ran the statement) say who;
  `backdate_reason` says why a version took effect before it was set (NULL
  for one that did not).
- `effective_from` is a finite time from 2000 on: `0001-01-01` was stored as
  `-infinity` and priced all of history.

Existing rows become the first version of themselves, set by
'before 0017'.

Frozen (migrations/README.md): the trigger function the new triggers run,
as it was when this revision was written.

Revision ID: 0017
Revises: 0016
Create Date: 2026-12-02
"""

from llmquota.store.migration_support import execute_script

revision = "0017"
down_revision = "0016"
branch_labels = None
depends_on = None

SCHEMA = r"""
-- Refuse UPDATE, DELETE and TRUNCATE on the prices: a change is a new version.
CREATE OR REPLACE FUNCTION lq_prices_refuse_change()
RETURNS trigger
LANGUAGE plpgsql
AS $$
BEGIN
    RAISE EXCEPTION 'model_prices is append-only: % on % is refused', TG_OP, TG_TABLE_NAME
        USING ERRCODE = 'insufficient_privilege',
              HINT = 'Set a new version: llmquota prices set --model M ...';
END
$$;

ALTER TABLE model_prices
    DROP CONSTRAINT model_prices_pkey,
    ADD COLUMN set_by text NOT NULL DEFAULT 'before 0017',
    ADD COLUMN set_by_role text NOT NULL DEFAULT session_user,
    ADD COLUMN backdate_reason text,
    ADD CONSTRAINT model_prices_pkey PRIMARY KEY (model, effective_from, set_at),
    ADD CONSTRAINT model_prices_set_by CHECK (length(set_by) BETWEEN 1 AND 200),
    ADD CONSTRAINT model_prices_backdate_reason
        CHECK (backdate_reason IS NULL OR length(backdate_reason) BETWEEN 1 AND 1000);
-- A version written without a name (by the owner, by hand) names its role.
ALTER TABLE model_prices ALTER COLUMN set_by SET DEFAULT session_user;
-- Checked after the rows are in: an existing -infinity row (from the bug
-- this revision closes) would fail it; such a database keeps its row and
-- the check is NOT VALID for it, enforced for every new version.
ALTER TABLE model_prices
    ADD CONSTRAINT model_prices_effective_from
        CHECK (effective_from >= '2000-01-01 00:00:00+00' AND effective_from < 'infinity')
        NOT VALID;
COMMENT ON TABLE model_prices IS
    'append-only price versions per million tokens; model is a name or a * glob';
COMMENT ON COLUMN model_prices.set_by IS 'who set this version (the operator the caller named)';
COMMENT ON COLUMN model_prices.set_by_role IS 'the database role that set this version';
COMMENT ON COLUMN model_prices.backdate_reason IS
    'why this version takes effect before it was set; NULL when it does not';

CREATE TRIGGER model_prices_append_only
    BEFORE UPDATE OR DELETE ON model_prices
    FOR EACH ROW EXECUTE FUNCTION lq_prices_refuse_change();
CREATE TRIGGER model_prices_no_truncate
    BEFORE TRUNCATE ON model_prices
    FOR EACH STATEMENT EXECUTE FUNCTION lq_prices_refuse_change();
"""

DOWNGRADE = r"""
-- reporting.model_prices (reports/00_base.sql) shows the columns that go:
-- dropped, and its script forgotten, so the repeatable step re-creates it.
DROP VIEW IF EXISTS reporting.model_prices;
DELETE FROM schema_repeatables WHERE name = 'reports/00_base.sql';
DROP TRIGGER model_prices_append_only ON model_prices;
DROP TRIGGER model_prices_no_truncate ON model_prices;
-- 0012 kept one row per (model, effective_from): its latest version.
DELETE FROM model_prices AS mp
 WHERE EXISTS (SELECT 1 FROM model_prices AS later
                WHERE later.model = mp.model
                  AND later.effective_from = mp.effective_from
                  AND later.set_at > mp.set_at);
ALTER TABLE model_prices
    DROP CONSTRAINT model_prices_pkey,
    DROP CONSTRAINT model_prices_effective_from,
    DROP COLUMN set_by,
    DROP COLUMN set_by_role,
    DROP COLUMN backdate_reason,
    ADD CONSTRAINT model_prices_pkey PRIMARY KEY (model, effective_from);
COMMENT ON TABLE model_prices IS NULL;
-- The functions that read the removed columns, and this revision's own.
DROP FUNCTION IF EXISTS lq_set_price(text, timestamptz, numeric, numeric, text, text);
DROP FUNCTION IF EXISTS lq_prices_refuse_change();
"""


def upgrade() -> None:
    execute_script(SCHEMA)


def downgrade() -> None:
    execute_script(DOWNGRADE)
