"""Migrating the database from code (`llmquota migrate`, `serve`, tests, bench).

Two steps, always in this order (migrations/README.md has the rule):

1. the versioned migrations (alembic, migrations/versions/): frozen table
   changes; replaying an old revision gives that revision's tables;
2. the repeatable scripts of sql/ (functions, views, grants): every script
   whose SHA-256 differs from the one recorded in `schema_repeatables` is
   applied, in one transaction, in the order of
   `llmquota.store.sqlfiles.REPEATABLE_SCRIPTS`.

`upgrade(dsn)` does both. `upgrade(dsn, revision)` for an older revision does
only the first: it gives that revision's tables, never today's functions.
Both steps take the same advisory lock, so concurrent `migrate` runs (several
API containers starting with `--migrate`) queue instead of racing.

Both steps run while the service does, and wait for the locks their DDL
takes (ACCESS EXCLUSIVE for most of it) with a bound (LockPatience): a lock
request that waits queues every later one on the same table behind it, so a
revision that waited for a long report's or a stuck transaction's lock
without one would stall every admission for as long. Past the bound the
revision is rolled back (each is one transaction) and tried again after a
pause, in which the service runs.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import asyncpg
from alembic import command
from alembic.config import Config
from alembic.script import ScriptDirectory
from alembic.script.revision import RevisionError

from llmquota.resources import migrations_dir
from llmquota.store.lock_patience import (
    DEFAULT_PATIENCE,
    LockPatience,
    MigrationLocksUnavailable,
    patiently,
    patiently_async,
)
from llmquota.store.migration_support import lock_timeout_for_workers
from llmquota.store.sqlfiles import RepeatableScript, named_queries, repeatable_scripts

__all__ = [
    "MIGRATION_LOCK",
    "AppliedScript",
    "LockPatience",
    "MigrationLocksUnavailable",
    "MigrationRefused",
    "alembic_config",
    "apply_repeatables",
    "apply_repeatables_async",
    "downgrade",
    "head_revision",
    "scripts_due",
    "upgrade",
]

_logger = logging.getLogger(__name__)

# The advisory lock both steps hold (key: hashtextextended(MIGRATION_LOCK, 0)).
# Advisory locks belong to one database, so migrating another database on the
# same server does not wait for it.
MIGRATION_LOCK = "llmquota.migrate"
# The alembic config option migrations/env.py connects by: the DSN as asyncpg
# takes it (several hosts, target_session_attrs, a socket directory).
DSN_OPTION = "llmquota.dsn"
# The alembic config option carrying LockPatience.timeout_ms to env.py.
LOCK_TIMEOUT_OPTION = "llmquota.lock_timeout_ms"

_T = TypeVar("_T")


@dataclass(frozen=True)
class AppliedScript:
    """A repeatable script that was applied, and why.

    reason: "new" (never applied to this database), "changed" (its checksum
    differs from the recorded one), "follows" (a grants script re-applied
    because a script before it was), "forced".
    """

    name: str
    reason: str
    checksum: str

    def describe(self) -> str:
        """One line for the operator."""
        if self.reason == "new":
            return f"functions: {self.name} applied (new)"
        if self.reason == "follows":
            return f"functions: {self.name} re-applied (it follows every change)"
        return f"functions: {self.name} {self.reason}, re-applied"


def _scripts_config() -> Config:
    """An alembic Config naming this package's migrations, and no database."""
    config = Config()
    config.set_main_option("script_location", str(migrations_dir()))
    return config


def alembic_config(dsn: str, patience: LockPatience | None = None) -> Config:
    """An alembic Config for this package's migrations against `dsn`."""
    config = _scripts_config()
    # ConfigParser interpolation: a literal % in a password must be doubled.
    config.set_main_option(DSN_OPTION, dsn.replace("%", "%%"))
    if patience is not None:
        config.set_main_option(LOCK_TIMEOUT_OPTION, str(patience.timeout_ms))
    return config


def _outside_event_loop(func: Callable[..., _T], *args: Any) -> _T:
    """Call `func`; on a worker thread when an event loop runs in this one.

    alembic's env.py and apply_repeatables run their own event loop, which
    cannot nest in a running one (an async caller).
    """
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return func(*args)
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(func, *args).result()


def _run(coroutine: Callable[[], Coroutine[Any, Any, _T]]) -> _T:
    return _outside_event_loop(lambda: asyncio.run(coroutine()))


