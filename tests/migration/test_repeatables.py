"""The repeatable step: sql/'s functions, views and grants, applied by checksum after the tables."""

from __future__ import annotations

import asyncio
import hashlib
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import asyncpg
import pytest
from alembic.script import ScriptDirectory

from llmquota.resources import sql_dir
from llmquota.store import migrate
from llmquota.store.migrate import AppliedScript
from llmquota.store.sqlfiles import repeatable_scripts
from tests.migration.tables import frozen_tables, schema_snapshot, table_snapshot

REPEATABLES = [
    "admission.sql",
    "allotments.sql",
    "plans.sql",
    "global_layer.sql",
    "estimates.sql",
    "ledger.sql",
    "reliability.sql",
    "quotas.sql",
    "keys.sql",
    "cache.sql",
    "reports/00_base.sql",
    "reports/10_usage.sql",
    "reports/20_accuracy.sql",
    "reports/30_reconciliation.sql",
    "reports/40_expired.sql",
    "reports/50_quotas.sql",
    "reports/60_oversubscription.sql",
    "reports/70_serving_paths.sql",
    "roles.sql",
]

# The functions revision 0002 keeps a frozen copy of: its triggers and its
# partitions need them before any repeatable script runs.
FROZEN_FUNCTIONS = {
    "lq_ledger_refuse_change()",
    "lq_ledger_receipt()",
    "lq_create_ledger_partition(date)",
    "lq_ensure_ledger_partitions(integer,timestamp with time zone)",
}


def _sha256(name: str, root: Path | None = None) -> str:
    return hashlib.sha256(((root or sql_dir()) / name).read_bytes()).hexdigest()


async def _fetch(dsn: str, query: str, *args: object) -> list[asyncpg.Record]:
    connection = await asyncpg.connect(dsn)
    try:
        rows: list[asyncpg.Record] = await connection.fetch(query, *args)
        return rows
    finally:
        await connection.close()


def _recorded(dsn: str) -> dict[str, tuple[str, object]]:
    rows = asyncio.run(_fetch(dsn, "SELECT name, checksum, applied_at FROM schema_repeatables"))
    return {r["name"]: (r["checksum"], r["applied_at"]) for r in rows}


def _functions(dsn: str) -> set[str]:
    rows = asyncio.run(
        _fetch(
            dsn,
            "SELECT p.oid::regprocedure::text AS f FROM pg_proc AS p"
            " JOIN pg_namespace AS n ON n.oid = p.pronamespace"
            " WHERE n.nspname IN ('public', 'reporting')",
        )
    )
    return {r["f"] for r in rows}


def _comment(dsn: str, function: str) -> str | None:
    rows = asyncio.run(
        _fetch(dsn, "SELECT obj_description($1::regprocedure, 'pg_proc') AS c", function)
    )
    comment: str | None = rows[0]["c"]
    return comment


def _definition(dsn: str, function: str) -> str:
    rows = asyncio.run(_fetch(dsn, "SELECT pg_get_functiondef($1::regprocedure) AS d", function))
    definition: str = rows[0]["d"]
    return definition


def _applied(result: list[AppliedScript]) -> list[tuple[str, str]]:
    return [(a.name, a.reason) for a in result]


@pytest.fixture
def sql_copy(tmp_path: Path) -> Path:
    """A copy of sql/ to change scripts in."""
    root = tmp_path / "sql"
    shutil.copytree(sql_dir(), root)
    return root


def _append(path: Path, text: str) -> None:
    path.write_text(path.read_text(encoding="utf-8") + text, encoding="utf-8")


def test_the_repeatables_are_applied_in_a_fixed_order() -> None:
    scripts = repeatable_scripts()
    assert [s.name for s in scripts] == REPEATABLES
    assert [s.name for s in scripts if s.follows_every_change] == ["roles.sql"]
    for script in scripts:
        assert script.checksum == _sha256(script.name)


def test_upgrade_records_every_repeatable_with_its_sha256(fresh_dsn: str) -> None:
    migrate.upgrade(fresh_dsn)
    recorded = _recorded(fresh_dsn)
    assert sorted(recorded) == sorted(REPEATABLES)
    for name, (checksum, _) in recorded.items():
        assert checksum == _sha256(name), name
    assert "lq_admit" in {f.split("(")[0] for f in _functions(fresh_dsn)}


def test_the_template_database_has_the_repeatables(database_dsn: str) -> None:
    recorded = _recorded(database_dsn)
    assert {name: checksum for name, (checksum, _) in recorded.items()} == {
        name: _sha256(name) for name in REPEATABLES
    }


