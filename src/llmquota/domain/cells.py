"""Where a tenant lives among K cells, and what share of a shared limit each cell holds.

A deployment of cells (`llmquota migrate --cells K`, docs/scaling.md) keeps
each tenant, with all its rows, in one cell, so that every decision about it
is one statement on one node. Every process that reaches the cells (the
library, the service, the CLI) must place a tenant in the same cell, now and
after a restart, whatever the Python version: so the placement is a fixed
hash of the name (CRC-32 of its UTF-8), never Python's `hash()`, which is
salted per process.

A limit no tenant owns (the global layer, a provider ceiling) is split into
K slices, one per cell, by the rule the sharded global layer already uses (`lq_shard_share` in
sql/global_layer.sql): slice k holds total // K, plus one while k is below
total mod K. The slices sum to the total, so the cells together never admit
more than one layer would; a cell whose slice is dry refuses while another
still has room (the price of never crossing the total; docs/scaling.md).
"""

from __future__ import annotations

import dataclasses
import zlib
from collections.abc import Mapping, Sequence

from llmquota.domain.errors import InvalidRequest
from llmquota.domain.plans import Ceiling, StoredCeiling
from llmquota.domain.policy import Policy

__all__ = [
    "SPLIT_LIMITS",
    "at_capacity",
    "ceiling_slice_of",
    "cell_of",
    "slice_of",
    "sliced_bodies",
    "summed",
    "summed_ceilings",
    "whole_ceilings",
]

# The limits of a shared policy or ceiling that are split over the cells.
SPLIT_LIMITS = (
    "tokens_per_minute",
    "token_burst",
    "requests_per_minute",
    "request_burst",
    "max_in_flight",
)


def cell_of(tenant: str, cells: int) -> int:
    """The cell (1 .. `cells`) that holds `tenant`."""
    return zlib.crc32(tenant.encode("utf-8")) % cells + 1


def _share(total: int | None, cell: int, cells: int) -> int | None:
    if total is None:
        return None
    return total // cells + (1 if cell - 1 < total % cells else 0)


def _slices(limits: dict[str, int | None], cell: int, cells: int) -> dict[str, int | None]:
    """Cell `cell`'s share of each limit; every limit set must be at least
    `cells`: a slice of 0 would refuse everything in its cell, which is not
    the limit asked for (InvalidRequest otherwise)."""
    too_small = sorted(
        name for name, value in limits.items() if value is not None and value < cells
    )
    if too_small:
        raise InvalidRequest(
            f"{', '.join(too_small)} must be at least the number of cells ({cells}) "
            "to be split over them"
        )
    return {name: _share(value, cell, cells) for name, value in limits.items()}


def slice_of(policy: Policy, cell: int, cells: int) -> Policy:
    """Cell `cell`'s slice (1-based) of a shared `policy` split over `cells`."""
    p = policy.resolved()
    limits = {name: getattr(p, name) for name in SPLIT_LIMITS}
    return p.model_copy(update=_slices(limits, cell, cells))


def ceiling_slice_of(ceiling: Ceiling, cell: int, cells: int) -> Ceiling:
    """Cell `cell`'s slice of a provider ceiling split over `cells`: its rates,
    bursts (a burst left out is a minute of its rate, as on one database) and
    in-flight bound. The shedding ladder and the alerts are fractions, so each
    slice keeps them, of its own burst."""
    limits = {
        "tokens_per_minute": ceiling.tokens_per_minute,
        "token_burst": ceiling.effective_token_burst,
        "requests_per_minute": ceiling.requests_per_minute,
        "request_burst": ceiling.effective_request_burst,
        "max_in_flight": ceiling.max_in_flight,
    }
    return ceiling.model_copy(update=_slices(limits, cell, cells))


def sliced_bodies(body: dict[str, object], cells: int) -> list[dict[str, object]]:
    """Each cell's body (cell 1 first) of a write of a shared limit over the
    API, a whole body or a merge patch: every limit it sets is split as
    `slice_of` splits it, anything else goes as it is. A burst left out stays
    out (each cell's default is a minute of its slice of the rate, and those
    add up to a minute of the rate). A limit that is not a whole number goes
    whole: every cell refuses it as one database would."""
    limits: dict[str, int | None] = {}
    for name in SPLIT_LIMITS:
        value = body.get(name)
        if isinstance(value, float) and value.is_integer():
            value = int(value)  # 2.0 is the whole number 2 to the API, and so to its split
        if isinstance(value, int) and not isinstance(value, bool):
            limits[name] = value
    return [{**body, **_slices(limits, cell, cells)} for cell in range(1, cells + 1)]


