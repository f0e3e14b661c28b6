"""Schema snapshots for the migration tests.

`table_snapshot`: the tables a revision leaves, what the versioned migrations
alone are responsible for.

Tables, their columns, constraints, indexes, triggers and sequences, and the
ledger's partitions; not the functions and views (the repeatable scripts of
sql/ own those, and their bodies are always today's). Monthly partition names
and bounds are written relative to the month the snapshot was taken in
(`usage_ledger_M+1`), so a snapshot taken today compares with one taken next
year. NOT NULL constraints are left to the columns' nullability: PostgreSQL 18
catalogues them as constraints, 15 does not.

`schema_snapshot`: the tables plus the code (functions, views, schemas) and
the privileges on all of it, for comparing two databases migrated two ways.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import os
import re
import shutil
import sys
import tempfile
import uuid
from pathlib import Path

import asyncpg

from llmquota.store import migrate
from llmquota.store.database import open_database
from tests.conftest import _admin, dsn_with_database

TABLES_SNAPSHOT = """
WITH rels AS (
    SELECT c.oid, n.nspname, c.relname, c.relkind, c.relispartition, c.relpartbound
      FROM pg_class AS c
      JOIN pg_namespace AS n ON n.oid = c.relnamespace
     WHERE n.nspname NOT IN ('pg_catalog', 'information_schema', 'pg_toast')
       AND n.nspname NOT LIKE 'pg\\_temp\\_%'
       AND n.nspname NOT LIKE 'pg\\_toast\\_temp\\_%'
       AND c.relkind IN ('r', 'p', 'S')
)
SELECT 'relation' AS kind, r.nspname || '.' || r.relname AS name,
       CASE r.relkind WHEN 'p' THEN 'partitioned' WHEN 'S' THEN 'sequence' ELSE 'plain' END
       || coalesce(' partition of ' || (SELECT i.inhparent::regclass::text
                                          FROM pg_inherits AS i WHERE i.inhrelid = r.oid)
                   || ' ' || pg_get_expr(r.relpartbound, r.oid), '') AS detail
  FROM rels AS r
UNION ALL
SELECT 'column', r.nspname || '.' || r.relname || '.' || a.attname,
       format_type(a.atttypid, a.atttypmod)
       || CASE WHEN a.attnotnull THEN ' not null' ELSE '' END
       || coalesce(' default ' || pg_get_expr(d.adbin, d.adrelid), '')
       || CASE a.attidentity WHEN 'a' THEN ' identity always'
                             WHEN 'd' THEN ' identity by default' ELSE '' END
  FROM rels AS r
  JOIN pg_attribute AS a ON a.attrelid = r.oid AND a.attnum > 0 AND NOT a.attisdropped
  LEFT JOIN pg_attrdef AS d ON d.adrelid = r.oid AND d.adnum = a.attnum
 WHERE r.relkind IN ('r', 'p') AND NOT r.relispartition
UNION ALL
SELECT 'constraint', r.nspname || '.' || r.relname || '.' || con.conname,
       pg_get_constraintdef(con.oid)
  FROM rels AS r
  JOIN pg_constraint AS con ON con.conrelid = r.oid
 WHERE con.contype <> 'n'
UNION ALL
SELECT 'index', r.nspname || '.' || ic.relname, pg_get_indexdef(ix.indexrelid)
  FROM rels AS r
  JOIN pg_index AS ix ON ix.indrelid = r.oid
  JOIN pg_class AS ic ON ic.oid = ix.indexrelid
UNION ALL
SELECT 'trigger', r.nspname || '.' || r.relname || '.' || t.tgname, pg_get_triggerdef(t.oid)
  FROM rels AS r
  JOIN pg_trigger AS t ON t.tgrelid = r.oid
 WHERE NOT t.tgisinternal
"""

_MONTH_NAME = re.compile(r"usage_ledger_(\d{4})_(\d{2})")
_MONTH_START = re.compile(r"'(\d{4})-(\d{2})-01 00:00:00\+00'")

Row = tuple[str, str, str]


def _relative(year: str, month: str, this_month: dt.date) -> str:
    offset = (int(year) - this_month.year) * 12 + int(month) - this_month.month
    return f"M{offset:+d}"


def normalize(rows: list[Row], this_month: dt.date) -> list[Row]:
    """Month names and bounds relative to `this_month`, sorted."""

    def fix(text: str) -> str:
        text = _MONTH_NAME.sub(lambda m: "usage_ledger_" + _relative(m[1], m[2], this_month), text)
        return _MONTH_START.sub(lambda m: "'" + _relative(m[1], m[2], this_month) + "'", text)

    return sorted((kind, fix(name), fix(detail)) for kind, name, detail in rows)


CODE_SNAPSHOT = """
SELECT 'function' AS kind, p.oid::regprocedure::text AS name,
       md5(pg_get_functiondef(p.oid)) || ' acl ' || coalesce(p.proacl::text, 'default')
       || coalesce(' comment ' || md5(obj_description(p.oid, 'pg_proc')), '') AS detail
  FROM pg_proc AS p
  JOIN pg_namespace AS n ON n.oid = p.pronamespace
 WHERE n.nspname NOT IN ('pg_catalog', 'information_schema')
