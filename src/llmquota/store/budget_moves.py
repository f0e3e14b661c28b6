"""Typed access to budget moves between the slices of shared layers in cells
(sql/global_layer.sql).

Beside store.py, over the same pool: one named statement per call, each a
function of the cell that runs whole on its node. The rebalancer
(admission/rebalancer.py) composes them into moves: a send in the giving
cell, a receive in the other, a confirm back in the first.
"""

from __future__ import annotations

import uuid
from typing import Any, NamedTuple

from llmquota.domain.budget_moves import SlicePermits, SliceRoom
from llmquota.store.connection import Row
from llmquota.store.pool import DeadlinePool

__all__ = ["BudgetMoveStore", "Undelivered", "UndeliveredPermits"]


class Undelivered(NamedTuple):
    """A move this cell sent that its receiver has not acknowledged."""

    transfer_id: uuid.UUID
    ceiling: str | None  # the shared layer: a provider ceiling's name, None: global
    peer: str
    tokens: float
    requests: float


class UndeliveredPermits(NamedTuple):
    """A move of permits this cell sent that its receiver has not acknowledged."""

    transfer_id: uuid.UUID
    ceiling: str | None
    peer: str
    permits: int


class BudgetMoveStore:
    """Read a cell's room in each shared layer; send, receive and confirm moves of it.
    A layer is named by its provider ceiling, None for the global layer."""

    def __init__(self, pool: DeadlinePool, sql: dict[str, str]) -> None:
        self._pool = pool
        self._sql = sql

    async def _fetch(self, name: str, *args: Any) -> list[Row]:
        return await self._pool.fetch(self._sql[name], args, deadline_seconds=None)

    async def rooms(self) -> dict[str | None, SliceRoom]:
        """This cell's slice of each shared layer it has, and its room now."""
        rows = await self._fetch("shared_rooms")
        return {row["ceiling"]: SliceRoom(*list(row.values())[1:]) for row in rows}

    async def send(
        self,
        transfer_id: uuid.UUID,
        ceiling: str | None,
        to_cell: str,
        tokens: float,
        requests: float,
        *,
        keep_tokens: float,
        keep_requests: float,
    ) -> tuple[float, float]:
        """Debit up to `tokens`/`requests` for `to_cell`, leaving at least the
        `keep_` amounts; what was debited (the same again for a repeated id)."""
        row = (
            await self._fetch(
                "send_budget",
                transfer_id,
                ceiling,
                to_cell,
                tokens,
                requests,
                keep_tokens,
                keep_requests,
            )
        )[0]
        return float(row["tokens"]), float(row["requests"])

    async def receive(
        self,
        transfer_id: uuid.UUID,
        ceiling: str | None,
        from_cell: str,
        tokens: float,
        requests: float,
    ) -> bool:
        """Credit a move (clamped at the burst); False: it was received before."""
        rows = await self._fetch(
            "receive_budget", transfer_id, ceiling, from_cell, tokens, requests
        )
        return bool(rows[0]["credited"])

    async def confirm(self, transfer_id: uuid.UUID) -> None:
        """Mark a sent move delivered."""
        await self._fetch("confirm_budget", transfer_id)

    async def undelivered(self, limit: int = 100) -> list[Undelivered]:
        """Moves sent from here and not acknowledged, oldest first."""
        rows = await self._fetch("undelivered_budget", limit)
        return [Undelivered(*row.values()) for row in rows]

    async def prune(self, keep_seconds: int) -> int:
        """Forget moves older than `keep_seconds` ('in' rows twice as old); how many."""
        rows = await self._fetch("prune_budget_transfers", keep_seconds)
        return int(rows[0]["pruned"])

    async def permits(self) -> dict[str | None, SlicePermits]:
        """This cell's slice of each shared layer that caps permits in flight."""
        rows = await self._fetch("shared_permits")
        return {row["ceiling"]: SlicePermits(*list(row.values())[1:]) for row in rows}

    async def send_permits(
        self, transfer_id: uuid.UUID, ceiling: str | None, to_cell: str, permits: int, *, keep: int
    ) -> int:
        """Lend up to `permits` free permits to `to_cell`, keeping `keep` free;
        how many left (the same again for a repeated id)."""
        rows = await self._fetch("send_permits", transfer_id, ceiling, to_cell, permits, keep)
        return int(rows[0]["permits"])

    async def receive_permits(
        self, transfer_id: uuid.UUID, ceiling: str | None, from_cell: str, permits: int
    ) -> bool:
        """Credit lent permits; False: this move was received before."""
        rows = await self._fetch("receive_permits", transfer_id, ceiling, from_cell, permits)
        return bool(rows[0]["credited"])

    async def undelivered_permits(self, limit: int = 100) -> list[UndeliveredPermits]:
        """Permit moves sent from here and not acknowledged, oldest first."""
        rows = await self._fetch("undelivered_permits", limit)
        return [UndeliveredPermits(*row.values()) for row in rows]
