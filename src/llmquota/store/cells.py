"""Cells: K copies of the schema in one database (`llmquota migrate --cells K`).

Distributing every table by tenant would change most keys of the schema and
every statement that names them (docs/scaling.md). Citus's schema-based
sharding asks for none of that: every table of a distributed schema becomes a
single-shard table, all of a schema's tables on one node, and a statement (or
a delegated function call) that names only that schema runs there. So a
deployment of K cells is K copies of today's schema, `cell_1` ... `cell_K`,
each migrated by the same migrations and SQL files; a tenant is to live in
the cell its name hashes to, and every admission, settlement and sweep of it
runs on that cell's node, whole: its locks, its refill arithmetic, its clock.

Seven frozen revisions name `public` or `reporting`, so a cell is born as
`public` (the migrations run as they always do) and is then renamed, and its
functions pinned to it (sql/cells_queries.sql, `seal_cell`). On Citus the cell
then becomes a distributed schema, its functions are created on its node, and
each is delegated: a call from the coordinator is one statement to that node.

A library process reaches every cell through admission/cells.py (a Limiter
per cell, `cells_in` and `in_cell` here); a service at a cell's DSN serves
that cell, and at the `public` DSN every cell (`cells_served_at`,
api/cells_front.py); a maintenance command at the database's own DSN reaches each
(`deployments_of`). A database-level `reporting` schema reads the cell of
the session that calls it (`reporting_over_cells`).

A build with a newer release upgrades each existing cell in place
(`_upgrade`): the revisions it lacks run with the cell as the search_path
(every revision since cells exist names no schema; the build refuses a cell
one would not reach), and the repeatable scripts that changed run with
`public` and `reporting` rewritten to the cell's names, its functions
pinned again in the same transaction.
"""

from __future__ import annotations

import asyncio
import re
from dataclasses import dataclass
from urllib.parse import parse_qs, urlsplit

import asyncpg

from llmquota.domain.cell_hints import HINTED_CELLS
from llmquota.store import migrate
from llmquota.store.connection import translate_errors
from llmquota.store.lock_patience import DEFAULT_PATIENCE, LockPatience
from llmquota.store.sqlfiles import named_queries

__all__ = [
    "MAX_CELLS",
    "Cell",
    "CellsError",
    "build_cells",
    "cell_name",
    "cell_named_in",
    "cell_served_at",
    "cells_in",
    "cells_served_at",
    "deployments_of",
    "in_cell",
    "script_in_cell",
]

# Tenants are placed by hashing their name over the cells, so the count is
# fixed once cells exist; 64 is more nodes than a cluster of this kind runs,
# and as many as a reservation id's hint can name (domain/cell_hints.py).
MAX_CELLS = HINTED_CELLS
# Held for the whole build, so that two `migrate --cells` queue: a cell is
# migrated in `public` and renamed, and two builds must not share `public`.
CELLS_LOCK = "llmquota.cells"
# What a cell's schema is called: cell_<number> (cell_name).
_CELL_NAME = re.compile(r"cell_[0-9]+")
# The schemas a migration or a repeatable script may name, which a cell
# renamed (seal_cell): `public` (the role PUBLIC is in capitals) and `reporting`
# (`llmquota_reporting`, a role, is one word with it: no boundary).
_PUBLIC = re.compile(r"\bpublic\b")
_REPORTING = re.compile(r"(?<!')\breporting\b")
_SCHEMA_NAMED = re.compile(r"\b(?:public|reporting)\b")


class CellsError(Exception):
    """Cells cannot be built as asked, or were built but for what the message names."""


@dataclass(frozen=True)
class Cell:
    """One cell after the build: its schema, what the build did, where it lives."""

    name: str
    status: str  # "built" | "up to date" | "upgraded (what was done)"
    node: str | None  # host:port of its Citus node; None on a plain PostgreSQL


def cell_name(number: int) -> str:
    """The schema of cell `number` (1-based)."""
    return f"cell_{number}"


def in_cell(dsn: str, cell: str) -> str:
    """`dsn` (a URI) with the cell as its search_path: how a service of that
    cell connects (asyncpg passes a query parameter it does not know on to the
    server as a setting)."""
    return f"{dsn}{'&' if '?' in dsn else '?'}search_path={_quoted(cell)}"


def cell_named_in(dsn: str) -> str | None:
    """The cell a DSN's search_path names (as `in_cell` writes it), or None."""
    paths = parse_qs(urlsplit(dsn).query).get("search_path", [])
    path = paths[-1].strip().strip('"') if paths else ""
    return path if _CELL_NAME.fullmatch(path) else None


