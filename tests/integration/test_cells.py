"""Cells (`llmquota migrate --cells K`, store/cells.py): K whole deployments in one database.

Each cell is today's schema under a name of its own, `cell_1` ... `cell_K`,
and a service reaches one by its search_path. Here, on any PostgreSQL: each
cell admits exactly its own burst under concurrency and writes its own ledger,
a second build changes nothing, and what cannot be built is refused with
nothing changed. On CI's Citus leg the same tests run on distributed schemas,
each cell on a worker; tests/citus/test_cells.py proves that each hot call is
one statement on that worker.
"""

from __future__ import annotations

import asyncio
import random
from collections import Counter

import asyncpg
import pytest
from alembic import command

from llmquota.admission.cells import CellLimiters
from llmquota.admission.limiter import Limiter, Reservation
from llmquota.config import Settings
from llmquota.domain.cells import cell_of
from llmquota.domain.errors import RateLimited
from llmquota.domain.policy import Policy
from llmquota.finance.ledger import LedgerStore
from llmquota.store import migrate
from llmquota.store.cells import MAX_CELLS, CellsError, build_cells, cell_name, in_cell
from llmquota.store.lock_patience import LockPatience, MigrationLocksUnavailable
from llmquota.store.migrate import MigrationRefused
from llmquota.store.sqlfiles import repeatable_scripts
from tests.conftest import _admin as _execute
from tests.conftest import audit_findings
from tests.support import APP_ROLE, dsn_as, fetch_value, run_cli

from .support import attempt

# Also run on a Citus coordinator by CI's Citus leg (pyproject.toml's markers).
pytestmark = pytest.mark.citus

CELLS = 2
K = 7  # the reservations each cell's tenant has room for
N = 40  # concurrent requests per cell
COST = 1_000
REQUEST = {"tenant": "acme", "model": "gpt-4o", "input_tokens": 100, "max_tokens": 900}


@pytest.fixture
async def cells_dsn(empty_database_dsn: str) -> str:
    """A database of CELLS cells, built as `llmquota migrate --cells` builds them."""
    cells = await asyncio.to_thread(build_cells, empty_database_dsn, CELLS)
    assert [(c.name, c.status) for c in cells] == [("cell_1", "built"), ("cell_2", "built")]
    return empty_database_dsn


async def _schemas(dsn: str) -> list[str]:
    connection = await asyncpg.connect(dsn)
    try:
        rows = await connection.fetch(
            "SELECT nspname FROM pg_namespace WHERE nspname LIKE 'cell%' ORDER BY nspname"
        )
        return [row["nspname"] for row in rows]
    finally:
        await connection.close()


async def _give_room(owner_cell_dsn: str, tenant: str, burst: int) -> None:
    """A tenant with `burst` tokens refilling at 1 a minute (set up as the owner)."""
    connection = await asyncpg.connect(owner_cell_dsn)
    try:
        await connection.execute("INSERT INTO tenants (tenant) VALUES ($1)", tenant)
        await connection.execute(
            "INSERT INTO limit_layers (scope, tenant, tokens_per_minute, token_burst, tokens)"
            " VALUES ('tenant', $1, 1, $2::bigint, $2::bigint)",
            tenant,
            burst,
        )
    finally:
        await connection.close()


async def _ledger_rows(owner_cell_dsn: str) -> int:
    connection = await asyncpg.connect(owner_cell_dsn)
    try:
        return int(await connection.fetchval("SELECT count(*) FROM usage_ledger"))
    finally:
        await connection.close()