UNION ALL
SELECT 'view', c.oid::regclass::text,
       md5(pg_get_viewdef(c.oid)) || ' acl ' || coalesce(c.relacl::text, 'default')
  FROM pg_class AS c
  JOIN pg_namespace AS n ON n.oid = c.relnamespace
 WHERE c.relkind = 'v' AND n.nspname NOT IN ('pg_catalog', 'information_schema')
UNION ALL
SELECT 'schema', n.nspname, coalesce(n.nspacl::text, 'default')
  FROM pg_namespace AS n
 WHERE n.nspname NOT IN ('pg_catalog', 'information_schema', 'pg_toast')
   AND n.nspname NOT LIKE 'pg\\_%'
UNION ALL
SELECT 'privileges', c.oid::regclass::text, coalesce(c.relacl::text, 'default')
  FROM pg_class AS c
  JOIN pg_namespace AS n ON n.oid = c.relnamespace
 WHERE c.relkind IN ('r', 'p', 'S')
   AND n.nspname NOT IN ('pg_catalog', 'information_schema', 'pg_toast')
   AND n.nspname NOT LIKE 'pg\\_%'
"""


async def _snapshot(dsn: str, *queries: str) -> list[Row]:
    connection = await asyncpg.connect(dsn)
    try:
        # Partition bounds are timestamptz literals, shown in the session's zone.
        await connection.execute("SET TimeZone = 'UTC'")
        rows = [row for query in queries for row in await connection.fetch(query)]
        this_month = await connection.fetchval(
            "SELECT date_trunc('month', clock_timestamp() AT TIME ZONE 'UTC')::date"
        )
    finally:
        await connection.close()
    return normalize([(r["kind"], r["name"], r["detail"]) for r in rows], this_month)


async def table_snapshot(dsn: str) -> list[Row]:
    """The normalized table snapshot of the database at `dsn`."""
    return await _snapshot(dsn, TABLES_SNAPSHOT)


async def schema_snapshot(dsn: str) -> list[Row]:
    """Tables, code and privileges of the database at `dsn`, normalized."""
    return await _snapshot(dsn, TABLES_SNAPSHOT, CODE_SNAPSHOT)


FROZEN_DIR = Path(__file__).parent / "frozen_tables"


def frozen_revisions() -> list[str]:
    """The revisions whose tables were recorded in frozen_tables/."""
    return sorted(path.stem for path in FROZEN_DIR.glob("*.tsv"))


def frozen_tables(revision: str) -> list[Row]:
    """The recorded table snapshot of `revision`."""
    rows: list[Row] = []
    for line in (FROZEN_DIR / f"{revision}.tsv").read_text(encoding="utf-8").splitlines():
        if line and not line.startswith("#"):
            kind, name, detail = line.split("\t")
            rows.append((kind, name, detail))
    return sorted(rows)


def capture(revision: str) -> Path:
    """Write frozen_tables/<revision>.tsv from a fresh database migrated to `revision`.

    For a new revision, once: `python -m tests.migration.tables 0007`. The
    server is LLMQUOTA_DATABASE_URL's, or an embedded one in a temporary
    directory.
    """
    url = os.environ.get("LLMQUOTA_DATABASE_URL")
    root = Path(tempfile.mkdtemp(prefix="llmquota-capture-"))
    try:
        with open_database(database_url=url, data_dir=None if url else root / "data") as handle:
            name = f"llmquota_capture_{uuid.uuid4().hex[:8]}"
            asyncio.run(_admin(handle.dsn, f'CREATE DATABASE "{name}"'))
            try:
                dsn = dsn_with_database(handle.dsn, name)
                migrate.upgrade(dsn, revision)
                rows = asyncio.run(table_snapshot(dsn))
            finally:
                asyncio.run(_admin(handle.dsn, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    path = FROZEN_DIR / f"{revision}.tsv"
    header = (
        f"# The tables revision {revision} leaves on a fresh database (see tables.py).\n"
        "# A versioned migration is frozen: this file never changes.\n"
        "# One row a line: kind, name, detail (tab-separated).\n"
    )
    path.write_text(header + "".join("\t".join(row) + "\n" for row in rows), encoding="utf-8")
    return path


if __name__ == "__main__":
    print(capture(sys.argv[1]))
