"""A provider ceiling's alerts over cells: its slices read and added up.

Over cells (docs/scaling.md) each cell holds a slice of every ceiling, and a
detector per cell saw its slice's utilization: up to K episodes and alerts
for one crossing, and an alert for a slice that filled while the ceiling had
room (the rebalancer moves room to where the traffic is, so a busy cell's
slice runs full by design). So a cell's own service runs no detector, and
one per process of the front (and `llmquota sweep --loop` at the database's
DSN) reads every cell's slices, adds them up and records episodes and
alerts in the first cell, whose delivery loop sends them (webhooks are
written to every cell whole). The record statement's guarded upsert writes
each crossing once, however many processes watch.

The rebalancer moves room between the slices while they are read (debit the
sender, credit the receiver, confirm: three statements):

- A move sent and not yet confirmed is counted with its sender, read after
  the sender's slice: a read of the receiver before the credit and of the
  sender after the debit still counts it. Only for IN_TRANSIT_SECONDS after
  this process first saw it: a move stranded longer (a round cut short and
  no rebalancer since) is room neither slice can admit from, as the
  ceiling's admissions see it.
- A whole move credited and confirmed between the reads of two cells hides
  its room from one read. So each bucket's room is the larger of this read
  and the one before it (a second read at once when there is none, or the
  ceiling was written since): a crossing must show in two reads in a row.
- Room counted twice (a slice read before a debit, its move after) only
  delays an alert, by two reads at most; the sum never exceeds the
  ceiling's capacity.

A cell that does not answer counts its slices, as last read, full (their
capacity: no credit takes one past it, so whatever it admitted or the
rebalancer moved into it meanwhile, it holds no more), with its moves as
last seen: the whole is then `estimated`, its utilization at most the
truth, and only crossings certain without the cell are recorded
(domain/ceiling_alerts.py). A ceiling the away cell's last read lacked is
not known whole meanwhile and samples nothing. A cell never read has
nothing to estimate by: the read fails, as before.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence

from llmquota.admin.ceiling_alerts import CeilingAlertDetector, ceiling_alerts_running
from llmquota.config import Settings
from llmquota.domain.cells import at_capacity, whole_ceilings
from llmquota.domain.errors import StoreUnavailable
from llmquota.domain.plans import StoredCeiling
from llmquota.store.alerts import AlertStore
from llmquota.store.budget_moves import Undelivered
from llmquota.store.cells import cell_served_at
from llmquota.store.store import Store

__all__ = ["CeilingsOverCells", "ceiling_alerts_of_the_deployment", "ceiling_alerts_over_cells"]

log = logging.getLogger("llmquota.alerts")

# Unconfirmed moves read per cell (the rebalancer delivers them again before
# it moves more: there are few).
MAX_MOVES_READ = 1_000
# How long a move not yet confirmed counts as room: the race it covers lasts
# milliseconds; a rebalancer round is REBALANCE_SECONDS (1 s).
IN_TRANSIT_SECONDS = 5.0


class CeilingsOverCells:
    """Every ceiling as the cells hold it together, for its alerts."""

    def __init__(
        self, stores: Sequence[Store], monotonic: Callable[[], float] = time.monotonic
    ) -> None:
        self._stores = list(stores)
        self._monotonic = monotonic
        self._last: dict[str, StoredCeiling] = {}
        self._first_seen: dict[uuid.UUID, float] = {}  # unconfirmed moves
        # Per cell (by index): its slices and unconfirmed moves as last read,
        # and which cells did not answer the last read.
        self._slices: dict[int, dict[str, StoredCeiling]] = {}
        self._moves: dict[int, list[Undelivered]] = {}
        self._away: set[int] = set()

    async def get_ceilings(
        self, name: str | None = None, *, deadline_seconds: float | None = None
    ) -> list[StoredCeiling]:
        """Each ceiling (or the one named) summed over the cells, its room the
        larger of two reads in a row."""
        whole = await self._read(name, deadline_seconds)
        last = self._last
        if any(not _comparable(c, last.get(c.name)) for c in whole):
            last = {c.name: c for c in whole}
            whole = await self._read(name, deadline_seconds)
        self._last = {c.name: c for c in whole}
        return self._unknown_while_away([_roomier(c, last.get(c.name)) for c in whole])

    async def _read(self, name: str | None, deadline_seconds: float | None) -> list[StoredCeiling]:
        """One read of every cell: its slices, then its moves not yet confirmed;
        a cell that does not answer, as last read, its slices full."""
        now = self._monotonic()
        per_cell: list[list[StoredCeiling] | None] = []
        in_transit, seen = [], {}
        for k, store in enumerate(self._stores):
            try:
                slices = await store.catalog.get_ceilings(name, deadline_seconds=deadline_seconds)
                self._moves[k] = await store.budget_moves.undelivered(MAX_MOVES_READ)
            except StoreUnavailable as exc:
                if k not in self._slices:
                    raise  # never read: nothing to estimate it by
                self._cell_away(k, exc)
                per_cell.append(None)
            else:
                self._cell_back(k, name, slices)
                per_cell.append(slices)
            sent: dict[str, tuple[float, float]] = {}
            for move in self._moves.get(k, []):
                seen[move.transfer_id] = self._first_seen.get(move.transfer_id, now)
                if move.ceiling is not None and now - seen[move.transfer_id] <= IN_TRANSIT_SECONDS:
                    tokens, requests = sent.get(move.ceiling, (0.0, 0.0))
                    sent[move.ceiling] = (tokens + move.tokens, requests + move.requests)
            in_transit.append(sent)
        self._first_seen = seen
        return whole_ceilings(self._estimated(per_cell, name), in_transit)

    def _cell_away(self, k: int, exc: StoreUnavailable) -> None:
        if k not in self._away:
            self._away.add(k)
            log.warning(
                "ceiling alerts: cell %d does not answer (%s); its slices count as full, and "
                "only crossings certain without it are recorded",
                k + 1,
                exc,
            )

    def _cell_back(self, k: int, name: str | None, slices: list[StoredCeiling]) -> None:
        if k in self._away:
            self._away.discard(k)
            log.info("ceiling alerts: cell %d answers again", k + 1)
        known = {} if name is None else dict(self._slices.get(k, {}))
        known.pop(name or "", None)
        self._slices[k] = known | {s.name: s for s in slices}

    def _estimated(
        self, per_cell: list[list[StoredCeiling] | None], name: str | None
    ) -> list[list[StoredCeiling]]:
        """Each away cell's slices as last read, at their capacity."""
        return [
            cell
            if cell is not None
            else [
                at_capacity(last)
                for last in self._slices[k].values()
                if name is None or last.name == name
            ]
            for k, cell in enumerate(per_cell)
        ]

    def _unknown_while_away(self, whole: list[StoredCeiling]) -> list[StoredCeiling]:
        """While a cell is away, a ceiling its last read lacked has no known
        whole (its slice there has no capacity to count): no balances, so no
        samples, and `estimated`, so its episodes' states are kept."""
        if not self._away:
            return whole
        known = set.intersection(*(set(self._slices[k]) for k in self._away))
        return [
            c
            if c.name in known
            else dataclasses.replace(c, tokens=None, requests=None, estimated=True)
            for c in whole
        ]