async def test_each_cell_admits_exactly_its_own_burst_and_writes_its_own_ledger(
    cells_dsn: str, settings: Settings
) -> None:
    for number in range(1, CELLS + 1):
        await _give_room(in_cell(cells_dsn, cell_name(number)), "acme", K * COST)

    for number in range(1, CELLS + 1):
        cell = in_cell(cells_dsn, cell_name(number))
        limiter = await Limiter.connect(dsn_as(cell, APP_ROLE), settings)
        try:
            results = await asyncio.gather(*(attempt(limiter, **REQUEST) for _ in range(N)))
            admitted = [r for r in results if isinstance(r, Reservation)]
            refused = [r for r in results if isinstance(r, RateLimited)]
            assert (len(admitted), len(refused)) == (K, N - K)
            for reservation in admitted:
                await limiter.settle(reservation.reservation_id, input_tokens=100, output_tokens=50)
        finally:
            await limiter.close()
        # Each cell's ledger holds its own settlements, and the later cells' none yet.
        assert await _ledger_rows(cell) == K
        for later in range(number + 1, CELLS + 1):
            assert await _ledger_rows(in_cell(cells_dsn, cell_name(later))) == 0
        assert await audit_findings(cell) == []


async def _functions(dsn: str) -> list[tuple[str, str]]:
    """Each function of the cells with its settings: what a build sets."""
    connection = await asyncpg.connect(dsn)
    try:
        rows = await connection.fetch(
            "SELECT p.oid::regprocedure::text AS f, coalesce(p.proconfig::text, '') AS config"
            "  FROM pg_proc AS p JOIN pg_namespace AS n ON n.oid = p.pronamespace"
            " WHERE n.nspname LIKE 'cell%' ORDER BY 1"
        )
        return [(row["f"], row["config"]) for row in rows]
    finally:
        await connection.close()


async def test_building_again_changes_nothing(cells_dsn: str) -> None:
    await _give_room(in_cell(cells_dsn, "cell_2"), "acme", COST)
    functions = await _functions(cells_dsn)

    again = await asyncio.to_thread(build_cells, cells_dsn, CELLS)

    assert [(c.name, c.status) for c in again] == [
        ("cell_1", "up to date"),
        ("cell_2", "up to date"),
    ]
    assert await _functions(cells_dsn) == functions
    assert len(functions) > 200
    connection = await asyncpg.connect(in_cell(cells_dsn, "cell_2"))
    try:
        assert await connection.fetchval("SELECT count(*) FROM tenants") == 1
        assert await connection.fetchval("SELECT tokens FROM limit_layers") == COST
    finally:
        await connection.close()


async def test_a_build_stopped_between_cells_is_finished_by_the_next(cells_dsn: str) -> None:
    # As a build stopped after its first cell leaves it.
    await _execute(cells_dsn, "DROP SCHEMA cell_2, cell_2_reporting CASCADE")

    again = await asyncio.to_thread(build_cells, cells_dsn, CELLS)

    assert [(c.name, c.status) for c in again] == [("cell_1", "up to date"), ("cell_2", "built")]
    assert await _schemas(cells_dsn) == ["cell_1", "cell_1_reporting", "cell_2", "cell_2_reporting"]


async def _stopped_while_migrating_cell_2(dsn: str, mark: str) -> None:
    """Leave `dsn` as a build stopped in cell_2's migrations leaves it: `public`
    marked as becoming it, and migrated half way."""
    await _execute(
        dsn,
        "DROP SCHEMA cell_2, cell_2_reporting CASCADE",
        f"COMMENT ON SCHEMA public IS '{mark}'",
    )
    await asyncio.to_thread(migrate.upgrade, dsn, "0010", for_a_cell=True)


async def test_a_build_stopped_while_it_migrated_a_cell_is_resumed(cells_dsn: str) -> None:
    await _stopped_while_migrating_cell_2(cells_dsn, "llmquota cell_2 of 2, being built")

    again = await asyncio.to_thread(build_cells, cells_dsn, CELLS)

    assert [(c.name, c.status) for c in again] == [("cell_1", "up to date"), ("cell_2", "built")]
    connection = await asyncpg.connect(in_cell(cells_dsn, "cell_2"))
    try:
        assert await connection.fetchval("SELECT version_num FROM alembic_version") == (
            migrate.head_revision()
        )
        assert await connection.fetchval("SELECT to_regclass('public.limit_layers')") is None
    finally:
        await connection.close()


