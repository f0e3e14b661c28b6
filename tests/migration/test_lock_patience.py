"""A migration waits a bounded time for its tables' locks while the service runs.

PostgreSQL grants table locks in the order they are asked for: a migration's
ACCESS EXCLUSIVE request that waits for a long report's or an open
transaction's lock holds up every debit asked for after it (an admission's
UPDATE takes ROW EXCLUSIVE on limit_layers). These tests make that wait with
a real open transaction (`a report`), measure how long a debit waits behind
the migration's request, and hold each step of `llmquota migrate` (the
versioned revisions, the repeatable scripts, the command itself) to its
bound: past it the step is rolled back and tried again, and when no try is
left the database is as it was before the step.
"""

from __future__ import annotations

import asyncio
import logging
import subprocess
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import TypeVar

import asyncpg
import pytest

from llmquota.store import migrate
from llmquota.store.lock_patience import LockPatience, MigrationLocksUnavailable
from llmquota.store.migrate import AppliedScript
from tests.support import fetch_value, run_cli


def _queued(relation: str, mode: str) -> str:
    """A query counting the lock requests in `mode` on `relation` not granted yet."""
    return (
        f"SELECT count(*) FROM pg_locks WHERE relation = '{relation}'::regclass"
        f" AND mode = '{mode}' AND NOT granted"
    )


# The migration's request on limit_layers, queued (0036 takes the table first).
QUEUED_ON_LAYERS = _queued("limit_layers", "AccessExclusiveLock")
# A debit's request, queued behind it.
DEBIT_QUEUED = _queued("limit_layers", "RowExclusiveLock")
# What an admission's UPDATE of its layers takes first: ROW EXCLUSIVE on the table.
DEBIT = "UPDATE limit_layers SET tokens = tokens WHERE layer_id = -1"
# How long the report holds its lock after a debit has queued, in the test
# without a bound.
REPORT_SECONDS = 2.0

_T = TypeVar("_T")


@asynccontextmanager
async def _report(dsn: str, query: str) -> AsyncIterator[asyncpg.Connection]:
    """An open transaction that has read through `query`: it holds ACCESS
    SHARE on what it read until it ends, as a long report does."""
    connection = await asyncpg.connect(dsn)
    try:
        async with connection.transaction():
            await connection.fetchval(query)
            yield connection
    finally:
        await connection.close()


async def _until(dsn: str, query: str) -> None:
    """Wait until `query` counts a row (20 s at most)."""
    deadline = time.monotonic() + 20.0
    while not await fetch_value(dsn, query):
        assert time.monotonic() < deadline, f"never true: {query}"
        await asyncio.sleep(0.02)


async def _debit_seconds(dsn: str) -> float:
    """How long a debit waits for its lock on limit_layers."""
    connection = await asyncpg.connect(dsn)
    try:
        started = time.monotonic()
        await connection.execute(DEBIT)
        return time.monotonic() - started
    finally:
        await connection.close()


def _in_thread(call: Callable[[], _T]) -> asyncio.Task[_T]:
    """`call` on a thread, begun now."""
    return asyncio.create_task(asyncio.to_thread(call))


async def _debit_behind_migration(
    dsn: str, patience: LockPatience
) -> tuple[asyncio.Task[list[AppliedScript]], asyncio.Task[float]]:
    """Begin the upgrade from 0035, then a debit once the upgrade's request on
    limit_layers queues; both returned once the debit queues behind it."""
    migrating = _in_thread(lambda: migrate.upgrade(dsn, patience=patience))
    await _until(dsn, QUEUED_ON_LAYERS)
    debit = asyncio.create_task(_debit_seconds(dsn))
    await _until(dsn, DEBIT_QUEUED)
    return migrating, debit


async def test_without_a_bound_a_waiting_revision_stalls_every_debit(fresh_dsn: str) -> None:
    """What the bound is for: with none (timeout 0), a debit asked for after
    the migration's request waits for the report to end."""
    await asyncio.to_thread(migrate.upgrade, fresh_dsn, "0035")
    patience = LockPatience(timeout_ms=0, attempts=1)
    async with _report(fresh_dsn, "SELECT count(*) FROM limit_layers"):
        migrating, debit = await _debit_behind_migration(fresh_dsn, patience)
        await asyncio.sleep(REPORT_SECONDS)
        assert not debit.done()
    # The report has ended: the migration runs, then the debit.
    assert await debit >= REPORT_SECONDS
    await migrating
    assert await fetch_value(fresh_dsn, "SELECT version_num FROM alembic_version") == "0036"


async def test_a_revision_that_cannot_lock_its_table_gives_up_and_changes_nothing(
    fresh_dsn: str,
) -> None:
    await asyncio.to_thread(migrate.upgrade, fresh_dsn, "0035")
    patience = LockPatience(timeout_ms=300, attempts=2)
    async with _report(fresh_dsn, "SELECT count(*) FROM limit_layers"):
        migrating, debit = await _debit_behind_migration(fresh_dsn, patience)
        waited = await debit
        started = time.monotonic()
        with pytest.raises(
            MigrationLocksUnavailable, match=r"not granted within 300 ms in any of 2"
        ):
            await migrating
        gave_up_after = time.monotonic() - started

    # The debit waited at most what was left of one 300 ms wait (with room
    # for a loaded machine), not for the report; the migration gave up after
    # its pause (1 s) and a second wait.
    assert waited < 1.0
    assert 1.0 < gave_up_after < 10.0
    assert await fetch_value(fresh_dsn, "SELECT version_num FROM alembic_version") == "0035"
    assert await fetch_value(fresh_dsn, "SELECT to_regproc('lq_layer_policy_rules')") is None


