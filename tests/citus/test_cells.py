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

from llmquota.store.cells import Cell, build_cells, in_cell
from llmquota.store.listener import ChangeListener
from llmquota.store.sqlfiles import named_queries, queries
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


def _writes(key_id: int, reservation: uuid.UUID) -> list[tuple[str, str, list[Any]]]:
    """The service's other writes (sql/*queries.sql), each with arguments that
    write something, and the function it must reach the worker as."""
    secret = "0123456789abcdef0123456789abcdef"
    moved = uuid.uuid4()
    return [
        ("put_tenant_policy", "lq_put_tenant_policy_if_match",
         ["acme", None, '{"tokens_per_minute": 6000}', None]),
        ("put_policy", "lq_put_policy",
         ["route", "acme", "chat", 6000, 600, 60, 10, None, 30, "closed", [], None, None,
          None, None, None, None]),
        ("put_global_policy", "lq_put_global_if_match",
         [100_000, 100_000, 1_000, 1_000, None, 30, "closed", 2, None]),
        ("put_plan", "lq_put_plan_if_match",
         ["gold", 1, 1000, 1000, 10, 10, None, 30, "closed", [], False, None, None, None,
          None]),
        ("put_ceiling", "lq_put_ceiling_if_match",
         ["c1", ["gpt-*"], 1000, 1000, 10, 10, None, None, None, None, None, None, None,
          None, None, None]),
        ("cool_down_ceilings", "lq_cool_down_ceilings", ["gpt-4o", 5.0, None, False]),
        ("heartbeat", "lq_heartbeat", [reservation, "acme", None, None, True]),
        ("rotate_api_key", "lq_rotate_api_key", [key_id, "acme", False, b"\x02" * 32, "p2", 60]),
        ("put_key_limits", "lq_put_key_limits",
         [key_id, "acme", 100, 100, 10, 10, 2, [], []]),
        ("note_key_use", "lq_note_key_use", [key_id]),
        ("suspend_tenant", "lq_suspend_tenant", ["acme", True]),
        ("suspend_tenant", "lq_suspend_tenant", ["acme", False]),
        ("put_quota", "lq_put_quota",
         ["acme", None, "monthly", "month", "UTC", 1000, None, [], [], [], "block", None]),
        ("put_webhook", "lq_put_webhook", ["hook", "http://127.0.0.1:9/", secret, None]),
        ("claim_deliveries", "lq_claim_deliveries", [10, 30.0, 5, [], []]),
        ("record_delivery", "lq_record_delivery",
         [uuid.uuid4(), "hook", 1, 200, None, True, None, 5]),
        ("purge_finished", "lq_purge_finished", [60, 100]),
        ("ensure_tenant", "lq_ensure_tenant", ["globex"]),
        ("insert_first_admin_key", "lq_insert_first_admin_key", [b"\x03" * 32, "adm"]),
        # the rebalancer's (sql/global_layer.sql): a move out, its confirmation, one in
        ("shared_rooms", "lq_shared_rooms", []),
        ("send_budget", "lq_send_budget", [moved, None, "cell_1", 1000.0, 10.0, 0.0, 0.0]),
        ("undelivered_budget", "lq_undelivered_budget", [10]),
        ("confirm_budget", "lq_confirm_budget", [moved]),
        ("receive_budget", "lq_receive_budget", [uuid.uuid4(), "c1", "cell_1", 500.0, 5.0]),
        ("prune_budget_transfers", "lq_prune_budget_transfers", [86_400]),
        # and its moves of permits in flight
        ("shared_permits", "lq_shared_permits", []),
        ("send_permits", "lq_send_permits", [uuid.uuid4(), "c1", "cell_1", 1, 0]),
        ("undelivered_permits", "lq_undelivered_permits", [10]),
        ("receive_permits", "lq_receive_permits", [uuid.uuid4(), "c1", "cell_1", 1]),
    ]  # fmt: skip