def test_an_old_revision_gets_its_tables_and_none_of_todays_functions(fresh_dsn: str) -> None:
    migrate.upgrade(fresh_dsn, "0005")
    assert asyncio.run(table_snapshot(fresh_dsn)) == frozen_tables("0005")
    assert _functions(fresh_dsn) == FROZEN_FUNCTIONS
    schemas = asyncio.run(_fetch(fresh_dsn, "SELECT to_regnamespace('reporting') AS s"))
    assert schemas[0]["s"] is None
    with pytest.raises(RuntimeError, match="migrate the database to head first"):
        migrate.apply_repeatables(fresh_dsn)

    # On to head: the repeatables follow.
    migrate.upgrade(fresh_dsn)
    assert sorted(_recorded(fresh_dsn)) == sorted(REPEATABLES)
    assert {"lq_admit", "lq_audit", "usage_daily"} <= {
        f.split("(")[0].removeprefix("reporting.") for f in _functions(fresh_dsn)
    }


def test_a_changed_script_is_reapplied_and_only_it(fresh_dsn: str, sql_copy: Path) -> None:
    migrate.upgrade(fresh_dsn)
    before = _recorded(fresh_dsn)
    assert migrate.apply_repeatables(fresh_dsn, sql_root=sql_copy) == []

    report = "reports/40_expired.sql"
    _append(
        sql_copy / report,
        "\nCOMMENT ON FUNCTION reporting.expired_reservations(date, date, text) IS 'changed';\n",
    )
    applied = migrate.apply_repeatables(fresh_dsn, sql_root=sql_copy)
    # The grants follow every change (a new function would otherwise have
    # PostgreSQL's default privileges).
    assert _applied(applied) == [(report, "changed"), ("roles.sql", "follows")]
    assert _comment(fresh_dsn, "reporting.expired_reservations(date, date, text)") == "changed"
    after = _recorded(fresh_dsn)
    assert after[report][0] == _sha256(report, sql_copy) != before[report][0]
    assert after["roles.sql"][0] == before["roles.sql"][0]
    assert after["roles.sql"][1] != before["roles.sql"][1]
    for name in set(REPEATABLES) - {report, "roles.sql"}:
        assert after[name] == before[name], name

    # Nothing changed since: nothing to do.
    assert migrate.apply_repeatables(fresh_dsn, sql_root=sql_copy) == []
    assert _recorded(fresh_dsn) == after

    # A function body: the function is replaced.
    admission = sql_copy / "admission.sql"
    marker = "-- a body the test changed"
    text = admission.read_text(encoding="utf-8")
    header = "CREATE OR REPLACE FUNCTION lq_sweep(p_limit integer)"
    body = text.index("AS $$\n", text.index(header)) + len("AS $$\n")
    admission.write_text(text[:body] + marker + "\n" + text[body:], encoding="utf-8")
    assert _applied(migrate.apply_repeatables(fresh_dsn, sql_root=sql_copy)) == [
        ("admission.sql", "changed"),
        ("roles.sql", "follows"),
    ]
    assert marker in _definition(fresh_dsn, "lq_sweep(integer)")

    # The grants alone.
    _append(sql_copy / "roles.sql", "\n-- a comment changes the checksum too\n")
    assert _applied(migrate.apply_repeatables(fresh_dsn, sql_root=sql_copy)) == [
        ("roles.sql", "changed")
    ]

    # Back to the real sql/: what differs from it is applied again.
    migrate.upgrade(fresh_dsn)
    assert {name: checksum for name, (checksum, _) in _recorded(fresh_dsn).items()} == {
        name: _sha256(name) for name in REPEATABLES
    }
    assert marker not in _definition(fresh_dsn, "lq_sweep(integer)")


def test_forcing_applies_every_script_again_and_changes_nothing(fresh_dsn: str) -> None:
    migrate.upgrade(fresh_dsn)
    before = asyncio.run(schema_snapshot(fresh_dsn))
    applied = migrate.apply_repeatables(fresh_dsn, force=True)
    assert _applied(applied) == [(name, "forced") for name in REPEATABLES]
    assert asyncio.run(schema_snapshot(fresh_dsn)) == before


def test_a_script_gone_from_sql_loses_its_record(fresh_dsn: str, sql_copy: Path) -> None:
    migrate.upgrade(fresh_dsn)
    (sql_copy / "reports" / "40_expired.sql").unlink()
    assert migrate.apply_repeatables(fresh_dsn, sql_root=sql_copy) == []
    assert "reports/40_expired.sql" not in _recorded(fresh_dsn)
    # Its function stays until a script or a migration drops it.
    assert "reporting.expired_reservations(date,date,text)" in _functions(fresh_dsn)


