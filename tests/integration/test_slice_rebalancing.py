"""Moving unused room between cells' global slices (admission/rebalancer.py).

The global policy of a database of cells is a slice per cell; the
rebalancer moves room from slices that have it to those that need it, in
two transactions on two nodes (debit, then credit). Here: a busy cell gets
an idle cell's room and the cells never admit more than the global burst;
a move stopped between its debit and its credit strands the room until the
next round delivers it, once; and with admissions and fast rounds running
side by side, the journal balances and the burst holds. On CI's Citus leg
the two cells are on the two workers.
"""

from __future__ import annotations

import asyncio
import uuid
from datetime import UTC, datetime, timedelta

import asyncpg
import pytest

from llmquota.admission.cells import CellLimiters
from llmquota.admission.limiter import Reservation
from llmquota.config import Settings
from llmquota.domain.cells import cell_of
from llmquota.domain.errors import RateLimited
from llmquota.domain.plans import Ceiling
from llmquota.domain.policy import Policy
from llmquota.store.cells import build_cells, cell_name, in_cell
from tests.conftest import audit_findings
from tests.support import APP_ROLE, dsn_as, run_cli

from .support import attempt

pytestmark = pytest.mark.citus

CELLS = 2
COST = 1_000  # tokens each request reserves
GLOBAL = 100  # requests the global burst holds, 50 a cell
REQUEST = {"model": "gpt-4o", "input_tokens": 100, "max_tokens": 900}
TENANTS = [f"tenant-{i:02d}" for i in range(40)]
IN_CELL_1 = [t for t in TENANTS if cell_of(t, CELLS) == 1][:10]
IN_CELL_2 = [t for t in TENANTS if cell_of(t, CELLS) == 2][:10]


@pytest.fixture
async def cells(empty_database_dsn: str, settings: Settings) -> CellLimiters:
    """Two cells, roomy tenants, a global burst of GLOBAL requests; no
    rebalancing but the rounds a test runs."""
    await asyncio.to_thread(build_cells, empty_database_dsn, CELLS)
    router = await CellLimiters.connect(
        dsn_as(empty_database_dsn, APP_ROLE), settings, rebalance_seconds=None
    )
    for tenant in IN_CELL_1 + IN_CELL_2:
        await router.for_tenant(tenant).store.put_policy(
            "tenant", tenant, None, Policy(tokens_per_minute=1, token_burst=1_000 * COST)
        )
    # a refill of 2 tokens a minute: nothing a test's seconds can add up to a request
    await router.put_global_policy(Policy(tokens_per_minute=CELLS, token_burst=GLOBAL * COST))
    return router


async def _admit(cells: CellLimiters, tenants: list[str], count: int) -> list[Reservation]:
    results = await asyncio.gather(
        *(attempt(cells.for_tenant(t), **REQUEST, tenant=t) for t in (tenants * count)[:count])
    )
    assert all(isinstance(r, Reservation | RateLimited) for r in results), results
    return [r for r in results if isinstance(r, Reservation)]


async def _rooms(cells: CellLimiters, ceiling: str | None = None) -> list[float]:
    """Each cell's tokens of room in the shared layer (a ceiling, None: global)."""
    rooms = [await limiter.store.budget_moves.rooms() for limiter in cells.limiters]
    return [room[ceiling].tokens or 0.0 for room in rooms]


async def test_a_busy_cell_gets_the_idle_cells_room_and_never_more_than_the_global_burst(
    cells: CellLimiters,
) -> None:
    async with cells:
        admitted = len(await _admit(cells, IN_CELL_1, 80))
        assert admitted == GLOBAL // CELLS  # its own slice, and no more without a round
        rounds = []
        for _ in range(5):
            rounds.append(await cells.rebalancer.run_round())
            admitted += len(await _admit(cells, IN_CELL_1, 80))
        # The first round knows nothing of demand (half of what is left
        # moves); later ones follow it: cell 1 has taken all but what the idle
        # cell keeps as its reserve, which shrinks each round.
        assert rounds[0].moves == 1 and rounds[0].tokens == pytest.approx(25 * COST, abs=10)
        false_refusals = GLOBAL - admitted
        assert 0 <= false_refusals <= 2, (admitted, rounds)
        # What is left is cell 2's reserve: its own tenants still get it.
        left = len(await _admit(cells, IN_CELL_2, 10))
        assert admitted + left <= GLOBAL
        assert sum(await _rooms(cells)) < COST * (GLOBAL - admitted - left + 1)


