"""Moving in-flight permits between cells' slices of a shared layer
(admission/rebalancer.py, sql/global_layer.sql).

A shared layer's `max_in_flight` is split over the cells like its tokens, so
a cell whose tenants are busy refuses at its own slice while another cell's
permits sit free. The rebalancer lends free permits the same way it moves
room: debit the giver (its cap goes down), credit the taker (its cap goes
up). Here: a busy cell borrows the idle cell's free permits and the cells
never hold more calls than the cap; the permits follow the demand back; a
move stopped between debit and credit is stranded until the next round
delivers it, once, and is not given up; a policy write keeps what was
moved, also below what a cell lent, also through a cap removed and set again;
a deleted ceiling's moves die with it; rounds as fast as they go beside
admissions and releases in both cells never let the cells hold more than the
cap. After each test the caps of every cell plus the permits stranded sum to
the policy (`_conserved`). On CI's Citus leg the two cells are on the two
workers.
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
PERMITS = 10  # the global max_in_flight, 5 a cell
REQUEST = {"model": "gpt-4o", "input_tokens": 100, "max_tokens": 100}
TENANTS = [f"tenant-{i:02d}" for i in range(40)]
IN_CELL = {
    cell: [t for t in TENANTS if cell_of(t, CELLS) == cell][:10] for cell in range(1, CELLS + 1)
}
ROOMY = Policy(tokens_per_minute=10**6, token_burst=10**7)


@pytest.fixture
async def cells(empty_database_dsn: str, settings: Settings) -> CellLimiters:
    """Two cells, roomy tenants, a global cap of PERMITS calls in flight and
    room for far more; no rebalancing but the rounds a test runs."""
    await asyncio.to_thread(build_cells, empty_database_dsn, CELLS)
    router = await CellLimiters.connect(
        dsn_as(empty_database_dsn, APP_ROLE), settings, rebalance_seconds=None
    )
    for tenant in IN_CELL[1] + IN_CELL[2]:
        await router.for_tenant(tenant).store.put_policy("tenant", tenant, None, ROOMY)
    await router.put_global_policy(
        Policy(tokens_per_minute=10**6, token_burst=10**7, max_in_flight=PERMITS)
    )
    return router


async def _admit(cells: CellLimiters, cell: int, count: int) -> list[Reservation]:
    tenants = IN_CELL[cell]
    results = await asyncio.gather(
        *(attempt(cells.for_tenant(t), **REQUEST, tenant=t) for t in (tenants * count)[:count])
    )
    assert all(isinstance(r, Reservation | RateLimited) for r in results), results
    return [r for r in results if isinstance(r, Reservation)]


async def _caps(cells: CellLimiters, ceiling: str | None = None) -> list[int]:
    """Each cell's cap of the shared layer's permits now."""
    return [
        (await limiter.store.budget_moves.permits())[ceiling].max_in_flight
        for limiter in cells.limiters
    ]


async def _shares(cells: CellLimiters, ceiling: str | None = None) -> list[int]:
    """Each cell's share of the policy: its cap less what moves brought it."""
    return [
        (await limiter.store.budget_moves.permits())[ceiling].share for limiter in cells.limiters
    ]


async def _policy_totals(cells: CellLimiters) -> tuple[int, int]:
    """The global policy's and the openai ceiling's max_in_flight as the API
    reads them over the cells: each cell's slice summed (domain/cells.py)."""
    global_total = ceiling_total = 0
    for limiter in cells.limiters:
        stored = await limiter.store.get_policy("global", None, None)
        assert stored is not None
        global_total += stored.policy.max_in_flight or 0
        for ceiling in await limiter.store.catalog.get_ceilings("openai"):
            ceiling_total += ceiling.ceiling.max_in_flight or 0
    return global_total, ceiling_total


async def _conserved(cells: CellLimiters, total: int, ceiling: str | None = None) -> None:
    """The cells' caps plus the permits stranded between them are the policy's."""
    caps = sum(await _caps(cells, ceiling))
    stranded = 0
    for limiter in cells.limiters:
        owed = await limiter.store.budget_moves.undelivered_permits()
        stranded += sum(move.permits for move in owed if move.ceiling == ceiling)
    assert caps + stranded == total, (await _caps(cells, ceiling), stranded)


async def _audited(dsn: str) -> None:
    for number in range(1, CELLS + 1):
        assert await audit_findings(in_cell(dsn, cell_name(number))) == []