async def test_a_half_migrated_public_of_another_build_is_refused(cells_dsn: str) -> None:
    await _stopped_while_migrating_cell_2(cells_dsn, "llmquota cell_2 of 3, being built")

    with pytest.raises(CellsError, match="public schema holds a deployment"):
        await asyncio.to_thread(build_cells, cells_dsn, CELLS)
    assert await _schemas(cells_dsn) == ["cell_1", "cell_1_reporting"]


async def test_migrating_a_cells_database_or_a_cell_as_one_deployment_is_refused(
    cells_dsn: str,
) -> None:
    with pytest.raises(MigrationRefused, match="holds cells: migrate it with"):
        await asyncio.to_thread(migrate.upgrade, cells_dsn)
    with pytest.raises(MigrationRefused, match="schema is cell_1, not public"):
        await asyncio.to_thread(migrate.upgrade, in_cell(cells_dsn, "cell_1"))
    with pytest.raises(MigrationRefused, match="holds cells: migrate it with"):
        await asyncio.to_thread(migrate.downgrade, cells_dsn, "0010")
    refused = run_cli("migrate", dsn=in_cell(cells_dsn, "cell_1"), check=False)
    assert refused.returncode == 2
    assert "the connection's schema is cell_1, not public" in refused.stderr
    serve = run_cli("serve", "--migrate", dsn=in_cell(cells_dsn, "cell_1"), check=False)
    assert serve.returncode == 2
    assert "llmquota serve: the connection's schema is cell_1, not public" in serve.stderr
    connection = await asyncpg.connect(cells_dsn)
    try:
        assert await connection.fetchval("SELECT to_regclass('public.limit_layers')") is None
    finally:
        await connection.close()


async def test_cells_are_built_with_the_databases_own_search_path(empty_database_dsn: str) -> None:
    with pytest.raises(CellsError, match="schema is none, not public: build cells with the"):
        await asyncio.to_thread(build_cells, in_cell(empty_database_dsn, "cell_1"), CELLS)
    assert await _schemas(empty_database_dsn) == []


async def test_an_extension_in_public_is_never_taken_along(empty_database_dsn: str) -> None:
    await _execute(empty_database_dsn, "CREATE EXTENSION citext SCHEMA public")

    with pytest.raises(CellsError, match=r"extensions live in the public schema \(citext\)"):
        await asyncio.to_thread(build_cells, empty_database_dsn, CELLS)
    assert await _schemas(empty_database_dsn) == []


async def test_the_number_of_cells_is_fixed_once_built(cells_dsn: str) -> None:
    with pytest.raises(CellsError, match=r"has 2 cells .*fixed once built"):
        await asyncio.to_thread(build_cells, cells_dsn, 3)
    assert await _schemas(cells_dsn) == ["cell_1", "cell_1_reporting", "cell_2", "cell_2_reporting"]


@pytest.mark.parametrize("count", [0, -1, MAX_CELLS + 1])
async def test_a_count_out_of_range_is_refused(empty_database_dsn: str, count: int) -> None:
    with pytest.raises(CellsError, match=f"between 1 and {MAX_CELLS}, not {count}"):
        await asyncio.to_thread(build_cells, empty_database_dsn, count)
    assert await _schemas(empty_database_dsn) == []


async def test_a_deployment_in_public_is_never_taken_over(empty_database_dsn: str) -> None:
    await asyncio.to_thread(migrate.upgrade, empty_database_dsn)

    with pytest.raises(CellsError, match="public schema holds a deployment"):
        await asyncio.to_thread(build_cells, empty_database_dsn, CELLS)

    assert await _schemas(empty_database_dsn) == []
    connection = await asyncpg.connect(empty_database_dsn)
    try:
        assert await connection.fetchval("SELECT to_regclass('public.limit_layers')") is not None
    finally:
        await connection.close()