async def test_a_move_stopped_between_debit_and_credit_is_stranded_then_delivered_once(
    cells: CellLimiters, empty_database_dsn: str
) -> None:
    async with cells:
        await _admit(cells, IN_CELL_2, 20)  # cell 2 down to 30 requests' room
        giver, taker = (limiter.store.budget_moves for limiter in cells.limiters)
        transfer = uuid.uuid4()
        # The debit commits; the rebalancer "dies" before the credit.
        sent = await giver.send(
            transfer, None, "cell_2", 10 * COST, 0.0, keep_tokens=0.0, keep_requests=0.0
        )
        assert sent == (10 * COST, 0.0)
        # A retried send of the same move debits nothing more.
        assert (
            await giver.send(
                transfer, None, "cell_2", 10 * COST, 0.0, keep_tokens=0.0, keep_requests=0.0
            )
            == sent
        )
        rooms = await _rooms(cells)
        assert rooms == [pytest.approx(40 * COST, abs=10), pytest.approx(30 * COST, abs=10)]
        # Stranded: 10 requests' room is in neither cell, so nothing can spend it.
        assert [u.transfer_id for u in await giver.undelivered()] == [transfer]

        report = await cells.rebalancer.run_round()
        assert report.redelivered == 1
        assert await giver.undelivered() == []
        rooms = await _rooms(cells)
        assert sum(rooms) == pytest.approx(80 * COST, abs=10)
        # Delivered again by a second rebalancer: credited once.
        assert await taker.receive(transfer, None, "cell_1", 10 * COST, 0.0) is False
        assert sum(await _rooms(cells)) == pytest.approx(80 * COST, abs=10)
    for number in (1, 2):
        assert await audit_findings(in_cell(empty_database_dsn, cell_name(number))) == []


async def _journal(dsn: str, number: int) -> dict[tuple[uuid.UUID, str], tuple[float, float, bool]]:
    connection = await asyncpg.connect(in_cell(dsn, cell_name(number)))
    try:
        rows = await connection.fetch(
            "SELECT transfer_id, direction, tokens, requests, delivered_at IS NOT NULL AS done"
            " FROM budget_transfers"
        )
    finally:
        await connection.close()
    return {
        (r["transfer_id"], r["direction"]): (r["tokens"], r["requests"], r["done"]) for r in rows
    }


async def test_rounds_beside_admissions_in_both_cells_keep_the_burst_and_balance_the_journal(
    cells: CellLimiters, empty_database_dsn: str
) -> None:
    async with cells:
        held: list[Reservation] = []
        # Demand that shifts between the cells, while rounds run as fast as they can.
        stop = asyncio.Event()

        async def rounds() -> int:
            moves = 0
            while not stop.is_set():
                moves += (await cells.rebalancer.run_round()).moves
            return moves

        mover = asyncio.create_task(rounds())
        for tenants in (IN_CELL_1, IN_CELL_2, IN_CELL_1, IN_CELL_2 + IN_CELL_1, IN_CELL_2):
            held += await _admit(cells, tenants, 15)
            # give some back: a release is a credit to the slice that admitted it
            for reservation in held[::5]:
                await reservation.release()
            held = [r for i, r in enumerate(held) if i % 5]
            await asyncio.sleep(0.05)
        stop.set()
        moves = await mover
        await cells.rebalancer.run_round()
        # Never more admitted and held than the global burst (the refill adds
        # a few tokens a minute, far from a request).
        assert len(held) * COST + sum(await _rooms(cells)) <= GLOBAL * COST + 10
        assert moves > 0
    one = await _journal(empty_database_dsn, 1)
    two = await _journal(empty_database_dsn, 2)
    sent = {tid: v for (tid, d), v in {**one, **two}.items() if d == "out"}
    received = {tid: v for (tid, d), v in {**one, **two}.items() if d == "in"}
    assert sent.keys() == received.keys()
    assert all(v[2] for v in sent.values())  # every move delivered and confirmed
    assert all(sent[t][:2] == received[t][:2] for t in sent)
    for number in (1, 2):
        assert await audit_findings(in_cell(empty_database_dsn, cell_name(number))) == []