async def test_a_busy_cell_borrows_the_idle_cells_free_permits_and_never_more_than_the_cap(
    cells: CellLimiters, empty_database_dsn: str
) -> None:
    async with cells:
        busy = await _admit(cells, 1, 20)
        assert len(busy) == PERMITS // CELLS  # its own slice, and no more without a round
        report = await cells.rebalancer.run_round()
        # The idle cell lends all its free permits but the one it keeps.
        assert (report.moves, report.permits, report.tokens) == (1, 4, 0.0)
        assert await _caps(cells) == [9, 1]
        busy += await _admit(cells, 1, 20)
        assert len(busy) == 9
        idle = await _admit(cells, 2, 5)
        assert len(idle) == 1  # what it kept for its own tenants
        # The cap holds across both cells: 10 calls in flight, no more anywhere.
        assert await _admit(cells, 1, 5) == [] and await _admit(cells, 2, 5) == []

        # The demand moves: the permits follow it back.
        for reservation in busy:
            await reservation.release()
        await cells.rebalancer.run_round()
        assert await _caps(cells) == [2, 8]
        idle += await _admit(cells, 2, 20)
        assert len(idle) == 8
        await _conserved(cells, PERMITS)
    await _audited(empty_database_dsn)


async def test_a_permit_move_stopped_between_debit_and_credit_is_stranded_then_delivered_once(
    cells: CellLimiters, empty_database_dsn: str
) -> None:
    async with cells:
        held = await _admit(cells, 1, 4)  # 4 of cell 1's 5 permits in use
        giver, taker = (limiter.store.budget_moves for limiter in cells.limiters)
        transfer = uuid.uuid4()
        # A permit in use is never lent: of the 3 asked, 1 is free.
        assert await giver.send_permits(transfer, None, "cell_2", 3, keep=0) == 1
        # A retried send of the same move lends nothing more.
        assert await giver.send_permits(transfer, None, "cell_2", 3, keep=0) == 1
        # Stranded: the permit is in neither cell. The policy is what it was.
        assert await _caps(cells) == [4, 5]
        assert await _policy_totals(cells) == (PERMITS, 0)
        await _conserved(cells, PERMITS)
        assert [u.transfer_id for u in await giver.undelivered_permits()] == [transfer]
        assert await giver.undelivered() == []  # not a move of room

        report = await cells.rebalancer.run_round()
        assert report.redelivered == 1
        assert await giver.undelivered_permits() == []
        assert sum(await _caps(cells)) == PERMITS
        # Delivered again by a second rebalancer: credited once.
        assert await taker.receive_permits(transfer, None, "cell_1", 1) is False
        assert sum(await _caps(cells)) == PERMITS
        for reservation in held:
            await reservation.release()

        # A move no round could deliver for days is still not given up: a
        # permit does not refill as room does. Its receipt outlives it too.
        lost = uuid.uuid4()
        assert await giver.send_permits(lost, None, "cell_2", 1, keep=0) == 1
        then = datetime.now(UTC) - timedelta(days=3)
        for number in (1, 2):
            connection = await asyncpg.connect(in_cell(empty_database_dsn, cell_name(number)))
            try:
                await connection.execute("UPDATE budget_transfers SET moved_at = $1", then)
            finally:
                await connection.close()
        await giver.prune(86_400)
        await taker.prune(86_400)
        assert [u.transfer_id for u in await giver.undelivered_permits()] == [lost]
        # The first move's receipt is kept a week: delivered again, credited once.
        assert await taker.receive_permits(transfer, None, "cell_1", 1) is False
        await cells.rebalancer.run_round()
        await _conserved(cells, PERMITS)
    await _audited(empty_database_dsn)


async def test_a_policy_write_keeps_the_permits_moved(
    cells: CellLimiters, empty_database_dsn: str
) -> None:
    async with cells:
        held = await _admit(cells, 1, 5)
        await cells.rebalancer.run_round()
        assert await _caps(cells) == [9, 1]
        # A cap raised to 12 (6 a cell): each keeps what it lent or borrowed.
        await cells.put_global_policy(
            Policy(tokens_per_minute=10**6, token_burst=10**7, max_in_flight=12)
        )
        assert await _caps(cells) == [10, 2]
        assert await _shares(cells) == [6, 6]
        assert await _policy_totals(cells) == (12, 0)  # read back as written
        # A share below what a cell lent: its cap is below zero, and it
        # admits nothing until the borrower gives permits back.
        await cells.put_global_policy(
            Policy(tokens_per_minute=10**6, token_burst=10**7, max_in_flight=4)
        )
        assert await _caps(cells) == [6, -2]
        assert await _policy_totals(cells) == (4, 0)
        assert await _admit(cells, 2, 3) == []
        for reservation in held:
            await reservation.release()
        await cells.rebalancer.run_round()
        assert await _caps(cells) == [3, 1]
        await _conserved(cells, 4)
        # No cap at all, then one again: what was moved is still moved.
        await cells.put_global_policy(Policy(tokens_per_minute=10**6, token_burst=10**7))
        assert [await limiter.store.budget_moves.permits() for limiter in cells.limiters] == [
            {},
            {},
        ]
        await cells.put_global_policy(
            Policy(tokens_per_minute=10**6, token_burst=10**7, max_in_flight=PERMITS)
        )
        assert await _caps(cells) == [6, 4]
        await _conserved(cells, PERMITS)
    await _audited(empty_database_dsn)