async def _cell_objects(dsn: str, cell: str) -> list[tuple[str, ...]]:
    """A cell's functions (signature, language, settings, body, comment) and
    its reporting schema's, and that schema's views with their comments, the
    cell's name written as `cell_k`: what a build made, to compare one cell
    with another."""
    connection = await asyncpg.connect(dsn)
    try:
        rows = await connection.fetch(
            "SELECT p.oid::regprocedure::text, l.lanname, coalesce(p.proconfig::text, ''),"
            "       p.prosrc, coalesce(obj_description(p.oid, 'pg_proc'), '')"
            "  FROM pg_proc AS p JOIN pg_language AS l ON l.oid = p.prolang"
            " WHERE p.pronamespace IN ($1::regnamespace, ($1 || '_reporting')::regnamespace)"
            " UNION ALL"
            " SELECT c.relname, 'view', '', pg_get_viewdef(c.oid),"
            "        coalesce(obj_description(c.oid, 'pg_class'), '')"
            "  FROM pg_class AS c"
            " WHERE c.relnamespace = ($1 || '_reporting')::regnamespace AND c.relkind = 'v'",
            cell,
        )
        return sorted(
            tuple(str(value).replace(cell, "cell_k") for value in row.values()) for row in rows
        )
    finally:
        await connection.close()


async def test_a_cell_behind_the_code_is_upgraded_in_place_to_what_a_build_makes(
    cells_dsn: str, settings: Settings
) -> None:
    # Cell 2 as an older release left it: three revisions behind (0036's,
    # 0035's and 0034's own downgrades, run in the cell) and every script of
    # another text (the finance reports and the grants included, which name
    # its schemas).
    await asyncio.to_thread(
        command.downgrade, migrate.alembic_config(in_cell(cells_dsn, "cell_2")), "0033"
    )
    await _execute(cells_dsn, "UPDATE cell_2.schema_repeatables SET checksum = repeat('0', 64)")
    assert await fetch_value(cells_dsn, "SELECT to_regclass('cell_2.budget_transfers')") is None

    cells = await asyncio.to_thread(build_cells, cells_dsn, CELLS)

    every_script = ", ".join(script.name for script in repeatable_scripts())
    assert [c.status for c in cells] == [
        "up to date",
        f"upgraded (revision 0033 to 0036; scripts {every_script})",
    ]
    # What a build of this code makes, function for function, setting for
    # setting, body for body; nothing in `public`, no `reporting` of its own.
    assert await _cell_objects(cells_dsn, "cell_2") == await _cell_objects(cells_dsn, "cell_1")
    assert (
        await fetch_value(
            cells_dsn,
            "SELECT count(*) FROM pg_proc WHERE pronamespace = 'public'::regnamespace"
            " AND proname LIKE 'lq\\_%'",
        )
        == 0
    )
    assert await fetch_value(cells_dsn, "SELECT to_regclass('public.budget_transfers')") is None
    assert await _schemas(cells_dsn) == ["cell_1", "cell_1_reporting", "cell_2", "cell_2_reporting"]
    again = await asyncio.to_thread(build_cells, cells_dsn, CELLS)
    assert [c.status for c in again] == ["up to date", "up to date"]

    # And it works as the service's role sees it, the rebalancer's table too.
    cell = in_cell(cells_dsn, "cell_2")
    await _give_room(cell, "acme", 2 * COST)
    limiter = await Limiter.connect(dsn_as(cell, APP_ROLE), settings)
    try:
        reservation = await limiter.admit(**REQUEST)
        await limiter.settle(reservation.reservation_id, input_tokens=100, output_tokens=50)
    finally:
        await limiter.close()
    assert await _ledger_rows(cell) == 1
    assert await fetch_value(cells_dsn, "SELECT count(*) FROM cell_2.budget_transfers") == 0
    assert await audit_findings(cell) == []