def cell_index_named_in(dsn: str | None) -> int | None:
    """The 0-based index of the cell a DSN's search_path names, or None: what
    a cell's service hints at in the reservation ids it makes
    (domain/cell_hints.py). A search_path set in `options` or on the role
    gives no hint, which only costs an admin key's settle its old way; so
    does a name no build makes (cell_0, past MAX_CELLS)."""
    named = None if dsn is None else cell_named_in(dsn)
    index = None if named is None else int(named.removeprefix("cell_")) - 1
    return index if index is not None and 0 <= index < MAX_CELLS else None


async def cell_served_at(dsn: str) -> str | None:
    """The cell a service at `dsn` works in: the one its search_path names,
    else its session's schema when that is a cell (a search_path set in
    `options` or on the role), else None."""
    named = cell_named_in(dsn)
    if named is not None:
        return named
    with translate_errors():
        connection = await asyncpg.connect(dsn, statement_cache_size=0)
        try:
            schema = await connection.fetchval("SELECT current_schema()")
        finally:
            await connection.close()
    return schema if isinstance(schema, str) and _CELL_NAME.fullmatch(schema) else None


async def cells_in(dsn: str) -> list[str]:
    """The cells of the database at `dsn`, in order; none when it holds none.

    CellsError when they are not all there: a tenant's cell is its name's hash
    over the count the cells were built for, so a service must see them all.
    """
    _, cells = await _look(dsn)
    return cells


async def cells_served_at(dsn: str) -> list[str]:
    """The cells a service at `dsn` serves: every cell when `dsn` is the
    `public` DSN of a database of cells (api/cells_front.py); none for a plain
    database, or a DSN that names one cell (that cell's own service)."""
    schema, cells = await _look(dsn)
    return cells if schema == "public" else []


async def deployments_of(dsn: str) -> list[tuple[str | None, str]]:
    """What a maintenance command (sweep, audit) at `dsn` looks after: each
    cell, with its DSN, when `dsn` is the `public` DSN of a database of cells;
    otherwise the one deployment `dsn` names (None: not a cell).

    A DSN whose search_path names a cell is that cell alone, as a service of
    that cell sees it.
    """
    schema, cells = await _look(dsn)
    if schema != "public":
        return [(schema if schema is not None and schema.startswith("cell_") else None, dsn)]
    return [(name, in_cell(dsn, name)) for name in cells] or [(None, dsn)]


async def _look(dsn: str) -> tuple[str | None, list[str]]:
    """The schema a session at `dsn` works in (None: none it may use), and the
    database's cells. One connection, without prepared statements (a
    transaction pooler may be in between); a server that does not answer is
    StoreUnavailable, as for any command."""
    with translate_errors():
        connection = await asyncpg.connect(dsn, statement_cache_size=0)
        try:
            schema = await connection.fetchval("SELECT current_schema()")
            rows = await connection.fetch(named_queries("cells_queries.sql")["cells"])
        finally:
            await connection.close()
    names = [str(row["cell"]) for row in rows]
    expected = [cell_name(k) for k in range(1, len(rows) + 1)]
    if names != expected or any(row["built_for"] != len(rows) for row in rows):
        built_for = sorted({row["built_for"] for row in rows})
        raise CellsError(
            f"the database holds cells {', '.join(names)} built for {built_for}: "
            "finish them with `llmquota migrate --cells K` first"
        )
    return schema, names


def build_cells(dsn: str, count: int, patience: LockPatience = DEFAULT_PATIENCE) -> list[Cell]:
    """Make the database hold exactly `count` cells, building the missing ones.

    Refused (CellsError, nothing changed) when `count` is out of range, when
    the database's cells were built for another count, when `public` holds a
    deployment, or when an existing cell is behind this code. A build that
    was interrupted is finished by the next: the cells it did not reach are
    built, and on Citus a cell not yet distributed or delegated is.
    """
    if not 1 <= count <= MAX_CELLS:
        raise CellsError(f"the number of cells must be between 1 and {MAX_CELLS}, not {count}")
    return asyncio.run(_build(dsn, count, patience))


