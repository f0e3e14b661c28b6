"""A limiter per cell: a tenant's requests go to the cell that holds it.

A database built with `llmquota migrate --cells K` holds K copies of the
schema; on Citus each is on one node, and every call of a cell is one
statement there (store/cells.py). A process that serves many tenants opens a
Limiter per cell (its pool, its coalescer, its policy cache: a batch is one
cell's, so it stays one statement on one node) and sends each tenant's
requests to the cell its name hashes to (domain/cells.py: the same cell in
every process). Settle, release and heartbeat go through the Reservation
that admission returned, so they reach the same cell.

A limit no tenant owns is written to every cell as that cell's slice: the
global policy and each provider ceiling, split K ways so that the slices sum
to it (domain/cells.py). A plan is written to every cell whole. The cells
never admit more than a shared limit together. A cell whose slice is dry
would refuse while another has room, so the router runs a rebalancer
(admission/rebalancer.py) that moves unused room between the slices every
second, debit before credit: it never creates room.
"""

from __future__ import annotations

import asyncio

from llmquota.admission.limiter import Limiter
from llmquota.admission.rebalancer import REBALANCER_LOCK_NAME, SliceRebalancer
from llmquota.config import Settings
from llmquota.domain.cells import ceiling_slice_of, cell_of, slice_of
from llmquota.domain.plans import Ceiling, Plan
from llmquota.domain.policy import Policy
from llmquota.store.cells import CellsError, cells_in, in_cell
from llmquota.store.leader import LeaderLock

__all__ = ["CellLimiters"]


class CellLimiters:
    """One Limiter per cell of a cells database, and where each tenant goes."""

    def __init__(
        self,
        limiters: dict[str, Limiter],
        rebalance_seconds: float | None = 1.0,
        leader: LeaderLock | None = None,
    ) -> None:
        if not limiters:
            raise CellsError("no cells: build them with `llmquota migrate --cells K` first")
        self.limiters = list(limiters.values())
        # Moves unused room between the shared slices; started unless
        # rebalance_seconds is None, and then only while `leader` is held.
        self.rebalancer = SliceRebalancer(
            [(name, limiter.store.budget_moves) for name, limiter in limiters.items()],
            rebalance_seconds or 1.0,
            credited=lambda cell: limiters[cell].refusals.forget_all(),
            leader=leader,
        )
        if rebalance_seconds is not None:
            self.rebalancer.start()

    @classmethod
    async def connect(
        cls, dsn: str, settings: Settings | None = None, rebalance_seconds: float | None = 1.0
    ) -> CellLimiters:
        """A Limiter for each cell of the database at `dsn` (its `public` DSN, a
        direct one: the rebalancer's leader lock is a session's), rebalancing
        the shared slices every `rebalance_seconds` (None: never) while this
        process holds the lock."""
        limiters: dict[str, Limiter] = {}
        try:
            for name in await cells_in(dsn):
                limiters[name] = await Limiter.connect(in_cell(dsn, name), settings)
        except BaseException:
            await asyncio.gather(*(limiter.close() for limiter in limiters.values()))
            raise
        # One process rebalances the cells at a time (admission/rebalancer.py).
        return cls(limiters, rebalance_seconds, LeaderLock(dsn, REBALANCER_LOCK_NAME))

    def for_tenant(self, tenant: str) -> Limiter:
        """The limiter of the cell that holds `tenant`."""
        return self.limiters[cell_of(tenant, len(self.limiters)) - 1]

    async def put_global_policy(self, policy: Policy) -> list[int]:
        """Write the global policy as K slices, each cell its own; each cell's
        new policy version. Every limit must be at least K (InvalidRequest)."""
        cells = len(self.limiters)
        slices = [slice_of(policy, cell, cells) for cell in range(1, cells + 1)]
        return [
            await limiter.store.put_policy("global", None, None, part)
            for limiter, part in zip(self.limiters, slices, strict=True)
        ]

    async def put_ceiling(self, name: str, ceiling: Ceiling) -> list[int]:
        """Write a provider ceiling as K slices, one per cell (its limits split
        as the global policy's are); each cell's new policy version."""
        cells = len(self.limiters)
        slices = [ceiling_slice_of(ceiling, cell, cells) for cell in range(1, cells + 1)]
        return [
            await limiter.store.catalog.put_ceiling(name, part)
            for limiter, part in zip(self.limiters, slices, strict=True)
        ]

    async def put_plan(self, name: str, plan: Plan) -> int:
        """Write a plan to every cell (a plan is a tenant's limits, not a shared
        budget: each cell holds it whole); how many tenants it changed."""
        changed = [await limiter.store.catalog.put_plan(name, plan) for limiter in self.limiters]
        return sum(changed)

    async def close(self) -> None:
        """Stop rebalancing, then close every cell's limiter (each finishes its
        batches first)."""
        await self.rebalancer.stop()
        await asyncio.gather(*(limiter.close() for limiter in self.limiters))

    async def __aenter__(self) -> CellLimiters:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