async def test_the_services_writes_are_each_one_statement_on_the_cells_worker(
    empty_database_dsn: str, cells: list[Cell]
) -> None:
    # The writes that stamp rows with the clock or a policy version, or
    # announce a change, would be refused by Citus as statements (a volatile
    # function in an UPDATE; a NOTIFY in a two-phase commit): each is a
    # function of the cell, delegated like admit.
    sql = queries() | named_queries("alerts_queries.sql")
    cell = cells[-1]
    connection = await asyncpg.connect(
        empty_database_dsn, server_settings={"search_path": cell.name}
    )
    remote = RemoteCommands()
    try:
        key = await connection.fetchrow(
            sql["insert_api_key"], b"\x01" * 32, "acme", "pfx", "label", ["admit"], None,
            None, None, None, None, None, [], [], False,
        )  # fmt: skip
        admitted = await connection.fetch(sql["admit"], *_admit_arguments(1))
        connection.add_log_listener(remote.listen)
        await connection.execute(
            "SET citus.log_remote_commands = on; SET client_min_messages = log"
        )
        for name, function, arguments in _writes(key["key_id"], admitted[0]["reservation_id"]):
            await connection.fetch(sql[name], *arguments)
            sent = remote.take()
            assert [(f"{cell.name}.{function}(" in c, node) for c, node in sent] == [
                (True, cell.node)
            ], (name, sent)
        await connection.execute("RESET citus.log_remote_commands")
        layers = await connection.fetchval(
            "SELECT count(*) FROM limit_layers WHERE scope IN ('route', 'global', 'ceiling', 'key')"
        )
        assert layers == 5  # a route, two global shards, a ceiling, a key's own
        written = await connection.fetchrow(
            "SELECT (SELECT count(*) FROM quotas) AS quotas, (SELECT count(*) FROM webhooks)"
            " AS webhooks, (SELECT count(*) FROM tenants) AS tenants,"
            " (SELECT count(*) FROM api_key_uses) AS uses"
        )
        assert dict(written) == {"quotas": 1, "webhooks": 1, "tenants": 2, "uses": 1}
        moves = await connection.fetch(
            "SELECT direction, ceiling, tokens, permits, delivered_at IS NOT NULL AS delivered"
            " FROM budget_transfers ORDER BY direction DESC, tokens DESC"
        )
        # (the ceiling caps no permits: nothing to lend, and the permit
        # received is kept for when it has a cap)
        assert [tuple(m) for m in moves] == [
            ("out", None, 1000.0, 0, True),
            ("in", "c1", 500.0, 0, False),
            ("in", "c1", 0.0, 1, False),
        ]
    finally:
        await connection.close()


async def test_a_change_in_a_cell_reaches_a_listener_on_the_cells_dsn(
    empty_database_dsn: str, cells: list[Cell]
) -> None:
    # The cell's triggers fire on its worker, where the coordinator's sessions
    # never hear a NOTIFY: the listener finds the worker and listens there.
    cell = cells[0]
    heard: asyncio.Queue[str | None] = asyncio.Queue()
    listener = ChangeListener(in_cell(empty_database_dsn, cell.name), heard.put_nowait)
    listener.start()
    connection = await asyncpg.connect(
        empty_database_dsn, server_settings={"search_path": cell.name}
    )
    try:
        assert await asyncio.wait_for(heard.get(), 10) is None  # listening: resync first
        await connection.fetch(queries()["ensure_tenant"], "acme")
        await connection.fetch(queries()["suspend_tenant"], "acme", True)
        layers, tenant = [await asyncio.wait_for(heard.get(), 5) for _ in range(2)]
        # The statement trigger names the shard it fired on (ChangeFeed reads
        # it as its table); the suspension names the tenant.
        assert re.fullmatch(r"limit_layers_\d+", layers or ""), layers
        assert tenant == "tenants:acme"
    finally:
        await connection.close()
        await listener.close()
