"""lq_admit_decide journals an admission as a whole `reservations` row.

Its steps build the row field by field (`lq_journal_row`, and the layers,
quotas and money in lq_admit_decide's debit) and insert it whole, so a
column's default never applies: a column added to reservations with a
default (or NOT NULL) must be set there too, or admissions would journal
NULL (or fail). This reads the table and the functions as the database has
them.
"""

from __future__ import annotations

import re

import asyncpg


async def test_every_column_with_a_default_is_set_by_the_journal_steps(owner_dsn: str) -> None:
    db = await asyncpg.connect(owner_dsn)
    try:
        columns = await db.fetch(
            """SELECT column_name, column_default IS NOT NULL AS has_default,
                      is_nullable = 'NO' AS required
                 FROM information_schema.columns
                WHERE table_schema = current_schema() AND table_name = 'reservations'"""
        )
        sources = await db.fetchval(
            """SELECT string_agg(pg_get_functiondef(p.oid), E'\\n')
                 FROM pg_proc AS p
                WHERE p.proname IN ('lq_journal_row', 'lq_admit_decide')"""
        )
    finally:
        await db.close()
    assigned = set(re.findall(r"\brs\.(\w+) :=", sources))
    must = {c["column_name"] for c in columns if c["has_default"] or c["required"]}
    assert len(must) >= 18
    assert must - assigned == set()
