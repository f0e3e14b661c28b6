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
global policy, split K ways so that the slices sum to it (domain/cells.py).
The cells never admit more than the global burst together; a cell whose
slice is dry refuses while another has room (no rebalancer moves unused room
between cells yet: docs/scaling.md).
"""

from __future__ import annotations

import asyncio

from llmquota.admission.limiter import Limiter
from llmquota.config import Settings
from llmquota.domain.cells import cell_of, slice_of
from llmquota.domain.policy import Policy
from llmquota.store.cells import CellsError, cells_in, in_cell

__all__ = ["CellLimiters"]


class CellLimiters:
    """One Limiter per cell of a cells database, and where each tenant goes."""

    def __init__(self, limiters: list[Limiter]) -> None:
        if not limiters:
            raise CellsError("no cells: build them with `llmquota migrate --cells K` first")
        self.limiters = limiters

    @classmethod
    async def connect(cls, dsn: str, settings: Settings | None = None) -> CellLimiters:
        """A Limiter for each cell of the database at `dsn` (its `public` DSN)."""
        limiters: list[Limiter] = []
        try:
            for name in await cells_in(dsn):
                limiters.append(await Limiter.connect(in_cell(dsn, name), settings))
        except BaseException:
            await asyncio.gather(*(limiter.close() for limiter in limiters))
            raise
        return cls(limiters)

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

    async def close(self) -> None:
        """Close every cell's limiter (each finishes its batches first)."""
        await asyncio.gather(*(limiter.close() for limiter in self.limiters))

    async def __aenter__(self) -> CellLimiters:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