async def test_a_move_stranded_while_the_cap_is_removed_is_kept_and_a_deleted_ceilings_dies(
    cells: CellLimiters, empty_database_dsn: str
) -> None:
    async with cells:
        giver, _taker = (limiter.store.budget_moves for limiter in cells.limiters)
        # Stranded, then the cap removed and set again, then delivered.
        assert await giver.send_permits(uuid.uuid4(), None, "cell_2", 3, keep=0) == 3
        await cells.put_global_policy(ROOMY)
        assert (await cells.rebalancer.run_round()).redelivered == 1
        await cells.put_global_policy(
            Policy(tokens_per_minute=10**6, token_burst=10**7, max_in_flight=PERMITS)
        )
        assert await _caps(cells) == [2, 8]
        await _conserved(cells, PERMITS)

        # A ceiling's move stranded, then the ceiling deleted everywhere and
        # made again: each cell starts from its share, and the move, whose
        # debt went with the row it debited, is not delivered.
        await cells.put_ceiling("openai", Ceiling(models=["gpt-4o"], max_in_flight=10))
        assert await giver.send_permits(uuid.uuid4(), "openai", "cell_2", 3, keep=0) == 3
        for limiter in cells.limiters:
            assert await limiter.store.catalog.delete_ceiling("openai")
        await cells.put_ceiling("openai", Ceiling(models=["gpt-4o"], max_in_flight=10))
        report = await cells.rebalancer.run_round()
        assert report.redelivered == 0
        assert await _caps(cells, "openai") == [5, 5]
        await _conserved(cells, 10, "openai")
    await _audited(empty_database_dsn)


async def test_a_provider_ceilings_permits_move_too_and_the_command_says_so(
    cells: CellLimiters, empty_database_dsn: str
) -> None:
    async with cells:
        await cells.put_global_policy(ROOMY)
        await cells.put_ceiling("openai", Ceiling(models=["gpt-4o"], max_in_flight=7))
        assert await _caps(cells, "openai") == [4, 3]  # lq_shard_share's split
        held = await _admit(cells, 2, 10)
        assert len(held) == 3
        done = await asyncio.to_thread(run_cli, "rebalance", dsn=empty_database_dsn)
        assert done.stdout.startswith("rebalanced: redelivered=0 moves=1 tokens=0 ")
        assert done.stdout.rstrip().endswith(" permits=3")
        assert await _caps(cells, "openai") == [1, 6]
        assert (await _policy_totals(cells))[1] == 7  # the ceiling as it was written
        held += await _admit(cells, 2, 10)
        assert len(held) == 6
        assert await _admit(cells, 1, 3) != []  # cell 1 kept one
        assert await _admit(cells, 1, 3) == []
        await _conserved(cells, 7, "openai")
    await _audited(empty_database_dsn)


async def test_rounds_beside_admissions_and_releases_never_let_the_cells_hold_more_than_the_cap(
    cells: CellLimiters, empty_database_dsn: str
) -> None:
    async with cells:
        held: list[Reservation] = []
        most = 0
        stop = asyncio.Event()

        async def rounds() -> int:
            permits = 0
            while not stop.is_set():
                permits += (await cells.rebalancer.run_round()).permits
            return permits

        mover = asyncio.create_task(rounds())
        for cell in (1, 2, 1, 1, 2, 2, 1):
            held += await _admit(cells, cell, 8)
            most = max(most, len(held))
            assert len(held) <= PERMITS
            for reservation in held[::3]:
                await reservation.release()
            held = [r for i, r in enumerate(held) if i % 3]
            await asyncio.sleep(0.02)
        stop.set()
        moved = await mover
        await cells.rebalancer.run_round()
        assert moved > 0
        assert most <= PERMITS
        # Every permit is in some cell's cap again: none made, none lost.
        await _conserved(cells, PERMITS)
        assert sum(await _caps(cells)) == PERMITS
        for reservation in held:
            await reservation.release()
    await _audited(empty_database_dsn)
