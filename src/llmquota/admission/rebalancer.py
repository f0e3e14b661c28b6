"""Moves unused room between the slices of shared layers in cells, in the background.

A database of cells (docs/scaling.md) splits each shared layer (the global
layer, each provider ceiling) into one slice per cell so that every
admission runs on one node; a cell whose slice is dry refuses while another
cell's still has room. A round of the rebalancer, layer by layer:

1. delivers again every move a cell sent that its receiver never
   acknowledged (a round stopped between the two transactions);
2. reads every slice's room, and plans moves that bring each to its share
   of the whole: a reserve by burst, the rest by what each cell spent since
   the last round (domain/budget_moves.py);
3. runs each move as three calls, each one transaction on one node: debit
   the giver and journal it (`send`), credit the taker once (`receive`),
   mark the giver's journal row delivered (`confirm`);
4. moves free in-flight permits of the layers that cap them the same way
   (`send_permits`, `receive_permits`, `confirm`): a permit lent lowers the
   giver's cap and raises the taker's.

Interrupted anywhere, a round strands room in the giver's journal until
the next round delivers it, and never creates any: the cells together never
admit more than the policy. One process rebalances at a time (a session
advisory lock, store/leader.py): two at once would be as safe (a giver never
gives below its share, however often it is asked), but each would read the
other's moves as spending and push room back and forth.

How early a request can be refused: between two rounds a busy cell can
spend its slice while the others hold theirs, so a refusal can come with up
to the other slices' fair shares left, plus what they refill in one
interval. At the limit, with every cell busy, the shares are all near empty
and the slack with them (docs/scaling.md measures it).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from llmquota.domain.budget_moves import (
    Move,
    PermitMove,
    SlicePermits,
    SliceRoom,
    plan_moves,
    plan_permit_moves,
)
from llmquota.store.budget_moves import BudgetMoveStore, Undelivered, UndeliveredPermits
from llmquota.store.leader import LeaderLock

__all__ = ["REBALANCER_LOCK_NAME", "RoundReport", "SliceRebalancer"]

# The session advisory lock whose holder rebalances a database's cells.
REBALANCER_LOCK_NAME = "llmquota.rebalancer"
# How long the cells' journals keep a move (lq_prune_budget_transfers): a
# move no round could deliver in a day is given up (room lost, never made).
JOURNAL_KEEP_SECONDS = 86_400
# How often a rebalancer prunes the journals: a day's rows need no pruning
# every second, and a DELETE per cell per round would be work for nothing.
PRUNE_EVERY_SECONDS = 3_600.0

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RoundReport:
    """What one round did."""

    redelivered: int  # moves of an earlier round delivered now
    moves: int  # of room and of permits
    tokens: float  # moved this round (debited from givers)
    requests: float
    permits: int = 0


class SliceRebalancer:
    """Rounds of moves over the cells' shared slices, on demand or every `interval`."""

    def __init__(
        self,
        cells: Sequence[tuple[str, BudgetMoveStore]],
        interval_seconds: float = 1.0,
        credited: Callable[[str], None] = lambda cell: None,
        leader: LeaderLock | None = None,
    ) -> None:
        self._names = [name for name, _ in cells]
        self._stores = dict(cells)
        self._interval = interval_seconds
        # Told the cell a move reached: its limiter forgets the refusals it
        # answers from memory (admission/refusals.py), which the room may undo.
        self._credited = credited
        # Held by the one process that rebalances (None: this one, always).
        self._leader = leader
        self._task: asyncio.Task[None] | None = None
        # Each slice's room as the last round left it, by (layer, cell): what
        # it spent since is that minus its room now (refill makes this an
        # underestimate).
        self._left: dict[tuple[str | None, str], tuple[float, float]] = {}
        self._pruned_at: float | None = None  # monotonic; None: not yet

    async def run_round(self) -> RoundReport:
        """One round: deliver what is owed, then move room to the short slices
        of every shared layer (the global layer, each provider ceiling)."""
        redelivered = await self._redeliver()
        now = time.monotonic()
        if self._pruned_at is None or now - self._pruned_at >= PRUNE_EVERY_SECONDS:
            for name in self._names:
                await self._stores[name].prune(JOURNAL_KEEP_SECONDS)
            self._pruned_at = now
        by_cell = await asyncio.gather(*(self._stores[name].rooms() for name in self._names))
        layers = sorted({layer for rooms in by_cell for layer in rooms}, key=lambda c: c or "")
        report = RoundReport(redelivered, 0, 0.0, 0.0)
        left: dict[tuple[str | None, str], tuple[float, float]] = {}
        for layer in layers:
            rooms = [rooms.get(layer) for rooms in by_cell]
            moved = await self._rebalance(layer, rooms, left)
            report = RoundReport(
                redelivered,
                report.moves + moved.moves,
                report.tokens + moved.tokens,
                report.requests + moved.requests,
            )
        self._left = left
        by_cell_permits = await asyncio.gather(
            *(self._stores[name].permits() for name in self._names)
        )
        capped = sorted(
            {layer for slices in by_cell_permits for layer in slices}, key=lambda c: c or ""
        )
        for layer in capped:
            moves, permits = await self._move_permits(
                layer, [slices.get(layer) for slices in by_cell_permits]
            )
            report = dataclasses.replace(
                report, moves=report.moves + moves, permits=report.permits + permits
            )
        return report

    async def _rebalance(
        self,
        layer: str | None,
        rooms: list[SliceRoom | None],
        left: dict[tuple[str | None, str], tuple[float, float]],
    ) -> RoundReport:
        """Move one shared layer's room; note in `left` what each slice holds after."""
        for name, room in zip(self._names, rooms, strict=True):
            if room is not None:
                left[layer, name] = (room.tokens or 0.0, room.requests or 0.0)
        spent = [
            None
            if (layer, name) not in self._left or (layer, name) not in left
            else (
                max(0.0, self._left[layer, name][0] - left[layer, name][0]),
                max(0.0, self._left[layer, name][1] - left[layer, name][1]),
            )
            for name in self._names
        ]
        moves, tokens, requests = 0, 0.0, 0.0
        for move in plan_moves(rooms, spent):
            sent = await self._move(layer, move)
            if sent != (0.0, 0.0):
                moves, tokens, requests = moves + 1, tokens + sent[0], requests + sent[1]
                for name, sign in ((self._names[move.giver], -1), (self._names[move.taker], 1)):
                    t, r = left[layer, name]
                    left[layer, name] = (t + sign * sent[0], r + sign * sent[1])
        return RoundReport(0, moves, tokens, requests)

    async def _move(self, layer: str | None, move: Move) -> tuple[float, float]:
        giver, taker = self._names[move.giver], self._names[move.taker]
        transfer_id = uuid.uuid4()
        sent = await self._stores[giver].send(
            transfer_id,
            layer,
            taker,
            move.tokens,
            move.requests,
            keep_tokens=move.keep_tokens,
            keep_requests=move.keep_requests,
        )
        if sent != (0.0, 0.0):
            await self._deliver(giver, Undelivered(transfer_id, layer, taker, *sent))
        return sent

    async def _move_permits(
        self, layer: str | None, slices: list[SlicePermits | None]
    ) -> tuple[int, int]:
        """Move one shared layer's free permits: (moves, permits moved)."""
        moves = permits = 0
        for move in plan_permit_moves(slices):
            sent = await self._send_permits(layer, move)
            moves, permits = moves + (sent > 0), permits + sent
        return moves, permits

    async def _send_permits(self, layer: str | None, move: PermitMove) -> int:
        giver, taker = self._names[move.giver], self._names[move.taker]
        transfer_id = uuid.uuid4()
        sent = await self._stores[giver].send_permits(
            transfer_id, layer, taker, move.permits, keep=move.keep
        )
        if sent > 0:
            await self._deliver_permits(giver, UndeliveredPermits(transfer_id, layer, taker, sent))
        return sent

    async def _deliver_permits(self, giver: str, sent: UndeliveredPermits) -> None:
        """Credit permits `giver` lent to their taker, then mark the move delivered."""
        taker = self._stores[sent.peer]
        if await taker.receive_permits(sent.transfer_id, sent.ceiling, giver, sent.permits):
            self._credited(sent.peer)
        await self._stores[giver].confirm(sent.transfer_id)

    async def _deliver(self, giver: str, sent: Undelivered) -> None:
        """Credit a move `giver` sent to its taker, then mark it delivered."""
        taker = self._stores[sent.peer]
        if await taker.receive(sent.transfer_id, sent.ceiling, giver, sent.tokens, sent.requests):
            self._credited(sent.peer)
        await self._stores[giver].confirm(sent.transfer_id)

    async def _redeliver(self) -> int:
        count = 0
        for giver in self._names:
            store = self._stores[giver]
            owed_all: list[Undelivered | UndeliveredPermits] = [
                *await store.undelivered(),
                *await store.undelivered_permits(),
            ]
            for owed in owed_all:
                if owed.peer not in self._stores:
                    log.warning("budget move %s names no cell %r", owed.transfer_id, owed.peer)
                    continue
                if isinstance(owed, UndeliveredPermits):
                    await self._deliver_permits(giver, owed)
                else:
                    await self._deliver(giver, owed)
                count += 1
        return count

    async def lead(self) -> bool:
        """Does this process rebalance now? With a leader lock, only while it
        holds it (taken when free)."""
        if self._leader is None:
            return True
        return self._leader.held or await self._leader.try_acquire()

    def start(self) -> None:
        """Run a round every interval in the background until `stop`."""
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="llmquota-slice-rebalancer")

    async def _run(self) -> None:
        while True:
            try:
                if await self.lead():
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
        if self._leader is not None:
            await self._leader.release()