def _comparable(now: StoredCeiling, before: StoredCeiling | None) -> bool:
    """Whether `before` is a read of the same ceiling as written now."""
    return before is not None and before.ceiling == now.ceiling


def _roomier(now: StoredCeiling, before: StoredCeiling | None) -> StoredCeiling:
    """`now` with each bucket's room the larger of its own and `before`'s."""
    if before is None or not _comparable(now, before):  # (checked here for the type checker)
        return now
    return dataclasses.replace(
        now,
        tokens=_larger(now.tokens, before.tokens),
        requests=_larger(now.requests, before.requests),
    )


def _larger(a: float | None, b: float | None) -> float | None:
    return a if b is None or (a is not None and a >= b) else b


def ceiling_alerts_over_cells(
    stores: Sequence[Store], settings: Settings
) -> contextlib.AbstractAsyncContextManager[CeilingAlertDetector | None]:
    """One detector over the ceilings of every cell added up, recording in the
    first cell; each cell's own service runs none."""
    alerts = AlertStore(stores[0].pool, deadline_seconds=settings.statement_timeout_ms / 1000 + 1)
    return ceiling_alerts_running(CeilingsOverCells(stores), alerts, settings)


@contextlib.asynccontextmanager
async def ceiling_alerts_of_the_deployment(
    store: Store, alerts: AlertStore, settings: Settings, dsn: str
) -> AsyncIterator[CeilingAlertDetector | None]:
    """A service's detector (ceiling_alerts_running), unless the service is
    one cell's: the cell its DSN's search_path names, or its session's schema
    (a search_path set in `options` or on the role)."""
    try:
        cell = await cell_served_at(dsn)
    except StoreUnavailable:
        cell = None if store.cell_index is None else f"cell_{store.cell_index + 1}"
    if cell is not None and settings.ceiling_alerts:
        log.info(
            "ceiling alerts: %s holds a slice of each ceiling; they are watched whole by the "
            "service over cells or `llmquota sweep --loop` at the database's DSN",
            cell,
        )
        yield None
        return
    async with ceiling_alerts_running(store.catalog, alerts, settings) as detector:
        yield detector