async def test_a_cell_whose_table_a_report_holds_is_left_as_it_was_then_upgraded(
    cells_dsn: str,
) -> None:
    """The in-place upgrade bounds its lock waits as `migrate` does
    (tests/migration/test_lock_patience.py): 0036 takes cell_2's limit_layers
    whole, a report reading it holds that back, and the revision is rolled
    back once its tries are spent; the next build, the report ended, runs it."""
    await asyncio.to_thread(
        command.downgrade, migrate.alembic_config(in_cell(cells_dsn, "cell_2")), "0035"
    )
    patience = LockPatience(timeout_ms=300, attempts=1)
    report = await asyncpg.connect(cells_dsn)
    try:
        async with report.transaction():
            await report.fetchval("SELECT count(*) FROM cell_2.limit_layers")
            with pytest.raises(MigrationLocksUnavailable, match="within 300 ms in its one try"):
                await asyncio.to_thread(build_cells, cells_dsn, CELLS, patience)
    finally:
        await report.close()
    at = "SELECT version_num FROM cell_2.alembic_version"
    assert await fetch_value(cells_dsn, at) == "0035"

    cells = await asyncio.to_thread(build_cells, cells_dsn, CELLS, patience)
    assert cells[1].status.startswith("upgraded (revision 0035 to 0036")
    assert await fetch_value(cells_dsn, at) == "0036"


async def test_a_cell_is_upgraded_while_its_service_admits_and_settles_and_no_request_fails(
    cells_dsn: str, settings: Settings
) -> None:
    # Every script applied again in one transaction, with its functions pinned:
    # a call sees the old functions or the new ones, never none.
    await _execute(cells_dsn, "UPDATE cell_2.schema_repeatables SET checksum = repeat('0', 64)")
    cell = in_cell(cells_dsn, "cell_2")
    await _give_room(cell, "acme", 10**9)
    limiter = await Limiter.connect(dsn_as(cell, APP_ROLE), settings)
    settled, failures = 0, []
    warm, upgraded = asyncio.Event(), asyncio.Event()

    async def serve() -> None:
        nonlocal settled
        after = 0
        while after < 20:  # until 20 more settled after the upgrade, each
            try:
                reservation = await limiter.admit(**REQUEST)
                await limiter.settle(reservation.reservation_id, input_tokens=100, output_tokens=50)
            except Exception as exc:  # what failed is the finding
                failures.append(repr(exc))
                warm.set()
                return
            settled += 1
            after += upgraded.is_set()
            if settled >= 20:
                warm.set()

    try:
        clients = [asyncio.create_task(serve()) for _ in range(4)]
        await warm.wait()
        cells = await asyncio.to_thread(build_cells, cells_dsn, CELLS)
        upgraded.set()
        await asyncio.gather(*clients)
    finally:
        await limiter.close()

    assert cells[1].status.startswith("upgraded (scripts admission.sql, ")
    assert failures == []
    assert await _ledger_rows(cell) == settled >= 20 + 4 * 20
    assert await audit_findings(cell) == []


@pytest.mark.parametrize(
    ("revision", "refusal"),
    [
        ("9999", "cell_2 is at revision 9999, which this code does not know"),
        ("0025", "cell_2 is at revision 0025: revisions 0026 name a schema"),
    ],
)
async def test_a_cell_that_cannot_be_upgraded_in_place_is_refused_and_nothing_changes(
    cells_dsn: str, revision: str, refusal: str
) -> None:
    await _execute(
        cells_dsn,
        f"UPDATE cell_2.alembic_version SET version_num = '{revision}';"
        " UPDATE cell_1.schema_repeatables SET checksum = repeat('0', 64)"
        " WHERE name = 'admission.sql'",
    )

    with pytest.raises(CellsError, match=refusal):
        await asyncio.to_thread(build_cells, cells_dsn, CELLS)

    # Refused before any cell was touched: cell 1's scripts were not applied either.
    assert (
        await fetch_value(
            cells_dsn, "SELECT checksum FROM cell_1.schema_repeatables WHERE name = 'admission.sql'"
        )
        == "0" * 64
    )
    assert await _schemas(cells_dsn) == ["cell_1", "cell_1_reporting", "cell_2", "cell_2_reporting"]