async def _build(dsn: str, count: int, patience: LockPatience) -> list[Cell]:
    queries = named_queries("cells_queries.sql")
    connection = await asyncpg.connect(dsn)
    try:
        await connection.execute("SELECT pg_advisory_lock(hashtextextended($1, 0))", CELLS_LOCK)
        existing = await _refuse_what_cannot_be_built(connection, count)
        citus = bool(await connection.fetchval(queries["is_citus"]))
        cells: list[Cell] = []
        for cell in (cell_name(k) for k in range(1, count + 1)):
            if cell in existing:
                status = await _upgrade(connection, dsn, cell, count, patience=patience)
            else:
                await connection.execute(queries["drop_reporting_over_cells"])
                async with connection.transaction():
                    await connection.execute(queries["name_the_cell"], cell, count)
                    await connection.execute(queries["mark_public"])
                await asyncio.to_thread(migrate.upgrade, dsn, for_a_cell=True, patience=patience)
                async with connection.transaction():
                    await connection.execute(queries["name_the_cell"], cell, count)
                    await connection.execute(queries["seal_cell"])
                    await connection.execute(queries["pin_cell"])
                status = "built"
            if citus and await _distribute(connection, cell) and status == "up to date":
                status = "built"  # an interrupted build's distribution, finished
            if citus:
                async with connection.transaction():
                    await connection.execute(queries["name_the_cell"], cell, count)
                    await connection.execute(queries["stamp_ledger_rows_on_their_node"])
            cells.append(Cell(cell, status, await _node_of(connection, cell) if citus else None))
        await _report_over_cells(connection, cells)
        return cells
    finally:
        await connection.close()


async def _report_over_cells(connection: asyncpg.Connection, cells: list[Cell]) -> None:
    """Bring the database's `reporting` up to date, in place: what finance built
    on it stays (sql/cells_queries.sql). A report that changed its result, or that
    the cells no longer have, with something of finance's standing on it is left
    as it was, the rest brought up to date, and CellsError names each."""
    queries = named_queries("cells_queries.sql")
    await connection.execute(queries["reporting_over_cells"])
    refused = await connection.fetchval(queries["reporting_refused"])
    if refused:
        raise CellsError(
            f"the {len(cells)} cells are built and the database's reporting schema is up to "
            f"date but for what finance built on reports this release changes or retires: "
            f"{'; '.join(refused.splitlines())}. Drop it, run `migrate --cells` again, then "
            "make it again over the reports as they are now"
        )


async def _refuse_what_cannot_be_built(connection: asyncpg.Connection, count: int) -> list[str]:
    """The cells already built, or CellsError for a build that must not start."""
    queries = named_queries("cells_queries.sql")
    rows = await connection.fetch(queries["cells"])
    counts = {row["built_for"] for row in rows}
    if counts and counts != {count}:
        raise CellsError(
            f"this database has {len(rows)} cells ({', '.join(r['cell'] for r in rows)}) "
            f"built for {' or '.join(sorted(map(str, counts)))}; their number is fixed once "
            "built, since tenants are placed by it"
        )
    for row in rows:
        await _check_upgradable(connection, row["cell"])
    public = await connection.fetchrow(queries["public_state"])
    if public["schema"] != "public":
        raise CellsError(
            f"the connection's schema is {public['schema'] or 'none'}, not public: build cells "
            "with the database's own DSN, without a search_path"
        )
    if public["extensions"]:
        raise CellsError(
            f"extensions live in the public schema ({', '.join(public['extensions'])}): a cell "
            "is built as public and renamed, and would take them along; move them first "
            "(ALTER EXTENSION ... SET SCHEMA)"
        )
    built = [row["cell"] for row in rows]
    next_cell = next(cell_name(k) for k in range(1, count + 2) if cell_name(k) not in built)
    # A build stopped while it migrated that cell in public: resumed, not refused.
    resumed = public["mark"] == f"llmquota {next_cell} of {count}, being built"
    if public["deployment"] and not resumed:
        raise CellsError(
            "the public schema holds a deployment (or a reporting schema exists): "
            "cells are built in a database of their own"
        )
    return built


async def _check_upgradable(connection: asyncpg.Connection, cell: str) -> None:
    """Refuse a cell that cannot be upgraded in place: one at a revision this
    code does not know (a newer release built it), or one a revision still to
    run would not reach (it names a schema: the seven frozen ones up to 0026,
    run before cells existed, name `public` or `reporting`)."""
    revision = await connection.fetchval(f"SELECT version_num FROM {_quoted(cell)}.alembic_version")
    due = migrate.revisions_after(revision)
    if due is None:
        raise CellsError(
            f"{cell} is at revision {revision}, which this code does not know: a newer "
            "release built it; build or upgrade cells with that release or a later one"
        )
    naming = [number for number, text in due if _SCHEMA_NAMED.search(text)]
    if naming:
        raise CellsError(
            f"{cell} is at revision {revision}: revisions {', '.join(naming)} name a schema "
            "and cannot run in a cell in place; build the cells again (docs/scaling.md, Cells)"
        )