def test_a_fresh_upgrade_equals_every_revision_in_turn_then_the_repeatables(
    fresh_dsn: str, second_fresh_dsn: str
) -> None:
    migrate.upgrade(fresh_dsn)

    script = ScriptDirectory.from_config(migrate.alembic_config(second_fresh_dsn))
    revisions = [r.revision for r in reversed(list(script.walk_revisions()))]
    assert revisions[:6] == ["0001", "0002", "0003", "0004", "0005", "0006"]
    for revision in revisions[:-1]:
        migrate.upgrade(second_fresh_dsn, revision)
        assert asyncio.run(table_snapshot(second_fresh_dsn)) == frozen_tables(revision)
    migrate.upgrade(second_fresh_dsn, revisions[-1])  # the head: the repeatables follow

    assert asyncio.run(schema_snapshot(second_fresh_dsn)) == asyncio.run(schema_snapshot(fresh_dsn))


@pytest.mark.parametrize("revision", ["0005", "0002", "0001"])
def test_a_downgrade_leaves_the_tables_of_its_revision(fresh_dsn: str, revision: str) -> None:
    migrate.upgrade(fresh_dsn)
    migrate.downgrade(fresh_dsn, revision)
    assert asyncio.run(table_snapshot(fresh_dsn)) == frozen_tables(revision)
    # Function bodies are not versioned: those left are today's (lq_admit
    # reads columns of 0008 and went with them).
    assert "lq_refilled(" in " ".join(_functions(fresh_dsn))

    migrate.upgrade(fresh_dsn)
    assert sorted(_recorded(fresh_dsn)) == sorted(REPEATABLES)


async def _wait_for_waiters(connection: asyncpg.Connection, waiters: int) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        waiting = await connection.fetchval(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted"
            " AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"
        )
        if waiting == waiters:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"never saw {waiters} migrations waiting for the lock")


async def _holding_the_lock(dsn: str) -> asyncpg.Connection:
    holder: asyncpg.Connection = await asyncpg.connect(dsn)
    await holder.execute("SELECT pg_advisory_lock(hashtextextended($1, 0))", migrate.MIGRATION_LOCK)
    return holder


def _migrate_command(dsn: str) -> tuple[list[str], dict[str, str]]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLMQUOTA_")}
    env["LLMQUOTA_DATABASE_URL"] = dsn
    return [sys.executable, "-m", "llmquota.cli", "migrate"], env


async def test_two_migrate_commands_at_once_queue_on_the_lock(fresh_dsn: str) -> None:
    # Two processes, as two API containers starting with --migrate would be
    # (alembic itself is not thread-safe within one process).
    command, env = _migrate_command(fresh_dsn)
    holder = await _holding_the_lock(fresh_dsn)
    try:
        runs = [
            await asyncio.create_subprocess_exec(
                *command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
            )
            for _ in "ab"
        ]
        await _wait_for_waiters(holder, 2)
        await holder.execute(
            "SELECT pg_advisory_unlock(hashtextextended($1, 0))", migrate.MIGRATION_LOCK
        )
        outputs = [await asyncio.wait_for(run.communicate(), 90) for run in runs]
        assert [run.returncode for run in runs] == [0, 0], outputs
        head = ScriptDirectory.from_config(migrate.alembic_config(fresh_dsn)).get_current_head()
        assert await holder.fetchval("SELECT version_num FROM alembic_version") == head
        assert await holder.fetchval("SELECT count(*) FROM schema_repeatables") == len(REPEATABLES)
        # One applied the scripts, the other found them applied.
        printed = sorted(out.decode() for out, _ in outputs)
        assert sum("functions up to date" in out for out in printed) == 1
    finally:
        await holder.close()


async def test_two_repeatable_steps_at_once_apply_each_script_once(fresh_dsn: str) -> None:
    await asyncio.to_thread(migrate.upgrade, fresh_dsn)
    holder = await _holding_the_lock(fresh_dsn)
    try:
        await holder.execute("DELETE FROM schema_repeatables")
        runs = [
            asyncio.create_task(asyncio.to_thread(migrate.apply_repeatables, fresh_dsn))
            for _ in "ab"
        ]
        await _wait_for_waiters(holder, 2)
        await holder.execute(
            "SELECT pg_advisory_unlock(hashtextextended($1, 0))", migrate.MIGRATION_LOCK
        )
        first, second = sorted(await asyncio.gather(*runs), key=len)
        assert first == []
        assert _applied(second) == [(name, "new") for name in REPEATABLES]
    finally:
        await holder.close()


def test_llmquota_migrate_says_what_it_applied(fresh_dsn: str) -> None:
    command, env = _migrate_command(fresh_dsn)

    first = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
    assert "database is at the latest schema" in first.stdout
    for name in REPEATABLES:
        assert f"functions: {name} applied (new)" in first.stdout

    again = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
    assert "functions up to date" in again.stdout
    assert "applied" not in again.stdout
