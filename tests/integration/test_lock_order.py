"""The layer lock order holds on every path of lq_admit (issue 25).

Admission locks limit_layers rows in layer_id order (admission.sql's
header), so concurrent transactions never deadlock. Its fast path (3a)
locks the batch's layers in one statement; when the batch does not fit
there it keeps them and the exact loop (3) locks again, with a snapshot of
its own under READ COMMITTED. A layer committed in between whose layer_id
is below one already held must not be waited for: the transaction would
wait for a lower id while holding a higher one, and a transaction locking
in order deadlocks with it. So after the fast path (3) waits for no lock
(SKIP LOCKED).

The interleaving is built with real row locks and read from pg_locks
(pg_blocking_pids), never from sleeps: X creates tenant t0's layer and does
not commit (its layer_id is drawn, below t1's); t1's layer is created and
committed; H holds the global layer's row(s); the batch (t0, t1) starts its
fast path, whose snapshot cannot see t0, and waits for H; X commits; Y locks
t0's row; H commits. The fast path locks the global layer and t1, finds
t0 unknown and does not fit, and (3) sees t0. Then Y asks for t1's row:
out of order, the batch would be waiting for Y's t0 while holding t1, and
one of the two would fail with a deadlock. In order, the batch leaves t0
out (it came after the batch began, and another transaction holds it):
t0's request is unknown_tenant, as if t0 had been created just after.
Without Y, t0's row is free: the batch takes it without waiting and
decides t0's request as any other.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import asyncpg
import pytest

from llmquota.admission.limiter import Limiter
from llmquota.domain.policy import Policy

LARGE = 10**9
WAIT_S = 30.0

# Two requests, for t0 then t1: the shape of the store's admission statement.
ADMIT = """SELECT ord, status FROM lq_admit(
    ARRAY['t0', 't1'], ARRAY[NULL, NULL]::text[], ARRAY['m', 'm'],
    ARRAY[10, 10]::bigint[], ARRAY[90, 90]::bigint[], ARRAY[false, false],
    ARRAY[NULL, NULL]::integer[], ARRAY[NULL, NULL]::text[], ARRAY[NULL, NULL]::text[], 1000)
ORDER BY ord"""


async def until(condition: Callable[[], Awaitable[bool]], what: str) -> None:
    """Poll the database until `condition` holds."""
    deadline = time.monotonic() + WAIT_S
    while not await condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting until {what}")
        await asyncio.sleep(0.01)


async def blockers(db: asyncpg.Connection, pid: int) -> list[int]:
    """The backends `pid` waits for a lock of (pg_locks, via pg_blocking_pids)."""
    return list(await db.fetchval("SELECT pg_blocking_pids($1)", pid))


async def layer_ids(db: asyncpg.Connection) -> dict[str, int]:
    """Each tenant layer's layer_id, by tenant (committed ones)."""
    rows = await db.fetch("SELECT tenant, layer_id FROM limit_layers WHERE scope = 'tenant'")
    return {row["tenant"]: row["layer_id"] for row in rows}