def summed(answers: list[dict[str, object]]) -> dict[str, object]:
    """A shared limit as the API shows it over cells: the first cell's answer
    with each split limit and each balance the sum of the cells' (a limit
    some cell lacks is shown as the first cell shows it), and a ceiling's
    utilization worked out again from the sums."""
    whole = dict(answers[0])
    for name in (*SPLIT_LIMITS, *_BALANCES):
        values = [answer.get(name) for answer in answers]
        if all(isinstance(v, int) and not isinstance(v, bool) for v in values):
            whole[name] = sum(v for v in values if isinstance(v, int))
    burst, remaining = whole.get("token_burst"), whole.get("remaining_tokens")
    if "utilization" in whole and isinstance(burst, int) and isinstance(remaining, int) and burst:
        whole["utilization"] = round(1.0 - remaining / burst, 6)
    return whole


def summed_ceilings(answers: list[dict[str, object]]) -> dict[str, object]:
    """The ceilings listing over cells: each of the first cell's ceilings
    summed with the same-named ceiling of every other cell (while a write is
    under way a cell may lack one: then the cells that hold it are summed)."""
    by_name: list[dict[str, dict[str, object]]] = []
    for answer in answers:
        items = answer.get("ceilings")
        named = items if isinstance(items, list) else []
        by_name.append({str(c.get("ceiling")): c for c in named if isinstance(c, dict)})
    whole = [summed([cells[name] for cells in by_name if name in cells]) for name in by_name[0]]
    return {**answers[0], "ceilings": whole}


# What a ceiling's answer says of its balances now, also held per cell.
_BALANCES = ("remaining_tokens", "remaining_requests", "in_flight")


def whole_ceilings(
    per_cell: Sequence[Sequence[StoredCeiling]],
    in_transit: Sequence[Mapping[str, tuple[float, float]]] = (),
) -> list[StoredCeiling]:
    """The first cell's ceilings, each added up with its slices in the other
    cells (limits, balances, calls in flight): a ceiling as one database would
    hold it, for its alerts (admin/ceiling_alerts.py). `in_transit`: per cell,
    by ceiling, the (tokens, requests) it sent another cell that the receiver
    has not confirmed (the rebalancer's moves): room that is in neither
    slice's balance meanwhile, counted with its sender, the sum never past
    the whole capacity. Each slice's bucket
    counts with the capacity it has (a burst, else a minute of refill), so
    slices written apart (a write under way) still add up. Read at the latest
    of the cells' clocks; a cell that lacks a ceiling adds nothing to it."""
    if not per_cell:
        return []
    named = [{stored.name: stored for stored in cell} for cell in per_cell]
    moving = [*in_transit, *([{}] * (len(per_cell) - len(in_transit)))]
    whole = []
    for first in per_cell[0]:
        held = [(k, cell[first.name]) for k, cell in enumerate(named) if first.name in cell]
        slices = [s for _k, s in held]
        limits = {
            name: sum(getattr(s.ceiling, name) for s in slices)
            for name in SPLIT_LIMITS
            if all(getattr(s.ceiling, name) is not None for s in slices)
        }
        for burst, effective in (("token_burst", "effective_token_burst"),
                                 ("request_burst", "effective_request_burst")):  # fmt: skip
            capacities = [getattr(s.ceiling, effective) for s in slices]
            if all(c is not None for c in capacities):
                limits[burst] = sum(c for c in capacities if c is not None)
        sent = [moving[k].get(first.name, (0.0, 0.0)) for k, _s in held]
        read = [s.read_at for s in slices if s.read_at is not None]
        ceiling = first.ceiling.model_copy(update=limits)
        tokens = _sum_of([*(s.tokens for s in slices), *(t for t, _r in sent)])
        requests = _sum_of([*(s.requests for s in slices), *(r for _t, r in sent)])
        whole.append(
            StoredCeiling(
                name=first.name,
                ceiling=ceiling,
                policy_version=first.policy_version,
                tokens=_at_most(tokens, ceiling.effective_token_burst),
                requests=_at_most(requests, ceiling.effective_request_burst),
                in_flight=sum(s.in_flight for s in slices),
                read_at=max(read) if len(read) == len(slices) else None,
                estimated=any(s.estimated for s in slices),
            )
        )
    return whole


def at_capacity(last: StoredCeiling) -> StoredCeiling:
    """A slice whose cell does not answer: as much room as it can hold (its
    capacity, as last read; a credit is clamped at it), nothing in flight.
    Whatever the cell admitted meanwhile, or the rebalancer moved into it, it
    holds no more, so a whole added up with it has a utilization at most the
    truth: `estimated`."""
    ceiling = last.ceiling
    return dataclasses.replace(
        last,
        tokens=_full(last.tokens, ceiling.effective_token_burst),
        requests=_full(last.requests, ceiling.effective_request_burst),
        in_flight=0,
        estimated=True,
    )


def _full(balance: float | None, capacity: int | None) -> float | None:
    return balance if balance is None or capacity is None else float(capacity)


def _sum_of(values: list[float | None]) -> float | None:
    """The sum, or None when any is None (a limit the ceiling does not have)."""
    return None if any(v is None for v in values) else sum(v for v in values if v is not None)


def _at_most(room: float | None, capacity: int | None) -> float | None:
    """Room counted twice (a move read with both cells) never past the capacity."""
    return room if room is None or capacity is None else min(room, float(capacity))