def head_revision() -> str | None:
    """The newest revision of migrations/versions/ (what `upgrade` migrates to)."""
    return ScriptDirectory.from_config(_scripts_config()).get_current_head()


def revisions_after(revision: str) -> list[tuple[str, str]] | None:
    """Each revision after `revision` up to head, oldest first, with its
    file's text; None when `revision` is not one of this code's (a newer
    release's)."""
    scripts = ScriptDirectory.from_config(_scripts_config())
    try:
        found = list(scripts.iterate_revisions("heads", revision))
    except RevisionError:
        return None
    return [(s.revision, Path(s.path).read_text(encoding="utf-8")) for s in reversed(found)]


def _is_head(revision: str) -> bool:
    return revision in ("head", "heads") or revision == head_revision()


class MigrationRefused(Exception):
    """The database is not one `upgrade` may migrate as asked; nothing was changed."""


def upgrade(
    dsn: str,
    revision: str = "head",
    *,
    for_a_cell: bool = False,
    patience: LockPatience = DEFAULT_PATIENCE,
) -> list[AppliedScript]:
    """Migrate the database to `revision`; at head, apply the repeatable scripts too.

    An older revision gets the versioned migrations up to it and nothing of
    sql/: that revision's tables, as it created them. Returns the repeatable
    scripts applied (none below head, or when the functions were up to date).

    Refused (MigrationRefused) when the connection's schema is not `public`
    (a DSN naming a cell's search_path: the migrations name `public`), or
    when the database holds cells, unless the cells' builder asks
    (`for_a_cell`: it migrates `public` and renames it, store/cells.py).
    MigrationLocksUnavailable when a step's locks are not granted (`patience`).
    """
    _refuse_relative(revision)
    _run(lambda: _refuse_other_schemas(dsn, for_a_cell))
    _versioned(alembic_config(dsn, patience), revision, patience)
    if _is_head(revision):
        return apply_repeatables(dsn, patience=patience)
    return []


def _versioned(config: Config, revision: str, patience: LockPatience) -> None:
    """alembic's upgrade to `revision`, a try resuming at the revision the
    last one could not apply (`revision` a named one: see _refuse_relative)."""
    _outside_event_loop(patiently, patience, "tables", lambda: command.upgrade(config, revision))


def _refuse_relative(revision: str) -> None:
    """A target relative to where the database is (alembic's `-1`, `+2`,
    `head-1`) would move again on each try: only a named one is taken."""
    if "+" in revision or "-" in revision:
        raise ValueError(f"name the revision to migrate to, not a step from here: {revision!r}")


async def _refuse_other_schemas(dsn: str, for_a_cell: bool) -> None:
    connection = await asyncpg.connect(dsn)
    try:
        schema = await connection.fetchval("SELECT current_schema()")
        cells = await connection.fetch(named_queries("cells_queries.sql")["cells"])
    finally:
        await connection.close()
    if schema != "public":
        raise MigrationRefused(
            f"the connection's schema is {schema or 'none'}, not public: the migrations run in "
            "public (a cell's search_path in the DSN? cells are migrated by "
            "`llmquota migrate --cells K` with the database's own DSN; docs/scaling.md)"
        )
    if cells and not for_a_cell:
        raise MigrationRefused(
            "this database holds cells: migrate it with `llmquota migrate --cells K` "
            "(docs/scaling.md, Cells)"
        )


def upgrade_cell(cell_dsn: str, patience: LockPatience = DEFAULT_PATIENCE) -> None:
    """Migrate one cell in place to head: its DSN's search_path names the cell
    (store/cells.py, which checks first that every revision still to run names
    no schema, and applies the repeatable scripts after)."""
    _versioned(alembic_config(cell_dsn, patience), "head", patience)


def downgrade(dsn: str, revision: str, patience: LockPatience = DEFAULT_PATIENCE) -> None:
    """Migrate the database down to `revision` ("base": nothing at all).

    The tables become those of `revision`. Functions and views are not
    versioned: the ones still there keep today's bodies (a downgrade drops the
    ones whose tables it drops, and the one to base drops them all). Below
    revision 0006 the record of the repeatable scripts goes too, so the next
    `upgrade` to head applies every script again. Refused where `upgrade` is.
    """
    _refuse_relative(revision)
    _run(lambda: _refuse_other_schemas(dsn, False))
    config = alembic_config(dsn, patience)
    _outside_event_loop(patiently, patience, "tables", lambda: command.downgrade(config, revision))