async def _upgrade(
    connection: asyncpg.Connection, dsn: str, cell: str, count: int, *, patience: LockPatience
) -> str:
    """Bring a cell built by an older release up to this code, in place, while
    its services run: its revisions still to run (their DDL names no schema,
    so it lands in the cell its DSN's search_path names), then its repeatable
    scripts that changed, rewritten to name the cell's schemas and applied with
    its functions pinned again in one transaction (callers see the old
    functions or the new ones, pinned). Its functions are pinned again on every
    build (each step repeatable), so a build stopped between a revision and
    its pin, or a release that changes only the pin's rules, is finished by
    the next. Its status: "up to date" or what was done."""
    queries = named_queries("cells_queries.sql")
    at = in_cell(dsn, cell)
    revision = await connection.fetchval(f"SELECT version_num FROM {_quoted(cell)}.alembic_version")
    done = []
    if revision != migrate.head_revision():
        await asyncio.to_thread(migrate.upgrade_cell, at, patience)
        done.append(f"revision {revision} to {migrate.head_revision()}")

    async def pin(session: asyncpg.Connection) -> None:
        await session.execute(queries["name_the_cell"], cell, count)
        await session.execute(queries["pin_cell"])

    applied = await migrate.apply_repeatables_async(
        at, rewrite=lambda text: script_in_cell(text, cell), finish=pin, patience=patience
    )
    if applied:
        done.append(f"scripts {', '.join(script.name for script in applied)}")
    else:  # a revision's new functions, or a build stopped before its pin: pinned all the same
        async with connection.transaction():
            await pin(connection)
    return f"upgraded ({'; '.join(done)})" if done else "up to date"


def script_in_cell(text: str, cell: str) -> str:
    """A repeatable script as it runs in a cell: `public` (the schema; the
    role PUBLIC is written in capitals) names the cell, `reporting` the
    cell's reporting schema, as seal_cell renamed them; but not a text that
    begins with `reporting` (a view's comment naming the report it shows, as
    a build leaves it). SQL comments change too."""
    return _REPORTING.sub(f"{cell}_reporting", _PUBLIC.sub(cell, text))


async def _distribute(connection: asyncpg.Connection, cell: str) -> bool:
    """Make the cell a distributed schema and delegate its functions, unless done.

    Distributing a schema moves its tables but not its functions. Each is
    created again from the coordinator (Citus then creates it on the cell's
    node too, with its argument types), function bodies unchecked until all
    exist, in the order they were made; then each is delegated but those that
    have no node (sql/cells_queries.sql, cell_functions, says which). Every
    step is idempotent, so a build interrupted here is finished by the next.
    Returns whether there was anything to do.
    """
    queries = named_queries("cells_queries.sql")
    functions = await connection.fetch(queries["cell_functions"], cell)
    delegated = [f["signature"] for f in functions if f["delegated"]]
    if await connection.fetchval(queries["citus_cell_complete"], cell, len(delegated)):
        return False
    if not await connection.fetchval(queries["is_distributed"], cell):
        async with connection.transaction():
            await connection.execute(queries["distribute_schema"], cell)
    await connection.execute("SET check_function_bodies = off")
    try:
        for function in functions:
            await connection.execute(function["definition"])
    finally:
        await connection.execute("RESET check_function_bodies")
    layers = f"{_quoted(cell)}.limit_layers"
    for signature in delegated:
        await connection.execute(queries["delegate_function"], signature, layers)
    return True


async def _node_of(connection: asyncpg.Connection, cell: str) -> str | None:
    """host:port of the Citus node that holds the cell's tables."""
    row = await connection.fetchrow(named_queries("cells_queries.sql")["cell_node"], _quoted(cell))
    return None if row is None else f"{row['nodename']}:{row['nodeport']}"


async def node_of_this_cell(connection: asyncpg.Connection) -> tuple[str, int] | None:
    """The Citus node that holds the cell this session works in (its DSN's
    search_path), or None: not Citus, or a schema that is not a distributed
    cell (plain PostgreSQL's cells live where the DSN points).

    A cell's triggers run on that node, and so do the NOTIFYs they send: a
    session elsewhere (the coordinator) never hears them.
    """
    queries = named_queries("cells_queries.sql")
    if not await connection.fetchval(queries["is_citus"]):
        return None
    row = await connection.fetchrow(queries["cell_node"], None)
    return None if row is None else (str(row["nodename"]), int(row["nodeport"]))


def _quoted(cell: str) -> str:
    """The cell's schema as an identifier (cell names are cell_<number>: no quoting needed)."""
    if not cell.startswith("cell_") or not cell[5:].isdigit():
        raise ValueError(f"not a cell's name: {cell!r}")
    return cell
