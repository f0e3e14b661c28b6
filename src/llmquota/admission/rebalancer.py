"""Moves unused room between cells' global slices, in the background.

A database of cells (docs/scaling.md) splits the global layer into one slice
per cell so that every admission runs on one node; a cell whose slice is
dry refuses while another cell's still has room. A round of the rebalancer:

1. delivers again every move a cell sent that its receiver never
   acknowledged (a round stopped between the two transactions);
2. reads every slice's room, and plans moves that bring each to its share
   of the whole: a reserve by burst, the rest by what each cell spent since
   the last round (domain/budget_moves.py);
3. runs each move as three calls, each one transaction on one node: debit
   the giver and journal it (`send`), credit the taker once (`receive`),
   mark the giver's journal row delivered (`confirm`).

Interrupted anywhere, a round strands room in the giver's journal until
the next round delivers it, and never creates any: the cells together never
admit more than the policy. Two rebalancers at once (two processes) are as
safe: a giver never gives below its fair share, however often it is asked.

How early a request can be refused: between two rounds a busy cell can
spend its slice while the others hold theirs, so a refusal can come with up
to the other slices' fair shares left, plus what they refill in one
interval. At the limit, with every cell busy, the shares are all near empty
and the slack with them (docs/scaling.md measures it).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from llmquota.domain.budget_moves import Move, plan_moves
from llmquota.store.budget_moves import BudgetMoveStore

__all__ = ["RoundReport", "SliceRebalancer"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RoundReport:
    """What one round did."""

    redelivered: int  # moves of an earlier round delivered now
    moves: int
    tokens: float  # moved this round (debited from givers)
    requests: float


class SliceRebalancer:
    """Rounds of moves over the cells' global slices, on demand or every `interval`."""

    def __init__(
        self,
        cells: Sequence[tuple[str, BudgetMoveStore]],
        interval_seconds: float = 1.0,
        credited: Callable[[str], None] = lambda cell: None,
    ) -> None:
        self._names = [name for name, _ in cells]
        self._stores = dict(cells)
        self._interval = interval_seconds
        # Told the cell a move reached: its limiter forgets the refusals it
        # answers from memory (admission/refusals.py), which the room may undo.
        self._credited = credited
        self._task: asyncio.Task[None] | None = None
        # Each cell's room as the last round left it: what it spent since is
        # that minus its room now (refill makes this an underestimate).
        self._left: dict[str, tuple[float, float]] = {}

    async def run_round(self) -> RoundReport:
        """One round: deliver what is owed, then move room to the short slices."""
        redelivered = await self._redeliver()
        rooms = await asyncio.gather(*(self._stores[name].room() for name in self._names))
        left = {
            name: (room.tokens or 0.0, room.requests or 0.0)
            for name, room in zip(self._names, rooms, strict=True)
            if room is not None
        }
        spent = [
            None
            if name not in self._left or name not in left
            else (
                max(0.0, self._left[name][0] - left[name][0]),
                max(0.0, self._left[name][1] - left[name][1]),
            )
            for name in self._names
        ]
        tokens = requests = 0.0
        moves = 0
        for move in plan_moves(rooms, spent):
            sent = await self._move(move)
            if sent != (0.0, 0.0):
                moves += 1
                tokens += sent[0]
                requests += sent[1]
                for name, sign in ((self._names[move.giver], -1), (self._names[move.taker], 1)):
                    t, r = left[name]
                    left[name] = (t + sign * sent[0], r + sign * sent[1])
        self._left = left
        return RoundReport(redelivered, moves, tokens, requests)

    async def _move(self, move: Move) -> tuple[float, float]:
        giver, taker = self._names[move.giver], self._names[move.taker]
        transfer_id = uuid.uuid4()
        sent = await self._stores[giver].send(
            transfer_id,
            taker,
            move.tokens,
            move.requests,
            keep_tokens=move.keep_tokens,
            keep_requests=move.keep_requests,
        )
        if sent != (0.0, 0.0):
            await self._deliver(giver, taker, transfer_id, *sent)
        return sent

    async def _deliver(
        self, giver: str, taker: str, transfer_id: uuid.UUID, tokens: float, requests: float
    ) -> None:
        if await self._stores[taker].receive(transfer_id, giver, tokens, requests):
            self._credited(taker)
        await self._stores[giver].confirm(transfer_id)

    async def _redeliver(self) -> int:
        count = 0
        for giver in self._names:
            for owed in await self._stores[giver].undelivered():
                if owed.peer not in self._stores:
                    log.warning("budget move %s names no cell %r", owed.transfer_id, owed.peer)
                    continue
                await self._deliver(giver, owed.peer, owed.transfer_id, owed.tokens, owed.requests)
                count += 1
        return count

    def start(self) -> None:
        """Run a round every interval in the background until `stop`."""
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="llmquota-slice-rebalancer")

    async def _run(self) -> None:
        while True:
            try:
                await self.run_round()
            except Exception:
                # A cell unreachable, a deadline: what was sent is delivered next round.
                log.warning(
                    "slice rebalancing round failed; next in %ss", self._interval, exc_info=True
                )
            await asyncio.sleep(self._interval)

    async def stop(self) -> None:
        """Stop the rounds (one under way is cancelled: what it sent is journaled)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
