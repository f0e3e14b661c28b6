"""Test fixtures: a real PostgreSQL, one migrated template, a fresh database per test.

The server is LLMQUOTA_DATABASE_URL when set (CI's PostgreSQL 15 matrix),
otherwise an embedded PostgreSQL in a temporary directory. The migrations run
once into a template database; each test gets `CREATE DATABASE ... TEMPLATE`
of it, which is fast, isolated and real.

With LLMQUOTA_TEST_CELLS=K the template holds K cells instead (store/cells.py,
`llmquota migrate --cells K`) and each test's database is its last cell
(`search_path=cell_K` in the DSN): on CI's Citus leg, a distributed schema on
a worker, so the contract tests run where a cells deployment runs them.

The service runs as the roles docs/operations.md documents: `limiter` and
the API's `client` connect as llmquota_app, report tests as
llmquota_reporting; the owner (`db`, `owner_dsn`) only migrates and sets up.

Every test of tests/api, tests/integration and tests/faults ends with the
audit (`audited`, autouse): `lq_audit()` on each database the test used must
find no drift, whatever the test did. A test that constructs drift on
purpose says so with `@pytest.mark.constructs_drift` and is not audited.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import shutil
import signal
import tempfile
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import asyncpg
import pytest

from llmquota.admission import allotments
from llmquota.admission.limiter import Limiter
from llmquota.config import Settings
from llmquota.store import migrate
from llmquota.store.cells import build_cells, cell_name, in_cell
from llmquota.store.database import open_database
from llmquota.store.store import Store
from tests.citus.nodes import CitusNodes, citus_nodes_of
from tests.support import APP_ROLE, REPORTING_ROLE, dsn_as

_counter = itertools.count()

# `serve` sweeps in the background by default (its maintenance leader). The
# tests of other behaviour must not have their lapsed reservations expired
# under them by an app they started, so the suite runs with it off; the
# tests of the leader (tests/faults/test_maintenance_leader.py) turn it on.
os.environ.setdefault("LLMQUOTA_SERVE_SWEEPER", "false")

# Some tests stop a child (the sweeper's loop, an embedded server's owner) with
# Ctrl-C, SIGINT. A shell that starts a job in the background without job
# control (`cmd &` in a script) starts it with SIGINT ignored, and an ignored
# signal stays ignored through every exec: each child would then ignore it too
# and the test wait for ever (a CI run started that way hung in
# test_crashes.py). A handler of our own is reset to the default in a child.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

# The suites whose every test ends with the audit (RELIABILITY.md), and the
# fixtures that give a test a database of its own.
AUDITED_SUITES = frozenset({"api", "integration", "faults", "console", "citus"})
AUDITED_DATABASES = ("database_dsn", "twin_dsn")
# A Citus node's own sessions can race a DROP DATABASE: tries, and the pause between them.
CITUS_DROP_ATTEMPTS = 5
CITUS_DROP_RETRY_SECONDS = 0.5
# The number of cells the template holds; 0: none, the schema is `public`.
TEST_CELLS = int(os.environ.get("LLMQUOTA_TEST_CELLS", "0"))


def dsn_with_database(dsn: str, database: str) -> str:
    """The same server, another database."""
    parts = urlsplit(dsn)
    return urlunsplit(parts._replace(path="/" + database))


async def _admin(dsn: str, *statements: str) -> None:
    connection = await asyncpg.connect(dsn)
    try:
        for statement in statements:
            await connection.execute(statement)
    finally:
        await connection.close()


@pytest.fixture(scope="session")
def server_dsn() -> Iterator[str]:
    """A DSN to the test server's maintenance database.

    The embedded server's directory is our own, not pytest's tmp_path: pytest
    prunes old basetemp directories, including those of a concurrent session.
    """
    url = os.environ.get("LLMQUOTA_DATABASE_URL")
    if url:
        with open_database(database_url=url) as handle:
            yield handle.dsn
        return
    root = Path(tempfile.mkdtemp(prefix="llmquota-test-pg-"))
    try:
        with open_database(data_dir=root / "data") as handle:
            yield handle.dsn
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="session")
def citus_nodes(server_dsn: str) -> CitusNodes | None:
    """The Citus cluster the server coordinates (CI's Citus leg), or None."""
    return asyncio.run(citus_nodes_of(server_dsn))


async def _create_database(
    server_dsn: str, nodes: CitusNodes | None, name: str, template: str | None = None
) -> None:
    """CREATE DATABASE on the server, and on a Citus coordinator's workers too.

    Citus propagates CREATE DATABASE only from template1: each node makes its
    own copy of the template, and the copies agree (metadata and all).
    """
    create = f'CREATE DATABASE "{name}"' + (f' TEMPLATE "{template}"' if template else "")
    for worker in nodes.worker_dsns if nodes else ():
        await _admin(worker, create)
    await _admin(server_dsn, create)


async def _drop_database(server_dsn: str, nodes: CitusNodes | None, name: str) -> None:
    drop = f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'
    if nodes is None:
        await _admin(server_dsn, drop)
        return
    # The coordinator first: dropping stops its maintenance daemon, whose
    # connections to the workers' copy would otherwise come back.
    for dsn in (server_dsn, *nodes.worker_dsns):
        await _drop_on_a_citus_node(dsn, drop)


async def _drop_on_a_citus_node(dsn: str, drop: str) -> None:
    """DROP DATABASE ... WITH (FORCE), again while Citus's sessions come and go.

    FORCE terminates the database's sessions, but a Citus node has sessions
    of its own that reconnect on their schedule (a worker's maintenance
    daemon, a coordinator's connection for recovery or deadlock detection):
    one that arrives between the termination and the drop fails it with
    "being accessed by other users" (1 drop in some 250 here).
    """
    for attempt in range(CITUS_DROP_ATTEMPTS):
        try:
            await _admin(dsn, drop)
            return
        except asyncpg.exceptions.ObjectInUseError:
            if attempt == CITUS_DROP_ATTEMPTS - 1:
                raise
            await asyncio.sleep(CITUS_DROP_RETRY_SECONDS)


@pytest.fixture(scope="session")
def template_database(server_dsn: str, citus_nodes: CitusNodes | None) -> Iterator[str]:
    """Name of a database migrated to head, used as the template for each test."""
    name = f"llmquota_template_{os.getpid()}"
    asyncio.run(_drop_database(server_dsn, citus_nodes, name))
    asyncio.run(_create_database(server_dsn, citus_nodes, name))
    if citus_nodes:
        asyncio.run(citus_nodes.join(dsn_with_database(server_dsn, name)))
    if TEST_CELLS:
        build_cells(dsn_with_database(server_dsn, name), TEST_CELLS)
    else:
        migrate.upgrade(dsn_with_database(server_dsn, name))
    if citus_nodes:
        asyncio.run(citus_nodes.freeze(name, server_dsn))
    yield name
    asyncio.run(_drop_database(server_dsn, citus_nodes, name))


@pytest.fixture
async def database_dsn(
    server_dsn: str, template_database: str, citus_nodes: CitusNodes | None
) -> AsyncIterator[str]:
    """A fresh, migrated database for one test."""
    name = f"llmquota_test_{os.getpid()}_{next(_counter)}_{uuid.uuid4().hex[:6]}"
    await _create_database(server_dsn, citus_nodes, name, template_database)
    yield in_test_cell(dsn_with_database(server_dsn, name))
    await _drop_database(server_dsn, citus_nodes, name)


def in_test_cell(dsn: str) -> str:
    """`dsn` in the test cell (LLMQUOTA_TEST_CELLS), or as it is without cells."""
    return in_cell(dsn, cell_name(TEST_CELLS)) if TEST_CELLS else dsn


@pytest.fixture
async def empty_database_dsn(server_dsn: str, citus_nodes: CitusNodes | None) -> AsyncIterator[str]:
    """A database with nothing in it (on Citus, joined to the cluster): tests of migrating."""
    name = f"llmquota_empty_{os.getpid()}_{next(_counter)}_{uuid.uuid4().hex[:6]}"
    await _create_database(server_dsn, citus_nodes, name)
    dsn = dsn_with_database(server_dsn, name)
    if citus_nodes:
        await citus_nodes.join(dsn)
    yield dsn
    await _drop_database(server_dsn, citus_nodes, name)


@pytest.fixture
def owner_dsn(database_dsn: str) -> str:
    """The test database as its owner (the role that ran the migrations): for
    tests that construct a state the service could not (rows with their own
    times, a shifted clock) and for inspecting it. Only set-up uses it."""
    return database_dsn


@pytest.fixture
def app_dsn(database_dsn: str) -> str:
    """The test database as the service's least-privilege role, llmquota_app,
    as docs/operations.md runs it: a grant roles.sql lacks fails the test."""
    return dsn_as(database_dsn, APP_ROLE)


@pytest.fixture
def reporting_dsn(database_dsn: str) -> str:
    """The test database as the read-only finance role, llmquota_reporting."""
    return dsn_as(database_dsn, REPORTING_ROLE)


@pytest.fixture
async def twin_dsn(
    server_dsn: str, template_database: str, citus_nodes: CitusNodes | None
) -> AsyncIterator[str]:
    """A second fresh database from the same template (batched vs one-by-one tests)."""
    name = f"llmquota_twin_{uuid.uuid4().hex[:12]}"
    await _create_database(server_dsn, citus_nodes, name, template_database)
    yield in_test_cell(dsn_with_database(server_dsn, name))
    await _drop_database(server_dsn, citus_nodes, name)


@pytest.fixture
def settings() -> Settings:
    """Settings for tests: a pool wide enough for the concurrency tests.

    The decision deadline is out of the way: these tests fire dozens of
    admissions at one row on a shared 2-core machine, where queueing for a
    connection can pass 250 ms, and they are about what PostgreSQL decides.
    The deadline and the failure modes are proven in tests/faults.
    """
    return Settings(  # type: ignore[call-arg]
        pool_min_size=1, pool_max_size=20, decision_deadline_ms=60_000, _env_file=None
    )


@pytest.fixture
def slices_off_the_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    """A key warms to a slice after WARM_REQUESTS requests, and keeps it while
    idle, however slow the machine is.

    Tests that count the admissions taken from slices mean the count, not the
    warm-up window: on a loaded 2-core machine WARM_REQUESTS exact decisions
    over HTTP once took longer than WARM_SECONDS, the count started over, and
    fewer requests came from slices (CI: "16 of 28"). The windows themselves
    are tested in tests/unit/test_allotment_windows.py.
    """
    monkeypatch.setattr(allotments, "WARM_SECONDS", 3_600.0)
    monkeypatch.setattr(allotments, "IDLE_SECONDS", 3_600.0)


@pytest.fixture
async def limiter(app_dsn: str, settings: Settings) -> AsyncIterator[Limiter]:
    """A Limiter on a fresh database, connected as the service's role."""
    lim = await Limiter.connect(app_dsn, settings)
    yield lim
    await lim.close()


@pytest.fixture
async def db(owner_dsn: str) -> AsyncIterator[asyncpg.Connection]:
    """A plain connection to the test database as its owner, for inspecting
    and shifting state (never the service's own path: see `limiter`)."""
    connection = await asyncpg.connect(owner_dsn)
    yield connection
    await connection.close()


async def audit_findings(dsn: str) -> list[str]:
    """lq_audit() on a database, as readable lines (empty: no drift)."""
    store = await Store.connect(dsn, min_size=1, max_size=1)
    try:
        return [
            f"{f.check_name} {f.subject}: expected {f.expected}, found {f.actual}"
            for f in await store.audit()
        ]
    finally:
        await store.close()


@pytest.fixture(autouse=True)
def audited(request: pytest.FixtureRequest) -> Iterator[None]:
    """After a test of an audited suite: no drift on any database it used.

    Autouse, so it is set up before the test's other fixtures and torn down
    after them: the audit reads the books once every limiter, client and
    server of the test has closed. A synchronous fixture, so that it can ask
    for the (async) database fixtures the test uses, and only those: a test
    without a database costs nothing.
    """
    suite = request.path.relative_to(Path(__file__).parent).parts[0]
    if suite not in AUDITED_SUITES or request.node.get_closest_marker("constructs_drift"):
        yield
        return
    used = [name for name in AUDITED_DATABASES if name in request.fixturenames]
    dsns = [request.getfixturevalue(name) for name in used]
    yield
    for dsn in dsns:
        findings = asyncio.run(audit_findings(dsn))
        assert findings == [], f"the audit found drift after the test: {findings}"
