"""Old revisions are frozen: replaying one on a fresh database gives that revision's tables.

frozen_tables/ holds what each revision left before the repeatable step
existed; nothing in sql/ may change it.
"""

from __future__ import annotations

import asyncio
import re

import pytest
from alembic.script import ScriptDirectory

from llmquota.resources import migrations_dir
from llmquota.store import migrate
from tests.migration.tables import frozen_revisions, frozen_tables, table_snapshot


def test_no_versioned_migration_reads_sql() -> None:
    # What a revision did must not depend on today's sql/ files.
    for path in sorted((migrations_dir() / "versions").glob("*.py")):
        source = path.read_text(encoding="utf-8")
        assert "sqlfiles" not in source, path.name
        assert "sql_dir" not in source, path.name


def _revisions() -> list[str]:
    script = ScriptDirectory.from_config(migrate.alembic_config("postgresql://unused/"))
    return [r.revision for r in reversed(list(script.walk_revisions()))]


def test_every_revision_has_a_frozen_snapshot() -> None:
    # A new revision: capture its tables once, `python -m tests.migration.tables NNNN`.
    assert frozen_revisions() == _revisions()
    assert _revisions()[:6] == ["0001", "0002", "0003", "0004", "0005", "0006"]


def test_revision_0002_has_exactly_its_tables(fresh_dsn: str) -> None:
    migrate.upgrade(fresh_dsn, "0002")
    tables = asyncio.run(table_snapshot(fresh_dsn))
    assert tables == frozen_tables("0002")
    relations = {name for kind, name, _ in tables if kind == "relation"}
    assert "public.ledger_receipts" in relations
    assert "public.usage_ledger_M+0" in relations


@pytest.mark.parametrize("revision", ["0001", "0003", "0004", "0005", "0006", "head"])
def test_replaying_a_revision_gives_its_tables(fresh_dsn: str, revision: str) -> None:
    migrate.upgrade(fresh_dsn, revision)
    # At head the repeatable scripts ran too: they add no table.
    expected = _revisions()[-1] if revision == "head" else revision
    assert asyncio.run(table_snapshot(fresh_dsn)) == frozen_tables(expected)


def test_every_revision_since_cells_exist_names_no_schema() -> None:
    # A cell is upgraded in place by running the revisions it lacks with its
    # own schema as the search_path (store/cells.py): a revision naming
    # `public` or `reporting` would reach past it, so the build refuses one.
    # Only the frozen ones before cells existed (up to 0026) name them.
    naming = migrate.revisions_after("0026")
    assert naming is not None and naming[0][0] == "0027"
    assert [number for number, text in naming if re.search(r"\b(public|reporting)\b", text)] == []
    assert migrate.revisions_after("9999") is None