async def test_a_cell_makes_its_ledger_partitions_beside_its_ledger(cells_dsn: str) -> None:
    connection = await asyncpg.connect(in_cell(cells_dsn, "cell_1"))
    try:
        # Six months on by the database's clock: the migrations made three.
        month = await connection.fetchval(
            "SELECT 'usage_ledger_' || to_char(date_trunc('month', clock_timestamp()"
            " AT TIME ZONE 'UTC') + interval '6 months', 'YYYY_MM')"
        )
        created = await connection.fetch("SELECT * FROM lq_ensure_ledger_partitions(6)")
        assert (month, "created") in [(r["partition_name"], r["status"]) for r in created]
        places = await connection.fetch(
            "SELECT n.nspname FROM pg_class AS c JOIN pg_namespace AS n ON n.oid = c.relnamespace"
            " WHERE c.relname = $1",
            month,
        )
        assert [p["nspname"] for p in places] == ["cell_1"]
    finally:
        await connection.close()


def test_migrate_cells_from_the_command_line(empty_database_dsn: str) -> None:
    built = run_cli("migrate", "--cells", "2", dsn=empty_database_dsn)
    again = run_cli("migrate", "--cells", "2", dsn=empty_database_dsn)
    refused = run_cli("migrate", "--cells", "3", dsn=empty_database_dsn, check=False)

    assert [line.split(",")[0] for line in built.stdout.splitlines()] == [
        "cell_1: built",
        "cell_2: built",
        "database holds 2 cells at the latest schema",
    ]
    assert [line.split(",")[0] for line in again.stdout.splitlines()][:2] == [
        "cell_1: up to date",
        "cell_2: up to date",
    ]
    assert refused.returncode == 2
    assert "this database has 2 cells (cell_1, cell_2)" in refused.stderr


def test_migrate_cells_from_the_command_line_upgrades_a_cell_behind_it(
    empty_database_dsn: str,
) -> None:
    run_cli("migrate", "--cells", "2", dsn=empty_database_dsn)
    asyncio.run(
        _execute(
            empty_database_dsn,
            "UPDATE cell_1.schema_repeatables SET checksum = repeat('0', 64)"
            " WHERE name = 'ledger.sql'",
        )
    )

    upgraded = run_cli("migrate", "--cells", "2", dsn=empty_database_dsn)

    lines = upgraded.stdout.splitlines()
    assert lines[0].startswith("cell_1: upgraded (scripts ledger.sql, roles.sql)")
    assert lines[1].startswith("cell_2: up to date")
    assert lines[2] == "database holds 2 cells at the latest schema"


TENANTS = [f"tenant-{i:02d}" for i in range(40)]
PER_TENANT = 5  # concurrent requests of each tenant: 200 in all
TENANT_ROOM = 4  # the reservations each tenant's burst holds


async def _demand(cells: CellLimiters) -> dict[str, list[Reservation]]:
    """Every tenant's PER_TENANT requests at once, each to its tenant's cell:
    what each tenant was admitted (a refusal is RateLimited, nothing else)."""

    async def one(tenant: str) -> Reservation | Exception:
        return await attempt(cells.for_tenant(tenant), **{**REQUEST, "tenant": tenant})

    results = await asyncio.gather(*(one(t) for t in TENANTS for _ in range(PER_TENANT)))
    assert all(isinstance(r, Reservation | RateLimited) for r in results), results
    admitted: dict[str, list[Reservation]] = {t: [] for t in TENANTS}
    for result in results:
        if isinstance(result, Reservation):
            admitted[result.tenant].append(result)
    return admitted