def apply_repeatables(
    dsn: str,
    *,
    sql_root: Path | None = None,
    force: bool = False,
    patience: LockPatience = DEFAULT_PATIENCE,
) -> list[AppliedScript]:
    """Apply the repeatable scripts that changed since this database last ran them.

    `sql_root` replaces sql/ (tests); `force` applies every script. Returns
    what was applied (`llmquota migrate` prints it); an empty list means the
    functions were up to date. Needs the database at head (the
    `schema_repeatables` table).
    """
    return _run(
        lambda: apply_repeatables_async(dsn, sql_root=sql_root, force=force, patience=patience)
    )


async def apply_repeatables_async(
    dsn: str,
    *,
    sql_root: Path | None = None,
    force: bool = False,
    rewrite: Callable[[str], str] | None = None,
    finish: Callable[[asyncpg.Connection], Awaitable[object]] | None = None,
    patience: LockPatience = DEFAULT_PATIENCE,
) -> list[AppliedScript]:
    """apply_repeatables for an async caller (logs only scripts gone from sql/).

    For a cell upgraded in place (store/cells.py): `rewrite` makes each
    script's text name the cell's schemas, and `finish` runs in the same
    transaction once any script was applied (the cell's functions pinned)."""
    scripts = repeatable_scripts(sql_root)
    return await patiently_async(
        patience,
        "functions",
        lambda: _apply_repeatables_once(
            dsn, scripts, force=force, rewrite=rewrite, finish=finish, patience=patience
        ),
    )


async def _apply_repeatables_once(
    dsn: str,
    scripts: list[RepeatableScript],
    *,
    force: bool,
    rewrite: Callable[[str], str] | None,
    finish: Callable[[asyncpg.Connection], Awaitable[object]] | None,
    patience: LockPatience,
) -> list[AppliedScript]:
    """One try of apply_repeatables_async, in one transaction."""
    connection = await asyncpg.connect(dsn)
    try:
        async with connection.transaction():
            await connection.execute(
                "SELECT pg_advisory_xact_lock(hashtextextended($1, 0))", MIGRATION_LOCK
            )
            # Bounded only now: waiting for another migrate's advisory lock is
            # queueing. On Citus the workers' connections get it too.
            for statement in lock_timeout_for_workers(f"{patience.timeout_ms}ms"):
                await connection.execute(statement)
            if await connection.fetchval("SELECT to_regclass('schema_repeatables')") is None:
                raise RuntimeError(
                    "schema_repeatables does not exist: migrate the database to head first"
                )
            # Read after the lock: a run that held it before us has recorded its work.
            recorded: dict[str, str] = {
                row["name"]: row["checksum"]
                for row in await connection.fetch("SELECT name, checksum FROM schema_repeatables")
            }
            applied = scripts_due(scripts, recorded, force)
            by_name = {script.name: script for script in scripts}
            for entry in applied:
                text = by_name[entry.name].text
                await connection.execute(text if rewrite is None else rewrite(text))
                await connection.execute(
                    "INSERT INTO schema_repeatables (name, checksum, applied_at)"
                    " VALUES ($1, $2, clock_timestamp())"
                    " ON CONFLICT (name) DO UPDATE"
                    " SET checksum = excluded.checksum, applied_at = excluded.applied_at",
                    entry.name,
                    entry.checksum,
                )
            if applied and finish is not None:
                await finish(connection)
            # A script removed from sql/: its record goes, its objects stay
            # (dropping them is the job of a script or a versioned migration).
            gone = sorted(set(recorded) - set(by_name))
            if gone:
                await connection.execute(
                    "DELETE FROM schema_repeatables WHERE name = ANY($1::text[])", gone
                )
                for name in gone:
                    _logger.warning(
                        "functions: %s is no longer in sql/; its record is removed, "
                        "its objects are left as they are",
                        name,
                    )
    finally:
        await connection.close()
    return applied


def scripts_due(
    scripts: list[RepeatableScript], recorded: dict[str, str], force: bool
) -> list[AppliedScript]:
    """The scripts to apply, in order, with the reason for each."""
    due: list[AppliedScript] = []
    for script in scripts:
        if force:
            reason = "forced"
        elif script.name not in recorded:
            reason = "new"
        elif recorded[script.name] != script.checksum:
            reason = "changed"
        elif script.follows_every_change and due:
            reason = "follows"
        else:
            continue
        due.append(AppliedScript(script.name, reason, script.checksum))
    return due