async def test_the_rebalance_command_runs_a_round_over_the_cells(
    cells: CellLimiters, empty_database_dsn: str
) -> None:
    # A deployment of services (one per cell) runs `llmquota rebalance`
    # beside them, as it runs `sweep`: the same round, from the command line.
    async with cells:
        assert len(await _admit(cells, IN_CELL_1, 60)) == GLOBAL // CELLS
        done = await asyncio.to_thread(run_cli, "rebalance", dsn=empty_database_dsn)
        assert done.stdout.startswith("rebalanced: redelivered=0 moves=1 tokens=25000 ")
        assert await _rooms(cells) == [
            pytest.approx(25 * COST, abs=10),
            pytest.approx(25 * COST, abs=10),
        ]
        again = await asyncio.to_thread(run_cli, "rebalance", dsn=empty_database_dsn)
        assert again.stdout.startswith("rebalanced: redelivered=0 moves=0 tokens=0 ")


def test_the_rebalance_command_refuses_a_database_without_cells(empty_database_dsn: str) -> None:
    refused = run_cli("rebalance", dsn=empty_database_dsn, check=False)
    assert refused.returncode == 2
    assert refused.stderr == "llmquota rebalance: this database holds no cells\n"


async def test_a_provider_ceiling_is_split_over_the_cells_and_its_room_moves_too(
    cells: CellLimiters, empty_database_dsn: str
) -> None:
    # A provider's account limit spans every tenant, so in cells it is a
    # slice per cell like the global layer, and rebalanced the same way.
    async with cells:
        await cells.put_global_policy(Policy(tokens_per_minute=CELLS, token_burst=10**6 * COST))
        versions = await cells.put_ceiling(
            "openai", Ceiling(models=["gpt-4o"], tokens_per_minute=CELLS, token_burst=41 * COST)
        )
        assert len(versions) == CELLS
        # 41 requests' room split 21 / 20 (lq_shard_share's rule)
        assert await _rooms(cells, "openai") == [
            pytest.approx(20_500, abs=10),
            pytest.approx(20_500, abs=10),
        ]
        admitted = len(await _admit(cells, IN_CELL_1, 40))
        assert admitted == 20  # its slice of 20,500 tokens, no more
        report = await cells.rebalancer.run_round()
        assert report.moves == 1  # the ceiling's; the global layer is far from short
        admitted += len(await _admit(cells, IN_CELL_1, 40))
        assert admitted == 30
        await cells.rebalancer.run_round()
        admitted += len(await _admit(cells, IN_CELL_1, 40))
        assert 37 <= admitted <= 41
        assert admitted * COST + sum(await _rooms(cells, "openai")) <= 41 * COST + 10
    for number in (1, 2):
        assert await audit_findings(in_cell(empty_database_dsn, cell_name(number))) == []


async def test_the_journal_forgets_a_move_after_a_day_and_its_receipt_after_two(
    cells: CellLimiters, empty_database_dsn: str
) -> None:
    async with cells:
        giver, taker = (limiter.store.budget_moves for limiter in cells.limiters)
        moved = uuid.uuid4()
        await giver.send(moved, None, "cell_2", 1_000.0, 0.0, keep_tokens=0.0, keep_requests=0.0)
        assert await taker.receive(moved, None, "cell_1", 1_000.0, 0.0)
        # Both rows a day and a half old (wall-clock literals: Citus takes no
        # clock arithmetic over a column in an UPDATE).
        then = datetime.now(UTC) - timedelta(hours=36)
        for number in (1, 2):
            connection = await asyncpg.connect(in_cell(empty_database_dsn, cell_name(number)))
            try:
                await connection.execute("UPDATE budget_transfers SET moved_at = $1", then)
            finally:
                await connection.close()
        assert await giver.prune(86_400) == 1  # the move: undelivered, given up
        assert await taker.prune(86_400) == 0  # its receipt stays a second day
        assert await giver.undelivered() == []
        # A late delivery of it (the rebalancer back after a day) still finds
        # the receipt: credited once.
        assert await taker.receive(moved, None, "cell_1", 1_000.0, 0.0) is False
        assert await taker.prune(2 * 86_400 // 3) == 1