async def test_forty_tenants_in_two_cells_admit_exactly_each_tenants_burst_and_the_global_one(
    cells_dsn: str, settings: Settings
) -> None:
    # The library's router (admission/cells.py): a Limiter per cell, each
    # tenant in the cell its name hashes to, the global policy a slice per
    # cell. On CI's Citus leg the two cells are on the two workers.
    placed = Counter(cell_of(t, CELLS) for t in TENANTS)
    assert placed == {1: 20, 2: 20}
    # No rebalancing: each slice alone (tests/integration/test_slice_rebalancing.py
    # moves room between them).
    async with await CellLimiters.connect(
        dsn_as(cells_dsn, APP_ROLE), settings, rebalance_seconds=None
    ) as cells:
        for tenant in TENANTS:
            await cells.for_tenant(tenant).store.put_policy(
                "tenant", tenant, None, Policy(tokens_per_minute=1, token_burst=TENANT_ROOM * COST)
            )
        # A global burst far from the demand: each tenant gets exactly its own.
        await cells.put_global_policy(Policy(tokens_per_minute=CELLS, token_burst=1_000 * COST))
        first = await _demand(cells)
        assert {t: len(r) for t, r in first.items()} == dict.fromkeys(TENANTS, TENANT_ROOM)
        for reservations in first.values():
            for reservation in reservations:
                await reservation.release()

        # A global burst of 100 requests, 50 a cell, below each cell's demand
        # of 80: exactly the global burst, each cell exactly its slice, and
        # still no tenant beyond its own.
        await cells.put_global_policy(Policy(tokens_per_minute=CELLS, token_burst=100 * COST))
        second = await _demand(cells)
        per_cell = Counter(cell_of(t, CELLS) for t, r in second.items() for _ in r)
        assert per_cell == {1: 50, 2: 50}
        assert max(len(r) for r in second.values()) <= TENANT_ROOM
        for reservations in second.values():
            for reservation in reservations:
                await reservation.settle(input_tokens=100, output_tokens=50)
    for number in range(1, CELLS + 1):
        cell = in_cell(cells_dsn, cell_name(number))
        assert await _ledger_rows(cell) == 50
        assert await audit_findings(cell) == []


async def _exported(owner_cell_dsn: str) -> Counter[tuple[object, ...]]:
    """The cell's ledger as `llmquota ledger export` pages it: (reservation, kind, in, out)."""
    connection = await asyncpg.connect(owner_cell_dsn)
    try:
        rows = LedgerStore(connection).export(0, limit=None, page_rows=7, number_limit=7)
        return Counter(
            [(e.reservation_id, e.entry_kind, e.input_tokens, e.output_tokens) async for e in rows]
        )
    finally:
        await connection.close()


