"""The nodes of a Citus cluster, as the test fixtures see it through its coordinator.

A Citus coordinator's metadata (`pg_dist_node`) lives in each database, so a
database the fixtures make is a cluster only once the workers are added to it
too. The cluster starter (tests/citus/cluster.py) adds them to the
coordinator's `postgres` database; the fixtures read them from there.
"""

from __future__ import annotations

from dataclasses import dataclass

import asyncpg

COORDINATOR_GROUP = 0


@dataclass(frozen=True)
class CitusNodes:
    """Where the coordinator and its workers listen, as the coordinator names them."""

    coordinator: tuple[str, int]
    workers: tuple[tuple[str, int], ...]
    user: str

    @property
    def worker_dsns(self) -> list[str]:
        """Each worker's maintenance database (CREATE and DROP DATABASE go there)."""
        return [f"postgresql://{self.user}@{host}:{port}/postgres" for host, port in self.workers]

    async def join(self, dsn: str) -> None:
        """Make the database at `dsn` (on the coordinator, with the extension) a cluster.

        The same database must exist on every worker first: Citus reaches a
        worker's database of the coordinator's database's name.
        """
        connection = await asyncpg.connect(dsn)
        try:
            host, port = self.coordinator
            await connection.execute("SELECT citus_set_coordinator_host($1, $2)", host, port)
            for host, port in self.workers:
                await connection.execute("SELECT citus_add_node($1, $2)", host, port)
        finally:
            await connection.close()

    async def freeze(self, database: str, coordinator_dsn: str) -> None:
        """Close `database` on every node, so that it can serve as a template.

        Citus keeps sessions in each database it runs in (its maintenance
        daemon on every node, the coordinator's cached connections to the
        workers), and CREATE DATABASE ... TEMPLATE refuses a source anyone is
        connected to. A database that allows no connections keeps them out for
        good, as template0 does; the copies allow them again.
        """
        for dsn in (coordinator_dsn, *self.worker_dsns):
            connection = await asyncpg.connect(dsn)
            try:
                await connection.execute(
                    f'ALTER DATABASE "{database}" WITH ALLOW_CONNECTIONS false'
                )
                await connection.execute(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                    " WHERE datname = $1 AND pid <> pg_backend_pid()",
                    database,
                )
            finally:
                await connection.close()


async def citus_nodes_of(server_dsn: str) -> CitusNodes | None:
    """The cluster whose coordinator `server_dsn` is, or None for a plain PostgreSQL."""
    connection = await asyncpg.connect(server_dsn)
    try:
        if not await connection.fetchval(
            "SELECT EXISTS (SELECT FROM pg_extension WHERE extname = 'citus')"
        ):
            return None
        rows = await connection.fetch(
            "SELECT nodename, nodeport, groupid FROM pg_dist_node ORDER BY nodeid"
        )
        user = await connection.fetchval("SELECT current_user")
    finally:
        await connection.close()
    coordinator = [
        (r["nodename"], r["nodeport"]) for r in rows if r["groupid"] == COORDINATOR_GROUP
    ]
    workers = tuple(
        (r["nodename"], r["nodeport"]) for r in rows if r["groupid"] != COORDINATOR_GROUP
    )
    if len(coordinator) != 1 or not workers:
        raise RuntimeError(f"{server_dsn} has the citus extension but no coordinator and workers")
    return CitusNodes(coordinator=coordinator[0], workers=workers, user=user)