class Interleaving:
    """X, H and Y (as the owner) and the batch (as the service), on connections of their own."""

    def __init__(self, db: asyncpg.Connection, owner_dsn: str, app_dsn: str) -> None:
        self.db, self.owner_dsn, self.app_dsn = db, owner_dsn, app_dsn

    async def __aenter__(self) -> Interleaving:
        self.x, self.h, self.y = [await asyncpg.connect(self.owner_dsn) for _ in range(3)]
        self.batch = await asyncpg.connect(self.app_dsn)
        self.pids = {
            id(c): await c.fetchval("SELECT pg_backend_pid()")
            for c in (self.x, self.h, self.y, self.batch)
        }
        return self

    async def __aexit__(self, *exc: object) -> None:
        for connection in (self.x, self.h, self.y, self.batch):
            await connection.close()

    async def waits_for(self, connection: asyncpg.Connection) -> bool:
        """Whether the batch waits for a lock `connection`'s transaction holds."""
        waited_for = await blockers(self.db, self.pids[id(self.batch)])
        return waited_for == [self.pids[id(connection)]]

    async def start_the_batch(self, limiter: Limiter, *, y_holds_t0: bool) -> asyncio.Task:
        """Up to H's commit: the fast path has no room for t0, unknown to its snapshot."""
        generous = Policy(tokens_per_minute=LARGE, token_burst=LARGE)
        # X: t0's layer, its layer_id drawn now, committed later.
        await self.x.execute("BEGIN")
        await self.x.execute(
            "SELECT lq_put_tenant_policy('t0', NULL, $1::jsonb)",
            f'{{"tokens_per_minute": {LARGE}}}',
        )
        await limiter.store.put_policy("tenant", "t1", None, generous)
        assert set(await layer_ids(self.db)) == {"t1"}
        # H: every global row. The batch's fast path waits for it.
        await self.h.execute("BEGIN")
        await self.h.execute("SELECT 1 FROM limit_layers WHERE scope = 'global' FOR UPDATE")
        admitting = asyncio.create_task(self.batch.fetch(ADMIT))
        await until(lambda: self.waits_for(self.h), "the batch waits for H")
        await self.x.execute("COMMIT")
        ids = await layer_ids(self.db)
        assert ids["t0"] < ids["t1"]
        if y_holds_t0:
            # Y: t0's row, in order (it holds nothing else yet).
            await self.y.execute("BEGIN")
            await self.y.execute(
                "SELECT 1 FROM limit_layers WHERE layer_id = $1 FOR UPDATE", ids["t0"]
            )
        await self.h.execute("COMMIT")
        return admitting


async def generous_global_layer(limiter: Limiter, shards: int) -> None:
    """A global layer of `shards` shards that never binds: only the locks matter."""
    generous = Policy(tokens_per_minute=LARGE, token_burst=LARGE)
    await limiter.store.put_policy("global", None, None, generous, shards=shards)


def statuses(rows: list[asyncpg.Record]) -> list[tuple[int, str]]:
    return [(row["ord"], row["status"]) for row in rows]


@pytest.mark.parametrize("shards", [1, 2])
async def test_a_layer_committed_under_a_batch_below_its_locks_is_not_waited_for(
    limiter: Limiter, db: asyncpg.Connection, owner_dsn: str, app_dsn: str, shards: int
) -> None:
    await generous_global_layer(limiter, shards)
    async with Interleaving(db, owner_dsn, app_dsn) as run:
        admitting = await run.start_the_batch(limiter, y_holds_t0=True)

        # Out of order, the batch would now wait for Y (t0) while holding t1.
        async def decided_or_waits_for_y() -> bool:
            return admitting.done() or await run.waits_for(run.y)

        await until(decided_or_waits_for_y, "the batch decides or waits for Y")
        # Y asks for t1's row, in order: it waits for the batch, never a deadlock.
        t1 = (await layer_ids(db))["t1"]
        results = await asyncio.gather(
            admitting,
            run.y.execute("SELECT 1 FROM limit_layers WHERE layer_id = $1 FOR UPDATE", t1),
            return_exceptions=True,
        )
        errors = [r for r in results if isinstance(r, BaseException)]
        assert errors == [], f"the lock order was broken: {errors!r}"
        await run.y.execute("COMMIT")
    # t0's layer came after the batch began, below its locks, held by Y:
    # decided as if created just after the batch.
    assert isinstance(results[0], list)
    assert statuses(results[0]) == [(1, "unknown_tenant"), (2, "admitted")]


@pytest.mark.parametrize("shards", [1, 2])
async def test_a_free_layer_committed_under_a_batch_is_taken_without_waiting(
    limiter: Limiter, db: asyncpg.Connection, owner_dsn: str, app_dsn: str, shards: int
) -> None:
    await generous_global_layer(limiter, shards)
    async with Interleaving(db, owner_dsn, app_dsn) as run:
        admitting = await run.start_the_batch(limiter, y_holds_t0=False)
        rows = await asyncio.wait_for(admitting, WAIT_S)
    assert statuses(rows) == [(1, "admitted"), (2, "admitted")]