async def test_random_admits_settles_releases_and_sweeps_over_cells_leave_exact_books(
    cells_dsn: str, settings: Settings
) -> None:
    # Each request's fate is drawn before it is sent: settled, released, or
    # left to lapse (a 1 s lease), swept, and half of those settled late. The
    # ledger each cell exports is then exactly what was done there, row for
    # row, and each cell's audit is clean.
    rng = random.Random(26)
    tenants = TENANTS[:12]
    expected: Counter[tuple[object, ...]] = Counter()
    lapsing: list[Reservation] = []
    async with await CellLimiters.connect(dsn_as(cells_dsn, APP_ROLE), settings) as cells:
        for tenant in tenants:
            await cells.for_tenant(tenant).store.put_policy(
                "tenant", tenant, None, Policy(tokens_per_minute=1, token_burst=6 * COST)
            )
        await cells.put_global_policy(Policy(tokens_per_minute=CELLS, token_burst=40 * COST))
        for _ in range(6):
            fates = [
                (rng.choice(tenants), rng.choice(["settle", "release", "lapse"])) for _ in range(20)
            ]
            results = await asyncio.gather(
                *(
                    attempt(cells.for_tenant(t), **{**REQUEST, "tenant": t},
                            lease_seconds=1 if fate == "lapse" else 60)
                    for t, fate in fates
                )
            )  # fmt: skip
            finishing = []
            for (_, fate), result in zip(fates, results, strict=True):
                if not isinstance(result, Reservation):
                    assert isinstance(result, RateLimited), result
                elif fate == "settle":
                    used = (rng.randint(1, 100), rng.randint(0, 900))
                    finishing.append(result.settle(input_tokens=used[0], output_tokens=used[1]))
                    expected[(result.reservation_id, "usage", *used)] += 1
                elif fate == "release":
                    finishing.append(result.release())  # nothing used: no ledger row
                else:
                    lapsing.append(result)
                    expected[(result.reservation_id, "usage", 0, 0)] += 1
            await asyncio.gather(*finishing)
        await asyncio.sleep(1.2)
        swept = [await limiter.sweep() for limiter in cells.limiters]
        assert sum(s.expired for s in swept) == len(lapsing) > 0
        for reservation in lapsing[::2]:
            await reservation.settle(input_tokens=10, output_tokens=20)
            expected[(reservation.reservation_id, "late", 10, 20)] += 1

    exported: Counter[tuple[object, ...]] = Counter()
    for number in range(1, CELLS + 1):
        cell = in_cell(cells_dsn, cell_name(number))
        exported += await _exported(cell)
        assert await audit_findings(cell) == []
    assert exported == expected


async def test_a_router_over_a_database_without_cells_is_refused_by_name(
    empty_database_dsn: str, settings: Settings
) -> None:
    with pytest.raises(CellsError, match="no cells: build them with `llmquota migrate --cells K`"):
        await CellLimiters.connect(empty_database_dsn, settings)


async def test_sweep_and_audit_of_a_cells_database_look_after_every_cell(
    cells_dsn: str, settings: Settings
) -> None:
    # `llmquota sweep` and `audit` at the database's public DSN go over
    # every cell (a cron job per cell would be K jobs to keep in step); at a
    # cell's DSN, over that cell alone, as its service sees it.
    async with await CellLimiters.connect(
        dsn_as(cells_dsn, APP_ROLE), settings, rebalance_seconds=None
    ) as cells:
        for tenant in ("tenant-00", "tenant-01", "tenant-04"):
            await cells.for_tenant(tenant).store.put_policy(
                "tenant", tenant, None, Policy(tokens_per_minute=1, token_burst=COST)
            )
            await cells.for_tenant(tenant).admit(**{**REQUEST, "tenant": tenant}, lease_seconds=1)
    lapsed = Counter(cell_of(t, CELLS) for t in ("tenant-00", "tenant-01", "tenant-04"))
    assert set(lapsed) == {1, 2}
    await asyncio.sleep(1.2)

    swept = await asyncio.to_thread(run_cli, "sweep", dsn=cells_dsn)
    lines = swept.stdout.splitlines()
    assert [line.split()[-1] for line in lines] == ["cell=cell_1", "cell=cell_2"]
    assert [line.split()[1] for line in lines] == [
        f"expired={lapsed[1]}",
        f"expired={lapsed[2]}",
    ]
    audited = await asyncio.to_thread(run_cli, "audit", dsn=cells_dsn)
    assert [line.split()[-1] for line in audited.stdout.splitlines()] == [
        "cell=cell_1",
        "cell=cell_2",
        "drift",
    ]
    assert audited.stdout.endswith("no drift\n")
    one = await asyncio.to_thread(run_cli, "audit", dsn=in_cell(cells_dsn, "cell_2"))
    assert one.stdout.splitlines()[0].endswith(f"ledger_rows={lapsed[2]} cell=cell_2")
    assert one.stdout.splitlines()[1:] == ["no drift"]
