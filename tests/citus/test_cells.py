"""Cells on Citus: each cell a distributed schema on a worker, each hot call one statement there.

`llmquota migrate --cells 2` on a coordinator with two workers puts each cell
on a worker of its own and delegates its functions (store/cells.py). The
service's own statements (sql/queries.sql: admit, finish, sweep) sent to the
coordinator in a cell must then reach the cell's worker as exactly one
statement each: the call itself, run there whole with its locks, refill and
clock. `citus.log_remote_commands` makes the coordinator say every command it
sends to a worker, and to which: a hot statement that became several (a
function no longer delegated, a statement split into a plan across nodes)
fails these tests.
"""

from __future__ import annotations

import asyncio
import re
import uuid
from typing import Any

import asyncpg
import pytest

from llmquota.store.cells import Cell, build_cells
from llmquota.store.sqlfiles import queries
from tests.citus.nodes import CitusNodes

pytestmark = pytest.mark.citus_only

COST = 1_000  # input 100 + max_tokens 900
_SERVER = re.compile(r"on server \S+@(\S+:\d+)")


@pytest.fixture
async def cells(empty_database_dsn: str, cluster: CitusNodes) -> list[Cell]:
    return await asyncio.to_thread(build_cells, empty_database_dsn, 2)


class RemoteCommands:
    """What the coordinator sends to the workers from one connection: (command, node)."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, str]] = []

    def listen(self, _connection: Any, message: Any) -> None:
        if message.message.startswith("issuing "):
            found = _SERVER.search(message.detail or "")
            self.sent.append((message.message, found.group(1) if found else "?"))

    def take(self) -> list[tuple[str, str]]:
        sent, self.sent = self.sent, []
        return sent


def _admit_arguments(n: int) -> list[Any]:
    """The admit statement's 26 arguments for n requests of tenant acme (admit_statement.py)."""
    return [
        ["acme"] * n, None, ["gpt-4o"] * n, [100] * n, [900] * n, [False] * n,
        None, None, None, 1000, None, None, None, [], [], [], None, None,
        [uuid.uuid4() for _ in range(n)], None, None, None, None, None, None, None,
    ]  # fmt: skip


def _finish_arguments(reservation: uuid.UUID, action: str) -> list[Any]:
    return [[reservation], [action], [None], [100], [50], ["ok"], None, None, None, None]


async def test_each_cell_lives_on_a_worker_of_its_own(
    cells: list[Cell], cluster: CitusNodes
) -> None:
    workers = sorted(f"{host}:{port}" for host, port in cluster.workers)
    assert sorted(c.node or "" for c in cells) == workers


async def test_admit_settle_release_and_sweep_are_each_one_statement_on_the_cells_worker(
    empty_database_dsn: str, cells: list[Cell]
) -> None:
    sql = queries()
    for cell in cells:
        connection = await asyncpg.connect(
            empty_database_dsn, server_settings={"search_path": cell.name}
        )
        remote = RemoteCommands()
        try:
            await connection.execute("INSERT INTO tenants (tenant) VALUES ('acme')")
            await connection.execute(
                "INSERT INTO limit_layers (scope, tenant, tokens_per_minute, token_burst, tokens)"
                f" VALUES ('tenant', 'acme', 1, {3 * COST}, {3 * COST})"
            )
            connection.add_log_listener(remote.listen)
            await connection.execute(
                "SET citus.log_remote_commands = on; SET client_min_messages = log"
            )

            # One request that fits: the fast path.
            first = await connection.fetch(sql["admit"], *_admit_arguments(1))
            admit_sent = remote.take()
            # Three that do not all fit: the exact loop, two admitted, one refused.
            batch = await connection.fetch(sql["admit"], *_admit_arguments(3))
            batch_sent = remote.take()
            settled = await connection.fetchrow(
                sql["finish"], *_finish_arguments(first[0]["reservation_id"], "settle")
            )
            settle_sent = remote.take()
            released = await connection.fetchrow(
                sql["finish"], *_finish_arguments(batch[0]["reservation_id"], "release")
            )
            release_sent = remote.take()
            swept = await connection.fetchrow(sql["sweep"], 100)
            sweep_sent = remote.take()

            assert [r["status"] for r in first] == ["admitted"]
            assert [r["status"] for r in batch] == ["admitted", "admitted", "rate_limited"]
            assert (settled["status"], released["status"]) == ("settled", "released")
            assert swept["expired"] == 0
            for sent, function in (
                (admit_sent, "lq_admit"),
                (batch_sent, "lq_admit"),
                (settle_sent, "lq_finish"),
                (release_sent, "lq_finish"),
                (sweep_sent, "lq_sweep"),
            ):
                assert [(f"{cell.name}.{function}(" in c, node) for c, node in sent] == [
                    (True, cell.node)
                ], (function, sent)
            await connection.execute("RESET citus.log_remote_commands")
            assert await connection.fetchval("SELECT count(*) FROM usage_ledger") == 1
        finally:
            await connection.close()
