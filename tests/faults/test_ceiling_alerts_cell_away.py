"""A ceiling's alerts over cells while one cell does not answer.

Over cells a ceiling is watched whole: every cell's slice read and added up
(admin/ceilings_over_cells.py). Before, one cell that did not answer stopped
every ceiling's alerts, at the moment an operator most needs them. Now the
away cell's slices count as full (their capacity: no credit takes a slice
past it), so the whole's utilization is at most the truth: a crossing
certain without the cell is recorded and alerted, once;
a reading below a threshold is left out, so the outage neither ends an open
episode nor makes the cell's return alert it again.

Here two cells of a real database, cell 2 reached through a proxy the test
cuts, and the ceiling's slices of 5,000 tokens each (10,000 whole).
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator

import asyncpg
import pytest

from llmquota.admin.ceiling_alerts import CeilingAlertDetector
from llmquota.admin.ceilings_over_cells import CeilingsOverCells
from llmquota.admission.limiter import Limiter
from llmquota.domain.ceiling_alerts import AlertDefaults
from llmquota.domain.cells import cell_of
from llmquota.domain.errors import StoreUnavailable
from llmquota.domain.plans import Ceiling
from llmquota.domain.policy import Policy
from llmquota.store.alerts import AlertStore
from llmquota.store.cells import build_cells, in_cell
from llmquota.store.store import Store
from tests.faults.conftest import fault_settings
from tests.faults.proxy import PgProxy

TENANT = next(t for t in (f"tenant-{i:02d}" for i in range(40)) if cell_of(t, 2) == 1)
SLICE = Ceiling(models=["gpt-4o"], tokens_per_minute=1, token_burst=5_000, alert_at=[0.3, 0.45])
OPEN = "SELECT threshold FROM cell_1.ceiling_alert_episodes WHERE episode_start IS NOT NULL"
ALERTS = "SELECT count(*) FROM cell_1.alert_outbox WHERE event_type = 'ceiling.utilization'"


@pytest.fixture
async def cells_dsn(empty_database_dsn: str) -> str:
    await asyncio.to_thread(build_cells, empty_database_dsn, 2)
    return empty_database_dsn


@pytest.fixture
async def cell_2_proxy(cells_dsn: str) -> AsyncIterator[PgProxy]:
    p = await PgProxy(cells_dsn).start()
    yield p
    await p.close()


async def open_thresholds(db: asyncpg.Connection) -> list[float]:
    return sorted(float(r["threshold"]) for r in await db.fetch(OPEN))


async def test_a_crossing_certain_without_an_away_cell_alerts_once_and_its_outage_ends_nothing(
    cells_dsn: str, cell_2_proxy: PgProxy
) -> None:
    db = await asyncpg.connect(cells_dsn)
    limiter = await Limiter.connect(in_cell(cells_dsn, "cell_1"), fault_settings())
    one = limiter.store
    two = await Store.connect(in_cell(cell_2_proxy.dsn, "cell_2"), min_size=1, max_size=2)
    try:
        for store in (one, two):
            await store.catalog.put_ceiling("openai", SLICE)
        await one.put_policy("tenant", TENANT, None, Policy(tokens_per_minute=1, token_burst=10**6))
        detector = CeilingAlertDetector(
            CeilingsOverCells([one, two]),
            AlertStore(one.pool),
            AlertDefaults(hysteresis=0.05, quiet_seconds=0.0),
            deadline_seconds=2.0,
        )
        held: list[uuid.UUID] = []

        async def admit(tokens: int) -> None:
            decision = await limiter.admit(
                tenant=TENANT, model="gpt-4o", input_tokens=100, max_tokens=tokens - 100
            )
            assert decision.reservation_id is not None
            held.append(decision.reservation_id)

        await admit(3_500)  # 35% of the whole (70% of cell 1's slice)
        opened = await detector.run_once()
        assert [float(s.threshold) for s, _event in opened] == [0.3]

        await cell_2_proxy.cut()
        await admit(1_100)  # 46%: certain whatever cell 2 holds
        opened = await detector.run_once()  # the larger room of two reads in a row: 35%
        opened += await detector.run_once()
        assert [float(s.threshold) for s, _event in opened] == [0.45]
        assert await open_thresholds(db) == [0.3, 0.45]

        # Room back in cell 1: the whole reads 0% without cell 2, which is not
        # certain, so the episodes stay open however long the outage lasts.
        for reservation_id in held:
            await limiter.release(reservation_id)
        for _ in range(3):
            assert await detector.run_once() == []
            await asyncio.sleep(0.05)
        assert await open_thresholds(db) == [0.3, 0.45]

        # Back: read whole, below both thresholds, the episodes end (the
        # proxy's cut connections may cost a read or two first).
        await cell_2_proxy.restore()
        for _ in range(50):
            with contextlib.suppress(StoreUnavailable):
                assert await detector.run_once() == []
            if not await open_thresholds(db):
                break
            await asyncio.sleep(0.1)
        assert await open_thresholds(db) == []
        assert await db.fetchval(ALERTS) == 2  # one per threshold: none again on the return
    finally:
        await two.close()
        await limiter.close()
        await db.close()


async def test_a_cell_never_read_leaves_the_ceilings_unwatched_rather_than_guessed(
    cells_dsn: str, cell_2_proxy: PgProxy
) -> None:
    limiter = await Limiter.connect(in_cell(cells_dsn, "cell_1"), fault_settings())
    two = await Store.connect(in_cell(cell_2_proxy.dsn, "cell_2"), min_size=1, max_size=2)
    try:
        await limiter.store.catalog.put_ceiling("openai", SLICE)
        await cell_2_proxy.cut()
        reader = CeilingsOverCells([limiter.store, two])
        with pytest.raises(StoreUnavailable):
            await reader.get_ceilings(deadline_seconds=2.0)
    finally:
        await two.close()
        await limiter.close()