async def test_a_revision_tried_again_applies_once_the_table_is_free(
    fresh_dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    await asyncio.to_thread(migrate.upgrade, fresh_dsn, "0035")
    patience = LockPatience(timeout_ms=300, attempts=5)
    with caplog.at_level(logging.WARNING, logger="llmquota.store.lock_patience"):
        async with _report(fresh_dsn, "SELECT count(*) FROM limit_layers"):
            migrating = _in_thread(lambda: migrate.upgrade(fresh_dsn, patience=patience))
            await _until(fresh_dsn, QUEUED_ON_LAYERS)
            await asyncio.sleep(0.6)  # past the first try's 300 ms wait
        await migrating

    assert await fetch_value(fresh_dsn, "SELECT version_num FROM alembic_version") == "0036"
    tries = [r.getMessage() for r in caplog.records if "was not granted" in r.getMessage()]
    assert tries
    assert tries[0] == (
        "tables: a lock was not granted within 300 ms (try 1 of 5); rolled back, "
        "trying again in 1 s"
    )


async def test_the_repeatable_scripts_are_bounded_and_tried_again_too(
    fresh_dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Re-applying sql/ replaces its views, which takes ACCESS EXCLUSIVE on
    each: a report reading one holds that back as it holds a revision."""
    await asyncio.to_thread(migrate.upgrade, fresh_dsn)
    recorded = "SELECT max(applied_at) FROM schema_repeatables"
    before = await fetch_value(fresh_dsn, recorded)
    patience = LockPatience(timeout_ms=300, attempts=2)

    def reapply() -> list[AppliedScript]:
        return migrate.apply_repeatables(fresh_dsn, force=True, patience=patience)

    async with _report(fresh_dsn, "SELECT count(*) FROM global_layer"):
        with pytest.raises(MigrationLocksUnavailable, match=r"^functions: a lock it needs"):
            await _in_thread(reapply)
    assert await fetch_value(fresh_dsn, recorded) == before

    caplog.clear()  # the first part's tries
    with caplog.at_level(logging.WARNING, logger="llmquota.store.lock_patience"):
        async with _report(fresh_dsn, "SELECT count(*) FROM global_layer"):
            reapplying = _in_thread(reapply)
            await _until(fresh_dsn, _queued("global_layer", "AccessExclusiveLock"))
            await asyncio.sleep(0.6)  # past the first try's 300 ms wait
        applied = await reapplying
    tries = [r.getMessage() for r in caplog.records if "was not granted" in r.getMessage()]
    assert tries == [
        "functions: a lock was not granted within 300 ms (try 1 of 2); rolled back, "
        "trying again in 1 s"
    ]
    assert {script.reason for script in applied} == {"forced"}
    assert await fetch_value(fresh_dsn, recorded) != before


def test_llmquota_migrate_says_which_step_could_not_lock_and_exits_2(fresh_dsn: str) -> None:
    """The command's own settings: LLMQUOTA_MIGRATE_LOCK_TIMEOUT_MS and
    LLMQUOTA_MIGRATE_LOCK_ATTEMPTS."""
    migrate.upgrade(fresh_dsn, "0035")
    env = {"LLMQUOTA_MIGRATE_LOCK_TIMEOUT_MS": "200", "LLMQUOTA_MIGRATE_LOCK_ATTEMPTS": "1"}

    async def refused() -> subprocess.CompletedProcess[str]:
        async with _report(fresh_dsn, "SELECT count(*) FROM limit_layers"):
            return await asyncio.to_thread(run_cli, "migrate", dsn=fresh_dsn, env=env, check=False)

    result = asyncio.run(refused())
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines()[-1] == (
        "llmquota migrate: tables: a lock it needs was not granted within 200 ms in its one"
        " try; it was rolled back. A session holds a table it changes (a long transaction or"
        " report: see pg_stat_activity); run migrate again once it ends"
    )
    assert migrate.head_revision() != "0035"
    assert asyncio.run(fetch_value(fresh_dsn, "SELECT version_num FROM alembic_version")) == "0035"

    run_cli("migrate", dsn=fresh_dsn, env=env)  # nothing holds the table now
    assert (
        asyncio.run(fetch_value(fresh_dsn, "SELECT version_num FROM alembic_version"))
        == migrate.head_revision()
    )


def test_pauses_grow_to_fifteen_seconds_and_bad_patience_is_refused() -> None:
    patience = LockPatience()
    assert (patience.timeout_ms, patience.attempts) == (1_000, 10)
    assert [patience.pause_seconds(n) for n in range(1, 8)] == [1, 2, 4, 8, 15, 15, 15]
    with pytest.raises(ValueError, match="attempts 1 or more"):
        LockPatience(attempts=0)
    with pytest.raises(ValueError, match="timeout_ms must be 0 or more"):
        LockPatience(timeout_ms=-1)


@pytest.mark.parametrize("relative", ["-1", "+2", "head-1", "0030+1"])
def test_a_relative_revision_is_refused_since_each_try_would_move_again(relative: str) -> None:
    """Checked before any connection: no database is named here."""
    with pytest.raises(ValueError, match="not a step from here"):
        migrate.upgrade("postgresql://nobody@/nothing", relative)
    with pytest.raises(ValueError, match="not a step from here"):
        migrate.downgrade("postgresql://nobody@/nothing", relative)
